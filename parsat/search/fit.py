"""Whether a step's candidate plan fits in memory, as the plan will run: the one judgment every ranking of a
step reads (`mesh.rank`, the recomputation policy, the grid's points).

An unstaged step's candidate runs as it is priced: its peak memory per device against the device's. A
pipeline stage's candidate (the whole model on a stage mesh, `pipeline_search`) runs cut into stages in a
schedule, so it fits when its busiest stage does, as the pipeline's pricing gives that stage's memory
(`cost.pipeline.StageFit`: the schedule's in-flight micro-batches, each stage's own weights, the first
stage's embedding, what recomputation keeps). The stage machine's memory, p times a device's, stays what
extraction's additive estimate is ranked against (`solve.in_flight_costs`); it no longer decides what fits,
which let a stage plan keep every activation where no schedule of it fit.

A stage candidate that fits is also ranked as its pipeline runs it (`MemoryFit.pipelined_s`, `mesh.rank`):
by the fastest pipelined plan that fits of those the pipeline search prices from it, the figure the plan the
search returns is chosen by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Protocol

from parsat.cost.pipeline import StageFit
from parsat.ir.costs import NodeCost, Totals
from parsat.ir.graph import Graph
from parsat.ir.machine import Machine
from parsat.ir.pcg import PCG
from parsat.ir.plan import Plan


class Priced(Protocol):
    """What the judgment reads of a candidate (`baselines.Candidate`)."""

    pcg: PCG
    costs: Mapping[int, NodeCost]
    totals: Totals


@dataclass(frozen=True)
class MemoryFit:
    """A step's judgment of memory: on `machine` (the step's), or, with `stage`, as the stage plan's pipeline
    runs. A stage candidate's figure is worked out once (cut and priced per schedule)."""

    machine: Machine
    graph: Graph          # the step's graph (its micro-batches), which a stage candidate is the plan of
    devices: int
    stage: StageFit | None = None
    # id of a candidate's costs -> (those costs, its PCG, bytes): kept alive, so an id stays theirs; a candidate
    # and its simulated copy (`mesh.CandidateSteps`: the same PCG and costs) share one figure. A stage step's is
    # the call's for its (graph, machine, devices, stage) (`request.step_context`): the figure reads those and the
    # candidate's PCG and costs alone, so a scout's step and the search of every mesh at its pair share it
    _known: dict = field(default_factory=dict, compare=False, repr=False)

    def needs(self, candidate: Priced) -> int:
        """The memory per device `candidate` needs as it runs (a stage plan: its busiest stage's, in the schedule
        and cut that need least; the whole plan's on the stage machine when no schedule can run it, which then
        never fits)."""
        staged = self._staged(candidate)
        return candidate.totals.memory_bytes if staged is None else staged

    def leanness(self, candidate: Priced) -> tuple[int, int]:
        """How `mesh.rank` orders candidates that do not fit, comparing like with like: a stage candidate by its
        figure (`needs`, one kind for every candidate); an unstaged one by its simulated peak where it was
        simulated (0, bytes), else, where a lower bound of its simulated peak refused it unsimulated
        (`Totals.refused`: it surely needs more than the device holds), by that bound (1, bytes), else by its
        per-node bound after every other (2, bytes). The unstaged
        figures are not comparable: the per-node bound is neither below nor above the simulated peak (sc21-1.7b:
        bound 27.32 GiB, simulated 25.59; llama-70b:64's grid points: bounds 39-64 GiB, simulated 142-230), and a
        candidate whose bound is over the device's memory is never simulated (`mesh.BestFirst`), so ranking the
        two together made an unsimulated point's bound "the smallest plan" beside plans that all simulate higher
        (llama-70b:64 at one micro-batch: 83.65 GiB said; the leanest simulated, 116.42). So what a step says the leanest plan needs (`step._over_as_simulated`,
        DoesNotFit, which `microbatches` splits the batch by) is the simulated peak of the leanest candidate
        that was simulated, and a per-node bound only where none was. (Where no mesh's extraction found a plan
        within the bound, the step's DoesNotFit is extraction's figure, `step._no_joint_plan`: the per-node bound
        of the leanest plan extracted, said as such, beside baselines that may simulate far higher: a 2-block
        GPT on 4 devices of 8 MiB, 9.36 MiB by the bound, data parallelism 37.87 MiB simulated.)"""
        if self.stage is not None or candidate.totals.simulation is not None:
            return 0, self.needs(candidate)
        if candidate.totals.floor_bytes is not None:   # refused unsimulated: at least this as simulated
            return 1, candidate.totals.floor_bytes
        return 2, candidate.totals.peak_memory_bytes

    def fits(self, candidate: Priced) -> bool:
        """Whether `candidate` fits in memory as it runs."""
        if self.stage is None:
            return candidate.totals.fits(self.machine)
        return self.stage.fits(self._staged(candidate))

    def pipelined_s(self, candidate: Priced) -> float:
        """A stage candidate's rank among those that fit (`mesh.rank`): the step of the fastest pipelined plan that
        fits of those the pipeline search prices from it (`StageFit.fastest_s`), worked out once per PCG and node
        costs for the call's step (kept beside its memory figure); `math.inf` unstaged."""
        if self.stage is None:
            return math.inf
        key = (FASTEST, id(candidate.costs))
        known = self._known.get(key)
        if known is None or known[0] is not candidate.costs or known[1] is not candidate.pcg:
            known = (candidate.costs, candidate.pcg, self.stage.fastest_s(self._plan(candidate)))
            self._known[key] = known
        return known[2]

    def pipelined_floor_s(self, candidate: Priced) -> float:
        """A lower bound of a stage candidate's `pipelined_s` (`StageFit.schedule_floors`, the plans': every
        pipelined plan that fits of every schedule the pipeline search prices from it); 0 unstaged."""
        if self.stage is None:
            return 0.0
        return self.stage.schedule_floors(self._plan(candidate))[0]

    def overshoot(self, candidate: Priced) -> float | None:
        """How many times a device's memory a stage candidate that does not fit needs as its pipeline runs it
        (`needs` over the device's); None unstaged, where no schedule can run it (no leaner plan helps then), or
        where it fits. What `mesh._extract_joint` scales extraction's memory by when it asks for a leaner plan."""
        staged = self._staged(candidate)
        if staged is None or self.stage.fits(staged):
            return None
        return staged / self.stage.machine.memory_capacity

    def _plan(self, candidate: Priced) -> Plan:
        """`candidate` as the stage plan the pipeline search would cut (the step's graph, machine and devices)."""
        return Plan(self.graph, self.machine, self.devices, candidate.pcg, candidate.costs, candidate.totals)

    def _staged(self, candidate: Priced) -> int | None:
        """A stage candidate's figure (`StageFit.peak_bytes`), worked out once; None unstaged or unrunnable."""
        if self.stage is None:
            return None
        known = self._known.get(id(candidate.costs))
        if known is None or known[0] is not candidate.costs or known[1] is not candidate.pcg:
            known = (candidate.costs, candidate.pcg, self.stage.peak_bytes(self._plan(candidate)))
            self._known[id(candidate.costs)] = known
        return known[2]


FASTEST = "fastest"   # `MemoryFit._known` key beside a costs' id: its `pipelined_s`, not its memory figure


__all__ = ["MemoryFit", "Priced"]
