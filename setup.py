"""The compiled parts: dataquay.client.wire._records, the per-sample loops of
local hits and the framing of cache values; dataquay.server._replies, the
receiving end of a peer read on the bulk path; and dataquay.server._coding,
the coded-shuffling planner's loops. Optional: where they cannot be built
(no C compiler, no Python headers) the install goes on without them and the
same loops run in Python (dataquay.client.wire.record_loops,
dataquay.server.node.peers.bulk.replies, dataquay.server._coding_py).

Everything else is declared in pyproject.toml; setuptools reads extension
modules from here (its pyproject.toml form is still experimental). xxHash is
vendored (client/third_party/xxhash) so that the C loop hashes exactly as the
xxhash package does, and, on x86, as fast: its run-time dispatch picks the
widest vector unit the node has.
"""

import re
import sysconfig

from setuptools import Extension, setup

XXHASH = "client/third_party/xxhash"
CODING = "server/dataquay/server/coding-c"
# Each extension that hashes compiles xxHash's run-time dispatch in: extensions share no objects.
hashing = []
macros = []
if re.search(r"x86_64|amd64|i[3-6]86", sysconfig.get_platform().lower()):
    hashing.append(f"{XXHASH}/xxh_x86dispatch.c")
    macros.append(("DATAQUAY_XXH_X86_DISPATCH", "1"))


def hashed(name: str, source: str) -> Extension:
    """An optional extension of one C file that hashes with the vendored xxHash."""
    return Extension(
        name,
        sources=[source, *hashing],
        include_dirs=[XXHASH],
        define_macros=macros,
        extra_compile_args=["-O3"],
        optional=True,
    )


setup(
    ext_modules=[
        hashed("dataquay.client.wire._records", "client/dataquay/client/wire/_records.c"),
        hashed("dataquay.server._replies", "server/dataquay/server/node/peers/bulk/replies.c"),
        Extension(
            "dataquay.server._coding",
            sources=[f"{CODING}/{name}.c" for name in ("module", "shared", "greedy", "packets", "tables", "dag")],
            include_dirs=[CODING],
            depends=[f"{CODING}/coding.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
