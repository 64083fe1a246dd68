"""A plan read as PyTorch's distributed pieces: per mesh axis a role, per weight a placement, per module a style.

`lower(pcg, graph, module)` reads what the plan does to each weight and
around each split contraction, and says it in torch's terms
(docs/TORCH_NATIVE.md has the table, node kind by node kind):

* **each weight, per mesh axis** (`WeightLowering.roles`): where its
  storage chain (`ir.pcg.weight_storage`) leaves it and how the compute
  operators read it, following every path through parallel operators and
  through computations on weights alone (a transpose):
  stored whole and read whole, `free` (every rank computes the same
  gradient); stored whole and read as a `replicate`'s copy, `synced` (its
  gradient all-reduced: data parallelism); stored split and gathered
  before use, `gathered` (ZeRO-3); stored split and read split, `split`
  (tensor parallelism); stored whole and read as a `replicate`'s copy
  only by operators on a slice of the sequence (`shard(1)` of a [batch,
  seq, hidden] value), `sequence` (a norm's weight under sequence
  parallelism, its gradient all-reduced by DTensor). One exception is stored otherwise than the plan
  says (`WeightLowering.restored`): a tied table kept whole, read whole by
  embeddings and vocabulary-split by projections (BERT under Megatron's
  plan) is `split` along the vocabulary for both reads, and a note says
  which collectives then differ from the plan's. Anything else (a whole
  weight sliced where it is read, split on one path and gathered on
  another) is refused, naming the node.
* **each mesh axis** (`Lowering.axis_roles`): `tensor` if it splits some
  weight (then it may gather none: one role per axis, as torch's styles
  give it; its `sequence` weights are the tensor-parallel styles' own, and
  a weight it synchronises there is `whole`, a `Replicate()` DTensor whose
  gradient torch computes whole on every rank, `synced_beside_split`), else `zero3` if it gathers some, else
  `data` if it synchronises some. At most one tensor axis. An axis on
  which every rank does the same work is refused: nothing of torch's
  stack runs it, and the plan would waste its devices.
* **each split weight's module** (`Style`): the contraction that reads it
  decides: a `nn.Linear` weight stored `Shard(0)` (its output features)
  is `ColwiseParallel`, `Shard(1)` (its input features)
  `RowwiseParallel`; a `nn.Embedding` table `Shard(0)` (the vocabulary)
  is `RowwiseParallel` (vocabulary-parallel, each rank looking up its
  rows and the partial sums all-reduced), `Shard(1)` `ColwiseParallel`.
  The plan's placements around it must be the style's: a column-parallel
  contraction reads its activation whole (a `replicate`: the backward
  all-reduce of the input's gradient, Megatron's f) and makes it split
  along its last dim; a row-parallel one reads it split along its last
  dim and makes a partial sum that the plan then `reduce`s (Megatron's g).
  The parallel operators on the tensor axis that a style does for itself
  are *claimed* by it: that `replicate`, that `reduce`, a `combine` of a
  column-parallel output (the style then returns it whole,
  `output_layouts=Replicate()`), a `partition` of a row-parallel input
  (`input_layouts=Replicate()`), the one-hot ids' vocabulary `partition`
  of a vocabulary-parallel embedding; with sequence parallelism a
  `reduce_scatter` along the sequence of a row-parallel partial sum
  (`output_layouts=Shard(1)`), an `all_gather` along it before a
  column-parallel one (`input_layouts=Shard(1)`), and the norms between
  them `SequenceParallel`; where one such gather, or one `replicate`,
  feeds every column-parallel projection of a parameter-free parent (an
  attention's q/k/v, an MLP's gate/up), the parent's input is converted
  once instead (`PrepareModuleInput`, `gathered_inputs`), so its
  gradient is reduced once, as the plan's. Any parallel operator on the tensor
  axis that no style claims is refused, naming it: the module's own code
  runs between the styled modules on local pieces, and only the styles
  move activations.
* **every other parameter** on a tensor axis is read whole there (`free`):
  its module is wrapped to compute with `Replicate()` DTensors (style
  `replicate`), so every parameter is a DTensor on one mesh.
* **data axes**: each rank runs its module on its local batch: every
  input that carries a batch (`ir.microbatch.batch_dims`) must be read
  split along it on every data axis, in one order of axes
  (`Lowering.batch_axes`: rank coordinates on them, major first, pick the
  rank's block, `apply.local_batch`); a collective over a data axis on an
  activation (the loss's `reduce`, an output's gather) is allowed only
  where no operator that reads a weight follows it, because the module's
  own forward computes everything before it on the local batch (batch
  statistics synchronised mid-model are refused).

What the plan decides that the module's own forward does not reproduce
is said in `Lowering.notes`, never silently: operators rewritten by
algebraic rules (`rewritten_nodes`; the module computes its own form,
equal in value, which the proofs are about, unless `rewritten` replaces
its forward by the plan's graph: `Lowering.rewritten` then says so),
where a partial sum is all-reduced, a loss averaged
per rank, micro-batches. A plan that recomputes blocks names each block's
module (`recomputed_blocks`, the submodule `layer_module` finds for block
i's `b{i}_...` weights: what `apply.checkpoint_blocks` checkpoints). A
pipelined plan is read stage by stage by `pipeline_lowering`, which calls
`lower(..., traced=True)` for its stage plan: torch's traced stage modules
run aten operators, not the module's `nn.Linear`s, so there a tensor axis
is each split weight's DTensor placement (`TracedSplit`: the same roles,
the stored dim as `Shard(dim)`), the operators running on DTensors, not a
style per module.

Torch is not imported here: the module is described by `ModuleInfo`
(`apply.module_info` builds it from an `nn.Module`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence

from parsat.dsl.parallel_ops import ALL_GATHER, ALL_TO_ALL, COMBINE, PARTITION, REDUCE, REDUCE_SCATTER, REPLICATE
from parsat.ir.blocks import OUTSIDE, block_of, has_blocks
from parsat.ir.graph import Graph
from parsat.ir.megatron import vocabulary_parallel_logsumexps
from parsat.ir.mesh import Mesh
from parsat.ir.microbatch import batch_dims, batch_wide_constants
from parsat.ir.pcg import PCG, WEIGHT, PNode, readers, storage_views, weight_placement, weight_storage
from parsat.ir.placement import FREE, PARTIAL, REPLICA, Placement, code_text, shard, shard_dim

FREE_ROLE, SYNCED, GATHERED, SPLIT, SEQUENCE = "free", "synced", "gathered", "split", "sequence"
WHOLE = "whole"   # synced on a tensor axis: a Replicate() parameter whose gradient torch's styles make whole
DATA, ZERO3, TENSOR = "data", "zero3", "tensor"
COLWISE, ROWWISE, VOCAB, REPLICATE_STYLE, SEQUENCE_STYLE = "colwise", "rowwise", "vocab", "replicate", "sequence"
PREPARE_STYLE = "prepare"   # PrepareModuleInput: a module's input converted once (gathered along the sequence, or
#                             made a Replicate() DTensor) for the column-parallel projections in it
SEQ_DIM = 1   # the sequence dim of a [batch, seq, hidden] activation: SequenceParallel's and Shard(1)'s
LAYOUTS = {"replicate": "Replicate()", "shard": "Shard(-1)", "sequence": "Shard(1)", "loss": "Shard(-1)"}
# "loss": a column-parallel head's logits left split along the vocabulary as a DTensor for the module's
# cross-entropy, which runs as loss parallelism on them (`Lowering.loss_parallel`, `loss_parallel.py`)
LINEAR, EMBEDDING = "linear", "embedding"
CONV1D = "conv1d"   # transformers' Conv1D (GPT-2): weight [in, out], y = x @ W + b; its styles are `apply`'s own
PROJECTIONS = frozenset({LINEAR, CONV1D})
LINEAR_OPS = frozenset({"linear", "linear_nobias", "linear_t", "linear_nobias_t", "matmul"})
EMBEDDING_OPS = frozenset({"embedding", "embedding_padded"})
GATHERS = frozenset({COMBINE, ALL_GATHER, REDUCE, REDUCE_SCATTER})
REWRITE_NOTE = "the plan computes otherwise than the module's graph"   # `note_rewrites`' note begins so


class LoweringError(ValueError):
    """A plan that torch's distributed stack cannot run as the plan says: the message names the node and why."""


class OwnForwardCannot(LoweringError):
    """A plan that the module's own forward cannot run under torch's pieces but a forward evaluating the plan's
    graph can (`lower(evaluated=True)`, `rewritten.lowered_plan`): the message says what the own forward lacks."""


class UnstyledAxis(OwnForwardCannot):
    """A plan whose tensor axis torch's styles cannot run on the module's own forward (an activation moved where no
    styled module moves it: HF LLaMA under tp 4 with 2 KV heads slices the heads `repeat_kv` makes), which a
    forward evaluating the plan's graph on DTensors runs (`lower(evaluated=True)`, `rewritten.lowered_plan`)."""


class UncheckpointedBlocks(OwnForwardCannot):
    """A plan recomputing blocks that the module holds in no submodule per block (`recomputed_blocks`: a plan
    file's graph as one module, `run.GraphModule`), so nothing of its own forward can be checkpointed; a forward
    evaluating the plan's graph checkpoints the plan's blocks' steps (`rewritten.Recomputed`)."""


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the module: every name it has (a tied parameter has several), its shape, and for each
    name the module that holds it and that module's kind (`linear`, `embedding`, or its class name)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    owners: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ModuleInfo:
    """What the lowering needs of an `nn.Module`: its parameters by every name, each submodule's kind, the
    parameters each holds itself, and the submodules that hold parameters below them."""

    params: Mapping[str, ParamInfo]
    kinds: Mapping[str, str]
    holds: Mapping[str, tuple[str, ...]]       # module -> its own parameters' local names (`recurse=False`)
    has_param_below: frozenset[str] = frozenset()  # modules some strict descendant of which holds a parameter

    def param(self, name: str) -> ParamInfo | None:
        return self.params.get(name)


@dataclass(frozen=True)
class WeightLowering:
    """A graph weight as the plan keeps it: the module's names for it, its stored placement, its leaf node, and
    per mesh axis its role (`free`, `synced`, `gathered`, `split`). `restored`: the axes on which torch stores it
    otherwise than the plan (`stored` then says torch's: a tied table the plan keeps whole, read whole by its
    embedding and vocabulary-split by its head, stored vocabulary-split for both, as Megatron does)."""

    name: str
    params: tuple[str, ...]
    node: int
    stored: Placement
    roles: tuple[str, ...]
    restored: tuple[int, ...] = ()

    def stored_dim(self, axis: int) -> int | None:
        return shard_dim(self.stored.codes[axis]) if self.stored.codes else None


@dataclass(frozen=True)
class Style:
    """How one module runs on the tensor axis: `colwise`, `rowwise`, `vocab` (RowwiseParallel of an
    embedding), `sequence` (SequenceParallel: a norm on a slice of the sequence, its parameters whole),
    `replicate` (every parameter whole) or `prepare` (PrepareModuleInput: a parameter-free parent, an
    attention or an MLP, whose input torch gathers along the sequence once for the column-parallel projections
    in it, as torchtitan's models do); how its activation arrives and leaves (`replicate`: whole, `shard`: split
    along the last dim, `sequence`: split along the sequence, Shard(1)); the plan nodes it stands for (the
    contraction and the parallel operators it claims). `conv1d`: the module is transformers' `Conv1D`, whose
    weight is [in, out] (column-parallel splits its dim 1, row-parallel its dim 0), run by `apply`'s Conv1D
    styles with the same layouts as torch's."""

    module: str
    kind: str
    input_layout: str = "replicate"
    output_layout: str = "replicate"
    nodes: tuple[int, ...] = ()
    conv1d: bool = False

    def describe(self) -> str:
        torch_name = {COLWISE: "ColwiseParallel", ROWWISE: "RowwiseParallel", VOCAB: "RowwiseParallel",
                      REPLICATE_STYLE: "Replicate()", SEQUENCE_STYLE: "SequenceParallel",
                      PREPARE_STYLE: "PrepareModuleInput"}[self.kind]
        extra = []
        if self.kind in (COLWISE, ROWWISE, VOCAB):
            if self.input_layout != ("shard" if self.kind == ROWWISE else "replicate"):
                extra.append(f"input_layouts={LAYOUTS[self.input_layout]}")
            if self.output_layout != ("shard" if self.kind == COLWISE else "replicate"):
                extra.append(f"output_layouts={LAYOUTS[self.output_layout]}")
            if self.output_layout == "loss":
                extra.append("use_local_output=False")
        nodes = f" (nodes {', '.join(f'#{n}' for n in self.nodes)})" if self.nodes else ""
        if self.conv1d:
            torch_name = "Conv1D" + torch_name   # apply.conv1d_style: weight Shard(1) / Shard(0), as Conv1D stores it
        if self.kind == REPLICATE_STYLE:
            return f"{self.module or '<root>'}: distribute_module, every parameter Replicate()"
        if self.kind == PREPARE_STYLE:
            return (f"{self.module}: PrepareModuleInput(its first input: input_layouts="
                    f"{LAYOUTS[self.input_layout]}, desired_input_layouts=Replicate(), use_local_output=False){nodes}")
        return f"{self.module or '<root>'}: {torch_name}({', '.join(extra)}){nodes}"


@dataclass(frozen=True)
class TracedSplit:
    """A weight split on the tensor axis of a traced stage module: its parameter names, the dim it is stored
    split along (its DTensor's `Shard(dim)`), what its reads make of it in Megatron's words (`column-parallel`: the
    output split along its last dim; `row-parallel`: a partial sum; `vocabulary-parallel`: an embedding's partial
    sum), and those reading nodes."""

    weight: str
    params: tuple[str, ...]
    dim: int
    kind: str
    nodes: tuple[int, ...]

    def describe(self) -> str:
        nodes = ", ".join(f"#{n}" for n in self.nodes)
        return f"{' = '.join(self.params)}: Shard({self.dim}), {self.kind} (nodes {nodes})"


@dataclass(frozen=True)
class Lowering:
    """A plan in torch's terms (module docstring)."""

    mesh: Mesh
    axis_roles: tuple[str, ...]
    weights: tuple[WeightLowering, ...]
    styles: tuple[Style, ...]
    batch_axes: tuple[int, ...]
    zero: int = 0                      # the plan's ZeRO stage of replicated weights' state (1, 2), else 0
    notes: tuple[str, ...] = field(default=())
    recompute: tuple[str, ...] = ()    # the block modules checkpointed (`recomputed_blocks`)
    traced_splits: tuple[TracedSplit, ...] = ()   # a traced module's split weights (`lower(traced=True)`)
    rewritten: str = ""                # how the module's forward computes the plan's graph (`rewritten.Rewrite`)
    unrecomputable: str = ""           # why the module's blocks cannot be checkpointed (a rewritten forward can)
    # the graph's cross-entropies (their nll_sum nodes) computed split along the vocabulary on the tensor axis: the
    # module's F.cross_entropy runs as loss parallelism on the head's Shard(-1) logits (`_Lowerer.vocabulary_losses`)
    loss_parallel: tuple[str, ...] = ()

    def axes(self, role: str) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.axis_roles) if r == role)

    @property
    def tensor_axis(self) -> int | None:
        found = self.axes(TENSOR)
        return found[0] if found else None

    def weight(self, name: str) -> WeightLowering:
        for w in self.weights:
            if name == w.name or name in w.params:
                return w
        raise KeyError(name)

    def describe(self) -> str:
        """The lowering as text: axes, styles, data parallelism, notes."""
        lines = ["mesh: " + " x ".join(f"{a.name} {a.size} ({role})" for a, role in
                                       zip(self.mesh.axes, self.axis_roles))]
        data, zero3 = self.axes(DATA), self.axes(ZERO3)
        names = self.mesh.names
        if zero3 or (data and self.zero >= 2):
            how = (f"fully_shard over {', '.join(names[a] for a in zero3)}" if zero3 else "")
            if data and zero3:
                how += f", replicated over {', '.join(names[a] for a in data)} (HSDP)"
            if data and not zero3:
                how = (f"fully_shard over {', '.join(names[a] for a in data)} with reshard_after_forward=False "
                       f"(the plan's ZeRO-{self.zero}: gradients reduce-scattered, state sharded)")
            lines.append("data parallelism: " + how)
        elif data:
            lines.append(f"data parallelism: replicate over {', '.join(names[a] for a in data)}"
                         + (" (the plan's ZeRO-1: gradients all-reduced whole; build the optimizer with "
                            "zero.zero_optimizer(model, torch.optim.AdamW, ...), which shards its state over "
                            "them; a plain optimizer keeps all of it)" if self.zero == 1 else ""))
        if self.traced_splits:
            lines.append(f"tensor parallelism on {names[self.tensor_axis]}: DTensor parameters (the split ones below, "
                         "every other Replicate()), the traced operators run on DTensors")
            lines += ["  " + s.describe() for s in self.traced_splits]
        elif self.tensor_axis is not None and self.rewritten:
            lines.append(f"tensor parallelism on {names[self.tensor_axis]}: every parameter a DTensor placed as the "
                         "plan stores its weight, the forward's values DTensors redistributed at the plan's parallel "
                         "operators (below)")
        elif self.tensor_axis is not None:
            lines.append(f"tensor parallelism on {names[self.tensor_axis]}: parallelize_module")
            lines += ["  " + s.describe() for s in self.styles]
        if self.loss_parallel:
            lines.append(f"loss on {names[self.tensor_axis]}: the module's F.cross_entropy on the Shard(-1) logits runs "
                         "as loss parallelism (torch.distributed.tensor.parallel.loss_parallel, forward and backward), "
                         f"the logits never gathered ({', '.join(self.loss_parallel)})")
        if self.recompute:
            lines.append(f"recomputation: torch.utils.checkpoint around each block's forward "
                         f"({', '.join(self.recompute)})")
        if self.rewritten:
            lines.append("forward: " + self.rewritten)
        lines += ["note: " + n for n in self.notes]
        return "\n".join(lines)


# ------------------------------------------------------------------ the analysis


def lower(pcg: PCG, graph: Graph, module: ModuleInfo, *, pipelined: bool = False, library=None,
          traced: bool = False, evaluated: bool = False) -> Lowering:
    """The plan `pcg` (of `graph`) on `module` in torch's terms; raises LoweringError naming what cannot be
    (`UnstyledAxis` where only the styles of its tensor axis cannot). `traced`: the module runs as traced aten
    graphs (a pipeline's stage modules, which call no `nn.Linear`), so a tensor axis is lowered as each weight's
    DTensor placement (`TracedSplit`), the activations DTensors too, instead of `parallelize_module` styles.
    `evaluated`: the module's forward will evaluate the plan's graph on DTensors (`rewritten`), every parallel
    operator on the tensor axis a redistribute, so no style is looked for there."""
    if pipelined:
        raise LoweringError("a pipelined plan is lowered stage by stage (pipeline_lowering.lower_pipeline: "
                            "torch.distributed.pipelining), not as one mesh's plan")
    if pcg.mesh.world < 2:
        raise LoweringError("the plan is for one device: run the module itself")
    moved = next((n for n in pcg.nodes if n.kind == "parallel" and n.op == ALL_TO_ALL), None)
    if moved is not None:
        raise LoweringError(f"node #{moved.id} is an all_to_all (a shard moved between dims: expert parallelism's "
                            "dispatch or context-parallel attention's Ulysses exchange), "
                            "which the torch-native runtime does not lower; run the plan with the interpreter "
                            "(runtime='interpreter', `parsat run`)")
    ring = next((n for n in pcg.nodes if n.kind == "op" and n.op in ("attention_masked", "causal_mask", "zigzag",
                                                                      "unzigzag")), None)
    if ring is not None:
        raise LoweringError(f"node #{ring.id} is {ring.op}: the causal ring's query blocks under their rows of the "
                            "causal mask (context parallelism of causal attention, attention_causal_query_parallel; "
                            "in zigzag order, attention_causal_zigzag_query_parallel), "
                            "which the torch-native runtime does not lower; run the plan with the interpreter "
                            "(runtime='interpreter', `parsat run`)")
    lowering = _Lowerer(pcg, graph, module, library, traced, evaluated).run()
    try:
        return replace(lowering, recompute=recomputed_blocks(pcg, module))
    except LoweringError as err:   # a rewritten forward checkpoints the plan's blocks, not the module's
        if traced:
            raise
        if not (evaluated or rewritten_nodes(pcg, graph)):
            raise UncheckpointedBlocks(str(err)) from None
        return replace(lowering, unrecomputable=str(err))


class _Lowerer:
    def __init__(self, pcg: PCG, graph: Graph, module: ModuleInfo, library, traced: bool = False,
                 evaluated: bool = False):
        self.pcg, self.graph, self.module = pcg, graph, module
        self.traced, self.evaluated = traced, evaluated
        self.mesh = pcg.mesh
        self.users = readers(pcg)
        self.static = weight_values(pcg)
        self.inputs = _input_chains(pcg)
        self.data_only = _data_only(pcg)
        self.library = library
        self.batch_constants = _batch_wide_constants(pcg, graph, library)
        self.constant_rows = _computed_from(pcg, lambda leaf: leaf.role == "weight" or leaf.id in
                                            self.batch_constants) - self.static
        # values made from weights and the import's constants alone (no batch data): every rank's forward makes them
        self.constant_made = _computed_from(pcg, lambda leaf: leaf.role == "weight" or leaf.op in graph.constants)
        self.notes: list[str] = []
        self.partial_region: set[int] = set()   # partial sums the row-parallel styles' outputs are computed into
        self.sequence_reduces: set[int] = set()  # reduces on the tensor axis torch makes Shard(1) (`sequence_split`)
        self.region_layout: dict[int, str] = {}   # partial-region node -> how its region leaves (`reduced_output`)
        self.loss_nodes: set[int] = set()    # a vocabulary-parallel cross-entropy's operators (`vocabulary_losses`)
        self.loss_claims: set[int] = set()   # ... and the parallel operators on the tensor axis around them
        self.loss_inputs: set[int] = set()   # the logits a column-parallel style leaves split for it (`feeds_loss`)
        self.losses: list[str] = []          # the graph's cross-entropies so computed (their nll_sum nodes)

    def node(self, ident: int) -> PNode:
        return self.pcg.node(ident)

    def where(self, node: PNode) -> str:
        """A node as the refusals name it: `#id op(attrs)` and the graph node it computes."""
        origin = f" [{node.origin}]" if node.origin else ""
        return f"node #{node.id} {node.label}{origin}"

    # ------------------------------------------------------------ weights

    def run(self) -> Lowering:
        weights = self.synced_beside_split(
            [self.weight(leaf) for leaf in self.pcg.nodes if leaf.kind == "leaf" and leaf.role == "weight"])
        roles = tuple(self.axis_role(a, weights) for a in range(len(self.mesh.axes)))
        tensor = [a for a, r in enumerate(roles) if r == TENSOR]
        if len(tensor) > 1:
            raise LoweringError(f"the plan splits weights on {len(tensor)} mesh axes "
                                f"({', '.join(self.mesh.names[a] for a in tensor)}): tensor parallelism over two "
                                "axes is not lowered (torch's styles take one tensor-parallel mesh)")
        batch_axes = self.check_inputs(roles)
        self.check_data_collectives(roles)
        styles: list[Style] = []
        splits: tuple[TracedSplit, ...] = ()
        if tensor and self.traced:
            splits = self.traced_splits(tensor[0], weights)
            self.vocabulary_losses(tensor[0])   # the traced stage's cross-entropy run as loss parallelism too
        elif tensor and not self.evaluated:
            try:
                styles = self.tensor_styles(tensor[0], weights)
            except LoweringError as err:
                raise UnstyledAxis(str(err)) from None
        self.note_rewrites()
        zero = self.pcg.zero
        if zero and not any(r == DATA for r in roles):
            zero = 0
        if self.graph.microbatches > 1:
            self.notes.append(f"the plan runs {self.graph.microbatches} micro-batches a step: the training loop calls "
                              "the module once per micro-batch and accumulates (each loss divided by their number); "
                              "torch synchronises gradients in every backward unless the loop turns it off "
                              "(FSDPModule.set_requires_gradient_sync(False) for all but the last)")
        notes = tuple(dict.fromkeys(self.notes))   # once each: a weight and its bias may note one node twice
        return Lowering(self.mesh, roles, tuple(weights), tuple(styles), batch_axes, zero, notes,
                        traced_splits=splits, loss_parallel=tuple(self.losses))

    def weight(self, leaf: PNode) -> WeightLowering:
        info = self.module.param(leaf.op)
        shape = tuple(leaf.shape)
        if info is None:
            raise LoweringError(f"the plan's weight '{leaf.op}' {list(shape)} is not a parameter of the module: "
                                "parallelize the module the plan was made for"
                                + (" (the importer named its stack of identical blocks b{i}_...: give parallelize "
                                   "example_inputs, and the import maps them to the module's names)"
                                   if has_blocks([leaf.op]) else ""))
        if tuple(info.shape) != shape:
            raise LoweringError(f"the plan's weight '{leaf.op}' has shape {list(shape)}, the module's "
                                f"{list(info.shape)}: parallelize the module the plan was made for")
        chain = weight_storage(self.pcg)[leaf.id]
        views = storage_views(self.pcg, chain)
        if views and not self.evaluated:
            why = (f"weight '{leaf.op}' is stored as a block of its view ({', '.join(v.op for v in views)}): each "
                   "rank's piece is a strided block of the parameter (Megatron-LM's head-ordered fused projection, "
                   "torch's `_StridedShard`), which no torch style stores")
            raise LoweringError(why) if self.traced else UnstyledAxis(why)
        stored = self.node(chain[-1]).placement
        uses = list(self.uses(chain[-1]))
        roles, restored = [], []
        for axis in range(len(self.mesh.axes)):
            if stored.codes[axis] == FREE and self.vocabulary_split_table(chain[-1], uses, axis):
                roles.append(SPLIT)
                restored.append(axis)
            else:
                roles.append(self.weight_role(leaf, stored, uses, axis))
        if restored:
            stored = Placement(tuple(shard(0) if a in restored else c for a, c in enumerate(stored.codes)))
            self.note_restored(leaf, uses, restored)
        if views:   # the view's dims as the parameter's (its strided dim held head-major: `head_major`)
            try:
                stored = weight_placement(self.pcg, chain)[0]
            except ValueError as err:
                raise LoweringError(str(err)) from None
        return WeightLowering(leaf.op, info.names, leaf.id, stored, tuple(roles), tuple(restored))

    def vocabulary_split_table(self, end: int, uses: list[tuple[PNode, PNode]], axis: int) -> bool:
        """Whether the weight whose storage ends at `end`, whole on `axis`, is a table torch stores split along the
        vocabulary there (`WeightLowering.restored`): every read an embedding's lookup of the whole table (its
        output whole) or a read split along the vocabulary (a `partition` of dim 0 of the stored value) by an
        embedding or a projection, and some read split. Two such tables: a tied one read whole by its embedding and
        split by its head (Megatron's VocabParallelEmbedding beside its tied head: no torch style keeps one
        parameter whole for one module and split for another), and one read only split, by vocabulary-parallel
        lookups (their outputs partial sums: Megatron's VocabParallelEmbedding, torchtitan's RowwiseParallel on the
        embedding), where a whole table read only in slices is no torch style either. Both compute the plan's
        values; the memory and collectives they differ in are noted (`note_restored`). Parallel operators on other
        axes between the two (a data axis's `replicate` or ZeRO-3 `all_gather`) are looked through."""
        whole = split = split_lookups = 0
        for user, value in uses:
            ops = self.ops_on_axis(value, end, axis)
            sliced = ops is not None and len(ops) == 1 and ops[0].op == PARTITION and ops[0].attr("dim") == 0
            if ops == [] and user.op in EMBEDDING_OPS and user.placement.codes[axis] in (FREE, REPLICA):
                whole += 1
            elif sliced and user.op in LINEAR_OPS:
                split += 1
            elif sliced and user.op in EMBEDDING_OPS and user.placement.codes[axis] == PARTIAL:
                split_lookups += 1
            else:
                return False
        return (whole > 0 and split > 0) or (split_lookups > 0 and whole == 0)

    def ops_on_axis(self, value: PNode, start: int, axis: int) -> list[PNode] | None:
        """The parallel operators on mesh axis `axis` that make `value` from node `start`, in order, those on other
        axes looked through; None where `value` is not made from `start` by parallel operators alone."""
        ops = []
        while value.id != start:
            if value.kind != "parallel":
                return None
            if value.axis(self.mesh) == axis:
                ops.append(value)
            value = self.node(value.inputs[0])
        return ops[::-1]

    def note_restored(self, leaf: PNode, uses: list[tuple[PNode, PNode]], axes: Sequence[int]) -> None:
        """Say where torch's collectives and memory differ from the plan's for a table stored vocabulary-split: the
        plan prices the whole table, its gradient and optimizer state on each rank of the axis (`cost.model`'s
        `_parallel_memory`: a weight's state where it is stored) and an all-gather of the split read's gradient in
        the backward (the `partition`'s); torch holds 1/degree of each and gathers no gradient."""
        for axis in axes:
            name, size = self.mesh.names[axis], self.mesh.axes[axis].size
            lookups = [user for user, _ in uses if user.op in EMBEDDING_OPS and user.placement.codes[axis] != PARTIAL]
            slices = sorted({value.id for user, value in uses if user not in lookups})
            held = (f"where the plan keeps the table whole on every rank of {name} (its gradient and optimizer state "
                    "too) and "
                    f"all-gathers the split read's gradient {list(leaf.shape)} in the backward, torch keeps "
                    f"1/{size} of each")
            if not lookups:   # read only split: the lookups' partial sums are the plan's own
                self.notes.append(
                    f"weight '{leaf.op}' {list(leaf.shape)} is stored whole on tensor axis {name} by the plan and read "
                    f"only split along the vocabulary (by {', '.join(f'#{i}' for i in slices)}): torch stores it "
                    "Shard(0), the embedding vocabulary-parallel (RowwiseParallel): the same values and the same "
                    f"forward all-reduce of the lookup's partial sums, but {held} and gathers no gradient")
                continue
            self.notes.append(
                f"weight '{leaf.op}' {list(leaf.shape)} is stored whole on tensor axis {name} by the plan, read whole "
                f"by {', '.join(self.where(u) for u in lookups)} and split along the vocabulary by "
                f"{', '.join(f'#{i}' for i in slices)}: torch stores it Shard(0) for both reads (one parameter, one "
                f"placement), the embedding vocabulary-parallel (RowwiseParallel): the same values, but {held} and "
                f"all-reduces the embedding's output {list(lookups[0].shape)} in the forward")

    def uses(self, start: int) -> Iterable[tuple[PNode, PNode]]:
        """(reader, value read) for every operator that reads a value made from the weight at `start` by parallel
        operators and computations on weights alone, where the reader also reads an activation or an input."""
        seen, todo = {start}, [start]
        while todo:
            current = todo.pop()
            for user in self.users.get(current, []):
                if user.id in self.static:
                    if user.id not in seen:
                        seen.add(user.id)
                        todo.append(user.id)
                else:
                    yield user, self.node(current)

    def weight_role(self, leaf: PNode, stored: Placement, uses: list[tuple[PNode, PNode]], axis: int) -> str:
        name = self.mesh.names[axis]
        s = stored.codes[axis]
        used = [(user, value, value.placement.codes[axis]) for user, value in uses]
        if s == FREE:
            if all(code == FREE for *_, code in used):
                return FREE_ROLE
            for user, value, code in used:
                if code not in (FREE, REPLICA):
                    raise LoweringError(
                        f"weight '{leaf.op}' is stored whole on mesh axis {name} but {self.where(user)} reads it "
                        f"as {code_text(code)} there ({self.where(value)}): a slice of a whole weight taken where it "
                        "is read is no torch style (store it split: ColwiseParallel / RowwiseParallel)")
            if all(code == REPLICA and len(user.shape) == 3 and user.placement.codes[axis] == shard(SEQ_DIM)
                   for user, _, code in used):
                return SEQUENCE   # read whole beside a slice of the sequence: a norm's weight under SequenceParallel
            return SYNCED
        if shard_dim(s) is not None:
            if all(code in (FREE, REPLICA) for *_, code in used):
                return GATHERED
            if all(shard_dim(code) is not None for *_, code in used):
                return SPLIT
            gathered = next(user for user, _, code in used if code in (FREE, REPLICA))
            split = next(user for user, _, code in used if shard_dim(code) is not None)
            raise LoweringError(f"weight '{leaf.op}' is stored split on mesh axis {name}, read split by "
                                f"{self.where(split)} and gathered for {self.where(gathered)}: one weight that is "
                                "both tensor-parallel and ZeRO-3 on one axis is no torch style")
        raise LoweringError(f"weight '{leaf.op}' is stored as {code_text(s)} on mesh axis {name}")

    def synced_beside_split(self, weights: list[WeightLowering]) -> list[WeightLowering]:
        """On an axis that splits some weight, a weight the plan reads as a `replicate`'s copy (`synced`: HF
        LLaMA's final norm beside its column-parallel `lm_head`, the plan all-reducing the norm's partial
        gradient) is `whole` there: a `Replicate()` DTensor, as torchtitan keeps norm weights beside a
        column-parallel head. torch computes the same gradient on every rank without synchronising it: outside
        the styled modules every activation's gradient is already whole (a column-parallel input's
        `from_local(Replicate())` all-reduces it in the backward; in a traced stage DTensor's propagation does),
        so the weight's gradient, made from whole values, is whole too. The collectives differ (a note says
        how); the values do not."""
        out = list(weights)
        for axis in range(len(self.mesh.axes)):
            if not any(w.roles[axis] == SPLIT for w in out):
                continue
            for i, w in enumerate(out):
                if w.roles[axis] != SYNCED:
                    continue
                out[i] = replace(w, roles=w.roles[:axis] + (WHOLE,) + w.roles[axis + 1:])
                self.notes.append(
                    f"weight '{w.name}' is read whole beside split weights on tensor axis {self.mesh.names[axis]}, "
                    f"its gradient all-reduced there by the plan "
                    f"({self.where(self.first_collective(w, axis))}): torch keeps it a Replicate() DTensor whose "
                    "gradient every rank computes whole, the activations' gradients all-reduced where the "
                    "tensor-parallel styles (or a traced stage's DTensors) take them whole; the same values, "
                    "the all-reduce moved from the weight's gradient to the activation's")
        return out

    def axis_role(self, axis: int, weights: Sequence[WeightLowering]) -> str:
        name = self.mesh.names[axis]
        by_role: dict[str, list[WeightLowering]] = {}
        for w in weights:
            by_role.setdefault(w.roles[axis], []).append(w)
        if SEQUENCE in by_role and SPLIT not in by_role:
            raise LoweringError(
                f"weight '{by_role[SEQUENCE][0].name}' is read whole beside a slice of the sequence on mesh axis "
                f"{name} ({self.where(self.first_collective(by_role[SEQUENCE][0], axis))}): sequence parallelism is "
                "lowered beside tensor parallelism (SequenceParallel styles, or a traced stage's Replicate() "
                "weights); this axis splits no weight")
        if SPLIT in by_role:
            for other, what in ((SYNCED, "synchronises the gradient of"), (GATHERED, "gathers before use")):
                if other in by_role:
                    raise LoweringError(
                        f"mesh axis {name} splits '{by_role[SPLIT][0].name}' (tensor parallelism) and {what} "
                        f"'{by_role[other][0].name}' ({self.where(self.first_collective(by_role[other][0], axis))}): "
                        "an axis that is a tensor axis for some layers and a data axis for others is not lowered "
                        "(torch gives each mesh axis one role)")
            return TENSOR
        if GATHERED in by_role:
            return ZERO3
        if SYNCED in by_role:
            return DATA
        raise LoweringError(f"on mesh axis {name} every rank does the same work (no weight is split or synchronised "
                            "there): nothing of torch's stack runs such an axis; optimize for fewer devices or pin "
                            "the parallelism (--degrees dp=... or tp=...)")

    def first_collective(self, weight: WeightLowering, axis: int) -> PNode:
        """The first parallel operator acting on `axis` that a weight's values pass through (for messages)."""
        seen, todo = {weight.node}, [weight.node]
        while todo:
            current = todo.pop(0)
            for user in self.users.get(current, []):
                if user.kind == "parallel" and user.axis(self.mesh) == axis and user.op != PARTITION:
                    return user
                if user.id in self.static and user.id not in seen:
                    seen.add(user.id)
                    todo.append(user.id)
        return self.node(weight.node)

    # ------------------------------------------------------------ inputs and data axes

    def check_inputs(self, roles: Sequence[str]) -> tuple[int, ...]:
        """Every input that carries a batch is read split along it on every data axis (in one axis order, which
        is returned), and read whole on the tensor axis unless a style claims its split (checked there)."""
        data_axes = [a for a, r in enumerate(roles) if r in (DATA, ZERO3)]
        batch = batch_dims(self.graph, self.library)
        orders = set()
        for leaf in self.pcg.nodes:
            if leaf.kind != "leaf" or leaf.role == "weight":
                continue
            dim = batch.get(leaf.op)
            for user, value in self.input_uses(leaf):
                for a in data_axes:
                    code = value.placement.codes[a]
                    name = self.mesh.names[a]
                    if dim is not None and code == shard(dim):
                        continue
                    if dim is None and code == shard(0) and leaf.id in self.batch_constants:
                        continue   # the module's forward builds it for its local batch: the slice it reads
                    if code in (FREE, REPLICA) and (dim is None or leaf.shape[dim] == 1):
                        continue   # a table or a constant every rank reads whole
                    read = "whole" if code in (FREE, REPLICA) else f"as {code_text(code)}"
                    raise LoweringError(
                        f"input '{leaf.op}' is read {read} on data axis {name} by {self.where(user)}: each rank "
                        f"runs the module on its local batch, which the plan must split along the batch dim"
                        f"{f' ({dim})' if dim is not None else ''} on every data axis")
                if dim is not None and data_axes and value.placement.shard_axes(dim):
                    orders.add(value.placement.shard_axes(dim))
        if len(orders) > 1:
            raise LoweringError("the plan splits its inputs' batch over the data axes in different orders "
                                f"({sorted(orders)}): a rank's local batch would differ between inputs")
        order = orders.pop() if orders else tuple(data_axes)
        if sorted(order) != data_axes:
            raise LoweringError(f"the plan splits its inputs' batch over mesh axes {[self.mesh.names[a] for a in order]}"
                                f" but its data axes are {[self.mesh.names[a] for a in data_axes]}")
        return tuple(order)

    def input_uses(self, leaf: PNode) -> Iterable[tuple[PNode, PNode]]:
        """(reader, value read) for every compute operator reading the input or a piece of it."""
        todo = [leaf]
        while todo:
            current = todo.pop()
            for user in self.users.get(current.id, []):
                if user.kind == "parallel":
                    todo.append(user)
                else:
                    yield user, current

    def check_data_collectives(self, roles: Sequence[str]) -> None:
        """On a data axis, only the inputs' own splits and replicas, and collectives no weight-reading operator
        follows (the loss's reduce, an output gathered): the module computes everything else on its batch."""
        data_axes = {a for a, r in enumerate(roles) if r in (DATA, ZERO3)}
        for node in self.pcg.nodes:
            if node.kind != "parallel" or node.id in self.static or node.axis(self.mesh) not in data_axes:
                continue
            if node.id in self.inputs and node.op in (PARTITION, REPLICATE):
                continue
            if node.op == PARTITION and node.attr("dim") == 0 and node.inputs[0] in self.constant_rows:
                continue   # e.g. BERT's token-type embedding of its constant ids: each rank's forward computes its rows
            if node.op == REPLICATE and node.inputs[0] in self.constant_made:
                continue   # e.g. BERT's position embedding of its constant positions: every rank computes it whole
            axis = self.mesh.names[node.axis(self.mesh)]
            if node.op not in GATHERS:
                raise LoweringError(f"{self.where(node)} on data axis {axis}: each rank runs the module on its local "
                                    "batch, so activations are neither split nor replicated there")
            later = self.weight_reader_after(node)
            if later is not None:
                raise LoweringError(
                    f"{self.where(node)} on data axis {axis} is followed by {self.where(later)}, which reads a weight: "
                    "the plan combines the data-parallel ranks' activations mid-model (batch statistics?), which "
                    "the module's own forward computes on its local batch (torch.nn.SyncBatchNorm would)")
        loss_reduced = any(n.kind == "parallel" and n.op == REDUCE and n.id not in self.static
                           and n.axis(self.mesh) in data_axes for n in self.pcg.nodes)
        if loss_reduced:
            self.notes.append("each rank's forward returns its local batch's loss, and the data-parallel gradient is "
                              "the ranks' mean: the plan's global loss and gradient when every rank's loss averages "
                              "as many items (equal local batches, no ignored targets); average the ranks' losses "
                              "to log the global one")

    def weight_reader_after(self, start: PNode) -> PNode | None:
        seen, todo = {start.id}, [start.id]
        while todo:
            current = todo.pop()
            for user in self.users.get(current, []):
                if user.kind == "op" and any(i in self.static for i in user.inputs):
                    return user
                if user.id not in seen:
                    seen.add(user.id)
                    todo.append(user.id)
        return None

    # ------------------------------------------------------------ the tensor axis

    def tensor_styles(self, axis: int, weights: Sequence[WeightLowering]) -> list[Style]:
        name = self.mesh.names[axis]
        styles: dict[str, Style] = {}
        claimed: set[int] = set()
        self.sequence_reduces = self.sequence_split(axis)
        self.vocabulary_losses(axis)
        claimed |= self.loss_claims
        for w in weights:
            if w.roles[axis] != SPLIT:
                continue
            for user, value in self.uses(w.node):
                style = self.contraction_style(w, user, axis)
                previous = styles.get(style.module)
                if previous is not None and (previous.kind, previous.input_layout, previous.output_layout) != \
                        (style.kind, style.input_layout, style.output_layout):
                    raise LoweringError(f"module {style.module} is read two ways on tensor axis {name} "
                                        f"({previous.describe()}; {style.describe()})")
                if previous is not None:
                    style = replace(style, nodes=tuple(sorted(set(previous.nodes) | set(style.nodes))))
                styles[style.module] = style
                claimed.update(style.nodes)
        self.sequence_inputs(styles, axis)
        styles.update(self.gathered_inputs(styles, axis))
        self.check_style_params(styles, weights, axis)
        self.check_loss_inputs(axis)
        self.check_partials(axis)
        for node in self.pcg.nodes:
            if node.kind == "parallel" and node.op == REPLICATE and node.inputs[0] in self.data_only:
                continue   # a copy of what the inputs alone make (a rotary table): no gradient for its backward to sum
            if node.kind == "parallel" and node.op == PARTITION and node.axis(self.mesh) == axis \
                    and self.chain_source(node.inputs[0]).op in self.graph.constants:
                self.note_constant_slice(node, axis)
                continue
            if node.kind == "parallel" and node.axis(self.mesh) == axis and node.id not in self.static \
                    and node.id not in claimed:
                dropout = any(u.op.startswith("dropout") for u in self.users.get(node.id, []))
                raise LoweringError(
                    f"{self.where(node)} on tensor axis {name} is not at the input or output of a split nn.Linear or "
                    "nn.Embedding: the module's own code runs between torch's tensor-parallel styles on local pieces, "
                    "and only the styles move activations (a vocabulary-parallel loss is lowered as the module's "
                    "F.cross_entropy on a column-parallel head's logits only, as loss parallelism; sequence "
                    "parallelism as a reduce_scatter / all_gather along dim 1 at a styled projection only)"
                    + ("; it splits a dropout mask, which the module draws itself on each rank: train with dropout "
                       "off, or run the plan with the interpreter" if dropout else ""))
        replicated = self.replicated_modules(styles, weights, axis)
        return sorted(styles.values(), key=lambda s: s.module) + replicated

    def traced_splits(self, axis: int, weights: Sequence[WeightLowering]) -> tuple[TracedSplit, ...]:
        """A traced module's tensor axis: each split weight becomes a `Shard(dim)` DTensor (the dim it is stored
        split along) and every other parameter a `Replicate()` one; the traced operators then run on DTensors,
        whose sharding propagation computes each global value, so no style has to claim the plan's
        collectives. Each split weight's reads are named as Megatron would (`TracedSplit`)."""
        out = []
        for w in weights:
            if w.roles[axis] != SPLIT:
                continue
            kinds, nodes = set(), []
            for user, _value in self.uses(w.node):
                code = user.placement.codes[axis]
                kinds.add("column-parallel" if code == shard(len(user.shape) - 1) else
                          "vocabulary-parallel" if user.op in EMBEDDING_OPS and (code == PARTIAL or axis in w.restored)
                          else
                          "row-parallel" if code == PARTIAL else f"read as {code_text(code)}")
                nodes.append(user.id)
            out.append(TracedSplit(w.name, w.params, w.stored_dim(axis), " and ".join(sorted(kinds)),
                                   tuple(sorted(nodes))))
        return tuple(out)

    def contraction_style(self, w: WeightLowering, user: PNode, axis: int) -> Style:
        """The style of the module whose weight `w` the contraction `user` reads, and the nodes it claims."""
        axis_name = self.mesh.names[axis]
        dim = w.stored_dim(axis)
        owner, kind = self.owner_for(w, user)
        if kind == LINEAR and user.op in LINEAR_OPS:
            style = COLWISE if dim == 0 else ROWWISE if dim == 1 else None
        elif kind == CONV1D and user.op in LINEAR_OPS:   # weight [in, out]: its output features are dim 1
            bias = any(name == f"{owner}.bias" for name in w.params)   # [out]: split only column-parallel
            style = (COLWISE if dim == 0 else None) if bias else COLWISE if dim == 1 else ROWWISE if dim == 0 else None
        elif kind == EMBEDDING and user.op in EMBEDDING_OPS:
            style = VOCAB if dim == 0 else COLWISE if dim == 1 else None
        else:
            raise LoweringError(
                f"weight '{w.name}' (of {owner or '<root>'}, a {kind}) is split on tensor axis {axis_name} and read "
                f"by {self.where(user)}: torch's tensor-parallel styles split nn.Linear and nn.Embedding weights "
                "(and transformers' Conv1D) read by their own linear or embedding")
        if style is None:
            raise LoweringError(f"weight '{w.name}' is split along dim {dim} on tensor axis {axis_name}")
        activations = [i for i in user.inputs if i not in self.static]
        if len(activations) != 1:
            raise LoweringError(f"{self.where(user)} reads {len(activations)} activations beside its split weight "
                                f"'{w.name}'")
        x = self.node(activations[0])
        x_code, out_code = x.placement.codes[axis], user.placement.codes[axis]
        if axis in w.restored and style == VOCAB and out_code != PARTIAL:   # the whole lookup of a table torch
            # stores vocabulary-split (a tied one); a split lookup of it is the plain vocabulary-parallel one below
            if x_code not in (FREE, REPLICA) or out_code not in (FREE, REPLICA):
                raise LoweringError(f"{self.where(user)} reads the tied table '{w.name}' whole on tensor axis "
                                    f"{axis_name} but its ids as {code_text(x_code)}")
            return Style(owner, VOCAB, "replicate", "replicate", (user.id,))
        last_in, last_out = len(x.shape) - 1, len(user.shape) - 1
        claims = [user.id]
        want = {COLWISE: ("whole", f"split along its last dim (Shard({last_out}))"),
                ROWWISE: (f"split along its last dim (Shard({last_in}))", "a partial sum"),
                VOCAB: (f"the ids split along the vocabulary (Shard({last_in}))", "a partial sum")}[style]
        ok_in = x_code in (FREE, REPLICA) if style == COLWISE else x_code == shard(last_in)
        ok_out = out_code == shard(last_out) if style == COLWISE else out_code == PARTIAL
        if not (ok_in and ok_out):
            torch_style = "ColwiseParallel" if style == COLWISE else "RowwiseParallel"
            raise LoweringError(
                f"{self.where(user)} (module {owner}) reads {self.where(x)} as {code_text(x_code)} and makes "
                f"{code_text(out_code)} on tensor axis {axis_name}; its weight's split makes it {torch_style}, "
                f"which reads {want[0]} and makes {want[1]}")
        input_layout = "replicate" if style in (COLWISE, VOCAB) else "shard"
        if x.kind == "parallel" and x.axis(self.mesh) == axis:
            if style == COLWISE and x.op == REPLICATE:
                claims.append(x.id)   # its input layout: `sequence_inputs`, once every region is read
            elif style == COLWISE and self.is_sequence_op(x, ALL_GATHER, axis):
                claims.append(x.id)
                input_layout = "sequence"
                other = next((u for u in self.users.get(x.id, []) if u.op not in LINEAR_OPS), None)
                if other is not None:
                    raise LoweringError(f"{self.where(x)} gathers the sequence on tensor axis {axis_name} for "
                                        f"{self.where(user)} and for {self.where(other)}: ColwiseParallel("
                                        "input_layouts=Shard(1)) gathers it inside the projection only")
            elif style == ROWWISE and x.op == PARTITION and x.attr("dim") == last_in:
                claims.append(x.id)
                input_layout = "replicate"
            elif style == VOCAB and x.op == PARTITION and x.id in self.inputs:
                claims.append(x.id)
        if style == COLWISE:
            output_layout, found = self.gathered_output(user, axis)
            if output_layout == "shard" and self.feeds_loss(user, axis):
                output_layout = "loss"
            elif output_layout == "shard":
                self.check_split_not_cut(user, owner, axis)
        else:
            output_layout, found = self.reduced_output(user, axis, owner)
        claims += found
        return Style(owner, style, input_layout, output_layout, tuple(claims), conv1d=kind == CONV1D)

    def owner_for(self, w: WeightLowering, user: PNode) -> tuple[str, str]:
        """The module (and its kind) holding the weight under the name that matches the reading operator: a tied
        table is an embedding's weight where `embedding` reads it and a linear's where a projection does."""
        info = self.module.param(w.name)
        owners = list(info.owners) if info else []
        wanted = {EMBEDDING} if user.op in EMBEDDING_OPS else PROJECTIONS if user.op in LINEAR_OPS else set()
        for owner, kind in owners:
            if kind in wanted:
                return owner, kind
        return owners[0] if owners else ("", "parameter")

    def gathered_output(self, user: PNode, axis: int) -> tuple[str, list[int]]:
        """A column-parallel output: gathered whole (a `combine` of its last dim after operators that keep it
        split along its last dim, each the only reader) or left split. Such an operator may also read a
        `partition` of a whole value along its last dim (GPT-2's attention output projection under
        `megatron_pcg`: its split output added to the split residual, then gathered): the style then gathers
        the output and the module adds the whole value, the same sum; those partitions are claimed too."""
        current, claims = user, []
        while True:
            readers_ = self.users.get(current.id, [])
            if len(readers_) != 1:
                return "shard", []
            reader = readers_[0]
            if reader.kind == "parallel" and reader.axis(self.mesh) == axis and reader.op == COMBINE \
                    and reader.attr("dim") == len(current.shape) - 1:
                if claims:
                    self.notes.append(
                        f"{self.where(reader)} gathers the column-parallel output of {self.where(user)} after it "
                        f"was joined with slices of whole values ({', '.join(f'#{i}' for i in claims)}): torch "
                        "gathers the output (output_layouts=Replicate()) and the module joins whole values: the "
                        "same values and forward bytes; the plan's backward also all-gathers those slices' "
                        "gradients, torch's holds them whole")
                return "replicate", claims + [reader.id]
            others = [self.node(i) for i in reader.inputs if i not in self.static and i != current.id]
            if reader.kind == "op" and all(self.whole_sliced(o, axis) for o in others) \
                    and reader.placement.codes[axis] == shard(len(reader.shape) - 1) \
                    and current.placement.codes[axis] == shard(len(current.shape) - 1):
                claims += [o.id for o in others]
                current = reader
                continue
            return "shard", []

    def whole_sliced(self, node: PNode, axis: int) -> bool:
        """Whether `node` is a `partition` along the last dim, on `axis`, of a value whole there: what a
        column-parallel output may be joined with before the `combine` that gathers both (`gathered_output`)."""
        return node.kind == "parallel" and node.op == PARTITION and node.axis(self.mesh) == axis \
            and node.attr("dim") == len(node.shape) - 1 and node.id not in self.static \
            and self.node(node.inputs[0]).placement.codes[axis] in (FREE, REPLICA)

    def check_split_not_cut(self, user: PNode, owner: str, axis: int) -> None:
        """A column-parallel output left split along its last dim must not be cut along that dim by the module's
        code (a `split`): torch's style gives rank r a contiguous block of the output features, so a fused
        projection's parts (GPT-2's c_attn [h, 3h] read as q, k, v by thirds) would be cut from the wrong
        columns, each rank holding another mix of heads. The plan must gather it first (`combine`), as
        `megatron_pcg` does, or it is refused here, naming the cut."""
        seen, todo = {user.id}, [user]
        while todo:
            current = todo.pop()
            last = len(current.shape) - 1
            for reader in self.users.get(current.id, []):
                if reader.kind != "op" or reader.id in seen:
                    continue
                if reader.op == "split" and reader.attr("dim") == last:
                    raise LoweringError(
                        f"{self.where(reader)} cuts the column-parallel output of {self.where(user)} (module "
                        f"{owner}) along the dim tensor axis {self.mesh.names[axis]} splits: torch's column split "
                        "of a fused projection gives each rank a contiguous block of its output features, not its "
                        "share of each part (a fused q/k/v projection would mix heads across ranks); gather the "
                        "output before the cut (combine), or split each part's weight separately")
                if reader.placement.codes[axis] == shard(len(reader.shape) - 1):
                    seen.add(reader.id)
                    todo.append(reader)

    def reduced_output(self, user: PNode, axis: int, owner: str) -> tuple[str, list[int]]:
        """A row-parallel (or vocabulary-parallel) partial sum, which RowwiseParallel all-reduces at the module's
        output: the plan may compute on it as a partial sum first (its operators that keep a partial sum, linear
        in it: a residual add of two such sums, a square's first factor, a mean), as long as every way out of that
        region is a `reduce` on the tensor axis, or every one a `reduce_scatter` along the sequence (or a reduce
        the plan slices along it, `sequence_split`): sequence parallelism, `output_layouts=Shard(1)`, the layout
        returned. Claimed: those reduces (and slices), and the `replicate`s the region reads (a whole factor's
        copy, whose backward all-reduce torch's whole values make needless). The region's nodes are kept
        (`partial_region`) for `check_partials`, with its layout (`region_layout`): a residual stream kept a
        partial sum joins the regions of several styles (LLaMA's embedding, o_proj and down_proj under
        Megatron's plan), and each style then leaves as the region does (each reduce-scattered, then added:
        the same sum)."""
        claims, todo, layouts, reduces = [], [user], set(), []
        region = [user.id]
        self.partial_region.add(user.id)
        while todo:
            current = todo.pop()
            for reader in self.users.get(current.id, []):
                if reader.kind == "parallel" and reader.axis(self.mesh) == axis and reader.op == REDUCE:
                    claims.append(reader.id)
                    layouts.add("sequence" if reader.id in self.sequence_reduces else "replicate")
                    reduces.append(reader)
                    claims += [r.id for r in self.users.get(reader.id, []) if self.is_sequence_op(r, PARTITION, axis)]
                elif self.is_sequence_op(reader, REDUCE_SCATTER, axis):
                    claims.append(reader.id)
                    layouts.add("sequence")
                elif reader.kind == "op" and reader.placement.codes[axis] == PARTIAL:
                    if reader.id in self.region_layout:   # another style's region, already read
                        layouts.add(self.region_layout[reader.id])
                    elif reader.id not in self.partial_region:
                        region.append(reader.id)
                        self.partial_region.add(reader.id)
                        todo.append(reader)
                        for i in reader.inputs:
                            source = self.node(i)
                            if source.kind == "parallel" and source.op == REPLICATE \
                                    and source.axis(self.mesh) == axis:
                                claims.append(source.id)
                else:
                    raise LoweringError(
                        f"the partial sum of {self.where(user)} (module {owner}) reaches {self.where(reader)} on "
                        f"tensor axis {self.mesh.names[axis]}, which makes it {code_text(reader.placement.codes[axis])}"
                        " without a `reduce`: RowwiseParallel all-reduces it at the module's output, or reduce-"
                        "scatters it along the sequence (dim 1) with output_layouts=Shard(1)")
        if len(layouts) > 1:
            self.gather_in_projections(user, owner, reduces, axis)
            layouts = {"sequence"}
        layout = layouts.pop() if layouts else "replicate"
        self.region_layout.update((i, layout) for i in region)
        return layout, claims

    def gather_in_projections(self, user: PNode, owner: str, reduces: Sequence[PNode], axis: int) -> None:
        """A partial sum reduce-scattered along the sequence on one path and all-reduced on another (the tiny
        LM's bias-free residual: the embedding's sum whole for fc1, reduce-scattered with fc2's for the norm):
        torch's style has one output, Shard(1), so the all-reduces must feed column-parallel projections only
        (each a `replicate`), which then gather it themselves (`input_layouts=Shard(1)`, `sequence_inputs`)."""
        for node in reduces:
            other = next((r for r in self.users.get(node.id, []) if not (
                r.kind == "parallel" and r.op == REPLICATE and r.axis(self.mesh) == axis)), None)
            if other is not None or len(node.shape) != 3:
                raise LoweringError(f"the partial sum of {self.where(user)} (module {owner}) is split along the "
                                    f"sequence on one path and all-reduced by {self.where(node)} on another, read "
                                    f"whole by {self.where(other) if other else 'a value not [batch, seq, hidden]'}: "
                                    "RowwiseParallel has one output layout")
            self.sequence_reduces.add(node.id)
            self.notes.append(f"{self.where(node)} all-reduces on tensor axis {self.mesh.names[axis]} what the plan "
                              "also reduce-scatters along the sequence: torch's style reduce-scatters it once "
                              "(output_layouts=Shard(1)) and the projections reading it whole all-gather it "
                              "(input_layouts=Shard(1)): the same values")

    def sequence_inputs(self, styles: dict[str, Style], axis: int) -> None:
        """The column-parallel styles reading a `replicate` of a sum torch keeps split along the sequence
        (`sequence_reduces`, known once every region is read) gather it: `input_layouts=Shard(1)`."""
        for name, style in styles.items():
            if style.kind == COLWISE and any(
                    self.node(n).kind == "parallel" and self.node(n).op == REPLICATE
                    and self.node(n).inputs[0] in self.sequence_reduces for n in style.nodes):
                styles[name] = replace(style, input_layout="sequence")
        if any("sequence" in (s.input_layout, s.output_layout) for s in styles.values()):
            self.notes.append(
                "sequence parallelism: between the styles the residual stream is a Shard(1) DTensor of the global "
                "shape (the styles' and norms' use_local_output=False), so the module's own code (residual adds, "
                "norms) runs on each rank's slice of the sequence while a forward that reads the sequence length "
                "from those activations (Hugging Face LLaMA's rotary positions and causal mask, from the "
                "embedding's output) reads the whole one")

    def gathered_inputs(self, styles: dict[str, Style], axis: int) -> dict[str, Style]:
        """Where several column-parallel projections read one value the plan converts once (LLaMA's q/k/v, its
        gate/up: one `all_gather` along the sequence, `input_layouts=Shard(1)`, or one `replicate`, Megatron's f)
        and are the only ones in their parent module (the attention, the MLP, holding no parameter itself),
        torch converts it once at the parent's first input (`PrepareModuleInput`, as torchtitan's models do) and
        the projections read it whole: one all-gather, as in the plan, where each projection would issue its
        own, and the parent's code (an attention reshaping by its input's shape) computes on the whole sequence.
        The parent's input stays a `Replicate()` DTensor (`use_local_output=False`, torchtitan's choice), so the
        projections' input gradients meet as one partial sum that the conversion's backward reduces once
        (reduce-scatters after a gather, all-reduces after a `replicate`), as the plan's backward does; each
        `ColwiseParallel` converting its own input would all-reduce its own partial gradient. Returns the
        parents' styles; the projections' are changed in place."""
        groups: dict[tuple[int, str], list[str]] = {}
        for name, style in styles.items():
            if style.kind != COLWISE or style.input_layout not in ("sequence", "replicate"):
                continue
            source = next((n for n in style.nodes if self.node(n).kind == "parallel" and self.node(n).axis(
                self.mesh) == axis and self.node(n).op in (ALL_GATHER, REPLICATE)), None)
            if source is not None:
                groups.setdefault((source, style.input_layout), []).append(name)
        out: dict[str, Style] = {}
        for (source, layout), names in groups.items():
            parent = names[0].rpartition(".")[0]
            inside = [m for m, s in styles.items() if s.kind == COLWISE and m.rpartition(".")[0] == parent]
            if len(names) < 2 or not parent or sorted(inside) != sorted(names) or self.module.holds.get(parent):
                continue
            for name in names:
                styles[name] = replace(styles[name], input_layout="replicate",
                                       nodes=tuple(n for n in styles[name].nodes if n != source))
            out[parent] = Style(parent, PREPARE_STYLE, layout, "replicate", (source,))
        return out

    def is_sequence_op(self, node: PNode, op: str, axis: int) -> bool:
        """Whether `node` is the parallel operator `op` along the sequence (dim 1 of [batch, seq, hidden]) on
        the tensor axis: the collectives of sequence parallelism."""
        return node.kind == "parallel" and node.op == op and node.axis(self.mesh) == axis \
            and node.attr("dim") == SEQ_DIM and len(node.shape) == 3

    def sequence_split(self, axis: int) -> set[int]:
        """The `reduce`s on the tensor axis that the plan also slices along the sequence (Megatron's plan with
        `sequence=True` all-reduces the embedding's output, reads it whole in the next column-parallel
        projection and a slice of it in the residual stream): torch's value between the styles is one local
        tensor, so it is the slice, Shard(1), and the projection gathers it (`input_layouts=Shard(1)`); every
        reader must then be that slice or a column-parallel projection's `replicate`."""
        found = set()
        for node in self.pcg.nodes:
            if node.kind != "parallel" or node.op != REDUCE or node.axis(self.mesh) != axis or node.id in self.static:
                continue
            readers_ = self.users.get(node.id, [])
            if not any(self.is_sequence_op(r, PARTITION, axis) for r in readers_):
                continue
            other = next((r for r in readers_ if not self.is_sequence_op(r, PARTITION, axis) and not (
                r.kind == "parallel" and r.op == REPLICATE and r.axis(self.mesh) == axis)), None)
            if other is not None:
                raise LoweringError(f"{self.where(node)} is read as a slice of the sequence and whole by "
                                    f"{self.where(other)} on tensor axis {self.mesh.names[axis]}: between torch's "
                                    "styles one local tensor holds it, Shard(1) under sequence parallelism")
            found.add(node.id)
            self.notes.append(f"{self.where(node)} all-reduces on tensor axis {self.mesh.names[axis]} and the plan "
                              "slices the sum along the sequence: torch reduce-scatters it (output_layouts=Shard(1)) "
                              "and all-gathers it inside the column-parallel projections that read it whole "
                              "(input_layouts=Shard(1)): the same values and bytes, two collectives where the plan has one")
        return found

    def vocabulary_losses(self, axis: int) -> None:
        """The cross-entropies the plan computes on logits split along the vocabulary on the tensor axis (Megatron-
        LM's vocabulary-parallel loss: the logsumexp as `ir.megatron.vocabulary_steps`, the target's logit and
        the mean on the shards, their partial sums all-reduced, the logits never gathered). torch runs the
        module's own `F.cross_entropy` on the column-parallel head's `Shard(-1)` logits as loss parallelism
        (`loss_parallel.py`: `torch.distributed.tensor.parallel.loss_parallel`), which computes the same loss
        without gathering them either; so those operators are that loss's (`loss_nodes`, their partial sums
        computed inside it), and the parallel operators on the axis that bring it its targets, its inverse count
        and its own values, or take its result, are claimed (`loss_claims`). A cross-entropy is the import's
        (`importer.aten_attention`): a logsumexp of the logits that one `nll_sum` of the same logits alone reads,
        and that sum's mean (a `mul` by the targets' inverse count) if the graph takes it. A vocabulary-parallel
        logsumexp that is not one is left to `check_partials`, which refuses its partial sum by name."""
        by_name = {n.name: n for n in self.graph.nodes}
        leaves = {leaf.name for leaf in self.graph.leaves}
        readers_: dict[str, list] = {}
        for n in self.graph.nodes:
            for i in n.inputs:
                readers_.setdefault(i, []).append(n)
        for lse, steps in vocabulary_parallel_logsumexps(self.pcg, self.graph).items():
            logits = by_name[lse].inputs[0]
            nll = readers_.get(lse, [])
            if len(nll) != 1 or nll[0].op != "nll_sum" or tuple(nll[0].inputs[:2]) != (logits, lse):
                continue
            names = {lse, nll[0].name}
            mean = readers_.get(nll[0].name, [])
            if len(mean) == 1 and mean[0].op == "mul" and any(i in leaves for i in mean[0].inputs):
                names.add(mean[0].name)
            nodes = set(steps) | {n.id for n in self.pcg.nodes if n.kind == "op" and n.origin in names}
            if all(self.node(i).placement.codes[axis] in (FREE, REPLICA) for i in nodes):
                continue   # computed on whole logits: a `combine` before it, the module's own cross-entropy
            self.loss_nodes |= nodes
            self.losses.append(nll[0].name)
        for ident in self.loss_nodes:
            for i in self.node(ident).inputs:   # back to a loss operator or an input: its targets, its count
                chain = []
                while self.node(i).kind == "parallel":
                    chain.append(self.node(i))
                    i = self.node(i).inputs[0]
                if i in self.loss_nodes or (self.node(i).kind == "leaf" and self.node(i).role != "weight"):
                    self.loss_claims.update(n.id for n in chain if n.axis(self.mesh) == axis)
            todo = [ident]   # forward to the next operator: the loss's reduces, its values' copies
            while todo:
                for reader in self.users.get(todo.pop(), []):
                    if reader.kind == "parallel":
                        if reader.axis(self.mesh) == axis:
                            self.loss_claims.add(reader.id)
                        todo.append(reader.id)

    def feeds_loss(self, user: PNode, axis: int) -> bool:
        """Whether the column-parallel output of `user` reaches a vocabulary-parallel cross-entropy (`loss_nodes`)
        split along its last dim, through operators that keep it so and are each the only reader (the head's
        logits flattened for the loss), and nothing else: the style then leaves it a `Shard(-1)` DTensor for
        loss parallelism (recorded in `loss_inputs`)."""
        current = user
        while True:
            readers_ = self.users.get(current.id, [])
            if readers_ and all(r.id in self.loss_nodes for r in readers_):
                self.loss_inputs.add(current.id)
                return True
            if len(readers_) != 1 or readers_[0].kind != "op" or \
                    readers_[0].placement.codes[axis] != shard(len(readers_[0].shape) - 1):
                return False
            current = readers_[0]

    def check_loss_inputs(self, axis: int) -> None:
        """Every value a vocabulary-parallel cross-entropy reads split on the tensor axis, other than its own
        operators' and its claimed inputs, is logits a column-parallel style leaves split for it (`feeds_loss`):
        anything else the module would hand its cross-entropy as a local piece, and it would compute a wrong loss."""
        for ident in sorted(self.loss_nodes):
            node = self.node(ident)
            for i in node.inputs:
                source = self.node(i)
                if i in self.loss_nodes or i in self.loss_claims or source.placement.codes[axis] in (FREE, REPLICA):
                    continue
                if i not in self.loss_inputs:
                    raise LoweringError(
                        f"{self.where(node)}, of the vocabulary-parallel cross-entropy, reads {self.where(source)} "
                        f"as {code_text(source.placement.codes[axis])} on tensor axis {self.mesh.names[axis]}, which "
                        "no column-parallel nn.Linear leaves split along the vocabulary for the module's "
                        "F.cross_entropy alone: torch's loss parallelism reads the head's Shard(-1) logits")

    def check_partials(self, axis: int) -> None:
        """Every partial sum on the tensor axis is a styled contraction's or computed from one (the module's own
        code, between the styles, computes on whole values or local pieces, never on partial sums)."""
        for node in self.pcg.nodes:
            if node.kind != "op" or node.id in self.static:
                continue
            if node.id in self.loss_nodes:
                continue   # a vocabulary-parallel cross-entropy's partial sums: loss parallelism's own
            partial_inputs = [i for i in node.inputs if self.node(i).placement.codes[axis] == PARTIAL]
            if node.placement.codes[axis] == PARTIAL and node.id not in self.partial_region:
                raise LoweringError(
                    f"{self.where(node)} makes a partial sum on tensor axis {self.mesh.names[axis]} that no split "
                    "nn.Linear or nn.Embedding makes: the module's own code would compute it on local pieces and "
                    "never add them up"
                    + (" (a vocabulary-parallel logsumexp is lowered only as the module's F.cross_entropy of a "
                       "column-parallel head's logits, by loss parallelism)" if node.op == "sumexp_shifted" else ""))
            for i in partial_inputs:
                if i not in self.partial_region:
                    raise LoweringError(f"{self.where(node)} reads the partial sum {self.where(self.node(i))} on "
                                        f"tensor axis {self.mesh.names[axis]}, which no styled module makes")

    def check_style_params(self, styles: Mapping[str, Style], weights: Sequence[WeightLowering], axis: int) -> None:
        """A styled module's other parameters must be as its style shards them: a column-parallel linear's bias
        split along dim 0, a row-parallel one's whole."""
        axis_name = self.mesh.names[axis]
        by_param = {p: w for w in weights for p in w.params}
        for style in styles.values():
            for local in self.module.holds.get(style.module, ()):
                full = f"{style.module}.{local}" if style.module else local
                w = by_param.get(full)
                if w is None or local == "weight":
                    continue
                want = "split along dim 0" if style.kind == COLWISE else "whole"
                got = w.roles[axis]
                ok = (got == SPLIT and w.stored_dim(axis) == 0) if style.kind == COLWISE else \
                    got in (FREE_ROLE, WHOLE) or (got == SEQUENCE and style.output_layout == "sequence")
                if not ok:
                    raise LoweringError(f"parameter '{full}' of {style.describe()} is {got} on tensor axis "
                                        f"{axis_name}; the style keeps it {want}")
        if self.module.has_param_below:
            for style in styles.values():
                if style.kind != PREPARE_STYLE and style.module in self.module.has_param_below:
                    raise LoweringError(f"module {style.module or '<root>'} is styled on tensor axis {axis_name} but "
                                        "has submodules with parameters of their own")

    def replicated_modules(self, styles: Mapping[str, Style], weights: Sequence[WeightLowering],
                           axis: int) -> list[Style]:
        """The modules holding parameters no style covers: each computes with `Replicate()` DTensors on the tensor
        axis (the plan reads those parameters whole there; parameters the plan lacks are whole too), under
        `SequenceParallel` if the plan reads some beside a slice of the sequence (role `sequence`: a norm)."""
        axis_name = self.mesh.names[axis]
        by_param = {p: w for w in weights for p in w.params}
        out = []
        for module, names in sorted(self.module.holds.items()):
            if not names or module in styles:
                continue
            names = tuple(n for n in names if not self.styled_elsewhere(f"{module}.{n}" if module else n, styles))
            if not names:
                continue   # its parameters are tied to a styled module's (BERT's head bias is its decoder's)
            kind = REPLICATE_STYLE
            for local in names:
                full = f"{module}.{local}" if module else local
                w = by_param.get(full)
                if w is not None and w.roles[axis] == SEQUENCE:
                    kind = SEQUENCE_STYLE
                elif w is not None and w.roles[axis] not in (FREE_ROLE, WHOLE):
                    raise LoweringError(f"parameter '{full}' is {w.roles[axis]} on tensor axis {axis_name} but its "
                                        f"module {module or '<root>'} ({self.module.kinds.get(module)}) has no "
                                        "tensor-parallel style")
            if module in self.module.has_param_below:
                raise LoweringError(f"module {module or '<root>'} holds parameters ({', '.join(names)}) beside "
                                    f"submodules with parameters: on tensor axis {axis_name} its parameters would "
                                    "be Replicate() DTensors, which only a module without such submodules computes "
                                    "with")
            out.append(Style(module, kind, *(("sequence", "sequence") if kind == SEQUENCE_STYLE else ())))
        unused = sorted(p for p, info in self.module.params.items() if p == info.names[0] and p not in by_param
                        and not any(p in w.params for w in weights))
        if unused:
            self.notes.append(f"parameters the plan's graph does not have ({', '.join(unused[:8])}"
                              f"{' ...' if len(unused) > 8 else ''}) are Replicate() on the tensor axis")
        return out

    def note_constant_slice(self, node: PNode, axis: int) -> None:
        """A constant the import found in the forward (BERT's attention mask, expanded over the heads), split on
        the tensor axis where the plan reads it (along the heads the styles split): the module builds it itself
        on every rank and reads it with its local pieces; it has no gradient, so nothing moves either way. A
        module that kept it whole along a split dim would fail its own shape check, loudly, in the forward."""
        constant = self.chain_source(node.inputs[0]).op
        self.notes.append(f"{self.where(node)}: a slice of the constant {constant} on tensor "
                          f"axis {self.mesh.names[axis]}, which the module builds itself and reads with its "
                          "local pieces (no collective, no gradient)")

    def chain_source(self, node: int) -> PNode:
        """The node a chain of parallel operators ending at `node` starts from (a constant split on a data axis,
        then on the tensor axis: the constant's leaf)."""
        found = self.node(node)
        while found.kind == "parallel":
            found = self.node(found.inputs[0])
        return found

    def styled_elsewhere(self, name: str, styles: Mapping[str, Style]) -> bool:
        """Whether parameter `name` is tied to one a styled module holds (the style places it; the tie is remade
        after, `apply._tie_again`)."""
        info = self.module.param(name)
        return info is not None and any(owner in styles for owner, _ in info.owners)

    # ------------------------------------------------------------ notes

    def note_rewrites(self) -> None:
        """Say where the plan computes otherwise than the graph (algebraic rewrites: other operators, or the same
        in another order, `rewritten_nodes`). The module's own forward is equal in value (the rules prove it);
        `entry` replaces this note where `rewritten` makes the module compute the plan's graph instead."""
        nodes = rewritten_nodes(self.pcg, self.graph)
        if not nodes:
            return
        graph_ops: dict[str, int] = {}
        for n in self.graph.nodes:
            graph_ops[n.op] = graph_ops.get(n.op, 0) + 1
        plan_ops: dict[str, int] = {}
        vocabulary = vocabulary_parallel_logsumexps(self.pcg, self.graph)   # each counted as its logsumexp
        steps = {i for ids in vocabulary.values() for i in ids}
        for n in self.pcg.nodes:
            if n.kind == "op":
                op = n.op if n.id not in steps else "logsumexp" if n.origin in vocabulary else None
                if op is not None:
                    plan_ops[op] = plan_ops.get(op, 0) + 1
        differ = sorted(op for op in set(graph_ops) | set(plan_ops) if graph_ops.get(op, 0) != plan_ops.get(op, 0))
        shown = ", ".join(f"{op} {graph_ops.get(op, 0)} -> {plan_ops.get(op, 0)}" for op in differ[:8])
        self.notes.append(f"{REWRITE_NOTE} ({shown or 'the same operators, in another order'}"
                          f"{' ...' if len(differ) > 8 else ''}; first {self.where(nodes[0])}"
                          f"{', by ' + nodes[0].rules[0] if nodes[0].rules else ''}): rewrites whose value the "
                          "rules prove equal; the module runs its own forward, so their order of computation is "
                          "not lowered")


def rewritten_nodes(pcg: PCG, graph: Graph) -> tuple[PNode, ...]:
    """The plan's compute nodes that compute an expression the graph does not, parallel operators looked through
    (they change the spread, never the value): none when the plan computes the graph's own operators on the
    graph's own operands; after `scale(bmm(q, k))` -> `bmm(scale(q), k)`, the new scale and bmm and every node
    computed from them (`_expressions`). A logsumexp computed as Megatron-LM's vocabulary-parallel steps
    (`ir.megatron.vocabulary_parallel_logsumexps`) is the graph's own: the module's cross-entropy computes it so on
    the logits' shards (`loss_parallel`), and the steps' last node stands for it."""
    of, named, steps = _expressions(pcg, graph)
    known = set(named.values())
    return tuple(n for n in pcg.nodes if n.kind == "op" and n.id not in steps and of[n.id] not in known)


def graph_nodes_computed(pcg: PCG, graph: Graph) -> dict[int, str]:
    """Plan compute node -> the graph node whose value it computes (`_expressions`); each step of a
    vocabulary-parallel logsumexp -> that logsumexp. Two operands of `add` and `mul` are matched in either order
    (IEEE addition and multiplication commute exactly, so `add_commute` leaves the value bit for bit); a node
    another rewrite made, and those computed from it, have none."""
    of, named, steps = _expressions(pcg, graph, COMMUTATIVE)
    by_key = {k: name for name, k in named.items()}
    return {n.id: steps[n.id] if n.id in steps else by_key[of[n.id]] for n in pcg.nodes
            if n.kind == "op" and (n.id in steps or of[n.id] in by_key)}


COMMUTATIVE = frozenset({"add", "mul"})   # operators whose two operands commute exactly (`graph_nodes_computed`)


def _expressions(pcg: PCG, graph: Graph, unordered: frozenset[str] = frozenset()
                 ) -> tuple[dict[int, int], dict[str, int], dict[int, str]]:
    """Each value as an expression, hash-consed to an integer (so deep graphs stay flat): (plan node -> its
    expression, parallel operators looked through: they change the spread, never the value; graph leaf or node
    -> its expression; plan node of a vocabulary-parallel logsumexp's steps -> that logsumexp's name). The
    operands of an operator in `unordered` are keyed as a set."""
    ids: dict[tuple, int] = {}
    vocabulary = vocabulary_parallel_logsumexps(pcg, graph)
    steps = {i: name for name, ids_ in vocabulary.items() for i in ids_}

    def key(op: str, attrs, inputs) -> int:
        inputs = tuple(inputs)
        return ids.setdefault((op, tuple(sorted(attrs)), tuple(sorted(inputs)) if op in unordered else inputs),
                              len(ids))

    named = {leaf.name: key("leaf", (), (leaf.name,)) for leaf in graph.leaves}
    for n in graph.nodes:
        named[n.name] = key(n.op, n.attrs, (named[i] for i in n.inputs))
    of: dict[int, int] = {}
    for n in pcg.nodes:
        if n.kind == "leaf":
            of[n.id] = key("leaf", (), (n.op,))
        elif n.kind == "parallel":
            of[n.id] = of[n.inputs[0]]
        elif n.id in steps and n.origin == steps[n.id]:
            of[n.id] = named[steps[n.id]]
        else:
            of[n.id] = key(n.op, n.attrs, (of[i] for i in n.inputs))
    return of, named, steps


def weight_values(pcg: PCG) -> set[int]:
    """Nodes computed from weights alone (weight leaves, then anything all of whose inputs are such)."""
    return _computed_from(pcg, lambda leaf: leaf.role == "weight")


def _data_only(pcg: PCG) -> set[int]:
    """Nodes computed from graph inputs alone (no weight upstream: nothing there has a gradient)."""
    return _computed_from(pcg, lambda leaf: leaf.role != "weight")


def _computed_from(pcg: PCG, seed: Callable[[PNode], bool]) -> set[int]:
    """The leaves `seed` accepts, then every node all of whose inputs are among them (in the PCG's order)."""
    found: set[int] = set()
    for node in pcg.nodes:
        if node.kind == "leaf":
            if seed(node):
                found.add(node.id)
        elif node.inputs and all(i in found for i in node.inputs):
            found.add(node.id)
    return found


def _batch_wide_constants(pcg: PCG, graph: Graph, library) -> set[int]:
    """Leaves of constants the import found in the forward whose leading dim is the batch
    (`ir.microbatch.batch_wide_constants`: BERT's attention mask of ones or its token-type one-hots): the module
    rebuilds them from its local batch's shape on every rank, so a plan that splits them (or values made from them
    and weights alone) along that dim on a data axis reads what the rank's own forward computes."""
    wide = batch_wide_constants(graph, batch_dims(graph, library))
    return {n.id for n in pcg.nodes if n.kind == "leaf" and n.role != "weight" and n.op in wide}


def _input_chains(pcg: PCG) -> set[int]:
    """Graph inputs and the values parallel operators make from them alone."""
    chains: set[int] = set()
    for node in pcg.nodes:
        if node.kind == "leaf" and node.role != "weight":
            chains.add(node.id)
        elif node.kind == "parallel" and node.inputs[0] in chains:
            chains.add(node.id)
    return chains


def weight_params(weight: str, module: ModuleInfo) -> tuple[str, ...]:
    """Every name of the module's parameter that is the plan's weight `weight`, or a LoweringError."""
    info = module.param(weight)
    if info is None:
        raise LoweringError(f"the plan's weight '{weight}' is not a parameter of the module: give parallelize "
                            "weight_names (graph weight -> parameter name) for a module that names its blocks "
                            "otherwise (the plan names block i's weights b{i}_...)")
    return info.names


def layer_module(layer: int, weights, module: ModuleInfo) -> str:
    """The submodule holding every parameter of layer `layer`'s weights and none of another layer's: where a
    pipeline chunk that begins with that layer is cut from the one before, and what recomputing it checkpoints."""
    if layer == OUTSIDE:
        raise LoweringError("a pipeline chunk after the first begins with the prelude (layer -1): no cut")
    mine = [n for w in weights if block_of(w) == layer for n in weight_params(w, module)]
    others = {n for w in weights if block_of(w) != layer for n in weight_params(w, module)}
    if not mine:
        raise LoweringError(f"the pipeline cuts before layer {layer}, which has no weights to find its module by")
    parts = [n.split(".")[:-1] for n in mine]
    common = parts[0]
    for p in parts[1:]:
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    owner = ".".join(common)
    if not owner or any(n.startswith(owner + ".") for n in others):
        raise LoweringError(f"the pipeline cuts before layer {layer} (weights b{layer}_...), but no submodule of "
                            f"the module holds that layer's parameters ({', '.join(mine[:3])}, ...) and no other "
                            "layer's: torch.distributed.pipelining cuts a module before a submodule's call")
    return owner


def recomputed_blocks(pcg: PCG, module: ModuleInfo) -> tuple[str, ...]:
    """The submodules to checkpoint for the plan's recomputation: one per block of the plan's stack
    (`layer_module`) when it recomputes blocks, none when it recomputes nothing; refused otherwise."""
    if pcg.recompute == "none":
        return ()
    weights = [n.op for n in pcg.nodes if n.kind == "leaf" and n.role == WEIGHT]
    layers = sorted({block_of(w) for w in weights} - {OUTSIDE})
    if pcg.recompute != "blocks" or not layers:
        raise LoweringError(f"the plan recomputes activations ({pcg.recompute!r}) but names no blocks (b{{i}}_... "
                            "weights) to checkpoint: only recomputing blocks is lowered onto torch")
    return tuple(layer_module(layer, weights, module) for layer in layers)
