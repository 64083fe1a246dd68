"""The one statistic a step's time is told by, on both sides of `parsat run`'s comparison.

`parsat run` times each training step on every rank from a barrier (`RankContext.step_start`); a step
takes as long as its slowest rank, and the step's time is the median of those over the steps after the
first (`WARMUP_STEPS`: the first step allocates what later steps reuse), with the middle half of them as
its spread. `parsat calibrate` times each of its figures by the same protocol (`calibrate._timed`):
rounds that start at a barrier, each round's time the slowest rank's, the median over the rounds. So
the prediction and the measurement are the same statistic of the same kind of sample; a statistic
picked for one side alone (a mean over a window on one, a median on the other) would let a single
descheduled moment move one side and not the other. On a 2-core box shared with other jobs, one fresh
calibration's mean over a window priced a 2 KB all-reduce at 1.60 ms where the same calibration's
32 KB all-reduce took 0.68 ms (benchmarks/demo_step.md, 2026-12-06): a window caught by another job.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

WARMUP_STEPS = 1   # the steps left out before the median: the first step's allocations and first touches


@dataclass(frozen=True)
class Spread:
    """A sample's median and its middle half (lower and upper quartile), in seconds, and its size."""

    median_s: float
    low_s: float
    high_s: float
    count: int

    @property
    def relative_width(self) -> float:
        """The middle half's width over the median: how far apart the sample's typical values are."""
        return (self.high_s - self.low_s) / self.median_s if self.median_s > 0 else 0.0


def slowest_per_round(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Each round's (step's) time: the slowest rank's, round by round (every rank ran the same rounds)."""
    return [max(times) for times in zip(*per_rank)]


def steady(times: Sequence[float], warmup: int = WARMUP_STEPS) -> list[float]:
    """The steps after the warm-up (all of them when there are no more)."""
    return list(times[warmup:]) if len(times) > warmup else list(times)


def spread(times: Sequence[float]) -> Spread:
    """The median and quartiles of `times` (inclusive method: a sample of one is its own quartiles)."""
    if not times:
        raise ValueError("no times to summarise")
    if len(times) == 1:
        return Spread(times[0], times[0], times[0], 1)
    low, _median, high = statistics.quantiles(times, n=4, method="inclusive")
    return Spread(statistics.median(times), low, high, len(times))
