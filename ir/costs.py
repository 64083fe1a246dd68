"""What a PCG node and a whole plan cost per training step: the records the plan JSON carries.

The cost model (`saturate/cost.py`) fills them; the plan (`plan.py`)
writes them (`nodes[i].cost`, `totals`, `baselines.NAME`); the backend
compares its measurements with them. Their meaning, and the conventions
behind every number, are in docs/plan-schema.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from parsat.ir.machine import Machine


@dataclass(frozen=True)
class NodeCost:
    """What one node costs per training step (times in seconds)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    comm_s: float = 0.0
    comm_elements: int = 0
    grad_sync_elements: int = 0
    memory_bytes: int = 0
    flops: float = 0.0
    collectives: tuple[str, ...] = ()
    problems: tuple[str, ...] = field(default=(), compare=False)

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s + self.comm_s

    def to_dict(self, dtype_bytes: int) -> dict:
        return {"time_s": self.time_s, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "optimizer_s": self.optimizer_s, "comm_s": self.comm_s, "comm_elements": self.comm_elements,
                "comm_bytes": self.comm_elements * dtype_bytes, "grad_sync_elements": self.grad_sync_elements,
                "memory_bytes": self.memory_bytes, "flops": self.flops, "collectives": list(self.collectives)}


@dataclass(frozen=True)
class Totals:
    """A plan's totals: the `totals` / `baselines` objects of the plan JSON."""

    time_s: float
    comm_elements: int
    comm_bytes: int
    peak_memory_bytes: int
    grad_sync_elements: int
    compute_s: float
    comm_s: float

    def to_dict(self) -> dict:
        return {"time_s": self.time_s, "comm_elements": self.comm_elements, "comm_bytes": self.comm_bytes,
                "peak_memory_bytes": self.peak_memory_bytes, "grad_sync_elements": self.grad_sync_elements,
                "compute_s": self.compute_s, "comm_s": self.comm_s}


def totals(costs: Mapping[int, NodeCost] | Sequence[NodeCost], machine: Machine) -> Totals:
    values = list(costs.values()) if isinstance(costs, Mapping) else list(costs)
    comm = sum(c.comm_elements for c in values)
    return Totals(sum(c.time_s for c in values), comm, comm * machine.dtype_bytes,
                  sum(c.memory_bytes for c in values), sum(c.grad_sync_elements for c in values),
                  sum(c.forward_s + c.backward_s + c.optimizer_s for c in values),
                  sum(c.comm_s for c in values))
