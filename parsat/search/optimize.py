"""`optimize(graph, machine=..., rules=..., limits=...) -> Plan`: the joint search and its baselines.

1. resolve the inputs (`inputs`) and ask the caller which rules saturation
   may apply (`choose_rules`: the facade's `parsat.optimize` keeps the rules
   the verifier PROVED; this package never imports the verifier);
2. saturate the graph with algebraic and parallel rules together, within
   limits, once per device mesh the devices can form (docs/MESH.md:
   nodes x GPUs and its factorisations), rules lifted onto each;
3. price every e-node with the cost model (per node, so costs add up) and
   extract the cheapest plan that fits in memory (`solve`);
4. compute the baselines with the same cost model (`baselines`): data
   parallelism only, the sequential approach (algebraic rules first, then
   parallel rules), and Megatron-style tensor parallelism (graph inputs
   never split);
5. simulate the step of every candidate (each mesh's joint plan and every
   baseline) with the same step simulator (`step_report`, `CandidateSteps`:
   overlap of communication with computation, DDP buckets, micro-batches);
6. the best feasible plan by simulated step time wins: the joint plan
   unless a baseline's PCG (each is a valid PCG, kept in the plan so a
   backend can run it) is strictly faster, which the plan then says
   (`extraction.chosen`). The plan keeps both figures: `totals.time_s`
   (simulated) and `totals.node_sum_s` (the per-node sum extraction used).

`limits.seconds` bounds the whole search, not saturation alone: building
the graph, saturating, extracting and the baselines share one deadline
(`Deadline`); what the deadline leaves no time for is cut (the ILP, then
the baselines), never the plan. Loading the rules and looking up their
proofs (cached) are not counted.
"""

from __future__ import annotations

import time
from math import prod
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.library import Library
from parsat.ir.blocks import has_blocks
from parsat.ir.budget import GraphBudget
from parsat.ir.costs import Totals, totals
from parsat.ir.graph import Graph
from parsat.ir.machine import Machine
from parsat.ir.mesh import Mesh
from parsat.ir.models import BATCH, EXAMPLES
from parsat.ir.pcg import Degrees
from parsat.ir.pcg_layout import lay_out
from parsat.ir.placement import Placement, PlacementError
from parsat.ir.plan import BASELINES, JOINT, BaselinePlan, Plan
from parsat.ir.recompute import AUTO, BLOCKS, NONE, POLICIES, check_policy
from parsat.ir.recompute import describe as describe_recompute
from parsat.search.baselines import Candidate, best_grid, data_parallel, megatron_excluded, sequential
from parsat.cost.model import weight_bytes
from parsat.search.deadline import Deadline
from parsat.ir.errors import DoesNotFit, OptimizeError
from parsat.search.extract import Extraction, ExtractionError, leaf_roles, node_costs
from parsat.dsl.checker import resolve_library
from parsat.search.inputs import check_devices, check_pins, pins_on, resolve_graph, search_meshes
from parsat.search.pipeline_search import best_of, parameters_of, search_pipelines
from parsat.egraph.program import MeshCaches
from parsat.search.repeat import SEARCHED_BLOCKS, RepeatError, Repetition, repetition_for
from parsat.egraph.runner import STOP_SATURATED, Limits
from parsat.egraph.saturate import SaturationResult, saturate
from parsat.search.solve import price, rules_used, solve
from parsat.cost.pcg_tasks import OpTimes, TaskBuildError
from parsat.cost.simulator import SimulationError
from parsat.cost.step_report import simulate_step
from parsat.search.strategies import Config, PinError, config_excluded, pinned_meshes

Progress = Callable[[str], None]
RuleChooser = Callable[[Library], tuple[Sequence[ast.RuleDecl], str]]
"""Picks the rules saturation may apply out of a library, with a note for the plan (`saturation.rules_note`)."""


def every_rule(library: Library) -> tuple[list[ast.RuleDecl], str]:
    """The default `RuleChooser`: every rule of the library, unverified (the facade's chooser keeps PROVED ones)."""
    return list(library.rules), "all rules used (no proof check was asked for)"


def optimize(graph, machine: Machine | str = "h100x8", rules=None, limits: Limits | Mapping | None = None,
             devices: int | None = None, *, microbatches: int | None = None, pipeline: bool | None = None,
             schedule: str | None = None, **options) -> Plan:
    """The cheapest plan, unstaged (`optimize_unstaged`) or pipelined (`pipeline_search`).

    A built-in example of several blocks is also searched as a pipeline
    (stages over a mesh axis, micro-batches, a schedule) when `pipeline` is
    True, when its devices span more than one node, when `degrees` pins
    `pp` above 1, or when no unstaged plan fits; `pipeline=False` never
    does. `schedule` pins the pipeline schedule ("gpipe", "1f1b",
    "interleaved"). The fastest plan that fits wins, the unstaged one on a
    tie; `saturation.pipeline_search` lists what was tried.

    `limits.seconds` bounds the whole call (`deadline`): the unstaged search
    gets `UNSTAGED_SHARE` of it when a pipeline is searched too
    (`UNSTAGED_SHARE_FIRST` when the pipeline waits on it not fitting), the
    pipeline what is left. Every search shares one cache of compiled rules.
    """
    say = options.get("progress") or (lambda _m: None)
    # loaded once (2-3 CPU s for the shipped rules): every search below, unstaged or a stage's, takes the Library
    rules = resolve_library(rules)
    limits = Limits.resolve(limits)
    clock = Deadline.starting_now(limits)
    options["caches"] = options.get("caches") or MeshCaches()
    degrees = dict(options.pop("degrees", None) or {})
    pp = degrees.pop("pp", None)
    if pp is not None and (isinstance(pp, bool) or not isinstance(pp, int) or pp < 1):
        raise OptimizeError(f"--degrees pp must be a positive integer, got {pp!r}")
    options["degrees"] = degrees or None
    sizes = dict(options.get("sizes") or {})
    batch = _example_batch(graph, sizes)
    base = Machine.resolve(machine)
    count = base.devices if devices is None else int(devices)
    blocks = {**EXAMPLES[graph].defaults(), **sizes}.get("blocks") if batch else None
    stageable = bool(batch) and isinstance(blocks, int) and blocks >= 2 and count >= 2
    if pp is not None and pp > 1:
        if pipeline is False:
            raise OptimizeError("--degrees pp asks for a pipeline, which pipeline=False (--no-pipeline) turns off")
        if not stageable:
            raise OptimizeError(f"--degrees pp={pp}: only a built-in example of several blocks, with a batch, on "
                                f"several devices is pipelined ('{graph}' is not)" if isinstance(graph, str) else
                                f"--degrees pp={pp}: only a built-in example of several blocks is pipelined")
        if count % pp:
            raise OptimizeError(f"--degrees pp={pp} does not divide the {count} devices")
    flat, unfit = None, None
    if pp is None or pp == 1:
        # across nodes the pipeline is searched too: the unstaged search then gets fewer micro-batch counts
        surely = stageable and pipeline is not False and (count > base.devices_per_node or pipeline is True)
        searches = UNSTAGED_SEARCHES_BESIDE_PIPELINE if surely else None
        share = UNSTAGED_SHARE if surely else UNSTAGED_SHARE_FIRST if stageable and pipeline is not False else 1.0
        try:
            flat = optimize_unstaged(graph, machine, rules, limits, devices, microbatches=microbatches,
                                     searches=searches, clock=clock.part(share), **options)
        except DoesNotFit as err:
            if not stageable or pipeline is False:
                raise
            unfit = err
    wanted = pipeline is True or (pp or 1) > 1 or (pipeline is None and (
        count > base.devices_per_node or unfit is not None or not flat.totals.fits(flat.machine)))
    if not stageable or pipeline is False or pp == 1 or not wanted:
        if schedule is not None and flat is not None:
            say(f"--schedule {schedule}: the plan is not pipelined")
        return flat
    whole = resolve_graph(graph, rules, sizes)

    def stage_plan(stage_machine: Machine, stage_devices: int, m: int, in_flight: int,
                   stage_clock: Deadline | None) -> Plan:
        return optimize_step(graph, stage_machine, rules, limits, stage_devices, in_flight=in_flight,
                             clock=stage_clock, **_split(options, sizes, batch, m))

    found = search_pipelines(stage_plan, base.with_devices(count), count, batch, parameters_of(whole), blocks + 1,
                             degree=pp if pp and pp > 1 else None, microbatches=microbatches, schedule=schedule,
                             say=say, clock=clock)
    if flat is None and not found.plans and unfit is not None:
        raise unfit
    return best_of(flat, found, base.with_devices(count), pinned=bool(degrees) or bool(pp and pp > 1))


UNSTAGED_SEARCHES_BESIDE_PIPELINE = 3   # micro-batch counts the unstaged search tries when a pipeline is searched too
UNSTAGED_SHARE = 0.5         # of the time limit, for the unstaged search when a pipeline is searched beside it
UNSTAGED_SHARE_FIRST = 0.75  # ... when the pipeline is searched only if no unstaged plan fits


def optimize_unstaged(graph, machine: Machine | str = "h100x8", rules=None, limits: Limits | Mapping | None = None,
                      devices: int | None = None, *, microbatches: int | None = None, searches: int | None = None,
                      clock: Deadline | None = None, **options) -> Plan:
    """The cheapest unstaged plan (`optimize_step`), with the step split into micro-batches where one does not fit.

    `microbatches=m` runs the step as m micro-batches: a built-in example is
    built at its `batch` / m, any other graph is taken as one micro-batch's.
    None: a built-in example with a `batch` size is searched whole first;
    if the best plan does not fit in memory, the batch is split into the
    fewest micro-batches whose activations fit beside the weights' state
    (estimated from that plan, `micro_batches_needed`, and searched again,
    doubling while the plan still does not fit), so the plan that comes
    back fits whenever a split of the batch makes one fit. Once a count
    fits, up to `REFINEMENTS` more searches bisect between it and the
    largest count that failed (the estimate can overshoot), and the fastest
    plan that fits wins. A plan that fits without micro-batches is not
    split further: more micro-batches cost latency and smaller kernels and
    save only memory. `searches` caps the micro-batch counts searched while none fits (the last plan comes
    back, or DoesNotFit).

    `clock` (default: `limits.seconds` from now) bounds every count's search together: each gets a part of the
    time left (`_count_share`), and once it is spent no further count is searched:
    the best plan found comes back, its `saturation.search_limit` saying what was left out.
    """
    sizes = dict(options.pop("sizes", None) or {})
    say = options.get("progress") or (lambda _m: None)
    batch = _example_batch(graph, sizes)
    clock = clock or Deadline.starting_now(Limits.resolve(limits))
    if microbatches is not None:
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise OptimizeError(f"microbatches must be a positive integer, got {microbatches!r}")
        return optimize_step(graph, machine, rules, limits, devices, clock=clock,
                             **_split(options, sizes, batch, microbatches))
    m, tried, failed, best, refined, kept_tried = 1, set(), 0, None, 0, False
    plans: list[Plan] = []

    def search(k: int, share: float) -> Plan:
        return optimize_step(graph, machine, rules, limits, devices, clock=clock.part(share),
                             **_split(options, sizes, batch, k))

    def cut_short(why: str) -> Plan:
        """The best plan found so far (else the leanest), saying what the time limit left out."""
        say(why)
        if best is not None:
            return _limited(_with_grid(best, plans, tried, batch, say, search, 0), why)
        if plans:
            return _limited(min(plans, key=lambda p: p.totals.peak_memory_bytes), why)
        raise DoesNotFit(f"{needed} ({why}; raise the limit to search it)", needed.needed_bytes,
                         needed.capacity_bytes)

    while True:
        if tried and clock.spent:
            return cut_short(f"micro-batch count {m} not searched: --limit seconds={clock.limits_given.seconds:g} "
                             "reached")
        tried.add(m)
        try:
            plan, needed = search(m, _count_share(len(tried)) if batch else 1.0), None   # no batch: one search
        except DoesNotFit as err:
            if not batch:
                raise
            plan, needed = None, err
        except OptimizeError as err:
            if len(tried) == 1 or (best is None and not plans):
                raise
            # a later count's search that its part of the time limit cut short: the counts searched stand
            return cut_short(f"micro-batch count {m}: {err}")
        if not batch:
            return plan
        if plan is not None:
            plans.append(plan)
        fits = plan is not None and plan.totals.fits(plan.machine)
        recomputes = plan is not None and plan.pcg.recompute != NONE
        if fits and (best is None or plan.totals.time_s < best.totals.time_s):
            best = plan
        if fits and m == 1 and not recomputes:
            return plan
        if not fits or recomputes:   # a count at which keeping every activation does not fit
            failed = max(failed, m)
        if fits and recomputes and not kept_tried and options.get("recompute", AUTO) == AUTO:
            # recomputing costs a forward per step: more micro-batches that keep every activation may run faster
            kept_tried = True
            more = micro_batches_needed(plan, batch, m)
            if more is not None and more not in tried and (searches is None or len(tried) < searches):
                say(f"a plan fits with {m} micro-batch(es) by recomputing activations: trying {more}, where "
                    "keeping them may fit")
                m = more
                continue
        if best is not None:
            # a count fits: the estimate that led to it may have overshot, and fewer micro-batches run faster
            # (larger kernels, fewer activation collectives), so bisect towards the largest count that failed
            fewer = _fewer_micro_batches(batch, failed, best.graph.microbatches, tried)
            if fewer is None or refined == REFINEMENTS:
                # beside a pipeline search, the grid's pipelined points stand in for more unstaged searches
                return _with_grid(best, plans, tried, batch, say, search, GRID_SEARCHES if searches is None else 0,
                                  clock)
            refined += 1
            say(f"a plan fits with {best.graph.microbatches} micro-batches: trying {fewer}")
            m = fewer
            continue
        more = (micro_batches_needed(plan, batch, m) if plan is not None else
                _more_micro_batches(needed, graph, sizes, rules, machine, devices, batch, m))
        if more is not None and m > 1:
            # the first estimate (from one whole batch) saves searches; later ones only double: memory is not
            # monotone in m (a micro-batch that no longer divides among the data-parallel devices needs tensor
            # parallelism), so a far jump can pass over the count that fits best
            more = min(more, _next_count(batch, 2 * m) or more)
        if more is None or more in tried or (searches is not None and len(tried) >= searches):
            if plan is not None:
                return plan
            raise needed
        held = (f"the plan needs {plan.totals.peak_memory_bytes / 2**30:.1f} GiB per device of "
                f"{plan.machine.memory_capacity / 2**30:.1f}" if plan is not None else
                f"no plan fits with {m} micro-batch(es) ({needed.needed_bytes / 2**30:.1f} GiB per device needed)")
        say(f"{held}: searching again with {more} micro-batches")
        m = more


GRID_SEARCHES = 2   # searches at more micro-batches spent finding a grid configuration that fits (at most)
EXPECTED_COUNTS = 4   # micro-batch counts a search usually makes (the first, an estimate, the count that keeps
                      # every activation, a refinement)


def _count_share(searched: int) -> float:
    """The part of the time left for the `searched`-th micro-batch count's search: half for the first (the one
    always made, and the one that pays for compiling the rules on every mesh), equal parts of what is left for
    the others expected, half of what they leave for any further one."""
    if searched == 1:
        return 0.5
    return 1.0 / (EXPECTED_COUNTS + 1 - searched) if searched <= EXPECTED_COUNTS else 0.5


def _limited(plan: Plan, why: str) -> Plan:
    """`plan`, saying in `saturation.search_limit` what the search's time limit left out."""
    return replace(plan, saturation={**dict(plan.saturation), "search_limit": why})


def _next_count(batch: int, least: int, skip: set[int] = frozenset()) -> int | None:
    """The smallest micro-batch count from `least` on that divides `batch` and is not in `skip`."""
    return next((k for k in range(least, batch + 1) if batch % k == 0 and k not in skip), None)


def _with_grid(best: Plan, plans: Sequence[Plan], tried: set[int], batch: int, say: Progress,
               search: Callable[[int, float], Plan], extra: int = GRID_SEARCHES, clock: Deadline | None = None) -> Plan:
    """`best` compared with every baseline at every micro-batch count searched: Megatron-style grids choose
    their micro-batch count too, and theirs may be larger than the joint plan's (tensor parallelism of one
    sequence per data-parallel rank). While no grid configuration fits, up to `extra` searches at
    twice the micro-batches are added. A baseline faster than the joint plan at its own count makes that
    search's plan the answer (it is a whole plan at that count); otherwise each baseline's best totals across
    counts are kept, with the count in its configuration, and its PCG when it was found at `best`'s count."""
    plans = list(plans)

    def fitting(name: str) -> list[Plan]:
        return [p for p in plans if p.baselines.get(name) is not None and p.baselines[name].fits(p.machine)]

    if "best_grid" in best.baselines:   # baselines were asked for
        m = max(p.graph.microbatches for p in plans)
        for _ in range(extra):
            if fitting("best_grid") or (clock is not None and clock.spent):
                break
            m = _next_count(batch, 2 * m, tried)
            if m is None:
                break
            tried.add(m)
            say(f"no grid configuration fits at the micro-batch counts searched: searching {m} for the baselines")
            try:
                plans.append(search(m, 0.5))
            except DoesNotFit:
                continue
    best = min((p for p in plans if p.totals.fits(p.machine)), key=lambda p: p.totals.time_s, default=best)
    baselines, baseline_plans = dict(best.baselines), dict(best.baseline_plans)
    for name in BASELINES:
        found = fitting(name)
        if not found:
            continue
        # the fastest that fits, `best`'s own on a tie (then it is already in place, with its PCG)
        source = min(found, key=lambda p: (p.baselines[name].time_s, p is not best))
        if source is best:
            continue
        baselines[name] = source.baselines[name]
        kept = source.baseline_plans.get(name)
        config = {**dict((kept and kept.config) or {}), "microbatches": source.graph.microbatches}
        baseline_plans[name] = BaselinePlan(None, {}, config)   # found at another count: no PCG for this graph
    return replace(best, baselines=baselines, baseline_plans=baseline_plans)


REFINEMENTS = 3   # searches spent looking for fewer micro-batches once a count fits (at most)


def _fewer_micro_batches(batch: int, failed: int, fits: int, tried: set[int]) -> int | None:
    """A count of micro-batches (a divisor of `batch`) between the largest that failed and one that fits, near
    their geometric middle; None when no untried count lies between."""
    between = [k for k in range(failed + 1, fits) if batch % k == 0 and k not in tried]
    if not between:
        return None
    middle = (max(failed, 1) * fits) ** 0.5
    return min(between, key=lambda k: (abs(k - middle), k))


def _more_micro_batches(err: DoesNotFit, graph: str, sizes, rules, machine, devices, batch: int, m: int) -> int | None:
    """More micro-batches after no plan fit at `m`: the smallest plan's memory less a lower bound of the
    weights' state (every weight sharded over every device, ZeRO-3) is taken as activations, which shrink
    with the micro-batch; at least twice `m`."""
    library = resolve_library(rules)
    whole = resolve_graph(graph, library, {**sizes, BATCH: batch // m})
    base = Machine.resolve(machine)
    count = base.devices if devices is None else int(devices)
    state = sum(prod(w.shape) for w in whole.weights) * weight_bytes(base) / count
    room = err.capacity_bytes - state
    if room <= 0:
        return None
    wanted = max(2 * m, m * (err.needed_bytes - state) / room)
    return next((k for k in range(m + 1, batch + 1) if batch % k == 0 and k >= wanted), None)


def _example_batch(graph, sizes: Mapping[str, int]) -> int | None:
    """The global batch of a built-in example that has one (None for any other graph)."""
    if isinstance(graph, str) and graph in EXAMPLES:
        return {**EXAMPLES[graph].defaults(), **sizes}.get(BATCH)
    return None


def _split(options: dict, sizes: Mapping[str, int], batch: int | None, m: int) -> dict:
    """optimize_step's options for a step of `m` micro-batches: an example built at its batch / m, any other
    graph taken as one micro-batch's."""
    if batch is None:
        return {**options, "sizes": dict(sizes) or None, "microbatches_of": m}
    if m == 1:
        return {**options, "sizes": dict(sizes) or None}
    if batch % m:
        raise OptimizeError(f"{m} micro-batches do not divide the batch of {batch}")
    return {**options, "sizes": {**sizes, BATCH: batch // m}, "microbatches_of": m}


def micro_batches_needed(plan: Plan, batch: int, m: int) -> int | None:
    """The fewest micro-batches (a divisor of `batch`, more than `m`) whose activations fit beside the weights'
    state, estimated from `plan` at `m` micro-batches: its activations shrink by m / m', its weights' state
    does not. None when the weights' state alone does not fit (splitting the batch cannot help). For a plan
    that recomputes (`ir.recompute`), the count at which keeping every activation would fit: its kept ones and
    every block's recomputed ones (`transient_bytes`, one block's per node that carries any)."""
    costs = plan.costs.values()
    transient = [c.transient_bytes for c in costs]
    kept = sum(c.activation_bytes for c in costs)
    activations = kept + sum(transient)
    state = plan.totals.peak_memory_bytes - kept - max(transient, default=0)
    room = plan.machine.memory_capacity - state
    if room <= 0 or activations <= 0:
        return None
    wanted = m * activations / room
    for k in range(m + 1, batch + 1):
        if batch % k == 0 and k >= wanted:
            return k
    return None


def optimize_step(graph, machine: Machine | str = "h100x8", rules=None, limits: Limits | Mapping | None = None,
                  devices: int | None = None, *, choose_rules: RuleChooser = every_rule,
             output_spreads: Mapping[str, Degrees | Mapping] | None = None,
             input_spreads: Mapping[str, Degrees | Mapping] | None = None, free_input_layouts: bool = True,
             baselines: bool = True, sizes: Mapping[str, int] | None = None,
             degrees: Mapping[str, int] | None = None, progress: Progress | None = None,
                  microbatches_of: int = 1, repeat_blocks: bool = True, in_flight: int = 1,
                  recompute: str = AUTO, clock: Deadline | None = None, caches: MeshCaches | None = None) -> Plan:
    """The cheapest plan the chosen rules reach for `graph` on `devices` devices of `machine`.

    `graph` is a Graph, a graph JSON path or an example name (with `sizes`);
    `rules` a Library, `.rule` paths, or None for the shipped rules, of which
    `choose_rules` picks the ones saturation applies (once the inputs are
    checked, so a bad graph is refused before any proof is looked up);
    `output_spreads` pins outputs (default: whole); `input_spreads` says how
    inputs arrive (default: in whatever layout the plan wants, as a data
    loader can read any slice; a pinned input read in another layout costs
    a gather). The search saturates the graph once per device mesh
    (`inputs.search_meshes`, docs/MESH.md) and keeps the cheapest plan;
    `limits.seconds` bounds the whole search. `degrees` pins kinds of
    parallelism (`{"tp": 2, "dp": 4}`: `strategies.pinned_meshes`) and
    searches the rest. A built-in example of more than three identical
    blocks is searched as three and the middle block's plan repeated
    (`repeat`), unless `repeat_blocks` is False. `in_flight` ranks memory with that many micro-batches'
    activations alive (a pipeline stage's, `pipeline_search`). `recompute` is the activation-recomputation
    policy ("none", "blocks": `ir.recompute`), or "auto": recompute blocks only where keeping every activation
    does not fit. `clock` is the search's deadline when a caller shares one among several searches (default:
    `limits.seconds` from now); `caches` the compiled rules they share. Raises OptimizeError, GraphError or
    MachineError with a message for the user.
    """
    say = progress or (lambda _m: None)
    if recompute not in POLICIES + (AUTO,):
        raise OptimizeError(f"--recompute must be one of {', '.join(POLICIES + (AUTO,))}, got {recompute!r}")
    library = resolve_library(rules)
    limits = Limits.resolve(limits)
    shared = clock is not None    # a part of a caller's deadline: building the graph is not cut by it
    clock = clock or Deadline.starting_now(limits)
    named = graph
    budget = GraphBudget(limits.enodes, None if shared else clock.at, limits.seconds)
    graph = resolve_graph(graph, library, sizes, budget)
    repetition = repetition_for(named, graph, library, sizes or {}, budget) if repeat_blocks else None
    if microbatches_of != 1:
        graph = graph.with_microbatches(microbatches_of)
        repetition = repetition and repetition.with_microbatches(microbatches_of)
    searched = repetition.searched if repetition else graph
    if recompute == BLOCKS and not has_blocks(leaf.name for leaf in graph.leaves):
        raise OptimizeError(f"--recompute blocks: '{graph.name}' has no blocks to recompute (ir.blocks: a block's "
                            "weights are named b0_..., b1_..., as the built-in examples name them)")
    if repetition:
        say(f"'{graph.name}' has {repetition.blocks} identical blocks: searching {SEARCHED_BLOCKS}, the middle one's "
            f"plan repeated {repetition.copies} times")
    base = Machine.resolve(machine)
    devices = base.devices if devices is None else int(devices)
    check_devices(graph, devices)
    machine = base.with_devices(devices)
    pins = check_pins(graph, output_spreads, input_spreads, devices)
    input_pins = {k: v for k, v in pins.items() if k not in graph.outputs}
    t = time.perf_counter()
    chosen, note = choose_rules(library)
    clock = clock.pause(time.perf_counter() - t)   # proofs (cached) are not the search's time
    chosen = list(chosen)
    say(f"{len(chosen)} rules; {note}")

    caches = caches or MeshCaches()
    try:
        pinned = pinned_meshes(dict(degrees or {}), devices, machine.devices_per_node)
    except PinError as err:
        raise OptimizeError(f"--degrees: {err}") from None
    candidates_meshes = [(m, c) for m, c in pinned] or [(m, None) for m in search_meshes(devices,
                                                                                         machine.devices_per_node)]
    meshes = [(mesh, config, pins_on(pins, mesh)) for mesh, config in candidates_meshes]
    meshes = [(mesh, config, placed) for mesh, config, placed in meshes if placed is not None]
    if not meshes:
        raise OptimizeError(f"no device mesh of {devices} devices can hold the pinned spreads")
    searches: list[MeshSearch] = []
    # the meshes get MESHES_SHARE of the time: simulating every candidate's step and the baselines take the rest
    meshes_clock = clock.part(MESHES_SHARE)
    for index, (mesh, config, placed) in enumerate(meshes):
        # what is left, split over the meshes to go, the first (one axis: the cheapest, and the data-parallel plans)
        # getting FIRST_MESH_SHARE of it when others follow
        part = FIRST_MESH_SHARE if index == 0 and len(meshes) > 1 else 1.0 / (len(meshes) - index)
        share = meshes_clock.limits(share=part)
        if share is None and not searches and shared:
            share = meshes_clock.remaining()   # a caller's part of its deadline ran out while building: least work
        if share is None:
            if not searches:
                raise OptimizeError(f"--limit seconds={limits.seconds:g} passed before saturation could start "
                                    f"(building '{graph.name}' took it); raise the limit")
            say(f"meshes {', '.join(str(m) for m, _, _ in meshes[index:])} not searched: --limit seconds="
                f"{limits.seconds:g} reached")
            break
        found = search_mesh(searched, library, chosen, mesh, Deadline(time.perf_counter() + share.seconds, limits),
                            machine, placed, input_pins, free_input_layouts, baselines, caches, say, config,
                            repetition, in_flight, recompute)
        searches.append(found)
    if pinned and not any(s.joint for s in searches):
        raise OptimizeError(f"--degrees {', '.join(f'{k}={v}' for k, v in degrees.items())} cannot hold for "
                            f"'{graph.name}': {searches[0].error or 'no plan uses the pinned axes that way'}")
    if devices > 1 and not any(s.spread for s in searches):
        stopped = [s.result.stop for s in searches if s.result.stop != STOP_SATURATED]
        if stopped:
            value = getattr(limits, stopped[0], "")
            raise OptimizeError(f"saturation stopped at --limit {stopped[0]}={value:g} before any parallel rule "
                                f"spread '{graph.name}' over {devices} devices; raise the limit")
        raise OptimizeError(f"no rule can spread '{graph.name}' over {devices} devices (no parallel rule applies "
                            "on any mesh of the device count)")
    steps = CandidateSteps(library, machine, graph.microbatches)
    searches = [s.simulated(steps) for s in searches]
    solved = [s for s in searches if s.joint is not None]
    if not solved:
        needs = [s for s in searches if s.needed_bytes]
        if needs:
            least = min(needs, key=lambda s: s.needed_bytes)
            raise DoesNotFit(least.error, least.needed_bytes, machine.memory_capacity)
        raise OptimizeError(searches[0].error or f"no plan for '{graph.name}' on {devices} devices")
    best_search = min(solved, key=lambda s: _rank(s.joint, machine))
    candidates = [best_search.joint]
    found_baselines: dict[str, Totals | None] = {}
    # The baselines that restrict each mesh's e-graph (Megatron, the grid) were extracted with it, and data
    # parallelism is built directly: they are always there to compare with. Only the sequential baseline saturates
    # again (twice), so only it is left out when the deadline leaves no time.
    spare = clock.limits(share=0.5)
    skipped = (f"sequential: --limit seconds={limits.seconds:g} reached before it" if baselines and spare is None
               else "")
    if skipped:
        say(f"baseline {skipped}")
    if baselines:
        megatron = _best([s.megatron for s in searches], machine)
        two_phase = sequential(searched, library, chosen, best_search.mesh,
                               replace(spare, ilp_seconds=min(spare.ilp_seconds, limits.ilp_seconds / 2)),
                               machine, best_search.pins, input_pins, free_input_layouts, say, caches,
                               repetition) if spare is not None else None
        dp = data_parallel(graph, library, machine, free_input_layouts, devices) if not pins else None
        two_phase, dp = steps(two_phase), steps(dp)
        # data parallelism over every device is a point of the grid too, built directly where an e-graph cut
        # short by the limits may not reach it
        as_grid = replace(dp, name="best_grid", config={"dp": devices, "tp": 1, "sp": False, "zero": 0,
                                                         "microbatches": graph.microbatches}) if dp else None
        grid = _best([s.grid for s in searches] + [as_grid], machine)
        for name, candidate in (("megatron", megatron), ("sequential", two_phase), ("data_parallel", dp),
                                ("best_grid", grid)):
            found_baselines[name] = candidate.totals if candidate is not None else None
            if candidate is not None:
                candidates.append(candidate)

    # Every candidate must be one the backend can lay out (`pcg_layout`): the placement analysis makes that so,
    # and a candidate that still is not is left out, and said, rather than returned.
    unplaceable = _unplaceable(candidates, library)
    for name, why in unplaceable.items():
        say(f"{name}: left out, it cannot be laid out on the devices ({why})")
    candidates = [c for c in candidates if c.name not in unplaceable]
    if not candidates:
        raise OptimizeError(f"internal: no plan for '{graph.name}' can be laid out on {devices} devices "
                            f"({unplaceable.get(JOINT, '')})")
    # Every baseline is a PCG priced by the same model, so the best candidate is a valid plan. The joint plan
    # wins ties; a baseline only replaces it when strictly cheaper (e.g. after a limit stopped the joint search),
    # and `extraction.chosen` and explain() say so.
    # With pinned degrees the plan is the pinned one; the baselines are there to compare with.
    best = candidates[0] if pinned and candidates[0].name == JOINT else min(candidates, key=lambda c: _rank(c, machine))
    if best.name != JOINT:
        say(f"baseline {best.name} was cheaper than anything extracted: the plan is its PCG")
    joint = best_search.result
    extraction = best_search.extraction
    saturation = joint.to_dict()
    saturation["rules_note"] = note
    saturation["rules_available"] = len(chosen)
    saturation["mesh"] = str(best_search.mesh)
    saturation["meshes"] = [s.summary() for s in searches]
    if repetition:
        saturation["repeated_blocks"] = repetition.to_dict()
    ext = {"method": extraction.method, "chosen": best.name,
           "seconds": round(best_search.extract_seconds, 4), "candidates": dict(extraction.candidates),
           "ilp_status": extraction.ilp_status, "pass_seconds": dict(extraction.seconds)}
    if unplaceable:
        ext["unplaceable"] = unplaceable
    if steps.failures:
        ext["unsimulated"] = dict(steps.failures)
        say("ranked by the per-node sum, the step simulator could not run them: "
            + "; ".join(f"{k}: {v}" for k, v in steps.failures.items()))
    if skipped:
        ext["baselines_skipped"] = skipped
    baseline_plans = {c.name: BaselinePlan(c.pcg, c.costs, c.config) for c in candidates if c.name != JOINT}
    return Plan(graph, machine, devices, best.pcg, best.costs, best.totals, found_baselines,
                rules_used(chosen, joint.snapshot, extraction.choice) if best.name == JOINT else (),
                saturation, ext, pins, baseline_plans)


def _best(found: Sequence[Candidate | None], machine: Machine) -> Candidate | None:
    present = [c for c in found if c is not None]
    return min(present, key=lambda c: _rank(c, machine)) if present else None


def _rank(candidate: Candidate, machine: Machine) -> tuple:
    """Plans that fit in memory first, then the fastest; the joint plan wins ties. When none fits, the one that
    needs least memory (what the micro-batch search splits from, and what the user is told)."""
    fits = candidate.totals.fits(machine)
    return (not fits, round(candidate.totals.time_s, 12) if fits else candidate.totals.peak_memory_bytes,
            candidate.name != JOINT)


SATURATION_SHARE = 0.6   # of a mesh's time, for saturating: pricing, extraction and the baselines take the rest
FIRST_MESH_SHARE = 0.5   # of a search's time, for its first mesh when several are searched
MESHES_SHARE = 0.8       # of a search's time, for its meshes (saturation, extraction); then the candidates' steps


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

    def summary(self) -> dict:
        return {"mesh": self.mesh.to_dict(), "stop": self.result.stop, "enodes": self.result.enodes,
                "seconds": round(self.result.seconds + self.result.compile_seconds + self.extract_seconds, 4),
                "time_s": self.joint.totals.time_s if self.joint else None,
                "node_sum_s": self.joint.totals.per_node_s if self.joint else None, "error": self.error}

    def simulated(self, steps: "CandidateSteps") -> "MeshSearch":
        """This search with its candidates' steps simulated (`CandidateSteps`)."""
        return replace(self, joint=steps(self.joint), megatron=steps(self.megatron), grid=steps(self.grid))


class CandidateSteps:
    """Simulates candidates' steps for the final ranking (`step_report.simulate_step`), sharing one cache of
    compute times; a candidate the simulator cannot run keeps its per-node sum, and `failures` says why."""

    def __init__(self, library: Library, machine: Machine, microbatches: int = 1):
        self.library, self.machine, self.microbatches = library, machine, microbatches
        self.times = OpTimes(library, machine)
        self.failures: dict[str, str] = {}
        # a PCG found twice (a mesh's joint plan is often one of its grid points) is simulated once: a step of
        # many micro-batches of a whole model takes seconds
        self.simulated: dict = {}

    def __call__(self, candidate: Candidate | None) -> Candidate | None:
        if candidate is None or candidate.totals.streams is not None:
            return candidate
        found = self.simulated.get(candidate.pcg)
        if found is None:
            try:
                found = simulate_step(candidate.pcg, self.library, self.machine, self.microbatches, self.times)
            except (TaskBuildError, SimulationError) as err:
                self.failures[candidate.name] = str(err)
                return candidate
            self.simulated[candidate.pcg] = found
        return replace(candidate, totals=candidate.totals.simulated(*found))


def search_mesh(graph: Graph, library: Library, rules: Sequence[ast.RuleDecl], mesh: Mesh, clock: "Deadline",
                machine: Machine, pins: Mapping[str, Placement], input_pins: Mapping[str, Degrees],
                free_inputs: bool, baselines: bool, caches: MeshCaches, say: Progress,
                config: Config | None = None, repetition: Repetition | None = None,
                in_flight: int = 1, recompute: str = AUTO) -> MeshSearch:
    """Saturate on one mesh, price every e-node, extract the joint plan (within `config`, pinned degrees, when
    given) and the baselines that restrict the same e-graph (Megatron, the grid), all before `clock`'s deadline
    (extractions past it take the greedy passes only: a plan, never none). With a `repetition`, `graph` is the
    searched blocks and every plan the whole model's (`repeat`).

    `recompute` ("none", "blocks": `ir.recompute`) is the activation-recomputation policy the plans run with;
    AUTO extracts with every activation kept, and again recomputing blocks when that plan does not fit (the
    e-graph is priced once: recomputation changes costs, not values, `search.recompute`)."""
    t = time.perf_counter()
    result = saturate(graph, library, rules, mesh, clock.remaining(SATURATION_SHARE), pins, caches=caches)
    say(f"mesh {mesh}: saturation {result.stop} after {result.iterations} iterations, {result.enodes} e-nodes, "
        f"{time.perf_counter() - t:.2f} s")
    spread = any(p.spread_axes for p in result.snapshot.placement.values())
    roots = [result.classes[f"pin:{n}"] if n in pins else result.classes[n] for n in graph.outputs]
    t = time.perf_counter()
    raw = node_costs(result.snapshot, graph, library, machine, free_inputs, input_pins)
    pinned = config_excluded(result.snapshot, leaf_roles(result.snapshot, graph), config) if config else None
    policies = (NONE, BLOCKS) if recompute == AUTO else (check_policy(recompute),)
    if recompute == AUTO and not has_blocks(leaf.name for leaf in graph.leaves):
        policies = (NONE,)   # no blocks (`ir.blocks`): nothing to recompute
    failure: MeshSearch | None = None
    found = None    # (policy, priced, pcg, costs, extraction, joint) of the plan kept so far
    for policy in policies:
        priced = price(result, graph, library, machine, free_inputs, input_pins, repetition, roots, policy, raw)
        try:
            pcg, costs, extraction = solve(result, graph, library, machine, roots, clock.remaining(),
                                           free_inputs, pinned, pins=input_pins, costs=priced, repetition=repetition,
                                           in_flight=in_flight, recompute=policy)
        except ExtractionError as err:
            if failure is None or 0 < err.needed_bytes < (failure.needed_bytes or float("inf")):
                failure = MeshSearch(mesh, pins, result, None, None, None, None, time.perf_counter() - t, spread,
                                     str(err), err.needed_bytes)
            continue
        except RepeatError as err:   # this policy's plan cannot be repeated: another policy's may be
            say(f"mesh {mesh}: {err}")
            failure = failure or MeshSearch(mesh, pins, result, None, None, None, None, time.perf_counter() - t,
                                            spread, f"the plan's blocks cannot be repeated ({err}); --all-blocks "
                                                    "searches every block")
            continue
        joint = Candidate(JOINT, pcg, costs, totals(costs, machine))
        if joint.totals.fits(machine) or found is None or \
                joint.totals.peak_memory_bytes < found[5].totals.peak_memory_bytes:
            found = (policy, priced, pcg, costs, extraction, joint)
        if joint.totals.fits(machine):
            break
        if policy != policies[-1]:
            say(f"mesh {mesh}: the plan keeping every activation needs {joint.totals.peak_memory_bytes / 2**30:.1f} "
                "GiB per device: extracting again with activation recomputation")
    if found is None:
        return failure
    policy, priced, pcg, costs, extraction, joint = found
    seconds = time.perf_counter() - t
    say(f"mesh {mesh}: extraction {extraction.method}, {seconds:.2f} s, plan {joint.totals.time_s * 1e3:.3f} ms"
        + (f", {describe_recompute(policy)}" if policy != NONE else ""))
    megatron = grid = None
    if baselines:
        grid = best_grid(result, graph, library, machine, roots, clock.remaining(0.5), free_inputs,
                         priced, input_pins, repetition, policy)
        excluded = megatron_excluded(result.snapshot, leaf_roles(result.snapshot, graph))
        try:
            mpcg, mcosts, _ = solve(result, graph, library, machine, roots, clock.remaining(),
                                    free_inputs, excluded, pins=input_pins, costs=priced, repetition=repetition,
                                    recompute=policy)
            if mpcg.max_pieces > 1:
                megatron = Candidate("megatron", mpcg, mcosts, totals(mcosts, machine))
        except (ExtractionError, RepeatError):
            pass
    return MeshSearch(mesh, pins, result, extraction, joint, megatron, grid, seconds, spread)


def _unplaceable(candidates: Sequence[Candidate], library: Library) -> dict[str, str]:
    """The candidates whose PCG cannot be laid out on its mesh, and why."""
    out = {}
    for candidate in candidates:
        try:
            lay_out(candidate.pcg, library.ops)
        except PlacementError as err:
            out[candidate.name] = str(err)
    return out
