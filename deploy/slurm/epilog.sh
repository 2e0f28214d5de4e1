#!/usr/bin/env bash
# Slurm Epilog (slurm.conf: Epilog=/opt/dataquay/deploy/slurm/epilog.sh): on
# every node of the allocation, stop the job's dataquay daemon (and, on the
# first node, its directory) and remove the job's files. The user's cache
# stays for their next job on this node unless DATAQUAY_WIPE=1 (or the job
# comment says dataquay.wipe=1). Running it twice, or after a prolog that
# started nothing, does nothing more.
#
# Fails only when a server outlives SIGKILL: Slurm then drains the node.
set -euo pipefail
# Slurm runs prologs with no search path.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}
export PATH

here=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
# shellcheck source=SCRIPTDIR/dataquay-slurm.sh
. "$here/dataquay-slurm.sh"

main() {
    dq_setup epilog
    dq_comment_settings
    if [[ ! -d "$DQ_JOB_DIR" && ! -f "$DQ_DAEMON_PID" && ! -f "$DQ_DIRECTORY_PID" ]]; then
        return 0
    fi
    dq_own_dir "$DQ_BASE"
    dq_own_dir "$DQ_BASE/users"
    dq_own_dir "$DQ_USER_DIR"
    exec 8>"$DQ_JOB_LOCK"
    flock -w 600 8 || dq_die "another $DQ_SCRIPT of the job holds $DQ_JOB_LOCK"

    local stopped=0
    dq_stop daemon "$DQ_DAEMON_READY" "$DQ_DAEMON_PID" || stopped=1
    if [[ "$DQ_NODE" == "$DQ_FIRST" ]]; then
        if [[ -n "${DATAQUAY_PROMETHEUS_SD_DIR:-}" ]]; then
            rm -f -- "$DATAQUAY_PROMETHEUS_SD_DIR/slurm-$SLURM_JOB_ID.daemons.json" \
                "$DATAQUAY_PROMETHEUS_SD_DIR/slurm-$SLURM_JOB_ID.directory.json"
        fi
        dq_stop directory "$DQ_DIRECTORY_READY" "$DQ_DIRECTORY_PID" || stopped=1
    fi
    if ((stopped != 0)); then
        dq_die "left $DQ_JOB_DIR in place: a server of the job still runs"
    fi

    exec 7>"$DQ_USER_DIR/.lock"
    flock -w 600 7 || dq_die "another job holds $DQ_USER_DIR/.lock"
    if [[ -f "$DQ_CLAIM" && "$(<"$DQ_CLAIM")" == "$SLURM_JOB_ID" ]]; then
        if [[ "${DATAQUAY_WIPE:-0}" == 1 ]]; then
            rm -rf -- "$DQ_USER_DIR/cache" "$DQ_USER_DIR/state"
            dq_log "wiped $DQ_USER_DIR/cache"
        fi
        rm -f -- "$DQ_CLAIM"
    fi
    flock -u 7
    rm -rf -- "$DQ_JOB_DIR"
    rm -f -- "$DQ_JOB_LOCK"
    dq_log "cleaned up"
}

main "$@"
