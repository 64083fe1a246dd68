"""How large a graph may get, and until when it may be built: the search's limits, applied before it starts.

A graph too large for the e-graph (`--limit enodes`) or too slow to build
within `--limit seconds` (a 749k-node JSON file, `--set blocks=10000`)
is refused while it is read or built, naming the limit, instead of being
built for minutes and then saturated no further than its first iteration.
The e-graph starts with one e-node per tensor (leaf or operator), so a
graph with more tensors than `enodes` could not even be loaded.

`--limit seconds` also bounds the tensors themselves: building a graph,
loading it into the e-graph, stamping, pricing and simulating its plan all
cost time in proportion to its tensors, and the work after a search
always finishes (a plan comes back), so a graph larger than the limit
can pay for (`TENSORS_PER_SECOND`) is refused up front, by its count
alone: the same graph and limit are refused on any machine, and with no
seconds limit nothing here reads the clock.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from parsat.ir.errors import GraphError, OutOfTime

TENSORS_PER_SECOND = 2_000
"""The most tensors a graph may have per second of `--limit seconds` (at least `LEAST_TENSORS`): a
400,001-tensor stack took over 40 s on a loaded 2-core box to build, stamp, price and simulate after its
3-block search (loading it into egglog took 0.2 ms a tensor then, about 0.05 ms since `egraph.loading`)."""
LEAST_TENSORS = 4_096   # a small graph is never refused by the rate: it builds and loads in well under a second


@dataclass(frozen=True)
class GraphBudget:
    """At most `tensors` leaves and operators, built before `deadline` (a `time.perf_counter()` value)."""

    tensors: int | None = None
    deadline: float | None = None
    seconds: float | None = None       # the limit `deadline` came from, for the message

    def check_count(self, count: int, what: str = "the graph", growing: bool = False) -> None:
        """GraphError when `count` tensors are more than the e-graph may hold, or more than the seconds limit
        can pay for (`growing`: and more may come)."""
        if self.tensors is not None and count > self.tensors:
            many = f"more than {self.tensors:,}" if growing else f"{count:,}"
            raise GraphError(f"{what} has {many} tensors (inputs, weights and operators), more than the e-graph "
                             f"may hold under --limit enodes={self.tensors}: it would stop before its first "
                             "rewrite; raise the limit to optimize it")
        most = self.most_tensors
        if most is not None and count > most:
            many = f"more than {most:,}" if growing else f"{count:,}"
            raise GraphError(f"{what} has {many} tensors (inputs, weights and operators), more than "
                             f"--limit seconds={self.seconds:g} can build, search and price (at most {most:,}: "
                             f"{TENSORS_PER_SECOND:,} a second); raise the limit, or leave it off")

    @property
    def most_tensors(self) -> int | None:
        """The tensors `seconds` pays for (`TENSORS_PER_SECOND`); None without a finite seconds limit."""
        if self.seconds is None or not math.isfinite(self.seconds):
            return None
        return max(LEAST_TENSORS, int(self.seconds * TENSORS_PER_SECOND))

    def check_time(self, count: int) -> None:
        """OutOfTime (a GraphError) when the deadline has passed while `count` tensors were built."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise OutOfTime(f"building the graph ran past --limit seconds={self.seconds:g} ({count:,} tensors "
                             "built); raise the limit to optimize it")
