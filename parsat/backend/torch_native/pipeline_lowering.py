"""A pipelined plan read as `torch.distributed.pipelining` pieces: where to cut the module, which schedule, which
stage holds what, and how each stage runs inside (docs/TORCH_NATIVE.md, "Pipelining").

`lower_pipeline(pcg, graph, pipeline, module)` says, without torch:

* **the cuts**: chunk c > 0 of the plan's layout (`ir.pipeline`) begins
  at its first layer; layer L is block L of the plan's stack (its weights
  are named `b{L}_...`, `ir.blocks`), and the module's submodule that
  holds every parameter of those weights and none of another layer's is
  where the module is cut (`pipeline()`'s `SplitPoint.BEGINNING`); where
  none does, the submodule holding the weight the layer reads first, if
  it holds that layer's parameters only (HF BERT, `_cut_module`). Another
  layer is refused, naming it;
* **each chunk's weights**: the parameters of the weights its nodes read
  (a tied embedding's on the first and the last stage), which the traced
  stage modules must hold exactly (`pipelined.py` checks it);
* **the shared weights**: a weight several stages hold has its gradient
  summed over them before the optimizer (Megatron's embedding group), as
  `ir.pipeline.StageLayout.shared_weights` says;
* **the schedule**: `ScheduleGPipe`, `Schedule1F1B` or
  `ScheduleInterleaved1F1B` (the plan's `gpipe`, `1f1b`, `interleaved`)
  with the plan's micro-batch count; torch orders the actions itself, in
  the same schedule family as the one the cost model simulated;
* **inside a stage**: the stage plan (one PCG on the stage's S devices)
  lowered as `lowering.lower` lowers any plan, on each stage module, with
  `traced=True`: the traced stage modules run aten operators, not the
  module's `nn.Linear` modules, so no `parallelize_module` style has a
  module to attach to; a tensor axis is instead each weight's DTensor
  placement (`Shard(d)` for a weight the plan stores split along d,
  `Replicate()` for the others: the same role analysis), and the stage's
  operators run on DTensors (`pipelined.py`). Every value crossing between
  chunks is sent whole; where the plan keeps them all split along the
  sequence on the tensor axis (sequence parallelism,
  `sequence_crossings`), each tp rank sends its `Shard(1)` piece to the
  same tp rank of the next stage (and the gradient back), as Megatron does
  and the cost model prices it; all split along the batch, its `Shard(0)`
  piece the same way (`piece_dim`); data and ZeRO-3 axes become
  `replicate` / `fully_shard` on each stage module. A one-device stage
  holds its parameters as DTensors on a one-rank mesh.

Recomputation (`PCG.recompute == "blocks"`) checkpoints each block's
submodule in the traced stage modules (`lowering.recomputed_blocks`).
Refused, naming why: a value crossing between chunks split on the
stage's tensor axis otherwise than along the sequence or the batch (or
crossings split differently), a layer the module does not
hold as one submodule, and whatever `lower` refuses in the stage plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parsat.backend.torch_native.lowering import (SEQ_DIM, Lowering, LoweringError, ModuleInfo, layer_module, lower,
                                                  recomputed_blocks, weight_params, weight_values)
from parsat.ir.blocks import block_of
from parsat.ir.graph import Graph
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import PCG, WEIGHT
from parsat.ir.pipeline import GPIPE, INTERLEAVED, ONE_F_ONE_B, Chunk, PipelinePlan, StageLayout
from parsat.ir.placement import FREE, PARTIAL, REPLICA, code_text, shard

TORCH_SCHEDULES = {GPIPE: "ScheduleGPipe", ONE_F_ONE_B: "Schedule1F1B", INTERLEAVED: "ScheduleInterleaved1F1B"}
PIPELINE_AXIS_NAME = "pp"
STAGE_AXIS_NAME = "stage"   # the one-rank axis of a one-device stage (its parameters' DTensor mesh)


@dataclass(frozen=True)
class ChunkLowering:
    """One chunk of the plan as a traced stage module: its index (torch's stage index), the stage (rank group)
    that runs it, its layers, the submodule it begins at (None for the first), the parameters it holds (every
    name of each), and those names by parameter (a tied one's several names in one group)."""

    index: int
    stage: int
    layers: tuple[int, ...]
    begins_at: str | None
    params: tuple[str, ...]
    groups: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class PipelineLowering:
    """A pipelined plan in torch's terms (module docstring)."""

    degree: int                                   # p, the pipeline stages
    stage_devices: int                            # S, the ranks of one stage
    schedule: str                                 # the plan's schedule (`ir.pipeline`)
    microbatches: int
    chunks: tuple[ChunkLowering, ...]
    shared: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]   # (a shared weight's parameter names, its stages)
    stage: Lowering | None                        # inside each stage (None: one device a stage)
    sequence_crossings: bool = False              # values crossing between chunks split along the sequence on tp
    piece_dim: int = SEQ_DIM                      # ... or, where 0, along the batch (the same pieces path)
    recompute: tuple[str, ...] = ()               # the block modules checkpointed (`lowering.recomputed_blocks`)
    # the plan's machine is priced as a runtime that re-gathers (`Machine.runtime_regathers`): a sequence-parallel
    # stage's column-parallel products gather their input again in backward (`sequence_products`)
    regathers: bool = False

    @property
    def torch_schedule(self) -> str:
        """The name of torch's schedule class for the plan's schedule."""
        return TORCH_SCHEDULES[self.schedule]

    @property
    def mesh(self) -> Mesh:
        """The stage mesh (a rank's coordinates in it pick its local batch: rank r is local rank r % S)."""
        return self.stage.mesh if self.stage is not None else Mesh.of([])

    @property
    def batch_axes(self) -> tuple[int, ...]:
        """The stage mesh's axes the batch is split over (`apply.local_batch`)."""
        return self.stage.batch_axes if self.stage is not None else ()

    def device_mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The job's DeviceMesh: the pipeline axis (major: rank r is stage r // S), then the stage mesh's axes (a
        one-rank `stage` axis for one-device stages)."""
        if self.stage is None:
            return (self.degree, 1), (PIPELINE_AXIS_NAME, STAGE_AXIS_NAME)
        return (self.degree, *self.stage.mesh.shape), (PIPELINE_AXIS_NAME, *self.stage.mesh.names)

    def chunks_of(self, stage: int) -> tuple[ChunkLowering, ...]:
        """The chunks pipeline stage `stage` runs (one, or v when interleaved)."""
        return tuple(c for c in self.chunks if c.stage == stage)

    def split_points(self) -> tuple[str, ...]:
        """The submodules the module is cut before, in order (chunks 1 .. n-1)."""
        return tuple(c.begins_at for c in self.chunks if c.begins_at is not None)

    def describe(self) -> str:
        """The lowering as text: stages, schedule, cuts, shared weights, each stage's own lowering."""
        lines = [f"pipeline: {self.degree} stages of {self.stage_devices} rank(s), "
                 f"{self.torch_schedule}(n_microbatches={self.microbatches}) over torch.distributed.pipelining"]
        for c in self.chunks:
            where = f"from {c.begins_at}" if c.begins_at else "from the start"
            lines.append(f"  stage module {c.index} (layers {c.layers[0]}..{c.layers[-1]}) on pipeline stage "
                         f"{c.stage}: {where}, {len(c.params)} parameters")
        for names, stages in self.shared:
            lines.append(f"  shared: {' = '.join(names)} held by stages {', '.join(map(str, stages))}, gradients "
                         "summed over them before the optimizer")
        if self.recompute and self.stage is None:   # a stage plan's own lowering says it otherwise
            lines.append(f"recomputation: torch.utils.checkpoint around each block's forward "
                         f"({', '.join(self.recompute)})")
        if self.stage is None:
            lines.append("inside each stage: one rank, parameters DTensors on a one-rank mesh")
        else:
            lines += ["inside each stage:"] + ["  " + line for line in self.stage.describe().splitlines()]
        return "\n".join(lines)


def lower_pipeline(pcg: PCG, graph: Graph, pipeline: PipelinePlan, module: ModuleInfo,
                   regathers: bool = False) -> PipelineLowering:
    """The pipelined plan (`pcg`, one stage mesh's plan of `graph`, cut as `pipeline` says) on `module`; raises
    LoweringError naming what cannot be lowered. `regathers`: the plan's machine's (`PipelineLowering.regathers`)."""
    if pipeline.schedule not in TORCH_SCHEDULES:
        raise LoweringError(f"the plan's pipeline schedule {pipeline.schedule!r} has no torch schedule "
                            f"(torch runs {', '.join(TORCH_SCHEDULES)})")
    stage = _stage_lowering(pcg, graph, module, pipeline.layout, pipeline.stage_devices)
    weights = {n.id: n.op for n in pcg.nodes if n.kind == "leaf" and n.role == WEIGHT}
    chunks = []
    for chunk in pipeline.layout.chunks:
        begins = None if chunk.index == 0 else _cut_module(pcg, chunk, weights, module)
        groups = sorted({weight_params(weights[ident], module) for ident in chunk.nodes if ident in weights})
        names = sorted({p for group in groups for p in group})
        chunks.append(ChunkLowering(chunk.index, chunk.stage, chunk.layers, begins, tuple(names), tuple(groups)))
    _one_copy_a_stage(chunks)
    pieces = _crossing_pieces(pcg, pipeline.layout, stage)
    shared = tuple((weight_params(weights[ident], module), tuple(stages))
                   for ident, stages in pipeline.layout.shared_weights)
    return PipelineLowering(pipeline.layout.degree, pipeline.stage_devices, pipeline.schedule,
                            pipeline.microbatches, tuple(chunks), shared, stage,
                            pieces is not None, recompute=recomputed_blocks(pcg, module), regathers=regathers,
                            piece_dim=SEQ_DIM if pieces is None else pieces)


def _cut_module(pcg: PCG, chunk: Chunk, weights: dict[int, str], module: ModuleInfo) -> str:
    """The submodule chunk `chunk` is cut before: the one holding its first layer alone (`layer_module`), or,
    where the layer spans submodules, the one holding the weight the layer reads first, if it holds that layer's
    parameters only: BERT's importer begins block i at the LayerNorm that ends encoder layer i - 1
    (`b1_..embeddings.LayerNorm` is `encoder.layer.0.output.LayerNorm`), so the cut is before that LayerNorm's
    call, where the block's computation begins. The traced stages must then hold exactly the chunks' parameters
    (`pipelined.py` checks it), so a cut that leaves another of the layer's submodules behind is refused there."""
    layer = chunk.layers[0]
    try:
        return layer_module(layer, weights.values(), module)
    except LoweringError:
        first = _first_weight_read(pcg, set(chunk.nodes), layer, weights)
        if first is None:
            raise
        owner = weight_params(first, module)[0].rpartition(".")[0]
        mine = {n for w in weights.values() if block_of(w) == layer for n in weight_params(w, module)}
        held = {f"{owner}.{local}" for local in module.holds.get(owner, ())}
        if not owner or not held <= mine or owner in module.has_param_below:
            raise
        return owner


def _first_weight_read(pcg: PCG, inside: set[int], layer: int, weights: dict[int, str]) -> str | None:
    """The graph weight of `layer` that the chunk's operators (its nodes `inside`, in the PCG's order) read first,
    directly or through computations on weights alone."""
    static = weight_values(pcg)

    def leaf_of(ident: int) -> int | None:
        if ident in weights:
            return ident
        if ident in static:
            return next((found for i in pcg.node(ident).inputs if (found := leaf_of(i)) is not None), None)
        return None

    for node in pcg.nodes:
        if node.id in inside and node.kind == "op" and node.id not in static:
            for i in node.inputs:
                leaf = leaf_of(i)
                if leaf is not None and block_of(weights[leaf]) == layer:
                    return weights[leaf]
    return None


def _stage_lowering(pcg: PCG, graph: Graph, module: ModuleInfo, layout: StageLayout,
                    devices: int) -> Lowering | None:
    """Inside a stage: nothing for one device, else the stage plan lowered for traced modules (a tensor axis as
    DTensor placements)."""
    if devices == 1:
        return None
    # the schedule runs the micro-batches: the stage plan is lowered as one micro-batch's
    lowering = lower(pcg, replace(graph, microbatches=1), module, traced=True)
    return lowering


def _crossing_pieces(pcg: PCG, layout: StageLayout, lowering: Lowering | None) -> int | None:
    """The dim the values crossing between chunks are split along on the stage's tensor axis, None where they
    cross whole: the sequence (`shard(1)` of [batch, seq, hidden]: sequence parallelism) or the batch (`shard(0)`:
    the same layout along the batch, reduce-scatters and all-gathers along dim 0 around the split projections,
    which the search offers when sp is left to it), each stage's floating inputs then entering as `Shard(d)`
    DTensors (`apply.traced_tensor_parallel`) and each tp rank sending its piece (`pipelined` sizes torch's
    PipelineStage buffers to the pieces): no gather before the send, no slice after. All crossings whole, or all
    split along one of those dims; anything else is refused, naming the node."""
    axis = lowering.tensor_axis if lowering is not None else None
    if axis is None:
        return None
    pieces = {shard(SEQ_DIM): SEQ_DIM, shard(0): 0}
    codes = {}
    for crossing in layout.crossings:
        node = pcg.node(crossing.node)
        code = node.placement.codes[axis]
        codes[crossing] = "whole" if code in (FREE, REPLICA) else pieces.get(code) if len(node.shape) > SEQ_DIM \
            else None
        if codes[crossing] is None or len(set(codes.values())) > 1:
            origin = f" [{node.origin}]" if node.origin else ""
            raise LoweringError(
                f"node #{node.id} {node.label}{origin} crosses from chunk {crossing.source} to chunk "
                f"{crossing.target} as {code_text(code)} on tensor axis {lowering.mesh.names[axis]}: the traced "
                "stages send each value whole, or each tp rank its piece of the sequence (Shard(1)) or of the "
                "batch (Shard(0)) when every crossing is so split; another split, or crossings split differently, "
                "is not lowered"
                + (" (a partial sum crosses: lay the stage plan out with its partial sums reduced where they are made, "
                   "as Megatron-LM does: `megatron_pcg(..., reduce_at_once=True)`)" if code == PARTIAL else "")
                )
    split = {c for c in codes.values() if c != "whole"}
    return split.pop() if split else None


def _one_copy_a_stage(chunks: list[ChunkLowering]) -> None:
    """No parameter in two chunks of one stage: each stage module is made data-parallel on its own, which would
    make two parameters of one weight on one rank (the gradient sum over stages assumes one a stage)."""
    seen: dict[tuple[int, str], int] = {}
    for chunk in chunks:
        for name in chunk.params:
            if (chunk.stage, name) in seen:
                raise LoweringError(f"parameter {name} is read by chunks {seen[chunk.stage, name]} and {chunk.index}, "
                                    f"both on pipeline stage {chunk.stage}: one weight in two stage modules of a rank "
                                    "is not lowered")
            seen[chunk.stage, name] = chunk.index
