"""The pipeline search: which pipeline degree, micro-batch count and schedule, around the joint search.

For each pipeline degree p tried, the joint search (`step.search_step`)
finds the stage plan: the whole model on a stage mesh of S = devices / p
devices. A stage holds about 1/p of the weights' state: extraction ranks
memory against a device p times the size. The first stage of 1F1B also
holds p micro-batches of 1/p of the layers' activations; when no schedule
of that stage plan fits, it is searched again ranking memory with p
micro-batches in flight (state + p x activations <= p x capacity is the
first stage's state / p + activations <= capacity), which finds leaner
stage plans. Those are extraction's estimates: what fits is judged, in
the stage search (its recomputation policy, its candidates, the grid's
points), by the figure the pricing gives (`cost.pipeline.StageFit`): the
plan cut into p stages, each stage's weights' state plus the activations
its schedule holds at its peak, in the schedule that needs least. A stage
plan that fits in no schedule keeping every activation is extracted again
recomputing blocks (`search.fit`, `mesh.search_mesh`).
`pipeline.pipelined` then chooses the cut points by the cost model and
prices each schedule; the fastest pipelined plan that fits competes with
the unstaged plan on the same cost model. This is Alpa's split (the
intra-operator plan from the e-graph inside an inter-operator pass over
stages), with one stage plan per stage-mesh size rather than one per stage.

The grid baseline gains Megatron-LM's PTD-P points the same way: the
grid's configuration found on each stage mesh, cut into stages of equal
layer counts (as Megatron cuts), run with 1F1B and interleaved 1F1B.

A pair that cannot win is not searched to the end: with the unstaged plan
known first (`optimize` searches it before the pipeline), its step and its
best grid point's are the bar (`bar_of`), and so are the fastest pipelined
plan and the fastest PTD-P point that fit of the pairs searched before
(`_bars`: a later pair's equal comes after them and is never chosen); a
scout's stage search stops, before simulating any candidate or pricing any
cut, where every stage plan it could choose has a pipelined floor at or above
the plans' bar and every grid point it could read a PTD-P floor at or above
the points' (`step.stop_where_cannot_win`, `StageFit.schedule_floors`: the
stages' fill, drain and busy time over the cuts whose memory can fit, at
least the nodes' per-step compute over the p stages, `StageFit.floor_s`).
The pair is listed in `tried` as skipped, with its floor and the bar
(llama-70b:64's 8 x 32, after 4 x 32's 16.777 s: 16.990 s). No
floor from the graph alone, before searching, is both sound and strong
enough: the stages' compute is mostly operators' dispatch and memory-bound
kernels, whose count equality saturation may change (fused or cancelled
operators), while its FLOPs at the best rate take under a quarter of the
bar on bert-large:64 (benchmarks/search_results.md).

The (degree, count) pairs are searched least 1F1B bubble first
(`search_order`: the likeliest fastest pair sets the bar for the rest) and
compared by scouts (`step`: each stage
plan searched on the first stage mesh, with the baselines built apart
from the e-graph); every stage mesh is then searched for the pair whose
pipelined plan ranks first (`_search_every_mesh`), and its plans join the
candidates, where that plan ranks before the unstaged plan. Between the two,
`optimize` may search every unstaged mesh (`sharpen`, given the scouts'
plans): the unstaged plan it returns is the bar of the search of every
stage mesh, which on llama-70b:64 (the unstaged plan on two axes 14.985 s,
the pipelined scout's 16.156 s) is then not run. The search of every stage
mesh itself stops, before simulating or pricing any candidate, where every
candidate of the meshes the scout did not search has a pipelined floor at or
above the scout's pipelined plan (its grid points at or above the fastest
PTD-P point too): nothing it could add would rank first
(`step.stop_where_cannot_win`; llama-70b:64's two-axis stage meshes at 8 x 64:
floors 16.52 s against 16.156).

Degrees tried: any p >= 2 dividing the devices whose stages are whole
nodes or a part dividing one (not only powers of two: Megatron-Core's
177B row runs 6 stages, SC'21's 530B row 35), from the smallest whose
stage (tensor parallelism inside a node, no ZeRO) holds its weights' state
in 80% of a device, two of them (one when pinned), and the degree below
those two where its stage holds the unsharded state in a whole device (the
80% share was a guess at the activations' room) and, as the stage plan
can shard it (ZeRO-1 over the stage's data-parallel replicas), the state
plus the activations 1F1B's first stage keeps (as `cost.saved` counts
them) in 80% of one: Megatron-Core's 314B row runs 8 stages, where the
unsharded state takes 90% of an H100, and 8, 12 and 16 are searched. A
model whose smaller stage's activations do not fit so (Llama 2 70B on 64
H100s), or whose unsharded state exceeds the device (GPT-3 175B on 1,024
A100s at 4 stages), searches the same two degrees as before. Micro-batch counts
about 4p and 8p (the 1F1B bubble (p - 1) / (m + p - 1) is then 16-43% at
most before interleaving), each a divisor of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from math import prod
from typing import Callable, Sequence

from parsat.dsl.library import Library
from parsat.ir.machine import Machine
from parsat.ir.pipeline import INTERLEAVED, ONE_F_ONE_B, SCHEDULES, PipelineError
from parsat.ir.plan import BaselinePlan, Plan
from parsat.cost.model import OPTIMIZER, weight_bytes
from parsat.search.deadline import Deadline
from parsat.ir.errors import CannotWin, DoesNotFit, OptimizeError
from parsat.cost.pipeline import PricedOnce, StageFit, StageMemo, StagePricer, applicable_schedules, equal_starts
from parsat.search.microbatches import rank_plans

DEGREES_TRIED = 2          # pipeline degrees searched when none is pinned
STATE_SHARE = 0.8          # of a device's memory the weights' state may take when choosing the least degree

StageSearch = Callable[[Machine, int, int, int, StageFit, "Deadline | None", bool], Plan]
"""(stage machine, stage devices, micro-batches, micro-batches extraction ranks in flight, how the pipeline runs
the stage plan (what fits: `search.fit`), its deadline, scout) -> the stage plan (a scout's searches the first
stage mesh only)"""

NOT_SEARCHED = "not searched: the search's time limit (--limit seconds) was reached before it"
INTERRUPTED = "not searched: the search was interrupted (Ctrl-C) before it"


@dataclass(frozen=True)
class PipelineSearch:
    """What the pipeline search found: its pipelined candidates, the PTD-P grid points, and what it tried."""

    plans: tuple[Plan, ...]
    grid: tuple[tuple[Plan, dict], ...]      # PTD-P points: the pipelined plan and its configuration
    tried: tuple[dict, ...]
    unstaged: Plan | None = None             # the unstaged plan after `sharpen` (the bar given, without one)


def pipeline_degrees(devices: int, machine: Machine, parameters: int, layers: int, pinned: int | None, *,
                     batch: int | None = None, sample_bytes: float = 0.0) -> list[int]:
    """The pipeline degrees to search (see the module docstring). `batch` and `sample_bytes` (the activations
    one sample keeps for backward over the whole model, `cost.saved.graph_kept_bytes` per sample) size the
    degree below the least one whose stage holds its unsharded state in the share; without a `batch` it is not
    tried."""
    if pinned is not None:
        return [pinned]
    node = machine.devices_per_node
    # a stage is whole nodes, or a part of one node that divides it (48 h100x8 GPUs in 4 stages of 12 is neither)
    degrees = [p for p in range(2, min(devices, layers) + 1) if devices % p == 0
               and (node % (devices // p) == 0 or (devices // p) % node == 0)]
    state = parameters * weight_bytes(machine)
    per_device = {p: state / (p * min(node, devices // p)) for p in degrees}
    fitting = [p for p in degrees if per_device[p] <= STATE_SHARE * machine.memory_capacity]
    if not fitting:
        return degrees[-DEGREES_TRIED:]
    start = degrees.index(fitting[0])
    below = degrees[start - 1] if start > 0 else None
    # the share is a guess at the activations' room: the degree below, whose unsharded state fits a device but
    # not the share, is searched too where its room, counted, holds (ZeRO-1's state and 1F1B's activations)
    if below is not None and batch is not None and per_device[below] <= machine.memory_capacity \
            and _sharded_stage_fits(below, devices, machine, parameters, batch, sample_bytes):
        return degrees[start - 1:start + DEGREES_TRIED]
    return degrees[start:start + DEGREES_TRIED]


def _sharded_stage_fits(p: int, devices: int, machine: Machine, parameters: int, batch: int,
                        sample_bytes: float) -> bool:
    """Whether a stage of `p` holds, in STATE_SHARE of a device, its weights' state as ZeRO-1 shards it over the
    stage's data-parallel replicas (tensor parallelism inside a node) and the activations 1F1B's first stage keeps:
    min(p, m) micro-batches of its 1/p of the layers, m the most micro-batches `microbatch_counts` tries, a
    micro-batch's samples split over the replicas (one at least), their activations over the tensor axis
    (sequence parallelism)."""
    tensor = min(machine.devices_per_node, devices // p)
    replicas = devices // (p * tensor)
    state = parameters / (p * tensor) * machine.precision_spec.parameter_bytes(OPTIMIZER).sharded(1, replicas)
    m = max(microbatch_counts(batch, p, None))
    samples = max(1.0, batch / (m * replicas))
    activations = sample_bytes * samples * min(p, m) / (p * tensor)
    return state + activations <= STATE_SHARE * machine.memory_capacity


def microbatch_counts(batch: int | None, degree: int, pinned: int | None) -> list[int]:
    """Micro-batch counts to search at pipeline degree `degree`: about 4p and 8p, divisors of the batch. Without a
    batch (a graph that is not a built-in example: its step is taken as one micro-batch's, `search.request.
    step_context`), 4p and 8p."""
    if pinned is not None:
        return [pinned]
    if batch is None:
        return [4 * degree, 8 * degree]
    counts = []
    for want in (4 * degree, 8 * degree):
        found = next((k for k in range(min(want, batch), batch + 1) if batch % k == 0), None)
        if found is not None and found not in counts:
            counts.append(found)
    return counts


def search_pipelines(search: StageSearch, machine: Machine, devices: int, batch: int | None, parameters: int,
                     layers: int, *, degree: int | None = None, microbatches: int | None = None,
                     schedule: str | None = None, say: Callable[[str], None] = lambda _m: None,
                     clock: Deadline | None = None, bar: Plan | None = None,
                     library: Library | None = None, sample_bytes: float | None = None, chunks: int | None = None,
                     sharpen: Callable[[tuple[Plan, ...]], Plan | None] | None = None) -> PipelineSearch:
    """Every pipelined candidate: stage plans searched per (degree, micro-batch count), cut and priced per
    schedule (`schedule` pins one). A degree or count whose stage plan cannot be found is said and skipped.
    With a `clock`, each (degree, count) gets an equal part of the time left, and those the clock leaves no
    time for are listed as not searched (the first one always is searched). `library`: the operators', with
    which a stage's price simulates its tensor-parallel overlap (`cost.pipeline.TpOverlap`). `bar`: the
    unstaged plan, searched before; a pair none of whose pipelined plans could beat it or its best grid point
    is listed as skipped (`bar_of`, the module docstring). `sample_bytes`: the activations one sample keeps
    over the whole model, with which the degrees count ZeRO-1 (`pipeline_degrees`; None: they do not).
    `chunks`: the interleaved schedule's chunks per stage, pinned (`cost.pipeline.schedule_chunks`).
    `sharpen`: given the scouts' pipelined plans, the unstaged plan to beat from then on (`optimize` searches
    every unstaged mesh there, where the scouts leave it within reach), which replaces `bar` before the search
    of every stage mesh; it is returned as `unstaged`."""
    if schedule is not None and schedule not in SCHEDULES:
        raise OptimizeError(f"unknown schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    plans: list[Plan] = []
    grid: list[tuple[Plan, dict]] = []
    tried: list[dict] = []
    # id of a plan priced from a scout's stage plan -> (p, m, in flight, that stage plan)
    scouted: dict[int, tuple[int, int, int, Plan]] = {}
    memos: dict[tuple[int, int, int], StageMemo] = {}   # (p, m, in flight) -> its scout's memo (`_search_every_mesh`)
    once, to_beat = PricedOnce(), bar_of(bar)
    degrees = pipeline_degrees(devices, machine, parameters, layers, degree,
                               batch=batch if sample_bytes is not None else None, sample_bytes=sample_bytes or 0.0)
    pairs = search_order([(p, m) for p in degrees for m in microbatch_counts(batch, p, microbatches)])
    for index, (p, m) in enumerate(pairs):
        stage_devices, stage_machine = devices // p, _stage_machine(machine, devices, p)
        if clock is not None and clock.spent and (index > 0 or clock.interrupted.is_set()):
            why = INTERRUPTED if clock.interrupted.is_set() else NOT_SEARCHED
            say(f"pipeline {p} stages x {m} micro-batches: {why}")
            tried.append({"pp": p, "microbatches": m, "error": why})
            continue
        # extraction first ranks one micro-batch alive (the fastest stage plan on p devices' memory), then, if
        # no schedule of it fits, the first stage's p in flight (a leaner stage plan); what fits is judged by the
        # schedules' figure either way (`StageFit`), recomputing blocks where keeping every activation fits none
        for in_flight in (1, min(p, m)):
            if in_flight > 1 and clock is not None and clock.spent:
                why = INTERRUPTED if clock.interrupted.is_set() else NOT_SEARCHED
                tried.append({"pp": p, "microbatches": m, "in_flight": in_flight, "error": why})
                break
            say(f"pipeline {p} stages of {stage_devices} devices, {m} micro-batches: searching the stage plan"
                + (f" ({in_flight} in flight)" if in_flight > 1 else ""))
            bar_s, grid_bar_s = _bars(to_beat, plans, grid, machine)
            fit = StageFit(p, machine, schedule, memo=StageMemo(library=library), chunks=chunks, bar_s=bar_s,
                           grid_bar_s=grid_bar_s, once=once)
            memos[(p, m, in_flight)] = fit.memo
            try:
                stage = search(stage_machine, stage_devices, m, in_flight, fit,
                               clock.part(1.0 / (len(pairs) - index)) if clock is not None else None, True)
            except CannotWin as err:
                say(f"pipeline {p} x {m} micro-batches: skipped, {err}")
                tried.append({"pp": p, "microbatches": m, "in_flight": in_flight, "skipped": str(err),
                              "floor_s": err.floor_s, "bar_s": err.bar_s})
                break
            except (DoesNotFit, OptimizeError) as err:
                say(f"pipeline {p} x {m} micro-batches: no stage plan ({err})")
                tried.append({"pp": p, "microbatches": m, "in_flight": in_flight, "error": str(err)})
                continue
            except KeyboardInterrupt:
                if clock is None:
                    raise
                clock.interrupt()   # the pairs after this one are listed as interrupted, the plans found stand
                tried.append({"pp": p, "microbatches": m, "in_flight": in_flight, "error": INTERRUPTED})
                break
            found = _priced(stage, p, m, schedule, machine, in_flight, tried, plans, grid, fit.memo, chunks, once)
            if stage.saturation.get("scouted"):
                scouted.update({id(plan): (p, m, in_flight, stage) for plan in found})
            if any(plan.totals.fits(machine) for plan in found) or in_flight == min(p, m):
                break
    if sharpen is not None:
        bar = sharpen(tuple(plans))
    if scouted and plans and not (clock is not None and clock.spent):
        _search_every_mesh(search, scouted, machine, devices, schedule, say, clock, tried, plans, grid, bar, library,
                           memos, chunks, once)
    return PipelineSearch(tuple(plans), tuple(grid), tuple(tried), bar)


def search_order(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (degree, micro-batch count) pairs in the order their scouts are searched: the least 1F1B bubble
    first, (p - 1) / (m + p - 1), the fraction of a step the first stage idles (ties in the order given).

    Why an order at all: a pair's scout stops before pricing anything where every plan it could give is at or
    above the fastest plan found so far (`_bars`, `step.stop_where_cannot_win`), so the search costs least
    when the fastest pair comes first; and the pair with the least bubble is the likeliest to be fastest: the
    stages' compute is the same work split alike at every count (a smaller micro-batch runs its products a
    little slower), while the bubble adds (p - 1) micro-batches' time to m of them. Degree-major order (the
    least degree's fewest micro-batches first) put llama-70b:64's 4 x 16 (bubble 3/19, its plan 18.131 s)
    before 4 x 32 (3/35, 14.624 s, the plan), so 4 x 16 was searched to the end, with no bar.

    Why the answer is the same in any order: each pair's plans and PTD-P points are what its search gives
    whatever was searched before, except that a pair none of whose plans could be below the bars is skipped
    (`CannotWin`), and a skipped pair's plans are all at or above a plan (or point) that fits and was found
    before it, so none of them would be chosen: `best_of`, `_search_every_mesh` and `optimize`'s `sharpen`
    choose the first-ranked plan and keep the first of equals. So the order changes which pairs are skipped
    and, on an exact tie of two pairs' steps, which of the equals comes first; `tried` lists the pairs in
    the order searched."""
    return sorted(pairs, key=lambda pair: (pair[0] - 1) / (pair[1] + pair[0] - 1))


def bar_of(flat: Plan | None) -> float | None:
    """The step a pipelined plan or PTD-P grid point must be below to matter (`StageFit.bar_s`), from the unstaged
    plan `flat` (a scout's, searched before the pipeline: `optimize`): its step and its best grid point's, the
    larger. A plan at or above both changes nothing: `best_of` keeps the unstaged plan on a tie and its best grid
    point unless one is strictly faster, `optimize` and `_search_every_mesh` act only on a pipelined plan that
    ranks strictly before the unstaged one; and the unstaged plan and best grid point the call ends with are at
    least as fast as the scout's (`microbatches.merged` keeps the faster of each). None (nothing is skipped)
    where there is no unstaged plan, it or its best grid point does not fit (a pipelined plan that fits would
    then win), or it has no best grid point (any PTD-P point would become it)."""
    if flat is None or not flat.totals.fits(flat.machine):
        return None
    grid = flat.baselines.get("best_grid")
    if grid is None or not grid.fits(flat.machine):
        return None
    return max(flat.totals.time_s, grid.time_s)


def _bars(to_beat: float | None, plans: Sequence[Plan], grid: Sequence[tuple[Plan, dict]], machine: Machine
          ) -> tuple[float | None, float | None]:
    """The bars of a scout's stage search (`StageFit.bar_s`, `grid_bar_s`): a pipelined plan priced from its stage
    plan matters only below the first, a PTD-P point only below the second; (None, None) where either role has
    no bar (nothing is skipped).

    Each role has two bars, either of which is enough. The unstaged plan's (`bar_of`), for both roles. And what
    the pairs searched before found: the fastest pipelined plan that fits so far, for the plans, and the
    fastest PTD-P point that fits so far, for the points. A later pair's plans and points come after those in
    `plans` and `grid`, and every choice made of them keeps the first of equals: `best_of` (the plan, the best
    grid point), `_search_every_mesh` (the first-ranked plan, `rank_plans`); `optimize`'s `sharpen` reads only
    the plans that rank before the unstaged scout and the fastest of them (`optimize._within_reach`). So a plan
    at or above the fastest that fits, or a point at or above the fastest point that fits, changes none of
    them, and one that does not fit ranks after those that do everywhere it is compared. Skipped pairs are
    listed in `tried` with the floor and the bar; nothing else of the plan differs."""
    fitting = [q.totals.time_s for q in plans if q.totals.fits(machine)]
    points = [g.totals.time_s for g, _c in grid if g.totals.fits(machine)]
    bar = min([b for b in (to_beat, min(fitting, default=None)) if b is not None], default=None)
    grid_bar = min([b for b in (to_beat, min(points, default=None)) if b is not None], default=None)
    if bar is None or grid_bar is None:
        return None, None
    return bar, grid_bar


def _stage_machine(machine: Machine, devices: int, p: int) -> Machine:
    """The machine a stage plan is searched on: a stage's devices, each p times the memory (a stage holds about
    1/p of the weights' state: the module docstring)."""
    return replace(machine.with_devices(devices // p), memory_capacity=machine.memory_capacity * p)


def _priced(stage: Plan, p: int, m: int, schedule: str | None, machine: Machine, in_flight: int,
            tried: list[dict], plans: list[Plan], grid: list[tuple[Plan, dict]],
            memo: StageMemo | None = None, chunks: int | None = None, once: "PricedOnce | None" = None
            ) -> list[Plan]:
    """`stage` cut and priced in every schedule that applies, added to `plans` with its grid points; those
    plans. `memo`: the layer maps and layouts of the stage search's memory checks (`StageFit.memo`); `chunks`:
    the interleaved chunks per stage pinned; `once`: the prices of the call's stage plans so far."""
    found = _price_schedules(stage, p, m, schedule, machine, in_flight, tried, memo, chunks, once)
    plans.extend(found)
    grid.extend(_grid_points(stage, p, [(plan.pipeline.schedule, plan.pipeline.layout.chunks_per_stage)
                                        for plan in found], machine, memo, once))
    return found


def _search_every_mesh(search: StageSearch, scouted: dict[int, tuple[int, int, int, Plan]], machine: Machine,
                       devices: int, schedule: str | None, say: Callable[[str], None], clock: Deadline | None,
                       tried: list[dict], plans: list[Plan], grid: list[tuple[Plan, dict]],
                       bar: Plan | None, library: Library | None = None,
                       memos: dict[tuple[int, int, int], StageMemo] | None = None,
                       fit_chunks: int | None = None, once: "PricedOnce | None" = None) -> None:
    """Every stage mesh searched for the pair of the pipelined plan that ranks first, when a scout found it and
    it ranks before `bar`: its plans and grid points join the candidates (the scout's stay).

    `memos`: each scout's `StageMemo` by (p, m, in flight). The search of every mesh at the pair takes its
    scout's: it judges the scout's first-mesh candidates and grid points again (`searched_once` and
    `step.independent_points` find them again, the same PCGs) and, where its stage plan is the scout's, cuts
    and prices the same PCG in the same schedules. A memo is a cache of what the stage plans' nodes, outputs,
    cuts and machine determine (layer maps, layouts, schedule orders, compute times, tensor-parallel overlaps,
    each keyed by all it reads: `StageMemo`), so a memo that holds more gives the same figures; llama-70b:64's
    search of every mesh worked out its scout's layer maps and overlaps again.

    The step is given the bars its new meshes' candidates must beat (`StageFit.bar_s`: `first`'s step, where it
    fits; `grid_bar_s`: the fastest PTD-P point that fits so far; `scouted_meshes`: the scout's first mesh is not
    bounded again) and stops with CannotWin where none can (`step.stop_where_cannot_win`), listed in `tried`.

    `scouted`: each plan priced from a scout's stage plan -> (p, m, in flight, that stage plan). Where the step
    chooses the scout's stage plan and grid point again, it answers with that plan (`StageFit.scout_plan`,
    `step._the_scouts_choice`), which is cut and priced here as its own would be: the same PCG and costs, so
    the same prices, schedules and grid points in `tried`, `plans` and `grid` (`PricedOnce`), each after the
    scout's equal one, which every choice made of them keeps (`_bars`)."""
    first = min(plans, key=rank_plans)
    if id(first) not in scouted or (bar is not None and rank_plans(bar) <= rank_plans(first)):
        return
    p, m, in_flight, scout = scouted[id(first)]
    once = once or PricedOnce()   # the stage step's ranking and this pricing read one table
    say(f"pipeline {p} stages x {m} micro-batches chosen: searching every stage mesh")
    memo = (memos or {}).get((p, m, in_flight)) or StageMemo(library=library)
    # the bars of the new meshes' candidates (`step.stop_where_cannot_win`): the first-ranked plan, the scout's,
    # where it fits, and the fastest PTD-P point that fits
    fitting_grid = [g.totals.time_s for g, _c in grid if g.totals.fits(machine)]
    fit = StageFit(p, machine, schedule, memo=memo, chunks=fit_chunks,
                   bar_s=first.totals.time_s if first.totals.fits(machine) else None,
                   grid_bar_s=min(fitting_grid) if fitting_grid else None, scouted_meshes=1, once=once,
                   scout_plan=scout)
    try:
        stage = search(_stage_machine(machine, devices, p), devices // p, m, in_flight, fit,
                       clock.part(1.0) if clock is not None else None, False)
    except CannotWin as err:
        say(f"pipeline {p} x {m} micro-batches, every stage mesh: skipped, {err}")
        tried.append({"pp": p, "microbatches": m, "in_flight": in_flight, "every_mesh": True, "skipped": str(err),
                      "floor_s": err.floor_s, "bar_s": err.bar_s})
        return
    except (DoesNotFit, OptimizeError) as err:
        say(f"pipeline {p} x {m} micro-batches, every stage mesh: no stage plan ({err})")
        return
    except KeyboardInterrupt:
        if clock is None:
            raise
        clock.interrupt()
        return
    _priced(stage, p, m, schedule, machine, in_flight, tried, plans, grid, fit.memo, fit_chunks, once)


def _price_schedules(stage: Plan, p: int, m: int, schedule: str | None, machine: Machine, in_flight: int,
                     tried: list[dict], memo: StageMemo | None = None, chunks: int | None = None,
                     once: "PricedOnce | None" = None) -> list[Plan]:
    """`stage` cut into p stages and priced in every schedule that applies (`chunks`: the interleaved chunks per
    stage pinned); each recorded in `tried`. `once`: prices found before are read (`PricedOnce`)."""
    found = []
    pricer = _pricer(stage, machine, memo)   # the stage plan's layers and node figures, once for all
    once = once or PricedOnce()
    layers = memo.layer_map(stage.pcg) if memo is not None else pricer().layer_map
    for name, v in applicable_schedules(schedule, p, m, layers.model_layers, chunks):
        try:
            plan = once.pipelined(stage, machine, pricer, p, name, v)
        except PipelineError as err:
            tried.append({"pp": p, "microbatches": m, "schedule": name, "error": str(err)})
            continue
        found.append(plan)
        tried.append({"pp": p, "microbatches": m, "in_flight": in_flight, "schedule": name, "chunks_per_stage": v,
                      "time_s": plan.totals.time_s, "peak_memory_bytes": plan.totals.peak_memory_bytes,
                      "fits": plan.totals.fits(machine)})
    return found


def _grid_points(stage: Plan, p: int, schedules: Sequence[tuple[str, int]], machine: Machine,
                 memo: StageMemo | None = None, once: "PricedOnce | None" = None) -> list[tuple[Plan, dict]]:
    """The grid's configuration on this stage mesh as PTD-P points: equal layer counts per stage, in each of
    `schedules` ((schedule, chunks per stage)) that Megatron runs (1F1B, interleaved). `once`: as
    `_price_schedules`'."""
    chosen = stage.baseline_plans.get("best_grid")
    schedules = [(name, v) for name, v in schedules if name in (ONE_F_ONE_B, INTERLEAVED)]
    if chosen is None or chosen.pcg is None or not schedules:
        return []
    gridded = replace(stage, pcg=chosen.pcg, costs=chosen.costs)
    pricer = _pricer(gridded, machine, memo)
    once = once or PricedOnce()
    layers = (memo.layer_map(chosen.pcg) if memo is not None else pricer().layer_map).layers
    points = []
    for name, v in schedules:
        try:
            plan = once.pipelined(gridded, machine, pricer, p, name, v, starts=equal_starts(layers, p * v))
        except PipelineError:
            continue
        config = {**dict(chosen.config or {}), "pp": p, "schedule": name, "chunks_per_stage": v,
                  "microbatches": stage.graph.microbatches, "cuts": "equal layer counts"}
        points.append((plan, config))
    return points


def _pricer(stage: Plan, machine: Machine, memo: StageMemo | None) -> Callable[[], StagePricer]:
    """The stage plan's `StagePricer`, made when first asked for (`PricedOnce` may need none)."""
    return cache(lambda: StagePricer(stage, machine, memo=memo))


def best_of(flat: Plan | None, found: PipelineSearch, machine: Machine, pinned: bool = False) -> Plan:
    """The fastest plan that fits (the unstaged one on a tie), with best_grid the best grid point of both and
    the pipeline search's trials in `saturation.pipeline_search`. With `pinned` degrees the plan keeps them:
    a grid point is compared with, never taken."""
    grid_plans = [] if pinned else [g for g, _c in found.grid]
    candidates = ([flat] if flat is not None else []) + list(found.plans) + grid_plans
    if not candidates:
        why = "; ".join(f"pp {t['pp']} x {t['microbatches']} micro-batches"
                        + (f" ({t['schedule']})" if "schedule" in t else "") + f": {t['error']}"
                        for t in found.tried if "error" in t)
        raise OptimizeError("no pipelined plan: " + (why or "no schedule applies to the micro-batch counts tried "
                                                            "(interleaved needs a multiple of the stages)"))
    # a grid point is a whole pipelined plan: when it is strictly the fastest it is the plan, and says so
    best = min(candidates, key=lambda c: (not c.totals.fits(machine), round(c.totals.time_s, 12), c is not flat,
                                          any(c is g for g in grid_plans)))
    if any(best is g for g in grid_plans):
        best = replace(best, extraction={**dict(best.extraction), "chosen": "best_grid"})
    # the unstaged search's baselines are over every device; a stage search's are over a stage's only
    baselines = dict(flat.baselines) if flat is not None else {}
    baseline_plans = dict(flat.baseline_plans) if flat is not None else {}
    if found.grid:
        # the fastest point that fits, else the one nearest to fitting (shown with the memory it needs)
        totals, config = min(((g.totals, c) for g, c in found.grid),
                             key=lambda g: (not g[0].fits(machine),
                                            g[0].time_s if g[0].fits(machine) else g[0].memory_bytes))
        current = baselines.get("best_grid")
        if current is None or (totals.fits(machine), -totals.time_s) > (current.fits(machine), -current.time_s):
            baselines["best_grid"] = totals
            baseline_plans["best_grid"] = BaselinePlan(None, {}, config)
    saturation = {**dict(best.saturation), "pipeline_search": list(found.tried)}
    unsearched = list(dict.fromkeys(f"pp {t['pp']} x {t['microbatches']} micro-batches" for t in found.tried
                                    if t.get("error") in (NOT_SEARCHED, INTERRUPTED)))
    if unsearched:   # said where explain shows it, beside what the unstaged search left out
        why = ("the search was interrupted (Ctrl-C)" if any(t.get("error") == INTERRUPTED for t in found.tried)
               else "the time limit (--limit seconds) was reached")
        said = f"pipeline {', '.join(unsearched)} not searched: {why}"
        saturation["search_limit"] = "; ".join(filter(None, (saturation.get("search_limit"), said)))
    return replace(best, baselines=baselines, baseline_plans=baseline_plans, saturation=saturation)


def parameters_of(graph) -> int:
    """Trained parameters of a graph (its weights' elements)."""
    return sum(prod(w.shape) for w in graph.weights)
