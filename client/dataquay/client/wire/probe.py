"""A quick look at a daemon's unix socket before the first call.

gRPC waits out the whole connect deadline for a socket that is missing or
refuses; the daemon's own answer to those is known at once, so the client
says so at once, and keeps the deadline for a daemon that is only slow.
"""

from __future__ import annotations

import errno
import os
import socket
import time

from dataquay.client.errors import DaemonUnavailableError
from dataquay.client.wire.memfd import daemon_socket_of

_HINT = "; is `dataquay serve` running there, and does DATAQUAY_ADDR name its socket?"

#: Seconds a missing socket is given to appear (a daemon that is starting).
SOCKET_APPEAR_S = 1.0


def probe_daemon_socket(address: str, timeout: float) -> None:
    """Raises at once where ``address`` is a unix socket that is missing or refuses.

    Raises:
        DaemonUnavailableError: no socket at the path after a short moment,
            or the socket refused the connection (no daemon behind it).
    """
    path = daemon_socket_of(address)
    if path is None:
        return
    end = time.monotonic() + min(SOCKET_APPEAR_S, timeout)
    while True:
        try:
            os.stat(path)
            break
        except FileNotFoundError:
            if time.monotonic() >= end:
                raise DaemonUnavailableError(f"no dataquay daemon: no socket at {path}" + _HINT) from None
            time.sleep(0.05)
        except OSError:
            return  # not ours to look at (a folder we may not enter): the call itself says why
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(min(SOCKET_APPEAR_S, timeout))
        try:
            probe.connect(path)
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                raise DaemonUnavailableError(f"no dataquay daemon: connection refused at {path}" + _HINT) from None
