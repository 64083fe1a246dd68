"""One device mesh's search: saturate, price every e-node, extract the joint plan and the restricted baselines.

`search_mesh` is the innermost loop of `optimize` (docs/MESH.md): for one
mesh of the step's devices it saturates the graph with the rules lifted
onto that mesh, prices the e-graph once, extracts the cheapest plan that
fits (keeping every activation, then recomputing blocks when that does not
fit), and extracts the baselines that restrict the same e-graph (Megatron's
layout, the best grid point). `CandidateSteps` then simulates every
candidate's step for the final ranking, and `rank` orders them.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

from parsat.cost.pcg_tasks import OpTimes, TaskBuildError, peak_floor, step_floor
from parsat.cost.simulator import SimulationError
from parsat.cost.step_report import simulated_step
from parsat.dsl.library import Library
from parsat.egraph.resize import resized, structure
from parsat.egraph.runner import STOP_INTERRUPTED, STOP_SATURATED, STOP_SECONDS
from parsat.egraph.saturate import SaturationResult, saturate
from parsat.ir.blocks import has_blocks
from parsat.ir.costs import totals
from parsat.ir.machine import Machine
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import PCG, describe_zero
from parsat.ir.placement import Placement
from parsat.ir.plan import JOINT
from parsat.ir.recompute import AUTO, BLOCKS, NONE, check_policy
from parsat.ir.recompute import describe as describe_recompute
from parsat.ir.units import fmt_bytes
from parsat.search.baselines import Candidate, best_grid, megatron_excluded
from parsat.search.deadline import Deadline
from parsat.search.extract import Extraction, ExtractionError, leaf_roles, node_costs
from parsat.search.repeat import RepeatError
from parsat.search.request import StepContext
from parsat.search.fit import MemoryFit
from parsat.search.solve import price, solve
from parsat.ir.megatron import contraction_weights
from parsat.search.strategies import Config, config_excluded, shared_weights

T = TypeVar("T")
SATURATION_SHARE = 0.6   # of a mesh's time, for saturating: pricing, extraction and the baselines take the rest


@dataclass(frozen=True)
class MeshSearch:
    """What the search found on one device mesh: the saturated e-graph, the joint plan and the Megatron-style
    restriction of it (None where extraction found none), and how long it took."""

    mesh: Mesh
    pins: Mapping[str, Placement]
    result: SaturationResult
    extraction: Extraction | None
    joint: Candidate | None
    megatron: Candidate | None
    grid: Candidate | None
    extract_seconds: float
    spread: bool       # whether any class of the e-graph is spread over the mesh
    error: str = ""
    needed_bytes: int = 0   # nothing fits in memory: what the smallest plan needs per device
    cut: str = ""           # no joint plan: which safety valve cut the search first ('' for none: `valve_cut`)

    def summary(self) -> dict:
        return {"mesh": self.mesh.to_dict(), "stop": self.result.stop, "enodes": self.result.enodes,
                "seconds": round(self.result.seconds + self.result.compile_seconds + self.extract_seconds, 4),
                "time_s": self.joint.totals.time_s if self.joint else None,
                "node_sum_s": self.joint.totals.per_node_s if self.joint else None, "error": self.error}

    def simulated(self, steps: "CandidateSteps", ranked: Callable[[Candidate], bool] | None = None) -> "MeshSearch":
        """This search with its candidates' steps simulated (`CandidateSteps`): the joint plan's always (its step
        is the mesh's `summary`, and the step ranks the meshes by it: never refused by its floor), the baselines'
        (Megatron, the grid point) where `ranked` says their step can matter (`step.step_read`; None: always)."""
        return replace(self, joint=steps.simulate(self.joint), megatron=steps.where(self.megatron, ranked),
                       grid=steps.where(self.grid, ranked))

    def settled(self, steps: "CandidateSteps") -> "MeshSearch":
        """This search with the baselines `steps` refused by their floors simulated after all (`CandidateSteps`)."""
        return replace(self, megatron=steps.settled(self.megatron), grid=steps.settled(self.grid))


class CandidateSteps:
    """Simulates candidates' steps for the final ranking (`step_report.simulated_step`: the figures the plan JSON
    prints are worked out when read), sharing one cache of compute times; a candidate the simulator cannot run
    keeps its per-node sum, and `failures` says why."""

    def __init__(self, library: Library, machine: Machine, microbatches: int = 1, shared: dict | None = None,
                 refusing: bool = False):
        self.library, self.machine, self.microbatches = library, machine, microbatches
        self.failures: dict[str, str] = {}
        # `refusing` (an unstaged step's, `step._search_step`): a candidate whose simulated peak is surely over the
        # device's memory (`peak_floor`) is refused unsimulated (`Totals.refused`); `refused` holds the PCGs so
        # refused, which a step that goes on to make a plan simulates after all (`settled`)
        self.refusing = refusing
        self.refused: set[PCG] = set()
        # a PCG found twice (a mesh's joint plan is often one of its grid points; a scout's candidates are found
        # again by the search of every mesh at its count) is simulated once: a step of many micro-batches of a
        # whole model takes seconds. `shared` (the call's, `SearchRequest.simulations`) keeps the simulated
        # steps and the compute times for every step on this machine and micro-batch count.
        known = (OpTimes(library, machine), {})
        self.times, self.simulated = known if shared is None else shared.setdefault((machine, microbatches), known)
        self.skipped = 0   # candidates `fastest` left out unsimulated

    def __call__(self, candidate: Candidate | None) -> Candidate | None:
        if candidate is None or candidate.totals.simulation is not None:
            return candidate
        return self.refusal(candidate) or self.simulate(candidate)

    def refusal(self, candidate: Candidate) -> Candidate | None:
        """`candidate` (unsimulated) refused by its floor, as this would give it (`refusing`: a lower bound of its
        simulated peak over the device's memory, and its step not simulated before); None where it would be
        simulated instead."""
        if not self.refusing or candidate.pcg in self.simulated:
            return None
        floor = self.peak_floor(candidate.pcg)
        if floor is None or floor <= self.machine.memory_capacity:
            return None
        self.refused.add(candidate.pcg)
        return replace(candidate, totals=candidate.totals.refused(floor))

    def simulate(self, candidate: Candidate | None) -> Candidate | None:
        """`candidate` with its step simulated (refused by no floor), kept for the call."""
        if candidate is None or candidate.totals.simulation is not None:
            return candidate
        found = self.simulated.get(candidate.pcg)
        if found is None:
            try:
                found = simulated_step(candidate.pcg, self.library, self.machine, self.microbatches, self.times)
            except (TaskBuildError, SimulationError) as err:
                self.failures[candidate.name] = str(err)
                return candidate
            self.simulated[candidate.pcg] = found
        return replace(candidate, totals=candidate.totals.simulated(found))

    def where(self, candidate: Candidate | None, ranked: Callable[[Candidate], bool] | None) -> Candidate | None:
        """`candidate` simulated where `ranked(candidate)` (or no `ranked` is given), else as it is: a step whose
        ranking reads no simulated time of a candidate (`step.step_read`) leaves it unsimulated. (Never run, it
        records no simulator failure either, as `fastest`'s left-out candidates do not.)"""
        if candidate is None or (ranked is not None and not ranked(candidate)):
            return candidate
        return self(candidate)

    def peak_floor(self, pcg: PCG) -> int | None:
        """A lower bound of `pcg`'s simulated peak memory per device (`pcg_tasks.peak_floor`), None where its tasks
        cannot be built (its simulation, if made, says why)."""
        try:
            return peak_floor(pcg, self.machine, self.times, self.microbatches)
        except TaskBuildError:
            return None

    def settled(self, candidate: Candidate | None) -> Candidate | None:
        """`candidate` as simulating it gives, where it was refused by its floor (`refusing`), else as it is."""
        if candidate is None or candidate.totals.floor_bytes is None:
            return candidate
        return self.simulate(candidate)

    def floor(self, pcg: PCG, plan: bool = True) -> float | None:
        """A lower bound of `pcg`'s simulated step (`pcg_tasks.step_floor`; without the `plan`'s own part, one
        for every ZeRO stage and recomputation of its layout), None where a node of it cannot be timed (its
        simulation, if made, says why)."""
        try:
            return step_floor(pcg, self.machine, self.times, self.microbatches, plan=plan)
        except TaskBuildError:
            return None

    def beyond(self, pcg: PCG, bar: float) -> bool:
        """Whether every ZeRO stage and recomputation of `pcg`'s layout is surely slower than `bar` (a simulated
        step, rounded as `rank` rounds): their floor, so rounded, is above it."""
        floor = self.floor(pcg, plan=False)
        return floor is not None and round(floor, 12) > bar

    def fastest(self, candidates: Sequence[Candidate], fits: Callable[[Candidate], bool], bar: float = math.inf,
                rivals: Callable[[Candidate], bool] | None = None) -> tuple[dict[int, Candidate], float]:
        """`candidates` by their index, with those that fit simulated, less those that cannot be the fastest of
        them: branch and bound (`BestFirst`, from `bar`, a step already simulated among those they are ranked
        with). Those that do not fit are kept as they are: they rank by memory, which simulating does not change;
        so are those `rivals` says are not ranked at all (a pinned search's grid points that do not keep the pins:
        the bar must come from a candidate that can be chosen). Also the fastest step simulated, the bar for the
        candidates ranked after them. A lone candidate under no bar is simulated without its floor: nothing is
        ordered by it, and no floor is above an infinite bar."""
        search = BestFirst(self, fits, bar, rivals)
        search.add(enumerate(candidates), lone=True)
        search.run()
        return {i: search.kept[i] for i in sorted(search.kept)}, search.bar


class SimulatedSteps:
    """How an unstaged step's branch and bound (`BestFirst`) judges a candidate: its floor, a lower bound of its
    simulated step (`CandidateSteps.floor`), and its time, the step simulated (`CandidateSteps`), by which `rank`
    orders those that fit; None where it was not simulated (refused by its peak floor, or the simulator failed)."""

    def __init__(self, steps: CandidateSteps):
        self.steps = steps

    def floor(self, candidate: Candidate) -> float | None:
        return self.steps.floor(candidate.pcg)

    def timed(self, candidate: Candidate) -> tuple[Candidate, float | None]:
        found = self.steps(candidate)
        return found, found.totals.time_s if found.totals.simulation is not None else None


class PipelinedSteps:
    """How a pipeline stage's branch and bound (`BestFirst`) judges a candidate, as `rank` ranks a stage's
    candidates that fit: its time, the fastest pipelined plan that fits of those the pipeline search prices from
    it (`MemoryFit.pipelined_s`, worked out once per candidate for the call's step, so `rank` reads it again
    for nothing), and its floor, a lower bound of every such plan (`StageFit.schedule_floors`, the plans'). The
    candidate is kept unsimulated: no ranking of a stage step reads a simulated step (`step.step_read`). Bounding
    a stage's points by their simulated stage steps left out points that pipeline faster than the fastest
    simulated one (benchmarks/search_results.md, session 64 helper A3's "Noticed" (a))."""

    def __init__(self, memory: MemoryFit):
        self.memory = memory

    def floor(self, candidate: Candidate) -> float | None:
        return self.memory.pipelined_floor_s(candidate)

    def timed(self, candidate: Candidate) -> tuple[Candidate, float | None]:
        return candidate, self.memory.pipelined_s(candidate)


class BestFirst:
    """Candidates simulated best-bound-first (`CandidateSteps`; a stage's priced pipelined, `judge`): the ones that
    fit (and that `rivals` ranks) wait, each with its step floor (`CandidateSteps.floor`; a stage's
    `PipelinedSteps.floor`), and `run` simulates them in the ascending order of their
    floors (ties in their keys' order), leaving out one whose floor is above the fastest step simulated so far
    (`bar`), as `rank` rounds them: its step would be slower still, so the fastest that fits, and every one as
    fast (`rank`'s ties: their floors are at or below every bar), are what simulating every one gives, whatever
    order they were added in. `run(upto)` stops before the first floor above `upto`, so a caller adding
    candidates as it builds them (`step.independent_points`: a grid family at a time, in the order of the
    families' bounds) simulates those that can set the bar before it builds a family that bound can leave out.
    (A left-out candidate is never run, so a simulator failure it would have had is not recorded.) `kept`: by
    key, every candidate added less those left out; `skipped` (of the steps) counts those."""

    def __init__(self, steps: CandidateSteps, fits: Callable[[Candidate], bool], bar: float = math.inf,
                 rivals: Callable[[Candidate], bool] | None = None,
                 judge: "SimulatedSteps | PipelinedSteps | None" = None):
        self.steps, self.fits, self.rivals, self.bar = steps, fits, rivals, bar
        # a candidate's floor and time (`SimulatedSteps`: its simulated step, as an unstaged step ranks; a stage
        # step's `PipelinedSteps`: its pipelined price)
        self.judge = judge if judge is not None else SimulatedSteps(steps)
        self.kept: dict = {}
        self._waiting: list[tuple] = []   # heap of (floor, or -inf where there is none; key; floor; candidate)

    def add(self, keyed: Iterable[tuple[Any, Candidate]], lone: bool = False) -> None:
        """`keyed` ((key, candidate), keys unique and ordered among themselves) added: those that are not ranked
        kept as they are, the others waiting with their floors. `lone`: where one alone is ranked and no bar is
        set yet, its floor is not worked out (it is simulated first, as it would be with one)."""
        ranked = []
        for key, candidate in keyed:
            self.kept[key] = candidate
            if self.fits(candidate) and (self.rivals is None or self.rivals(candidate)):
                ranked.append((key, candidate))
        unfloored = lone and len(ranked) == 1 and self.bar == math.inf and not self._waiting
        for key, candidate in ranked:
            floor = None if unfloored else self.judge.floor(candidate)
            heapq.heappush(self._waiting, (-math.inf if floor is None else floor, key, floor, candidate))

    def run(self, upto: float = math.inf) -> None:
        """The waiting candidates whose floors are at or below `upto` simulated, or left out (above the bar)."""
        steps = self.steps
        while self._waiting and self._waiting[0][0] <= upto:
            _order, key, floor, candidate = heapq.heappop(self._waiting)
            if floor is not None and round(floor, 12) > self.bar:
                del self.kept[key]
                steps.skipped += 1
                continue
            found, time_s = self.judge.timed(candidate)
            self.kept[key] = found
            # the bar is the fastest time that fits as judged: a candidate whose simulated peak is over the
            # device's memory (it fitted by the per-node bound) cannot be chosen, so it sets no bar
            if time_s is not None and self.fits(found):
                self.bar = min(self.bar, round(time_s, 12))


def rank(candidate: Candidate, memory: MemoryFit) -> tuple:
    """Plans that fit in memory as they run (`memory`, the step's: `search.fit`) first, then the fastest; the
    joint plan wins ties. When none fits, the one that needs least memory (what the micro-batch search splits
    from, and what the user is told), like compared with like (`MemoryFit.leanness`): an unstaged step's
    simulated peaks first, then the per-node bounds of candidates never simulated.

    The fastest as the plan will run: an unstaged candidate by its step (simulated, else its per-node sum); a
    pipeline stage's by the fastest pipelined plan that fits of those the pipeline search prices from it
    (`MemoryFit.pipelined_s`), the figure its pipelined plan is then chosen by (`pipeline_search.best_of`).
    The stage plan's own step is not that figure: llama-70b:64's `gpu 8` stage plan has the faster step and
    pipelines in 16.156 s, `gpu0 4 x gpu1 2`'s keeping every activation in 15.234 s."""
    if not memory.fits(candidate):
        return True, memory.leanness(candidate), candidate.name != JOINT
    time_s = memory.pipelined_s(candidate) if memory.stage is not None else candidate.totals.time_s
    return False, (0, round(time_s, 12)), candidate.name != JOINT


def first_ranked(items: Sequence[T], memory: MemoryFit, of: Callable[[T], Candidate] = lambda c: c) -> T | None:
    """The first of `items` by `rank` of their candidates (`of`), ties in their order: `min(items, key=rank)`, None
    where there is none. A pipeline stage's candidates that fit rank by their pipelined price
    (`MemoryFit.pipelined_s`: a cut search in every schedule, the costliest figure a stage step reads), worked out
    in the ascending order of their floors (`MemoryFit.pipelined_floor_s`: at most the step of every pipelined
    plan that fits priced from a stage plan, its stages' fill, drain and busy time over the cuts whose memory can
    fit, at or above the mean busy time, `StageFit.floor_s`, and worked out once per stage plan for its ranking
    and the stage search's bounds) and only while a floor is at or below the fastest price so far: one whose
    floor is above it pipelines slower still, so it is not the first, nor tied with it, whatever it would price
    at. Where none fits, no price is read (they rank by memory), nor where one alone fits (it ranks first)."""
    if not items:
        return None
    fit = memory.stage
    fitting = [k for k, item in enumerate(items) if memory.fits(of(item))] if fit is not None else []
    if len(fitting) == 1:
        return items[fitting[0]]
    if not fitting:
        return min(items, key=lambda item: rank(of(item), memory))
    floors = sorted((round(memory.pipelined_floor_s(of(items[k])), 12), k) for k in fitting)
    bar, priced = math.inf, []
    for floor, k in floors:
        if floor > bar:
            break
        bar = min(bar, round(memory.pipelined_s(of(items[k])), 12))
        priced.append(k)
    return min((items[k] for k in sorted(priced)), key=lambda item: rank(of(item), memory))


def best(found: Sequence[Candidate | None], memory: MemoryFit) -> Candidate | None:
    """The best of the candidates found (`rank`), None when there is none."""
    return first_ranked([c for c in found if c is not None], memory)


@dataclass(frozen=True)
class Saturated:
    """A mesh's saturated e-graph, priced once: what every extraction on that mesh reads."""

    mesh: Mesh
    pins: Mapping[str, Placement]
    result: SaturationResult
    roots: list[int]
    raw: Mapping
    spread: bool


def search_mesh(step: StepContext, mesh: Mesh, config: Config | None, pins: Mapping[str, Placement],
                clock: Deadline) -> MeshSearch:
    """Saturate on one mesh, price every e-node, extract the joint plan (within `config`, pinned parallel dims, when
    given) and the baselines that restrict the same e-graph (Megatron, the grid), all before `clock`'s deadline
    (extractions past it take the greedy passes only: a plan, never none). With repeated blocks, saturation
    sees the searched blocks and every plan is the whole model's (`repeat`).

    The request's `recompute` ("none", "blocks": `ir.recompute`) is the activation-recomputation policy the
    plans run with; AUTO extracts with every activation kept, and again recomputing blocks when that plan does
    not fit (the e-graph is priced once: recomputation changes costs, not values, `search.recompute`)."""
    sat = _saturate(step, mesh, pins, clock)
    t = time.perf_counter()
    found, failure = _extract_joint(step, sat, config, clock, t)
    if found is None:
        return replace(failure, cut=valve_cut(clock, sat.result))   # the step may fall back to a baseline
    policy, priced, extraction, joint = found
    seconds = time.perf_counter() - t
    step.say(f"mesh {mesh}: extraction {extraction.method}, {seconds:.2f} s, plan {joint.totals.time_s * 1e3:.3f} ms"
             + (f", {policy.describe()}" if policy.describe() else ""))
    megatron = grid = None
    if step.request.baselines:
        megatron, grid = _restricted_baselines(step, sat, priced, policy, clock)
    return MeshSearch(mesh, pins, sat.result, extraction, joint, megatron, grid, seconds, sat.spread)


def valve_cut(clock: Deadline, result: SaturationResult) -> str:
    """Which safety valve cut a mesh's search ('' when none did): Ctrl-C, or `--limit seconds` stopping its
    saturation or running out before its extraction ended (which then ran its greedy passes only, and a repeated
    plan's blocks may not come out alike, `repeat`). A search no valve cut ran on its work budgets alone, so
    without `--limit seconds` and Ctrl-C this is always '' and the search's outcome is the same on any machine."""
    if clock.interrupted.is_set() or result.stop == STOP_INTERRUPTED:
        return "interrupted (Ctrl-C)"
    seconds = f"--limit seconds={clock.limits_given.seconds:g}"
    if result.stop == STOP_SECONDS:
        return f"saturation stopped by its part of {seconds}"
    if clock.limits() is None:
        return f"extraction cut to its greedy passes by {seconds}"
    return ""


def _saturate(step: StepContext, mesh: Mesh, pins: Mapping[str, Placement], clock: Deadline) -> Saturated:
    """The step's graph saturated on `mesh` within its share of `clock`, its roots, and every e-node priced."""
    request, graph = step.request, step.searched
    t = time.perf_counter()
    result = _resized(step, mesh, pins)
    if result is None:
        result = saturate(graph, request.library, request.rules, mesh, clock.remaining(SATURATION_SHARE), pins,
                          caches=request.caches, cut_sums=request.cut_sums, matches=True)
        if result.stop == STOP_SATURATED and result.pattern_rows is not None:
            # only an e-graph saturated here is kept: a taken one's e-nodes hold its own graph's reals where its
            # match rows hold the first graph's, and keeping it (a copy of the shapes) took no other saturation
            # away on llama-70b:64 (benchmarks/search_results.md)
            request.saturations.setdefault(_saturation_key(graph, mesh, pins), []).append((graph, result))
    if result.stop == STOP_INTERRUPTED:
        clock.interrupt()   # Ctrl-C inside egglog: this mesh's e-graph as it stands, and nothing more after it
    step.say(f"mesh {mesh}: saturation {result.stop} after {result.iterations} iterations, {result.enodes} "
             f"e-nodes, {time.perf_counter() - t:.2f} s")
    spread = any(p.spread_axes for p in result.snapshot.placement.values())
    roots = [result.classes[f"pin:{n}"] if n in pins else result.classes[n] for n in graph.outputs]
    raw = node_costs(result.snapshot, graph, request.library, step.machine, request.free_input_placements,
                     step.input_pins, computed=request.prices)
    return Saturated(mesh, pins, result, roots, raw, spread)


def _saturation_key(graph, mesh: Mesh, pins: Mapping[str, Placement]) -> tuple:
    """What a saturation on `mesh` reads of `graph` beside its sizes and reals (`resize.structure`)."""
    return structure(graph), mesh, tuple(sorted(pins.items()))


def _resized(step: StepContext, mesh: Mesh, pins: Mapping[str, Placement]) -> SaturationResult | None:
    """The saturated e-graph of a graph of the step's structure at other sizes (another micro-batch count's, or
    another pipeline pair's stage), taken at the step's sizes where every rule reads the same of them
    (`egraph.resize`: then saturating the step's graph would leave this very e-graph); None where none is kept
    or none holds. Only e-graphs that saturated are kept: their e-graph depends on the graph and the rules alone,
    not on a limit."""
    request, graph = step.request, step.searched
    memo = request.saturations.setdefault("instances", {})
    for like, kept in request.saturations.get(_saturation_key(graph, mesh, pins), ()):
        t = time.perf_counter()
        found = resized(kept.snapshot, kept.classes, kept.program, kept.pattern_rows, like, graph, request.library,
                        memo)
        if found is not None:
            step.say(f"mesh {mesh}: the e-graph saturated at other sizes holds at these (every guard reads the same "
                     "of them): taken, not saturated again")
            # its rows hold `like`'s reals, its e-nodes `graph`'s: no other e-graph is taken from it (None)
            return replace(kept, snapshot=found, seconds=time.perf_counter() - t, compile_seconds=0.0,
                           pattern_rows=None)
    return None


@dataclass(frozen=True)
class Policy:
    """How a plan holds memory, beside its layout: activations kept or recomputed (`ir.recompute`), and the ZeRO
    stage of its weights' state (`ir.pcg.PCG.zero`). Both change costs, not values: the e-graph is priced once
    and extracted once per policy."""

    recompute: str = NONE
    zero: int = 0

    def describe(self) -> str:
        """The policy in words, for progress lines ("" for keeping everything unsharded)."""
        parts = ([describe_recompute(self.recompute)] if self.recompute != NONE else []) + \
            ([describe_zero(self.zero)] if self.zero else [])
        return ", ".join(parts)


def policies(step: StepContext) -> tuple[Policy, ...]:
    """The policies to extract with, fastest first: AUTO keeps every activation, then shards the weights' state
    (ZeRO-1, then 2: a little communication, no compute), then recomputes blocks (a third more compute). A
    pinned recomputation or ZeRO stage (`--recompute`, `--degrees zero=N`) is the only one of its kind."""
    recompute, zero = step.request.recompute, step.request.state_zero
    if recompute != AUTO:
        recomputes = (check_policy(recompute),)
    elif has_blocks(leaf.name for leaf in step.searched.leaves):
        recomputes = (NONE, BLOCKS)
    else:
        recomputes = (NONE,)   # no blocks (`ir.blocks`): nothing to recompute
    stages = (0, 1, 2) if zero == AUTO else (zero,)
    ordered = [Policy(r, z) for r in recomputes for z in stages]
    if len(recomputes) > 1 and len(stages) > 1:
        ordered.remove(Policy(BLOCKS, 0))   # recomputing while the state could be sharded: never the faster
    return tuple(ordered)


def _tried_in_order(ordered: Sequence[Policy]) -> list[Policy]:
    """The order extraction tries `ordered` in: the first; then the one holding least memory, so that where
    nothing fits two extractions say so; then the ones between, fastest first."""
    if len(ordered) <= 2:
        return list(ordered)
    return [ordered[0], ordered[-1], *ordered[1:-1]]


def _pinned_out(step: StepContext, sat: Saturated, config: Config):
    """The e-nodes a pinned configuration excludes from extraction (`config_excluded`)."""
    result, graph = sat.result, step.searched
    batch = {result.classes[name]: dim for name, dim in step.batch_inputs.items() if name in result.classes}
    # a pinned tensor axis splits every contraction's weight, on a mesh of that axis alone too (a pipeline
    # stage's tp 2 mesh extracted a plan with nothing split there before)
    split = frozenset(result.classes[name] for name in contraction_weights(graph)
                      if name in result.classes) if config.tensor_axis is not None else frozenset()
    return config_excluded(result.snapshot, leaf_roles(result.snapshot, graph), config, batch, split,
                           shared_weights(graph, result.classes))


def _extract_joint(step: StepContext, sat: Saturated, config: Config | None, clock: Deadline, started: float):
    """The joint plan of the fastest policy whose plan fits (else the one needing least memory): ((policy,
    priced, extraction, joint), None), or (None, the MeshSearch that says why none was found)."""
    request, graph, machine = step.request, step.searched, step.machine
    result = sat.result
    pinned = None if config is None else _pinned_out(step, sat, config)
    ordered = policies(step)
    failure: MeshSearch | None = None
    found = None    # (policy, priced, extraction, joint) of the plan kept so far
    fitting: dict[Policy, tuple] = {}
    lean_after = False   # the leanest policy fitted only by trading time for memory: so will the ones between
    # a policy's plan was extracted again leaner and fits as run (`_leaner_as_run`): the policies after it are
    # extracted once each, and compared with it (bounded work: one policy's leaner extractions per mesh)
    leaned = False
    for index, policy in enumerate(_tried_in_order(ordered)):
        priced = price(result, graph, request.library, machine, request.free_input_placements, step.input_pins,
                       step.repetition, sat.roots, policy.recompute, sat.raw, zero=policy.zero)
        try:
            pcg, costs, extraction = _solve_policy(step, sat, priced, policy, pinned, clock, machine,
                                                   lean=policy == ordered[-1] or lean_after)
        except ExtractionError as err:
            if failure is None or 0 < err.needed_bytes < (failure.needed_bytes or float("inf")):
                failure = MeshSearch(sat.mesh, sat.pins, result, None, None, None, None,
                                     time.perf_counter() - started, sat.spread, str(err), err.needed_bytes)
            if index == 1:
                break   # the policy holding least memory has no plan: the ones between have none either
            continue
        except RepeatError as err:   # this policy's plan cannot be repeated: another policy's may be
            step.say(f"mesh {sat.mesh}: {err}")
            failure = failure or MeshSearch(sat.mesh, sat.pins, result, None, None, None, None,
                                            time.perf_counter() - started, sat.spread,
                                            f"the plan's blocks cannot be repeated ({err}); --all-blocks "
                                            "searches every block")
            continue
        joint = Candidate(JOINT, pcg, costs, totals(costs, machine))
        # as the plan runs (`search.fit`): a stage plan that fits under none of its pipeline's schedules recomputes
        holds = step.memory.fits(joint)
        leaner = None if holds or leaned else _leaner_as_run(step, sat, priced, policy, pinned, clock, joint)
        if leaner is not None:
            pcg, costs, extraction, joint = leaner
            holds = leaned = True
        if found is None or step.memory.needs(joint) < step.memory.needs(found[3]):
            found = (policy, priced, extraction, joint)
        lean_after = lean_after or (index == 1 and extraction.lean)
        if holds:
            fitting[policy] = (policy, priced, extraction, joint)
            # the fastest policy that fits (the least-memory one is tried second but preferred last); a lean plan
            # fits by trading time for memory, and so does one extracted again leaner: a policy holding less may
            # fit faster, so go on after one
            if not extraction.lean and leaner is None and (index != 1 or len(ordered) <= 2):
                break
        elif index == 1 and len(ordered) > 2:
            break   # not even the policy holding least memory fits
        if index + 1 < len(ordered) and not holds:   # a plan that fits goes on to the next policy unsaid
            held = f"with {policy.describe()}" if policy.describe() else "keeping every activation"
            step.say(f"mesh {sat.mesh}: the plan {held} needs {fmt_bytes(step.memory.needs(joint))} per device"
                     + (" as its pipeline runs" if step.stage is not None else " by the per-node bound")
                     + ": extracting again with less held")
    if fitting:
        if step.stage is not None:
            # ranked as the stage step ranks its candidates (`rank`: the fastest pipelined plan that fits of those
            # priced from it; ties in the policies' order): a plan extracted again leaner keeping every activation
            # pipelines faster than one recomputing blocks, or one sharding the state, though the policies' order
            # says nothing of what the leaner extraction traded
            found = first_ranked([fitting[p] for p in ordered if p in fitting], step.memory, lambda f: f[3])
        else:
            plain = [p for p in ordered if p in fitting and not fitting[p][2].lean]
            # the first policy whose time-ranked extraction fits, as ever; else the fastest of the lean plans
            found = fitting[plain[0]] if plain else min(fitting.values(), key=lambda f: f[3].totals.time_s)
    return found, failure


LEANER_TRIES = 3   # extractions asked for one policy's stage plan that fits extraction's bound but not as run


def _solve_policy(step: StepContext, sat: Saturated, priced, policy: Policy, pinned, clock: Deadline,
                  machine: Machine, lean: bool):
    """`solve` of the step's saturated e-graph under `policy` (its recomputation and ZeRO stage) on `machine`:
    (pcg, costs, extraction); what `_extract_joint` asks for each policy and `_leaner_as_run` again with less
    memory."""
    request = step.request
    return solve(sat.result, step.searched, request.library, machine, sat.roots, clock.remaining(),
                 request.free_input_placements, pinned, pins=step.input_pins, costs=priced,
                 repetition=step.repetition, in_flight=step.in_flight, recompute=policy.recompute, zero=policy.zero,
                 computed=request.prices, lean=lean)


def _leaner_as_run(step: StepContext, sat: Saturated, priced, policy: Policy, pinned, clock: Deadline,
                   joint: Candidate) -> tuple | None:
    """A pipeline stage's plan of `policy` that fits as its pipeline runs it, where `joint`, extracted ranking memory
    by extraction's bound on the stage machine (p times a device's memory), fits that bound but not as run
    (`MemoryFit.overshoot`): (pcg, costs, extraction, candidate), or None where none was found (unstaged, `joint`
    fits, no schedule can run it, or LEANER_TRIES extractions did not fit).

    Why: the bound is extraction's additive estimate, and what fits is the pipeline's figure (`search.fit`); a
    plan over it by some factor is asked for again, lean (`extract.lean_choices` where the passes ranked by time
    do not fit), with the bound divided by that factor, and again by the factor the new plan is over, at most
    LEANER_TRIES times. Before, only the policy holding least memory was extracted lean, so a plan keeping every
    activation that fits as run was never asked for: llama-70b:64's `gpu0 4 x gpu1 2` stage plan kept them all at
    119.4 GiB a device as run (517.7 GiB by the bound, under 640), and its plan recomputed blocks (a third more
    compute) where one keeping them all, extracted at the bound scaled so, fits at 76.6 GiB and pipelines 5.7%
    faster. The capacities follow from the plans' figures alone, so the same e-graph gives the same plans. No
    bound skips it: before extracting, no floor of the plans the e-graph holds is near a bar (its LP relaxation
    is ~0 over the cycles of parallel operators: benchmarks/search_results.md, session 64 helper A2)."""
    overshoot = step.memory.overshoot(joint)
    machine = step.machine
    capacity = machine.memory_capacity
    for _ in range(LEANER_TRIES):
        if overshoot is None:
            return None
        capacity = int(capacity / overshoot)
        try:
            pcg, costs, extraction = _solve_policy(step, sat, priced, policy, pinned, clock,
                                                   replace(machine, memory_capacity=capacity), lean=True)
        except (ExtractionError, RepeatError):
            return None
        candidate = Candidate(JOINT, pcg, costs, totals(costs, machine))
        if step.memory.fits(candidate):
            step.say(f"mesh {sat.mesh}: the plan" + (f" with {policy.describe()}" if policy.describe() else "")
                     + f" extracted again within {fmt_bytes(capacity)} fits as its pipeline runs "
                     f"({fmt_bytes(step.memory.needs(candidate))} per device)")
            return pcg, costs, extraction, candidate
        overshoot = step.memory.overshoot(candidate)
    return None


def _restricted_baselines(step: StepContext, sat: Saturated, priced, policy: Policy,
                          clock: Deadline) -> tuple[Candidate | None, Candidate | None]:
    """The baselines that restrict the same e-graph: Megatron's layout (None where it uses no parallelism) and
    the best grid point."""
    request, graph, machine, result = step.request, step.searched, step.machine, sat.result
    grid = best_grid(result, graph, request.library, machine, sat.roots, clock.remaining(0.5),
                     request.free_input_placements, priced, step.input_pins, step.repetition, policy.recompute,
                     policy.zero, fits=step.memory.fits, computed=request.prices)
    megatron = None
    if step.stage is not None:
        return megatron, grid   # a pipeline stage's plan: its grid point is the one baseline the pipeline reads
    excluded = megatron_excluded(result.snapshot, leaf_roles(result.snapshot, graph))
    try:
        mpcg, mcosts, _ = solve(result, graph, request.library, machine, sat.roots, clock.remaining(),
                                request.free_input_placements, excluded, pins=step.input_pins, costs=priced,
                                repetition=step.repetition, recompute=policy.recompute,
                                zero=policy.zero, computed=request.prices)
        if mpcg.max_pieces > 1:
            megatron = Candidate("megatron", mpcg, mcosts, totals(mcosts, machine))
    except (ExtractionError, RepeatError):
        pass
    return megatron, grid
