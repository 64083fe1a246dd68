"""Times and byte counts as people read them: the one formatting every report of a plan shares."""

from __future__ import annotations


def fmt_time(seconds: float) -> str:
    """Seconds in the unit that shows the figure: s, ms or us."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def fmt_bytes(n: float) -> str:
    """Bytes in the largest binary unit they reach: GiB, MiB, KiB or B."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
