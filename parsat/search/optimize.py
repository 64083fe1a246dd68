"""`optimize(graph, machine=..., rules=..., limits=...) -> Plan`: the joint search and its baselines.

1. resolve the inputs once (`request.resolve_request`) and ask the caller
   which rules saturation may apply (`choose_rules`: the facade's
   `parsat.optimize` keeps the rules the verifier PROVED; this package
   never imports the verifier);
2. for each micro-batch count the batch needs (`microbatches`), and for
   each pipeline stage plan (`pipeline_search`), search one step
   (`step.search_step`): saturate the graph with algebraic and parallel
   rules together, within limits, once per device mesh the devices can
   form (docs/MESH.md: nodes x GPUs and its factorisations), rules lifted
   onto each (`mesh.search_mesh`);
3. price every e-node with the cost model (per node, so costs add up) and
   extract the cheapest plan that fits in memory (`solve`);
4. compute the baselines with the same cost model (`baselines`): data
   parallelism only, the sequential approach (algebraic rules first, then
   parallel rules), and Megatron-style tensor parallelism (graph inputs
   never split);
5. simulate the step of every candidate (each mesh's joint plan and every
   baseline) with the same step simulator (`mesh.CandidateSteps`:
   overlap of communication with computation, DDP buckets, micro-batches);
6. the best feasible plan by simulated step time wins: the joint plan
   unless a baseline's PCG (each is a valid PCG, kept in the plan so a
   backend can run it) is strictly faster, which the plan then says
   (`extraction.chosen`). The plan keeps both figures: `totals.time_s`
   (simulated) and `totals.node_sum_s` (the per-node sum extraction used).

`limits.seconds` bounds the whole call, not saturation alone: loading the
rules and looking up their proofs, building the graph (checked as it is
built, `ir.budget`, and refused up front when it has more tensors than
the limit pays for), saturating, extracting and the baselines share one
deadline (`Deadline`); what the deadline leaves no time for is cut (the
ILP, then the baselines), never the plan, and a graph that cannot be built
or loaded in time is a GraphError or OptimizeError saying so.
"""

from __future__ import annotations

from math import prod
from typing import Mapping, Sequence

from parsat.cost.model import weight_bytes
from parsat.cost.pcg_tasks import profile_for
from parsat.cost.pipeline import StageFit
from parsat.cost.saved import graph_kept_bytes
from parsat.egraph.runner import Limits
from parsat.ir.errors import DoesNotFit, OptimizeError
from parsat.ir.machine import Machine
from parsat.ir.models import EXAMPLES
from parsat.ir.pipeline import INTERLEAVED, chunks_refusal
from parsat.ir.plan import Plan
from parsat.ir.units import fmt_bytes_pair
from parsat.search.collector import paused_while_searching
from parsat.search.deadline import Deadline
from parsat.search.microbatches import every_mesh_at, merged, rank_plans, search_unstaged
from parsat.search.pipeline_search import best_of, parameters_of, search_pipelines
from parsat.search.request import (Progress, RuleChooser, SearchRequest, check_microbatches, every_rule,
                                   graph_blocks, resolve_request, stageable, step_context)
from parsat.search.step import search_step

__all__ = ["optimize", "every_rule", "Progress", "RuleChooser"]

UNSTAGED_SEARCHES_BESIDE_PIPELINE = 3   # micro-batch counts the unstaged search tries when a pipeline is searched too
UNSTAGED_SHARE = 0.5         # of the time limit, for the unstaged search when a pipeline is searched beside it
UNSTAGED_SHARE_FIRST = 0.75  # ... when the pipeline is searched only if no unstaged plan fits
# every mesh is searched at the unstaged scout's count unless a pipelined plan is faster by more than this: a
# two-axis joint plan beat the scout's (one-axis mesh and grid) by 9.4% on llama-70b:64 (16.539 -> 14.985 s)
UNSTAGED_EVERY_MESH_WITHIN = 0.10


def optimize(graph, machine: Machine | str = "h100x8", rules=None, limits: Limits | Mapping | None = None,
             devices: int | None = None, *, microbatches: int | None = None, pipeline: bool | None = None,
             schedule: str | None = None, chunks_per_stage: int | None = None, **options) -> Plan:
    """The cheapest plan, unstaged (`microbatches.search_unstaged`) or pipelined (`pipeline_search`).

    `graph` is a Graph, a graph JSON path or an example name (with `sizes`);
    `rules` a Library, `.rule` paths, or None for the shipped rules, of which
    `choose_rules` picks the ones saturation applies; `output_spreads` pins
    outputs (default: whole); `input_spreads` says how inputs arrive
    (default: in whatever placement the plan wants, as a data loader can read
    any slice; a pinned input read in another placement costs a gather).
    `degrees` pins parallel dims, kinds of parallelism (`{"tp": 2, "dp": 4, "pp": 2}`:
    `strategies.pinned_meshes`) and searches the rest. A graph of more than
    three identical blocks (a built-in example's, an imported stack's:
    `ir.block_layout`) is searched as three and the middle block's plan
    repeated (`repeat`), unless `repeat_blocks` is False.
    `recompute` is the activation-recomputation policy ("none", "blocks":
    `ir.recompute`), or "auto": recompute blocks only where keeping every
    activation does not fit. The other options are `resolve_request`'s.

    A built-in example of several blocks, or a graph whose weights fall in
    several blocks (an imported module's: `request.graph_blocks`, its step
    taken as one micro-batch's), is also searched as a pipeline
    (stages over a mesh axis, micro-batches, a schedule) when `pipeline` is
    True, when its devices span more than one node, when `degrees` pins
    `pp` above 1, or when no unstaged plan fits; `pipeline=False` never
    does. `schedule` pins the pipeline schedule ("gpipe", "1f1b",
    "interleaved"); `chunks_per_stage` pins the interleaved schedule's chunks
    per stage (Megatron-Core's `--virtual-pipeline-model-parallel-size`; 2 or
    more implies "interleaved"), refused when the layers of a stage do not
    split evenly into them (`ir.pipeline.chunks_refusal`, Megatron's rule);
    unpinned, the search takes the least that does (`cost.pipeline.schedule_chunks`).
    The fastest plan that fits wins, the unstaged one on a
    tie; `saturation.pipeline_search` lists what was tried.

    `limits.seconds` bounds the whole call (`deadline`): the unstaged search
    gets `UNSTAGED_SHARE` of it when a pipeline is searched too
    (`UNSTAGED_SHARE_FIRST` when the pipeline waits on it not fitting), the
    pipeline what is left. Every search shares one cache of compiled rules.
    Raises OptimizeError, GraphError or MachineError with a message for the user.
    The cyclic collector is paused meanwhile (`collector`).
    """
    with paused_while_searching():
        schedule = _check_chunks_pin(graph, options, schedule, chunks_per_stage)
        return _optimize(graph, machine, rules, limits, devices, microbatches, pipeline, schedule, options,
                         chunks_per_stage)


def _optimize(graph, machine, rules, limits, devices, microbatches, pipeline, schedule, options: Mapping,
              chunks: int | None = None) -> Plan:
    """`optimize`'s search, its arguments as given."""
    check_microbatches(graph, options.get("sizes"), microbatches)
    _check_pipeline_pin(graph, machine, devices, options, pipeline)
    clock = Deadline.starting_now(Limits.resolve(limits))   # bad limits are refused here, before any work
    request = resolve_request(graph, machine, rules, limits, devices, deadline=clock.at, **options)
    refuse_unfitting_state(request)   # before any search: where the weights' state alone cannot fit, no plan can
    count, per_node = request.devices, request.machine.devices_per_node
    pp = request.pipeline_degree
    can_stage = stageable(_staged_graph(request), request.sizes, count)
    if pp is not None and pp > 1 and not can_stage:   # a graph file's blocks, read
        raise OptimizeError(_unstageable(pp, request.graph))
    flat, unfit = None, None
    if pp is None or pp == 1:
        # across nodes the pipeline is searched too: the unstaged search then gets fewer micro-batch counts
        surely = can_stage and pipeline is not False and (count > per_node or pipeline is True)
        searches = UNSTAGED_SEARCHES_BESIDE_PIPELINE if surely else None
        share = UNSTAGED_SHARE if surely else UNSTAGED_SHARE_FIRST if can_stage and pipeline is not False else 1.0
        try:
            flat = search_unstaged(request, clock.part(share), microbatches, searches,
                                   every_mesh=not (surely and pp is None))
        except DoesNotFit as err:
            if not can_stage or pipeline is False:
                raise
            unfit = err
    try:
        wanted = pipeline is True or (pp or 1) > 1 or (pipeline is None and (
            count > per_node or unfit is not None or not flat.totals.fits(flat.machine)))
        if flat is not None and clock.interrupted.is_set():
            wanted = False   # Ctrl-C during the unstaged search: its best plan is the answer
        if not can_stage or pipeline is False or pp == 1 or not wanted:
            if schedule is not None and flat is not None:
                request.say(f"--schedule {schedule}: the plan is not pipelined")
            return flat
        def sharpen(scouts: tuple[Plan, ...]) -> Plan | None:
            """The unstaged plan, searched on every mesh where the pipelined scouts leave it within reach."""
            if flat is not None and _within_reach(flat, scouts):
                return merged(every_mesh_at(request, clock, flat), flat, request.batch, request.say)
            return flat
        found = _search_pipelines(request, clock, microbatches, schedule, flat, chunks, sharpen)
        flat = found.unstaged
        if flat is None and not found.plans and unfit is not None:
            raise unfit
        return best_of(flat, found, request.machine, pinned=request.pinned)
    finally:
        # the error, raised, holds this frame in its traceback, and this frame holds it: a reference cycle that
        # kept the whole call's memos (`request`) for a full collection of the cyclic collector to free
        # (llama-70b:64: 2.3 million objects, 2.2 CPU s, in whatever ran after the call)
        unfit = None


def state_floor(request: SearchRequest) -> int:
    """A lower bound of the memory per device of every plan `request` can have, unstaged at every micro-batch
    count or pipelined: each weight some node reads held once for training over all the request's devices, at
    the fewest bytes a parameter costs in any figure a step judges fit by (`step.memory`, `Totals.memory_bytes`).
    `refuse_unfitting_state` refuses the call with it before any search.

    Why no plan holds less. Every figure counts each stored weight's training state per device at its stored
    piece (the elements of its placement on the device: at least its elements over the devices, a placement
    splitting it over mesh axes whose product is at most the device count) times the bytes a parameter holds
    there, of which ZeRO stage z over the p data-parallel replicas of that piece takes off at most the share
    (p - 1) / p of every part (`ParameterBytes.sharded`): so at least its elements times the bytes over
    (split degree) x p <= devices. The figures: the simulated peak, at least the `resident` bytes held the whole
    step (`cost.pcg_tasks._Builder.resident`: the profile's optimizer (`profile_for`: `DDP`, Adam, on GPUs;
    `PARSAT_RUN`, SGD, on a CPU box), gradients left out where the profile frees them); the peak floor that
    refuses a candidate unsimulated (`peak_floor`, `resident()` and more); the per-node bound, which counts
    `weight_bytes` (Adam) at each weight's storage (`cost.model._parallel_memory`: a placement, a finer one
    replacing the coarser, ZeRO's share taken off) or at the operator that reads it whole (`compute_cost`). So
    the floor takes the fewer of the two byte counts. Rules rewrite values, never the weights a plan trains
    (leaves), so a weight the graph reads is held by every plan of it; a weight nothing reads is left out.

    What it leaves out, on purpose: activations. What a plan keeps for backward depends on the values the
    extraction chooses (algebraic rules may fuse or restructure them, recomputation drops a block's), so no
    figure read off the graph as written bounds every plan; the weights' state is what every plan holds.
    llama-70b:64 (16 bytes a parameter): 16.06 GiB of the 80 (its unstaged counts need 87-116 GiB as
    simulated: what keeps them out is the placements the rules reach, not the state); llama-70b:8: 128.5 GiB,
    refused before a count is searched.

    Pipelined plans: a stage's plan is judged by its layers' figures (`cost.pipeline.node_share`: each node's
    per-node-bound state, the same `weight_bytes` at the same pieces), its weights spread over its own devices
    at best. Stage s holds at least W_s / D_s per device (W_s its weights' state at these bytes, D_s its
    devices), every weight is some stage's, and the stages' devices are the request's: so the most loaded
    stage holds max_s W_s / D_s >= (sum_s W_s) / (sum_s D_s) = the floor (a weight two stages read counts
    twice, more).

    What the refusal changes: the floor holds at every count and pipeline, so every search that would have run
    fails (a scout's step raises where no candidate fits: `step._search_step`; a pipeline pair's stage plan fits
    under no schedule); the unstaged search tried one count only when `more_micro_batches` saw no room (its
    state over the machine's devices, the same where they are the request's: llama-70b:8), else more, all
    failing, and the pipeline search every pair it tries. The answer stays DoesNotFit, now with the floor's
    message and figure, and where a search would have failed otherwise (an OptimizeError that is not
    DoesNotFit) that error is not reached."""
    graph, machine = request.whole, request.machine
    read = {name for node in graph.nodes for name in node.inputs}
    parameters = sum(prod(w.shape) for w in graph.weights if w.name in read)
    profile = profile_for(machine)
    held = machine.precision_spec.parameter_bytes(profile.optimizer)
    simulated = held.total - (held.gradient if profile.transient_gradients else 0)
    return -(-parameters * min(simulated, weight_bytes(machine)) // request.devices)


def refuse_unfitting_state(request: SearchRequest) -> None:
    """Raise DoesNotFit, saying by how much, where the weights' state alone does not fit (`state_floor`)."""
    floor, capacity = state_floor(request), request.machine.memory_capacity
    if floor <= capacity:
        return
    needs, has = fmt_bytes_pair(floor, capacity)
    raise DoesNotFit(f"no plan fits in memory: every plan needs at least {needs} per device for the weights' "
                     f"training state alone (every weight spread over all {request.devices} devices), the device has "
                     f"{has} (use more devices or a smaller model)", floor, capacity)


def _within_reach(scout: Plan, pipelined: Sequence[Plan]) -> bool:
    """Whether every mesh is searched at the unstaged scout's count: where no pipelined plan beats the scout's, or
    the best that does is faster by at most `UNSTAGED_EVERY_MESH_WITHIN` (the scout saw one mesh and the grid; a
    two-axis joint plan may close that gap). A fixed fraction of predicted steps: the same plans on any box.
    `pipelined`: the pipeline scouts' plans, before any stage mesh but the first is searched (`sharpen` in
    `_optimize`), so the unstaged plan this search returns is the bar that search must beat."""
    rivals = [p for p in pipelined if rank_plans(p) < rank_plans(scout)]
    if not rivals:
        return True
    if not scout.totals.fits(scout.machine):
        return False   # a pipelined plan fits where the scout's does not
    best = min(p.totals.time_s for p in rivals)   # every rival fits, as the scout does
    return scout.totals.time_s <= best * (1 + UNSTAGED_EVERY_MESH_WITHIN)


def _search_pipelines(request: SearchRequest, clock: Deadline, microbatches: int | None, schedule: str | None,
                      bar: Plan | None, chunks: int | None = None, sharpen=None):
    """The pipelined candidates: one stage plan (`search_step` on a stage's machine) per pipeline degree and
    micro-batch count that `pipeline_search` tries."""
    def stage_plan(stage_machine: Machine, stage_devices: int, m: int, in_flight: int, fit: StageFit,
                   stage_clock: Deadline | None, scout: bool) -> Plan:
        step = step_context(request, m, stage_machine, stage_devices, in_flight, stage=fit, scout=scout)
        return search_step(step, stage_clock or Deadline.starting_now(request.limits))

    pp = request.pipeline_degree
    return search_pipelines(stage_plan, request.machine, request.devices, request.batch,
                            parameters_of(request.whole), _blocks(request) + 1,
                            degree=pp if pp and pp > 1 else None, microbatches=microbatches, schedule=schedule,
                            say=request.say, clock=clock, bar=bar, library=request.library,
                            sample_bytes=graph_kept_bytes(request.whole, request.library, request.machine)
                            / request.batch if request.batch else None, chunks=chunks, sharpen=sharpen)


def _blocks(request: SearchRequest) -> int:
    """The number of blocks of a pipelined graph (`stageable`)."""
    return graph_blocks(_staged_graph(request), request.sizes)


def _staged_graph(request: SearchRequest):
    """What `stageable` reads of the request's graph: a built-in example's name (its sizes say its blocks), else the
    graph itself (a graph file's too, read)."""
    return request.graph if isinstance(request.graph, str) and request.graph in EXAMPLES else request.whole


def _check_chunks_pin(graph, options: Mapping, schedule: str | None, chunks: int | None) -> str | None:
    """The schedule a chunks-per-stage pin implies (interleaved for 2 or more); OptimizeError with the reason
    for a pin that cannot hold: not a positive integer, beside a one-chunk schedule, or (pinned pipeline degree
    of a built-in example) a split of each stage's layers that is not even (`ir.pipeline.chunks_refusal`)."""
    if chunks is None:
        return schedule
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise OptimizeError(f"chunks_per_stage must be a positive integer, got {chunks!r}")
    if chunks == 1:
        if schedule == INTERLEAVED:
            raise OptimizeError("interleaved 1F1B runs 2 or more chunks per stage, not 1")
        return schedule
    if schedule not in (None, INTERLEAVED):
        raise OptimizeError(f"{chunks} chunks per stage need the interleaved schedule, not {schedule}")
    pp = dict(options.get("degrees") or {}).get("pp")
    if isinstance(graph, str) and graph in EXAMPLES and isinstance(pp, int) and not isinstance(pp, bool) and pp > 1:
        blocks = {**EXAMPLES[graph].defaults(), **dict(options.get("sizes") or {})}.get("blocks")
        why = chunks_refusal(INTERLEAVED, blocks, pp, chunks) if isinstance(blocks, int) else None
        if why is not None:
            raise OptimizeError(f"--chunks-per-stage {chunks}: {why}")
    return INTERLEAVED


def _check_pipeline_pin(graph, machine, devices, options: Mapping, pipeline: bool | None) -> None:
    """Refuse a pinned pipeline degree (`--degrees pp`) that cannot hold, before anything is resolved."""
    pp = dict(options.get("degrees") or {}).get("pp")
    if pp is None or isinstance(pp, bool) or not isinstance(pp, int) or pp <= 1:
        return   # absent, 1, or not an integer (which `resolve_request` refuses)
    if pipeline is False:
        raise OptimizeError("--degrees pp asks for a pipeline, which pipeline=False (--no-pipeline) turns off")
    count = Machine.resolve(machine).devices if devices is None else int(devices)
    unread = isinstance(graph, str) and graph not in EXAMPLES   # a graph file: judged once read (`_optimize`)
    if not unread and not stageable(graph, dict(options.get("sizes") or {}), count):
        raise OptimizeError(_unstageable(pp, graph))
    if count % pp:
        raise OptimizeError(f"--degrees pp={pp} does not divide the {count} devices")


def _unstageable(pp: int, graph) -> str:
    """Why a pinned pipeline degree cannot hold on `graph` (`stageable`)."""
    if isinstance(graph, str) and graph in EXAMPLES:
        return (f"--degrees pp={pp}: only a built-in example of several blocks, with a batch, on several devices is "
                f"pipelined ('{graph}' is not)")
    return (f"--degrees pp={pp}: only a graph of several blocks (weights named b0_..., b1_..., as the importer names "
            "a module's layers), or a built-in example of several blocks, on several devices is pipelined")
