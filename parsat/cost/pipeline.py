"""Pipeline parallelism priced: a stage plan cut into stages, the cut points chosen by the cost model.

A pipelined plan is a stage plan (a PCG for the whole model on the stage
mesh of S devices, found by the joint search, `search.optimize`) run on p
stages of S devices each, every stage computing a contiguous run of the
layers (`ir.pipeline.lay_out_stages`). This module:

1. profiles the stage plan per layer (`layer_costs`: each layer's
   forward and backward seconds per micro-batch, the activations one
   micro-batch keeps, its weights' state, from the plan's node costs);
2. chooses the cut points (`balanced_starts`): contiguous stages that
   minimise the slowest stage's time per micro-batch (what sets a
   pipeline's steady state) subject to each stage's memory, weights'
   state plus the activations its schedule keeps in flight, fitting the
   device: stages balanced by predicted time and memory, not by layer
   count (`equal_starts` is the layer-count split Megatron-LM uses, kept
   for the grid baseline and for comparison);
3. prices the cut plan (`pipelined`): the schedule simulated action by
   action (`ir.pipeline.simulate_schedule`: the bubble comes out of it,
   (p - 1) / (m + p - 1) of the step for 1F1B, less when interleaved),
   point-to-point transfers on the link between two stages' ranks, each
   stage's weights' gradient reductions overlapped with each chunk's last
   backward (`overlapped_reduce_end`, Megatron's overlap_grad_reduce; after
   the stage's last backward where the machine's profile does not overlap
   them, `CommProfile.overlap_grad_reduce`), the rest of its synchronisation and its optimizer once per step after them
   (ZeRO-1/2's all-gathers of updated shards too, unless the machine's
   profile overlaps them with the next step's forward, Megatron's
   overlap_param_gather: then each chunk's first forward waits for what its
   first layers cannot hide, `StagePricer._gather_wait`), the sum of a weight held on two
   stages (a tied embedding) after the flush, and each stage's peak memory
   from the schedule's in-flight activations. Where the machine's profile
   pipelines in-node tensor-parallel collectives with their GEMMs
   (`ExecutionProfile.tp_comm_overlap`, Megatron-Core's --tp-comm-overlap),
   each chunk's forward and backward are the node costs' less the part of
   their activation collectives the step simulator hides for one
   micro-batch of the stage plan (`TpOverlap`, docs/PIPELINE.md).

The figures add up from the same node costs that rank unstaged plans, so a
pipelined plan and an unstaged one are compared on one cost model.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from itertools import accumulate, chain, compress, filterfalse, repeat
from operator import attrgetter
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Collection, Mapping, Sequence

import numpy as np

from parsat.dsl.library import Library
from parsat.ir.blocks import block_excerpt, node_blocks
from parsat.ir.costs import NodeCost, Totals
from parsat.ir.machine import Machine
from parsat.ir.pipeline import (BACKWARD, GPIPE, INTERLEAVED, ONE_F_ONE_B, Action, Chunk, LayerMap, PipelineError,
                                PipelinePlan, StageFigures, StageLayout, activation_peaks, chunks_refusal,
                                in_flight_counts, interleaved_chunk_counts, layer_structure, nodes_elements,
                                p2p_elements, schedule_order, shared_weight_elements, simulate_schedule,
                                stored_piece_elements)
from parsat.ir.plan import Plan
from parsat.cost.collectives import ALL_REDUCE, SEND_RECV, GroupTopology, price
from parsat.cost.pcg_tasks import (ExecutionProfile, OpTimes, collective_pipelines, profile_for,
                                  simulate_pcg)
from parsat.cost.schedules import prefetch_delay
from parsat.cost.stage_sync import Reduction, bucketed_seconds, gather_buckets, weight_gathers, weight_reductions
from parsat.cost.step_report import ends_by_phase, phase_ends, stream_phase_ends


@dataclass(frozen=True)
class LayerCost:
    """One layer of a stage plan, per rank of its stage: what the cut-point search adds up."""

    forward_s: float = 0.0       # per micro-batch
    backward_s: float = 0.0      # per micro-batch
    activation_bytes: int = 0    # what one micro-batch keeps alive until its backward
    state_bytes: int = 0         # weights, gradients, optimizer state (and accumulated gradients)
    step_s: float = 0.0          # once per step: its weights' chains (gathers, gradient reductions), the optimizer
    transient_bytes: int = 0     # the largest recomputed block's activations (`ir.recompute`), one at a time
    tp_comm_s: float = 0.0       # per micro-batch and direction: the part of forward_s (and of backward_s) that is
    #                              in-node activation collectives, what tensor-parallel overlap can hide (`TpOverlap`)


_FIGURES = tuple(attrgetter(name) for name in ("forward_s", "backward_s", "activation_bytes", "state_bytes", "step_s",
                                                "transient_bytes", "tp_comm_s"))
"""A `LayerCost`'s figures, each read by a C getter (`_summed` maps them over a chunk's ~1,000 shares)."""


def node_share(cost: NodeCost, microbatches: int, in_node: bool = False) -> LayerCost:
    """One node's part of its layer. Costs are per step (`NodeCost.per_step`): compute and activation
    collectives divide by the micro-batches, half of a node's collective time counted with the forward and
    half with the backward (its dual). A weight's chain runs once per step: its time is the stage's
    synchronisation (`stage_figures`), not a micro-batch's. `in_node`: the node is an activation collective on
    a group inside one node, whose time tensor-parallel overlap can hide (`LayerCost.tp_comm_s`)."""
    state = cost.memory_bytes - cost.activation_bytes - cost.transient_bytes
    if cost.weight_chain:
        return LayerCost(state_bytes=state, step_s=cost.time_s)
    m = microbatches
    return LayerCost((cost.forward_s + cost.comm_s / 2) / m, (cost.backward_s + cost.comm_s / 2) / m,
                     cost.activation_bytes, state, cost.optimizer_s, cost.transient_bytes,
                     cost.comm_s / 2 / m if in_node else 0.0)


@dataclass(frozen=True)
class TpOverlap:
    """What tensor-parallel communication overlap (`ExecutionProfile.tp_comm_overlap`) takes off one micro-batch
    of a stage plan, as the step simulator runs it: the stage plan's PCG simulated for one micro-batch with the
    overlap and without it, under the machine's profile (its ZeRO gathers left after the update: the stage price
    charges those itself), and the difference of the forward's and of the backward's extents (a stack of many
    alike blocks: read off excerpts of a few of its blocks, `_run_extents`). The per-node sum
    has no overlap (a node's cost must not depend on the nodes around it), so the stage price takes the part
    `forward` (`backward`) of every in-node activation collective's time (`LayerCost.tp_comm_s`) off: the
    seconds saved over those collectives' seconds in that direction, at most all of them, so that a chunk is
    never priced below its computation. Below zero where the simulator finds the pipelined collectives slower
    than whole ones (their ring steps each pay a launch)."""

    forward: float = 0.0
    backward: float = 0.0
    saved_forward_s: float = 0.0    # per micro-batch of the whole stage plan, as simulated
    saved_backward_s: float = 0.0

    def applied(self, cost: LayerCost) -> LayerCost:
        """`cost` (a chunk's, per micro-batch) with the hidden part of its collectives taken off."""
        if not cost.tp_comm_s or (not self.forward and not self.backward):
            return cost
        return replace(cost, forward_s=cost.forward_s - self.forward * cost.tp_comm_s,
                       backward_s=cost.backward_s - self.backward * cost.tp_comm_s)


NO_OVERLAP = TpOverlap()


EXCERPT_COUNTS = (4, 5, 6)
"""The block counts of the excerpts whose extents give a stage plan's (`tp_overlap`, `block_excerpt`)."""
COLLINEAR = 1e-9
"""How far (relative to the extent) the excerpts' figures may lie off one line for the line to be used."""


def tp_overlap(plan: Plan, library: Library, profile: ExecutionProfile, comm_s: float,
               times: OpTimes | None = None, counts: Sequence[int] = EXCERPT_COUNTS) -> TpOverlap:
    """`TpOverlap` of stage plan `plan` (on its stage machine, `plan.machine`) under `profile`; `comm_s` the
    stage plan's in-node activation collectives' seconds per micro-batch and direction (their `tp_comm_s`).
    No overlap (and no simulation) where the profile pipelines nothing, no collective of the stage plan pipelines
    with its product (`collective_pipelines`), or there is nothing to hide. Each run's extents are its excerpts'
    line where they give one (`_run_extents`, `counts`), else the whole plan's."""
    if not (profile.tp_comm_overlap and profile.overlap) or comm_s <= 0:
        return NO_OVERLAP
    base = replace(profile, overlap_param_gather=False)
    if not collective_pipelines(plan.pcg, base):
        # no collective pipelined with its product: the run without the overlap builds the same tasks (the
        # profiles differ in `tp_comm_overlap` alone, which only `collective_pipelines` reads), so the two runs'
        # extents are equal and nothing is saved: the figures below, 0 / comm_s and x - x, are 0.0, NO_OVERLAP's,
        # without simulating either (llama-70b:64: 6 of its 29 stage plans, no sequence parallelism: all-reduces)
        return NO_OVERLAP
    extents = [_run_extents(plan, library, run, times, counts) for run in (base, replace(base, tp_comm_overlap=False))]
    (forward_on, backward_on), (forward_off, backward_off) = extents
    saved_f, saved_b = forward_off - forward_on, backward_off - backward_on
    return TpOverlap(min(1.0, saved_f / comm_s), min(1.0, saved_b / comm_s), saved_f, saved_b)


def _run_extents(plan: Plan, library: Library, run: ExecutionProfile, times: OpTimes | None,
                 counts: Sequence[int]) -> tuple[float, float]:
    """One micro-batch of stage plan `plan` under `run`: (the forward's end, the backward's extent).

    A stage plan of N alike blocks (llama-70b: 80, ~5,000-6,600 nodes, ~14,000 tasks a run) is simulated as
    excerpts of it with `counts` blocks (`ir.blocks.block_excerpt`: the blocks before, the last one after) where
    N exceeds their sum, and each phase's end is read off the line through them, E(N) = E(k3) + (N - k3) s with
    s the slope of the last two, where every figure lies on one line (`_on_line`); else (not alike, the line
    not met, too few blocks) the whole plan is simulated, as before.

    Why the line: the simulator runs tasks on in-order streams, each starting at the latest of its stream
    coming free and its dependencies ending (`cost.simulator`): a max-plus recurrence. Alike blocks issue alike
    tasks, so once the state a block begins in (its streams' free times, what it reads of the block before)
    is the state the block before began in, moved by a period, every later block begins so too, and the
    phases' ends grow by that period a block: E(k) = a + b k. The first blocks' transient (block 0 reads the
    embeddings, the last the head) is what the excerpts keep whole. The line is not taken on trust: the
    excerpts' phase ends, and every stream's last end in each phase (`stream_phase_ends`), must lie on lines
    within `COLLINEAR` of the extent, and no stream's may grow faster than its phase's end (a chain that
    nothing waits for yet, growing faster, would overtake the phase's end at some count past the excerpts'). A
    transient longer than the excerpts whose every stream happens to lie on such lines would still pass: the
    check is evidence, not proof, and was compared with the whole simulation on every overlap of llama-70b:64 and
    gpt-175b:1024 on a100x8 (benchmarks/search_results.md, session 71 helper O: the extents within 8e-14 of each
    other, float rounding; a saving of 7.7e-5 s of a backward of seconds within 1.5e-10 of itself). llama-70b:64:
    2 x 80 blocks become 2 x (4 + 5 + 6), its 29 overlaps ~3.2x cheaper."""
    pcg = plan.pcg
    blocks = max(node_blocks(pcg).values(), default=-1) + 1
    if len(counts) == 3 and blocks > sum(counts):
        excerpts = [block_excerpt(pcg, count) for count in counts]
        if all(e is not None for e in excerpts):
            found = [stream_phase_ends(simulate_pcg(e, library, plan.machine, run, times=times, microbatches=1))
                     for e in excerpts]
            line = _on_line(counts, found, blocks)
            if line is not None:
                return line
    return _extents(phase_ends(simulate_pcg(pcg, library, plan.machine, run, times=times, microbatches=1)))


def _extents(ends: Mapping[str, float]) -> tuple[float, float]:
    """(The forward's end, the backward's extent) from a run's phase ends (`step_report.phase_ends`)."""
    forward_end = ends.get("forward", 0.0)
    return forward_end, ends.get("backward", forward_end) - forward_end


def _on_line(counts: Sequence[int], found: Sequence[Mapping[tuple[str, str], float]],
             blocks: int) -> tuple[float, float] | None:
    """The extents at `blocks` blocks read off the line through the excerpts' (`found`, at `counts` blocks), or
    None where a figure is off its line (by more than `COLLINEAR` of the phase's end at the largest count), a
    stream's end grows faster than its phase's, or the excerpts' streams differ (`_run_extents`)."""
    if any(set(f) != set(found[0]) for f in found):
        return None
    (k1, k2, k3), phases, ends = counts, [ends_by_phase(f) for f in found], {}
    for phase in ("forward", "backward"):
        keys = [key for key in found[0] if key[0] == phase]
        if not keys:
            continue
        phase_at = [p[phase] for p in phases]
        slope = (phase_at[2] - phase_at[1]) / (k3 - k2)
        tolerance = COLLINEAR * abs(phase_at[2])
        for series in [phase_at] + [[f[key] for f in found] for key in keys]:
            step = (series[2] - series[1]) / (k3 - k2)
            off_line = abs(series[1] - step * (k2 - k1) - series[0]) > tolerance
            if off_line or series[2] - series[1] > phase_at[2] - phase_at[1] + tolerance:
                return None
        ends[phase] = phase_at[2] + (blocks - k3) * slope
    return _extents(ends)


def layer_costs(plan: Plan) -> dict[int, LayerCost]:
    """Layer -> its cost in a stage plan: the nodes a one-chunk-per-layer layout gives each layer (free values
    with the first layer that reads them, as a stage computes each once)."""
    return StagePricer(plan, plan.machine).layer_costs()


def _share_bytes(shares: Sequence[LayerCost]) -> tuple[int, int, int]:
    """The activation and state bytes of `shares` summed in order, and their largest transient bytes (0 at least)."""
    _forward, _backward, activation, state, _step, transient, _tp_comm = _FIGURES
    return (sum(map(activation, shares)), sum(map(state, shares)),
            max(max(map(transient, shares), default=0), 0))


def equal_starts(layers: Sequence[int], chunks: int) -> tuple[int, ...]:
    """The layers cut into `chunks` runs of equal count (the first ones one longer when it does not divide)."""
    if chunks > len(layers):
        raise PipelineError(f"{len(layers)} layers cannot make {chunks} chunks")
    size, extra = divmod(len(layers), chunks)
    starts, at = [], 0
    for c in range(chunks):
        starts.append(layers[at])
        at += size + (1 if c < extra else 0)
    return tuple(starts)


def balanced_starts(layers: Sequence[int], cost: Mapping[int, LayerCost], chunks: int, degree: int,
                    schedule: str, microbatches: int, capacity: float,
                    cuttable: Collection[int] | None = None, held: Sequence[int] | None = None
                    ) -> tuple[int, ...] | None:
    """Chunk starts that minimise the busiest chunk's time per step (m micro-batches' forward and backward, then
    its weights' synchronisation and optimizer: what the slowest stage adds to the pipeline's fill and drain),
    each stage's weights' state plus in-flight activations within `capacity` (one chunk per stage; interleaved
    chunks are balanced by time and their memory checked when priced). Dynamic programming over (chunk, first
    layer); None when no cut fits. Of equal cuts, the one whose chunks end first, chunk by chunk. `cuttable`: the
    layers a chunk may begin at (`ir.pipeline.LayerMap.cuttable`: no partial sum crosses there); every layer when
    None. `held`: the schedule's `in_flight_counts` on one chunk per stage where the caller has them (worked out
    here when None).

    Each chunk's row of the programme is one array operation over (first layer, next chunk's first layer): the
    same sums and maxima as a loop would make, in float64, and the memory in exact integers (the stage search
    runs this for every candidate's schedules, at 80 layers x 16 chunks)."""
    n = len(layers)
    if chunks > n:
        return None
    run = [0.0]   # added one by one, as a loop adds them (numpy's cumsum may add in another order)
    for layer in layers:
        run.append(run[-1] + (cost[layer].forward_s + cost[layer].backward_s) * microbatches + cost[layer].step_s)
    times = np.array(run)
    # one recomputed block's activations at a time (`ir.recompute`): the largest, wherever it falls (an upper bound)
    transient = max((cost[layer].transient_bytes for layer in layers), default=0)
    if schedule == INTERLEAVED:
        held = (1,) * degree
    elif held is None:
        held = in_flight_counts(schedule, degree, 1, microbatches)
    acts, states = _byte_sums([cost[layer].activation_bytes for layer in layers],
                              [cost[layer].state_bytes for layer in layers], max(held), transient)
    inf = float("inf")
    span = np.arange(n + 1)
    later = span[None, :] > span[:, None]                  # [i, j]: j after i
    if cuttable is not None:   # the next chunk begins at a layer it may begin at (or none follows)
        later &= np.array([j == n or layers[j] in cuttable for j in range(n + 1)])[None, :]
    # best[k][i]: the least slowest-chunk time for chunks k.. covering layers i..n-1; then[k][i]: the next start
    best = np.full((chunks + 1, n + 1), inf)
    then = np.full((chunks + 1, n + 1), -1)
    best[chunks, n] = 0.0
    for k in range(chunks - 1, -1, -1):
        value = np.maximum(best[k + 1][None, :], times[None, :] - times[:, None])
        allowed = later & (span[:, None] <= n - (chunks - k)) & (span[None, :] <= n - (chunks - k - 1)) & \
            (best[k + 1][None, :] < inf)
        if schedule != INTERLEAVED:
            memory = states[None, :] - states[:, None] + held[k % degree] * (acts[None, :] - acts[:, None]) + transient
            allowed &= ~_exceeds(memory, capacity)
        value = np.where(allowed, value, inf)
        first = np.argmin(value, axis=1)                   # the first of equal ones, as a loop over j keeps
        least = value[span, first]
        found = least < inf
        best[k] = np.where(found, least, inf)
        then[k] = np.where(found, first, -1)
    if best[0][0] == inf:
        return None
    starts, at = [], 0
    for k in range(chunks):
        starts.append(layers[at])
        at = int(then[k][at])
    return tuple(starts)


def _byte_sums(acts: Sequence[int], states: Sequence[int], held: int, transient: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """0 and the running sums of `acts` and of `states` (bytes), as a loop adds them: in int64 where every figure
    is an integer and no memory the programme forms (differences of sums, activations times `held`, plus
    `transient`) can overflow it, else as the Python numbers themselves (compared as Python compares them)."""
    sums = []
    for values in (acts, states):
        run = [0]
        for v in values:
            run.append(run[-1] + v)
        sums.append(run)
    integral = all(type(v) is int for run in sums for v in run) and type(transient) is int
    bound = 2 * max(map(abs, sums[0])) * max(held, 1) + 2 * max(map(abs, sums[1])) + abs(transient) \
        if integral else math.inf
    dtype = np.int64 if bound < 2 ** 62 else object
    return np.array(sums[0], dtype=dtype), np.array(sums[1], dtype=dtype)


def _exceeds(memory: np.ndarray, capacity: float) -> np.ndarray:
    """Where `memory` > `capacity`, as Python compares them: an int64 array against the float's floor (an integer
    exceeds a finite float exactly when it exceeds its floor; numpy would round a large integer first)."""
    if memory.dtype == object or not math.isfinite(capacity):
        return np.vectorize(lambda b: b > capacity, otypes=[bool])(memory)
    floor = math.floor(capacity)
    if abs(floor) >= 2 ** 62:   # beyond every int64 memory formed (`_byte_sums`)
        return np.full(memory.shape, floor < 0, dtype=bool)
    return memory > floor


def transfer_seconds(layout: StageLayout, stage_devices: int, machine: Machine, dtype_bytes: int
                     ) -> dict[tuple[int, int], float]:
    """(source chunk, target chunk) -> seconds to send one micro-batch's crossings between their stages: every
    rank to its twin at once, over the slowest pair's link (another node when a stage fills whole nodes)."""
    stage = {c.index: c.stage for c in layout.chunks}
    sizes: dict[tuple[int, int], int] = {}
    for crossing in layout.crossings:
        if stage[crossing.source] != stage[crossing.target]:
            key = (crossing.source, crossing.target)
            sizes[key] = sizes.get(key, 0) + crossing.piece_elements * dtype_bytes
    out = {}
    for (a, b), nbytes in sizes.items():
        group = _pair(stage[a], stage[b], stage_devices, machine.devices_per_node)
        out[(a, b)] = price(SEND_RECV, group, nbytes, machine).seconds
    return out


def _pair(s: int, t: int, stage_devices: int, per_node: int) -> GroupTopology:
    """The link between local rank i of stage s and of stage t, for the worst i."""
    across = any((s * stage_devices + i) // per_node != (t * stage_devices + i) // per_node
                 for i in range(stage_devices))
    return GroupTopology(2, 1, 2) if across else GroupTopology(2, 2, 1)


def pipelined(plan: Plan, degree: int, schedule: str, machine: Machine, *, chunks_per_stage: int = 1,
              starts: Sequence[int] | None = None, library: Library | None = None) -> Plan:
    """`plan` (a stage plan on S devices) run as `degree` stages on `machine`'s degree x S devices, cut at
    `starts`, or where the cost model finds the step shortest (below). `library`: the operators', for the
    stage's tensor-parallel overlap (`TpOverlap`; none without it). Raises PipelineError when the layers
    cannot make the chunks."""
    return StagePricer(plan, machine, memo=StageMemo(library=library)).pipelined(degree, schedule,
                                                                                 chunks_per_stage, starts)


# Layer maps (and stage plans' overlaps) a StageMemo keeps, and stage plans' pricers a StageFit keeps for its
# memory checks and floors, the most recently used: llama-70b:64's search asks 109 distinct node tuples' maps and
# 147 stage plans' pricers, in an order that comes back to earlier ones (a mesh's candidates, then its grid
# points, then the next mesh's); keeping 4 built 173 maps and 215 pricers (2.1 and 2.6 CPU s, max RSS 1263 MiB),
# 12 build 121 and 183 (1.5 and 1.8 CPU s, 1407 MiB), 32 build 109 and 174 for ~170 MiB more. A bound all the
# same: each map and pricer is a table per node of a stage plan (llama-70b's: ~9 MiB the pair).
LAYER_MAPS_KEPT = 12
PRICERS_KEPT = 12


class StageMemo:
    """What pricing many stage plans of one pipeline search repeats, worked out once: the layer map of a PCG's
    nodes (`ir.pipeline.LayerMap`) and the layouts of the cuts laid out on it. The stage search judges the
    memory of every candidate by its cuts (`StageFit`), and a grid layout is judged with its state whole, then
    with ZeRO-1, then recomputing blocks (`search.baselines`): three PCGs with the same nodes, so one layer map
    and the same layouts. A layer map depends on the nodes and the outputs alone (not on the ZeRO stage or the
    recomputation policy), and is keyed by their identity, each kept alive beside it so that no other tuple can
    take its id. Only the last LAYER_MAPS_KEPT are kept: a stage plan's map is large, and the variants of one
    layout are judged one after another.

    `library`: the operators' library, which the step simulator needs to time a stage plan's nodes for its
    tensor-parallel overlap (`tp_overlap`); without one a stage is priced with none. The overlap of each stage
    plan is simulated once per memo (`overlap`): the search prices a stage plan's cuts in every schedule, and
    its grid point is often the same PCG."""

    def __init__(self, kept: int = LAYER_MAPS_KEPT, library: Library | None = None):
        self.kept = kept
        self.library = library
        # (id(nodes), id(outputs)) -> (nodes, outputs, their layer map, its layouts by (starts, degree))
        self._maps: OrderedDict[tuple[int, int], tuple] = OrderedDict()
        self._overlaps: OrderedDict[tuple, TpOverlap] = OrderedDict()   # (pcg, machine, profile, comm) -> overlap
        self._times: dict[Machine, OpTimes] = {}                          # stage machine -> compute-time cache
        self._orders: dict[tuple, tuple] = {}   # (schedule, degree, chunks per stage, micro-batches) -> the orders
        # (id(nodes), mesh) -> (nodes, `_in_node_collectives`): the last `kept`, as the maps
        self._in_node: OrderedDict[tuple, tuple] = OrderedDict()
        self._in_flight: dict[tuple, tuple[int, ...]] = {}    # as `_orders` -> `in_flight_counts`
        self._groups: dict[GroupTopology, int] = {}   # a reduction's group -> its number in the keys below
        self._gathers: dict[tuple, dict] = {}   # (machine, gathers' figures) -> `gather_buckets` by place
        self._buckets: dict[tuple, tuple[float, float]] = {}   # (machine, reductions' figures) -> `bucketed_seconds`

    def in_node(self, plan: Plan) -> set[int]:
        """`_in_node_collectives(plan)`, once per its PCG's nodes and mesh while kept: it reads those alone (each
        parallel node's axis and the mesh's groups), and the stage search makes a pricer for each of a PCG's node
        costs (llama-70b:64: 183 pricers of 93 node tuples). The nodes are kept alive beside the set, so that no
        other tuple takes their id. Read only."""
        pcg = plan.pcg
        key = (id(pcg.nodes), pcg.mesh)
        found = self._in_node.get(key)
        if found is None or found[0] is not pcg.nodes:
            found = self._in_node[key] = (pcg.nodes, _in_node_collectives(plan))
            while len(self._in_node) > self.kept:
                self._in_node.popitem(last=False)
        self._in_node.move_to_end(key)
        return found[1]

    def bucketed_seconds(self, reductions: Sequence[Reduction], machine: Machine, flat: tuple | None = None
                         ) -> tuple[float, float]:
        """`stage_sync.bucketed_seconds(reductions, machine)`, once per machine and sequence of the reductions'
        (kind, group, bytes): it reads nothing else of them (the buckets are cut by bytes alone, `assign_buckets`,
        and priced by kind, group and bytes), and a stage plan of alike blocks reduces alike weights in every
        chunk and in every candidate of one layout. Its figures are few (two floats a key). `flat`: the key's
        figures (`_flat(reductions, True)`) where the caller has them (`parts`)."""
        key = (machine, self._flat(reductions, True) if flat is None else flat)
        found = self._buckets.get(key)
        if found is None:
            found = self._buckets[key] = bucketed_seconds(reductions, machine)
        return found

    def _flat(self, reductions: Sequence[Reduction], kinds: bool) -> tuple:
        """The (kind, when `kinds`,) group and bytes of each of `reductions`, in order, in one flat tuple of strings
        and integers, each group by its number in this memo (`_groups`, one per distinct group): a key the
        collector need not walk (a tuple per reduction, each holding a group, made one tracked object per weight
        of every chunk kept)."""
        groups, flat = self._groups, []
        for r in reductions:
            number = groups.get(r.group)
            if number is None:
                number = groups[r.group] = len(groups)
            flat += (r.kind, number, r.nbytes) if kinds else (number, r.nbytes)
        return tuple(flat)

    def parts(self, reductions: Mapping[int, Reduction], kinds: bool) -> dict[int, tuple]:
        """Node -> its reduction's part of a `_flat` key (`_flat([reduction], kinds)`), for a pricer to join a
        chunk's key from in C rather than walk its reductions for every chunk of every cut. The same key as
        `_flat` of the chunk's reductions: `_flat` is the parts joined in order, and a group's number, once
        given, is kept for the memo's life (the numbers may be given in another order than chunk by chunk would,
        but a key is only compared with keys of this memo, and equal numbers are equal groups either way)."""
        return {i: self._flat((r,), kinds) for i, r in reductions.items()}

    def in_flight(self, schedule: str, degree: int, chunks_per_stage: int, microbatches: int) -> tuple[int, ...]:
        """`ir.pipeline.in_flight_counts`, made once per search for its four integers, as `schedule_order`: the
        balanced cut and the floors of every candidate read the same few (each walked the schedule's order)."""
        key = (schedule, degree, chunks_per_stage, microbatches)
        found = self._in_flight.get(key)
        if found is None:
            found = self._in_flight[key] = in_flight_counts(schedule, degree, chunks_per_stage, microbatches)
        return found

    def gather_buckets(self, gathers: Sequence[Reduction], machine: Machine, flat: tuple | None = None
                       ) -> dict[GroupTopology, list[tuple[tuple[int, ...], float]]]:
        """`stage_sync.gather_buckets(gathers, machine)`, worked out once per machine and sequence of the gathers'
        (group, bytes): it reads of a gather its group, bytes and node alone, and the node only to name it in
        its bucket, so the buckets are made once with each gather named by its place in `gathers` and named
        here by their nodes again (the same buckets, in the same order, with the same seconds). A stage plan of
        alike blocks gathers alike weights in every chunk and in every candidate of one layout. `flat`: the key's
        figures (`_flat(gathers, False)`) where the caller has them (`parts`)."""
        key = (machine, self._flat(gathers, False) if flat is None else flat)
        found = self._gathers.get(key)
        if found is None:
            placed = [replace(g, node=k) for k, g in enumerate(gathers)]
            found = self._gathers[key] = gather_buckets(placed, machine)
        return {group: [(tuple(gathers[k].node for k in places), seconds) for places, seconds in buckets]
                for group, buckets in found.items()}

    def schedule_order(self, schedule: str, degree: int, chunks_per_stage: int, microbatches: int) -> tuple:
        """`ir.pipeline.schedule_order`, made once per search for its four integers (every candidate's memory
        check reads the same few); PipelineError as it raises."""
        key = (schedule, degree, chunks_per_stage, microbatches)
        found = self._orders.get(key)
        if found is None:
            found = self._orders[key] = schedule_order(schedule, degree, chunks_per_stage, microbatches)
        return found

    def overlap(self, plan: Plan, profile: ExecutionProfile, comm_s: float) -> TpOverlap:
        """`tp_overlap(plan, ...)`, simulated once per stage plan while kept (the last `kept`); none without a
        library."""
        if self.library is None:
            return NO_OVERLAP
        key = (plan.pcg, plan.machine, profile, comm_s)
        found = self._overlaps.get(key)
        if found is None:
            times = self._times.setdefault(plan.machine, OpTimes(self.library, plan.machine))
            found = self._overlaps[key] = tp_overlap(plan, self.library, profile, comm_s, times)
            while len(self._overlaps) > self.kept:
                self._overlaps.popitem(last=False)
        self._overlaps.move_to_end(key)
        return found

    def layer_map(self, pcg) -> LayerMap:
        """The layer map of `pcg`'s nodes (the one made before for the same nodes and outputs, if kept)."""
        return self._entry(pcg)[2]

    def lay_out(self, layer_map: LayerMap, starts: Sequence[int], degree: int) -> StageLayout:
        """`layer_map.lay_out(starts, degree)`, laid out once per cut while the map is kept."""
        layouts = self._entry(layer_map.pcg, layer_map)[3]
        key = (tuple(starts), degree)
        found = layouts.get(key)
        if found is None:
            found = layouts[key] = layer_map.lay_out(starts, degree)
        return found

    def _entry(self, pcg, made: LayerMap | None = None) -> tuple:
        key = (id(pcg.nodes), id(pcg.outputs))
        found = self._maps.get(key)
        if found is None or found[0] is not pcg.nodes or found[1] is not pcg.outputs:
            found = (pcg.nodes, pcg.outputs, made if made is not None else LayerMap(pcg), {})
            self._maps[key] = found
            while len(self._maps) > self.kept:
                self._maps.popitem(last=False)
        self._maps.move_to_end(key)
        return found


REFINE_PRICINGS = 64   # simulated schedules spent improving one pipeline's cut (at most)
FLOOR_MARGIN = 1e-9    # relative: a cut's floor (`StagePricer._busy_floor`) must clear a step by this to rule it out


class StagePricer:
    """Prices cuts of one stage plan on one machine: the per-node figures and the PCG's layer map are worked
    out once, since the cut search prices many cuts of the same plan, and so are each chunk's cost and each
    stage's synchronisation (a cut moved by one layer changes two chunks). `overlap_param_gather`: whether
    ZeRO-1/2's gathers of updated shards run during the next step's forward (None: as the machine's execution
    profile says, `pcg_tasks.profile_for`). `memo`: the layer maps and layouts shared with the other pricers of
    one search (`StageMemo`)."""

    def __init__(self, plan: Plan, machine: Machine, overlap_param_gather: bool | None = None,
                 memo: "StageMemo | None" = None, tp_comm_overlap: bool | None = None):
        self.plan, self.machine = plan, machine
        self.memo = memo if memo is not None else StageMemo()
        self.layer_map = self.memo.layer_map(plan.pcg)
        self.microbatches = plan.graph.microbatches
        self.shares = _node_shares(plan.costs, self.microbatches, self.memo.in_node(plan))
        self._overlap_param_gather = overlap_param_gather
        self._tp_comm_overlap = tp_comm_overlap
        self._layer_costs: dict[int, LayerCost] | None = None
        self._chunk_memo: dict[tuple, LayerCost] = {}   # (stage's earlier chunks' layers, chunk's layers) -> cost
        self._sync_memo: dict[tuple, StageSync] = {}     # (degree, stage, its chunks' layers, aligned) -> its sync
        self._sums_memo: dict[tuple, tuple] = {}         # a stage's chunks' layers -> `_stage_sums`
        self._schedule_floors: dict[tuple, tuple] = {}   # (degree, schedules) -> `schedule_fitting_floors`
        self._starts: dict[tuple, list | PipelineError] = {}   # (degree, schedule, chunks per stage) -> `start_cuts`

    @cached_property
    def chain_s(self) -> dict[int, float]:
        """Once per step, per node: a weight chain's collectives (the stage's sync). This and the figures below
        are read only by `price`, not by the memory a cut needs (`least_peak_bytes`), which the stage search
        asks of every candidate: they are worked out when first read."""
        return {ident: cost.comm_s for ident, cost in self.plan.costs.items() if cost.weight_chain}

    @cached_property
    def reduce_s(self) -> dict[int, float]:
        """The part of `chain_s` that reduces gradients as the last backward produces them
        (`NodeCost.grad_reduce_s`)."""
        return {ident: cost.grad_reduce_s for ident, cost in self.plan.costs.items() if cost.weight_chain}

    @cached_property
    def reductions(self) -> dict:
        """The gradient reductions a stage runs in buckets (`cost.stage_sync`)."""
        return weight_reductions(self.plan)

    @cached_property
    def gathers(self) -> dict:
        """ZeRO-1/2's gathers of updated shards, where they run during the next step's forward (`overlap_param_gather`
        given, else as the machine's execution profile says)."""
        overlap = self._overlap_param_gather
        if overlap is None:
            overlap = profile_for(self.machine).overlap_param_gather
        return weight_gathers(self.plan) if overlap else {}

    @cached_property
    def overlap_grad_reduce(self) -> bool:
        """Whether each chunk's gradient reduction runs beside its last backward (`overlapped_reduce_end`), as the
        machine's execution profile says, or only after the stage's last backward (`CommProfile.overlap_grad_reduce`
        off: Megatron-LM of 2021 all-reduced once the pipeline had flushed)."""
        return profile_for(self.machine).overlap_grad_reduce

    @cached_property
    def overlap(self) -> TpOverlap:
        """The tensor-parallel overlap of a micro-batch of this stage plan (`TpOverlap`), as the machine's
        execution profile runs it (`tp_comm_overlap` given: with it on or off): what `price` takes off each
        chunk's forward and backward. Not read by the memory a cut needs (`least_peak_bytes`) nor by the cuts
        the search starts from (`start_cuts`, from the per-node sums): the stage search asks those of every
        candidate, and only a plan it prices pays for the simulation."""
        profile = profile_for(self.machine)
        if self._tp_comm_overlap is not None:
            profile = replace(profile, tp_comm_overlap=self._tp_comm_overlap)
        comm_s = sum(share.tp_comm_s for share in self.shares.values())
        return self.memo.overlap(self.plan, profile, comm_s)

    @cached_property
    def optimizer_s(self) -> dict[int, float]:
        """Each node's optimizer seconds, once per step."""
        return {ident: cost.optimizer_s for ident, cost in self.plan.costs.items()}

    @cached_property
    def pieces(self) -> dict[int, int]:
        """Each weight's stored piece (`stored_piece_elements`): what a weight two stages share sums."""
        return stored_piece_elements(self.plan.pcg)

    def pipelined(self, degree: int, schedule: str, chunks_per_stage: int = 1,
                  starts: Sequence[int] | None = None) -> Plan:
        chunks = self._chunks(degree, schedule, chunks_per_stage)
        layers = self.layer_map.layers
        if starts is not None:
            return self.price(self.memo.lay_out(self.layer_map, starts, degree), schedule)
        # The dynamic programme ranks cuts by the busiest stage; the step also depends on where that stage sits
        # (fill and drain) and on each stage's tail. So the balanced cut and the layer-count one are both priced
        # by the simulated schedule, and the better one improved by moving one cut at a time while the step
        # shrinks.
        seen: dict[tuple[int, ...], Plan] = {}
        # cuts left unpriced because their floor (`_busy_floor`) is above a step that fits: not better, but counted
        # against the REFINE_PRICINGS as if priced, so the refinement visits the same cuts and stops where it did
        slower: set[tuple[int, ...]] = set()

        def price_cut(cut: tuple[int, ...]) -> Plan:
            if cut not in seen:
                seen[cut] = self.price(self.memo.lay_out(self.layer_map, cut, degree), schedule)
            return seen[cut]

        def rank(p: Plan) -> tuple:
            return (not p.totals.fits(self.machine), p.totals.time_s)

        def better(c: tuple[int, ...], than: Plan) -> bool:
            if c not in seen and (c in slower or (than.totals.fits(self.machine) and self._busy_floor(c, degree)
                                                  > than.totals.time_s * (1 + FLOOR_MARGIN))):
                slower.add(c)
                return False
            return rank(price_cut(c)) < rank(than)

        cut = min(self.start_cuts(degree, schedule, chunks_per_stage), key=lambda c: rank(price_cut(c)))
        index, cuttable = {layer: i for i, layer in enumerate(layers)}, self.layer_map.cuttable
        # an interleaved schedule's chunks hold equal layer counts (`ir.pipeline.chunks_refusal`): moving one cut
        # would unbalance two chunks, which neither Megatron-LM nor Megatron-Core runs
        while schedule != INTERLEAVED and len(seen) + len(slower) < REFINE_PRICINGS:
            moves = []
            for k in range(1, chunks):
                for step in (-1, 1):
                    at, end = index[cut[k]] + step, len(layers) if k + 1 == chunks else index[cut[k + 1]]
                    while index[cut[k - 1]] < at < end and layers[at] not in cuttable:
                        at += step   # over the layers no chunk may begin at (a partial sum crosses there)
                    if index[cut[k - 1]] < at < end:
                        moves.append(cut[:k] + (layers[at],) + cut[k + 1:])
            found = [c for c in moves if len(seen) + len(slower) < REFINE_PRICINGS and better(c, price_cut(cut))]
            if not found:
                break
            cut = min(found, key=lambda c: rank(price_cut(c)))
        return price_cut(cut)

    @cached_property
    def _own_busy_s(self) -> dict[int, float]:
        """Per layer, per micro-batch, the forward and backward seconds of its own nodes (not the free values it
        reads), tensor-parallel overlap taken off as `price` takes it off a chunk (`TpOverlap.applied`: linear in
        the nodes, and no node's part below zero, since at most all of its in-node collective is hidden)."""
        free, overlap, out = self.layer_map.free, self.overlap, {}
        for layer, members in self.layer_map.layer_members.items():
            mine = [self.shares[i] for i in members if i not in free and i in self.shares]
            out[layer] = sum(c.forward_s + c.backward_s - (overlap.forward + overlap.backward) * c.tp_comm_s
                             for c in mine)
        return out

    def _busy_floor(self, starts: Sequence[int], degree: int) -> float:
        """A floor of the step `price` gives the cut at `starts`, without laying it out or simulating it: a stage
        runs its m micro-batches' forwards and backwards of each of its chunks one after another
        (`simulate_schedule`: waits only add), and the step ends no earlier than its busiest stage; its sync,
        optimizer and the tied weights' sum come after and are not negative. Its chunks' nodes include their
        layers' own (`_own_busy_s`), whose seconds are each at least zero. Where each chunk reads the one before
        it (`_chained`), a stage's fill and drain count too (`_cut_floor`, as `fitting_floors` argues it): stage
        s starts no earlier than chunks 0..s-1's forwards of one micro-batch and its last backward is followed by
        theirs, so the step is at least, for each s, those chunks' work of one micro-batch plus the stage's m
        micro-batches'. llama-70b:64's 1F1B on 4 stages of 32 micro-batches: the fill and drain are a bubble of
        8%, which the busiest stage alone leaves out, so a cut moved by one layer (a stage's work +-1.3%) was
        priced although it cannot be faster than the cut it moves."""
        layers, busy, m = self.layer_map.layers, self._own_busy_s, self.microbatches
        index = {layer: k for k, layer in enumerate(layers)}
        if self._is_chained:
            return _cut_floor([busy[layer] * m for layer in layers], [index[s] for s in starts], degree, m)
        bounds = [index[s] for s in starts] + [len(layers)]
        stages = [0.0] * degree
        for c in range(len(starts)):
            stages[c % degree] += sum(busy[layers[i]] for i in range(bounds[c], bounds[c + 1]))
        return max(stages) * m

    @cached_property
    def _is_chained(self) -> bool:
        """`_chained` of this pricer's layer map, worked out once (the cut search asks it of every cut)."""
        return _chained(self.layer_map)

    def _chunks(self, degree: int, schedule: str, chunks_per_stage: int) -> int:
        """The chunks `schedule` cuts the layers into; PipelineError when it cannot (an interleaved schedule
        whose chunks would not split each stage's layers evenly too: `ir.pipeline.chunks_refusal`)."""
        chunks, layers = degree * chunks_per_stage, self.layer_map.layers
        if chunks > len(layers):
            raise PipelineError(f"'{self.plan.graph.name}' has {len(layers)} layers to cut, fewer than {chunks} "
                                "chunks")
        why = chunks_refusal(schedule, self.layer_map.model_layers, degree, chunks_per_stage)
        if why is not None:
            raise PipelineError(why)
        return chunks

    def start_cuts(self, degree: int, schedule: str, chunks_per_stage: int = 1) -> list[tuple[int, ...]]:
        """The cuts `pipelined` starts from: equal layer counts, and the balanced cut (`balanced_starts`) where
        one fits. `pipelined` keeps a cut that fits over one that does not, so when one of these fits
        (`least_peak_bytes`), the plan it prices fits. An interleaved schedule starts from the equal cut alone:
        its chunks must hold equal layer counts (`ir.pipeline.chunks_refusal`, checked by `_chunks`), and a
        balanced cut that moves layers between them is one neither Megatron-LM nor Megatron-Core runs. Only cuts
        no partial sum crosses (`LayerMap.cuttable`): the equal cut where it is one, the balanced cut among them
        (where none fits, the fastest of them, to be priced); PipelineError where no cut into these chunks is.
        Worked out once per pricer for its three integers: the memory check (`least_peak_bytes`) and the cut
        search (`pipelined`) of one stage plan ask the same, and the answer reads nothing else that changes."""
        key = (degree, schedule, chunks_per_stage)
        found = self._starts.get(key)
        if found is None:
            try:
                found = self._work_out_start_cuts(degree, schedule, chunks_per_stage)
            except PipelineError as err:
                found = err
            self._starts[key] = found
        if isinstance(found, PipelineError):
            raise found
        return list(found)

    def _work_out_start_cuts(self, degree: int, schedule: str, chunks_per_stage: int) -> list[tuple[int, ...]]:
        """`start_cuts`, worked out."""
        chunks = self._chunks(degree, schedule, chunks_per_stage)
        layers, cuttable = self.layer_map.layers, self.layer_map.cuttable
        equal = equal_starts(layers, chunks)
        found = [equal] if cuttable.issuperset(equal) else []
        restricted = cuttable if len(cuttable) < len(layers) else None
        if schedule != INTERLEAVED:
            held = self.memo.in_flight(schedule, degree, 1, self.microbatches)
            balanced = balanced_starts(layers, self.layer_costs(), chunks, degree, schedule, self.microbatches,
                                       self.machine.memory_capacity, restricted, held)
            if balanced is None and not found and restricted is not None:   # none fits: one that runs, to price
                balanced = balanced_starts(layers, self.layer_costs(), chunks, degree, schedule, self.microbatches,
                                           math.inf, restricted, held)
            if balanced is not None and balanced not in found:
                found.append(balanced)
        if not found:   # every cut into these chunks receives a partial sum somewhere (`LayerMap.blocked`)
            blocked = next(layer for layer in equal if layer not in cuttable)
            raise PipelineError(f"no cut of the stage plan into {chunks} chunks"
                                f"{' of equal layer counts' if schedule == INTERLEAVED else ''} sends only whole "
                                f"values or pieces of one: {self.layer_map.blocked_reason(blocked)}")
        return found

    def least_peak_bytes(self, degree: int, schedules: Sequence[tuple[str, int]]) -> int | None:
        """The least, over `schedules` ((schedule, chunks per stage)) and the cuts each starts from
        (`start_cuts`), of the busiest stage's memory per device, as `price` prices it (`stage_memory`): what the
        stage search judges a stage plan's memory by, so that the plan it keeps fits when priced. None when no
        schedule can cut the plan."""
        least = None
        for schedule, v in schedules:
            try:
                orders = self.memo.schedule_order(schedule, degree, v, self.microbatches)
                cuts = self.start_cuts(degree, schedule, v)
            except PipelineError:
                continue
            for cut in cuts:
                busiest = self._cut_peak_bytes(cut, degree, orders, schedule)
                least = busiest if least is None else min(least, busiest)
        return least

    def _cut_peak_bytes(self, cut: Sequence[int], degree: int, orders: tuple, schedule: str) -> int:
        """The busiest stage's memory per device of the cut at `cut` run in `orders` (`schedule`'s
        `schedule_order`), as `price` prices it (`stage_memory`).

        Where each stage holds one chunk (1F1B, GPipe) and the chunks' activation bytes are integers at or above
        0, each stage's peak (`activation_peaks`: the running sum of its chunk's bytes, + at a forward, - at a
        backward) is the chunk's bytes times the most micro-batches its order holds at once (`in_flight_counts`,
        kept by the memo): every action of the stage's order moves the same integer, so the running sum is that
        integer times the running count, and its largest is the integer times the largest count. The same
        integers, without walking the order (2m actions a stage) for every cut of every candidate."""
        per_chunk = self._chunk_bytes(cut, degree)
        if per_chunk is not None and len(cut) == degree and all(act >= 0 for act, _state, _transient in per_chunk):
            held = self.memo.in_flight(schedule, degree, 1, self.microbatches)
            peaks = [count * act for count, (act, _state, _transient) in zip(held, per_chunk)]
        else:
            if per_chunk is None:   # a figure that is not an integer: summed node by node, as `price` sums it
                layout = self.memo.lay_out(self.layer_map, cut, degree)
                per_chunk = [(c.activation_bytes, c.state_bytes, c.transient_bytes)
                             for c in self._chunk_costs(layout)]
            peaks = activation_peaks(orders, [act for act, _state, _transient in per_chunk])
        return max(_stage_bytes([range(s, len(cut), degree) for s in range(degree)], per_chunk, peaks))

    def fitting_floors(self, degree: int, schedules: Sequence[tuple[str, int]]) -> tuple[float, float]:
        """Lower bounds of the steps (the fastest pipelined plan that fits, of `schedules` ((schedule, chunks per
        stage)) at any cut `pipelined` may price; the fastest PTD-P point that fits: 1F1B and interleaved at the
        equal cut); `math.inf` where none. Without margin for the floats' order (`StageFit.schedule_floors`).

        Why. A chunk's forward per micro-batch is at least its own nodes' forward_s / m, its backward likewise
        (`StageFit.floor_s`); waits, transfers, synchronisation and optimizer only add. Where each chunk reads
        the one before it (`_chained`), a chunk's forward of a micro-batch waits for that micro-batch's forwards
        of every earlier chunk, and a chunk's backward for the backwards of the later ones
        (`ir.pipeline.simulate_schedule`). A stage s's first action is a forward of its first chunk, chunk s (any
        other action of it waits for one on s), and its last a backward of chunk s (a later chunk's backward of
        that micro-batch comes before it, on s); its actions run one after another. So the step is at least,
        for each s, chunks 0..s-1's forwards of one micro-batch, then the stage's m forwards and backwards of its
        chunks, then chunks s-1..0's backwards (`_cut_floor`). Interleaved and the PTD-P points run the equal cut
        alone (`start_cuts`, no refinement; an equal cut some partial sum crosses is no plan), whose memory
        (`_cut_peak_bytes`, the figure `price` gives) says whether it fits. 1F1B and GPipe run one chunk per
        stage at any cut `pipelined` reaches (whose chunks begin at cuttable layers): the least of `_cut_floor`
        over every such cut whose stages' memory can fit, by dynamic programming over (stage, first layer), a
        stage's term reading only its first and last layer; a stage's memory is at least its own nodes' state
        plus its in-flight micro-batches' own activations (`in_flight_counts`; free values and the transient
        only add). Where the chain is not shown, `math.inf` is not claimed: both bounds are 0 (the caller's
        `floor_s` stands)."""
        each = self.schedule_fitting_floors(degree, schedules)
        return min((f[0] for f in each), default=math.inf), min((f[1] for f in each), default=math.inf)

    def schedule_fitting_floors(self, degree: int, schedules: Sequence[tuple[str, int]]
                                ) -> tuple[tuple[float, float], ...]:
        """`fitting_floors` of each of `schedules` alone, in their order: (a lower bound of the step of every
        pipelined plan of that schedule that fits, at any cut `pipelined` may price; of its PTD-P point that fits,
        `math.inf` for GPipe, which Megatron does not run); `math.inf` where none can fit or be cut, (0.0, 0.0)
        where the chain is not shown. Worked out once per (degree, schedules): the floors of a stage plan are
        asked by its ranking (`StageFit.fastest_s`), the grid's bound and the stage search's stop."""
        key = (degree, tuple(schedules))
        found = self._schedule_floors.get(key)
        if found is None:
            found = self._schedule_floors[key] = self._work_out_schedule_floors(degree, schedules)
        return found

    def _work_out_schedule_floors(self, degree: int, schedules: Sequence[tuple[str, int]]
                                  ) -> tuple[tuple[float, float], ...]:
        """`schedule_fitting_floors`, worked out (`fitting_floors` says why each is a floor)."""
        layer_map, m, capacity = self.layer_map, self.microbatches, self.machine.memory_capacity
        if not self._is_chained:
            return tuple((0.0, 0.0) for _s in schedules)
        layers, cuttable, free, blocks = layer_map.layers, layer_map.cuttable, layer_map.free, layer_map.blocks
        per_layer = {layer: 0.0 for layer in layers}
        for i, c in self.plan.costs.items():
            if i not in free and not c.weight_chain and i in blocks:
                per_layer[blocks[i]] += c.forward_s + c.backward_s
        busy = [per_layer[layer] for layer in layers]
        out = []
        for name, v in schedules:
            if degree * v > len(layers) or chunks_refusal(name, layer_map.model_layers, degree, v) is not None:
                out.append((math.inf, math.inf))
                continue
            orders = self.memo.schedule_order(name, degree, v, m)
            equal = equal_starts(layers, degree * v)
            on_equal = math.inf
            if cuttable.issuperset(equal) and self._cut_peak_bytes(equal, degree, orders, name) <= capacity:
                index = {layer: k for k, layer in enumerate(layers)}
                on_equal = _cut_floor(busy, [index[s] for s in equal], degree, m)
            plans = on_equal if name == INTERLEAVED else self._fitting_cut_floor(busy, degree, name)
            points = on_equal if name in (ONE_F_ONE_B, INTERLEAVED) else math.inf
            out.append((plans, points))
        return tuple(out)

    def _fitting_cut_floor(self, busy: Sequence[float], degree: int, schedule: str) -> float:
        """The least `_cut_floor` over the cuts into `degree` one-chunk stages beginning at cuttable layers whose
        stages' own state and in-flight own activations fit (`fitting_floors`); `math.inf` where none."""
        layers, m, n = self.layer_map.layers, self.microbatches, len(busy)
        if degree > n:
            return math.inf
        run = [0.0]
        for b in busy:
            run.append(run[-1] + b)
        times = np.array(run)
        span = np.arange(n + 1)
        later = span[None, :] > span[:, None]
        later &= np.array([j == n or layers[j] in self.layer_map.cuttable for j in range(n + 1)])[None, :]
        term = times[:, None] / m + (times[None, :] - times[:, None])   # [i, j]: a stage of layers i..j-1
        held = self.memo.in_flight(schedule, degree, 1, m)
        own = self._layer_bytes
        if own is not None:
            acts, states = _byte_sums([own[layer][0] for layer in layers], [own[layer][1] for layer in layers],
                                      max(held), 0)
        best = np.full(n + 1, math.inf)
        best[n] = 0.0
        for k in range(degree - 1, -1, -1):
            allowed = later & (span[:, None] <= n - (degree - k)) & (span[None, :] <= n - (degree - k - 1)) & \
                (best[None, :] < math.inf)
            if own is not None:
                memory = states[None, :] - states[:, None] + held[k] * (acts[None, :] - acts[:, None])
                allowed &= ~_exceeds(memory, self.machine.memory_capacity)
            value = np.where(allowed, np.maximum(best[None, :], term), math.inf)
            best = value.min(axis=1)
        return float(best[0])

    @cached_property
    def _layer_bytes(self) -> dict[int, tuple[int, int, int]] | None:
        """Per layer, the activation, state and largest transient bytes of its own nodes (not the free values it
        reads): what a chunk's memory adds up (`_layer_runs`, `_fitting_cut_floor`). None where a node's figure is
        not an integer (then only the node-by-node sum in `_chunk_costs`' order is the same figure)."""
        shares = self.shares.values()
        distinct = dict(zip(map(id, shares), shares)).values()   # nodes alike share one (`__init__`); in C
        if not all(type(c.activation_bytes) is int and type(c.state_bytes) is int and type(c.transient_bytes) is int
                   for c in distinct):
            return None
        return self._per_layer(_share_bytes, self.layer_map.free)

    def _chunk_bytes(self, starts: Sequence[int], degree: int) -> list[tuple[int, int, int]] | None:
        """Each chunk's (activation, state, largest transient) bytes of the cut at `starts`, as `_chunk_costs`
        gives them, from the layers' integer sums (`_layer_bytes`) without laying the cut out: a chunk's nodes are
        its layers' own nodes, disjoint between layers, and the free values they read, which a stage counts with
        its first chunk that reads them. Integers add up alike in any order, so the figures are the same. None
        where `_layer_bytes` is.

        A free value that one layer alone reads is counted with that layer's chunk, by whatever stage it lies on
        (no earlier chunk reads it), so it is summed into its layer's figures once (`_layer_runs`), and a chunk's
        sums of those are differences of running sums over the layers; only the free values two or more layers
        read (a mask, a rotary table, a tied embedding: a handful) are charged stage by stage as before."""
        found = self._layer_runs
        if found is None:
            return None
        acts, states, transients, shared, free_bytes = found
        layers = self.layer_map.layers
        index = {layer: k for k, layer in enumerate(layers)}
        bounds = [index[s] for s in starts] + [len(layers)]
        charged: list[set[int]] = [set() for _ in range(degree)]
        out = []
        for c in range(len(starts)):
            first, end = bounds[c], bounds[c + 1]
            free = set().union(*shared[first:end]) - charged[c % degree]
            charged[c % degree] |= free
            figures = [free_bytes[i] for i in free]
            out.append((acts[end] - acts[first] + sum(f[0] for f in figures),
                        states[end] - states[first] + sum(f[1] for f in figures),
                        max(max(transients[first:end], default=0), max((f[2] for f in figures), default=0))))
        return out

    @cached_property
    def _layer_runs(self) -> tuple[list[int], list[int], list[int], list[frozenset[int]],
                                   dict[int, tuple[int, int, int]]] | None:
        """What `_chunk_bytes` reads, from `_layer_bytes`: over the layers in order, 0 and the running sums of
        each layer's own activation and state bytes plus those of the free values it alone reads; each layer's
        largest transient of those; each layer's free values that other layers read too (with bytes); and those
        values' bytes. None where `_layer_bytes` is. Which free values a layer alone reads is the structure's
        (`ir.pipeline.LayerStructure.layer_free`, shared by every pricer of a PCG of that structure); the bytes are
        this plan's, integers, so the sums are the same in any order."""
        own = self._layer_bytes
        if own is None:
            return None
        shares, layers = self.shares, self.layer_map.layers
        _forward, _backward, activation, state_of, _step, transient_of, _tp_comm = _FIGURES
        acts, states, transients, shared, free_bytes = [0], [0], [], [], {}
        for layer, (alone, others) in zip(layers, self.layer_map.structure.layer_free):
            act, state, transient = own[layer]
            # the free values it alone reads that have shares, their bytes summed in C (integers: any order)
            held = list(filter(None, map(shares.get, alone)))
            if held:
                act, state = act + sum(map(activation, held)), state + sum(map(state_of, held))
                transient = max(transient, max(map(transient_of, held)))
            acts.append(acts[-1] + act)
            states.append(states[-1] + state)
            transients.append(transient)
            mine = frozenset(filter(shares.__contains__, others))
            shared.append(mine)
            for i in mine:
                if i not in free_bytes:
                    c = shares[i]
                    free_bytes[i] = (c.activation_bytes, c.state_bytes, c.transient_bytes)
        return acts, states, transients, shared, free_bytes

    @staticmethod
    def stage_memory(layout: StageLayout, per_chunk: Sequence[LayerCost], peaks: Sequence[int]) -> list[int]:
        """Each stage's memory per device: its chunks' weights' state, the activations its schedule holds at its
        peak (`peaks`, `ir.pipeline.activation_peaks`) and its largest recomputed block's while recomputed. The
        one figure for a pipelined plan's memory (`price`) and the stage search's check (`least_peak_bytes`)."""
        return _stage_bytes([[c.index for c in layout.stage_chunks(s)] for s in range(layout.degree)],
                            [(c.activation_bytes, c.state_bytes, c.transient_bytes) for c in per_chunk], peaks)

    def layer_costs(self) -> dict[int, LayerCost]:
        """Layer -> its cost (`layer_costs`), worked out once."""
        if self._layer_costs is None:
            # one chunk per layer, each its own stage (nothing charged to an earlier chunk): a layer's nodes in the
            # PCG's order, as `lay_out` lists a chunk's, summed as `_chunk_costs` sums them
            self._layer_costs = self._per_layer(_summed)
        return self._layer_costs

    def _per_layer(self, figure: Callable[[list[LayerCost]], object], left_out: Collection[int] = ()) -> dict:
        """Layer -> `figure` of the shares of its nodes (`_layer_orders`, less `left_out`), in the PCG's order:
        worked out once per distinct sequence of share objects (what `layer_costs` and `_layer_bytes` read)."""
        shares, made, out = self.shares, {}, {}
        kept = (shares.keys() - left_out if left_out else shares.keys()).__contains__
        for layer, ordered in self._layer_orders:
            mine = list(map(shares.__getitem__, filter(kept, ordered)))   # in C: the nodes in shares, not left out
            key = tuple(map(id, mine))
            found = made.get(key)
            if found is None:
                found = made[key] = figure(mine)
            out[layer] = found
        return out

    @cached_property
    def _layer_orders(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """Each layer, in order, with the nodes a chunk holding it alone computes, in the PCG's order
        (`LayerMap.chunk_nodes`, kept with the map: every pricer of the same nodes reads the same).

        What reads them (`layer_costs`, `_layer_bytes`) works out each layer's figure once per distinct
        sequence of share objects (`__init__`: nodes alike share one): a stage plan of N alike blocks has N
        layers whose nodes' shares are the same objects in the same order (llama-70b:64's stage plans: 81 layers,
        3 to 6 distinct sequences), and a figure summed from the same objects in the same order is the same
        float. The shares are held by the pricer for the whole computation, so an id is theirs alone."""
        runs = self.layer_map.chunk_nodes
        return tuple((layer, runs(k, k + 1)[1]) for k, layer in enumerate(self.layer_map.layers))

    def _chunk_costs(self, layout: StageLayout) -> list[LayerCost]:
        """Each chunk's cost: its nodes' shares, a value two chunks of one stage read counted with the first.
        A chunk's nodes follow from its layers and those of the stage's chunks before it, so its cost is worked
        out once per pricer for those (the cut search prices cuts that differ in one or two chunks)."""
        earlier: list[tuple[tuple[int, ...], ...]] = [() for _ in range(layout.degree)]
        out = []
        for chunk in layout.chunks:
            key = (earlier[chunk.stage], chunk.layers)
            found = self._chunk_memo.get(key)
            if found is None:
                charged = {i for c in layout.stage_chunks(chunk.stage) if c.index < chunk.index for i in c.nodes}
                kept = (self.shares.keys() - charged if charged else self.shares.keys()).__contains__
                found = _summed(list(map(self.shares.__getitem__, filter(kept, chunk.nodes))))
                self._chunk_memo[key] = found
            earlier[chunk.stage] += (chunk.layers,)
            out.append(found)
        return out

    def _stage_sums(self, layout: StageLayout, stage: int) -> tuple[float, int, int]:
        """A stage's optimizer seconds and the elements its collectives send per step, all and its gradient
        synchronisation's (`ir.pipeline.stage_comm_elements`), over its nodes (`StageLayout.stage_nodes`). They
        follow from its chunks' layers (a chunk's nodes do), so they are worked out once per pricer for those: a
        cut moved by one layer changes two stages. The set of nodes is made alike for the same chunks, so its
        sums add in the same order."""
        key = tuple(c.layers for c in layout.stage_chunks(stage))
        found = self._sums_memo.get(key)
        if found is None:
            nodes = layout.stage_nodes(stage)
            # the same seconds in the same order as a generator gives them (`sum` adds what it is handed)
            found = self._sums_memo[key] = (sum(map(self.optimizer_s.get, nodes, repeat(0.0))),
                                            nodes_elements(nodes, self.plan.costs),
                                            nodes_elements(nodes, self.plan.costs, "grad_sync_elements"))
        return found

    def _stage_sync(self, layout: StageLayout, stage: int, aligned: bool = False) -> "StageSync":
        """A stage's synchronisation once per step: per chunk, the seconds reducing its weights' gradients (run
        beside its last backward, `overlapped_reduce_end`), and the seconds of the rest (ZeRO's all-gathers of
        updated shards, ZeRO-3's gathers), after them; or, where they are overlapped with the next forward
        (`gathers`), those all-gathers' seconds and what each chunk's first forward waits for them
        (`_gather_wait`; `aligned`: every stage launches them at the step's start, chunk after chunk). The
        gradient reductions run in buckets (`cost.stage_sync`); a node two chunks of the stage read counts
        with the first. Worked out once per pricer for the stage's chunks (their layers) in a pipeline of
        `layout.degree` stages: its chunks' indices and nodes follow from them."""
        key = (layout.degree, stage, tuple(c.layers for c in layout.stage_chunks(stage)), aligned)
        found = self._sync_memo.get(key)
        if found is None:
            found = self._sync_memo[key] = self._work_out_sync(layout, stage, aligned)
        return found

    def _work_out_sync(self, layout: StageLayout, stage: int, aligned: bool) -> "StageSync":
        """`_stage_sync`, worked out."""
        seen: set[int] = set()
        reduce_s: dict[int, float] = {}
        wait_s: dict[int, float] = {}
        after_s = gather_s = 0.0
        launched: dict[GroupTopology, float] = {}   # aligned: per group, the gathers queued before this chunk's
        chain_s, own_s, reductions, gathers = self.chain_s, self.reduce_s, self.reductions, self.gathers
        for chunk in layout.stage_chunks(stage):
            kept = (chain_s.keys() - seen if seen else chain_s.keys()).__contains__
            nodes = list(filter(kept, chunk.nodes))   # its weights' chains not counted before, in its order
            seen.update(nodes)
            # in C: the memo's keys joined from each node's part (`StageMemo.parts`: the same keys), the rest's
            # seconds handed to `sum` in the chunk's order (the same floats)
            keyed = list(filter(reductions.__contains__, nodes))
            reducing, after = self.memo.bucketed_seconds(list(map(reductions.__getitem__, keyed)), self.machine,
                                                         tuple(chain.from_iterable(map(self._reduction_parts.get,
                                                                                       keyed))))
            rest = list(filterfalse(reductions.__contains__, nodes))
            reduce_s[chunk.index] = reducing + sum(map(own_s.__getitem__, rest))
            keyed = list(filter(gathers.__contains__, nodes))
            if keyed:   # ZeRO-1's bucketed gathers (`after`) and ZeRO-2's per-node ones run in the next forward
                after = 0.0
                buckets = self.memo.gather_buckets(list(map(gathers.__getitem__, keyed)), self.machine,
                                                   tuple(chain.from_iterable(map(self._gather_parts.get, keyed))))
                wait_s[chunk.index] = self._gather_wait(chunk, buckets, launched if aligned else {})
                for group, found in buckets.items():
                    seconds = sum(s for _nodes, s in found)
                    gather_s += seconds
                    launched[group] = launched.get(group, 0.0) + seconds
            after_s += after + sum(chain_s[i] - own_s[i] for i in filterfalse(gathers.__contains__, rest))
        return StageSync(reduce_s, after_s, gather_s, wait_s)

    @cached_property
    def _reduction_parts(self) -> dict[int, tuple]:
        """Each gradient reduction's part of the memo's bucketing key (`StageMemo.parts`), once per pricer."""
        return self.memo.parts(self.reductions, True)

    @cached_property
    def _gather_parts(self) -> dict[int, tuple]:
        """Each overlapped gather's part of the memo's gather-bucket key (`StageMemo.parts`), once per pricer."""
        return self.memo.parts(self.gathers, False)

    @cached_property
    def _gather_reads(self) -> tuple[dict[int, float], dict[int, frozenset[int]]]:
        """What `_gather_wait` reads of each node outside the weights' chains (a chain is the stage's sync, not a
        forward's: left out of both): its share's overlapped forward seconds (`TpOverlap.applied`, once per share
        object: nodes alike share one), and the free values it needs where it needs any. Worked out once per
        pricer, when a gather is first waited for, rather than node by node for every chunk of every cut."""
        chain, made, forward = self.chain_s, {}, {}
        for i, share in self.shares.items():
            if i not in chain:
                found = made.get(id(share))
                if found is None:
                    found = made[id(share)] = self.overlap.applied(share).forward_s
                forward[i] = found
        needs = {i: found for i, found in self.layer_map.needs.items() if found and i not in chain}
        return forward, needs

    def _gather_wait(self, chunk: Chunk, buckets: Mapping[GroupTopology, Sequence[tuple[tuple[int, ...], float]]],
                     queued: Mapping[GroupTopology, float]) -> float:
        """What `chunk`'s first forward waits for its parameters' all-gathers (`stage_sync.gather_buckets`: per
        group, bucket by bucket), as Megatron's overlap_param_gather runs them (`schedules.prefetch_delay`): a
        bucket is first read where the chunk's forward reaches the first node reading one of its weights (the
        forward seconds per micro-batch of the chunk's nodes before it, `node_share`). Each group on its own
        link: the longest of their waits. `queued`: per group, seconds of gathers launched before this chunk's
        at the same moment (aligned launches), which the result then counts from."""
        forward, needs = self._gather_reads
        nodes = chunk.nodes
        # before each node, the chunk's forward so far (0.0 added for a node with none: the same float, `at` never
        # being -0.0), and after the last
        ats = list(accumulate(map(forward.get, nodes, repeat(0.0)), initial=0.0))
        first: dict[int, float] = {}
        for k in compress(range(len(nodes)), map(needs.__contains__, nodes)):
            for r in needs[nodes[k]]:
                first.setdefault(r, ats[k])
        at = ats[-1]
        waits = [prefetch_delay([seconds for _nodes, seconds in found],
                                [min((first.get(n, at) for n in nodes), default=at) for nodes, _s in found],
                                queued.get(group, 0.0))
                 for group, found in buckets.items()]
        return max(waits, default=0.0)

    def price(self, layout: StageLayout, schedule: str) -> Plan:
        """The plan cut as `layout`, run in `schedule`, priced (see the module docstring)."""
        plan, machine, m = self.plan, self.machine, self.microbatches
        p, stage_devices, dtype = layout.degree, plan.devices, machine.dtype_bytes
        per_chunk = [self.overlap.applied(c) for c in self._chunk_costs(layout)]   # memory as it was, time overlapped
        transfers = transfer_seconds(layout, stage_devices, machine, dtype)
        # Megatron launches the gathers on every stage at the step's start where the schedule is interleaved
        # (align_param_gather, its default there), else each stage at its first forward (it forces it off)
        aligned = schedule == INTERLEAVED
        syncs = [self._stage_sync(layout, s, aligned) for s in range(p)]
        waits = tuple(next((sync.wait_s[c.index] for sync in syncs if c.index in sync.wait_s), 0.0)
                      for c in layout.chunks)
        waits = waits if any(waits) else ()
        run = simulate_schedule(layout, schedule, m, [c.forward_s for c in per_chunk],
                                [c.backward_s for c in per_chunk], transfers,
                                [c.activation_bytes for c in per_chunk], () if aligned else waits,
                                waits if aligned else (),
                                self.memo.schedule_order(schedule, p, layout.chunks_per_stage, m),
                                self.memo.in_flight(schedule, p, layout.chunks_per_stage, m))
        shared_s = _shared_sync(self.pieces, layout, stage_devices, machine)
        sent = p2p_elements(layout, m)
        memory = self.stage_memory(layout, per_chunk, run.activation_peak_bytes)
        stages, ends = [], []
        sums = [self._stage_sums(layout, s) for s in range(p)]
        for s in range(p):
            mine = [per_chunk[c.index] for c in layout.stage_chunks(s)]
            reduce_s, after_s = syncs[s].reduce_s, syncs[s].after_s + shared_s.get(s, 0.0)
            sync = sum(reduce_s.values()) + after_s + syncs[s].gather_s
            optimizer = sums[s][0]
            stage_end = max((e for _a, _b, e in run.busy[s]), default=0.0)
            stages.append(StageFigures(sum(c.forward_s for c in mine), sum(c.backward_s for c in mine), sync,
                                       optimizer, memory[s], run.in_flight[s]))
            reduced = (max(stage_end, overlapped_reduce_end(run.busy[s], reduce_s)) if self.overlap_grad_reduce
                       else stage_end + sum(reduce_s.values()))   # Megatron-LM of 2021: after the flush
            ends.append(reduced + after_s + optimizer)
        shared = shared_weight_elements(self.pieces, layout)
        stage_comm = [sums[s][1] + shared.get(s, 0) + sum(v for (a, _b), v in sent.items() if a == s)
                      for s in range(p)]
        busiest = max(range(p), key=lambda s: stage_comm[s])
        p2p_bytes = max((sum(v for (a, _b), v in sent.items() if a == s) for s in range(p)), default=0) * dtype
        figures = PipelinePlan(schedule, m, stage_devices, layout, tuple(stages),
                               tuple(c.forward_s for c in per_chunk), tuple(c.backward_s for c in per_chunk),
                               tuple(c.activation_bytes for c in per_chunk), run.bubble_fraction, p2p_bytes,
                               tuple((a, b, t) for (a, b), t in sorted(transfers.items())),
                               () if aligned else waits, waits if aligned else ())
        compute = max((s.forward_s + s.backward_s) * m + s.optimizer_s for s in stages)
        totals = Totals(max(ends), int(stage_comm[busiest]), int(stage_comm[busiest]) * dtype,
                        max(s.memory_bytes for s in stages),
                        max(grad for _optimizer, _comm, grad in sums),
                        compute, max(s.sync_s for s in stages) + figures.transfer_s * 2 * m)
        return replace(plan, machine=machine, devices=p * stage_devices, totals=totals, pipeline=figures)


def _node_shares(costs: Mapping[int, NodeCost], microbatches: int, in_node: Collection[int]) -> dict[int, LayerCost]:
    """Each node's share (`node_share`), in the order of `costs`. A priced PCG's nodes share few cost objects (a
    model of repeated blocks: llama-70b's 4,664 nodes hold 774), and a node's share is a function of its cost
    object and whether it is in `in_node`: each worked out once, and the nodes of one (cost object, in `in_node`)
    share that one object (`StagePricer._per_layer` reads the objects' ids). The nodes outside `in_node` (all but
    its few collectives) are looked up by their cost object's id alone, without a key tuple made per node, and
    those in it put in their places after. The ids are those of objects `costs` holds throughout."""
    distinct = dict(zip(map(id, costs.values()), costs.values()))
    made = {key: node_share(cost, microbatches, False) for key, cost in distinct.items()}
    shares = dict(zip(costs, map(made.__getitem__, map(id, costs.values()))))
    made_in: dict[int, LayerCost] = {}
    for ident in in_node:
        cost = costs.get(ident)
        if cost is not None:
            found = made_in.get(id(cost))
            if found is None:
                found = made_in[id(cost)] = node_share(cost, microbatches, True)
            shares[ident] = found
    return shares


def _summed(shares: Sequence[LayerCost]) -> LayerCost:
    """A chunk's cost from its nodes' shares (`node_share`), summed in the order given (the PCG's): each figure's
    values handed to `sum` (`max`) in that order, as a generator over the shares hands them."""
    forward, backward, activation, state, step, transient, tp_comm = _FIGURES
    return LayerCost(sum(map(forward, shares)), sum(map(backward, shares)), sum(map(activation, shares)),
                     sum(map(state, shares)), sum(map(step, shares)), max(map(transient, shares), default=0),
                     sum(map(tp_comm, shares)))


def _stage_bytes(stages: Sequence[Sequence[int]], per_chunk: Sequence[tuple[int, int, int]], peaks: Sequence[int]
                 ) -> list[int]:
    """Each stage's memory per device (`StagePricer.stage_memory`) from its chunks' (activation, state, largest
    transient) bytes; `stages`: each stage's chunks, in order."""
    out = []
    for s, chunks in enumerate(stages):
        mine = [per_chunk[c] for c in chunks]
        out.append(sum(state for _act, state, _t in mine) + peaks[s] + max((t for _a, _s, t in mine), default=0))
    return out


@dataclass(frozen=True)
class StageSync:
    """A stage's weights' synchronisation per step (`StagePricer._stage_sync`)."""

    reduce_s: Mapping[int, float]   # chunk -> seconds reducing its gradients beside its last backward
    after_s: float                  # seconds after the reductions, before the optimizer
    gather_s: float                 # seconds of ZeRO's gathers run during the next forward (0 when not overlapped)
    wait_s: Mapping[int, float]     # chunk -> what its first forward waits for those gathers (aligned: its earliest
    #                                 start, from the step's start)


def _in_node_collectives(plan: Plan) -> set[int]:
    """The plan's parallel nodes whose group is inside one node: the collectives Megatron-Core's userbuffers and
    PyTorch's symmetric memory reach (docs/COSTMODEL.md "Tensor-parallel communication overlap"). A node's group
    is its axis's (`mesh_groups`), so whether it spans one node is asked once per axis, and a node's axis once per
    distinct `attrs` (the axis is one of them: nodes of equal attributes act on one axis), not per node (a stage
    plan of llama-70b holds ~2,000 parallel nodes of a few dozen attribute tuples)."""
    mesh = plan.pcg.mesh
    inside = [GroupTopology.of_axis(mesh, a).nodes_spanned == 1 for a in range(len(mesh))]
    by_attrs: dict[tuple, bool] = {}
    out = set()
    for node in plan.pcg.nodes:
        if node.kind == "parallel":
            found = by_attrs.get(node.attrs)
            if found is None:
                found = by_attrs[node.attrs] = inside[node.axis(mesh)]
            if found:
                out.add(node.id)
    return out


def overlapped_reduce_end(busy: Sequence[tuple[Action, float, float]], reduce_s: Mapping[int, float]) -> float:
    """When a stage's gradient reductions end, each chunk's (`reduce_s`: chunk -> seconds) run as its last
    micro-batch's backward produces the gradients, as Megatron's overlap_grad_reduce and DDP's buckets run them:
    a chunk's reduction starts with that backward (its buckets are launched as they fill), ends no earlier than
    the backward does (the last bucket waits for the last gradient), and the chunks' reductions run one after
    another on the stage's data-parallel link, in the order their last backwards start (interleaved: the
    later chunk first). The last bucket's own time after the backward is not charged (a 25 MB bucket: about
    1 ms across nodes)."""
    last: dict[int, tuple[float, float]] = {}
    for action, start, end in busy:
        if action.phase == BACKWARD:
            last[action.chunk] = (start, end)
    free = 0.0
    for chunk, (start, end) in sorted(last.items(), key=lambda item: item[1]):
        seconds = reduce_s.get(chunk, 0.0)
        if seconds > 0:
            free = max(max(free, start) + seconds, end)
    return free


def _shared_sync(pieces: Mapping[int, int], layout: StageLayout, stage_devices: int, machine: Machine
                 ) -> dict[int, float]:
    """Stage -> seconds to sum the gradients of the weights it shares with other stages (each rank's stored
    piece, `stored_piece_elements`, all-reduced with its twins on those stages)."""
    out: dict[int, float] = {}
    for weight, stages in layout.shared_weights:
        nbytes = pieces[weight] * machine.dtype_bytes
        across = any(_pair(a, b, stage_devices, machine.devices_per_node).nodes_spanned > 1
                     for a in stages for b in stages if a < b)
        group = GroupTopology(len(stages), 1, len(stages)) if across else GroupTopology(len(stages), len(stages), 1)
        seconds = price(ALL_REDUCE, group, nbytes, machine).seconds
        for s in stages:
            out[s] = out.get(s, 0.0) + seconds
    return out


SCHEDULE_CHOICES = (ONE_F_ONE_B, INTERLEAVED, GPIPE)   # what the search tries, in this order


def schedule_chunks(schedule: str, degree: int, layers: int, pinned: int | None = None) -> int | None:
    """The chunks per stage the search prices `schedule` with on `degree` stages of `layers` layers; None when
    it cannot run there. 1F1B and GPipe: one. Interleaved: `pinned` (Megatron's
    `--virtual-pipeline-model-parallel-size`) when given and it splits each stage's layers evenly, else the
    least v >= 2 that does (`ir.pipeline.interleaved_chunk_counts`, Megatron's rule).

    Why the least and one only: the search prices one interleaved layout per (degree, micro-batches), as it did
    with its fixed two chunks, so its work does not grow with the divisors of the layers per stage; two chunks
    (Megatron's example and the most common setting) wherever they divide, so the plans that were layouts
    Megatron runs do not move. More chunks shrink the bubble ((p - 1) / (v m) of the step) but send v times the
    point-to-point transfers and hold more warm-up activations; a published run that used more is priced by
    pinning them."""
    if schedule != INTERLEAVED:
        return 1 if pinned in (None, 1) else None
    counts = interleaved_chunk_counts(layers, degree)
    if pinned is not None:
        return pinned if pinned in counts else None
    return counts[0] if counts else None


def applicable_schedules(pinned: str | None, degree: int, microbatches: int, layers: int,
                         chunks: int | None = None) -> tuple[tuple[str, int], ...]:
    """(schedule, chunks per stage) the pipeline search prices (`pinned` alone when given; `chunks` pins the
    chunks per stage): interleaved where the micro-batches are a multiple of the stages, with the chunks
    `schedule_chunks` gives (none where no even split exists)."""
    out = []
    for name in SCHEDULE_CHOICES:
        if pinned is not None and name != pinned:
            continue
        v = schedule_chunks(name, degree, layers, chunks)
        if v is None or (name == INTERLEAVED and microbatches % degree):
            continue
        out.append((name, v))
    return tuple(out)


class PricedOnce:
    """The pipelined prices of one call's stage plans (`StagePricer.pipelined`), each worked out once for the
    same PCG and node costs: the search of every stage mesh at the pair a scout chose (`_search_every_mesh`)
    often chooses the scout's stage plan again (its candidates hold the scout's, the same objects:
    `step.searched_once`, `step.independent_points`), and then cut and priced the same PCG in the same schedules,
    its grid point too; and a stage step ranks its candidates by these prices (`StageFit.fastest_s`), which the
    pipeline search then reads for the plan it chose. Sound: a price reads of the stage plan only its PCG, node
    costs, stage machine, devices and graph's micro-batches and name (`StagePricer`), each in the key (the PCG
    and costs by identity, kept alive beside the entry so that no other object takes their id), beside the
    pipeline's machine, degree, schedule, chunks and cut; the memo a pricer reads is a cache of what those determine (`StageMemo`), so
    another memo gives the same figures. The plan found again is the price's figures (machine, devices, totals,
    pipeline) put on the stage plan given, as `StagePricer.price` puts them on its own; a PipelineError is
    raised again."""

    def __init__(self) -> None:
        self.done: dict[tuple, tuple] = {}

    def pipelined(self, stage: Plan, machine: Machine, pricer: Callable[[], StagePricer], p: int, schedule: str,
                  v: int, starts: Sequence[int] | None = None) -> Plan:
        """`pricer().pipelined(p, schedule, v, starts=starts)` of `stage` (the pricer's plan) on `machine`."""
        key = (id(stage.pcg), id(stage.costs), stage.machine, stage.devices, stage.graph.microbatches,
               stage.graph.name, machine, p, schedule, v, None if starts is None else tuple(starts))
        found = self.done.get(key)
        if found is None:
            try:
                result: Plan | PipelineError = pricer().pipelined(p, schedule, v, starts=starts)
            except PipelineError as err:
                result = err
            found = self.done[key] = (stage.pcg, stage.costs, result)
        result = found[2]
        if isinstance(result, PipelineError):
            raise result
        return replace(stage, machine=result.machine, devices=result.devices, totals=result.totals,
                       pipeline=result.pipeline)


@dataclass(frozen=True)
class StageFit:
    """How the stage search judges a stage plan's memory (`search.pipeline_search`): cut into `degree` stages
    and run in one of the schedules it will be priced in (`pinned`, or every one that applies) on `machine`
    (all the pipeline's devices), its busiest stage's memory per device as the pricing gives it
    (`StagePricer.least_peak_bytes`). One computation for both: a stage plan the check keeps fits when priced
    in some schedule, and one that fits in none is not kept without recomputing."""

    degree: int
    machine: Machine
    pinned: str | None = None
    # the layer maps and layouts the candidates' pricers share (not part of what the judgment is)
    memo: StageMemo = field(default_factory=StageMemo, compare=False, repr=False)
    # chunks per stage pinned for the interleaved schedule (`schedule_chunks`); None: the search's choice
    chunks: int | None = None
    # the step a pipelined plan must be faster than to matter (`search.pipeline_search`): where every candidate's
    # `floor_s` is at or above it, the stage search stops (`ir.errors.CannotWin`); None: never. It changes which
    # searches run, not what a search finds, so it is no part of the judgment (nor of a cache key)
    bar_s: float | None = field(default=None, compare=False)
    # the search of every stage mesh at a scout's pair (`pipeline_search._search_every_mesh`): its first
    # `scouted_meshes` meshes are the scout's, already judged, and only the others' candidates are bounded, their
    # grid points against `grid_bar_s` too, the fastest PTD-P point that fits so far (`search.step.
    # stop_where_cannot_win`); like `bar_s`, they change which searches run, not what a search finds
    grid_bar_s: float | None = field(default=None, compare=False)
    scouted_meshes: int = field(default=0, compare=False)
    # the scout's stage plan at that pair: where the search of every stage mesh chooses the scout's stage plan and
    # grid point again, it answers with this plan rather than making its own (`search.step._the_scouts_choice`);
    # like `bar_s`, it changes what a search makes, not what it finds
    scout_plan: Plan | None = field(default=None, compare=False, repr=False)
    # the call's pipelined prices of stage plans (`PricedOnce`, the pipeline search's): `fastest_s` prices a
    # candidate as the pipeline search then prices the stage plan chosen, so that one is read, not priced again
    once: "PricedOnce" = field(default_factory=lambda: PricedOnce(), compare=False, repr=False)
    # the pricers of the last PRICERS_KEPT stage plans judged (`_pricer`): a cache, no part of the judgment
    _pricers: OrderedDict = field(default_factory=OrderedDict, compare=False, repr=False)

    def _pricer(self, plan: Plan) -> "StagePricer":
        """The `StagePricer` of `plan` on this machine, made once per stage plan judged: the stage search asks a
        candidate's memory (`peak_bytes`, through `search.fit.MemoryFit`) and then its floors (`schedule_floors`,
        `search.step.stop_where_cannot_win`) of two Plans holding the same PCG and node costs, and each made its
        pricer (every node's share, every layer's bytes) again. Sound: what these two read of a pricer (its
        shares, layer map, per-layer bytes and the cut memos) is worked out from the PCG, the node costs, the
        graph's micro-batches, this machine and the memo (a cache of what the PCG determines), each in the key or
        fixed for this StageFit (the PCG and costs by identity, kept alive beside the pricer so that no other
        object takes their id). `price`, which reads the rest of the plan (its graph's name, machine, devices),
        is asked of them by `fastest_s` alone, whose plans are every caller's (`search.fit.MemoryFit`,
        `search.step.stop_where_cannot_win`): the step's graph, stage machine and devices, fixed for this
        StageFit's pair. Only the last PRICERS_KEPT are kept: the questions come one after the other, and a
        pricer is large (a share per node)."""
        key = (id(plan.pcg), id(plan.costs), plan.graph.microbatches)
        found = self._pricers.get(key)
        if found is None or found[0] is not plan.pcg or found[1] is not plan.costs:
            found = self._pricers[key] = (plan.pcg, plan.costs, StagePricer(plan, self.machine, memo=self.memo))
            while len(self._pricers) > PRICERS_KEPT:
                self._pricers.popitem(last=False)
        self._pricers.move_to_end(key)
        return found[2]

    def peak_bytes(self, plan: Plan) -> int | None:
        """The memory per device `plan` (a stage plan) needs in the schedule and cut that need least of those
        the pricing starts from; None when no schedule can run it (too few layers, a pinned schedule that does
        not apply)."""
        pricer = self._pricer(plan)
        return pricer.least_peak_bytes(self.degree, applicable_schedules(
            self.pinned, self.degree, pricer.microbatches, pricer.layer_map.model_layers, self.chunks))

    def fits(self, peak_bytes: int | None) -> bool:
        """Whether a stage plan needing `peak_bytes` per device (`peak_bytes`) fits on the machine."""
        return peak_bytes is not None and peak_bytes <= self.machine.memory_capacity

    def fastest_s(self, plan: Plan) -> float:
        """The step of the fastest pipelined plan that fits of those the pipeline search prices from the stage plan
        `plan` (`search.pipeline_search._price_schedules`: `StagePricer.pipelined` in every schedule that applies,
        its own cut search); `math.inf` where none fits or none can be cut. What the stage search ranks its
        candidates that fit by (`search.mesh.rank`): the plan the pipeline search returns is the fastest of these
        prices, so a stage plan ranked by its unpipelined step (the whole model on the stage mesh, no bubble, no
        stage's own synchronisation) was chosen over one that pipelines faster (llama-70b:64: the scout's `gpu 8`
        plan, 16.156 s pipelined, over `gpu0 4 x gpu1 2` keeping every activation, 15.234 s)."""
        pricer = self._pricer(plan)
        best = math.inf
        schedules = applicable_schedules(self.pinned, self.degree, pricer.microbatches,
                                         pricer.layer_map.model_layers, self.chunks)
        floors = pricer.schedule_fitting_floors(self.degree, schedules)
        # the schedules in the ascending order of their floors (ties in their order), each priced only while its
        # floor is not above the fastest price that fits so far: its plans that fit are at least that floor, so
        # it cannot lower the least (a schedule none of whose plans can fit, `math.inf`, is never priced here:
        # llama-70b's GPipe holds every micro-batch, 530 GiB a device, yet its cut search priced up to
        # REFINE_PRICINGS cuts for each candidate ranked). The pipeline search prices every schedule of the stage
        # plan it chooses (`pipeline_search._price_schedules`), as before.
        for k in sorted(range(len(schedules)), key=lambda k: floors[k][0]):
            name, v = schedules[k]
            floor = floors[k][0]
            if floor == math.inf or floor * (1.0 - FLOOR_MARGIN) > best:
                continue
            try:
                priced = self.once.pipelined(plan, self.machine, lambda: pricer, self.degree, name, v)
            except PipelineError:
                continue
            if priced.totals.fits(self.machine):
                best = min(best, priced.totals.time_s)
        return best

    def floor_s(self, pcg, costs: Mapping[int, NodeCost]) -> float:
        """A lower bound of the step of every pipelined plan `StagePricer` prices from the stage plan (`pcg`, its
        node `costs`) at this degree: any cut, any schedule, any chunks per stage, the grid's equal cuts too.

        Why: `price` runs each stage's actions one after another (`ir.pipeline.simulate_schedule`: an action
        starts no earlier than the one before it ends, and waits only add), and its step is the latest stage's
        end plus that stage's synchronisation and optimizer, none negative; so the step is at least each stage's
        busy time, hence at least their mean over the p stages. A stage runs each of its chunks' forward and
        backward once per micro-batch, m of them; a chunk's forward per micro-batch is the sum of its nodes'
        shares (`node_share`: (forward_s + comm_s / 2) / m), less at most the in-node collectives' half
        (`TpOverlap.applied`: the part hidden is at most 1 of comm_s / 2 / m, and a negative part adds), so at
        least the sum of its nodes' forward_s / m; the backward likewise. Every node outside the free values
        (`ir.pipeline.free_nodes`) is in its layer, and a chunk computes every node of its layers (free values
        may be counted again by other stages, which only adds): the stages' busy times sum to at least the sum
        of forward_s + backward_s (per step) over those nodes. A weight's chain is charged once per step to the
        synchronisation, not to a micro-batch (`node_share`), and is left out. So the step is at least that sum
        over p, less `FLOOR_MARGIN` for the order in which the floats add up."""
        free = layer_structure(pcg).free
        busy = sum(c.forward_s + c.backward_s for i, c in costs.items() if i not in free and not c.weight_chain)
        return busy / self.degree * (1.0 - FLOOR_MARGIN)

    def schedule_floors(self, plan: Plan) -> tuple[float, float]:
        """Two lower bounds, each at or above `floor_s`, for the stage plan `plan` at this degree: (the step of every
        pipelined plan that fits that `pipeline_search._price_schedules` prices from it: any cut, every schedule
        that applies; the step of every PTD-P point of it that fits: `pipeline_search._grid_points`, 1F1B and
        interleaved on equal layer counts). `math.inf` where none can fit or be cut. A plan that does not fit
        is not bounded: the stage search compares these only with bars that fit (`search.step.
        stop_where_cannot_win`), beside which such a plan changes nothing (`pipeline_search._bars`)."""
        pricer = self._pricer(plan)
        floor = self.floor_s(plan.pcg, plan.costs)
        schedules = applicable_schedules(self.pinned, self.degree, pricer.microbatches,
                                         pricer.layer_map.model_layers, self.chunks)
        plans, points = pricer.fitting_floors(self.degree, schedules)
        return max(floor, plans * (1.0 - FLOOR_MARGIN)), max(floor, points * (1.0 - FLOOR_MARGIN))


def _chained(layer_map: LayerMap) -> bool:
    """Whether every layer that may begin a chunk (`LayerMap.cuttable`, the first one aside) reads some node of the
    layer before it (free values aside): then any cut's neighbouring chunks are joined by a crossing
    (`LayerMap.lay_out`), which `StagePricer.fitting_floors` reads."""
    read = {(layer, reader) for _node, layer, readers, _e in layer_map.reader_layers for reader in readers}
    layers = layer_map.layers
    return all((layers[k - 1], layers[k]) in read for k in range(1, len(layers)) if layers[k] in layer_map.cuttable)


def _cut_floor(busy: Sequence[float], starts: Sequence[int], degree: int, microbatches: int) -> float:
    """The step floor of one cut (`StagePricer.fitting_floors`): per stage s, the work per micro-batch of chunks
    0..s-1 (its fill and drain) plus the stage's whole work; the largest. `busy`: each layer's own forward and
    backward seconds per step, in the layers' order; `starts`: each chunk's first layer's index."""
    bounds = list(starts) + [len(busy)]
    chunk = [sum(busy[bounds[c]:bounds[c + 1]]) for c in range(len(starts))]
    stages = [sum(chunk[c] for c in range(s, len(chunk), degree)) for s in range(degree)]
    return max(sum(chunk[:s]) / microbatches + stages[s] for s in range(degree))
