"""One step's search: every device mesh searched, every candidate simulated, the best assembled into a Plan.

`search_step` is what `optimize` runs once per micro-batch count and once
per pipeline stage plan (`StepContext`): saturate on every mesh the
devices can form (`inputs.search_meshes`, docs/MESH.md, or the meshes the
`--degrees` pins ask for), extract each mesh's joint plan and restricted
baselines (`mesh.search_mesh`), add the baselines built apart from the
e-graph (data parallelism, the sequential search), simulate every
candidate's step (`mesh.CandidateSteps`), and keep the best that fits (the
joint plan on a tie; where `--degrees` pins, one that keeps the pins).

A scout's step (`StepContext.scout`) searches the first mesh only (one
axis: the cheapest to saturate, a tenth of a two-axis mesh's e-graph) with
every baseline built apart from the e-graph (data parallelism, the grid of
every mesh built directly): the micro-batch search and the pipeline search
compare their counts and (degree, count) pairs by scouts, then search every
mesh at the one they choose, so the e-graphs of the two-axis meshes are
saturated once per call rather than once per count and pair. The plan of
a scout says so (`saturation.scouted`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Sequence

from parsat.dsl.library import Library
from parsat.ir.costs import Totals
from parsat.ir.errors import CannotWin, DoesNotFit, OptimizeError
from parsat.dsl.parallel_ops import PARTITION
from parsat.ir.mesh import Mesh
from parsat.ir.parallelism import sequence_split
from parsat.ir.pcg import PCG
from parsat.ir.recompute import AUTO
from parsat.ir.pcg_placement import derive_placements
from parsat.ir.placement import PARTIAL, Placement, PlacementError, shard_dim
from parsat.ir.plan import JOINT, BaselinePlan, Plan
from parsat.ir.units import fmt_bytes, fmt_bytes_pair
from parsat.egraph.runner import STOP_INTERRUPTED, STOP_SATURATED, Limits
from parsat.egraph.snapshot import Snapshot
from parsat.search.baselines import Candidate, data_parallel, expert_parallel, grid_families, sequential
from parsat.search.solve import pcg_node_costs
from parsat.search.deadline import Deadline
from parsat.search.inputs import pinned_layouts, pins_on, search_meshes
from parsat.search.mesh import (BestFirst, CandidateSteps, MeshSearch, PipelinedSteps, best, first_ranked, rank,
                                search_mesh)
from parsat.search.request import SearchRequest, StepContext
from parsat.search.provenance import rules_used
from parsat.search.strategies import PINNABLE, Config

NO_PINNED_LAYOUT = "no plan uses the pinned axes that way"
FIRST_MESH_SHARE = 0.5   # of a search's time, for its first mesh when several are searched
MESHES_SHARE = 0.8       # of a search's time, for its meshes (saturation, extraction); then the candidates' steps


@dataclass(frozen=True)
class MeshChoice:
    """A mesh to search: its grid configuration when `--degrees` pins one, and the pinned placements on it."""

    mesh: Mesh
    config: Config | None
    pins: dict[str, Placement]


def search_step(step: StepContext, clock: Deadline) -> Plan:
    """The cheapest plan of one step (see the module docstring), all before `clock`'s deadline. Raises
    OptimizeError (DoesNotFit when no plan fits in memory) with a message for the user; where no mesh gives a
    joint plan because a safety valve cut the search, the best baseline that fits instead (`_valve_cut`).

    A scout's step whose first mesh holds no plan that fits searches every mesh when a point of the
    independent grid fits: a two-axis mesh (tensor parallelism inside a node) holds what one axis cannot, and
    a count or pair must not be judged by the one mesh that fails. (A scout's plan that comes back is the best
    of that mesh's and of every grid point, two-axis ones included: when it does not fit, no grid point
    does.)"""
    choices = mesh_choices(step)
    if not step.scout or len(choices) == 1:   # one mesh: a scout's step is the whole step
        return _search_step(step, clock, choices)
    try:
        return _search_step(step, clock, choices[:1], left_out=choices[1:])
    except DoesNotFit:
        if step.pins or not a_grid_point_fits(step):
            raise
        step.say("no plan on the first mesh fits where a grid point does: searching every mesh")
        return _search_step(step, clock, choices)


def _search_step(step: StepContext, clock: Deadline, choices: Sequence[MeshChoice],
                 left_out: Sequence[MeshChoice] = ()) -> Plan:
    """`search_step` on the meshes `choices`; `left_out`, the meshes a scout's step does not search, are said
    in the plan (`saturation.scouted`). Where no mesh gives a joint plan (none that fits, or none at all) the
    step answers with the best baseline that fits, saying why (`_fallen_back`), and fails only where none fits:
    the grid's points and data parallelism are built apart from the e-graph, so a configuration the joint
    extraction cannot reach (mcore-119b's stage at 4 stages x 16 micro-batches: every mesh's joint plan needed
    444-2186 GiB where the grid's tp 8 point fits; the same row pinned to it ran) is answered, not refused.
    Scouts still raise where the caller reads DoesNotFit: a scout's first mesh, and an unstaged count's scout
    (the micro-batch search chooses its next count by it)."""
    said = {}
    if left_out:
        said["scouted"] = (f"mesh {', '.join(str(c.mesh) for c in choices)} searched, "
                           f"{', '.join(str(c.mesh) for c in left_out)} not: "
                           "a scout's step, compared with the other micro-batch counts or pipeline pairs")
    searches = search_meshes_of(step, choices, clock)
    pinned = choices[0].config is not None
    unspread = _unspread(step, searches)
    steps = CandidateSteps(step.request.library, step.machine, step.graph.microbatches, step.request.simulations,
                           refusing=_refusing(step))
    if not pinned:
        stop_where_cannot_win(step, searches)
        scouts = _the_scouts_choice(step, searches, steps, clock)
        if scouts is not None:
            return scouts
    ranked = step_read(step)
    searches = [s.simulated(steps, ranked) for s in searches]
    if pinned:
        searches = [_keeping_pins(s, step) for s in searches]
    solved = [s for s in searches if s.joint is not None]
    cut = "" if solved else _valve_cut(searches, choices, clock)
    if not solved and not cut and not pinned and (left_out or (step.scout and step.stage is None)):
        # a scout's first mesh: `search_step` searches every mesh then; an unstaged count's scout: the
        # micro-batch search reads DoesNotFit to try other counts (`microbatches.CountSearch`)
        raise _no_joint_plan(step, searches)
    best_search = first_ranked(solved, step.memory, lambda s: s.joint) if solved else searches[0]
    candidates, found_baselines, skipped = _compared(step, searches, best_search, steps, clock, pinned)
    if not candidates:
        # nothing to fall back to (pinned inputs, or pinned degrees: no baseline keeps them)
        raise _pin_error(step, searches) if pinned else _no_joint_plan(step, searches)
    if solved and not cut and step.stage is None:
        # (a stage plan's fit is its pipeline's, `search.fit`: the pipeline search judges it per schedule)
        chosen = _first_placeable(step, candidates)
        if chosen is not None and not step.memory.fits(chosen):
            raise _over_as_simulated(step, chosen)
    if _settle_grid(step, steps) or steps.refused:   # a plan is made: as if nothing had been refused (`_refusing`)
        steps.refusing = False
        searches = [s.settled(steps) for s in searches]
        candidates, found_baselines, skipped = _compared(step, searches, best_search, steps, clock, pinned)
    plan = assemble_plan(step, searches, best_search, candidates, found_baselines, skipped, steps)
    if unspread:
        said["unspread"] = unspread
    if cut:
        plan = _fallen_back(step, searches, plan, f"no joint plan once the search was cut ({_mesh_errors(searches)})")
        said["search_limit"] = cut   # which valve cut the search, the meshes it left unsearched included
    elif not solved and pinned:
        plan = _fallen_back(step, searches, plan, _pins_unheld(step, searches))
    elif not solved:
        plan = _fallen_back(step, searches, plan, f"no joint plan ({_mesh_errors(searches)})")
    elif clock.interrupted.is_set() and len(searches) < len(choices):
        said["search_limit"] = (f"interrupted (Ctrl-C): meshes "
                                f"{', '.join(str(c.mesh) for c in choices[len(searches):])} not searched")
    return replace(plan, saturation={**dict(plan.saturation), **said}) if said else plan


def stop_where_cannot_win(step: StepContext, searches: Sequence[MeshSearch]) -> None:
    """Raise CannotWin where this pipeline stage's step can lead to no plan that matters: every candidate the step
    could choose as the stage plan has a pipelined floor (`StageFit.schedule_floors`: every cut and schedule of
    it) at or above the bar its pipelined plans must beat (`StageFit.bar_s`), and every one it could choose as
    its grid point (which `pipeline_search._grid_points` prices as PTD-P points) a PTD-P floor at or above the
    bar of the grid's points (`StageFit.grid_bar_s`, `bar_s` where None), so no plan priced from the step's
    plans is below them. Called before any candidate is simulated or priced in a schedule (the step's costliest
    part on a stage).

    The candidates bounded are every one `compare_baselines` and `assemble_plan` can choose from: each mesh's
    joint plan, Megatron and restricted grid point, data parallelism, expert parallelism, and every point of the
    independent grid (`baselines.grid_families` as `independent_points` makes them; a family whose first layout's
    floor is at or above both bars is not built further, `_stage_candidates`), the sequential baseline being
    never built for a stage; the grid's role is taken by the meshes' grid points, data parallelism and the
    independent grid's points (`compare_baselines`). Only where some mesh has a joint plan (otherwise the step
    falls back or fails as before), and only where the plan the step would choose surely fits (`_surely_fits`):
    the pipeline search then prices a plan that fits, and never searches the pair again with more micro-batches
    in flight, so stopping changes no other search. A candidate that does not fit (`step.memory`) is then left
    out: the step ranks those that fit first, so it chooses none of them as its stage plan, and none as its grid
    point either, or where it would (no point fits), none of its PTD-P points fits: they run the equal cut in
    1F1B and interleaved, which the memory check judges among the cuts it starts from (`StagePricer.start_cuts`,
    `least_peak_bytes`) and where that cut cannot be made no point is priced. A plan that does not fit changes
    nothing beside a bar that fits (`pipeline_search.bar_of`, `_bars`: each bar is a plan or point that fits).
    The search of every stage mesh at a scout's pair (`StageFit.scouted_meshes`) bounds only the candidates of
    the meshes the scout did not search (`_stop_where_nothing_new_wins`)."""
    fit = step.stage
    if fit is None or fit.bar_s is None or step.pins or step.request.parallel_dims:
        return
    solved = [s for s in searches if s.joint is not None]
    if not solved:
        return
    if fit.scouted_meshes:
        _stop_where_nothing_new_wins(step, searches)
        return
    if not _surely_fits(step, solved):
        return
    bar = fit.bar_s
    grid_bar = bar if fit.grid_bar_s is None else fit.grid_bar_s
    least = math.inf
    for candidate, grid in _stage_candidates(step, searches, max(bar, grid_bar)):
        if not step.memory.fits(candidate):
            continue
        plans, points = fit.schedule_floors(Plan(step.graph, step.machine, step.devices, candidate.pcg,
                                                 candidate.costs, candidate.totals))
        if plans < bar or (grid and points < grid_bar):
            return
        least = min(least, plans)
    if math.isfinite(least):
        raise CannotWin(least, bar)


def _stop_where_nothing_new_wins(step: StepContext, searches: Sequence[MeshSearch]) -> None:
    """Raise CannotWin where the search of every stage mesh at a scout's pair (`pipeline_search._search_every_mesh`)
    can add nothing that matters: every candidate of the meshes the scout did not search (their joint plan,
    Megatron and restricted grid point) can be placed and has a pipelined floor (`StageFit.floor_s`) at or above
    `StageFit.bar_s`, the pipelined plan the scout's stage plan gave (the first-ranked so far, which fits), and
    each such grid point at or above `StageFit.grid_bar_s` too (the fastest PTD-P point that fits so far).
    Called, as `stop_where_cannot_win`, before any candidate is simulated or priced; only where no wall-clock
    limit applies (`_refusing`'s condition: the first mesh's search, the grid and data and expert parallelism
    are then the scout's own, kept for the call: `searched_once`, `independent_points`, `built_once`) and no
    safety valve cut a mesh.

    Why nothing it would add matters. The step chooses, of its candidates that can be placed, the first by
    `rank` (`assemble_plan`), and its grid point is the first by `rank` of its grid's points (`best`); the
    pipeline search prices the chosen one in every schedule and the grid point as PTD-P points. Its candidates
    are the scout's (with the same simulated steps and memory figures, shared for the call) in the same order of
    roles (joint, Megatron, data and expert parallelism, grid point; the scout's mesh first among the meshes),
    where a new mesh's candidate may take a role's place by ranking first in it. If the chosen one is new, every
    plan priced from it is at or above its floor, so at or above the bar: appended after the scout's plan, it
    never ranks before it (`best_of` keeps the first on a tie). If it is one of the scout's, it is the scout's
    chosen stage plan S: were it another, X, then X ranks no later than S here, or than the new candidate N
    holding S's role (which can be placed, so X ranks no later than N, and N no later than S in that role); the
    scout ranked S no later than X, so all tie and the earlier role wins in both steps, S's role in the scout's
    and X's here, which cannot both hold. S priced again gives the scout's plans again (`PricedOnce`), after
    them. The grid point likewise: a new one's PTD-P points are at or above the grid bar, and one of the scout's
    is the scout's own (the same argument over the grid's points), priced again. So the plans, the best plan and
    the best grid point are what searching on gives; only `tried` lacks the pair's repeated schedules."""
    fit, request = step.stage, step.request
    if request.limits.clocked or any(s.cut for s in searches):
        return
    grid_bar = None if fit.grid_bar_s is None else max(fit.bar_s, fit.grid_bar_s)
    least = math.inf
    for search in searches[fit.scouted_meshes:]:
        for candidate, bar in ((search.joint, fit.bar_s), (search.megatron, fit.bar_s), (search.grid, grid_bar)):
            if candidate is None:
                continue
            if bar is None or _unplaceable([candidate], request.library, request.built):
                return
            floor = fit.floor_s(candidate.pcg, candidate.costs)
            least = min(least, floor)
            if floor < bar:
                return
    if math.isfinite(least):
        raise CannotWin(least, fit.bar_s)


def _the_scouts_choice(step: StepContext, searches: Sequence[MeshSearch], steps: CandidateSteps,
                       clock: Deadline) -> Plan | None:
    """The scout's stage plan (`StageFit.scout_plan`) where the search of every stage mesh at its pair chooses, of
    its candidates, the scout's stage plan and grid point again (the same PCGs and node costs, and the grid
    point's configuration), else None: the step then makes its own plan, as before. Asked before any candidate's
    step is simulated (what the plan's `saturation.meshes` shows of each mesh's joint plan: llama-70b:64's three
    two-axis meshes' plans, ~0.7 CPU s each), and only where no wall-clock limit applies and no safety valve
    cut a mesh (`_stop_where_nothing_new_wins`' conditions: the scout's candidates are then the same objects).

    Why the answer is the same. A stage step ranks its candidates by their stage memory figure and pipelined price
    (`mesh.rank`), neither of which simulating changes (`step_read`), so the candidates (`compare_baselines`,
    its grid point the first by `rank` of the grid's points) and the one chosen (`_first_placeable`, as
    `assemble_plan` chooses) are what the simulated searches give. What the pipeline search reads of the stage
    plan it gets (`pipeline_search._priced`) is the chosen PCG and costs and its best grid point's PCG, costs
    and configuration, with its graph, machine and devices (the scout's step's: the same pair); the prices are
    kept by those (`PricedOnce`), so the schedules, `tried` entries and grid points are the scout's, and its
    plans, equal to the scout's and after them, are never chosen over them (`pipeline_search._bars`). The rest
    of the step's own plan (every mesh's summary, its baselines' totals) would reach no plan."""
    fit, request = step.stage, step.request
    scout = fit.scout_plan if fit is not None and fit.scouted_meshes else None
    if scout is None or step.pins or request.parallel_dims or request.limits.clocked or \
            any(s.cut for s in searches):
        return None
    solved = [s for s in searches if s.joint is not None]
    if not solved:
        return None
    candidates, _found, _skipped = compare_baselines(step, searches, first_ranked(solved, step.memory,
                                                                                  lambda s: s.joint), steps, clock)
    chosen = _first_placeable(step, candidates)
    grid = next((c for c in candidates if c.name == "best_grid"
                 and not _unplaceable([c], request.library, request.built)), None)
    kept = scout.baseline_plans.get("best_grid")
    same_grid = grid is None and kept is None or grid is not None and kept is not None and \
        grid.pcg is kept.pcg and grid.costs is kept.costs and grid.config == kept.config
    if chosen is None or chosen.pcg is not scout.pcg or chosen.costs is not scout.costs or not same_grid:
        return None
    step.say("every stage mesh searched: the scout's stage plan and grid point chosen again")
    return scout


def _stage_candidates(step: StepContext, searches: Sequence[MeshSearch], family_bar: float
                      ) -> Iterator[tuple[Candidate, bool]]:
    """Every candidate a stage step can choose from (`stop_where_cannot_win`), each with whether it can be the
    step's grid point, the cheapest to build first: the meshes' plans, then data and expert parallelism, then the
    points of the independent grid, as `independent_points` makes them, less the families whose first layout has
    a floor (`StageFit.floor_s`) at or above `family_bar`: every point of such a family is as slow.

    A grid family's points are its layout laid out with ZeRO 0 and with ZeRO 3 (weights stored split and
    all-gathered into the placement their readers take, every other value laid out alike:
    `baselines.grid_families`), each in the forms `baselines._fitting_point` and `_GridPricer.priced` give it
    (the ZeRO stage as pinned or as fits, recomputing blocks). Their compute nodes are the same, with the same
    inputs' placements, so the same forward and backward seconds; the ZeRO stage prices only parallel nodes
    (`solve.restaged_node_costs`), whose forward_s and backward_s are 0 (`cost.model.parallel_cost`: a
    collective's time is its comm_s), and recomputation adds each recomputed forward to its backward
    (`NodeCost.recomputed`). So the family's first layout, priced as laid out (`solve.pcg_node_costs`), has a
    floor no higher than any of its points', at or above each of their `schedule_floors` (the mean busy time):
    the rest of the family is not built (`grid_families`' `skip`). That layout's parallel nodes are not priced
    either (`_not_parallel`): the floor reads forward_s and backward_s alone, a parallel node's are 0
    (`cost.model.parallel_cost`, `NodeCost()` where no gradient flows), and a sum less terms that are 0.0 is the
    same float; a layout that cannot be priced so is built on (its points judged one by one). The fit of a
    family's points is judged as `independent_points` judges it (`step.memory`), so they take the same forms."""
    request = step.request
    for search in searches:
        yield from ((c, grid) for c, grid in ((search.joint, False), (search.megatron, False), (search.grid, True))
                    if c is not None)
    for build, grid in ((data_parallel, True), (expert_parallel, False)):
        found = built_once(step, build)
        if found is not None:
            yield found, grid

    priced: dict = {}   # the first layouts' node costs, which the floor works out and their points read

    def slow(pcg: PCG) -> bool:   # asked of each family's first layout before the family is built further
        floor = _stage_layout_floor(step, pcg, priced)
        return floor is not None and floor >= family_bar
    for family in _grid_families(step, skip=slow, priced=priced):
        yield from ((point, True) for _place, point in family)


def _stage_layout_floor(step: StepContext, pcg: PCG, priced: dict | None = None) -> float | None:
    """A lower bound of every pipelined plan priced from any point of the grid family whose first layout is `pcg`
    (a pipeline stage's step, `StageFit.floor_s`; `_stage_candidates` argues it), None where the layout cannot
    be priced so (its points are then judged one by one). `priced` (`grid_families`' `priced`): the layout's
    node costs, every node priced, are kept there for its first point, which then reads them rather than pricing
    the PCG again (compute nodes twice per family on llama-70b:64's stage grids); the floor reads of them only
    what it reads of the compute nodes' alone (the parallel nodes' forward_s and backward_s are 0.0, and a
    float sum with terms 0.0 added is the same float), so it is the same figure. Where some parallel node
    cannot be priced, the compute nodes alone are priced for the floor, as without `priced`."""
    request = step.request
    args = (request.library, step.machine, request.free_input_placements, step.graph.microbatches)
    costs = pcg_node_costs(pcg, *args, computed=request.prices) if priced is not None else None
    if costs is not None:
        priced[id(pcg)] = (pcg, costs)   # the PCG kept beside its costs, so that its id stays its own
    else:
        costs = pcg_node_costs(pcg, *args, only=_not_parallel, computed=request.prices)
    return None if costs is None else step.stage.floor_s(pcg, costs)


def _not_parallel(node) -> bool:
    """Whether a PCG node is a leaf or a compute node (what `_stage_candidates` prices for a family's floor)."""
    return node.kind != "parallel"


def _surely_fits(step: StepContext, solved: Sequence[MeshSearch]) -> bool:
    """Whether the stage plan the step would choose fits (`step.memory`): it is the first by `rank` of the
    candidates that can be placed, which fit first, so it fits where one that is surely among them fits and can
    be placed: data parallelism (built alike by `compare_baselines` where baselines are asked for), or the joint
    plan of the one mesh that has one."""
    request = step.request
    sure = [built_once(step, data_parallel)] if request.baselines else []
    if len(solved) == 1:
        sure.append(solved[0].joint)
    return any(c is not None and step.memory.fits(c) and not _unplaceable([c], request.library, request.built)
               for c in sure)


def _keeping_pins(search: MeshSearch, step: StepContext) -> MeshSearch:
    """`search`, or, where its joint plan leaves a pinned axis idle (`idle_pinned_axes`), the search without a
    joint plan, its error naming the axis: the step then answers with a baseline that keeps the pins (the grid's
    point of the pinned layout) or refuses, never with an idle axis. Extraction within a pinned configuration
    splits every pinned axis (`strategies.config_excluded`); this holds the promise wherever it does not."""
    request = step.request
    idle = idle_pinned_axes(search.joint.pcg, request.parallel_dims, request.sequence_parallel) \
        if search.joint is not None else {}
    if not idle:
        return search
    why = "; ".join(f"its plan leaves axis {kind} idle: {reason}" for kind, reason in idle.items())
    step.say(f"mesh {search.mesh}: {why}")
    return replace(search, joint=None, extraction=None, error=why)


def _pins_unheld(step: StepContext, searches: Sequence[MeshSearch]) -> str:
    """Why no mesh's joint plan keeps the pinned degrees, said where a baseline that keeps them (the grid's
    point of the pinned layout, data parallelism built apart from the e-graph) is the plan instead: a data-parallel
    plan exists whatever the rules reach, so a pin it keeps is answered, not refused."""
    return f"no joint plan keeps --degrees {_pins(step)} ({_mesh_errors(searches) or NO_PINNED_LAYOUT})"


def _mesh_errors(searches: Sequence[MeshSearch]) -> str:
    """Each mesh's reason for having no joint plan."""
    return "; ".join(f"mesh {s.mesh}: {s.error}" for s in searches if s.error)


def _pin_error(step: StepContext, searches: Sequence[MeshSearch]) -> OptimizeError:
    """A pin that no plan keeps, neither a joint plan nor a baseline: the error names it."""
    return OptimizeError(f"--degrees {_pins(step)} cannot hold for '{step.graph.name}': "
                         f"{searches[0].error or NO_PINNED_LAYOUT}")


def _pins(step: StepContext) -> str:
    """The pinned degrees as the user wrote them (`dp=2, tp=2`, `sp=2` with sequence parallelism pinned on)."""
    request = step.request
    pins = [f"{k}={v}" for k, v in request.parallel_dims.items()]
    if request.sequence_parallel is not None:
        pins.append(f"sp={request.parallel_dims['tp'] if request.sequence_parallel else 1}")
    return ", ".join(pins)


def _compared(step: StepContext, searches: Sequence[MeshSearch], best_search: MeshSearch, steps: CandidateSteps,
              clock: Deadline, pinned: bool):
    """`compare_baselines`' (candidates, baselines found, skipped), where the degrees are `pinned` only the
    candidates that keep the pins beside the joint plan (only such a plan may stand for it)."""
    candidates, found_baselines, skipped = compare_baselines(step, searches, best_search, steps, clock)
    if pinned:
        candidates = [c for c in candidates if c.name == JOINT or keeps_pins(c, step.request)]
    return candidates, found_baselines, skipped


def _refusing(step: StepContext) -> bool:
    """Whether the step refuses, unsimulated, a baseline whose simulated peak is surely over the device's memory
    (`CandidateSteps.refusing`, `pcg_tasks.peak_floor`): an unstaged step, where nothing cuts the search by the
    wall clock. Such a candidate does not fit as simulated either, so whether any candidate fits, and which
    fitting one is chosen, is what simulating every one gives; simulating is needed only for the plan's figures
    (its baselines' steps) and for ranking candidates that do not fit. A step where none fits makes no plan
    (`_over_as_simulated`: llama-70b:64's unstaged counts, whose grid points simulate at 142-230 GiB), so its
    refused ones are never simulated; a step that makes a plan simulates them after all and chooses its
    baselines again (`_search_step`), reading what the first pass built (`built_once`, the sequential baseline
    and the independent grid, kept for the call where no wall-clock limit applies). The joint plans are always
    simulated (`MeshSearch.simulated`): the step picks its best mesh by them, which decides where the sequential
    baseline is built. A stage step judges memory by its pipeline (`search.fit`), not by a simulated peak."""
    return step.stage is None and not step.request.limits.clocked


def _settle_grid(step: StepContext, steps: CandidateSteps) -> bool:
    """The step's independent grid (`independent_points`, kept for the call: an earlier step, a scout's, may have
    made it and refused some of its points) with the points refused by their floors simulated after all: by
    `steps` where it refused them (a simulator failure is then said in the plan, as when the grid was made
    here), else by a step of its own, whose failures are not said (as when an earlier step made the grid).
    Whether any point was refused."""
    request = step.request
    key = (step.graph, step.machine, step.devices, step.stage)
    points = request.grid_points.get(key)
    if not points or not any(p.totals.floor_bytes is not None for p in points):
        return False
    other = CandidateSteps(request.library, step.machine, step.graph.microbatches, request.simulations)
    request.grid_points[key] = [(steps if p.pcg in steps.refused else other).settled(p) for p in points]
    return True


def _no_joint_plan(step: StepContext, searches: Sequence[MeshSearch]) -> OptimizeError:
    """Why no mesh gave a joint plan, as the step's error: DoesNotFit with what the leanest plan needs when
    nothing fits in memory (the micro-batch search splits the batch on it), else the first mesh's error."""
    needs = [s for s in searches if s.needed_bytes]
    if needs:
        least = min(needs, key=lambda s: s.needed_bytes)
        return DoesNotFit(least.error, least.needed_bytes, step.machine.memory_capacity)
    return OptimizeError(searches[0].error or f"no plan for '{step.graph.name}' on {step.devices} devices")


def _first_placeable(step: StepContext, candidates: Sequence[Candidate]) -> Candidate | None:
    """The candidate `assemble_plan` would choose (None where none can be placed), finding out which can be placed
    in `rank`'s order and only until one can: the first by `rank` of those that can be placed (a stable sort, so
    ties in the candidates' order, as `min` breaks them). A step whose chosen candidate does not fit ends there
    (`_over_as_simulated`), and its plan is never made: an unstaged count at which nothing fits placed every
    candidate before (llama-70b:64: ~0.2 CPU s at each of its three counts), of which only the chosen one's
    answer is read. The answers found are kept (`_unplaceable`'s `known`), so a plan made after reads them, and
    says which were left out (`assemble_plan`; a step that ends here makes no plan to leave them out of)."""
    request = step.request
    for candidate in sorted(candidates, key=lambda c: rank(c, step.memory)):
        if not _unplaceable([candidate], request.library, request.built):
            return candidate
    return None


def _over_as_simulated(step: StepContext, plan: Plan | Candidate) -> DoesNotFit:
    """The step's error where a mesh's joint plan fitted by the per-node bound (extraction's memory limit) but
    no candidate fits as it runs. `plan` is the first by `rank` of those that can be placed, so the figure is
    the simulated peak (`ir.costs.Totals.memory_bytes`, transient buffers included) of the leanest candidate
    that was simulated (`MemoryFit.leanness`: simulated peaks are compared with simulated peaks, and a
    candidate never simulated, its per-node bound over the device's memory, ranks after them); it is a per-node
    bound only where no candidate could be simulated, and the message then says so. DoesNotFit, so the
    micro-batch search splits the batch further (issue 28: one figure decides what fits)."""
    needs, has = fmt_bytes_pair(step.memory.needs(plan), step.machine.memory_capacity)
    bound = fmt_bytes(plan.totals.peak_memory_bytes)
    if plan.totals.simulation is not None:
        how = f" as simulated (transient buffers included; {bound} by the per-node bound)"
    elif plan.totals.floor_bytes is not None:
        needs = f"at least {needs}"
        how = f" as it would simulate (a lower bound of its simulated peak, not simulated; {bound} by the per-node bound)"
    else:
        how = " by the per-node bound (not simulated)"
    return DoesNotFit(f"no plan fits in memory: the smallest plan found needs {needs} per device{how}, the device "
                      f"has {has}", step.memory.needs(plan), step.machine.memory_capacity)


def _valve_cut(searches: Sequence[MeshSearch], choices: Sequence[MeshChoice], clock: Deadline) -> str:
    """Which safety valve cut a step whose meshes gave no joint plan ('' when none did, and the step's error
    stands): the meshes' own (`mesh.valve_cut`: saturation stopped, extraction cut to its greedy passes, Ctrl-C),
    or the meshes it left unsearched. A cut step falls back to the best baseline that fits (`_fallen_back`):
    `--limit seconds` and Ctrl-C return the best plan found so far, never an error while one fits."""
    cuts = [f"mesh {s.mesh}: {s.cut}" for s in searches if s.cut]
    if len(searches) < len(choices):
        cuts.append(f"meshes {', '.join(str(c.mesh) for c in choices[len(searches):])} not searched: "
                    f"{clock.why_spent()}")
    return "; ".join(cuts)


def _fallen_back(step: StepContext, searches: Sequence[MeshSearch], plan: Plan, fallback: str) -> Plan:
    """`plan`, a baseline's (no mesh gave a joint plan: a safety valve cut the search, or no joint plan keeps
    the pinned degrees), saying why (`fallback`) in `extraction.fallback`; the step's error when it does not
    fit (what the search would have ended with: it does not hide a plan that fits, and the micro-batch search
    reads DoesNotFit)."""
    if not step.memory.fits(plan):
        raise _no_joint_plan(step, searches)
    step.say(f"{fallback}: the plan is the best baseline that fits, {plan.extraction['chosen']}")
    return replace(plan, extraction={**dict(plan.extraction), "fallback": fallback})


def mesh_choices(step: StepContext) -> list[MeshChoice]:
    """The meshes to search: the ones the `--degrees` pins ask for, else every factorisation of the devices;
    each with the pinned placements on it (a mesh that cannot realise them is left out)."""
    request = step.request
    pinned = pinned_layouts(dict(request.parallel_dims), step.devices, step.machine.devices_per_node, request.zero,
                            request.sequence_parallel)
    meshes = [(m, c) for m, c in pinned] or [(m, None) for m in search_meshes(step.devices,
                                                                              step.machine.devices_per_node)]
    choices = [MeshChoice(mesh, config, pins_on(step.pins, mesh)) for mesh, config in meshes]
    choices = [choice for choice in choices if choice.pins is not None]
    if not choices:
        raise OptimizeError(f"no device mesh of {step.devices} devices can hold the pinned spreads")
    return choices


def search_meshes_of(step: StepContext, choices: Sequence[MeshChoice], clock: Deadline) -> list[MeshSearch]:
    """Every mesh searched in turn, each with its part of the time: the meshes get MESHES_SHARE of `clock`
    (simulating every candidate's step and the baselines take the rest), what is left split over the meshes
    to go, the first (one axis: the cheapest, and the data-parallel plans) getting FIRST_MESH_SHARE of it when
    others follow. The meshes the limit leaves no time for are said and not searched."""
    searches: list[MeshSearch] = []
    meshes_clock = clock.part(MESHES_SHARE)
    for index, choice in enumerate(choices):
        part = FIRST_MESH_SHARE if index == 0 and len(choices) > 1 else 1.0 / (len(choices) - index)
        share = meshes_clock.limits(share=part)
        if share is None and not searches:
            share = meshes_clock.remaining()   # a caller's part of its deadline ran out while building: least work
        if share is None:
            step.say(f"meshes {', '.join(str(c.mesh) for c in choices[index:])} not searched: "
                     f"{clock.why_spent()}")
            break
        try:
            searches.append(searched_once(step, choice, clock.within(share.seconds)))
        except KeyboardInterrupt:
            clock.interrupt()
            if not searches:
                raise
            step.say(f"meshes {', '.join(str(c.mesh) for c in choices[index:])} not searched: interrupted (Ctrl-C)")
            break
    return searches


def searched_once(step: StepContext, choice: MeshChoice, clock: Deadline) -> MeshSearch:
    """`search_mesh` on `choice`, once per call for the same inputs: the search of every mesh at the count (or
    pipeline pair) a scout chose repeats the scout's search of the first mesh, on the same graph, machine,
    devices and pins, so its result is kept and found again. Only where no wall-clock limit can cut a search
    (`--limit seconds`, `ilp_seconds`): a search's result then depends on its inputs alone (work budgets),
    and one that Ctrl-C cut is not kept."""
    request = step.request
    if request.limits.clocked:
        return search_mesh(step, choice.mesh, choice.config, choice.pins, clock)
    key = (step.graph, step.repetition, step.machine, step.devices, step.stage, step.in_flight,
           tuple(sorted(step.batch_inputs.items())), tuple(sorted(step.pins.items())), choice.mesh, choice.config,
           tuple(sorted(choice.pins.items())))
    found = request.mesh_searches.get(key)
    if found is not None:
        step.say(f"mesh {choice.mesh}: searched before, with the same inputs")
        return found
    found = search_mesh(step, choice.mesh, choice.config, choice.pins, clock)
    if found.result.stop != STOP_INTERRUPTED and not clock.interrupted.is_set():
        request.mesh_searches[key] = found
    return found


def _unspread(step: StepContext, searches: Sequence[MeshSearch]) -> str:
    """Why no mesh's e-graph spreads anything over the devices ('' when one does): a limit stopped saturation
    first, or no parallel rule applies. It is said, not an error: the plan is then the best baseline (a
    data-parallel plan, built apart from the e-graph) or the unspread graph (under pins, a baseline that keeps
    them: `_pins_unheld`)."""
    graph, devices, limits = step.graph, step.devices, step.request.limits
    if devices == 1 or any(s.spread for s in searches):
        return ""
    stopped = [s.result.stop for s in searches if s.result.stop != STOP_SATURATED]
    if stopped:
        how = "interrupted (Ctrl-C)" if stopped[0] == STOP_INTERRUPTED else \
            f"stopped at --limit {stopped[0]}={getattr(limits, stopped[0]):g}"
        why = f"saturation {how} before any parallel rule spread '{graph.name}' over {devices} devices"
    else:
        why = f"no parallel rule applies to '{graph.name}' on any mesh of {devices} devices"
    step.say(f"{why}: the plan is the best baseline, or the graph unspread")
    return why


def compare_baselines(step: StepContext, searches: Sequence[MeshSearch], best_search: MeshSearch,
                      steps: CandidateSteps, clock: Deadline):
    """The candidates to rank (the joint plan first, then every baseline found), each baseline's totals (None
    where it has none), and what the time limit left out; the joint plan is missing where `best_search` has none
    (a step a safety valve cut: the baselines are then built even without `request.baselines`, as the plans
    to fall back to, `_fallen_back`). The baselines that restrict each mesh's e-graph
    (Megatron, the grid) were extracted with it, and data parallelism is built directly: they are always there
    to compare with, and so is the grid built directly from the graph (`baselines.independent_grid`), every
    point simulated: the best grid point is the best of both grids (and of data parallelism). Only
    the sequential baseline saturates again (twice), so only it is left out when the deadline leaves no
    time, and for a pipeline stage's plan, whose grid point is the one baseline the pipeline reads
    (`pipeline_search._grid_points`)."""
    request, graph, machine = step.request, step.graph, step.machine
    candidates = [best_search.joint] if best_search.joint is not None else []
    found: dict[str, Totals | None] = {}
    spare = clock.limits(share=0.5)
    skipped = f"sequential: {clock.why_spent()} before it" if request.baselines and spare is None else ""
    if skipped:
        step.say(f"baseline {skipped}")
    if not request.baselines and candidates:
        return candidates, found, skipped
    megatron = best([s.megatron for s in searches], step.memory)
    two_phase = _two_phase(step, best_search, spare, clock) \
        if spare is not None and step.stage is None and request.baselines else None
    dp = built_once(step, data_parallel) if not step.pins else None
    experts = built_once(step, expert_parallel) if not step.pins else None
    ranked = step_read(step)
    two_phase, dp, experts = steps.where(two_phase, ranked), steps.where(dp, ranked), steps.where(experts, ranked)
    # data parallelism over every device is a point of the grid too, and so is every point of the grid built
    # directly from the graph (`independent_grid`): an e-graph cut short by the limits may not reach them
    as_grid = replace(dp, name="best_grid", config={"dp": step.devices, "tp": 1, "sp": False, "zero": 0,
                                                     "microbatches": graph.microbatches}) if dp else None
    # an unstaged count's scout whose joint plans do not fit raises unless a baseline fits: where its steps refuse
    # points by their floors (no wall-clock limit), its grid is scanned for a point that may fit before the grid
    # is made with floors and order (`independent_points`' `scan_first`)
    scan_first = step.scout and step.stage is None and steps.refusing and best_search.joint is not None and \
        not step.memory.fits(best_search.joint)
    independent = independent_points(step, steps, scan_first) if not step.pins else []
    points = [s.grid for s in searches] + [as_grid] + independent
    if request.parallel_dims:   # pinned: the grid is the pinned layout's points, so it may be the plan
        points = [p for p in points if p is not None and keeps_pins(p, request)]
    grid = best(points, step.memory)
    for name, candidate in (("megatron", megatron), ("sequential", two_phase), ("data_parallel", dp),
                            ("expert_parallel", experts), ("best_grid", grid)):
        found[name] = candidate.totals if candidate is not None else None
        if candidate is not None:
            candidates.append(candidate)
    return candidates, found, skipped


def step_read(step: StepContext) -> Callable[[Candidate], bool] | None:
    """Which baselines' simulated steps the step's plan can read (None: every one's, an unstaged step's: its
    baselines are the plan's, each shown with its simulated step). A pipeline stage's step (`step.stage`)
    ranks a candidate that fits by its pipelined price (`mesh.rank`, `MemoryFit.pipelined_s`), not by its
    simulated step, and one that does not by `MemoryFit.needs`, which simulating does not change
    (`Totals.simulated` keeps the memory), and its independent grid's branch and bound reads their pipelined
    prices too (`independent_points`, `mesh.PipelinedSteps`): so none is simulated (`_never`; session 64 helper
    A3's "Noticed" (b), benchmarks/search_results.md). Nothing else of them reaches a plan: the stage plan's
    `baselines` are over a stage's devices, and `pipeline_search.best_of` gives the plan the unstaged search's
    instead (with the best PTD-P point, priced by `StagePricer`); the stage plan's `totals` (its chosen
    candidate's) become its pipelined price (`StagePricer.price`); its best grid point is read for its PCG and
    costs (`pipeline_search._grid_points`). The joint plan of each mesh is simulated whatever it needs (its
    step is in `saturation.meshes`, which the pipelined plan keeps: `MeshSearch.simulated`), except where the
    search of every stage mesh chooses the scout's stage plan again: it then makes no plan of its own, and
    simulates none (`_the_scouts_choice`). Where a stage plan's
    pipelined plan is not the call's (the unstaged plan wins), none of the stage plan reaches it beside `tried`'s
    prices, which read the PCG and costs alone."""
    return _never if step.stage is not None else None


def _never(_candidate: Candidate) -> bool:
    """`step_read`'s answer for a pipeline stage's step: no baseline's simulated step is read."""
    return False


def _two_phase(step: StepContext, best_search: MeshSearch, spare: Limits, clock: Deadline) -> Candidate | None:
    """The sequential baseline on the best mesh within `spare`; None when Ctrl-C cuts it, which then ends the call's
    search as anywhere else (`Deadline.interrupt`): the step's plan comes back, not the user's interrupt.

    Built once per call for the same inputs (as `searched_once` searches a mesh once): the search of every mesh
    at the count a scout chose builds it again on the same graph and, where the scout's first mesh stays the
    best, the same mesh (bert-large:64: two saturations, one device and `mixed 64`, and two extractions).
    Only where no wall-clock limit can cut it (`--limit seconds`, `ilp_seconds`: `spare` is then the given
    limits, and saturation and extraction stop on work budgets alone, so its inputs decide it), and not where
    Ctrl-C cut the call."""
    request = step.request
    limits = replace(spare, ilp_nodes=max(1, request.limits.ilp_nodes // 2))
    key = ("sequential", step.searched, step.repetition, step.machine, best_search.mesh,
           tuple(sorted(best_search.pins.items())), tuple(sorted(step.input_pins.items())), limits)
    once = not request.limits.clocked
    found = request.built.get(key, _UNBUILT) if once else _UNBUILT
    if found is not _UNBUILT:
        step.say("baseline sequential: built before, with the same inputs")
        return found
    try:
        found = sequential(step.searched, request.library, request.rules, best_search.mesh, limits, step.machine,
                           best_search.pins, step.input_pins, request.free_input_placements, step.say,
                           request.caches, step.repetition, computed=request.prices)
    except KeyboardInterrupt:
        clock.interrupt()
        step.say("baseline sequential: none (interrupted (Ctrl-C))")
        return None
    if once and not clock.interrupted.is_set():
        request.built[key] = found
    return found


def built_once(step: StepContext, build: Callable[..., Candidate | None]) -> Candidate | None:
    """`build` (`baselines.data_parallel` or `expert_parallel`) of the step's graph on its machine and devices,
    once per call: a pipeline stage's step reads data parallelism twice before any candidate is simulated
    (`_stage_candidates`, `_surely_fits`) and again where nothing is skipped (`compare_baselines`), and the
    search of every mesh at a count builds what its scout built. Sound: a builder reads only these and the
    request's library and `free_input_placements` (no limit, no clock: the same inputs give the same
    candidate), and a Candidate is frozen, its PCG and costs never written once priced, so the one built first
    is what building again would give. bert-large:64 built data parallelism 10 times, 5 of them again."""
    request = step.request
    key = (build.__name__, step.graph, step.machine, step.devices)
    found = request.built.get(key, _UNBUILT)
    if found is _UNBUILT:
        # data parallelism laid out among the grids' layouts (`baselines.data_parallel`'s `kin`): it is the tp 1
        # ZeRO-0 point of the step's grid (`_grid_families`), which then takes this PCG rather than building it
        shared = {"kin": request.layouts} if build is data_parallel else {}
        found = request.built[key] = build(step.graph, request.library, step.machine, request.free_input_placements,
                                           step.devices, computed=request.prices, **shared)
    return found


_UNBUILT = object()   # `built_once`: not built yet in this call (None is an answer: the baseline does not apply)


def independent_points(step: StepContext, steps: CandidateSteps, scan_first: bool = False) -> list[Candidate]:
    """The independent grid's points (`baselines.independent_grid`), the ones that fit as they run
    (`search.fit`) simulated, less those whose step cannot be the fastest of them: only the fastest point can
    be the best grid point, and a point that does not fit ranks by its memory, which simulating does not
    change. Branch and bound over the grid's points, best bound first (`mesh.BestFirst`): the layouts
    (`baselines.grid_families`) come in the ascending order of their step floors, each layout's points wait
    with their own floors (which count the ZeRO stage and recomputation that a layout's floor leaves out), and
    before the next layout is built every point waiting with a floor at or below that layout's is simulated or
    left out; a layout whose step floor is above the fastest point simulated so far is not built further nor
    simulated, and a point whose floor is above it is not simulated. So the points kept hold every one as fast
    as the fastest, in the grid's order. The order changes only which slower points are left out: every point
    as fast as the fastest has a floor at or below every bar, so it is kept in any order, and a point that does
    not fit matters only where none fits, when the bar never falls and nothing is left out. Points waiting
    across layouts rather than a layout's alone: on llama-70b:64's stage grids, the layouts first by their
    floors held points that all recompute blocks (a third more compute than their layout's floor), and four of
    the grids' 13 simulations were of such points, slower than a later layout's point. Where `--degrees` pins,
    only the points that keep the pins can be the best grid point (`compare_baselines`), so only they are
    simulated and set the bar; the others are kept unsimulated. A pipeline stage's points rank by their
    pipelined price (`mesh.rank`), not their step: there "simulated" is priced pipelined and the floors are
    floors of that price (`mesh.PipelinedSteps`, `_stage_layout_floor` for a layout), by the same argument;
    bounded by their steps, a point that pipelines faster than the fastest simulated one could be left out.
    Made once per call for one graph on one machine
    and devices (and pipeline, for a stage's), which a scout's step and the search of every mesh at its count
    share. `scan_first` (where the caller expects that no point fits): the grid is first made without floors
    where it can be (`_unfitting_grid`), and as above only where a point may fit."""
    request = step.request
    key = (step.graph, step.machine, step.devices, step.stage)
    found = request.grid_points.get(key)
    if found is None and scan_first and not request.parallel_dims and not request.built.get((GRID_SCANNED, key)):
        found = _unfitting_grid(step, steps)
        if found is not None:
            request.grid_points[key] = found
    if found is None:
        if request.built.get((GRID_SCANNED, key)):   # made where `a_grid_point_fits` stood: its failures unsaid
            steps = CandidateSteps(request.library, step.machine, step.graph.microbatches, request.simulations,
                                   refusing=steps.refusing)
        rivals = (lambda point: keeps_pins(point, request)) if request.parallel_dims else None
        staged = step.stage is not None   # a stage's points rank by their pipelined price (`mesh.rank`)
        search = BestFirst(steps, step.memory.fits, rivals=rivals,
                           judge=PipelinedSteps(step.memory) if staged else None)
        priced: dict = {}   # a stage grid's first layouts' node costs (`_stage_layout_floor`), read by their points
        floors = _LayoutFloors(steps, (lambda pcg: _stage_layout_floor(step, pcg, priced)) if staged else None)

        def skip(pcg: PCG) -> bool:   # asked of each layout's first PCG before the layout is built further
            floor = floors(pcg)
            search.run(-math.inf if floor is None else floor)
            return floors.beyond(pcg, search.bar)
        for family in _grid_families(step, skip=skip, order=floors, priced=priced):
            # a point's key: its place in the grid's order, then its place in its layout (a ZeRO-1 twin follows)
            search.add(((place, k), point) for k, (place, point) in enumerate(family))
        search.run()
        found = [point for _key, point in sorted(search.kept.items(), key=lambda item: item[0])]
        request.grid_points[key] = found
    return found


def _unfitting_grid(step: StepContext, steps: CandidateSteps) -> list[Candidate] | None:
    """The independent grid as `independent_points` makes it, where none of its points fits; None where one may
    fit (the grid is then made with its floors and order). Scanned the leanest layouts first (`grid_families`'
    `lean_first`: every order gives the same points), each point judged as `independent_points` judges it with
    no bar set: a point over its per-node bound is kept as it is, one within it is stepped (`steps`), which
    refuses it unsimulated where a lower bound of its simulated peak is over the device's memory
    (`CandidateSteps.refusal`); a point that would be simulated may fit, and ends the scan.

    Why the same grid: where no point fits, the branch and bound's bar (the fastest point simulated that fits)
    stays infinite, so it leaves out no layout and no point, simulates nothing it did not refuse here, and keeps
    every point by its (place in the grid's order, place in its layout) key, as here. What it would work out for
    nothing: each layout's step floor and each point's (`_LayoutFloors`, `CandidateSteps.floor`), which only
    order the simulations and set no bar where none fits; llama-70b:64's unstaged scouts (micro-batch counts 1,
    2, 4; their joint plans 87-116 GiB as simulated, every grid point over its bound or refused) raise
    DoesNotFit after making it."""
    kept: dict = {}
    for family in _grid_families(step, lean_first=True):
        for k, (place, point) in enumerate(family):
            if step.memory.fits(point):
                point = steps.refusal(point)
                if point is None:
                    return None
            kept[(place, k)] = point
    return [point for _key, point in sorted(kept.items(), key=lambda item: item[0])]


GRID_SCANNED = "grid scanned"   # `request.built` key: a step's grid scanned for a point that fits, not made


def a_grid_point_fits(step: StepContext) -> bool:
    """Whether a point of the step's independent grid fits (`step.memory`): what a scout's step whose first mesh
    holds no plan that fits asks before searching every mesh (`search_step`). The answer `independent_points`'
    points give, without simulating a step or working out a floor: the grid's every point, the leanest layouts
    first (`grid_families`' `lean_first`: any order gives the same points, and this one is asked where memory is
    short), the first that fits ending the scan (a grid already made is read instead). In the grid's order
    (tp 1 first) llama-70b:64's three scans built and priced 6-8 layouts each before dp 16 x tp 4 fitted.

    Why the same: `independent_points` keeps every point that does not fit and, of those that fit (and keep
    the pins, where `--degrees` pins), leaves out only ones whose floor is above a step already simulated,
    which is a point that fits; a family its bound skips likewise. So its points hold one that fits exactly
    where the grid does. The scan judges each point as the grid does (`_grid_families`: the same layouts,
    forms and `fits`, the kin layouts and compute costs shared with the call, which give what building anew
    gives). A scout's step asked this on every count of llama-70b:64, where the search of every mesh then found no joint
    plan that fits and raised: the grid's simulations and floors (3-4 CPU s a count) went unread.

    Where the grid is made later (the search of every mesh reaches its baselines), `independent_points` makes
    it with a `CandidateSteps` of its own, as it was made here before: a simulation that fails is not said in
    that step's plan (`unsimulated`), as it was not."""
    request = step.request
    key = (step.graph, step.machine, step.devices, step.stage)
    made = request.grid_points.get(key)
    if made is not None:
        return any(step.memory.fits(point) for point in made)
    request.built[(GRID_SCANNED, key)] = True
    return any(step.memory.fits(point) for family in _grid_families(step, lean_first=True)
               for _place, point in family)


def _grid_families(step: StepContext, fits: Callable[[Candidate], bool] | None = None,
                   **bounding) -> Iterator[list[tuple[int, Candidate]]]:
    """`baselines.grid_families` of the step's graph, machine and devices as the request pins it (`--degrees
    zero=N`, `--recompute`), the step's memory judging what fits (or `fits`); `bounding`: its `skip` and `order`
    (and `priced`, the node costs a stage layout's floor worked out), or `lean_first`. A pipeline stage's grid
    reduces each partial sum where it is made (`reduce_at_once`): its points are cut into stages (the PTD-P
    points, and a stage plan that is its grid point), and Megatron-LM sends no partial sum between stages."""
    request = step.request
    pinned_zero = request.state_zero if request.state_zero in (1, 2) else 0   # `--degrees zero=N`
    return grid_families(step.graph, request.library, step.machine, request.free_input_placements, step.devices,
                         fits or step.memory.fits, state_zero=pinned_zero, computed=request.prices,
                         kin=request.layouts, recompute=request.recompute if request.recompute != AUTO else None,
                         reduce_at_once=step.stage is not None, **bounding)


class _LayoutFloors:
    """Each grid layout's step floor without the plan's own part (`CandidateSteps.floor(pcg, plan=False)`; a
    pipeline stage's, `of`: `_stage_layout_floor`, a floor of its points' pipelined prices, which its points rank
    by), worked out once: it orders the layouts (`grid_families`' `order`) and bounds them (`beyond`). Kept by
    the layout's identity, beside it, for one grid."""

    def __init__(self, steps: CandidateSteps, of: Callable[[PCG], float | None] | None = None):
        self.known = {}
        self.of = of if of is not None else (lambda pcg: steps.floor(pcg, plan=False))

    def __call__(self, pcg: PCG) -> float | None:
        found = self.known.get(id(pcg))
        if found is None or found[0] is not pcg:
            found = self.known[id(pcg)] = (pcg, self.of(pcg))
        return found[1]

    def beyond(self, pcg: PCG, bar: float) -> bool:
        """`CandidateSteps.beyond` on the floor worked out once: above `bar` as `rank` rounds."""
        floor = self(pcg)
        return floor is not None and round(floor, 12) > bar


def assemble_plan(step: StepContext, searches: Sequence[MeshSearch], best_search: MeshSearch,
                  candidates: list[Candidate], found_baselines: dict, skipped: str, steps: CandidateSteps) -> Plan:
    """The plan: the best candidate that the backend can place (every baseline is a PCG priced by the same
    model, so it is a valid plan; the joint plan wins ties; when parallel dims are pinned, the caller passes only
    the candidates that keep the pins, `keeps_pins`), with the search's statistics and every baseline's PCG."""
    request, graph, machine = step.request, step.graph, step.machine
    # Every candidate must be one the backend can place (`pcg_placement`): the placement analysis makes that so,
    # and a candidate that still is not is left out, and said, rather than returned.
    unplaceable = _unplaceable(candidates, request.library, request.built)
    for name, why in unplaceable.items():
        step.say(f"{name}: left out, it cannot be placed on the devices ({why})")
    candidates = [c for c in candidates if c.name not in unplaceable]
    if not candidates:
        raise OptimizeError(f"internal: no plan for '{graph.name}' can be placed on {step.devices} devices "
                            f"({unplaceable.get(JOINT, '')})")
    chosen = first_ranked(candidates, step.memory)
    if chosen.name != JOINT and best_search.joint is not None:
        step.say(f"baseline {chosen.name} was cheaper than anything extracted: the plan is its PCG")
    joint = best_search.result
    saturation = {**joint.to_dict(), "rules_note": request.rules_note, "rules_available": len(request.rules),
                  "mesh": str(best_search.mesh), "meshes": [s.summary() for s in searches]}
    if step.repetition:
        saturation["repeated_blocks"] = step.repetition.to_dict()
    extraction = _extraction_record(best_search, chosen, unplaceable, steps, skipped, step)
    baseline_plans = {c.name: BaselinePlan(c.pcg, c.costs, c.config) for c in candidates if c.name != JOINT}
    return Plan(graph, machine, step.devices, chosen.pcg, chosen.costs, chosen.totals, found_baselines,
                plan_rules(request, joint.snapshot, best_search.extraction.choice) if chosen.name == JOINT
                else (), saturation, extraction, step.pins, baseline_plans)


def plan_rules(request: SearchRequest, snapshot: Snapshot, choice: Mapping[int, int]) -> tuple[str, ...]:
    """`provenance.rules_used` of a joint plan, worked out once per call for one extraction of one e-graph: the
    search of every mesh at the count a scout chose finds the scout's search of the first mesh again
    (`searched_once`), and where that mesh's plan wins both steps' plans name the same rules (gpt-1.3b on 64
    devices: its rules were followed back twice). Keyed by the snapshot's identity, which the entry keeps alive
    so that no other snapshot can take its id, and by the choice."""
    key = (id(snapshot), tuple(sorted(choice.items())))
    found = request.rules_found.get(key)
    if found is None:
        found = request.rules_found[key] = (snapshot, rules_used(request.rules, snapshot, choice))
    return found[1]


def keeps_pins(candidate: Candidate, request: SearchRequest) -> bool:
    """Whether a baseline keeps every pin, so that it may be the plan of a pinned search: a grid point whose
    configuration has the pinned `--degrees`, whose PCG has the pinned ZeRO stage and `--recompute` policy
    (the grid built apart from the e-graph prices its own), and uses the pinned axes. The joint plan is
    extracted within the pins, but its extraction is bounded (`--limit ilp_nodes`), and the grid point of the
    pinned layout, a restriction of the same e-graph, can be the faster plan: Megatron-Core's 32B row pinned t 8 x d 48 gave a joint plan of 2.196 s where its grid
    point, the same degrees with Megatron's column/row projections, fits and runs in 1.374 s. Other
    baselines (data parallelism, the sequential search) may not keep the pins."""
    config = candidate.config
    if candidate.name != "best_grid" or not config:
        return False
    if any(config.get(kind, value) != value for kind, value in request.parallel_dims.items()):
        return False
    if request.zero != AUTO and (config.get("zero") != 3 if request.zero == 3 else
                                 config.get("zero") == 3 or candidate.pcg.zero != request.zero):
        return False   # a ZeRO-3 point's PCG says stage 0 (its weights stored split), which a pin of 0 does not allow
    if request.recompute != AUTO and candidate.pcg.recompute != request.recompute:
        return False
    if request.sequence_parallel is not None and bool(config.get("sp")) != request.sequence_parallel:
        return False
    return uses_pinned_axes(candidate.pcg, request.parallel_dims, request.sequence_parallel)


def uses_pinned_axes(pcg: PCG, dims: Mapping[str, int], sequence: bool | None = None) -> bool:
    """Whether `pcg` puts work on every pinned axis as the pin promises (`idle_pinned_axes` finds none idle). A
    grid point's configuration names its degrees, but its extraction may leave an axis idle (an MLP's dp 2 point
    computed whole on both ranks), and so may a joint plan extracted on a pinned mesh."""
    return not idle_pinned_axes(pcg, dims, sequence)


def idle_pinned_axes(pcg: PCG, dims: Mapping[str, int], sequence: bool | None = None) -> dict[str, str]:
    """The pinned axes (`dp`, `tp` above 1) on which `pcg` breaks the pin, each with why: no operator computes a
    split or partial piece there (every rank of the axis does the same work: a `tp` axis with only a replicate
    on it, or a pipeline stage plan on a `tp 2` mesh with nothing split), or, on `dp`, no graph input is split
    there (each data-parallel rank must compute on its own samples). A pinned `sequence` (`--degrees sp`) is
    broken, under "sp", where it is on and no operator computes a piece cut along the sequence on the tensor
    axis (Megatron-LM's sequence-parallel region: the norms and residuals), or off and one does."""
    by_id = {node.id: node for node in pcg.nodes}
    split_inputs = {str(node.attr("axis")) for node in pcg.nodes if node.kind == "parallel" and node.op == PARTITION
                    and by_id[node.inputs[0]].kind == "leaf" and by_id[node.inputs[0]].role == "input"}
    names = tuple(pcg.mesh.names)
    idle = {}
    for kind in (kind for kind, degree in dims.items() if kind in PINNABLE and degree > 1):
        at = names.index(kind) if kind in names else None
        if at is None or not any(node.kind == "op" and _splits(node.placement, at) for node in pcg.nodes):
            idle[kind] = "no operator is split on it, so every rank of the axis does the same work"
        elif kind == "dp" and kind not in split_inputs:
            idle[kind] = "no graph input is split on it, so every data-parallel rank computes on the same samples"
    if sequence is not None and "tp" in names:
        cut = sum(node.kind == "op" and sequence_split(node.shape, node.placement.codes[names.index("tp")])
                  for node in pcg.nodes)
        if sequence and not cut:
            idle["sp"] = "no operator computes a piece cut along the sequence on the tensor axis, so the norms " \
                         "and residuals run whole on every tensor-parallel rank"
        elif not sequence and cut:
            idle["sp"] = f"pinned off, but {cut} operators compute pieces cut along the sequence on the tensor axis"
    return idle


def _splits(placement: Placement, axis: int) -> bool:
    """Whether a value placed so is a different piece on each rank of `axis` (split, or a partial sum)."""
    codes = placement.codes
    return axis < len(codes) and (codes[axis] == PARTIAL or shard_dim(codes[axis]) is not None)


def _extraction_record(best_search: MeshSearch, chosen: Candidate, unplaceable: dict, steps: CandidateSteps,
                       skipped: str, step: StepContext) -> dict:
    """The plan's `extraction` record: how the best mesh's plan was extracted (method "none" where no mesh gave
    one), which candidate was chosen, and what was left out or could not be simulated."""
    extraction = best_search.extraction
    ext = {"method": "none", "chosen": chosen.name, "seconds": round(best_search.extract_seconds, 4),
           "candidates": {}, "ilp_status": "not run", "pass_seconds": {}}
    if extraction is not None:
        # a pass that found no plan (inf) is written null, as the schema has it (an ILP with no feasible plan)
        ext.update(method=extraction.method,
                   candidates={k: (v if math.isfinite(v) else None) for k, v in extraction.candidates.items()},
                   ilp_status=extraction.ilp_status, pass_seconds=dict(extraction.seconds))
    if unplaceable:
        ext["unplaceable"] = unplaceable
    if steps.failures:
        ext["unsimulated"] = dict(steps.failures)
        step.say("ranked by the per-node sum, the step simulator could not run them: "
                 + "; ".join(f"{k}: {v}" for k, v in steps.failures.items()))
    if skipped:
        ext["baselines_skipped"] = skipped
    return ext


def _unplaceable(candidates: Sequence[Candidate], library: Library, known: dict | None = None) -> dict[str, str]:
    """The candidates whose PCG cannot be placed on its mesh, and why. `known` (the request's `built`) keeps each
    PCG's answer by its identity, beside the PCG (so no other PCG takes its id): `derive_placements` reads only
    the PCG and the library's operators, both the call's, and the steps of one call ask again of the same PCGs
    (a scout's candidates are the search of every mesh's again: its first mesh's search, data parallelism, the
    grid points; a stage step asks of data parallelism before and after the candidates are simulated)."""
    out = {}
    for candidate in candidates:
        key = ("placed", id(candidate.pcg))
        found = known.get(key) if known is not None else None
        if found is None or found[0] is not candidate.pcg:
            try:
                derive_placements(candidate.pcg, library.ops)
                why = None
            except PlacementError as err:
                why = str(err)
            found = (candidate.pcg, why)
            if known is not None:
                known[key] = found
        if found[1] is not None:
            out[candidate.name] = found[1]
    return out
