"""The search's one deadline: the safety valves of a whole `optimize` call, `--limit seconds` and Ctrl-C.

The search is bounded by work (`egraph.runner.Limits`), so by default the
deadline is infinitely far and nothing here changes a plan. When a caller
sets `--limit seconds`, one call's several micro-batch counts and pipeline
stage plans (each a saturation per device mesh, extractions and baselines)
each get a part of the time left (`part`), never their own copy of the
whole limit, so the answer comes back within the limit (past it only by
the work that always finishes: a search that has started returns a plan,
by extraction's greedy passes). Ctrl-C (`interrupt`) spends the deadline at
once for every part of the call: the searches under way end with what they
have, no further one starts, and the best plan found so far comes back.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

from parsat.egraph.runner import Limits

SEARCH_SECONDS = 1.0   # the least time worth starting one more search in


@dataclass(frozen=True)
class Deadline:
    """A deadline (`time.perf_counter()`), and the limits that fit in what is left of it."""

    at: float
    limits_given: Limits
    interrupted: threading.Event = field(default_factory=threading.Event, compare=False)   # Ctrl-C, shared by
    #                                                                   every part of the call's deadline

    def interrupt(self) -> None:
        """Ctrl-C: from now on every search of the call does the least work and the best plan comes back."""
        self.interrupted.set()

    def within(self, seconds: float) -> "Deadline":
        """A deadline `seconds` from now, inside this one's call (its interrupt shared)."""
        return replace(self, at=time.perf_counter() + seconds)

    @classmethod
    def starting_now(cls, limits: Limits) -> "Deadline":
        return cls(time.perf_counter() + limits.seconds, limits)

    @property
    def left(self) -> float:
        """Seconds left (0 once passed or interrupted)."""
        return 0.0 if self.interrupted.is_set() else max(0.0, self.at - time.perf_counter())

    @property
    def spent(self) -> bool:
        """Too little time left to start another search in (`SEARCH_SECONDS`): building the graph and compiling
        the rules alone take about that."""
        return self.left < SEARCH_SECONDS

    def why_spent(self) -> str:
        """What ended the call's time: Ctrl-C or the time limit."""
        if self.interrupted.is_set():
            return "interrupted (Ctrl-C)"
        return f"--limit seconds={self.limits_given.seconds:g} reached"

    def part(self, share: float) -> "Deadline":
        """A deadline `share` of the time left from now (one search among several that share this one)."""
        now = time.perf_counter()
        return replace(self, at=now + max(0.0, self.at - now) * min(1.0, share))

    def pause(self, seconds: float) -> "Deadline":
        """The same deadline, `seconds` later: time spent on what the limit does not count."""
        return replace(self, at=self.at + seconds)

    def limits(self, share: float = 1.0) -> Limits | None:
        """The given limits with `seconds` (and the ILP's) cut to `share` of the time left; None if none is."""
        left = (self.at - time.perf_counter()) * share
        if left <= 0 or self.interrupted.is_set():
            return None
        given = self.limits_given
        return replace(given, seconds=left, ilp_seconds=min(given.ilp_seconds, left))

    def greedy(self) -> Limits:
        """No time left: extraction's greedy passes only (they always give a plan)."""
        return replace(self.limits_given, ilp_seconds=0)

    def remaining(self, share: float = 1.0) -> Limits:
        """`limits(share)`, or with no time left the least work: saturation stops at once, extraction greedy."""
        return self.limits(share) or replace(self.greedy(), seconds=1e-9)
