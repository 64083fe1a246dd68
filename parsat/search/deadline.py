"""The search's one deadline: `--limit seconds` bounds a whole `optimize` call.

One call searches several micro-batch counts and, across nodes, several
pipeline stage plans; each is a saturation per device mesh, extractions
and baselines. Each of those gets a part of the time left (`part`), never
its own copy of the whole limit, so the answer comes back within the limit
(past it only by the work that always finishes: a search that has started
returns a plan, by extraction's greedy passes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from parsat.egraph.runner import Limits

SEARCH_SECONDS = 1.0   # the least time worth starting one more search in


@dataclass(frozen=True)
class Deadline:
    """A deadline (`time.perf_counter()`), and the limits that fit in what is left of it."""

    at: float
    limits_given: Limits

    @classmethod
    def starting_now(cls, limits: Limits) -> "Deadline":
        return cls(time.perf_counter() + limits.seconds, limits)

    @property
    def left(self) -> float:
        """Seconds left (0 once passed)."""
        return max(0.0, self.at - time.perf_counter())

    @property
    def spent(self) -> bool:
        """Too little time left to start another search in (`SEARCH_SECONDS`): building the graph and compiling
        the rules alone take about that."""
        return self.left < SEARCH_SECONDS

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
        if left <= 0:
            return None
        given = self.limits_given
        return replace(given, seconds=left, ilp_seconds=min(given.ilp_seconds, left))

    def greedy(self) -> Limits:
        """No time left: extraction's greedy passes only (they always give a plan)."""
        return replace(self.limits_given, ilp_seconds=0)

    def remaining(self, share: float = 1.0) -> Limits:
        """`limits(share)`, or with no time left the least work: saturation stops at once, extraction greedy."""
        return self.limits(share) or replace(self.greedy(), seconds=1e-9)
