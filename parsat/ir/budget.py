"""How large a graph may get, and until when it may be built: the search's limits, applied before it starts.

A graph too large for the e-graph (`--limit enodes`) or too slow to build
within `--limit seconds` (a 749k-node JSON file, `--set blocks=10000`)
is refused while it is read or built, naming the limit, instead of being
built for minutes and then saturated no further than its first iteration.
The e-graph starts with one e-node per tensor (leaf or operator), so a
graph with more tensors than `enodes` could not even be loaded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from parsat.ir.errors import GraphError


@dataclass(frozen=True)
class GraphBudget:
    """At most `tensors` leaves and operators, built before `deadline` (a `time.perf_counter()` value)."""

    tensors: int | None = None
    deadline: float | None = None
    seconds: float | None = None       # the limit `deadline` came from, for the message

    def check_count(self, count: int, what: str = "the graph", growing: bool = False) -> None:
        """GraphError when `count` tensors are more than the e-graph may hold (`growing`: and more may come)."""
        if self.tensors is not None and count > self.tensors:
            many = f"more than {self.tensors:,}" if growing else f"{count:,}"
            raise GraphError(f"{what} has {many} tensors (inputs, weights and operators), more than the e-graph "
                             f"may hold under --limit enodes={self.tensors}: it would stop before its first "
                             "rewrite; raise the limit to optimize it")

    def check_time(self, count: int) -> None:
        """GraphError when the deadline has passed while `count` tensors were built."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise GraphError(f"building the graph ran past --limit seconds={self.seconds:g} ({count:,} tensors "
                             "built); raise the limit to optimize it")
