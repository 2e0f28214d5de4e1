#!/usr/bin/env bash
# Slurm TaskProlog (slurm.conf: TaskProlog=/opt/dataquay/deploy/slurm/task-prolog.sh):
# runs as the job's user before every task and hands it the env file
# prolog.sh wrote (DATAQUAY_ADDR, DATAQUAY_DIRECTORY, DATAQUAY_JOB,
# DATAQUAY_TOKEN_FILE, ...):
# Slurm sets each "export NAME=value" line this prints in the task's
# environment. Prints nothing when the node runs no dataquay daemon.
set -euo pipefail
# Slurm runs prologs with no search path.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}
export PATH

here=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
# shellcheck source=SCRIPTDIR/dataquay-slurm.sh
. "$here/dataquay-slurm.sh"

main() {
    dq_setup task-prolog
    [[ -r "$DQ_ENV_FILE" ]] || return 0
    (
        set -a
        # shellcheck source=/dev/null
        . "$DQ_ENV_FILE"
        set +a
        for var in $(compgen -v DATAQUAY_); do
            case $var in
            DATAQUAY_ADDR | DATAQUAY_DIRECTORY | DATAQUAY_JOB | DATAQUAY_TOKEN_FILE | DATAQUAY_DATASET | \
                DATAQUAY_SEED | DATAQUAY_MODE | DATAQUAY_Q)
                printf 'export %s=%s\n' "$var" "${!var}"
                ;;
            esac
        done
    )
}

main "$@"
