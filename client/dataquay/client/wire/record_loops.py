"""The per-sample loops of local hits and of framing and checking cache values: the C
extension ``_records`` where it was built, else the same loops in Python.

An install without a C compiler still works (setup.py marks the extension
optional), only slower (bench/record_loops.py); it says so once, at
the first import of a trainer and its DataLoader workers together.
"""

from __future__ import annotations

import logging

from dataquay.client.wire.notices import first_to_tell

log = logging.getLogger("dataquay.client")

try:
    from dataquay.client.wire._records import encode_value, payload_copies, payloads_into, sample_keys, values_intact

    COMPILED = True
except ImportError:
    from dataquay.client.wire._records_py import encode_value, payload_copies, payloads_into, sample_keys, values_intact

    COMPILED = False
    if first_to_tell("records not compiled"):
        log.warning(
            "dataquay's C extension (dataquay.client.wire._records) is not built, so local hits and cache values are "
            "handled in Python, at about half to three quarters of the compiled rate. Install a wheel, or "
            "reinstall with a C compiler and the Python headers."
        )

__all__ = ["COMPILED", "encode_value", "payload_copies", "payloads_into", "sample_keys", "values_intact"]
