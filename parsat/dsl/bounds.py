"""Every number a user gives parsat on the command line or to the API, with its one bound.

One number can ask for unbounded work or break a library far from where it
was typed: `run --collective-timeout inf` ended in an OverflowError inside
`datetime.timedelta`, `calibrate --size 100000` asked each rank for a
terabyte, `--steps 10**12` would train for ever. So each such number has a
bound here, checked before any work starts (before a proof is looked up, a
rank is spawned or a file is written), and the message says the bound in
the user's terms: "--steps must be a whole number from 1 to 1,000,000, got
10000000000". The CLI and the Python API call the same `check`, so both
refuse the same values with the same words; the table is also the list of
what `benchmarks/hostile_inputs.py` tries.

Bounds that belong to a data format stay with its reader (graph shapes and
machine fields: `ir.validate`; rule literals: `dsl.parser`), and the search
bounds `--devices` itself (`search.request`). The
bounds of `--limit` are here, checked by the runner (`egraph.runner.check_limits`,
which every path to a search passes).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

WEEK_S = 7 * 24 * 3600.0
DAY_S = 24 * 3600.0


class BoundError(ValueError):
    """A number outside its bound; the message names the flag, the bound and the value."""


def figure(value: float) -> str:
    """A bound as people read it: 1,000,000 and 604,800, 0.5 as it is."""
    if float(value).is_integer() and abs(value) < 1e18:
        return f"{int(value):,}"
    return f"{value:g}"


def _given(value) -> str:
    """The value refused, shortened: a 5,000-digit integer is shown by its length."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 400:
        return f"a whole number of about {int(value.bit_length() * 0.30103):,} digits"
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text):,} characters)"


@dataclass(frozen=True)
class Bound:
    """`low` to `high` (inclusive, or exclusive at `low` when `above`), whole numbers only when `whole`."""

    flag: str
    low: float
    high: float
    whole: bool = True
    unit: str = ""          # "seconds", "ranks": said after the range
    above: bool = False     # low itself is refused (a timeout of 0)

    def describe(self) -> str:
        if self.high >= sys.float_info.max:
            return "a finite number"
        kind = "a whole number" if self.whole else "a number"
        unit = f" {self.unit}" if self.unit else ""
        if self.above and self.low == 0:
            return f"a positive number{' of' + unit if unit else ''}, at most {figure(self.high)}"
        if self.above:
            return f"{kind}{unit} more than {figure(self.low)} and at most {figure(self.high)}"
        return f"{kind} from {figure(self.low)} to {figure(self.high)}{unit}"

    def check(self, value):
        """`value` when it is inside the bound; BoundError otherwise (NaN, infinity and booleans included)."""
        number = not isinstance(value, bool) and isinstance(value, int if self.whole else (int, float))
        inside = number and not (isinstance(value, float) and math.isnan(value)) and (
            (value > self.low if self.above else value >= self.low) and value <= self.high)
        if not inside:
            raise BoundError(f"{self.flag} must be {self.describe()}, got {_given(value)}")
        return value


def _table() -> dict[tuple[str, str], Bound]:
    """Each bound's figure is the most a user can mean, not the most parsat can take: a week for a timeout, a
    billion steps, a calibration --size of 4,096 (about 9 GiB a rank in float64, its buffers included)."""
    seconds = dict(whole=False, unit="seconds", above=True)
    rows = {
        ("run", "--nproc"): Bound("--nproc", 1, 1 << 20),
        ("run", "--steps"): Bound("--steps", 1, 1_000_000_000),   # the job is bounded by --timeout too
        ("run", "--seed"): Bound("--seed", 0, 2 ** 32 - 1),
        ("run", "--lr"): Bound("--lr", -sys.float_info.max, sys.float_info.max, whole=False),
        ("run", "--timeout"): Bound("--timeout", 0, WEEK_S, **seconds),
        ("run", "--collective-timeout"): Bound("--collective-timeout", 0, WEEK_S, **seconds),
        ("calibrate", "--nproc"): Bound("--nproc", 2, 256),
        ("calibrate", "--size"): Bound("--size", 16, 4096),
        ("calibrate", "--repeats"): Bound("--repeats", 1, 1000),
        ("calibrate", "--comm-elements"): Bound("--comm-elements", 1, 1 << 26),
        ("calibrate", "--window"): Bound("--window", 0, 60, whole=False, unit="seconds"),
        ("calibrate", "--timeout"): Bound("--timeout", 0, WEEK_S, **seconds),
        ("verify", "--timeout"): Bound("--timeout", 0, DAY_S, **seconds),
        ("verify", "--jobs"): Bound("--jobs", 1, 256),
        ("verify", "--rlimit"): Bound("--rlimit", 1, 2 ** 32 - 1),   # z3's rlimit is an unsigned 32-bit count
        ("generate", "--max-ops"): Bound("--max-ops", 1, 8),
        ("generate", "--degrees"): Bound("--degrees", 2, 64),
        ("generate", "--max-rank"): Bound("--max-rank", 1, 6),
        ("generate", "--max-terms"): Bound("--max-terms", 1, 10_000_000),
        ("generate", "--jobs"): Bound("--jobs", 1, 256),
        ("generate", "--seconds"): Bound("--seconds", 0, WEEK_S, **seconds),
        ("generate", "--verify-timeout"): Bound("--verify-timeout", 0, DAY_S, **seconds),
        ("show", "--timeout"): Bound("--timeout", 0, DAY_S, **seconds),
        # the search's budgets (`egraph.runner.check_limits`; `seconds` left at infinity is off, unchecked)
        ("optimize", "--limit iterations"): Bound("--limit iterations", 1, 10_000),
        ("optimize", "--limit generations"): Bound("--limit generations", 0, 1_000),
        ("optimize", "--limit enodes"): Bound("--limit enodes", 1, 100_000_000),
        ("optimize", "--limit matches"): Bound("--limit matches", 1, 100_000_000),
        ("optimize", "--limit ilp_nodes"): Bound("--limit ilp_nodes", 1, 10_000_000),
        ("optimize", "--limit seconds"): Bound("--limit seconds", 0, WEEK_S, **seconds),
        ("optimize", "--limit ilp_seconds"): Bound("--limit ilp_seconds", 0, WEEK_S, whole=False, unit="seconds"),
        # a step of more micro-batches than 2**20 has no use (each is a graph run); checked before the rules load
        ("optimize", "--microbatches"): Bound("--microbatches", 1, 1 << 20),
    }
    return rows


SIZE_LIMITS = {"blocks": 10_000, "experts": 10_000}
"""A built-in example's sizes that count repeated parts (each builds that many layers); every other size is a
dimension, at most 2**53 (a tensor's elements are bounded by the same figure, `ir.validate.MAX_ELEMENTS`)."""


def size_bound(key: str) -> Bound:
    """The bound of an example's size `key` (`--set KEY=VALUE`, `sizes=` in the API)."""
    return Bound(f"size {key}", 1, SIZE_LIMITS.get(key, 2 ** 53))


BOUNDS = _table()
"""(command, flag) -> its bound."""


def bound(command: str, flag: str) -> Bound:
    """The bound of `flag` of `command` (`bound("run", "--steps")`)."""
    return BOUNDS[(command, flag)]


def check(command: str, flag: str, value):
    """`value` checked against its bound (BoundError, a ValueError, with the bound in the message)."""
    return BOUNDS[(command, flag)].check(value)


def check_all(command: str, values: dict[str, object]) -> None:
    """Every flag's value of `values` (flag -> value; None: not given) against its bound, in order."""
    for flag, value in values.items():
        if value is None:
            continue
        for item in (value if isinstance(value, (list, tuple)) else (value,)):
            check(command, flag, item)
