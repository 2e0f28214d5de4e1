# shellcheck shell=bash disable=SC2034  # the DQ_* settings are for the scripts that source this
# What prolog.sh and epilog.sh share: settings, the allocation's nodes, where
# each job keeps its files, and starting and stopping a server by its ready
# file. Sourced, never run.
#
# Layout under DATAQUAY_SLURM_DIR (put it on the node-local SSD). The scripts
# run as root: everything they write lives in directories only root can
# change, and the job's user owns only what its servers write.
#   users/<user>/                  root's: locks, pid files, the cache claim
#   users/<user>/cache, state      the user's cache, kept for the user's next
#                                  job on this node unless DATAQUAY_WIPE=1
#   users/<user>/job-<id>/         the user's: socket, ready files, env file,
#                                  the directory's state on the first node,
#                                  and a private cache when another job of the
#                                  user holds users/<user>/cache
# Logs go to DATAQUAY_SLURM_LOG_DIR/job-<id>.{log,daemon.log,directory.log}.

# Job settings a job comment may set ("dataquay.dataset=imagenet dataquay.seed=42"),
# as the variables of the same name (DATAQUAY_DATASET, DATAQUAY_SEED). Nothing
# else: the comment is the user's, and these scripts run as root.
DQ_COMMENT_KEYS=(dataset dataset_root dataset_format seed mode q partition batch_size ranks_per_node wipe)

dq_log() {
    local line
    line="$(date -u +%Y-%m-%dT%H:%M:%SZ) job ${SLURM_JOB_ID:-?} ${DQ_NODE:-?} ${DQ_SCRIPT:-dataquay}: $*"
    printf '%s\n' "$line" >&2
    if [[ -n "${DQ_LOG_FILE:-}" ]]; then
        printf '%s\n' "$line" >>"$DQ_LOG_FILE" 2>/dev/null || true
    fi
}

dq_die() {
    dq_log "error: $*"
    exit 1
}

# The allocation's node list as slurmd hands it to a prolog or epilog, in
# DQ_NODELIST, and the variable it came from in DQ_NODELIST_VAR:
# newer Slurm releases set SLURM_JOB_NODELIST, 22.05 only SLURM_NODELIST.
dq_nodelist() {
    local var
    for var in SLURM_JOB_NODELIST SLURM_NODELIST; do
        if [[ -n "${!var:-}" ]]; then
            DQ_NODELIST_VAR=$var
            DQ_NODELIST=${!var}
            return 0
        fi
    done
    dq_die "neither SLURM_JOB_NODELIST nor SLURM_NODELIST is set"
}

# The allocation's node names in Slurm's order (rank order). Only a bracketed
# list (gpu[01-04]) needs scontrol, which needs the node's slurm.conf.
dq_nodes() {
    dq_nodelist
    if [[ "$DQ_NODELIST" != *"["* ]]; then
        tr ',' '\n' <<<"$DQ_NODELIST" | sed '/^$/d'
    elif ! command -v scontrol >/dev/null 2>&1; then
        dq_die "cannot expand $DQ_NODELIST_VAR=$DQ_NODELIST without scontrol"
    elif ! scontrol show hostnames "$DQ_NODELIST" 2>/dev/null; then
        dq_die "scontrol cannot expand $DQ_NODELIST_VAR=$DQ_NODELIST"
    fi
}

# Sets DATAQUAY_<KEY> from "dataquay.<key>=value" words of the job comment,
# unless the variable is set already.
dq_comment_settings() {
    local comment=${SLURM_JOB_COMMENT:-}
    # slurmd 22.05 passes the job comment in SLURM_JOB_COMMENT; squeue only where it is unset.
    if [[ -z "${SLURM_JOB_COMMENT+set}" && -n "${SLURM_JOB_ID:-}" ]] && command -v squeue >/dev/null 2>&1; then
        comment=$(squeue --noheader --jobs "$SLURM_JOB_ID" --format %k 2>/dev/null || true)
    fi
    local words word key value allowed var
    read -ra words <<<"$comment"
    for word in "${words[@]}"; do
        [[ "$word" == dataquay.*=* ]] || continue
        key=${word#dataquay.}
        key=${key%%=*}
        value=${word#*=}
        for allowed in "${DQ_COMMENT_KEYS[@]}"; do
            if [[ "$key" == "$allowed" ]]; then
                var="DATAQUAY_${key^^}"
                if [[ -z "${!var:-}" ]]; then
                    printf -v "$var" '%s' "$value"
                    export "${var?}"
                fi
            fi
        done
    done
}

# Reads settings and fills in every DQ_* variable both scripts use.
dq_setup() {
    DQ_SCRIPT=$1
    local conf=${DATAQUAY_SLURM_CONF:-/etc/dataquay/slurm.env}
    if [[ -f "$conf" ]]; then
        # Exported: the servers read their settings (DATAQUAY_CACHE_SIZE, ...) from the environment.
        set -a
        # shellcheck source=/dev/null
        . "$conf"
        set +a
    fi
    [[ -n "${SLURM_JOB_ID:-}" ]] || dq_die "SLURM_JOB_ID is not set: run me as a Slurm Prolog or Epilog"
    [[ "$SLURM_JOB_ID" =~ ^[0-9]+$ ]] || dq_die "unexpected SLURM_JOB_ID=$SLURM_JOB_ID"
    DQ_BIN=${DATAQUAY_BIN:-dataquay}
    # The config file of the systemd units (/etc/dataquay/dataquay.toml) is not
    # for per-job servers: its token file, for one, is the dataquay user's.
    export DATAQUAY_CONFIG=${DATAQUAY_CONFIG:-/dev/null}
    DQ_BASE=${DATAQUAY_SLURM_DIR:-/var/tmp/dataquay}
    [[ "$DQ_BASE" == /?* ]] || dq_die "DATAQUAY_SLURM_DIR must be an absolute path other than /, not '$DQ_BASE'"
    DQ_LOG_DIR=${DATAQUAY_SLURM_LOG_DIR:-$DQ_BASE/log}
    DQ_NODE=${SLURMD_NODENAME:-$(hostname -s)}
    local nodes
    dq_nodelist
    nodes=$(dq_nodes)
    mapfile -t DQ_NODES <<<"$nodes"
    [[ -n "${DQ_NODES[0]}" ]] || dq_die "$DQ_NODELIST_VAR=$DQ_NODELIST names no node"
    DQ_FIRST=${DQ_NODES[0]}
    DQ_USER=${SLURM_JOB_USER:-$(id -un)}
    [[ "$DQ_USER" =~ ^[A-Za-z0-9_][A-Za-z0-9._-]*$ ]] || dq_die "unexpected user name $DQ_USER"
    DQ_UID=${SLURM_JOB_UID:-$(id -u "$DQ_USER")}
    DQ_GID=${SLURM_JOB_GID:-$(id -g "$DQ_USER")}
    DQ_USER_DIR=$DQ_BASE/users/$DQ_USER
    DQ_JOB_DIR=$DQ_USER_DIR/job-$SLURM_JOB_ID
    DQ_LOG_FILE=$DQ_LOG_DIR/job-$SLURM_JOB_ID.log
    DQ_JOB_LOCK=$DQ_USER_DIR/job-$SLURM_JOB_ID.lock
    DQ_DAEMON_READY=$DQ_JOB_DIR/daemon.ready.json
    DQ_DAEMON_PID=$DQ_USER_DIR/job-$SLURM_JOB_ID.daemon.pid
    DQ_DIRECTORY_READY=$DQ_JOB_DIR/directory.ready.json
    DQ_DIRECTORY_PID=$DQ_USER_DIR/job-$SLURM_JOB_ID.directory.pid
    DQ_SOCKET=${DATAQUAY_SOCKET:-$DQ_JOB_DIR/dataquay.sock}
    DQ_ENV_FILE=$DQ_JOB_DIR/dataquay.env
    DQ_CLAIM=$DQ_USER_DIR/cache.job
    DQ_JOB=${DATAQUAY_JOB:-slurm-$SLURM_JOB_ID}
    # One port per job, so that jobs whose first node is the same do not collide.
    DQ_DIRECTORY_LISTEN=${DATAQUAY_DIRECTORY_LISTEN:-0.0.0.0:$((20000 + SLURM_JOB_ID % 20000))}
    DQ_START_TIMEOUT=${DATAQUAY_START_TIMEOUT:-60}
    DQ_STOP_TIMEOUT=${DATAQUAY_STOP_TIMEOUT:-30}
    DQ_NODES_TIMEOUT=${DATAQUAY_NODES_TIMEOUT:-300}
    # Servers run as the job's user: they read the PFS with the user's
    # rights, and trainers share their uid (the shared-memory hand-off and the
    # read-only LMDB map both need that).
    DQ_AS_USER=()
    if [[ "$(id -u)" == 0 && "$DQ_UID" != 0 ]]; then
        DQ_AS_USER=(setpriv "--reuid=$DQ_UID" "--regid=$DQ_GID" --init-groups --)
    fi
}

# Creates a directory of this script's user (root), or checks the one there:
# not a link, not writable by anyone else, so nobody can swap what is in it.
dq_own_dir() {
    if [[ ! -e "$1" ]]; then
        install -d -m 0755 "$1"
    fi
    local mode
    mode=$(stat -c %a "$1")
    if [[ -L "$1" || ! -d "$1" || ! -O "$1" ]] || ((8#$mode & 8#022)); then
        dq_die "$1 must be a directory of uid $(id -u), writable by nobody else"
    fi
}

# Creates a directory for the job's user (mode 0700) in one of dq_own_dir's,
# or checks that the one there is a directory of that user.
dq_user_dir() {
    if [[ ! -e "$1" && ! -L "$1" ]]; then
        install -d -m 0700 -o "$DQ_UID" -g "$DQ_GID" "$1"
    fi
    if [[ -L "$1" || ! -d "$1" || "$(stat -c %u "$1")" != "$DQ_UID" ]]; then
        dq_die "$1 must be a directory of uid $DQ_UID"
    fi
}

# The value of a top-level "key" of a one-line JSON ready file.
dq_json_field() {
    sed -n -e "s/.*\"$2\": *\"\\([^\"]*\\)\".*/\\1/p" -e "t" -e "s/.*\"$2\": *\\([0-9][0-9]*\\).*/\\1/p" "$1"
}

# Whether the server of a ready file runs: the pid in PIDFILE, with the ready
# file's path on its command line (a reused pid is never taken for ours).
dq_running() {
    local ready=$1 pidfile=$2 pid
    [[ -f "$pidfile" ]] || return 1
    pid=$(<"$pidfile")
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [[ -r "/proc/$pid/cmdline" ]] || return 1
    grep -qzxF -- "$ready" "/proc/$pid/cmdline" 2>/dev/null
}

# Whether process PID exists and is not a zombie.
dq_alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ "${stat%% *}" != Z ]]
}

# Starts "dataquay ARGS... --ready-file READY" in a session of its own, as the
# job's user, unless it runs already; waits until it serves.
dq_start() {
    local what=$1 ready=$2 pidfile=$3 log=$4
    shift 4
    if dq_running "$ready" "$pidfile" && [[ -f "$ready" ]]; then
        dq_log "$what already running (pid $(<"$pidfile"))"
        return 0
    fi
    rm -f -- "$ready" "$pidfile"
    touch "$log"
    if [[ "$(id -u)" == 0 ]]; then
        chown "$DQ_UID:$DQ_GID" "$log"
    fi
    # Not the scripts' lock files (fds 7 and 8): a server holding them would
    # block the epilog and the next prolog.
    setsid "${DQ_AS_USER[@]}" "$DQ_BIN" "$@" --ready-file "$ready" </dev/null >>"$log" 2>&1 7>&- 8>&- &
    local pid=$!
    printf '%s\n' "$pid" >"$pidfile"
    local waited=0
    while [[ ! -f "$ready" ]]; do
        if ! dq_alive "$pid"; then
            dq_die "$what exited at start: $(tail -n 3 "$log" | tr '\n' ' ')"
        fi
        if ((waited >= DQ_START_TIMEOUT * 10)); then
            kill -KILL "$pid" 2>/dev/null || true
            dq_die "$what not ready after ${DQ_START_TIMEOUT}s: $(tail -n 3 "$log" | tr '\n' ' ')"
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
    dq_log "$what started (pid $pid), log $log"
}

# Writes CONTENT to PATH (mode 0644) by a rename, so a reader never sees half
# of it.
dq_publish() {
    local path=$1 content=$2
    printf '%s\n' "$content" >"$path.tmp"
    chmod 0644 "$path.tmp"
    mv -f -- "$path.tmp" "$path"
}

# SIGTERM, up to DQ_STOP_TIMEOUT seconds for a clean exit, then SIGKILL.
# Fails only if the process outlives SIGKILL.
dq_stop() {
    local what=$1 ready=$2 pidfile=$3 pid waited=0
    if ! dq_running "$ready" "$pidfile"; then
        rm -f -- "$pidfile"
        return 0
    fi
    pid=$(<"$pidfile")
    kill -TERM "$pid" 2>/dev/null || true
    while dq_running "$ready" "$pidfile" && ((waited < DQ_STOP_TIMEOUT * 10)); do
        sleep 0.1
        waited=$((waited + 1))
    done
    if dq_running "$ready" "$pidfile"; then
        dq_log "$what (pid $pid) still running after ${DQ_STOP_TIMEOUT}s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        waited=0
        while dq_running "$ready" "$pidfile" && ((waited < 50)); do
            sleep 0.1
            waited=$((waited + 1))
        done
        if dq_running "$ready" "$pidfile"; then
            dq_log "error: $what (pid $pid) survived SIGKILL"
            return 1
        fi
    fi
    dq_log "$what stopped (pid $pid)"
    rm -f -- "$pidfile"
}

# The job id that holds the user's shared cache, or nothing when it is free
# (never claimed, or claimed by a job whose daemon is gone).
dq_cache_holder() {
    local holder
    [[ -f "$DQ_CLAIM" ]] || return 0
    holder=$(<"$DQ_CLAIM")
    [[ "$holder" =~ ^[0-9]+$ ]] || return 0
    if [[ "$holder" == "$SLURM_JOB_ID" ]] ||
        dq_running "$DQ_USER_DIR/job-$holder/daemon.ready.json" "$DQ_USER_DIR/job-$holder.daemon.pid"; then
        printf '%s\n' "$holder"
    fi
}
