#!/usr/bin/env bash
# Runs the fabric benchmarks (peer hits and the exchange against a raw TCP
# stream, then CPU seconds per GB by path) on a machine that has Python 3.11+
# and a C compiler but no package index: a bigger node than the one you
# develop on, where sender and receiver do not share two cores.
#
#   bench/offline_run.sh WHEELS OUT [SECONDS]
#
# WHEELS holds wheels of dataquay's dependencies for that machine's Python
# (bench/offline_wheels.sh downloads them), setuptools among them. The tree is
# built there, its C loops included, into a temporary folder; nothing is
# installed system-wide. Results (JSON) and logs land in OUT as each
# benchmark ends; each gets at most SECONDS (default 150), so that a slow
# machine still returns what finished. The exchange moves a quarter of
# 512 MiB per round here, four times the default: on a fast node the
# default's 32 MiB take a few tens of milliseconds.
set -euo pipefail

if [ $# -lt 2 ] || [ $# -gt 3 ]; then
    echo "usage: bench/offline_run.sh WHEELS OUT [SECONDS]" >&2
    exit 2
fi
if ! compgen -G "$1/*.whl" >/dev/null; then
    echo "offline_run.sh: no wheels in $1 (bench/offline_wheels.sh downloads them)" >&2
    exit 2
fi
wheels=$(realpath "$1")
mkdir -p "$2"
out=$(realpath "$2")
budget=${3:-150}
cd "$(dirname "$0")/.."

site=$(mktemp -d /tmp/dataquay-offline.XXXXXX)
trap 'rm -rf "$site"' EXIT
export PIP_ROOT_USER_ACTION=ignore PYTHONUNBUFFERED=1 BENCH_RESULTS=$out
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
export PYTHONPATH=$site
python3 -m pip wheel -q --no-index --no-deps --no-build-isolation --wheel-dir "$site/dist" . >"$out/build.log" 2>&1 ||
    { tail -n 30 "$out/build.log"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$site"/dist/dataquay-*.whl
python3 -c "
import sys; sys.path.insert(0, 'bench')
from common import machine
from dataquay.client.wire import record_loops
print(machine(), '| compiled loops:', record_loops.COMPILED)
" | tee "$out/machine.txt"

run() {  # name, then the command; its log and results land in OUT whatever its end
    local name=$1
    shift
    local started=$SECONDS
    timeout --signal=INT --kill-after=20 "$budget" "$@" >"$out/$name.log" 2>&1 || echo "$name: exit $?" | tee -a "$out/$name.log"
    echo "$name: $((SECONDS - started)) s"
    tail -n 6 "$out/$name.log"
}

BENCH_PARTS=peer BENCH_PASSES=6 run wire_peer python3 bench/experiments/wire.py
BENCH_PARTS=exchange BENCH_EXCHANGE_MIB=512 run wire_exchange python3 bench/experiments/wire.py
run cpu_per_gb python3 bench/cpu_per_gb.py --runs 2
