#!/usr/bin/env bash
# Slurm Prolog (slurm.conf: Prolog=/opt/dataquay/deploy/slurm/prolog.sh,
# PrologFlags=Alloc): on every node of the allocation, start a dataquay daemon
# as the job's user; on the first node, start the job's directory first and,
# once every node's daemon is up, stage the job's dataset on all of them.
#
# The dataset comes from DATAQUAY_DATASET (and DATAQUAY_DATASET_ROOT to
# register it), set in /etc/dataquay/slurm.env or by the job comment:
#   sbatch --comment "dataquay.dataset=imagenet dataquay.dataset_root=/lustre/imagenet/train dataquay.seed=42" ...
# Trainers find the daemon through the env file this script writes (see
# task-prolog.sh and README.md). Running it twice starts nothing twice.
#
# A daemon that cannot start fails the prolog (Slurm then drains the node); a
# dataset that cannot be staged is logged and the job runs, reading what is
# not cached from the PFS, unless DATAQUAY_STAGE_REQUIRED=1.
set -euo pipefail
# Slurm runs prologs with no search path.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}
export PATH

here=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
# shellcheck source=SCRIPTDIR/dataquay-slurm.sh
. "$here/dataquay-slurm.sh"

# Registers the dataset at the directory unless it is there already. The
# daemon's list is the directory's: a dataset the daemon keeps in the user's
# cache from an earlier job is not in it until registered again, and then it
# keeps its cache when its files have not changed.
register_dataset() {
    local name=$1 root=$2
    if "${DQ_AS_USER[@]}" "$DQ_BIN" dataset ls --addr "$DQ_SOCKET" 2>/dev/null |
        awk -v name="$name" 'NR > 1 && $1 == name { found = 1 } END { exit !found }'; then
        dq_log "dataset $name is registered already"
        return 0
    fi
    local args=(dataset add "$name" "$root" --addr "$DQ_SOCKET")
    if [[ -n "${DATAQUAY_DATASET_FORMAT:-}" ]]; then
        args+=(--format "$DATAQUAY_DATASET_FORMAT")
    fi
    dq_log "registering dataset $name from $root"
    "${DQ_AS_USER[@]}" "$DQ_BIN" "${args[@]}" >>"$DQ_LOG_FILE" 2>&1
}

# Waits until the directory lists every node of the allocation as up.
wait_for_nodes() {
    local directory=$1 waited=0 up node missing
    while :; do
        up=$("${DQ_AS_USER[@]}" "$DQ_BIN" status --directory "$directory" 2>/dev/null |
            awk '/^NODE +STATE/ { table = 1; next } table && NF == 0 { exit } table && $2 == "up" { print $1 }' ||
            true)
        missing=()
        for node in "${DQ_NODES[@]}"; do
            grep -qxF -- "$node" <<<"$up" || missing+=("$node")
        done
        [[ ${#missing[@]} -eq 0 ]] && return 0
        if ((waited >= DQ_NODES_TIMEOUT)); then
            dq_log "error: nodes not up at the directory after ${DQ_NODES_TIMEOUT}s: ${missing[*]}"
            return 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
}

stage_dataset() {
    local directory=$1 name=$2
    if [[ -n "${DATAQUAY_DATASET_ROOT:-}" ]]; then
        register_dataset "$name" "$DATAQUAY_DATASET_ROOT" || {
            dq_log "error: cannot register dataset $name from $DATAQUAY_DATASET_ROOT (see $DQ_LOG_FILE)"
            return 1
        }
    fi
    wait_for_nodes "$directory" || return 1
    local nodes
    nodes=$(IFS=,; printf '%s' "${DQ_NODES[*]}")
    local args=(stage "$name" --job "$DQ_JOB" --nodes "$nodes" --directory "$directory" --quiet)
    local setting flag
    for setting in seed mode q partition batch_size ranks_per_node; do
        flag=DATAQUAY_${setting^^}
        if [[ -n "${!flag:-}" ]]; then
            args+=("--${setting//_/-}" "${!flag}")
        fi
    done
    dq_log "staging $name for job $DQ_JOB on ${#DQ_NODES[@]} nodes"
    if ! "${DQ_AS_USER[@]}" "$DQ_BIN" "${args[@]}" >>"$DQ_LOG_FILE" 2>&1; then
        dq_log "error: staging $name failed: $(tail -n 1 "$DQ_LOG_FILE")"
        return 1
    fi
    dq_log "staged $name: $(tail -n 1 "$DQ_LOG_FILE")"
}

# One HTTP/1.0 GET of 127.0.0.1:PORT/PATH with bash alone (nodes need not
# have curl); prints the body of a 200 answer. The directory answers at once
# and closes the connection.
http_get() {
    local port=$1 path=$2 reply
    { exec 6<>"/dev/tcp/127.0.0.1/$port"; } 2>/dev/null || return 1
    printf 'GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' "$path" >&6
    reply=$(timeout 10 cat <&6) || true
    exec 6<&-
    [[ "${reply%%$'\r\n'*}" == "HTTP/1.1 200 "* ]] || return 1
    printf '%s\n' "${reply#*$'\r\n\r\n'}"
}

# The target groups of the directory's /sd answer ($1) that name a node of the
# allocation, as a JSON list in the allocation's order. Anyone who holds the
# cluster token may register a node at the job's directory; root must not
# publish such a node's address for Prometheus to scrape. A group counts only
# in the form the directory writes it (Python's json.dumps escapes every quote
# inside a name or an address, so no registered string can forge one).
allocation_targets() {
    local sd=$1 node name pattern group groups=()
    for node in "${DQ_NODES[@]}"; do
        [[ "$node" =~ ^[A-Za-z0-9._-]+$ ]] || continue
        name=${node//./\\.}
        pattern='\{"targets": \["[][A-Za-z0-9.:_-]+"\], "labels": \{"dataquay_node": "'"$name"'", '
        pattern+='"dataquay_state": "(up|down)"\}\}'
        group=$(grep -oE -- "$pattern" <<<"$sd" | head -n 1 || true)
        [[ -z "$group" ]] || groups+=("$group")
    done
    local IFS=,
    printf '[%s]\n' "${groups[*]}"
}

# Prometheus' file_sd target files for this job in DATAQUAY_PROMETHEUS_SD_DIR:
# slurm-<id>.daemons.json, the directory's /sd of the allocation's nodes once
# every one is up (each daemon's metrics endpoint with dataquay_node and
# dataquay_state), and slurm-<id>.directory.json, the directory's own. Each target carries
# slurm_job=<id>. The epilog removes both, so a finished job's targets go
# with it; a daemon that dies during the job stays a target with up 0.
write_prometheus_targets() {
    local directory=$1 sd_dir=$DATAQUAY_PROMETHEUS_SD_DIR http_port sd
    # Root writes there: nobody else may swap a file for a link.
    if [[ -L "$sd_dir" || ! -d "$sd_dir" || ! -O "$sd_dir" ]] || (($(stat -c '8#%a' "$sd_dir") & 8#022)); then
        dq_log "error: DATAQUAY_PROMETHEUS_SD_DIR=$sd_dir must be a directory of uid $(id -u), writable by nobody else"
        return 1
    fi
    wait_for_nodes "$directory" || return 1
    http_port=$(dq_json_field "$DQ_DIRECTORY_READY" http_port)
    sd=$(http_get "$http_port" /sd) || { dq_log "error: no /sd answer from the directory"; return 1; }
    sd=$(allocation_targets "$sd")
    sd=${sd//\"labels\": \{/\"labels\": \{\"slurm_job\": \"$SLURM_JOB_ID\", }
    dq_publish "$sd_dir/slurm-$SLURM_JOB_ID.daemons.json" "$sd"
    dq_publish "$sd_dir/slurm-$SLURM_JOB_ID.directory.json" \
        "[{\"targets\": [\"$DQ_FIRST:$http_port\"], \"labels\": {\"slurm_job\": \"$SLURM_JOB_ID\"}}]"
    dq_log "Prometheus targets in $sd_dir/slurm-$SLURM_JOB_ID.{daemons,directory}.json"
}

# The node token file of the job's servers: the site's when it names one,
# else one for this job that the job's user writes into the job's directory
# (mode 0600), derived from the cluster token and the job id so that every
# node of the allocation writes the same without a shared file system. The
# daemons run as the job's user, who thus holds both tokens (single tenant);
# the trainers' env file names only the cluster token.
node_token_file() {
    if [[ -n "${DATAQUAY_NODE_TOKEN_FILE:-}" ]]; then
        printf '%s\n' "$DATAQUAY_NODE_TOKEN_FILE"
        return 0
    fi
    # shellcheck disable=SC2016 # expanded by sh
    "${DQ_AS_USER[@]}" sh -c 'umask 077; t=$(cat "$2") && [ -n "$t" ] &&
        printf "%s\ndataquay node token of job %s\n" "$t" "$3" | sha256sum | cut -d " " -f 1 >"$1.tmp" &&
        mv -f "$1.tmp" "$1"' node-token \
        "$DQ_JOB_DIR/node-token" "$DATAQUAY_TOKEN_FILE" "$SLURM_JOB_ID" ||
        dq_die "cannot derive the job's node token from $DATAQUAY_TOKEN_FILE"
    printf '%s\n' "$DQ_JOB_DIR/node-token"
}

# The trainers' settings, written by the job's user into the job's directory.
write_env_file() {
    local directory=$1 var content
    content=$(
        printf '# dataquay for Slurm job %s on %s; source with: set -a; . %q; set +a\n' \
            "$SLURM_JOB_ID" "$DQ_NODE" "$DQ_ENV_FILE"
        printf 'DATAQUAY_ADDR=%q\n' "$DQ_SOCKET"
        printf 'DATAQUAY_DIRECTORY=%q\n' "$directory"
        printf 'DATAQUAY_JOB=%q\n' "$DQ_JOB"
        for var in DATAQUAY_TOKEN_FILE DATAQUAY_DATASET DATAQUAY_SEED DATAQUAY_MODE DATAQUAY_Q; do
            if [[ -n "${!var:-}" ]]; then
                printf '%s=%q\n' "$var" "${!var}"
            fi
        done
    )
    # shellcheck disable=SC2016 # expanded by sh
    "${DQ_AS_USER[@]}" sh -c 'cat >"$1.tmp" && mv -f "$1.tmp" "$1"' write-env "$DQ_ENV_FILE" <<<"$content"
}

main() {
    dq_setup prolog
    dq_comment_settings
    dq_own_dir "$DQ_BASE"
    dq_own_dir "$DQ_LOG_DIR"
    dq_own_dir "$DQ_BASE/users"
    dq_own_dir "$DQ_USER_DIR"
    # One prolog at a time per job and node.
    exec 8>"$DQ_JOB_LOCK"
    flock -w 600 8 || dq_die "another $DQ_SCRIPT of the job holds $DQ_JOB_LOCK"

    dq_user_dir "$DQ_JOB_DIR"

    # The cluster token, when the site names one (a file the job's user can
    # read, the same on every node); the CLI calls below read the variable.
    # The servers hold the node token too, which the trainers' env file never
    # names.
    local token=() node_token
    if [[ -n "${DATAQUAY_TOKEN_FILE:-}" ]]; then
        node_token=$(node_token_file)
        token=(--token-file "$DATAQUAY_TOKEN_FILE" --node-token-file "$node_token")
    fi

    local directory cache state holder
    if [[ "$DQ_NODE" == "$DQ_FIRST" ]]; then
        dq_start directory "$DQ_DIRECTORY_READY" "$DQ_DIRECTORY_PID" "$DQ_LOG_DIR/job-$SLURM_JOB_ID.directory.log" \
            directory --listen "$DQ_DIRECTORY_LISTEN" --state-dir "$DQ_JOB_DIR/directory" \
            --http-port "${DATAQUAY_DIRECTORY_HTTP_PORT:-0}" "${token[@]}"
        directory=$(dq_json_field "$DQ_DIRECTORY_READY" tcp)
        [[ -n "$directory" ]] || dq_die "no address in $DQ_DIRECTORY_READY"
    else
        [[ "${DQ_DIRECTORY_LISTEN##*:}" != 0 ]] ||
            dq_die "DATAQUAY_DIRECTORY_LISTEN=$DQ_DIRECTORY_LISTEN: other nodes need a fixed port"
        directory=$DQ_FIRST:${DQ_DIRECTORY_LISTEN##*:}
    fi

    # The user's cache, unless another of the user's jobs on this node holds
    # it. The lock is held until the daemon serves: one daemon per cache, and
    # a job starting beside this one sees this one's claim with its daemon.
    exec 7>"$DQ_USER_DIR/.lock"
    flock -w 600 7 || dq_die "another job holds $DQ_USER_DIR/.lock"
    holder=$(dq_cache_holder)
    if [[ -z "$holder" || "$holder" == "$SLURM_JOB_ID" ]]; then
        printf '%s\n' "$SLURM_JOB_ID" >"$DQ_CLAIM"
        cache=$DQ_USER_DIR/cache
        state=$DQ_USER_DIR/state
        dq_user_dir "$cache"
        dq_user_dir "$state"
    else
        dq_log "job $holder holds $DQ_USER_DIR/cache: this job gets a private cache"
        cache=$DQ_JOB_DIR/cache
        state=$DQ_JOB_DIR/state
    fi
    dq_start daemon "$DQ_DAEMON_READY" "$DQ_DAEMON_PID" "$DQ_LOG_DIR/job-$SLURM_JOB_ID.daemon.log" \
        serve --socket "$DQ_SOCKET" --listen "${DATAQUAY_LISTEN:-0.0.0.0:0}" \
        --metrics-port "${DATAQUAY_METRICS_PORT:-0}" --cache-dir "$cache" --state-dir "$state" \
        --node-name "$DQ_NODE" --directory "$directory" "${token[@]}"
    flock -u 7
    write_env_file "$directory"

    # Before staging, so that Prometheus follows it.
    if [[ "$DQ_NODE" == "$DQ_FIRST" && -n "${DATAQUAY_PROMETHEUS_SD_DIR:-}" ]]; then
        write_prometheus_targets "$directory" || dq_log "error: Prometheus will not find job $SLURM_JOB_ID"
    fi
    if [[ "$DQ_NODE" == "$DQ_FIRST" && -n "${DATAQUAY_DATASET:-}" ]]; then
        if ! stage_dataset "$directory" "$DATAQUAY_DATASET" && [[ "${DATAQUAY_STAGE_REQUIRED:-0}" == 1 ]]; then
            exit 1
        fi
    fi
}

main "$@"
