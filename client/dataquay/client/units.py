"""Byte counts as people read them; shared by the client, its tools and the server."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 ("1.5 GiB")."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
