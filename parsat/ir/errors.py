"""The errors every stage shares: each says, for the user, why a graph, machine or plan cannot be used, or why
no plan could be made.

They live apart from the classes that raise them so that the readers
(`graph`, `machine`, `plan`) and the structural checks they call first
(`validate`) share them without importing each other, and so that the
e-graph layer and the search raise the same `OptimizeError` without the
one importing the other.
"""

from __future__ import annotations


class GraphError(Exception):
    """A graph that cannot be optimized; the message names the node."""


class MachineError(Exception):
    """A machine description that cannot be used."""


class PlanError(Exception):
    """A plan file that cannot be read."""


class OptimizeError(Exception):
    """Why `optimize` could not make a plan; the message is for the user."""


class OutOfTime(GraphError, OptimizeError):
    """A graph not built before the `--limit seconds` deadline: a GraphError to whoever reads graphs, and an
    OptimizeError to the search, where a later micro-batch count's graph cut short leaves the counts already
    searched standing (their best plan comes back) instead of ending the call."""


class DoesNotFit(OptimizeError):
    """No plan fits in memory: the smallest needs `needed_bytes` per device of `capacity_bytes`."""

    def __init__(self, message: str, needed_bytes: int, capacity_bytes: int):
        super().__init__(message)
        self.needed_bytes, self.capacity_bytes = needed_bytes, capacity_bytes


class CannotWin(Exception):
    """A pipeline stage search stopped before simulating or pricing anything: every stage plan it could return is
    priced, in every cut and schedule, at or above the step its pipelined plans must beat (`StageFit.bar_s`), so
    no plan it could lead to can be chosen. Not an OptimizeError: no plan is missing, none could win."""

    def __init__(self, floor_s: float, bar_s: float):
        super().__init__(f"every stage plan's pipelined step is at least {floor_s * 1e3:.3f} ms, not below the "
                         f"{bar_s * 1e3:.3f} ms to beat (+{(floor_s / bar_s - 1) * 100:.1f}%)")
        self.floor_s, self.bar_s = floor_s, bar_s
