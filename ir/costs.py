"""What a PCG node and a whole plan cost per training step: the records the plan JSON carries.

The cost model (`saturate/cost.py`) fills them; the plan (`plan.py`)
writes them (`nodes[i].cost`, `totals`, `baselines.NAME`); the backend
compares its measurements with them. Their meaning, and the conventions
behind every number, are in docs/plan-schema.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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
    sync_s: float = 0.0        # the part of comm_s that synchronises gradients (once per step)
    activation_bytes: int = 0  # the part of memory_bytes one micro-batch keeps alive (the rest: weights' state)

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s + self.comm_s

    def to_dict(self, dtype_bytes: int) -> dict:
        return {"time_s": self.time_s, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "optimizer_s": self.optimizer_s, "comm_s": self.comm_s, "comm_elements": self.comm_elements,
                "comm_bytes": self.comm_elements * dtype_bytes, "grad_sync_elements": self.grad_sync_elements,
                "memory_bytes": self.memory_bytes, "flops": self.flops, "collectives": list(self.collectives)}

    def per_step(self, microbatches: int) -> "NodeCost":
        """This node's cost per step when a step runs `microbatches` micro-batches (gradient accumulation).

        The cost model prices a node at the micro-batch's shapes. Its
        compute and the collectives on activations run once per micro-batch;
        the gradient synchronisation and the optimizer once per step (the
        gradients of the micro-batches accumulate locally first, as with
        DDP's `no_sync`); memory is what one micro-batch keeps alive plus the
        weights' state, since a micro-batch's activations are freed by its
        backward before the next begins.
        """
        m = microbatches
        if m == 1:
            return self
        activation_elements = self.comm_elements - self.grad_sync_elements
        return replace(self, forward_s=self.forward_s * m, backward_s=self.backward_s * m,
                       comm_s=(self.comm_s - self.sync_s) * m + self.sync_s,
                       comm_elements=activation_elements * m + self.grad_sync_elements, flops=self.flops * m)


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
