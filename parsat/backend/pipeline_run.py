"""Run a pipelined plan: each stage's chunks on its own ranks, micro-batches moved point to point.

A pipelined plan (`ir.pipeline`) is one PCG laid out on the stage mesh of S
ranks and cut into chunks of layers, chunk c on stage c % p; global rank r
is stage r // S, local rank r % S. Each rank runs its stage's part of the
PCG with the executor's own pieces (`RankProgram` restricted to
`StageLayout.stage_nodes`, over the stage's process groups,
`MeshGroups(..., stages=p)`), and runs exactly its stage's actions of
`ir.pipeline.schedule_order`, in that order:

* F(k, c): receive the values crossing into chunk c for micro-batch k (from
  local rank i of the source stage; each becomes a leaf that requires a
  gradient), compute the chunk's nodes and the loss of the outputs it owns,
  send the values crossing out of it. The chunk's autograd graph stays
  alive until its backward.
* B(k, c): receive the gradients of the values it sent, run backward from
  them and from its loss (divided by m, as `executor.run_rank` does), send
  back the gradients of the values it received.

Under activation recomputation each chunk runs the part of each block it
computes as one checkpointed region (`RankProgram.forward`), keeping what
it sends; the region's forward runs again in the chunk's backward.

Weights' chains are made once per step for all micro-batches and their
gradients reduced once after the stage's last backward, exactly as
`run_rank` runs m > 1 micro-batches (`RankProgram.weight_values`,
`reduce_gradients`). Then a weight several stages hold (a tied embedding)
has its gradient summed over those stages, local rank i with local rank i
(Megatron's embedding group), so every copy steps like the unstaged weight;
each stage steps its optimizer on the pieces it holds. Free values made
from graph inputs alone (masks, positions) are computed once per
micro-batch on a stage and shared by its chunks, so a stage computes each
of its `stage_nodes` once per micro-batch: what
`ir.pipeline.stage_comm_elements` predicts.

Why our own point-to-point schedule and not `torch.distributed.pipelining`:
a stage here is a sub-PCG interpreted by our executor, with collectives of
its own over the stage's process groups, not an `nn.Module` cut at
`pipe_split` points; a chunk boundary carries several tensors (every
crossing, each a local piece laid out as the plan says) where a
`PipelineStage` passes positional activations; a tied weight spans stages
and needs its gradient summed before the optimizer; and the order of
actions must be `schedule_order`'s, the order the cost model simulated (one
source of truth), where the library's schedules carry their own.

Channels: each pair of chunks on different stages that a crossing joins
has, per local rank i, one process group of the two twin ranks for its
forward values and one for its gradients. Both ends of a channel post
their messages in micro-batch order (every schedule runs one chunk's
forwards, and its backwards, in micro-batch order), so they pair up
without tags, as NCCL needs (it matches a pair's messages in posting
order); separate channels keep a value and a gradient going opposite ways
from queueing behind each other on one communicator's stream. Sends are
`isend`, waited at the end of the step; receives are `irecv`, waited before
use. A stage runs its actions in an order `simulate_schedule` proves free of
deadlock when an action waits only for its inputs, which is all a rank
waits for here, so the job cannot deadlock; a rank that fails ends the job
through the launcher like any other.

Counting (reported beside the prediction, `parsat run`): each rank counts
the elements it sends to each other stage, forward values and gradients
(`ir.pipeline.p2p_elements`), and those it sends to sum shared weights'
gradients (ring convention, `ir.pipeline.shared_weight_elements`); its
stage's collectives are counted as `run_rank` counts them, and summed over
the stage's ranks they are the stage's figure
(`ir.pipeline.stage_comm_elements`).
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from parsat.backend.collectives import (ALL_REDUCE_KIND, COLLECTIVES, GRAD_SYNC, PIPELINE_AXIS, Comm, CommCounter,
                                        MeshGroups)
from parsat.backend.executor import (Comparison, ExecutionError, Optimizer, Prediction, RankProgram, RunResult,
                                     TensorMemory, TrainConfig, WeightValues, _job_summary, check_mesh,
                                     compare_with_reference, gradient_of, operator_library, reference_run,
                                     starting_weights, step_comm)
from parsat.backend.launch import LaunchConfig, RankContext, launch
from parsat.backend.training_data import StepData
from parsat.dsl.library import Library
from parsat.ir.costs import NodeCost
from parsat.ir.graph import Graph
from parsat.ir.microbatch import StepBatch, step_batch
from parsat.ir.pcg import PCG, WEIGHT, weight_storage
from parsat.ir.pipeline import (FORWARD, Crossing, PipelineError, PipelinePlan, free_nodes, p2p_elements,
                                schedule_order, shared_weight_elements, simulate_schedule, stage_comm_elements,
                                stored_piece_elements)
from parsat.ir.placement import Placement

SHARED_WEIGHT = "shared_weight"   # the counter's name for the gradient sum of a weight several stages hold


# ------------------------------------------------------------------ what the plan predicts


@dataclass(frozen=True)
class PipelinePrediction:
    """What a pipelined plan predicts per step: each stage's collectives (summed over its ranks) and gradient
    synchronisation, the point-to-point elements each rank of a stage sends to each other stage, and what each
    rank of a stage sends to sum shared weights' gradients. The same `ir.pipeline` functions the cost model
    prices a pipeline with."""

    collectives: tuple[int, ...]
    grad_sync: tuple[int, ...]
    p2p: Mapping[tuple[int, int], int]
    shared: Mapping[int, float]

    @staticmethod
    def of(pcg: PCG, pipeline: PipelinePlan, costs: Mapping[int, NodeCost]) -> "PipelinePrediction":
        layout = pipeline.layout
        return PipelinePrediction(stage_comm_elements(layout, costs),
                                  stage_comm_elements(layout, costs, "grad_sync_elements"),
                                  p2p_elements(layout, pipeline.microbatches),
                                  shared_weight_elements(stored_piece_elements(pcg), layout))

    def totals(self, base: Prediction) -> Prediction:
        """The job's prediction: the stages' collectives and gradient syncs summed (every rank's, as
        `RunResult` measures them), the plan's time and memory figures as they are."""
        return replace(base, comm_elements=sum(self.collectives), grad_sync_elements=sum(self.grad_sync))


def load_pipeline(data: Mapping) -> tuple[PipelinePlan, dict[int, NodeCost]] | None:
    """A plan dict's pipeline and node costs (None for a plan without a pipeline)."""
    if not data.get("pipeline"):
        return None
    try:
        pipeline = PipelinePlan.from_dict(data["pipeline"])
        costs = {int(n["id"]): NodeCost.from_dict(n.get("cost") or {}) for n in data["nodes"]}
    except (KeyError, TypeError, ValueError) as err:
        raise ExecutionError(f"the plan's pipeline does not follow the plan schema ({type(err).__name__}: {err})") \
            from None
    return pipeline, costs


def check_pipeline(pcg: PCG, pipeline: PipelinePlan, nproc: int, graph: Graph | None = None,
                   library: Library | None = None) -> None:
    """ExecutionError, before any rank starts, for a pipelined plan that cannot run as laid out: a rank count
    other than stages x stage devices, a PCG mesh other than a stage's, micro-batches other than the graph's, a
    schedule that cannot order these chunks, or a chunk that reads a value it neither computes nor receives."""
    layout = pipeline.layout
    p, s = layout.degree, pipeline.stage_devices
    if pcg.zero:
        raise ExecutionError(f"the plan's stages shard their weights' state (ZeRO-{pcg.zero}), which the pipelined "
                             "backend does not run yet; optimize with --degrees zero=0 to run it")
    if nproc != p * s:
        raise ExecutionError(f"the plan runs {p} pipeline stages of {s} rank(s), {p * s} ranks in all, but "
                             f"--nproc is {nproc}: start as many ranks as the plan has devices")
    if pcg.mesh.world != s:
        raise ExecutionError(f"the plan's pipeline stages have {s} device(s) each, but its PCG runs on a mesh of "
                             f"{pcg.mesh.world} ({pcg.mesh or 'one device'})")
    check_mesh(pcg, s, library)
    if graph is not None and graph.microbatches != pipeline.microbatches:
        raise ExecutionError(f"the pipeline runs {pipeline.microbatches} micro-batches a step, the plan's graph "
                             f"{graph.microbatches}")
    if sorted(c.index for c in layout.chunks) != list(range(len(layout.chunks))) or \
            any(c.stage != c.index % p for c in layout.chunks):
        raise ExecutionError("the pipeline's chunks must be numbered 0 .. n-1, chunk c on stage c % "
                             f"{p}, got {[(c.index, c.stage) for c in layout.chunks]}")
    by_id = {n.id: n for n in pcg.nodes}
    for chunk in layout.chunks:
        have = set(chunk.nodes) | {x.node for x in layout.crossings if x.target == chunk.index}
        for ident in chunk.nodes:
            missing = [i for i in by_id[ident].inputs if i not in have]
            if missing:
                raise ExecutionError(f"chunk {chunk.index} of the pipeline computes node {ident} but neither "
                                     f"computes nor receives its input(s) {missing}")
    for crossing in layout.crossings:
        if crossing.node not in layout.chunks[crossing.source].nodes:
            raise ExecutionError(f"the pipeline sends node {crossing.node} from chunk {crossing.source}, which "
                                 "does not compute it")
    computed = {n for c in layout.chunks for n in c.nodes}
    lost = [i for i in pcg.outputs if i not in computed]
    if lost:
        raise ExecutionError(f"no chunk of the pipeline computes the plan's output node(s) {lost}")
    try:
        n = len(layout.chunks)
        simulate_schedule(layout, pipeline.schedule, pipeline.microbatches, [1.0] * n, [1.0] * n, {}, [0] * n)
    except PipelineError as err:
        raise ExecutionError(f"the pipeline cannot run: {err}") from None


# ------------------------------------------------------------------ one stage's rank


@dataclass
class _ChunkRun:
    """One chunk's forward of one micro-batch, kept until its backward."""

    env: dict[int, tuple[torch.Tensor, Placement]]
    received: list[tuple[int, Crossing, torch.Tensor]]   # (crossing index, crossing, the leaf it arrived as)
    sent: list[tuple[int, Crossing, torch.Tensor]]       # (crossing index, crossing, the value it sent)
    to_diff: torch.Tensor | None                         # this chunk's share of the objective, or None


@dataclass
class _StepState:
    """What one step of one stage holds while its actions run."""

    data: StepData
    weights: WeightValues
    counter: CommCounter
    p2p: list[int]                                        # elements sent to each stage
    live: dict[tuple[int, int], _ChunkRun] = field(default_factory=dict)
    free: dict[int, dict] = field(default_factory=dict)  # micro-batch -> input-only free values made so far
    mail: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)   # crossings within the stage
    sends: list = field(default_factory=list)            # (work, tensor) to wait for before the step ends
    outputs: dict[str, list] = field(default_factory=dict)
    reported: float = 0.0


class StageRank:
    """One rank of one pipeline stage: its part of the PCG, its channels, its schedule (module docstring).
    `weights`: full starting values by name (`executor.starting_weights`; None: seeded from the PCG)."""

    def __init__(self, ctx: RankContext, pcg: PCG, pipeline: PipelinePlan, config: TrainConfig,
                 library: Library, weights: Mapping[str, torch.Tensor] | None = None):
        layout = pipeline.layout
        self.pipeline, self.layout, self.config, self.ctx = pipeline, layout, config, ctx
        self.stage, self.local = pipeline.stage_of_rank(ctx.rank)
        size = pipeline.stage_devices
        groups = MeshGroups(pcg.mesh, ctx.rank, ctx.device, ctx.collective_timeout_s, stages=layout.degree)
        self.program = RankProgram(pcg, replace(ctx, rank=self.local, world=size), config, library, weights,
                                   nodes=frozenset(layout.stage_nodes(self.stage)), groups=groups)
        self.order = schedule_order(pipeline.schedule, layout.degree, layout.chunks_per_stage,
                                    pipeline.microbatches)[self.stage]
        self.chunk_stage = {c.index: c.stage for c in layout.chunks}
        self.chunk_nodes = {c.index: frozenset(c.nodes) for c in layout.chunks}
        crossings = list(enumerate(layout.crossings))
        self.into = {c: [(i, x) for i, x in crossings if x.target == c] for c in self.chunk_nodes}
        self.out_of = {c: [(i, x) for i, x in crossings if x.source == c] for c in self.chunk_nodes}
        owner = {i: max(c for c, nodes in self.chunk_nodes.items() if i in nodes) for i in pcg.outputs}
        self.outputs_of = {c: [(i, name) for i, name in self.program.outputs_here if owner[i] == c]
                           for c in self.chunk_nodes}
        weighty: set[int] = set()
        for node in pcg.nodes:
            if (node.kind == "leaf" and node.role == WEIGHT) or any(i in weighty for i in node.inputs):
                weighty.add(node.id)
        self.input_free = frozenset(free_nodes(pcg) - weighty)
        timeout = timedelta(seconds=ctx.collective_timeout_s)
        self.channels = self._channels(timeout)
        self.shared = self._shared_groups(pcg, timeout)

    def _rank_of(self, stage: int) -> int:
        """This rank's twin on `stage`."""
        return stage * self.pipeline.stage_devices + self.local

    def _channels(self, timeout: timedelta) -> dict[tuple[int, int, str], tuple[object, int]]:
        """(source chunk, target chunk, phase) -> (this rank's process group for it, the peer's global rank),
        for the chunk pairs on different stages this rank sends or receives on. Every rank creates every group
        in one order (torch requires it), then opens the ones it belongs to in that order (NCCL creates a
        communicator on first use, which blocks until both ends arrive: the same order everywhere keeps that
        from waiting in a circle)."""
        pairs = sorted({(x.source, x.target) for x in self.layout.crossings
                        if self.chunk_stage[x.source] != self.chunk_stage[x.target]})
        size = self.pipeline.stage_devices
        mine: dict[tuple[int, int, str], tuple[object, int]] = {}
        opened = []
        for source, target in pairs:
            ends = (self.chunk_stage[source], self.chunk_stage[target])
            for phase in ("F", "B"):
                for local in range(size):
                    ranks = sorted(s * size + local for s in ends)
                    group = dist.new_group(ranks, timeout=timeout)
                    if self.ctx.rank in ranks:
                        peer = ranks[0] if ranks[1] == self.ctx.rank else ranks[1]
                        mine[(source, target, phase)] = (group, peer)
                        opened.append(group)
        for group in opened:   # not counted: opening the channels, not the plan's traffic
            dist.all_reduce(torch.zeros(1, device=self.ctx.device), group=group)
        return mine

    def _shared_groups(self, pcg: PCG, timeout: timedelta) -> list[tuple[int, object, tuple[int, ...]]]:
        """(stored node, this rank's group with its twins on the stages holding it, those stages) per weight
        this stage shares with others."""
        storage = weight_storage(pcg)
        size = self.pipeline.stage_devices
        groups: dict[tuple[int, ...], object] = {}
        for stages in sorted({stages for _, stages in self.layout.shared_weights}):
            for local in range(size):
                group = dist.new_group([s * size + local for s in stages], timeout=timeout)
                if local == self.local and self.stage in stages:
                    groups[stages] = group
        return [(storage[leaf][-1], groups[stages], stages) for leaf, stages in self.layout.shared_weights
                if self.stage in stages]

    # -------------------------------------------------------------- p2p

    def _send(self, state: _StepState, x: torch.Tensor, channel: tuple[int, int, str], to_stage: int) -> None:
        group, peer = self.channels[channel]
        x = x.detach().contiguous()
        state.sends.append((dist.isend(x, dst=peer, group=group), x))
        state.p2p[to_stage] += x.numel()

    def _receive(self, like_shape, channel: tuple[int, int, str]) -> torch.Tensor:
        group, peer = self.channels[channel]
        buffer = torch.empty(like_shape, dtype=self.config.torch_dtype(), device=self.ctx.device)
        dist.irecv(buffer, src=peer, group=group).wait()
        return buffer

    # -------------------------------------------------------------- actions

    def forward(self, state: _StepState, step: int, k: int, chunk: int, memory: TensorMemory,
                recomputed=None) -> _ChunkRun:
        program = self.program
        nodes = self.chunk_nodes[chunk]
        free = state.free.setdefault(k, {})
        env = {i: free[i] for i in nodes if i in free}
        received = []
        for index, crossing in self.into[chunk]:
            if self.chunk_stage[crossing.source] == self.stage:
                value = state.mail.pop(("F", k, index)).detach()
            else:
                node = program.pcg.node(crossing.node)
                shape = program.placements[node.id].local_shape(node.shape, program.mesh.shape)
                value = self._receive(shape, (crossing.source, chunk, "F"))
            value.requires_grad_()
            env[crossing.node] = (value, program.placements[crossing.node])
            received.append((index, crossing, value))
        to_diff = None
        with memory.saving((k, chunk)):
            program.forward(step, state.counter, state.data.inputs(k), state.weights, nodes, env, recomputed)
            if self.outputs_of[chunk]:
                to_diff, to_report = program.loss(env, state.data.targets(k), self.outputs_of[chunk])
                state.reported += float(to_report) / self.pipeline.microbatches
                for out_id, name in self.outputs_of[chunk]:
                    x, placement = env[out_id]
                    state.outputs[name].append((x.detach(), placement))
        free.update({i: env[i] for i in nodes if i in self.input_free and i in env})
        sent = []
        for index, crossing in self.out_of[chunk]:
            value = env[crossing.node][0]
            target_stage = self.chunk_stage[crossing.target]
            if target_stage == self.stage:
                state.mail[("F", k, index)] = value
            else:
                self._send(state, value, (chunk, crossing.target, "F"), target_stage)
            sent.append((index, crossing, value))
        return _ChunkRun(env, received, sent, to_diff)

    def backward(self, state: _StepState, k: int, chunk: int, run: _ChunkRun) -> None:
        tensors, grads = [], []
        if run.to_diff is not None and run.to_diff.requires_grad:  # the plan, not the data, decides it
            tensors.append(run.to_diff / self.pipeline.microbatches)   # the step's objective: the mean
            grads.append(None)
        for index, crossing, value in run.sent:
            if self.chunk_stage[crossing.target] == self.stage:
                grad = state.mail.pop(("B", k, index))
            else:
                grad = self._receive(value.shape, (chunk, crossing.target, "B"))
            if value.requires_grad:
                tensors.append(value)
                grads.append(grad)
        if tensors:
            torch.autograd.backward(tensors, grads)
        for index, crossing, leaf in run.received:
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            source_stage = self.chunk_stage[crossing.source]
            if source_stage == self.stage:
                state.mail[("B", k, index)] = grad
            else:
                self._send(state, grad, (crossing.source, chunk, "B"), source_stage)

    def sum_shared(self, counter: CommCounter) -> None:
        """Each weight held by several stages: its gradient summed over them (the module docstring)."""
        for stored, group, stages in self.shared:
            param = self.program.params[stored].tensor
            comm = Comm(group, len(stages), stages.index(self.stage), counter, SHARED_WEIGHT, PIPELINE_AXIS,
                        tag=GRAD_SYNC)
            param.grad = COLLECTIVES[ALL_REDUCE_KIND](gradient_of(param), None, comm, "backward")

    def train_step(self, step: int, data: StepData, optimizer: Optimizer,
                   memory: TensorMemory) -> tuple[_StepState, CommCounter]:
        """One step on `data` (drawn before the step's clock): the stage's actions in schedule order, then its
        gradient syncs, the shared weights' sum and the optimizer. Returns the step's state (outputs, counts) and
        the shared sum's counter."""
        program = self.program
        counter = CommCounter()
        state = _StepState(data, program.weight_values(counter), counter,
                           [0] * self.layout.degree, outputs={name: [] for _, name in program.outputs_here})
        first = True

        def recomputed(made) -> None:   # a recomputed block's values, beside every chunk's still alive
            memory.measure({**_live_values(state), **{("recomputed", i): v for i, v in made.items()}}, program,
                           optimizer, state.weights)

        for action in self.order:
            key = (action.microbatch, action.chunk)
            if action.phase == FORWARD:
                state.live[key] = self.forward(state, step, action.microbatch, action.chunk, memory, recomputed)
                if first:   # after the first forward: last step's gradients were alive until here
                    optimizer.zero_grad()
                    first = False
            else:
                self.backward(state, action.microbatch, action.chunk, state.live[key])   # alive in its backward
                del state.live[key]
                memory.release(key)
            memory.measure(_live_values(state), program, optimizer, state.weights)
        for work, _tensor in state.sends:
            work.wait()
        state.sends.clear()
        program.reduce_gradients(state.weights)   # once per step: the stage's gradient synchronisation
        shared = CommCounter()
        self.sum_shared(shared)
        memory.measure({}, program, optimizer, state.weights)
        optimizer.step()
        return state, shared


def _live_values(state: _StepState) -> dict:
    """Every value of every chunk forward not yet run backward (for the memory count)."""
    return {(key, ident): value for key, run in state.live.items() for ident, value in run.env.items()}


def run_stage_rank(ctx: RankContext, pcg: PCG, pipeline: PipelinePlan, config: TrainConfig, graph: Graph | None,
                   batch: StepBatch | None = None) -> dict:
    """One rank's training run of a pipelined plan (what `launch` sends to each rank): `run_rank`'s report,
    plus this stage's figures and the job's per stage (`_pipeline_summary`)."""
    library = operator_library()
    if batch is None:
        batch = step_batch(graph, library) if graph is not None else StepBatch()
    stage = StageRank(ctx, pcg, pipeline, config, library, starting_weights(graph, config))
    program = stage.program
    optimizer = Optimizer([p.tensor for p in program.params.values()], config)
    reference = reference_run(graph, config, batch) if config.check and graph is not None else None
    losses, times, steps_comm, diffs, figures = [], [], [], [], []
    memory = TensorMemory()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    for step in range(config.steps):
        data = program.step_data(batch, step).loaded()   # before the clock: the data loader's work, not the plan's
        start = ctx.step_start()
        state, shared = stage.train_step(step, data, optimizer, memory)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        total = torch.tensor(state.reported, dtype=config.torch_dtype(), device=ctx.device)
        dist.all_reduce(total)  # reporting only: not part of the plan, not counted
        losses.append(float(total))
        steps_comm.append(step_comm(state.counter, program.mesh))
        figures.append({"p2p": [float(x) for x in state.p2p], "shared": float(shared.sent()),
                        "shared_events": len(shared.events)})
        if reference is not None:
            diffs.append(compare_with_reference(program, state.outputs, reference, step, float(total)))
    found = Comparison()
    for d in diffs:
        found = found.merge(d)
    peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else memory.peak
    report = {"rank": ctx.rank, "stage": stage.stage, "losses": losses, "step_times": times, "comm": steps_comm,
              "pipeline": figures, "max_abs_diff": found.max_abs if diffs else None,
              "max_rel_diff": found.max_rel if diffs else None, "worst": found.worst,
              "nonfinite": list(found.nonfinite[:20]), "peak_memory_bytes": peak,
              "process_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    report["job"] = _job_summary(report, ctx)
    report["job"]["pipeline"] = _pipeline_summary(report, ctx, pipeline)
    return report


def _pipeline_summary(report: dict, ctx: RankContext, pipeline: PipelinePlan) -> dict:
    """The last step's figures of every rank and every stage, agreed by all ranks (reporting traffic, not
    counted): per stage its collectives and gradient syncs summed over its ranks and its peak memory; per rank
    the elements it sent to each stage and to sum shared weights' gradients."""
    p, world = pipeline.degree, ctx.world
    stage = report["stage"]
    last, mine = report["comm"][-1], report["pipeline"][-1]
    per_stage = torch.zeros(2, p, dtype=torch.float64, device=ctx.device)
    per_stage[0, stage], per_stage[1, stage] = last["sent"], last["grad_sync"]
    per_rank = torch.zeros(world, p + 1, dtype=torch.float64, device=ctx.device)
    per_rank[ctx.rank] = torch.tensor([*mine["p2p"], mine["shared"]], dtype=torch.float64)
    peaks = torch.zeros(p, dtype=torch.float64, device=ctx.device)
    peaks[stage] = float(report["peak_memory_bytes"])
    dist.all_reduce(per_stage)
    dist.all_reduce(per_rank)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return {"collectives": per_stage[0].tolist(), "grad_sync": per_stage[1].tolist(),
            "p2p": [row[:p] for row in per_rank.tolist()], "shared": [row[p] for row in per_rank.tolist()],
            "peak_memory_bytes": [int(x) for x in peaks.tolist()]}


# ------------------------------------------------------------------ measured against predicted


def pipeline_comparison(measured: Mapping, predicted: PipelinePrediction, pipeline: PipelinePlan) -> dict:
    """Each stage's measured figures beside the prediction (`parsat run --json`'s `pipeline` object):
    collectives per stage (summed over its ranks), point-to-point elements each of its ranks sent to each other
    stage, and each rank's share of the shared weights' gradient sum; `matches` when every one is equal."""
    p, size = pipeline.degree, pipeline.stage_devices
    stages, everything = [], True
    for s in range(p):
        ranks = range(s * size, (s + 1) * size)
        p2p_measured = {t: [measured["p2p"][r][t] for r in ranks] for t in range(p) if t != s}
        p2p_predicted = {t: predicted.p2p.get((s, t), 0) for t in range(p) if t != s}
        shared_measured = [measured["shared"][r] for r in ranks]
        shared_predicted = predicted.shared.get(s, 0.0)
        checks = [_equal(measured["collectives"][s], predicted.collectives[s]),
                  *(_equal(x, p2p_predicted[t]) for t, xs in p2p_measured.items() for x in xs),
                  *(_equal(x, shared_predicted) for x in shared_measured)]
        stages.append({"stage": s, "ranks": list(ranks),
                       "collectives_measured": measured["collectives"][s],
                       "collectives_predicted": predicted.collectives[s],
                       "grad_sync_measured": measured["grad_sync"][s], "grad_sync_predicted": predicted.grad_sync[s],
                       "p2p_sent_measured": {str(t): xs for t, xs in p2p_measured.items()},
                       "p2p_sent_predicted": {str(t): x for t, x in p2p_predicted.items()},
                       "shared_sum_measured": shared_measured, "shared_sum_predicted": shared_predicted,
                       "peak_memory_bytes": measured["peak_memory_bytes"][s], "matches": all(checks)})
        everything = everything and all(checks)
    return {"degree": p, "stage_devices": size, "schedule": pipeline.schedule,
            "microbatches": pipeline.microbatches, "chunks_per_stage": pipeline.layout.chunks_per_stage,
            "stages": stages, "matches": everything}


def _equal(measured: float, predicted: float) -> bool:
    return abs(measured - predicted) < 0.5


def run_pipelined_plan(pcg: PCG, pipeline: PipelinePlan, costs: Mapping[int, NodeCost], nproc: int,
                       config: TrainConfig, graph: Graph | None = None, predicted: Prediction | None = None,
                       backend: str | None = None, timeout_s: float = 300.0,
                       collective_timeout_s: float = 30.0) -> RunResult:
    """Train a pipelined plan on `nproc` spawned ranks (or the torchrun group) and summarise, as
    `executor.run_plan` does, with each stage's figures beside the prediction (`RunResult.pipeline`)."""
    if config.check and graph is None:
        raise ExecutionError("--check needs the original graph to compare with")
    if config.steps < 1:
        raise ExecutionError(f"--steps must be >= 1, got {config.steps}")
    library = operator_library()
    check_pipeline(pcg, pipeline, nproc, graph, library)   # before any rank starts
    batch = step_batch(graph, library) if graph is not None else StepBatch(pipeline.microbatches)
    expected = PipelinePrediction.of(pcg, pipeline, costs)
    reports = launch(run_stage_rank, (pcg, pipeline, config, graph, batch),
                     LaunchConfig(nproc=nproc, backend=backend, timeout_s=timeout_s,
                                  collective_timeout_s=collective_timeout_s))
    result = RunResult.of_job(reports, config, expected.totals(predicted or Prediction()), batch.microbatches,
                              pcg.recompute)
    return replace(result, pipeline=pipeline_comparison(reports[0]["job"]["pipeline"], expected, pipeline))


__all__ = ["PipelinePrediction", "StageRank", "check_pipeline", "load_pipeline", "pipeline_comparison",
           "run_pipelined_plan", "run_stage_rank"]
