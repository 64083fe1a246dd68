"""What a PCG node and a whole plan cost per training step: the records the plan JSON carries.

The cost model (`parsat/cost/model.py`) fills them; the plan (`plan.py`)
writes them (`nodes[i].cost`, `totals`, `baselines.NAME`); the backend
compares its measurements with them. Their meaning, and the conventions
behind every number, are in docs/plan-schema.md.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Mapping, Sequence

import numpy as np

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
    activation_bytes: int = 0  # the part of memory_bytes one micro-batch keeps alive (the rest: weights' state)
    # A parallel operator on a weight's chain (`ir.pcg.pcg_roles`: a weight or a weight-piece read by parallel
    # operators only): its value is made once per step and its gradient reduced once per step, whatever the
    # micro-batch count, so none of its collectives repeat per micro-batch (`per_step`).
    weight_chain: bool = False
    accumulation_bytes: int = 0  # a gradient this node holds across a step's micro-batches (a gathered weight's)
    # Forward parts of comm_s and comm_elements: what activation recomputation runs again (`recomputed`).
    forward_comm_s: float = 0.0
    forward_comm_elements: int = 0
    # Part of memory_bytes alive only while the node's block is recomputed and differentiated (`recomputed`):
    # one block's at a time, so it neither repeats with the blocks a node stands for nor with micro-batches.
    transient_bytes: int = 0
    # Part of comm_s that reduces a weight's gradient (all-reduce, or ZeRO's reduce-scatter) and can run while
    # the last micro-batch's backward produces it, bucket by bucket (DDP; Megatron's overlap_grad_reduce): what a
    # pipeline stage overlaps with its last backward (`cost.pipeline`). Not ZeRO's all-gather after the update.
    grad_reduce_s: float = 0.0
    # A product's backward kernel for each operand's gradient alone, dispatch included, per micro-batch (not
    # scaled by `per_step` or `times`): what its input-gradient GEMM can hide of a re-gathered operand's second
    # all-gather (`cost.saved.regather_cover`); empty for anything that is not one product.
    input_grad_s: tuple[float, ...] = ()

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s + self.comm_s

    def to_dict(self, dtype_bytes: int) -> dict:
        return {"time_s": self.time_s, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "optimizer_s": self.optimizer_s, "comm_s": self.comm_s, "comm_elements": self.comm_elements,
                "comm_bytes": self.comm_elements * dtype_bytes, "grad_sync_elements": self.grad_sync_elements,
                "memory_bytes": self.memory_bytes, "flops": self.flops, "collectives": list(self.collectives)}

    @staticmethod
    def from_dict(data: Mapping) -> "NodeCost":
        """A node's `cost` object of a plan JSON (`to_dict`) read back: the figures it records (what only the
        search keeps, activation and accumulation bytes, the weight-chain flag, stays at its default)."""
        return NodeCost(float(data.get("forward_s", 0.0)), float(data.get("backward_s", 0.0)),
                        float(data.get("optimizer_s", 0.0)), float(data.get("comm_s", 0.0)),
                        int(data.get("comm_elements", 0)), int(data.get("grad_sync_elements", 0)),
                        int(data.get("memory_bytes", 0)), float(data.get("flops", 0.0)),
                        tuple(data.get("collectives", ())))

    def _changed(self, **changes) -> "NodeCost":
        """`dataclasses.replace(self, **changes)` without its walk over the fields and the frozen `__init__`: the
        search derives ~200,000 costs this way on llama-70b:64 (`times`, `recomputed`, `per_step`, ...), and
        `replace` was ~2% of its CPU. The same object: NodeCost has no `__post_init__` and nothing in its
        `__dict__` but its fields, so copying them and setting `changes` is what `__init__` would store."""
        new = object.__new__(type(self))
        state = new.__dict__
        state.update(self.__dict__)
        state.update(changes)
        return new

    def times(self, factor: int) -> "NodeCost":
        """This cost counted `factor` times (a node standing for `factor` alike, `search.repeat`): every
        figure that adds up over nodes."""
        return self._changed(forward_s=self.forward_s * factor, backward_s=self.backward_s * factor,
                       optimizer_s=self.optimizer_s * factor, comm_s=self.comm_s * factor,
                       comm_elements=self.comm_elements * factor,
                       grad_sync_elements=self.grad_sync_elements * factor,
                       memory_bytes=(self.memory_bytes - self.transient_bytes) * factor + self.transient_bytes,
                       flops=self.flops * factor, accumulation_bytes=self.accumulation_bytes * factor,
                       activation_bytes=self.activation_bytes * factor,
                       forward_comm_s=self.forward_comm_s * factor,
                       forward_comm_elements=self.forward_comm_elements * factor,
                       grad_reduce_s=self.grad_reduce_s * factor)

    def recomputed(self, kept: bool) -> "NodeCost":
        """This node under activation recomputation (`ir.recompute`): its block's forward runs again before
        the block's backward, so its forward compute and forward collectives count twice (as backward time and
        elements sent; model FLOPs do not change). Unless its value is `kept` (read outside its block), it
        holds no activation between forward and backward, only while its block is recomputed
        (`transient_bytes`)."""
        again = self._changed(backward_s=self.backward_s + self.forward_s, comm_s=self.comm_s + self.forward_comm_s,
                        comm_elements=self.comm_elements + self.forward_comm_elements)
        if kept:
            return again
        return again._changed(activation_bytes=0, transient_bytes=self.transient_bytes + self.activation_bytes)

    def with_transient(self, transient_bytes: int) -> "NodeCost":
        """This node charged `transient_bytes` of recomputed activations in place of its own (a block's are
        counted on one node, or spread as an average: `search.recompute`)."""
        return self._changed(memory_bytes=self.memory_bytes - self.transient_bytes + transient_bytes,
                       transient_bytes=transient_bytes)

    def with_in_flight(self, count: int) -> "NodeCost":
        """This cost with `count` micro-batches' activations alive at once (a pipeline stage's warm-up): what
        a stage search ranks memory by (`search.pipeline_search`)."""
        if count == 1:
            return self
        extra = (count - 1) * self.activation_bytes
        return self._changed(memory_bytes=self.memory_bytes + extra, activation_bytes=self.activation_bytes + extra)

    def per_step(self, microbatches: int) -> "NodeCost":
        """This node's cost per step when a step runs `microbatches` micro-batches (gradient accumulation).

        The cost model prices a node at the micro-batch's shapes. Its
        compute and the collectives on activations run once per micro-batch.
        A weight's chain runs once per step, as the backend runs it
        (parsat/backend/executor.py `RankProgram.weight_values`): the values made
        from a weight by parallel operators (its ZeRO-3 all-gather, its
        replicas) before the first micro-batch, kept for all of them, and
        their backward (the gradient synchronisation: all-reduce,
        reduce-scatter) after the last, on the gradient accumulated over the
        micro-batches (as DDP's `no_sync`, and FSDP's with resharding after
        forward off). The optimizer runs once per step. Memory is what one
        micro-batch keeps alive plus the weights' state, since a
        micro-batch's activations are freed by its backward before the next
        begins, plus the gradients a weight's chain accumulates across the
        micro-batches (`accumulation_bytes`: a gathered weight's whole
        gradient waits for the one reduce-scatter).
        """
        m = microbatches
        if m == 1:
            return self
        if self.weight_chain:
            return self._changed(memory_bytes=self.memory_bytes + self.accumulation_bytes)
        return self._changed(forward_s=self.forward_s * m, backward_s=self.backward_s * m, comm_s=self.comm_s * m,
                       comm_elements=self.comm_elements * m, flops=self.flops * m,
                       forward_comm_s=self.forward_comm_s * m, forward_comm_elements=self.forward_comm_elements * m)


# The phases a simulated step is reported in (`StepTimeline.phases`), and the letter each draws on the timeline's
# lanes: the compute lane in capitals, the communication lane in lower case (the gradient sync is communication
# by nature, so it is G on the communication lane), a waiting rank as w. `explain` prints the legend.
STEP_PHASES = ("forward", "backward", "grad_sync", "optimizer", "stragglers")
LANES = ("compute", "comm", "overlap")
LANE_LETTERS = {("compute", "forward"): "F", ("compute", "backward"): "B", ("compute", "optimizer"): "O",
                ("compute", "grad_sync"): "G", ("compute", "stragglers"): "w",
                ("comm", "forward"): "f", ("comm", "backward"): "b", ("comm", "grad_sync"): "G",
                ("comm", "optimizer"): "o", ("comm", "stragglers"): "w"}


@dataclass(frozen=True)
class PhaseTimes:
    """One phase of a simulated step: when it ran, and how long each lane was busy with it."""

    phase: str          # one of STEP_PHASES
    start_s: float
    end_s: float
    compute_s: float    # the compute lane's busy time in this phase
    comm_s: float       # the communication lane's busy time in this phase

    def to_dict(self) -> dict:
        return {"phase": self.phase, "start_s": self.start_s, "end_s": self.end_s, "compute_s": self.compute_s,
                "comm_s": self.comm_s}


@dataclass(frozen=True)
class StepTimeline:
    """A plan's training step as the step simulator ran it (`cost.step_report`): the `step` object of a
    plan's `totals` (docs/plan-schema.md). `lanes` draw the step, one character per equal slice of it
    (`LANE_LETTERS`, a space where the lane is idle), for `explain`."""

    profile: str                    # the execution profile simulated (`cost.pcg_tasks`: "ddp", "parsat run")
    microbatches: int
    peak_memory_bytes: int          # the simulated peak at any instant, transient buffers included
    phases: tuple[PhaseTimes, ...]
    lanes: tuple[tuple[str, str], ...]   # (lane, its drawing): ("compute", "FFFBB..."), ("comm", " f  GG..."),
                                         # ("overlap", "    ^^..."): where both were busy at once

    def to_dict(self) -> dict:
        return {"profile": self.profile, "microbatches": self.microbatches,
                "peak_memory_bytes": self.peak_memory_bytes, "phases": [p.to_dict() for p in self.phases],
                "lanes": dict(self.lanes)}


@dataclass(frozen=True)
class StepStreams:
    """The simulated step's time and what its streams did: the per-stream totals of the plan JSON."""

    time_s: float            # the simulated step time: the critical path
    compute_busy_s: float    # the compute lane busy (computation, loss, optimizer)
    comm_busy_s: float       # the communication lane busy (every collective, waits for peers)
    exposed_comm_s: float    # the step less the compute lane's busy time: compute idle, waiting
    overlap_s: float         # time both lanes were busy at once


@dataclass(frozen=True, eq=False)
class SimulatedStep:
    """A simulated step's time, and its per-stream totals and timeline worked out when first read.

    A search simulates dozens of candidate steps and ranks them by their time
    alone; the figures the plan JSON prints (`StepStreams`, `StepTimeline`)
    are read for the few it keeps (the plan and its baselines), and working
    them out is a quarter to a half of a simulation (`cost.step_report`).
    `report` gives them, with the same time; it is called at most once.
    Two are equal when their figures are (worked out to compare them).

    `peak` is the simulated peak memory per device (`StepTimeline.peak_memory_bytes`) where the simulation
    gave it beside the time (`cost.step_report.simulated_step`: it decides whether the plan fits,
    `Totals.fits`, so a search reads it for every candidate it simulates); else it is read from the figures."""

    time_s: float
    report: Callable[[], tuple[StepStreams, StepTimeline]] = field(repr=False)
    peak: int | None = None

    @staticmethod
    def known(streams: StepStreams, step: StepTimeline) -> "SimulatedStep":
        """A step whose figures are already worked out."""
        return SimulatedStep(streams.time_s, lambda: (streams, step), step.peak_memory_bytes)

    @cached_property
    def figures(self) -> tuple[StepStreams, StepTimeline]:
        streams, step = self.report()
        if streams.time_s != self.time_s:
            raise ValueError(f"a step simulated in {self.time_s!r} s is reported as {streams.time_s!r} s")
        if self.peak is not None and step.peak_memory_bytes != self.peak:
            raise ValueError(f"a step simulated with a peak of {self.peak} bytes is reported with "
                             f"{step.peak_memory_bytes}")
        return streams, step

    @property
    def peak_memory_bytes(self) -> int:
        """The simulated peak memory per device, transient buffers included."""
        return self.step.peak_memory_bytes if self.peak is None else self.peak

    @property
    def streams(self) -> StepStreams:
        return self.figures[0]

    @property
    def step(self) -> StepTimeline:
        return self.figures[1]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SimulatedStep):
            return NotImplemented
        return self is other or (self.time_s == other.time_s and self.figures == other.figures)

    def __hash__(self) -> int:
        return hash(self.time_s)


@dataclass(frozen=True)
class Totals:
    """A plan's totals: the `totals` / `baselines` objects of the plan JSON.

    `time_s` is the step time the plan is ranked by: the step simulator's
    when the plan was simulated (`simulated`), the per-node sum otherwise;
    `node_sum_s` is always the per-node sum (what extraction ranks e-nodes
    by); `compute_s` and `comm_s` are the per-node sums of computation and
    communication; `simulation` the simulated step, whose figures
    (`streams`, `step`) are worked out when read (`SimulatedStep`).

    Memory likewise: `peak_memory_bytes` is the per-node bound (what
    extraction's memory constraint adds up, node by node), and
    `memory_bytes` the figure that decides whether the plan fits (`fits`):
    the simulated peak, transient buffers included, where the plan was
    simulated, else that bound (docs/COSTMODEL.md, "Memory"; issue 28). A plan refused without being
    simulated because a lower bound of its simulated peak is over the device's memory (`floor_bytes`,
    `cost.pcg_tasks.peak_floor`: `search.mesh.CandidateSteps`) has that lower bound as `memory_bytes`: it does
    not fit, as its simulation would have said.
    """

    time_s: float
    comm_elements: int
    comm_bytes: int
    peak_memory_bytes: int
    grad_sync_elements: int
    compute_s: float
    comm_s: float
    node_sum_s: float | None = None
    simulation: SimulatedStep | None = None
    floor_bytes: int | None = None   # not simulated: a lower bound of its simulated peak, over the device's memory

    def simulated(self, step: SimulatedStep) -> "Totals":
        """These totals with the simulated step: `time_s` becomes the simulated time, the sum is kept."""
        return replace(self, time_s=step.time_s, node_sum_s=self.per_node_s, simulation=step, floor_bytes=None)

    def refused(self, floor_bytes: int) -> "Totals":
        """These totals, unsimulated, of a plan whose simulated peak is at least `floor_bytes`, more than the
        device holds: it does not fit (`memory_bytes` is that lower bound)."""
        return replace(self, floor_bytes=floor_bytes)

    @property
    def streams(self) -> StepStreams | None:
        """The simulated step's per-stream totals (worked out now if not yet), None where not simulated."""
        return None if self.simulation is None else self.simulation.streams

    @property
    def step(self) -> StepTimeline | None:
        """The simulated step's timeline (worked out now if not yet), None where not simulated."""
        return None if self.simulation is None else self.simulation.step

    @property
    def memory_bytes(self) -> int:
        """The memory per device that decides whether the plan fits: the simulated peak (transient buffers
        included) where the step was simulated, else the lower bound of it that refused the plan (`refused`),
        else the per-node bound."""
        if self.simulation is not None:
            return self.simulation.peak_memory_bytes
        return self.peak_memory_bytes if self.floor_bytes is None else self.floor_bytes

    def fits(self, machine: Machine) -> bool:
        """Whether the plan's memory per device (`memory_bytes`) fits in `machine`'s."""
        return self.memory_bytes <= machine.memory_capacity

    @property
    def per_node_s(self) -> float:
        return self.time_s if self.node_sum_s is None else self.node_sum_s

    def to_dict(self) -> dict:
        out = {"time_s": self.time_s, "comm_elements": self.comm_elements, "comm_bytes": self.comm_bytes,
               "peak_memory_bytes": self.peak_memory_bytes, "grad_sync_elements": self.grad_sync_elements,
               "compute_s": self.compute_s, "comm_s": self.comm_s, "node_sum_s": self.per_node_s}
        if self.streams is not None:
            s = self.streams
            out.update({"compute_busy_s": s.compute_busy_s, "comm_busy_s": s.comm_busy_s,
                        "exposed_comm_s": s.exposed_comm_s, "overlap_s": s.overlap_s})
        if self.step is not None:
            out["step"] = self.step.to_dict()
        return out


def totals(costs: Mapping[int, NodeCost] | Sequence[NodeCost], machine: Machine) -> Totals:
    """A plan's per-node totals: every figure added up over its nodes' costs, in their order.

    Alike nodes share one cost object (`search.solve.pcg_node_costs` prices each key once, and
    `search.recompute.recomputed_pcg_costs` derives once per object), so a llama-70b layout's ~5,500 costs are
    ~70 objects: each figure is read once per object (`_Alike`), not once per node in seven passes; the call
    totals ~270 plans (the grid's points, the joint plans), and the passes were ~1 CPU s of llama-70b:64."""
    values = list(costs.values()) if isinstance(costs, Mapping) else list(costs)
    alike = _Alike.of(values)
    if alike is None:
        return _totals_node_by_node(values, machine)
    comm = alike.weighted(lambda c: c.comm_elements)
    # a recomputed block's activations live only while it is recomputed, one block at a time
    # (`search.recompute.recomputed_pcg_costs` puts each block's on one node)
    memory = alike.weighted(lambda c: c.memory_bytes - c.transient_bytes) + \
        max(c.transient_bytes for c in alike.objects)
    time_s, compute_s, comm_s = alike.in_order(lambda c: (c.time_s, c.forward_s + c.backward_s + c.optimizer_s,
                                                         c.comm_s))
    return Totals(time_s, comm, comm * machine.dtype_bytes, memory, alike.weighted(lambda c: c.grad_sync_elements),
                  compute_s, comm_s)


def _totals_node_by_node(values: Sequence[NodeCost], machine: Machine) -> Totals:
    """`totals` read node by node: what `_Alike` gives, and what is used where it does not apply."""
    comm = sum(c.comm_elements for c in values)
    memory = sum(c.memory_bytes - c.transient_bytes for c in values) + max((c.transient_bytes for c in values),
                                                                           default=0)
    return Totals(sum(c.time_s for c in values), comm, comm * machine.dtype_bytes,
                  memory, sum(c.grad_sync_elements for c in values),
                  sum(c.forward_s + c.backward_s + c.optimizer_s for c in values),
                  sum(c.comm_s for c in values))


@dataclass(frozen=True, eq=False)
class _Alike:
    """A sequence of node costs as its distinct objects (`objects`), how many times each occurs (`counts`) and
    which one stands at each place (`places`), so that `totals` reads each object's figures once.

    Why the same figures as adding node by node (`_totals_node_by_node`): the integer figures are exact,
    so their sum is the sum over objects of count x figure in any order (`weighted`; `of` refuses a sequence
    where one is not an `int`), and a maximum is the maximum over the objects. The float figures are added by
    Python's `sum` over the nodes in their order (`in_order`: each node's object's figure, looked up by its
    place), so the additions are the ones the node-by-node passes make, whatever `sum`'s float algorithm; each
    figure of an object is the same double wherever the object stands, so working it out once gives what working
    it out at every node gives. Where `sum` of floats is plain double additions from `0 + first` (CPython before
    3.12, whose float loop adds one IEEE double after another; 3.12 made it compensated) and every figure is a
    `float`, the same additions are made by `numpy.add.accumulate` over the nodes' figures after a 0.0 (an
    accumulation is sequential: each partial sum is an output), ~3x cheaper: its last partial sum is `sum`'s
    double. `of` refuses (None) where the sequence is empty (`sum` then gives the int 0)."""

    objects: tuple[NodeCost, ...]
    counts: tuple[int, ...]
    places: np.ndarray   # each node's object's index in `objects`

    @staticmethod
    def of(values: Sequence[NodeCost]) -> "_Alike | None":
        """`values` grouped by object identity (the list holds them, so no two live objects share an id); None
        where an integer figure is not an `int` (a float would make its sum depend on the order)."""
        if not values:
            return None
        ids = np.fromiter(map(id, values), dtype=np.int64, count=len(values))
        _ids, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
        objects = tuple(values[i] for i in first.tolist())
        for c in objects:
            if not (type(c.comm_elements) is type(c.memory_bytes) is type(c.transient_bytes)
                    is type(c.grad_sync_elements) is int):
                return None
        inverse = inverse.reshape(-1)
        return _Alike(objects, tuple(np.bincount(inverse, minlength=len(objects)).tolist()), inverse)

    def weighted(self, figure: Callable[[NodeCost], int]) -> int:
        """An integer figure added up over the nodes: each object's times its count."""
        return sum(count * figure(c) for count, c in zip(self.counts, self.objects))

    def in_order(self, figures: Callable[[NodeCost], tuple[float, ...]]) -> tuple[float, ...]:
        """Float figures (one tuple per object) each added up over the nodes in their order as `sum` adds them."""
        rows = [figures(c) for c in self.objects]
        if PLAIN_FLOAT_SUM and all(type(x) is float for row in rows for x in row):
            table = np.array([(0.0,) * len(rows[0])] + rows, dtype=np.float64)
            order = np.concatenate((np.zeros(1, dtype=np.intp), self.places + 1))
            return tuple(float(x) for x in np.add.accumulate(table[order], axis=0)[-1])
        places = self.places.tolist()
        return tuple(sum(map(column.__getitem__, places)) for column in zip(*rows))


PLAIN_FLOAT_SUM = sys.version_info < (3, 12)
"""Whether this interpreter's `sum` of floats adds plain doubles in order (`_Alike.in_order`): CPython 3.12 made it
compensated (Neumaier)."""
