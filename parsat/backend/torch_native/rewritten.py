"""An algebraic rewrite lowered: the user's module, its forward computing the plan's graph.

Where the plan's PCG computes otherwise than the module's graph
(`lowering.rewritten_nodes`: an algebraic rule replaced or reordered
operators, e.g. BERT's attention scale moved from the scores onto the
queries by `scale_into_bmm_left`), the module's own forward computes the
graph's form: equal in value, as the rules prove, but not what the plan
chose. Here the module's forward is replaced (an instance attribute: the
class, the parameters and their names stay the user's) by
`RewrittenForward`, which on each rank evaluates the plan's compute nodes,
in the plan's order, with parsat's torch operators (`importer.torch_ops`)
on

* the module's own parameters, read at call time: inside `replicate` /
  `fully_shard`'s forward they are the unsharded tensors, so gradients
  reach torch's data-parallel machinery as the module's own forward's do,
  and `state_dict()`, DCP, `clip_grad_norm_` and optimizers see the same
  DTensor parameters as without a rewrite;
* the rank's local batch, fed as the import feeds the graph
  (`ImportedModule.data_values`, its batch-carrying leaves encoded at the
  local batch's shapes); the import's constants and dropout masks whole,
  sliced where the plan partitions them;

and returns what the module returns (the import's output structure).

Parallel operators on the data axes keep the module's own contract
(`lowering.check_data_collectives`): each rank computes on its local batch.
A batch split of the user's data is already done (the rank was given its
slice); a split of a constant, a dropout mask or a value made from them and
weights is a slice at the rank's coordinate; a replica, a gather or a sum
over the data ranks of an activation keeps the rank's own value (the loss of
its local batch: torch averages the gradients over the data ranks); parallel
operators on weights are torch's (`replicate`, `fully_shard`, which then
wraps the root only: the blocks' own forwards are not called, so their
hooks would never gather their parameters).

On a tensor axis (`place_parameters`, `_on_dtensors`) no style is
applied: every parameter is a DTensor on the tensor axis's mesh placed as
the plan stores its weight (the end of its storage chain: BERT's tied
word table whole, where the styles store it vocabulary-split; a weight
stored as a strided block of itself, HF GPT-2's head-ordered `c_attn`, held
head-major as a plain `Shard(d)` and read back as the strided DTensor of the
module's parameter: `head_major`), the data
enters as `Replicate()` DTensors, each compute node runs on DTensors
(DTensor's sharding propagation computes the global values, and on BERT's
Megatron plan leaves every node in the plan's placement), and each parallel
operator on that axis is a `redistribute` to the plan's placement there.
Beside data axes (dp x tp) the same holds on the tensor axis's mesh:
`replicate` / `fully_shard` over the data axes make the stored parameters
DTensors of the 2-D mesh (`Replicate()` or `Shard(d)` on dp, the plan's
placement on tp) and hand the forward their tp-mesh DTensors, each rank's
values being its local batch's (the data axes' split done by the batch it
was given, the constants sliced), so the data axes' gradient sync stays
torch's. A lookup in a table split along the vocabulary on the tensor
axis is each rank's lookup of its rows, a `Partial()` DTensor
(`vocabulary_lookup`: DTensor's own sharding of it fails in the backward).
A plan recomputing blocks runs each block's steps under
`torch.utils.checkpoint` (`Recomputed`).

Covered: every unpipelined plan of data, ZeRO and tensor axes (data
parallel, ZeRO-1/2/3, HSDP, one tensor axis, dp x tp), vocabulary-split
lookups, recomputed blocks. Not covered (the module then runs its own
forward, equal in value, and the lowering's note says so): a module given
without its import or example inputs. Refused, naming the node (`rewrite_of`): a
scale after a sum over the data ranks (a normalisation fixed at the global
batch would be off on a local one; a plan file's built-in example has it computed at the
local batch, `local_attrs`), an operator on the user's data before
the plan splits it, a batch norm keeping running statistics, a module
returning other values than the graph's outputs (integers, None), a lookup
of a vocabulary-split table whose ids are not split alike.

A plan computing the module's own graph runs this forward too where torch's
styles cannot run its tensor axis on the module's own forward
(`lowered_plan`, `lowering.UnstyledAxis`: HF LLaMA under tp 4 with 2 KV
heads, whose plan slices the heads `repeat_kv` makes): here each parallel
operator there is a DTensor `redistribute`, a partition of a whole value a
local slice.

The graph has no dtypes (casts import as the identity); the import records
where the module computes in another dtype than its parameters
(`importer.imported.NodeDtypes`: HF's causal loss reads its logits
`.float()`, LlamaRMSNorm its input `.to(torch.float32)`), and each step
computes so (`node_dtypes`, `_in_dtypes`), a cross-entropy as torch's
`log_softmax` (`_in_module_dtypes`): its float32 sections then round as the
module's do where their values are whole on the rank.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from math import prod
from typing import Any, Mapping

import torch
import torch.distributed as dist

from parsat.dsl.parallel_ops import ALL_GATHER, COMBINE, PARTITION, REDUCE, REPLICATE
from parsat.importer.imported import NodeDtypes
from parsat.importer.torch_ops import apply_op
from parsat.ir.graph import Graph
from parsat.ir.megatron import vocabulary_parallel_logsumexps
from parsat.ir.microbatch import batch_dims
from parsat.ir.pcg import PCG, PNode, storage_views, weight_placement, weight_storage
from parsat.ir.placement import FREE, PARTIAL, REPLICA, shard, shard_dim
from parsat.backend.recompute_regions import Region, forward_units
from parsat.backend.torch_native.head_major import checkpoint_in_module_order, head_major, strided_view
from parsat.backend.torch_native.lowering import (DATA, EMBEDDING_OPS, REWRITE_NOTE, ZERO3, Lowering, LoweringError,
                                                  ModuleInfo, OwnForwardCannot, UncheckpointedBlocks,
                                                  UnstyledAxis, graph_nodes_computed, lower,
                                                  rewritten_nodes, weight_values)

WEIGHT, LEAF, OP, SAME, SLICE, PLACE, LOOKUP = "weight", "leaf", "op", "same", "slice", "place", "lookup"


@dataclass(frozen=True)
class Step:
    """One plan node as a rank evaluates it: `weight` (the module's parameter `name`), `leaf` (the data leaf
    `name`), `op` (operator `name` with `attrs`), `same` (the input's value: a parallel operator the rank's local
    batch or torch's data parallelism already does), `slice` (the rank's piece of a whole value along `dim`, at
    its coordinate on mesh axis `axis`, one of `degree`), `place` (a parallel operator on the tensor axis: the
    DTensor redistributed to the plan's placement there, `code`), or `lookup` (embedding `name` of a table split
    along its rows on the tensor axis: each rank's lookup of its rows, a partial sum, `vocabulary_lookup`).
    `frees`: values no later step reads. `reads` / `makes`: for an `op` or `lookup` the module computes in another
    dtype than its parameters (`importer.imported.NodeDtypes`), the operands cast so and the value's dtype."""

    node: int
    action: str
    name: str = ""
    inputs: tuple[int, ...] = ()
    attrs: tuple[tuple[str, Any], ...] = ()
    dim: int = 0
    axis: int = 0
    degree: int = 1
    code: int = 0
    frees: tuple[int, ...] = ()
    reads: tuple[tuple[int, str], ...] = ()
    makes: str = ""


@dataclass(frozen=True)
class Recomputed:
    """A recomputed block's steps, `start` to `end` (exclusive) in `Rewrite.steps`, run under
    `torch.utils.checkpoint` (non-reentrant): the values of `needed` (made outside, read inside) go in, those of
    `kept` (read outside it or returned) come out; the rest are made again in its backward
    (`recompute_regions.Region`, as the interpreter runs it)."""

    start: int
    end: int
    needed: tuple[int, ...]
    kept: tuple[int, ...]


@dataclass(frozen=True)
class Rewrite:
    """What a rank evaluates in place of the module's forward (module docstring): the steps in the plan's order,
    the output nodes, the local shapes of the batch-carrying data leaves, the rewritten nodes' description, and
    on a tensor axis (`tensor_axis`) each weight's stored placement there (parameter name, placement code; a
    parameter's split factor in `strided` where it is stored as a strided block, `parameter_placement`); for a
    plan that recomputes blocks, each block's run of steps (`recomputed`)."""

    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    local_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    summary: str
    tensor_axis: int | None = None
    stored: tuple[tuple[str, int], ...] = ()
    recomputed: tuple["Recomputed", ...] = ()
    strided: tuple[tuple[str, int], ...] = ()   # parameter -> split factor, where > 1 (`parameter_placement`)

    def lowered(self, lowering: Lowering) -> Lowering:
        """`lowering` saying that the module's forward computes the plan's graph (its rewrite note replaced)."""
        notes = tuple(n for n in lowering.notes if not n.startswith(REWRITE_NOTE))
        # the module's block forwards are not called: the regions of the plan's blocks are checkpointed instead
        lowering = replace(lowering, recompute=(), unrecomputable="")
        if self.tensor_axis is None:
            return replace(lowering, notes=notes, rewritten=self.summary)
        # no styles: the parameters take the plan's placements, so the styles' notes (a table stored otherwise
        # than the plan, a constant sliced on the tensor axis) do not apply
        axis = lowering.mesh.names[self.tensor_axis]
        styled = (f"axis {axis}", f"axis={axis}", "torch stores it")   # what the styles would have done on it
        notes = tuple(n for n in notes if not any(word in n for word in styled))
        weights = tuple(replace(w, restored=()) for w in lowering.weights)
        return replace(lowering, notes=notes, rewritten=self.summary, styles=(), weights=weights)


def lowered_plan(pcg: PCG, graph: Graph, module: ModuleInfo, imported, library=None
                 ) -> tuple[Lowering, Rewrite | None]:
    """(the lowering, the rewrite to install, None for the module's own forward) of an unpipelined plan: the
    module's own forward under torch's styles where they run the plan's tensor axis (`lowered_rewrite` then
    replaces it only for an algebraic rewrite), else the plan's graph evaluated on DTensors, where each parallel
    operator on the tensor axis is a redistribute (`UnstyledAxis`: HF LLaMA under tp 4 with 2 KV heads, whose
    plan slices the heads `repeat_kv` makes, a partition of a whole value being each rank's local slice). Without
    the import the styles' refusal stands, saying what would run it. Raises LoweringError naming the node."""
    try:
        lowering = lower(pcg, graph, module, library=library)
    except OwnForwardCannot as err:   # a tensor axis no style runs, blocks no submodule holds (`run.GraphModule`)
        why = _no_rewrite(imported)
        if why:
            raise LoweringError(f"{err} (a forward evaluating the plan's graph on DTensors would run it: {why})"
                                ) from None
        lowering = lower(pcg, graph, module, library=library, evaluated=True)
        rewrite = rewrite_of(pcg, graph, lowering, imported, library,
                             unstyled=str(err) if isinstance(err, UnstyledAxis) else "",
                             unmodular=str(err) if isinstance(err, UncheckpointedBlocks) else "")
        return rewrite.lowered(lowering), rewrite
    return lowered_rewrite(pcg, graph, lowering, imported, library)


def _no_rewrite(imported) -> str:
    """Why a rewritten forward cannot run for `imported` ("" where it can): no import at hand."""
    return ("give parallelize the example inputs (or the import) to have it compute the plan's graph"
            if imported is None else "")


def lowered_rewrite(pcg: PCG, graph: Graph, lowering: Lowering, imported, library=None
                    ) -> tuple[Lowering, Rewrite | None]:
    """(the lowering, the rewrite to install) for a plan computing otherwise than the module's graph; the rewrite
    None where nothing differs, or where it is not covered (the lowering's note then says why the module runs its
    own forward). Raises LoweringError for what is covered but cannot run (module docstring)."""
    if not rewritten_nodes(pcg, graph):
        return lowering, None
    why = _no_rewrite(imported)
    if why and lowering.unrecomputable:
        raise LoweringError(lowering.unrecomputable)
    if why:
        return replace(lowering, notes=tuple(f"{n} ({why})" if n.startswith(REWRITE_NOTE) else n
                                             for n in lowering.notes)), None
    rewrite = rewrite_of(pcg, graph, lowering, imported, library)
    return rewrite.lowered(lowering), rewrite


def rewrite_of(pcg: PCG, graph: Graph, lowering: Lowering, imported, library=None, unstyled: str = "",
               unmodular: str = "") -> Rewrite:
    """The steps a rank evaluates for `pcg` on its local batch (module docstring), or a LoweringError naming the
    node that cannot be evaluated so. `unstyled`: why the styles cannot run the plan's tensor axis (`lowered_plan`),
    said in the summary in place of the first rewritten node where the plan computes the module's own graph;
    `unmodular`: likewise why the module's own blocks cannot be checkpointed."""
    if imported.running_stats:
        raise LoweringError("the plan's graph is rewritten and the module's batch norms keep running statistics, "
                            "which only the module's own forward updates: run the plan with the interpreter")
    spec = imported.output_spec
    if spec is not None and spec.num_leaves != len(pcg.outputs):
        raise LoweringError(f"the module returns {spec.num_leaves} value(s) and the plan's graph computes "
                            f"{len(pcg.outputs)}: a rewritten forward returns what the graph computes, so it would "
                            "not return what the module does (return the loss, or only tensors the import maps)")
    data_axes = set(lowering.axes(DATA)) | set(lowering.axes(ZERO3))
    batch = batch_dims(graph, library)
    count = prod(lowering.mesh.shape[a] for a in lowering.batch_axes)
    at_local = local_attrs(pcg, graph, imported, count)
    local = {name for name, leaf in imported.data.items() if not leaf.constant and leaf.encoding != "dropout"}
    static = weight_values(pcg)
    chains = weight_storage(pcg)
    # a weight's storage: the parameter is that (a view on the chain is computed: `parameter_placement`)
    stored_by = {i for chain in chains.values() for i in chain[1:] if pcg.node(i).kind != "op"}
    presliced: dict[int, frozenset[int]] = {}   # node -> data axes its value on the rank is already split along
    summed: set[int] = set()                    # nodes after a gather or a sum over the data ranks
    steps = []
    for n in pcg.nodes:
        if n.id in stored_by:
            steps.append(Step(n.id, SAME, inputs=n.inputs))
            continue
        steps.append(_step(n, pcg, lowering, data_axes, static, presliced, summed, local, batch, at_local))
    shapes = tuple((name, tuple(s // count if d == batch[name] else s for d, s in enumerate(graph.shape(name))))
                   for name in sorted(local) if name in batch)
    plan_only = rewritten_nodes(pcg, graph)
    why = []
    if plan_only:
        first = plan_only[0]
        why.append(f"{len(plan_only)} computing otherwise than the module's graph, first #{first.id} {first.label}"
                   f"{' by ' + first.rules[0].split(' ')[0] if first.rules else ''}")
    if unstyled:   # the refusal's first clause: the node and what no style does with it
        why.append(f"torch's styles cannot run its tensor axis on the module's own forward "
                   f"({unstyled.split(': ', 1)[0]}); here every parallel operator there is a DTensor redistribute")
    if unmodular:
        why.append("no submodule of the module holds one block's parameters, so its own forward has nothing to "
                   "checkpoint")
    summary = (f"the plan's graph ({sum(s.action == OP for s in steps)} operators, {'; '.join(why)}), evaluated "
               "with importer.torch_ops on the module's parameters and the rank's local batch in place of its own "
               "forward (torch_native/rewritten.py)"
               + ("; fully_shard wraps the root only" if lowering.axes(ZERO3) or lowering.zero >= 2 else ""))
    tp = lowering.tensor_axis
    placed = () if tp is None else tuple((w.params[0], *parameter_placement(pcg, chains[w.node], tp))
                                         for w in lowering.weights)
    stored = tuple((name, code) for name, code, _ in placed)
    strided = tuple((name, factor) for name, _, factor in placed if factor > 1)
    dtypes = node_dtypes(pcg, graph, getattr(imported, "dtypes", {}))
    steps = [_in_module_dtypes(s, dtypes[s.node], pcg) if s.node in dtypes and s.action in (OP, LOOKUP) else s
             for s in steps]
    steps, recomputed = _in_regions(pcg, tuple(steps))
    steps = _with_frees(steps, pcg.outputs)
    if recomputed:
        summary += f"; {len(recomputed)} blocks recomputed in the backward (torch.utils.checkpoint)"
    return Rewrite(steps, pcg.outputs, shapes, summary, tp, stored, recomputed, strided)


def _step(n: PNode, pcg: PCG, lowering: Lowering, data_axes: set[int], static: set[int],
          presliced: dict[int, frozenset[int]], summed: set[int], local: set[str], batch: Mapping[str, int],
          at_local: Mapping[int, tuple]) -> Step:
    """Node `n` as a step (`rewrite_of`), recording which data axes its value is already split along on the rank
    and whether a sum or gather over the data ranks precedes it; a node in `at_local` (`local_attrs`) computes
    with those attributes."""
    where = f"node #{n.id} {n.label}{f' [{n.origin}]' if n.origin else ''}"
    if n.kind == "leaf":
        if n.role == "weight":
            return Step(n.id, WEIGHT, lowering.weight(n.op).params[0])
        if n.op in local and n.op in batch:
            presliced[n.id] = frozenset(lowering.batch_axes)
        return Step(n.id, LEAF, n.op)
    source = n.inputs[0]
    if n.kind == "op":
        ahead = [i for i in n.inputs if presliced.get(i)]
        if ahead:
            raise LoweringError(f"{where} computes on the user's data before the plan splits it over the data ranks "
                                "(each rank is given its local batch): run the plan with the interpreter")
        if any(i in summed for i in n.inputs):
            if n.op == "scale" and n.id not in at_local:
                raise LoweringError(f"{where} scales a value summed or gathered over the data ranks: a constant "
                                    "fixed at the global batch would be off on each rank's local batch")
            summed.add(n.id)
        if n.op in EMBEDDING_OPS and _split_rows(pcg, n, lowering.tensor_axis):
            return Step(n.id, LOOKUP, n.op, n.inputs, n.attrs)
        return Step(n.id, OP, n.op, n.inputs, at_local.get(n.id, n.attrs))
    axis = n.axis(pcg.mesh)
    if source in summed:
        summed.add(n.id)
    if axis == lowering.tensor_axis:
        return Step(n.id, PLACE, inputs=(source,), axis=axis, code=n.placement.codes[axis])
    if n.id in static or axis not in data_axes:   # a weight's storage and sync: torch's
        return Step(n.id, SAME, inputs=(source,))
    split = presliced.get(source, frozenset())
    if n.op == PARTITION:
        if axis in split:
            presliced[n.id] = split - {axis}
            return Step(n.id, SAME, inputs=(source,))
        return Step(n.id, SLICE, inputs=(source,), dim=int(n.attr("dim")), axis=axis, degree=int(n.attr("degree")))
    if n.op not in (REPLICATE, REDUCE, COMBINE, ALL_GATHER):
        raise LoweringError(f"{where} on data axis {pcg.mesh.names[axis]}: a rewritten forward keeps each rank's "
                            "own value over the data ranks, which this collective does not")
    if n.op != REPLICATE:
        summed.add(n.id)
    if split:
        presliced[n.id] = split
    return Step(n.id, SAME, inputs=(source,))


def local_attrs(pcg: PCG, graph: Graph, imported, count: int) -> dict[int, tuple]:
    """Plan node -> its attributes at the rank's local batch (1 / `count` of the plan's), for an import that knows
    which of its graph's nodes fix an attribute at the plan's batch (`run.GraphImport.local_attrs`: a built-in
    example's loss, its 1 / count): the rank's loss is then its local batch's mean, and torch's average over the
    data ranks the plan's. A user's module computes at the batch it is given (its import has none). Each such
    graph node must be computed by a plan node with its attributes (else a LoweringError naming it: an algebraic
    rule moved the constant, whose value at the local batch is not known)."""
    rebuilt = getattr(imported, "local_attrs", None)
    if rebuilt is None or count == 1:
        return {}
    wanted = rebuilt(count)
    plan_attrs = {n.name: n.attrs for n in graph.nodes}
    found = {n.id: wanted[n.origin] for n in pcg.nodes
             if n.kind == "op" and n.origin in wanted and n.attrs == plan_attrs.get(n.origin)}
    missing = sorted(set(wanted) - {pcg.node(i).origin for i in found})
    if missing:
        raise LoweringError(f"graph node(s) {', '.join(missing)} fix an attribute at the plan's batch and no plan node "
                            "computes them as the graph does (an algebraic rule moved it): their value at each rank's "
                            "local batch is not known; run the plan with the interpreter")
    return found


def node_dtypes(pcg: PCG, graph: Graph, dtypes: Mapping[str, NodeDtypes]) -> dict[int, NodeDtypes]:
    """Plan node -> the dtypes the module computes it in (the import's `NodeDtypes` of the graph node whose value
    it computes, `lowering.graph_nodes_computed`), where they are not the parameters': HF's causal loss in float32
    (`logits.float()`), LlamaRMSNorm's normalization in float32. The steps of a vocabulary-parallel logsumexp
    (`ir.megatron`) compute in the logsumexp's dtype, every operand read so. A node an algebraic rule made
    computes as torch promotes its operands."""
    if not dtypes:
        return {}
    vocabulary = {i for ids in vocabulary_parallel_logsumexps(pcg, graph).values() for i in ids}
    out = {}
    for ident, name in graph_nodes_computed(pcg, graph).items():
        found = dtypes.get(name)
        if found is not None and ident in vocabulary and found.makes:
            found = NodeDtypes(tuple((k, found.makes) for k in range(len(pcg.node(ident).inputs))), found.makes)
        if found is not None:
            out[ident] = found
    return out


def _in_module_dtypes(s: Step, dtypes: NodeDtypes, pcg: PCG) -> Step:
    """Step `s` computing in the module's dtypes; a cross-entropy's `nll_sum(x, logsumexp(x), y)` so computed is
    evaluated as torch's `F.cross_entropy` computes it, `-sum(y * log_softmax(x))` (equal in value for every y:
    sum_j y_j (lse - x_j)), so that its gradient is `log_softmax`'s backward on the same float32 values, as the
    module's (HF's `logits.float()` then `F.cross_entropy`), rounded alike: AdamW turns a float32 rounding of
    the logits' gradient taken otherwise into 1e-4 - 1e-3 of a weight in 3 steps (where a gradient is near its
    epsilon)."""
    s = replace(s, reads=dtypes.reads, makes=dtypes.makes)
    if s.name == "nll_sum" and pcg.node(s.inputs[1]).op == "logsumexp" \
            and pcg.node(s.inputs[1]).inputs == (s.inputs[0],):
        s = replace(s, name=NLL_OF_LOG_SOFTMAX)
    return s


NLL_OF_LOG_SOFTMAX = "nll_of_log_softmax"   # `_in_module_dtypes`: nll_sum(x, logsumexp(x), y) as torch computes it


def _split_rows(pcg: PCG, n: PNode, axis: int | None) -> bool:
    """Whether embedding `n` reads its table split along its rows (the vocabulary) on tensor axis `axis`: its
    one-hot ids must then be split along the vocabulary there too (each rank's columns, the plan's SPMD reading:
    a partial sum), else a LoweringError naming the node."""
    if axis is None:
        return False
    onehot, table = (pcg.node(i) for i in n.inputs[:2])
    if table.placement.codes[axis] != shard(0):
        return False
    if n.op != "embedding" or onehot.placement.codes[axis] != shard(len(onehot.shape) - 1):
        why = "with a padding row (a global row index)" if n.op != "embedding" else "without its ids split so"
        raise LoweringError(f"node #{n.id} {n.label}{f' [{n.origin}]' if n.origin else ''} reads a table split along "
                            f"the vocabulary on axis {pcg.mesh.names[axis]} {why}: a rewritten forward looks up "
                            "each rank's rows as the plan's vocabulary-parallel embedding does")
    return True


def _in_regions(pcg: PCG, steps: tuple[Step, ...]) -> tuple[tuple[Step, ...], tuple[Recomputed, ...]]:
    """The steps in the order the interpreter runs a plan that recomputes blocks (`recompute_regions.forward_units`:
    each recomputed block's nodes together, as one region, dependencies kept), and each region's run of them
    (`Recomputed`: what it reads from outside, what is read outside it)."""
    by_node = {s.node: s for s in steps}
    ordered: list[Step] = []
    regions = []
    for unit in forward_units(pcg, by_node):
        if isinstance(unit, Region):
            regions.append(Recomputed(len(ordered), len(ordered) + len(unit.runs), unit.inputs, unit.kept))
            ordered += [by_node[i] for i in unit.runs]
        else:
            ordered.append(by_node[unit])
    return tuple(ordered), tuple(regions)


def _with_frees(steps: tuple[Step, ...], outputs: tuple[int, ...]) -> tuple[Step, ...]:
    """Each step with the values whose last reader it is (outputs kept): the evaluation holds only what is
    still to be read, autograd what backward needs."""
    last: dict[int, int] = {}
    for k, s in enumerate(steps):
        for i in s.inputs:
            last[i] = k
    kept = set(outputs)
    frees: dict[int, list[int]] = {}
    for value, k in last.items():
        if value not in kept:
            frees.setdefault(k, []).append(value)
    return tuple(replace(s, frees=tuple(sorted(frees.get(k, ())))) for k, s in enumerate(steps))


class RewrittenForward:
    """The module's forward replaced (module docstring): takes the inputs as the module's forward takes them,
    returns what it returns. Dropout masks are the import's (`dropout_mask`: seeded per step, sliced as the plan
    reads them); in eval mode none is drawn. On a tensor axis every value is a DTensor on its mesh (the data
    enters `Replicate()`), redistributed to the plan's placement at each of its parallel operators there, and the
    outputs leave whole."""

    def __init__(self, module: torch.nn.Module, rewrite: Rewrite, imported, rank: int, coords: tuple[int, ...]):
        self.module, self.rewrite, self.imported = module, rewrite, imported
        self.signature = inspect.signature(module.forward)   # the module's own (bound: no self)
        self.coords, self.rank = coords, rank
        self.step = 0
        self.shapes = dict(rewrite.local_shapes)

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        inputs = list(bound.arguments.values())
        params = {s.name: self.module.get_parameter(s.name) for s in self.rewrite.steps if s.action == WEIGHT}
        for name, factor in self.rewrite.strided:   # held head-major: read as the module's parameter
            if name in params:
                params[name] = strided_view(params[name], shard_dim(dict(self.rewrite.stored)[name]), factor)
        first = next(iter(params.values()))
        dtype, device = first.dtype, first.device
        data = {k: v.to(device) for k, v in self.imported.constant_values(dtype).items()}
        drawn = self.imported.data_values(inputs, dtype, 0, self.step, self.shapes)
        data.update({k: v.to(device) for k, v in drawn.items()})
        if not self.module.training:   # evaluation: every dropout mask keeps everything, scaled back
            for leaf in self.imported.data.values():
                if leaf.encoding == "dropout" and leaf.name in data:
                    data[leaf.name] = torch.full_like(data[leaf.name], 1.0 - leaf.rate)
        if self.rewrite.tensor_axis is None:
            outs = evaluate(self.rewrite, params, data, self.coords)
        else:
            outs = _on_dtensors(self.rewrite, params, data, self.coords, device)
        if self.module.training:
            self.step += 1
        spec = self.imported.output_spec
        if spec is not None:   # as many leaves as outputs (`rewrite_of`)
            return torch.utils._pytree.tree_unflatten(outs, spec)
        return outs[0] if len(outs) == 1 else tuple(outs)


def _on_dtensors(rewrite: Rewrite, params, data, coords, device) -> list[torch.Tensor]:
    """`evaluate` on a tensor axis: the data as `Replicate()` DTensors on the parameters' tensor-parallel mesh,
    in `apply.dtensor_step` (tensors an operator makes count as `Replicate()`; attention as its math on CPU),
    the outputs whole and local."""
    from torch.distributed.tensor import DTensor, Replicate

    from parsat.backend.torch_native.apply import dtensor_step

    mesh = next(p.device_mesh for p in params.values() if isinstance(p, DTensor))
    data = {k: DTensor.from_local(v, mesh, [Replicate()], run_check=False) for k, v in data.items()}
    with dtensor_step(device):
        outs = evaluate(rewrite, params, data, coords, in_step=partial(_in_step, device))
    return [o.full_tensor() if isinstance(o, DTensor) else o for o in outs]


@contextmanager
def _in_step(device):
    """`apply.dtensor_step` entered when the context is (a block's recomputation runs in the backward, outside the
    forward's context)."""
    from parsat.backend.torch_native.apply import dtensor_step

    with dtensor_step(device):
        yield


def evaluate(rewrite: Rewrite, params: Mapping[str, torch.Tensor], data: Mapping[str, torch.Tensor],
             coords: tuple[int, ...], in_step=nullcontext) -> list[torch.Tensor]:
    """The plan's outputs on this rank: each step in the plan's order (`Step`), values freed after their last
    reader; a recomputed block's steps under `torch.utils.checkpoint` (`Recomputed`), so that its backward runs
    them again (their redistributions too, on every rank alike) instead of keeping their activations. `in_step`:
    the context the forward runs in, entered again around a block's recomputation in the backward (`_in_step`:
    on DTensors, attention as its math on CPU)."""
    from torch.utils.checkpoint import checkpoint

    env: dict[int, torch.Tensor] = {}
    runs = {r.start: r for r in rewrite.recomputed}
    k = 0
    while k < len(rewrite.steps):
        run = runs.get(k)
        if run is None:
            _apply(rewrite.steps[k], env, params, data, coords)
            k += 1
            continue
        block = rewrite.steps[run.start:run.end]

        def forward(*values, block=block, run=run):
            inner = dict(zip(run.needed, values))
            for s in block:
                _apply(replace(s, frees=()), inner, params, data, coords)
            return tuple(inner[i] for i in run.kept)

        env.update(zip(run.kept, checkpoint(forward, *(env[i] for i in run.needed), use_reentrant=False,
                                                  context_fn=lambda: (nullcontext(), in_step()))))
        for i in {i for s in block for i in s.frees}:
            env.pop(i, None)
        k = run.end
    return [env[o] for o in rewrite.outputs]


def _apply(s: Step, env: dict[int, torch.Tensor], params: Mapping[str, torch.Tensor],
           data: Mapping[str, torch.Tensor], coords: tuple[int, ...]) -> None:
    """Step `s` evaluated into `env`, then the values it was the last reader of dropped."""
    if s.action == WEIGHT:
        env[s.node] = params[s.name]
    elif s.action == LEAF:
        env[s.node] = data[s.name]
    elif s.action == OP and s.name == NLL_OF_LOG_SOFTMAX:
        env[s.node] = _in_dtypes(s, lambda _op, a, _attrs: -(a[2] * torch.log_softmax(a[0], dim=-1)).sum(),
                                 [env[i] for i in s.inputs])
    elif s.action == OP:
        env[s.node] = _in_dtypes(s, apply_op, [env[i] for i in s.inputs])
    elif s.action == SLICE:
        x = env[s.inputs[0]]
        size = x.shape[s.dim] // s.degree
        env[s.node] = x.narrow(s.dim, coords[s.axis] * size, size)
    elif s.action == LOOKUP:
        env[s.node] = _in_dtypes(s, lambda op, args, attrs: vocabulary_lookup(op, *args[:2], attrs),
                                 [env[i] for i in s.inputs])
    elif s.action == PLACE:
        x = env[s.inputs[0]]
        env[s.node] = x.redistribute(x.device_mesh, [dtensor_placement(s.code)])
    else:
        env[s.node] = env[s.inputs[0]]
    for i in s.frees:
        del env[i]


def _in_dtypes(s: Step, run, args: list) -> Any:
    """`run(s.name, args, attrs)` with the operands `s.reads` names cast as the module reads them, the value in
    `s.makes` (the module's float32 sections of a float64 model round as the module's do)."""
    for k, dtype in s.reads:
        if args[k].is_floating_point():
            args[k] = args[k].to(getattr(torch, dtype))
    out = run(s.name, args, dict(s.attrs))
    return out.to(getattr(torch, s.makes)) if s.makes else out


def vocabulary_lookup(op: str, onehot, table, attrs: Mapping[str, Any]):
    """A lookup in a table split along its rows on the tensor axis, as the plan's SPMD semantics and Megatron's
    VocabParallelEmbedding compute it: each rank looks its one-hot columns up in its rows (`apply_op` on the local
    pieces: an id another rank holds has an all-zero row here, so its output row is zero), and the result is a
    `Partial()` DTensor, the sum over the ranks. DTensor's own sharding of the lookup fails here (torch 2.13):
    `gather` on the vocabulary-split one-hot makes a `_MaskPartial` whose mask its first reduction releases, and
    the backward of the `mul` that read it reduces the saved value again (AssertionError in
    `_MaskPartial._reduce_value`). The gradient reaches the rank's rows through `to_local`, as DTensor's
    `Shard(0)` of the table."""
    from torch.distributed.tensor import DTensor, Partial

    local = apply_op(op, [onehot.to_local(), table.to_local()], attrs)
    return DTensor.from_local(local, table.device_mesh, [Partial()], run_check=False)


def dtensor_placement(code: int):
    """DTensor's placement for a plan's placement code on one axis (`ir.placement`): whole (free or a replica)
    `Replicate()`, a partial sum `Partial()`, split along d `Shard(d)`."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if code in (FREE, REPLICA):
        return Replicate()
    return Partial() if code == PARTIAL else Shard(shard_dim(code))


def parameter_placement(pcg: PCG, chain: tuple[int, ...], axis: int) -> tuple[int, int]:
    """(placement code, split factor) of the parameter whose storage chain (`ir.pcg.weight_storage`) is `chain`,
    on mesh axis `axis` (`ir.pcg.weight_placement`: stored as a block of its view `unflatten(w, u, k)` split along
    the view's dim u + 1, the parameter's dim u split with split factor m / k, which the runtime holds head-major:
    `head_major`). Another view, or a split of the view elsewhere, raises LoweringError naming it."""
    try:
        placement, factors = weight_placement(pcg, chain)
    except ValueError as err:
        raise LoweringError(f"{err} (lowered: a split of one unflatten's dims, held head-major)") from None
    return placement.codes[axis], factors[axis]


def place_parameters(module: torch.nn.Module, tp_mesh, rewrite: Rewrite) -> None:
    """Every parameter a DTensor on the tensor axis's mesh, placed as the plan stores its weight there (a weight
    the plan keeps whole `Replicate()`, one it stores split `Shard(d)`; a parameter the graph does not read
    `Replicate()`): what `apply.apply_lowering` does instead of the styles when a rewritten forward, calling no
    styled module, reads the parameters. A parameter stored as a strided block (`parameter_placement`: HF GPT-2's
    head-ordered `c_attn`) is held head-major as `Shard(d)` (`head_major`: so `fully_shard` and DCP take it as any
    column-parallel weight), the forward reading it back as the module's parameter and its checkpoint in the
    module's order. A tied parameter stays one tensor under all its names."""
    from torch.distributed.tensor import distribute_tensor

    stored, strided = dict(rewrite.stored), dict(rewrite.strided)
    ranks = tp_mesh.size()
    made: dict[int, tuple[torch.nn.Parameter, int, int]] = {}   # parameter -> its DTensor, split dim and factor
    for name, param in list(module.named_parameters(remove_duplicate=False)):
        if id(param) not in made:
            names = [n for n, p in module.named_parameters(remove_duplicate=False) if p is param]
            code = next((stored[n] for n in names if n in stored), FREE)
            factor = next((strided[n] for n in names if n in strided), 1)
            value = head_major(param.data, shard_dim(code), factor, ranks) if factor > 1 else param.data
            made[id(param)] = (torch.nn.Parameter(distribute_tensor(value, tp_mesh, [dtensor_placement(code)]),
                                                  param.requires_grad), shard_dim(code), factor)
        placed, dim, factor = made[id(param)]
        owner, _, local = name.rpartition(".")
        setattr(module.get_submodule(owner), local, placed)
        if factor > 1:
            checkpoint_in_module_order(module.get_submodule(owner), local, dim, factor, ranks)


def install(module: torch.nn.Module, rewrite: Rewrite, imported, mesh) -> torch.nn.Module:
    """`module` (lowered by `apply.apply_lowering`) computing `rewrite` in place of its own forward, on this rank
    of the plan's `mesh` (`ir.mesh.Mesh`); the same module back."""
    rank = dist.get_rank() % mesh.world
    module.forward = RewrittenForward(module, rewrite, imported, rank, mesh.coords(rank))
    return module
