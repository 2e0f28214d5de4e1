"""Human-readable sizes, rates and durations for flags and config values.

K, M, G, T and KiB..TiB are powers of 1024 (as in Slurm's --mem); KB, MB, GB and
TB are powers of 1000. A bare number is bytes. Durations take ms, s, m, h or d;
a bare number is seconds.
"""

from __future__ import annotations

import math
import re

from dataquay.client.units import format_bytes as format_bytes  # re-exported: the server formats with it
from dataquay.server.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(i?b?)|b?)\s*$", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|)\s*$")
_SECONDS = {"ms": 0.001, "s": 1.0, "": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

SIZE_EXPECTED = "expected a size like 200G or 512MiB"
DURATION_EXPECTED = "expected a duration like 2s, 500ms or 5m"


class QuantityError(ConfigError):
    """A size or a duration that does not parse.

    Keeps what was expected apart from the message, so that a config file can
    report it next to the key and the value as written there.
    """

    def __init__(self, what: str, text: str, expected: str) -> None:
        super().__init__(f"bad {what} {text!r}: {expected}")
        self.expected = expected


def parse_size(text: str, what: str = "size") -> int:
    """Bytes in ``text`` ("200G", "512MiB", "1.5TB", "4096")."""
    match = _SIZE.match(str(text))
    if not match:
        raise QuantityError(what, text, SIZE_EXPECTED)
    number, prefix, suffix = match.groups()
    if prefix is None:
        return int(float(number))
    decimal = suffix.lower() == "b"
    base = 1000 if decimal else 1024
    return int(float(number) * base ** _POWERS[prefix.lower()])


def parse_duration(text: str, what: str = "duration") -> float:
    """Seconds in ``text`` ("2s", "500ms", "5m", "1h", "7d", "3")."""
    match = _DURATION.match(str(text))
    if not match:
        raise QuantityError(what, text, DURATION_EXPECTED)
    return float(match.group(1)) * _SECONDS[match.group(2)]


def format_duration(seconds: float) -> str:
    """``seconds`` in its two largest units, as an idle time is read in a
    table ("42s", "5m3s", "2h15m", "3d4h"); fractions of a second are dropped."""
    whole = max(0, int(seconds))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes}m"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def size_flag(n: int) -> str:
    """``n`` bytes as a size flag takes it ("18M", "1.3G"), rounded up so that
    a capacity advised with it is never short of ``n``."""
    for unit, power in (("K", 1), ("M", 2), ("G", 3), ("T", 4)):
        value = n / 1024**power
        if value < 1024 or unit == "T":
            break
    if value >= 10:
        return f"{math.ceil(value)}{unit}"
    return f"{math.ceil(value * 10) / 10:g}{unit}"
