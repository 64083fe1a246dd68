"""The verifier's limits: work budgets decide a verdict, the wall clock only stops a runaway.

Same input, same answer: a verdict is a function of the rule, its operators
and the budgets, never of the machine's speed or load. So every stage is
bounded by counted work: the concrete search by its trial counts
(`core.SEARCH_TRIALS`, the cross-checks' `crosscheck.LARGE_TRIALS`), the
shrinker by its steps (each lowers the sum of sizes), and every z3 query by
z3's deterministic resource counter, `rlimit` (`DEFAULT_RLIMIT` per query).
Each rule is proved in a z3 context of its own (`prove.Solving`): z3's
work on a query depends on the terms the context already holds, so a
shared context would make a rule's count depend on which rules a worker
process verified before it.

The budget is per query, not per rule: z3 counts per `check`, the query
that ran out can be named in the verdict, and the default is simply the
most any one query of the library needs with a margin
(benchmarks/RESULTS-verify.md). A rule makes a bounded number of queries,
fixed by its text (rank assignments x goals x case splits), so its whole
work is bounded too.

`--timeout` stays as an outer safety valve only: when the wall clock
passes it, whatever stage is running raises `OutOfTime`, and the verdict is
UNKNOWN saying the wall clock cut it, never a verdict that a faster
machine would have reached differently (a shorter search, a skipped
cross-check, a counterexample shrunk less).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# The most z3 work units (`rlimit`) one query may use. The largest any query of rules/ (17,142) and
# tests/true_rules/ (171,174) needs was measured with `benchmarks/verify_rlimit.py` (benchmarks/
# RESULTS-verify.md): 10 million is 58x the largest, 580x the library's. A query that runs out of it has
# spent about 3 CPU seconds on the 2-core box, and ends its rule's verdict (UNKNOWN).
DEFAULT_RLIMIT = 10_000_000
# The wall-clock safety valve per rule (seconds). Far above what any rule needs under its budgets (the
# slowest rule of the library takes a few CPU seconds), so that it fires only for a runaway or a stalled
# machine, not because a loaded one is slow.
DEFAULT_TIMEOUT = 600.0


class OutOfTime(Exception):
    """The wall clock passed `--timeout` during `stage`: the verdict is UNKNOWN whatever the stage found."""

    def __init__(self, stage: str):
        super().__init__(stage)
        self.stage = stage


def check_deadline(deadline: float | None, stage: str) -> None:
    """Raise OutOfTime when `deadline` (a `time.monotonic()` value, None: none) has passed."""
    if deadline is not None and time.monotonic() > deadline:
        raise OutOfTime(stage)


@dataclass(frozen=True)
class WallClock:
    """One rule's safety valve: `timeout` seconds from `start` (`time.monotonic()`)."""

    timeout: float
    start: float = field(default_factory=lambda: time.monotonic())   # read when made, as `check` reads it

    @property
    def deadline(self) -> float:
        return self.start + self.timeout

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def check(self, stage: str) -> None:
        """Raise OutOfTime when the valve has closed."""
        check_deadline(self.deadline, stage)


_WALL_CLOCK = "timeout: the wall clock passed"


def wall_clock_reason(timeout: float, stage: str) -> str:
    """The reason of a verdict the wall clock cut: which valve, during what, and what to do."""
    return (f"{_WALL_CLOCK} --timeout {timeout:g} s during {stage}, so no verdict was reached "
            "(a safety valve, not a budget: the same rule on a faster or less loaded machine may finish; raise "
            "--timeout)")


def is_wall_clock(verdict) -> bool:
    """Whether the wall clock cut this verdict (an UNKNOWN that depends on the machine: never cached)."""
    return verdict.verdict == "UNKNOWN" and verdict.reason.startswith(_WALL_CLOCK)


def budget_reason(rlimit: int, what: str) -> str:
    """The reason of a verdict a z3 query's work budget ended: which budget, and how to raise it."""
    return (f"z3 ran out of its work budget while proving that {what}: the query needs more than "
            f"--rlimit {rlimit:,} units (z3's deterministic resource count, per query); raise --rlimit")
