#!/usr/bin/env bash
# Downloads, for bench/offline_run.sh, the wheels of dataquay's dependencies
# (their whole closure, setuptools among them) for another machine's Python
# on x86-64 Linux: run it where pip reaches a package index.
#
#   bench/offline_wheels.sh DIR [PYTHON_VERSION]    # PYTHON_VERSION like 3.12; default this python3's
#
# Copy DIR beside the tree to the other machine; what that machine already
# has is installed again from DIR, into a temporary folder only.
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: bench/offline_wheels.sh DIR [PYTHON_VERSION]" >&2
    exit 2
fi
dir=$1
version=${2:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
cd "$(dirname "$0")/.."
platforms=()
for platform in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014; do
    platforms+=(--platform "${platform}_x86_64")
done
python3 -m pip download -q --only-binary=:all: --implementation cp --python-version "$version" \
    "${platforms[@]}" --dest "$dir" . setuptools
ls "$dir"
