"""Times and byte counts as people read them: the one formatting every report of a plan and every message shares.

A message that compares two figures must show them so that they differ: a
tiny machine was told "needs 0.00 GiB per device, the device has 0.00 GiB".
`fmt_bytes_pair` shows each in its own unit, or both in one small enough.
"""

from __future__ import annotations

_UNITS = (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10))


def fmt_time(seconds: float) -> str:
    """Seconds in the unit that shows the figure: s, ms or us."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def fmt_bytes(n: float) -> str:
    """Bytes in the largest binary unit they reach: GiB, MiB, KiB or B."""
    for unit, size in _UNITS:
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_bytes_pair(a: float, b: float) -> tuple[str, str]:
    """Two byte counts that read differently whenever they differ: each in its own unit (`fmt_bytes`: 10.00
    MiB against 1000 B), or, where that shows them alike (80.00 GiB against 80.00 GiB), both in the next
    smaller unit in which they differ, down to exact bytes."""
    left, right = fmt_bytes(a), fmt_bytes(b)
    if left != right or a == b:
        return left, right
    for unit, size in _UNITS:
        left, right = f"{a / size:,.2f} {unit}", f"{b / size:,.2f} {unit}"
        if left != right and min(a, b) >= size:
            return left, right
    return f"{int(a):,} B", f"{int(b):,} B"
