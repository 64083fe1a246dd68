"""Megatron-LM's layout (data x tensor parallelism, ZeRO-3, sequence parallelism), built directly as a PCG.

The independent grid (`search.baselines.independent_grid`) prices one such
PCG per point (dp, tp, zero, sp), so that "the plan is never worse than any
fitting grid point" holds even where saturation is cut short: these PCGs
come from the graph alone, not from the e-graph or the rules.

The layout is propagated operator by operator, in graph order, with fixed
preferences; the placement analysis (`ir.placement.compute_placement`,
`apply_parallel`) decides what each operator accepts and what it makes,
and nothing is placed by hand:

* the data axis `dp`: every graph input split along its batch dim
  (`ir.microbatch.batch_dims`; replicated where it has none or it does not
  split evenly; a constant the module builds at its batch's shape, BERT's
  attention mask, split along dim 0 with it:
  `ir.microbatch.batch_wide_constants`), every weight replicated (with ZeRO-3 stored split along
  its first dim the axis divides and all-gathered where it is used), values
  computed from weights alone replicated, a partial sum over the batch
  (the loss) reduced where an operator needs it whole, outputs gathered;
* the tensor axis `tp`: the weights a contraction reads (`linear`,
  `linear_nobias`, torch's `linear_t` and `linear_nobias_t` (weight [out, in]:
  column-parallel is its dim 0, row-parallel its dim 1), `matmul`,
  `embedding`, `bmm`, `conv2d`:
  `contraction_weights`) are split: column-parallel (the weight's output
  dim) where the activation arrives replicated, row-parallel (its
  contraction dim, a partial sum) where it arrives split along its last
  dim, the embedding vocabulary-parallel (one-hot ids and table split on
  the vocabulary, a partial sum). A partial sum is all-reduced lazily,
  where the next operator does not accept it (a bias-free residual stream,
  LLaMA's, stays a partial sum from norm to norm); with `reduce_at_once`
  a contraction's partial sum is all-reduced (reduce-scattered, with
  `sequence`) where it is made, as Megatron-LM's row-parallel layers do
  (its g), so every value between layers is whole or split along the
  sequence: what a pipeline stage sends. A row-parallel `linear` runs
  as `linear_nobias` then `bias_add` (its semantics: the same sum plus the
  bias), so its bias is added once after the all-reduce, as Megatron-LM
  adds it; that bias stays whole on the axis. Every other operator follows
  its inputs where the analysis accepts them (heads-parallel attention
  follows from column-parallel q, k, v), otherwise its inputs are
  gathered or reduced, the cheapest way first; norms read whole rows;
* with `sequence` (Megatron-LM's sequence parallelism): a partial sum of
  [batch, seq, hidden] is reduce-scattered along the sequence rather than
  all-reduced, so norms, residuals and element-wise work run on a slice of
  the sequence, and it is all-gathered before a column-parallel GEMM.

Inputs are read in the cheapest placement the analysis accepts, by a fixed
price per conversion (`_conversion`): a layout, not a cost model. A
`logsumexp` of logits split along the vocabulary on the tensor axis runs as
Megatron-LM's vocabulary-parallel cross-entropy (`vocabulary_steps`):
the logits are never gathered. What the builder does not do: splitting the
sequence inside attention (context parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import islice, product
from typing import AbstractSet, Callable, Mapping, Sequence

from parsat.dsl.instantiate import InstantiationError, OpInstance
from parsat.dsl.library import Library
from parsat.dsl.parallel_ops import (ALL_GATHER, COMBINE, PARTITION, REDUCE, REDUCE_SCATTER,
                                     REPLICATE)
from parsat.ir.data_parallel import _live, data_parallel_pcg
from parsat.ir.fused_projections import heads_ordered, with_rules
from parsat.ir.block_replay import BlockReplay, BlockTemplate, ReplayShared, block_runs
from parsat.ir.blocks import OUTSIDE, block_of
from parsat.ir.graph import Graph, Leaf, OpNode, instance_for
from parsat.ir.mesh import Mesh
from parsat.ir.microbatch import batch_dims, batch_wide_constants
from parsat.ir.pcg import PCG, STRIDED_VIEW, VIEW_OPS, Degrees, PNode, StructureTable
from parsat.ir.placement import (FREE, PARTIAL, REPLICA, Placement, PlacementError, apply_parallel,
                                 _signature, axis_compute, codes_for_rank, compute_placement, shard, shard_dim)

DP_AXIS, TP_AXIS = "dp", "tp"
ZERO_LEVELS = (0, 3)
CONTRACTIONS = frozenset({"matmul", "linear", "linear_nobias", "linear_t", "linear_nobias_t", "bmm", "embedding",
                          "conv2d"})
UNBIASED = {"linear": "linear_nobias", "linear_t": "linear_nobias_t"}   # a row-parallel layer's partial sum
OPTIONS_PER_AXIS = 8   # accepted input placements kept per axis, cheapest first, before they are tried together

# fixed prices of reading a value in another placement on one axis (a layout's preferences, not times)
SAME, LOCAL, COPY, SPLIT, SCATTER, SUM, GATHER, RESPLIT = 0, 1, 1, 2, 8, 10, 10, 20


def contraction_weights(graph: Graph) -> frozenset[str]:
    """The weights some contraction reads (a projection, an embedding table, a tied head through a transpose):
    those tensor parallelism splits. A weight read only by element-wise work (a norm's gain, a position table
    added to the embeddings) stays whole on every tensor-parallel rank, as in Megatron-LM."""
    consumers: dict[str, set[str]] = {}
    for node in graph.nodes:
        for source in node.inputs:
            consumers.setdefault(source, set()).add(node.op)
    through = {node.name: node.inputs[0] for node in graph.nodes if node.op == "transpose" and node.inputs}
    found = {source for source, ops in consumers.items() if ops & CONTRACTIONS}
    found |= {through[name] for name in found if name in through}
    return frozenset(w.name for w in graph.weights if w.name in found)


def megatron_pcg(graph: Graph, library: Library, mesh_shape: tuple[int, int], devices_per_node: int = 1, *,
                 zero: int = 0, sequence: bool = False, cache: dict | None = None,
                 kin: dict | None = None, vocabulary_loss: bool = False,
                 reduce_at_once: bool = False, heads_ordered: bool = False) -> PCG | None:
    """Megatron-LM's layout of `graph` on the mesh `dp x tp` (`mesh_shape`; the module docstring), ZeRO-3
    over the data axis with `zero=3`, sequence parallelism with `sequence`. An axis of size 1 is left out of
    the mesh; with `tp == 1` it is data parallelism (`ir.data_parallel`, whose one-axis mesh it is).
    `cache`: a dict the calls for one graph and library may share (operator instances, what they accept).
    `kin`: a dict calls for several graphs may share (a step's graph at several micro-batch counts): a layout
    built for one graph is that layout of another whose sizes differ alone where the build cannot tell them
    apart (`_Kin`), with the other's sizes. `vocabulary_loss`: the loss runs Megatron-LM's vocabulary-parallel
    cross-entropy (`vocabulary_steps`) rather than gathering the logits. Off by default; the search's grid
    (`search.baselines`) asks for it, as Megatron-LM runs: a grid point can be the plan of an imported module,
    whose own cross-entropy the torch runtime runs on the head's split logits as DTensor's loss parallelism
    (`backend.torch_native.loss_parallel`). `reduce_at_once`: each contraction's partial sum on the tensor axis
    reduced where it is made (the module docstring), for a stage plan that is cut into pipeline stages: the lazy
    layout's residual stream of a bias-free model crosses a cut as a partial sum, which a stage cannot send as
    Megatron-LM does (whole, or its piece of the sequence); the same collectives, of the same sizes, in total
    (one per norm lazily, one per row-parallel layer and embedding at once), placed on the stage that makes the
    sum. The pipeline search's grid lays its stage plans out so (`search.step`), sharing them through `kin` with
    the stage plans at its other micro-batch counts: a layout is kept and taken by `reduce_at_once` beside its mesh,
    sequence parallelism and ZeRO level, and the reduction it adds reads of a size only what the lazy layout's
    conversions read (whether a dim splits on the mesh: `_Kin`).

    `heads_ordered`: a fused projection read apart (HF GPT-2's `c_attn`, `ir.fused_projections`) laid out as
    Megatron-LM lays its fused QKV weight out, head by head: the weight and bias stored as the tensor axis's
    partition of their views, each rank's block its heads' q, k and v columns, the attention heads-parallel
    (`heads_ordered_layout`; the torch runtime runs it as a rewritten forward, such a parameter held head-major:
    `backend.torch_native.head_major`).
    Off by default (the plain layout); the search's grid asks for it (`search.baselines.independent_grid`).

    None where the graph cannot be laid out that way (an operator that accepts no placement its inputs can
    be brought to, a size that does not split): the grid then has no such point."""
    if heads_ordered and mesh_shape[1] > 1:
        found = heads_ordered_layout(graph, library, mesh_shape, devices_per_node, zero=zero, sequence=sequence,
                                     cache=cache, vocabulary_loss=vocabulary_loss, reduce_at_once=reduce_at_once)
        if found is not None:
            return found
    dp, tp = (int(s) for s in mesh_shape)
    if zero not in ZERO_LEVELS:
        raise ValueError(f"zero must be one of {ZERO_LEVELS}, got {zero!r}")
    if dp < 1 or tp < 1 or dp * tp < 2:
        return None
    kinship = _Kin.of(kin, library) if kin is not None else None
    if tp == 1 and kinship is None:
        return data_parallel_pcg(graph, library, dp, devices_per_node, zero3=zero == 3)
    axes = [(name, size) for name, size in ((DP_AXIS, dp), (TP_AXIS, tp)) if size > 1]
    mesh = Mesh.of([s for _, s in axes], devices_per_node, names=[n for n, _ in axes])
    memo = kinship.memo(graph, cache) if kinship is not None else _Memo.of(graph, library, cache)
    form = (sequence, zero, reduce_at_once and tp > 1)   # what a kin layout is kept by beside its mesh
    found = kinship.layout(graph, memo, mesh, form) if kinship is not None else _NONE
    if found is not _NONE:
        return found
    if tp == 1:   # data parallelism (`_Kin`: its build reads the sizes as this one's does)
        pcg = data_parallel_pcg(graph, library, dp, devices_per_node, zero3=zero == 3, cache=kinship.placements)
    else:
        pcg = _built_layout(graph, mesh, zero, sequence, memo, cache, vocabulary_loss, reduce_at_once)
    if kinship is not None:
        if pcg is not None:   # a structure laid out before (on another mesh, for another graph): its facts shared
            pcg = kinship.structures.shared(pcg)
        kinship.keep(graph, memo, mesh, form, pcg)
    return pcg


_NONE = object()   # `_Kin.layout`: no kin graph's layout to rescale


def heads_ordered_layout(graph: Graph, library: Library, mesh_shape: tuple[int, int], devices_per_node: int = 1,
                         **options) -> PCG | None:
    """`megatron_pcg` of `graph` with its fused projections written head by head (`fused_projections.heads_ordered`:
    one product per q / k / v block, its weight and bias columns of the weight's and bias's views), each node
    those rewrites made naming the proved rules that made it. The builder stores each view as its partition on
    the tensor axis (`_MegatronBuilder.stored_view`): each rank's heads. None where the graph has no fused
    projection or that graph cannot be laid out (`megatron_pcg`'s other options as given; no `kin`). Under ZeRO-3
    the view's piece on the tensor axis is split again on the data axis and all-gathered, as a weight's is
    (`_MegatronBuilder.on_data_axis`; the torch runtime holds such a parameter head-major, a plain `Shard(d)` on
    tp that `fully_shard` shards again: `torch_native.head_major`)."""
    cache = options.pop("cache", None)
    written = cache.get(("heads_ordered", id(graph))) if cache is not None else None
    if written is None or written[0] is not graph:
        written = (graph, heads_ordered(graph))
        if cache is not None:
            cache[("heads_ordered", id(graph))] = written
    if written[1] is None:
        return None
    rewritten, made = written[1]
    own = cache.setdefault(("heads_ordered_cache", id(graph)), {}) if cache is not None else None
    pcg = megatron_pcg(rewritten, library, mesh_shape, devices_per_node, cache=own, **options)
    if pcg is None:
        return None
    return replace(pcg, nodes=tuple(with_rules(pcg.nodes, made, library.rule_locations)))


def _built_layout(graph: Graph, mesh: Mesh, zero: int, sequence: bool, memo: "_Memo",
                  cache: dict | None, vocabulary_loss: bool = False, reduce_at_once: bool = False) -> PCG | None:
    """`megatron_pcg` on a mesh with a tensor axis, for this graph: built, or its ZeRO-3 form derived from the
    layout without it where `cache` holds that one's build."""
    # the builds without ZeRO-3 by (graph, mesh, sequence), beside the memo rather than in it: a builder holds the
    # memo, so the memo holding builders would be a cycle that only the collector frees
    builds = cache.setdefault("built", {}) if cache is not None else {}
    key = (id(graph), mesh, sequence, vocabulary_loss, reduce_at_once)
    built = builds.get(key) if zero == 3 else None
    if built is not None and built[2] is graph:   # built without ZeRO-3: its weights' chains rewritten
        derived = built[0].sharded_nodes(built[1])
        if derived is not None:
            return _live(derived[0], derived[1], tuple(graph.outputs), mesh)
    build = _MegatronBuilder(graph, mesh, zero == 3, sequence, memo, vocabulary_loss, reduce_at_once)
    for leaf in graph.leaves:
        build.place_leaf(leaf)

    def place(run: Sequence[OpNode]) -> str | None:
        for gnode in run:
            if gnode.name in build.static:
                continue   # made where it is read, in the placement its reader needs (`weight_value`)
            if not build.place_graph_node(gnode):
                return gnode.name
        return None
    # the graph's nodes, a block's a run: one laid out as the one before, repeated
    if _Repeats(build, memo.replays).lay_out(memo.runs, place) is not None:
        return None
    outputs = [build.gathered(name) for name in graph.outputs]
    if any(o is None for o in outputs):
        return None
    if zero == 0 and cache is not None:
        builds[key] = (build, outputs, graph)
    return _live(build.nodes, outputs, tuple(graph.outputs), mesh)


class _Kin:
    """Layouts built for graphs of one structure, reused for another graph of that structure
    (`megatron_pcg`'s `kin`): a step's graph at another micro-batch count differs in its sizes alone.

    What the build reads of a size is, by reading `_MegatronBuilder` through: ranks; whether a dim splits into
    blocks of a product of the mesh's axis sizes (`_splits`, `Placement.local_shape`, an input's batch dim, a
    weight's ZeRO-3 dim, which is its dim split on both axes); whether an operator instantiates at its inputs'
    shapes; and which placements it accepts (`axis_compute`), which reads the instance's signature (its
    operator, ranks, attributes and variadic groups, never its sizes: `placement._signature`). So where two
    graphs have the same leaves, operators, inputs, attributes, outputs and batch dims, every dim of every
    value splits by the same products of the mesh's axis sizes in both, and every operator (and the
    bias-less form of each `linear`, which a row-parallel layer reads) instantiates in both, with the same
    signature, each step of the build goes alike for both: the layouts differ in their nodes' shapes alone,
    each the shape of the value it holds (`_rescaled`). The verdict is worked out once per pair of graphs and
    mesh; the graphs stay alive in the dict, so their identities cannot be reused. The same graph laid out again
    (bert-large's stage grids are asked for one graph under two schedules) takes its layout as it is.

    Data parallelism (tp 1, `ir.data_parallel`) is taken so too: its build reads of a size only whether an input's
    dim 0, a ZeRO-3 weight's dims and a weight-only value's dim 0 split into dp blocks, whether an operator
    instantiates, and the placement analysis's answers, by signature; besides the structure it reads which
    inputs the graph names constant, which `_alike` compares. The nodes it adds of its own (a weight-only value
    computed whole, a mean's sum and scale over the split batch) name no graph value as their origin, so
    `_rescaled` finds no shape for them and the layout is built instead (issue 28: llama-70b:64's seven grids
    built their two data-parallel layouts each).

    What every build of the grid's calls shares besides (`memo`): one graph's `_Memo` for every call that lays
    it out (a stage grid's graph is the unstaged step's at that micro-batch count; on other meshes and
    machines: every entry of a memo is kept by what it reads, the mesh's part included, as the layouts of one
    call on several meshes already share it), and the placement analysis's answers (`placement.axis_compute`'s
    cache) for every graph and mesh: kept by the operator's signature and its input codes on one axis, which is
    all the answer reads (the sizes not, `placement._signature`), so a graph of other sizes or a layout on
    another mesh finds them as its own would work them out."""

    def __init__(self, library: Library, examples: dict | None = None):
        self.library = library
        # (mesh, (sequence, zero, reduce_at_once)) -> built
        self.layouts: dict[tuple, list[tuple[Graph, PCG | None]]] = {}
        self.batches: dict[int, tuple[Graph, dict]] = {}                 # id(graph) -> (graph, its batch dims)
        self.verdicts: dict[tuple, tuple[Graph, Graph, bool]] = {}      # (like, graph, mesh shape) -> verdict
        self.parts: dict[tuple, tuple[Graph, Graph, bool]] = {}         # (part, (like, graph)) -> its answer
        self.placements: dict = {}               # `axis_compute`'s cache, for every graph and mesh
        self.memos: dict[int, "_Memo"] = {}      # id(graph) -> its memo (which keeps the graph alive)
        # `batch_dims`' examples built, by name and sizes: the call's own where its kin dict holds them ("examples":
        # `search.request.SearchRequest.examples`, where its steps' graphs are built)
        self.examples: dict = {} if examples is None else examples
        self.structures = StructureTable()       # every layout built, by its structure (`megatron_pcg`)

    def memo(self, graph: Graph, cache: dict | None) -> "_Memo":
        """`graph`'s memo, shared with every call that lays it out (and kept in `cache` as `_Memo.of` keeps it).
        A new graph's batch dims (`batch_dims`, which builds a built-in example twice) are those of an equal graph
        memo'd before (a step's graph made twice: llama-70b:64's stage grids at 32 micro-batches on 16 and on 8
        devices), `batch_dims` being a function of the graph's content and the library; else worked out with the
        examples built for the other graphs (`batch_dims`' `built`)."""
        memo = self.memos.get(id(graph))
        if memo is None or memo.graph is not graph:
            equal = next((m for m in self.memos.values() if m.graph == graph), None)
            memo = self.memos[id(graph)] = _Memo(graph, self.library, self.placements, self.examples,
                                                 equal.batch if equal is not None else None)
        if cache is not None:
            cache["memo"] = memo
        return memo

    @staticmethod
    def of(kin: dict, library: Library) -> "_Kin":
        found = kin.get("kin")
        if found is None or found.library is not library:
            found = kin["kin"] = _Kin(library, kin.get("examples"))
        return found

    def keep(self, graph: Graph, memo: "_Memo", mesh: Mesh, form: tuple, pcg: PCG | None) -> None:
        self.batches[id(graph)] = (graph, memo.data_batch)
        self.layouts.setdefault((mesh, form), []).append((graph, pcg))

    def layout(self, graph: Graph, memo: "_Memo", mesh: Mesh, form: tuple):
        """The layout rescaled from a kin graph's of the same `form` (sequence parallelism, ZeRO level,
        `reduce_at_once`; None where the build finds none), or `_NONE`. A layout rescaled is kept as this graph's
        (`keep`): the same graph laid out again takes it as it is (the step's data-parallel baseline and its grid's
        tp 1 point: `search.baselines.data_parallel`), rather than rescaling it again."""
        entries = self.layouts.get((mesh, form), ())
        for like, pcg in entries:
            if like is graph:   # laid out already (a stage's grid for another schedule): the build is a function
                return pcg
        for like, pcg in entries:
            if self.alike(like, graph, memo.data_batch, mesh):
                found = _rescaled(pcg, like, graph, self.tables(like, graph)) if pcg is not None else None
                if pcg is None or found is not None:
                    self.keep(graph, memo, mesh, form, found)
                    return found
        return _NONE

    def tables(self, like: Graph, graph: Graph) -> "_PairTables":
        """`_PairTables` of `like` and `graph`, made once per pair: every layout rescaled from `like` to `graph` (a
        grid's dozen) reads the same two graphs' shapes and operators, which each rescale made again (4 shape
        tables of ~6,400 values each)."""
        key = ("tables", (id(like), id(graph)))
        found = self.parts.get(key)
        if found is None:   # kept beside both graphs, so that their ids stay theirs
            found = self.parts[key] = (like, graph, _PairTables.of(like, graph))
        return found[2]

    def alike(self, like: Graph, graph: Graph, batch: dict, mesh: Mesh) -> bool:
        """`_alike` on `mesh`, worked out once per pair of graphs and mesh shape, and its parts that read no mesh
        (`_same_structure`, `_same_signatures`) once per pair of graphs, each where `_alike` would ask it: a grid
        lays a graph out on every mesh of its devices (llama-70b:64's unstaged counts: four), and the signatures
        were most of each verdict."""
        key = (id(like), id(graph), tuple(mesh.shape))
        if key not in self.verdicts:
            pair = (id(like), id(graph))

            def part(name: str, check) -> bool:   # kept beside both graphs, so that their ids stay theirs
                found = self.parts.get((name, pair))
                if found is None:
                    found = self.parts[(name, pair)] = (like, graph, check())
                return found[2]
            self.verdicts[key] = (like, graph, _alike(like, graph, self.library, self.batches[id(like)][1], batch,
                                                      _blocks(mesh.shape), part))
        return self.verdicts[key][2]


def _blocks(sizes: Sequence[int]) -> tuple[int, ...]:
    """The products of the mesh's axis sizes (every non-empty set of axes): the block counts a dim is split into."""
    out = {1}
    for size in sizes:
        out |= {k * size for k in out}
    return tuple(sorted(out - {1}))


def _alike(like: Graph, graph: Graph, library: Library, like_batch: dict, batch: dict,
           blocks: Sequence[int], once: Callable[[str, Callable[[], bool]], bool] | None = None) -> bool:
    """Whether `graph` is `like` with other sizes that the build cannot tell apart on a mesh whose dims split
    into `blocks` (`_Kin`): the same structure and batch dims (`_same_structure`), every dim splitting into
    `blocks` in both or in neither (`_splits_alike`), and every operator instantiating in both with the same
    signature (`_same_signatures`). Each check reads only its arguments; asked in this order, each only where
    those before it hold. `once(name, check)`: the answer of a check that reads no mesh, which a caller asking
    of several meshes keeps (`_Kin.alike`)."""
    once = once or (lambda _name, check: check())
    return once("structure", lambda: _same_structure(like, graph, like_batch, batch)) and \
        _splits_alike(once("dims", lambda: _differing_dims(like, graph)), blocks) and \
        once("signatures", lambda: _same_signatures(like, graph, library))


def _same_structure(like: Graph, graph: Graph, like_batch: dict, batch: dict) -> bool:
    """Whether the graphs have the same leaves, operators, inputs, ranks, outputs, constants and batch dims."""
    def structure(g: Graph) -> tuple:   # the attributes: in the signatures (their real values are not read)
        return (tuple((l.name, l.role, len(l.shape)) for l in g.leaves),
                tuple((n.name, n.op, tuple(n.inputs), len(n.shape)) for n in g.nodes), tuple(g.outputs),
                g.constants)

    return structure(like) == structure(graph) and like_batch == batch


def _differing_dims(like: Graph, graph: Graph) -> frozenset[tuple[int, int]]:
    """Each (size in `like`, size in `graph`) that some dim of some value has, where the two differ (`like` of
    `graph`'s structure: `_same_structure`): all `_splits_alike` reads of the graphs, worked out once per pair
    rather than once per mesh (a dim of one size in both splits alike into every block count)."""
    before, after = like.shapes(), graph.shapes()
    return frozenset((a, b) for name, shape in before.items() for a, b in zip(shape, after[name]) if a != b)


def _splits_alike(dims: frozenset[tuple[int, int]], blocks: Sequence[int]) -> bool:
    """Whether every dim of every value of `like` (whose structure `graph` has: `_same_structure`) splits into
    each of `blocks` exactly where the same dim of `graph` does, given their sizes where they differ
    (`_differing_dims`): the part of `_alike` that reads the mesh."""
    return not any((a % k == 0) != (b % k == 0) for a, b in dims for k in blocks)


def _same_signatures(like: Graph, graph: Graph, library: Library) -> bool:
    """Whether every operator of `graph` (of `like`'s structure), and the bias-less form of each row-parallel
    layer with its bias add, instantiates at its shapes in both graphs with the same signature."""
    before, after = like.shapes(), graph.shapes()
    seen: dict = {}
    old_attrs = {n.name: n.attrs for n in like.nodes}
    for node in graph.nodes:
        forms = [(node.op, node.inputs, old_attrs[node.name], node.attrs)]
        if node.op in UNBIASED and len(node.inputs) > 2:   # a row-parallel layer: its partial sum, then its bias
            forms += [(UNBIASED[node.op], node.inputs[:2], (), ()), ("bias_add", (node.name, node.inputs[2]), (), ())]
        for op, inputs, was, attrs in forms:
            if _signature_at(library, op, [before[i] for i in inputs], was, seen) != \
                    _signature_at(library, op, [after[i] for i in inputs], attrs, seen):
                return False
    return True


def _signature_at(library: Library, op: str, shapes: Sequence[Sequence[int]], attrs: Sequence, seen: dict):
    """The operator's signature at these shapes and attributes (`placement._signature`: its integer attributes,
    not its real ones, such as a loss's 1 / tokens, which scale values and index nothing), None where it does not
    instantiate."""
    key = (op, tuple(tuple(s) for s in shapes), tuple(attrs))
    if key not in seen:
        try:
            seen[key] = _signature(instance_for(library.ops[op], key[1], dict(attrs), {}))
        except (InstantiationError, KeyError):
            seen[key] = None
    return seen[key]


@dataclass(frozen=True)
class _PairTables:
    """What `_rescaled` reads of a kin graph `like` and the graph a layout is rescaled to: each graph's value ->
    shape (`Graph.shapes`) and operator name -> node; and `values`, what `_value_rescaled` worked out per node
    content for this pair, filled as asked (every layout rescaled from `like` to `graph` asks again for the same
    nodes' values: a grid's dozen layouts, each of ~6,400 nodes of far fewer contents). Read only, but `values`."""

    before: dict
    after: dict
    was: dict
    now: dict
    logsumexps: tuple   # `like`'s logsumexp nodes (`_vocabulary_parts`)
    values: dict = field(default_factory=dict, compare=False)

    @staticmethod
    def of(like: Graph, graph: Graph) -> "_PairTables":
        return _PairTables(like.shapes(), graph.shapes(), {n.name: n for n in like.nodes},
                           {n.name: n for n in graph.nodes}, tuple(n for n in like.nodes if n.op == "logsumexp"))


def _rescaled(pcg: PCG, like: Graph, graph: Graph, tables: _PairTables | None = None) -> PCG | None:
    """`pcg`, a layout of `like`, with each node's shape that of the value it holds in `graph` (a leaf's, an
    operator's origin's, a row-parallel layer's partial sum's its layer's, a parallel operator's its input's),
    and a graph operator's attributes its own in `graph`; None where a node's shape or attributes are not its
    value's in `like` (then build it). `tables`: the two graphs' `_PairTables`, where the caller keeps them.
    A leaf's or an operator's answer reads its kind, operator, origin and attributes and the pair's tables alone
    (`_value_rescaled`), so it is kept in the tables by those (`_PairTables.values`) and read from there."""
    tables = tables or _PairTables.of(like, graph)
    parts = _vocabulary_parts(pcg, tables)
    known = tables.values
    old_nodes = pcg.nodes
    nodes: list[PNode] = []
    append = nodes.append
    for node in old_nodes:
        kind, attrs = node.kind, node.attrs
        if kind == "parallel":   # its input's shapes: the input's node before and after (`nodes`, as made)
            source = node.inputs[0]
            old, new = old_nodes[source].shape, nodes[source].shape
        else:
            part = parts.get(node.origin) if parts and kind == "op" else None
            if part is not None:
                old, new, attrs = part
            else:
                key = (kind, node.op, node.origin, attrs)
                found = known.get(key)
                if found is None:
                    found = known[key] = _value_rescaled(tables, kind, node.op, node.origin, attrs)
                if found is _NOT_ITS:
                    return None
                old, new, now = found
                if now is not None:
                    attrs = now
        if node.shape != old:
            return None
        append(node if new == old and attrs == node.attrs else
               PNode(node.id, kind, node.op, node.inputs, attrs, tuple(new), node.degrees, node.role, node.origin,
                     node.placement, node.rules))
    # the same structure (each node the layout's own, or made from it with its `STRUCTURE` fields, just above):
    # the facts read from it alone are shared
    return pcg.reshaped(tuple(nodes), kept_structure=True)


_NOT_ITS = ("not its value's",)   # `_value_rescaled`: the node's attributes or value are not the kin graph's


def _value_rescaled(tables: _PairTables, kind: str, op: str, origin: str, attrs: tuple) -> tuple:
    """A leaf's or a graph operator's node of these fields, for `_rescaled`: (the shape of the value it holds in
    `like`, in `graph`, the graph operator's attributes in `graph`, None for a node that keeps its own: a leaf, a
    bias or a partial sum), or `_NOT_ITS` where it holds no value of `like` or its attributes are not its
    operator's there. Kept by `attrs` only as far as they are compared (equal keys, equal verdicts): what a node
    keeps is its own attributes, never those of another node with equal ones (1 and 1.0 are equal keys)."""
    before, was = tables.before, tables.was
    name = op if kind == "leaf" else origin
    if kind == "op" and op in UNBIASED.values() and name not in before:
        name = name.removesuffix("_nobias")
    if name not in before:
        return _NOT_ITS
    if name in was and op == was[name].op:   # the graph's operator itself (else its bias or partial sum)
        if attrs != tuple(was[name].attrs):
            return _NOT_ITS
        return before[name], tables.after[name], tuple(tables.now[name].attrs)
    return before[name], tables.after[name], None


def vocabulary_steps(name: str, logits: str, rows: Sequence[int], vocab: int, p: int) -> list[tuple]:
    """The operators that make logsumexp `name` of `logits` [*rows, vocab], split along the vocabulary in p
    blocks on the tensor axis, as Megatron-LM's vocabulary-parallel cross-entropy computes it, never gathering
    the logits: each rank's block maximum, the p maxima gathered (Megatron all-reduces their max: a value a
    row) and their max taken, each rank's shifted sum of exps (a partial sum, all-reduced), then max + log(sum).
    The same value by the proven rules `logsumexp_shifted_parts` and `amax_vocab_parallel`
    (rules/parallel_layers.rule); the placement analysis makes the sum's pieces partial sums, as
    `sumexp_shifted_vocab_parallel` does. Each step is (value, op, inputs, attrs, shape), for
    `_MegatronBuilder.place`. The blocks are cut from [*rows, 1, vocab] (a unit dim after the rows), so that no
    value is a rank-3 one split on its dim 1 on the tensor axis, which a plan's reading and the `--degrees sp`
    pin take for a sequence cut (`parallelism.along_sequence`)."""
    rows, r = tuple(rows), len(rows)   # r >= 1: the logits' last row dim takes a unit dim after it
    part = {k: f"{name}_{k}" for k in VOCABULARY_PARTS}
    return [(part["unit"], "unflatten", (logits,), (("dim", r - 1), ("k", 1)), (*rows, 1, vocab)),
            (part["blocks"], "unflatten", (part["unit"],), (("dim", r + 1), ("k", vocab // p)),
             (*rows, 1, p, vocab // p)),
            (part["block_max"], "amax", (part["blocks"],), (), (*rows, 1, p)),
            (part["row_max"], "amax", (part["block_max"],), (), (*rows, 1)),
            (part["max"], "flatten", (part["row_max"],), (("dim", r - 1),), rows),
            (part["sumexp"], "sumexp_shifted", (logits, part["max"]), (), rows),
            (part["log"], "log", (part["sumexp"],), (), rows),
            (name, "add", (part["max"], part["log"]), (), rows)]


VOCABULARY_PARTS = ("unit", "blocks", "block_max", "row_max", "max", "sumexp", "log")   # `vocabulary_steps`' values


def vocabulary_parallel_logsumexps(pcg: PCG, graph: Graph) -> dict[str, frozenset[int]]:
    """Each logsumexp of `graph` that `pcg` computes as `vocabulary_steps` (Megatron-LM's vocabulary-parallel
    cross-entropy): its name -> the ids of the plan's operators of those steps, the last (named as the logsumexp
    itself, max + log(sum)) included. What a runtime reads to run them as one loss (the torch runtime's
    `loss_parallel`) rather than as rewrites of the graph."""
    names = {n.name for n in graph.nodes if n.op == "logsumexp"}
    parts = {f"{name}_{k}": name for name in names for k in VOCABULARY_PARTS}
    split = {parts[n.origin] for n in pcg.nodes if n.kind == "op" and n.origin in parts}
    return {name: frozenset(n.id for n in pcg.nodes if n.kind == "op" and (
        n.origin == name or parts.get(n.origin) == name)) for name in sorted(split)}


def _vocabulary_parts(pcg: PCG, tables: _PairTables) -> dict[str, tuple]:
    """The values of each vocabulary-parallel logsumexp in `pcg` (`vocabulary_steps`) but the logsumexp itself:
    name -> (its shape in `like`, its shape and attributes in the graph rescaled to), for `_rescaled`, read off the
    pair's `tables` (the kin graph's logsumexps, each graph's shapes)."""
    made = _first_made(pcg)
    out = {}
    for gnode in tables.logsumexps:
        if f"{gnode.name}_blocks" not in made:
            continue
        blocks = pcg.node(made[f"{gnode.name}_blocks"])
        p = blocks.shape[-2]
        old, new = (vocabulary_steps(gnode.name, gnode.inputs[0], shapes[gnode.name], shapes[gnode.inputs[0]][-1], p)
                    for shapes in (tables.before, tables.after))
        out.update({o[0]: (tuple(o[4]), tuple(n[4]), tuple(n[3])) for o, n in zip(old[:-1], new[:-1])})
    return out


def _first_made(pcg: PCG) -> Mapping[str, int]:
    """Graph value -> the id of the first operator node of `pcg` that names it its origin (`_vocabulary_parts`
    looks the steps up by it). It reads the nodes' kinds, origins and ids alone (`STRUCTURE`), so it is kept in
    `PCG.structural`: the layouts of one structure (`StructureTable`, `reshaped`) share one, where each rescale
    walked its layout's ~6,400 nodes for it. Read it, never change it."""
    def make() -> dict[str, int]:
        first: dict[str, int] = {}
        for n in pcg.nodes:
            if n.kind == "op":
                first.setdefault(n.origin, n.id)
        return first
    return pcg.derive("first_made", None, make, structural=True)


_OWN_ENDINGS = tuple(f"_{suffix}" for suffix in ("nobias", *VOCABULARY_PARTS))   # `_Memo.own_names_apart`


class _Memo:
    """What every layout of one graph shares: its batch dims, operator instances by shapes and attributes, and
    which codes each accepts on one axis (`axis_compute`, by the instance's key)."""

    def __init__(self, graph: Graph, library: Library, placements: dict | None = None, examples: dict | None = None,
                 batch: Mapping[str, int] | None = None):
        self.graph, self.ops = graph, library.ops
        # `batch`: this graph's batch dims where the caller knows them (`_Kin.memo`); `examples`: `batch_dims`' built
        self.batch = dict(batch) if batch is not None else batch_dims(graph, library, examples)
        # ... and on a data axis, with the constants the module builds at its batch's shape (`batch_wide_constants`:
        # BERT's attention mask and token-type one-hots), split with the batch as each rank's forward builds them
        self.data_batch = {**self.batch, **{name: 0 for name in batch_wide_constants(graph, self.batch)}}
        self.instances: dict = {}    # `instance_for`'s memo
        self.accepts: dict[tuple, int | None] = {}
        # `compute_placement`'s own cache (`axis_compute`'s: by signature and codes), shared across graphs by `_Kin`
        self.placements: dict = {} if placements is None else placements
        self.options: dict[tuple, list[tuple[float, tuple[int, ...]]]] = {}   # `_MegatronBuilder.known_options`
        self.runs = block_runs(graph)   # the graph's nodes in runs of one block (`_Repeats`)
        self.replays = ReplayShared()   # what every layout's replay of these runs shares (`_Repeats.context`)
        self.statics: dict[frozenset, frozenset[str]] = {}                 # `static`'s memo

    @cached_property
    def weight_names(self) -> frozenset[str]:
        """The graph's weights' names: what `weighted`, `views` and `static` start from."""
        return frozenset(w.name for w in self.graph.weights)

    @cached_property
    def weighted(self) -> frozenset[str]:
        """The weights and the values made of them alone (`_made_of`), for every builder of the graph."""
        return _made_of(self.graph, self.weight_names)

    @cached_property
    def views(self) -> frozenset[str]:
        """The weights seen through views alone (`_views_of`), for every builder of the graph."""
        return _views_of(self.graph, self.weight_names)

    @cached_property
    def own_names_apart(self) -> bool:
        """Whether no name the builder gives a value of its own (a row-parallel layer's partial sum
        `{node}_nobias`, a vocabulary-parallel loss's steps `{node}_{part}`) is a graph value's: then a builder's
        shape of every graph value is the graph's (`_Repeats.context`)."""
        nodes = {n.name for n in self.graph.nodes}
        return not any(name.endswith(_OWN_ENDINGS) and any(
            name.endswith(end) and name[:-len(end)] in nodes for end in _OWN_ENDINGS) for name in self.graph.shapes())

    def static(self, unsplit: frozenset[str]) -> frozenset[str]:
        """The weights, the inputs `unsplit` and the values made of them alone (`_made_of`): what a builder whose
        data axis leaves `unsplit` whole makes where it is read. A function of the graph and `unsplit`, kept by it:
        a grid's layouts on meshes of one data axis size ask the same."""
        found = self.statics.get(unsplit)
        if found is None:
            found = self.statics[unsplit] = _made_of(self.graph, self.weight_names | unsplit)
        return found

    @staticmethod
    def of(graph: Graph, library: Library, cache: dict | None) -> "_Memo":
        memo = (cache or {}).get("memo")
        if memo is None or memo.graph is not graph:
            memo = _Memo(graph, library)
            if cache is not None:
                cache["memo"] = memo
        return memo

    def instance(self, op: str, shapes: Sequence[Sequence[int]], attrs: Sequence) -> tuple[tuple, OpInstance | None]:
        """The operator at these shapes and attributes (None where it does not instantiate), and its key."""
        key = (op, tuple(tuple(s) for s in shapes), tuple(attrs))
        try:
            return key, instance_for(self.ops[op], key[1], dict(attrs), self.instances)
        except (InstantiationError, KeyError):
            return key, None

    def accepted(self, key: tuple, instance: OpInstance, codes: tuple[int, ...]) -> int | None:
        """The output code of the operator on one axis for these input codes; None where it refuses them."""
        found = self.accepts.get((key, codes), -1)
        if found == -1:
            found = self.accepts[(key, codes)] = axis_compute(instance, codes, self.placements)[0]
        return found


@dataclass(frozen=True)
class _Operand:
    """An input of an operator being placed: the graph value, and whether it is static: made of weights and
    inputs the data axis does not split alone (what every data-parallel rank holds alike)."""

    name: str
    shape: tuple[int, ...]
    static: bool


class _MegatronBuilder:
    """The PCG of one graph while `megatron_pcg` builds it. Activations are placed forward, in graph order, and
    keep every placement they were brought to (`forms`); static values (weights, inputs the data axis does not
    split, and the values made of them alone) are made on demand, in the placement their reader needs
    (`weight_value`), so a weight is split once, as its reader splits it, and stored so, and a table such as
    a rotary one is replicated as an input, whose copies need no gradient."""

    def __init__(self, graph: Graph, mesh: Mesh, zero3: bool, sequence: bool, memo: _Memo,
                 vocabulary_loss: bool = False, reduce_at_once: bool = False):
        self.mesh, self.zero3, self.sequence, self.memo = mesh, zero3, sequence, memo
        self.vocabulary_loss, self.reduce_at_once = vocabulary_loss, reduce_at_once
        self.data = mesh.index(DP_AXIS) if DP_AXIS in mesh.names else None
        self.tensor = mesh.index(TP_AXIS)
        self.graph_nodes = {n.name: n for n in graph.nodes}
        self.leaves = {leaf.name: leaf for leaf in graph.leaves}
        self.shapes = dict(graph.shapes())
        self.batch = memo.data_batch if self.data is not None else memo.batch
        size = mesh.size(self.data) if self.data is not None else 1
        self.unsplit = frozenset(leaf.name for leaf in graph.leaves if leaf.role == "input" and (
            self.batch.get(leaf.name) is None or leaf.shape[self.batch[leaf.name]] % size != 0))
        self.weighted = memo.weighted                 # weights and values of them alone
        self.static = memo.static(self.unsplit)       # ... and of unsplit inputs
        self.views = memo.views                       # weights seen through views alone
        self.nodes: list[PNode] = []
        self.leaf_ids: dict[str, int] = {}
        self.forms: dict[str, dict[Placement, int]] = {}             # activation -> placement -> node
        self.made: dict[tuple[str, Placement], int | None] = {}      # weight value at a placement -> node
        self.cache = memo.placements
        # what repeats block after block within one layout, worked out once: a placement's degrees at a shape
        # (`add`); and the input codes an operator accepts on an axis from its operands as they lie (`place`),
        # which the layouts of one graph share (`known_options`)
        self.degrees: dict[tuple[Placement, tuple[int, ...]], Degrees] = {}
        self.options = memo.options
        self.chains: list[_Chain] = []   # without ZeRO-3: the chains ZeRO-3 would store split (`stored_weight`)

    # ------------------------------------------------------------------ nodes
    def add(self, kind: str, op: str, inputs: Sequence[int], attrs: Sequence, shape: Sequence[int],
            placement: Placement, role: str = "", origin: str = "") -> int:
        """Append a node (its degrees follow from its placement; PlacementError if a dim does not split)."""
        known = (placement, tuple(shape))
        degrees = self.degrees.get(known)
        if degrees is None:
            placement.local_shape(shape, self.mesh.shape)
            degrees = self.degrees[known] = Degrees.of_placement(placement, self.mesh, len(shape))
        self.nodes.append(PNode(len(self.nodes), kind, op, tuple(inputs), tuple(attrs), tuple(shape), degrees, role,
                                origin, placement))
        return len(self.nodes) - 1

    def parallel(self, op: str, source: int, axis: int, dim: int | None = None) -> int:
        """Append the parallel operator `op` on mesh axis `axis`, reading `source` (PlacementError if illegal)."""
        node = self.nodes[source]
        attrs = ((("dim", dim),) if dim is not None else ()) + (("axis", self.mesh.axes[axis].name),
                                                                 ("degree", self.mesh.size(axis)))
        return self.add("parallel", op, (source,), attrs, node.shape, apply_parallel(node.placement, op, axis, dim))

    def leaf(self, leaf: Leaf) -> int:
        if leaf.name not in self.leaf_ids:
            self.leaf_ids[leaf.name] = self.add("leaf", leaf.name, (), (), leaf.shape, Placement.whole(len(self.mesh)),
                                                leaf.role, leaf.name)
        return self.leaf_ids[leaf.name]

    def place_leaf(self, leaf: Leaf) -> None:
        """A graph input split along its batch dim on the data axis, whole on the tensor axis until a reader needs
        it otherwise. Weights and the inputs the data axis does not split (no batch dim, or one that does not
        split evenly) are made where they are read (`weight_value`): replicated there."""
        if leaf.name in self.static:
            return
        node = self.leaf(leaf)
        if self.data is not None:
            node = self.parallel(PARTITION, node, self.data, self.batch[leaf.name])
        self.forms[leaf.name] = {self.nodes[node].placement: node}

    # ------------------------------------------------------------------ operators
    def place_graph_node(self, gnode) -> bool:
        """A graph operator placed (False: it accepts nothing its inputs can be brought to). A `linear` whose
        input arrives split along its last dim on the tensor axis is row-parallel: `linear_nobias` (a partial
        sum; `linear_nobias_t` for torch's `linear_t`) then `bias_add`, so the bias is added once, after the all-reduce."""
        if gnode.op in UNBIASED and self.split_on_features(gnode.inputs[0]):
            partial = f"{gnode.name}_nobias"
            self.shapes[partial] = tuple(gnode.shape)
            return self.place(partial, UNBIASED[gnode.op], gnode.inputs[:2], (), gnode.shape) and \
                self.place(gnode.name, "bias_add", (partial, gnode.inputs[2]), (), gnode.shape)
        if gnode.op == "logsumexp" and self.vocabulary_loss and self.split_on_features(gnode.inputs[0]):
            steps = self.vocabulary_parallel(gnode.name, gnode.inputs[0])
            if steps is not None:
                return all(self.place(*step) for step in steps)
        return self.place(gnode.name, gnode.op, gnode.inputs, gnode.attrs, gnode.shape)

    def vocabulary_parallel(self, name: str, logits: str) -> list[tuple] | None:
        """`vocabulary_steps` for logsumexp `name` of `logits`, their shapes known to the builder; None where the
        vocabulary does not split on the tensor axis."""
        *rows, vocab = self.shapes[logits]
        p = self.mesh.size(self.tensor)
        if vocab % p or not rows:
            return None
        steps = vocabulary_steps(name, logits, rows, vocab, p)
        for value, _op, _inputs, _attrs, shape in steps[:-1]:
            self.shapes[value] = shape
        return steps

    def split_on_features(self, name: str) -> bool:
        if name in self.static or name not in self.forms:
            return False
        last = shard(len(self.shapes[name]) - 1)
        return any(p.codes[self.tensor] == last for p in self.forms[name])

    def place(self, name: str, op: str, inputs: Sequence[str], attrs: Sequence, shape: Sequence[int]) -> bool:
        """Operator `op` making `name` from `inputs`: the cheapest input placements the analysis accepts, axis by
        axis (`axis_options`), tried together until they can all be made; the output's placement is the
        analysis's."""
        operands = [_Operand(i, tuple(self.shapes[i]), i in self.static) for i in inputs]
        key, instance = self.memo.instance(op, [o.shape for o in operands], attrs)
        if instance is None:
            return False
        per_axis = [self.known_options(key, instance, op, operands, shape, axis) for axis in range(len(self.mesh))]
        combos = sorted(product(*per_axis), key=lambda options: sum(cost for cost, _ in options))
        for combo in combos:
            targets = [Placement(tuple(codes[k] for _, codes in combo)) for k in range(len(operands))]
            made = [self.weight_value(o.name, t) if o.static else self.convert(o.name, t)
                    for o, t in zip(operands, targets)]
            if None in made:
                continue
            try:
                placement = compute_placement(instance, [self.nodes[i].placement for i in made], self.cache)
                node = self.add("op", op, made, attrs, shape, placement, origin=name)
            except PlacementError:
                continue
            self.forms[name] = {placement: node}
            if self.reduce_at_once and op in CONTRACTIONS and placement.codes[self.tensor] == PARTIAL:
                return self.reduced_at_once(name, placement, len(shape))
            return True
        return False

    def reduced_at_once(self, name: str, placement: Placement, rank: int) -> bool:
        """A contraction's partial sum `name` (`reduce_at_once`) brought out of its partial form on the tensor axis
        at once, the cheapest way (`conversion`: reduce-scattered along the sequence with `sequence`, else
        all-reduced), and kept only so: its readers read the reduced value."""
        options = [FREE] + ([shard(1)] if self.sequence and rank == 3 else [])
        steps = sorted((step[0], code) for code in options
                       if (step := self.conversion(PARTIAL, code, self.tensor, rank)) is not None)
        for _price, code in steps:
            target = Placement(tuple(code if a == self.tensor else c for a, c in enumerate(placement.codes)))
            made = self.convert(name, target)
            if made is not None:
                self.forms[name] = {target: made}
                return True
        return False

    def known_options(self, key: tuple, instance: OpInstance, op: str, operands: Sequence[_Operand],
                      shape: Sequence[int], axis: int) -> list[tuple[float, tuple[int, ...]]]:
        """`axis_options`, once per operator and operands as they lie on the axis: what it reads of an operand is
        its shape, whether it is static (and a weight's value, `weight_codes`), or the codes its placements
        have on the axis, in order (`activation_codes`); every block of a model asks the same. Of the layout they
        read only whether the axis is the data or the tensor axis, its size and sequence parallelism (and the
        graph's weights, which the memo is per): the layouts of one graph share them (ZeRO 0 and 3 alike)."""
        lie = tuple((o.shape, o.static, o.name in self.weighted) if o.static else
                    (o.shape, tuple(p.codes[axis] for p in self.forms[o.name])) for o in operands)
        where = (key, op, lie, tuple(shape), axis == self.data, axis == self.tensor, self.mesh.size(axis),
                 self.sequence)
        found = self.options.get(where)
        if found is None:
            found = self.options[where] = self.axis_options(key, instance, op, operands, shape, axis)
        return found

    def axis_options(self, key: tuple, instance: OpInstance, op: str, operands: Sequence[_Operand],
                     shape: Sequence[int], axis: int) -> list[tuple[float, tuple[int, ...]]]:
        """The input codes on one axis that the operator accepts (and whose output splits evenly), cheapest first:
        at most OPTIONS_PER_AXIS of them."""
        size = self.mesh.size(axis)
        choices = []
        for o in operands:
            found = self.weight_codes(o, op, axis) if o.static else self.activation_codes(o, axis)
            choices.append([(c, code) for c, code in found if _splits(o.shape, code, size)])
        accepted = []
        for combo in sorted(product(*choices), key=lambda cs: sum(c for c, _ in cs)):
            codes = tuple(code for _, code in combo)
            out = self.memo.accepted(key, instance, codes)
            if out is not None and _splits(shape, out, size):
                accepted.append((sum(c for c, _ in combo), codes))
                if len(accepted) == OPTIONS_PER_AXIS:
                    break
        return accepted

    def weight_codes(self, operand: _Operand, op: str, axis: int) -> list[tuple[float, int]]:
        """How a static value may be read on one axis, with its price: replicated on the data axis; on the tensor
        axis split when a contraction reads a weight (the embedding's table on the vocabulary first), else
        whole, replicated, or split."""
        if axis == self.data:
            return [(SAME, REPLICA)]
        shards = [shard(d) for d in range(len(operand.shape))]
        if op in CONTRACTIONS and operand.name in self.weighted:
            if op == "embedding":
                return [(SAME, shard(0))] + [(RESPLIT, s) for s in shards[1:]]
            return [(SAME, s) for s in shards]
        split = LOCAL if self.sequence else SPLIT + 1
        return [(SAME, FREE), (COPY, REPLICA)] + [(split, s) for s in shards]

    def activation_codes(self, operand: _Operand, axis: int) -> list[tuple[float, int]]:
        """Every code an activation can be brought to on one axis from a placement it has, at its cheapest."""
        best: dict[int, float] = {}
        for placement in self.forms[operand.name]:
            for code in codes_for_rank(len(operand.shape)):
                step = self.conversion(placement.codes[axis], code, axis, len(operand.shape))
                if step is not None and step[0] < best.get(code, float("inf")):
                    best[code] = step[0]
        return sorted(((c, code) for code, c in best.items()), key=lambda cc: cc[0])

    def conversion(self, src: int, dst: int, axis: int, rank: int,
                   gather: bool = False) -> tuple[float, tuple[tuple[str, int | None], ...]] | None:
        """The parallel operators that bring an activation from `src` to `dst` on one axis, and their price;
        None where the layout does not (activations are never gathered on the data axis but as outputs:
        `gather`; reduce-scatter only along the sequence, with sequence parallelism)."""
        tensor = axis == self.tensor
        if src == dst:
            return SAME, ()
        if src == FREE:
            if dst == REPLICA:
                return COPY, ((REPLICATE, None),)
            return (SPLIT, ((PARTITION, shard_dim(dst)),)) if dst != PARTIAL else None
        if src == PARTIAL:
            if dst == FREE:
                return SUM, ((REDUCE, None),)
            if dst == REPLICA:
                return SUM + COPY, ((REDUCE, None), (REPLICATE, None))
            scatter = tensor and self.sequence and rank == 3 and shard_dim(dst) == 1
            return (SCATTER, ((REDUCE_SCATTER, 1),)) if scatter else None
        dim = shard_dim(src)
        if dim is None or not (tensor or gather):
            return None
        if dst == FREE:
            return GATHER, ((COMBINE, dim),)
        if dst == REPLICA:
            return GATHER + COPY, ((ALL_GATHER, dim),)
        return (RESPLIT, ((COMBINE, dim), (PARTITION, shard_dim(dst)))) if dst != PARTIAL else None

    def convert(self, name: str, target: Placement, gather: bool = False) -> int | None:
        """The node holding activation `name` in `target`: one it has, else made from the placement it has that
        is cheapest to convert (every intermediate placement kept too); None where the layout cannot."""
        forms = self.forms[name]
        if target in forms:
            return forms[target]
        rank = len(self.shapes[name])
        plans = []
        for placement, node in forms.items():
            steps = [self.conversion(placement.codes[a], target.codes[a], a, rank, gather)
                     for a in range(len(self.mesh))]
            if None not in steps:
                plans.append((sum(s[0] for s in steps), node, [(a, s[1]) for a, s in enumerate(steps)]))
        for _cost, node, per_axis in sorted(plans, key=lambda p: p[0]):
            for order in (per_axis, per_axis[::-1]):   # mesh order decides which axis may act first
                made = self.apply_steps(node, order)
                if made is not None and self.nodes[made[-1]].placement == target:
                    for i in made:
                        forms.setdefault(self.nodes[i].placement, i)
                    return made[-1]
        return None

    def apply_steps(self, node: int, per_axis) -> list[int] | None:
        """The parallel operators of each axis in turn on `node` (checked before any is added); their ids."""
        placement = self.nodes[node].placement
        try:
            for axis, steps in per_axis:
                for op, dim in steps:
                    placement = apply_parallel(placement, op, axis, dim)
                    placement.local_shape(self.nodes[node].shape, self.mesh.shape)
        except PlacementError:
            return None
        made = [node]
        for axis, steps in per_axis:
            for op, dim in steps:
                made.append(self.parallel(op, made[-1], axis, dim))
        return made

    # ------------------------------------------------------------------ weights
    def weight_value(self, name: str, target: Placement) -> int | None:
        """A static value in `target`: a weight (or an unsplit input) stored as its reader splits it (on the
        tensor axis, then with ZeRO-3 on the data axis) and replicated or all-gathered (`stored_weight`); a value
        made of them from its inputs in the placements that give `target` (`weight_op`). None where none can."""
        key = (name, target)
        if key not in self.made:
            self.made[key] = None   # a value cannot be made from itself
            try:
                self.made[key] = self.stored_weight(self.leaves[name], target) if name in self.leaves \
                    else self.weight_op(name, target)
            except PlacementError:
                self.made[key] = None
            if self.made[key] is None and name in self.views:
                self.made[key] = self.stored_view(name, target)
        return self.made[key]

    def stored_view(self, name: str, target: Placement) -> int | None:
        """A view of a weight (`views`) split on the tensor axis where no split of the weight gives that split:
        the view made whole, partitioned on the tensor axis (the weight's storage, `ir.pcg.weight_storage`) and
        replicated on the data axis, as `stored_weight` stores a weight. None where `target` asks otherwise."""
        dim = shard_dim(target.codes[self.tensor])
        data_code = target.codes[self.data] if self.data is not None else FREE
        if dim is None or data_code not in (FREE, REPLICA):
            return None
        node = self.weight_value(name, Placement.whole(len(self.mesh)))
        if node is None:
            return None
        try:
            node = self.parallel(PARTITION, node, self.tensor, dim)
            node = self.on_data_axis(node, self.shapes[name], target.codes[self.tensor], data_code, True)
        except PlacementError:
            return None
        return node if self.nodes[node].placement == target else None

    def stored_weight(self, leaf: Leaf, target: Placement) -> int | None:
        """A weight (or unsplit input) leaf in `target`: split on the tensor axis (a weight's storage), a weight
        with ZeRO-3 split again on the data axis along another dim the axis divides and all-gathered, else
        replicated on the data axis."""
        node = self.leaf(leaf)
        tensor_code = target.codes[self.tensor]
        data_code = target.codes[self.data] if self.data is not None else FREE
        if data_code not in (FREE, REPLICA) or tensor_code == PARTIAL:
            return None
        if shard_dim(tensor_code) is not None:
            node = self.parallel(PARTITION, node, self.tensor, shard_dim(tensor_code))
        node = self.on_data_axis(node, leaf.shape, tensor_code, data_code, leaf.role == "weight")
        return node if self.nodes[node].placement == target else None

    def on_data_axis(self, node: int, shape: Sequence[int], tensor_code: int, data_code: int, weight: bool) -> int:
        """`node` (a weight, or a weight's view, of `shape`, split on the tensor axis as `tensor_code` asks) as its
        reader has it on the data axis: with ZeRO-3, a weight split again along a dim the data axis divides (not its
        tensor-axis dim) and all-gathered there; else copied on the tensor axis where `tensor_code` is a replica
        and on the data axis where `data_code` is (the chain `sharded_nodes` rewrites to the ZeRO-3 form)."""
        gathered, source, dim = False, node, None
        if data_code == REPLICA and weight:
            size, local = self.mesh.size(self.data), self.nodes[node].placement.local_shape(shape, self.mesh.shape)
            dim = next((d for d, n in enumerate(local) if n % size == 0 and shard(d) != tensor_code), None)
            if dim is not None and self.zero3:
                node = self.parallel(ALL_GATHER, self.parallel(PARTITION, node, self.data, dim), self.data, dim)
                gathered = True
        first = len(self.nodes)
        if tensor_code == REPLICA:
            node = self.parallel(REPLICATE, node, self.tensor)
        if data_code == REPLICA and not gathered:
            node = self.parallel(REPLICATE, node, self.data)
            if dim is not None:
                self.chains.append(_Chain(source, first, node, dim, tensor_code == REPLICA))
        return node

    def sharded_nodes(self, outputs: Sequence[int]) -> tuple[list[PNode], list[int]] | None:
        """This layout's nodes (built without ZeRO-3) and `outputs` as the same layout with ZeRO-3 builds them;
        None where that cannot be shown (then build it). ZeRO-3 is read in one place, `stored_weight`: a weight
        replicated on the data axis is stored split along `dim` there and all-gathered, before its copy on the
        tensor axis, where without it the copies come first and a replicate on the data axis last. Where the
        gathered value's placement is the replicated one's (checked here, chain by chain), `stored_weight`
        returns a node in the same placement either way, so every other step of the build goes alike and reads
        it alike: the ZeRO-3 nodes are these with each chain's tail (its copies) replaced by the partition,
        all-gather and tensor copy that `stored_weight` appends in its place, every later node renumbered."""
        old, self.nodes = self.nodes, []
        chains, inside = {c.first: c for c in self.chains}, {i for c in self.chains for i in range(c.first, c.last + 1)}
        remap: dict[int, int] = {}
        try:
            for node in old:
                chain = chains.get(node.id)
                if chain is not None:
                    made = self.parallel(ALL_GATHER, self.parallel(PARTITION, remap[chain.source], self.data,
                                                                   chain.dim), self.data, chain.dim)
                    if chain.tensor_copy:
                        made = self.parallel(REPLICATE, made, self.tensor)
                    if self.nodes[made].placement != old[chain.last].placement:
                        return None
                    remap[chain.last] = made
                elif node.id not in inside:   # the node `add` appends here: its degrees are its placement's
                    ident, inputs = len(self.nodes), tuple([remap[i] for i in node.inputs])
                    self.nodes.append(node if ident == node.id and inputs == node.inputs else
                                      PNode(ident, node.kind, node.op, inputs, node.attrs, node.shape, node.degrees,
                                            node.role, node.origin, node.placement))
                    remap[node.id] = ident
            return self.nodes, [remap[o] for o in outputs]
        except (KeyError, PlacementError):   # a chain's inner node read elsewhere, a split refused: build it
            return None
        finally:
            self.nodes = old

    def weight_op(self, name: str, target: Placement) -> int | None:
        """A static value computed in `target`: on each axis the first input codes (whole, replicated, split;
        never split on the data axis) whose output the analysis says is `target`'s, its inputs made so."""
        gnode = self.graph_nodes[name]
        shapes = [tuple(self.shapes[i]) for i in gnode.inputs]
        key, instance = self.memo.instance(gnode.op, shapes, gnode.attrs)
        if instance is None:
            return None
        codes = []
        for axis in range(len(self.mesh)):
            size = self.mesh.size(axis)
            choices = [[c for c in codes_for_rank(len(s)) if c != PARTIAL and _splits(s, c, size)
                        and (axis != self.data or shard_dim(c) is None)] for s in shapes]
            found = next((combo for combo in product(*choices)
                          if self.memo.accepted(key, instance, combo) == target.codes[axis]), None)
            if found is None:
                return None
            codes.append(found)
        made = [self.weight_value(i, Placement(tuple(c[k] for c in codes))) for k, i in enumerate(gnode.inputs)]
        if None in made:
            return None
        placement = compute_placement(instance, [self.nodes[i].placement for i in made], self.cache)
        node = self.add("op", gnode.op, made, gnode.attrs, gnode.shape, placement, origin=name)
        return node if placement == target else None

    # ------------------------------------------------------------------ outputs
    def gathered(self, name: str) -> int | None:
        """An output as every rank holds it: partial sums reduced, splits gathered (on every axis)."""
        if name in self.static:
            return self.weight_value(name, Placement(tuple(REPLICA if a == self.data else FREE
                                                           for a in range(len(self.mesh)))))
        forms = self.forms[name]
        whole = next((p for p in forms if all(c in (FREE, REPLICA) for c in p.codes)), None)
        if whole is not None:
            return forms[whole]
        source = min(forms, key=lambda p: sum(c not in (FREE, REPLICA) for c in p.codes))
        target = Placement(tuple(c if c in (FREE, REPLICA) else FREE for c in source.codes))
        return self.convert(name, target, gather=True)


@dataclass(frozen=True)
class _Chain:
    """A weight's chain as `stored_weight` made it without ZeRO-3: `source` (the leaf or its split on the tensor
    axis), then nodes `first` .. `last` (a copy on the tensor axis where `tensor_copy`, the copy on the data axis
    last); `dim`, the dim ZeRO-3 would store it split along on the data axis."""

    source: int
    first: int
    last: int
    dim: int
    tensor_copy: bool


def _made_of(graph: Graph, leaves: AbstractSet[str]) -> frozenset[str]:
    """`leaves` and the values computed from them alone (a tied embedding's transpose, rotary tables)."""
    found = set(leaves)
    for node in graph.nodes:
        if node.inputs and all(i in found for i in node.inputs):
            found.add(node.name)
    return frozenset(found)


def _views_of(graph: Graph, weights: AbstractSet[str]) -> frozenset[str]:
    """The values that are a weight seen through views alone, the first an unflatten (`ir.pcg.VIEW_OPS`,
    `STRIDED_VIEW`, as `ir.pcg.weight_storage` reads a storage chain): what the builder may store as their
    partition (`_MegatronBuilder.stored_view`)."""
    found: set[str] = set()
    for node in graph.nodes:
        if node.op in VIEW_OPS and len(node.inputs) == 1 and (
                (node.inputs[0] in weights and node.op == STRIDED_VIEW) or node.inputs[0] in found):
            found.add(node.name)
    return frozenset(found)


def _splits(shape: Sequence[int], code: int, size: int) -> bool:
    """Whether a code on an axis of `size` cuts `shape` evenly (a shard of a dim it has, that divides)."""
    dim = shard_dim(code)
    return dim is None or (dim < len(shape) and shape[dim] % size == 0)


@dataclass(kw_only=True)
class _Template(BlockTemplate):
    """A block's run as `_MegatronBuilder` placed it node by node (`_Repeats`; `BlockTemplate`'s fields): what it
    read of the builder's state from outside the block, as it stood before (`reads`: each activation from outside
    the block read, with its forms then; `kept`: the nodes of static values from outside both this block and the
    one before, by id); and what it added to that state besides its nodes: its values' forms, the forms it added
    to the activations it read (`forms_end`, their forms after), its static values made (`made`), leaves, ZeRO-3
    chains and shapes. Not `usable` where it read or added anything else (then a block is not laid out from it)."""

    reads: dict
    kept: frozenset
    made_from: int
    leaves_from: int
    chains_from: int
    shapes_from: int
    forms_from: int
    forms_end: dict | None = None
    own_forms: dict | None = None
    made: list | None = None
    leaves: list | None = None
    chains: list | None = None
    shapes: list | None = None


class _Repeats(BlockReplay):
    """A block's run laid out as the builder laid the run of a block before it out (its template), renamed, where
    the builder would place it alike (`ir.block_replay.BlockReplay`, the mechanism; issue 28: llama-70b's 80
    blocks, each placed operator by operator in every layout the grid builds, 18 builds a call).

    Why the same nodes. The builder places a run's operators one after another, and each step reads only: the
    graph (the operators, their inputs, attributes and shapes, which values are static, weights, or views of
    them, and the leaves' shapes and roles); caches whose entries are functions of what they are keyed by (the
    memo's instances, accepted codes and options, the degrees); and the builder's state: the forms of the
    activations the operators read (each placement, in order, and its node), the static values made (`made`), the
    leaves' nodes and the nodes themselves, each read as the placement and shape of a node held in a form or
    made. A template is usable where every value it read from outside its block was an activation (whose forms it
    recorded before it began) or a static value of no block it renames, already made (whose node it reads by id;
    one that it made, or a leaf it added outside its block, makes it unusable). A run of block j is laid out from
    a template of block t where the run is the template's with every name of t in j and of t - 1 in j - 1 (its
    operators, attributes, shapes, inputs; its values static, weights, views, leaves of the same shapes and roles
    alike: `alike`, `value`), and each activation it reads from outside holds the forms the template's did,
    placement by placement in the same order (its nodes other ones, of the same placements and shapes: the
    value's: `outside`). Then every read of the run's steps gives what the template's step read gave, renamed, its
    node ids the template's moved by where the run begins (an activation's form by its placement, a static value's
    kept node as it is), so each step makes the same decision and the same nodes, renamed and renumbered: what
    `replayed` appends, with the state the template added, renamed likewise (`added`). Checked on llama-70b:64's
    100 layouts of a call: each equals the layout main placed operator by operator (1,404 blocks replayed)."""

    def record(self, block: int, run: Sequence) -> _Template:
        b = self.build
        own = {gnode.name for gnode in run}
        reads = {}
        for gnode in run:
            for name in gnode.inputs:
                if name not in own and name not in b.static and name not in reads:
                    reads[name] = dict(b.forms[name]) if name in b.forms else None
                elif name not in own and name in b.static and block_of(name) == block - 1 != OUTSIDE:
                    reads[name] = None   # a static value of the block before: its node is not kept by id
        kept = frozenset(node for (name, _p), node in b.made.items()
                         if node is not None and block_of(name) not in (block, block - 1))
        return _Template(block, tuple(run), len(b.nodes), reads=reads, kept=kept, made_from=len(b.made),
                         leaves_from=len(b.leaf_ids), chains_from=len(b.chains), shapes_from=len(b.shapes),
                         forms_from=len(b.forms))

    def completed(self, mark: _Template) -> bool:
        b, block = self.build, mark.block
        mark.made = list(islice(b.made.items(), mark.made_from, None))
        mark.leaves = list(islice(b.leaf_ids.items(), mark.leaves_from, None))
        mark.chains = b.chains[mark.chains_from:]
        mark.shapes = list(islice(b.shapes, mark.shapes_from, None))
        mark.forms_end = {name: dict(b.forms[name]) for name in mark.reads if name in b.forms}
        mark.own_forms = {name: dict(forms) for name, forms in islice(b.forms.items(), mark.forms_from, None)}
        outside = {node for forms in mark.reads.values() if forms is not None for node in forms.values()}
        outside |= mark.kept
        ids = [i for node in b.nodes[mark.first:mark.end] for i in node.inputs] + \
            [i for chain in mark.chains for i in (chain.source, chain.first, chain.last)]
        return None not in mark.reads.values() and \
            all(block_of(name) == block for name in [key[0] for key, _node in mark.made] +
                [name for name, _node in mark.leaves] + mark.shapes + list(mark.own_forms)) and \
            all(i >= mark.first or i in outside for i in ids)

    def outside(self, t: _Template, name_of: Callable[[str], str]) -> dict[int, int] | None:
        b = self.build
        outside: dict[int, int] = {node: node for node in t.kept}
        for read, forms in t.reads.items():
            now = b.forms.get(name_of(read))
            if now is None or list(now) != list(forms):
                return None
            outside.update((node, now[placement]) for placement, node in forms.items())
        if any((name_of(n), placement) in b.made for (n, placement), _node in t.made) or \
                any(name_of(n) in b.leaf_ids for n, _node in t.leaves) or \
                any(name_of(n) in b.forms for n in t.own_forms):
            return None   # what the template made, made already (read before by another block): not alike
        return outside

    def added(self, t: _Template, moved: Callable[[int], int], name_of: Callable[[str], str]) -> None:
        b = self.build
        for read, forms in t.forms_end.items():
            now = b.forms[name_of(read)]
            for placement, node in forms.items():
                now.setdefault(placement, moved(node))
        for own, forms in t.own_forms.items():
            b.forms[name_of(own)] = {placement: moved(node) for placement, node in forms.items()}
        b.made.update(((name_of(n), placement), None if node is None else moved(node))
                      for (n, placement), node in t.made)
        b.leaf_ids.update((name_of(n), moved(node)) for n, node in t.leaves)
        b.chains += [_Chain(moved(c.source), moved(c.first), moved(c.last), c.dim, c.tensor_copy) for c in t.chains]
        b.shapes.update((name_of(n), b.shapes[n]) for n in t.shapes)

    def value(self, name: str) -> tuple:
        """What the builder reads of a graph value besides its forms and nodes (`alike`)."""
        b = self.build
        leaf = b.leaves.get(name)
        return (tuple(b.shapes.get(name, ())), name in b.static, name in b.weighted, name in b.views,
                name in b.graph_nodes, leaf.role if leaf is not None else None, b.batch.get(name))

    def context(self) -> tuple | None:
        """What `value` reads of a graph value besides the graph (`BlockReplay.known_alike`): `static` is the
        graph's weights, the inputs the data axis leaves whole (`unsplit`) and the values made of them alone;
        `batch` the memo's batch dims, with the data axis's batch-wide constants where there is one; `weighted`,
        `views`, `graph_nodes` and `leaves` are the graph's. `shapes` starts as the graph's and the builder adds
        only names of its own (a partial sum `{name}_nobias`, a vocabulary-parallel loss's `{name}_{part}`, and
        those a replay moves, which are such names of the run's nodes): where none of those is a graph value's
        name (`_Memo.own_names_apart`) every graph value's shape stays the graph's. None otherwise."""
        b = self.build
        return (b.unsplit, b.data is not None) if b.memo.own_names_apart else None
