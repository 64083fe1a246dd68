"""Data parallelism, by its textbook definition: the PCG every baseline table starts from.

Every graph input split along dim 0 over all devices (one mesh axis, `dp`),
but the inputs the graph names constant (`Graph.constants`), which carry no
batch, every weight replicated, outputs gathered; a partial sum (a statistic over
the split batch: batch norm's mean and variance) all-reduced where an
operator needs it whole, which is synchronized batch normalization, the
data parallelism torch's SyncBatchNorm runs; and a value computed from the
weights and constants alone that meets the batch along its dim 0 (ViT's class token,
broadcast over the batch and concatenated with the patches) computed whole
on every device and split with the batch, as each rank would slice it; a
mean over the split batch (a `.mean()` loss) as each rank's sum of its rows,
all-reduced, times one over the global count, the global mean exactly
(`mean` divides by its dim's size, which a split piece does not know, so
the placement analysis refuses it on a split dim). It
is built from the graph alone, not found by the rules, so the optimizer can
price it as a baseline (`parsat/search/baselines.py`) and the backend can run it
for a plan that names it (`parsat/backend/cli.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import islice
from typing import Callable, Sequence

from parsat.dsl import ast
from parsat.dsl.instantiate import InstantiationError
from parsat.dsl.library import Library
from parsat.dsl.parallel_ops import ALL_GATHER, COMBINE, PARTITION, REDUCE, REPLICATE
from parsat.ir.block_replay import BlockReplay, BlockTemplate, block_runs
from parsat.ir.blocks import OUTSIDE, block_of
from parsat.ir.graph import Graph, Leaf, OpNode, instance_for
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import PCG, Degrees, PNode
from parsat.ir.placement import (FREE, PARTIAL, REPLICA, Placement, PlacementError, apply_parallel,
                                 compute_placement, shard)

DP_AXIS = "dp"


def data_parallel_pcg(graph: Graph, library: Library, devices: int, devices_per_node: int = 1,
                      zero3: bool = False, cache: dict | None = None) -> PCG | None:
    """Data parallelism: every input split along dim 0, every weight replicated, outputs gathered.

    An input whose dim 0 does not split evenly (a constant of batch size 1,
    a scalar such as cross-entropy's inverse count) is replicated instead.
    With `zero3`, ZeRO-3 (FSDP's full sharding): each weight is stored split
    along its first dim the devices divide and all-gathered where it is
    used (its gradient reduce-scattered back); a weight with no such dim
    stays replicated.

    Built directly (the textbook definition, independent of the rules) and
    checked operator by operator with the placement analysis; None when an
    operator does not accept it. `cache`: the placement analysis's answers
    (`placement.axis_compute`'s cache, kept by an operator's signature and
    input codes, which is all they read) shared with other builds, of any
    graph and mesh (`ir.megatron._Kin`).
    """
    if devices < 2:
        return None
    build = _built(graph, library, devices, devices_per_node, zero3, cache=cache)
    return build.pcg if isinstance(build, _DataParallelBuilder) else None


def data_parallel_refusal(graph: Graph, library: Library, devices: int) -> str | None:
    """Why `data_parallel_pcg` has no PCG for `graph` on `devices` devices, in words (the operator that accepts
    no repair of its inputs' spread, with the placement analysis's reason); None where it has one."""
    if devices < 2:
        return f"data parallelism needs 2 or more devices, not {devices}"
    build = _built(graph, library, devices, 1, False)
    return build if isinstance(build, str) else None


def _built(graph: Graph, library: Library, devices: int, devices_per_node: int,
           zero3: bool, builder: type | None = None, cache: dict | None = None) -> "_DataParallelBuilder | str":
    """The builder after placing every leaf and operator and gathering the outputs (its `pcg` set), or the reason
    it stopped. `builder`: a subclass of `_DataParallelBuilder` to build with (`ir.expert_parallel`). `cache`:
    `axis_compute`'s, shared (`data_parallel_pcg`)."""
    mesh = Mesh.of((devices,), devices_per_node, names=(DP_AXIS,))
    build = (builder or _DataParallelBuilder)(graph, devices, mesh, library)
    for leaf in graph.leaves:
        build.place_leaf(leaf, zero3, leaf.name in graph.constants)
    cache = {} if cache is None else cache

    def place(run: Sequence[OpNode]) -> str | None:
        for gnode in run:
            refused = build.place_operator(gnode, library.ops[gnode.op], cache)
            if refused:
                return f"operator '{gnode.name}' ({gnode.op}) does not accept its inputs split along the batch: " \
                    f"{refused}"
        return None
    # a block's run laid out as the alike run before it was (`_Replay`), by the plain builder alone: a subclass's
    # steps read state of its own (`ir.expert_parallel`), which the replay does not compare (one run, OUTSIDE)
    runs = block_runs(graph) if type(build) is _DataParallelBuilder else ((OUTSIDE, tuple(graph.nodes)),)
    refused = _Replay(build).lay_out(runs, place)
    if refused is not None:
        return refused
    outputs = build.gathered_outputs(graph.outputs)
    if outputs is None:
        return "an output is split along a dim other than the batch, which no rank can gather as the module returns it"
    build.pcg = _live(build.nodes, outputs, tuple(graph.outputs), mesh)
    return build


class _DataParallelBuilder:
    """The data-parallel PCG of one graph while `data_parallel_pcg` builds it: its nodes so far, the node that
    holds each graph value, and the weight-only values computed whole. Each call makes its own (nothing is
    shared between calls); the steps are methods so that each reads on its own."""

    def __init__(self, graph: Graph, devices: int, mesh: Mesh, library: Library):
        self.devices = devices
        self.mesh = mesh
        self.library = library
        self.pcg: PCG | None = None              # set by `_built` once every node is placed
        self.graph_nodes = {n.name: n for n in graph.nodes}
        self.nodes: list[PNode] = []
        self.ident: dict[str, int] = {}          # graph name -> the node that holds it as its readers use it
        self.whole: dict[str, int | None] = {}   # graph name -> its value whole on every device, for weight-only values
        self.instances: dict = {}                # operator instances (`instance_for`'s memo): blocks repeat them

    def add(self, kind: str, op: str, inputs: Sequence[int], attrs: Sequence, shape: Sequence[int],
            placement: Placement, role: str = "", origin: str = "") -> int:
        """Append a node (its degrees follow from its placement on the mesh); its id."""
        degrees = Degrees.of_placement(placement, self.mesh, len(shape))
        self.nodes.append(PNode(len(self.nodes), kind, op, tuple(inputs), tuple(attrs), tuple(shape), degrees, role,
                                origin, placement))
        return len(self.nodes) - 1

    def parallel(self, op: str, source: int, dim: int | None = None, origin: str = "") -> int:
        """Append the parallel operator `op` over all devices of the `dp` axis, reading `source`; its id."""
        node = self.nodes[source]
        attrs = ((("dim", dim),) if dim is not None else ()) + (("axis", DP_AXIS), ("degree", self.devices))
        return self.add("parallel", op, (source,), attrs, node.shape, apply_parallel(node.placement, op, 0, dim),
                        origin=origin)

    def whole_of(self, name: str) -> int | None:
        """The node computing `name` whole (every device the same), if it depends on weights only."""
        if name in self.whole:
            return self.whole[name]
        gnode = self.graph_nodes.get(name)
        found = None
        if gnode is not None:
            parts = [self.whole_of(i) for i in gnode.inputs]
            if None not in parts:
                found = self.add("op", gnode.op, parts, gnode.attrs, gnode.shape, Placement.whole(1))
        self.whole[name] = found
        return found

    def all_reduced(self, inputs: list[PNode]) -> list[PNode]:
        """Synchronize: all-reduce the partial inputs; the reduced value is the graph node's (its origin)."""
        reduced: dict[int, int] = {}
        for n in inputs:
            if n.placement.codes[0] == PARTIAL and n.id not in reduced:
                self.nodes[n.id] = replace(n, origin="")
                total = self.parallel(REDUCE, n.id, origin=n.origin)
                reduced[n.id] = self.parallel(REPLICATE, total)
                self.ident[n.origin] = reduced[n.id]
        return [self.nodes[reduced.get(n.id, n.id)] for n in inputs]

    def split_with_batch(self, names: Sequence[str], inputs: list[PNode]) -> list[PNode]:
        """Copies of a weight-only value beside batch-split operands: split it with the batch instead."""
        split = []
        for name, n in zip(names, inputs):
            source = self.whole_of(name) if n.placement.codes[0] == REPLICA else None
            if source is not None and n.shape and n.shape[0] % self.devices == 0:
                n = self.nodes[self.parallel(PARTITION, source, 0)]
            split.append(n)
        return split

    def place_leaf(self, leaf: Leaf, zero3: bool, constant: bool = False) -> None:
        """A graph input split along dim 0 (replicated where dim 0 does not split evenly, or where it is a
        `constant`: the same for every batch, held whole by every rank as a weight is); a weight replicated, or
        with `zero3` stored split along its first dim the devices divide and all-gathered for its readers."""
        base = self.add("leaf", leaf.name, (), (), leaf.shape, Placement.whole(1), leaf.role, leaf.name)
        self.whole[leaf.name] = base if leaf.role == "weight" or constant else None
        stored = next((d for d, size in enumerate(leaf.shape) if size % self.devices == 0), None)
        if leaf.role == "input" and leaf.shape and leaf.shape[0] % self.devices == 0 and not constant:
            self.ident[leaf.name] = self.parallel(PARTITION, base, 0)
        elif leaf.role == "weight" and zero3 and stored is not None:
            self.ident[leaf.name] = self.parallel(ALL_GATHER, self.parallel(PARTITION, base, stored), stored)
        else:
            self.ident[leaf.name] = self.parallel(REPLICATE, base)

    def place_operator(self, gnode: OpNode, op: ast.OpDecl, cache: dict) -> str | None:
        """The graph operator `gnode` (of library operator `op`) on its inputs as placed so far, repaired in turn
        (as is, partial sums all-reduced, weight-only values split with the batch) until the placement analysis
        accepts it; a mean over a split dim as a sum and a scale (`split_mean`). None once placed, else why not:
        the placement analysis's reason for the inputs as first placed (or the instantiation error)."""
        inputs = [self.nodes[self.ident[i]] for i in gnode.inputs]
        try:
            instance = instance_for(op, [n.shape for n in inputs], dict(gnode.attrs), self.instances)
        except InstantiationError as err:
            return str(err)
        placement, first_reason = None, None
        for repair in self.repairs(gnode):
            inputs = repair(inputs)
            try:
                placement = compute_placement(instance, [n.placement for n in inputs], cache)
                break
            except PlacementError as err:
                first_reason = first_reason or str(err)
        if placement is None:
            return None if self.split_mean(gnode, inputs, cache) else first_reason
        self.ident[gnode.name] = self.add("op", gnode.op, [n.id for n in inputs], gnode.attrs, gnode.shape,
                                          placement, origin=gnode.name)
        return None

    def repairs(self, gnode: OpNode) -> tuple:
        """The repairs `place_operator` tries in turn on an operator's inputs: none, partial sums all-reduced,
        weight-only values split with the batch (a subclass may add its own: `ir.expert_parallel`)."""
        return (lambda ins: ins, self.all_reduced, lambda ins: self.split_with_batch(gnode.inputs, ins))

    def split_mean(self, gnode: OpNode, inputs: list[PNode], cache: dict) -> bool:
        """`mean(x, dim)` with `x` split along `dim` over the batch axis: each rank sums its rows (`reduce_sum`, a
        partial sum over the axis) and scales the sum by one over the global size of `dim`; the reduce a reader
        or the output adds makes it the global mean, exactly (the global mean of equal pieces is the mean of
        the pieces' means, and each piece's mean is its sum over the same global count's share). False where
        the operator is not such a mean or the analysis refuses the sum or the scale."""
        if gnode.op != "mean" or len(inputs) != 1 or inputs[0].placement.codes[0] != shard(dict(gnode.attrs)["dim"]):
            return False
        x, dim = inputs[0], dict(gnode.attrs)["dim"]
        try:
            total_op = instance_for(self.library.ops["reduce_sum"], [x.shape], {"dim": dim}, self.instances)
            total_at = compute_placement(total_op, [x.placement], cache)
            scale_op = instance_for(self.library.ops["scale"], [gnode.shape], {"c": 1.0 / x.shape[dim]},
                                    self.instances)
            scaled_at = compute_placement(scale_op, [total_at], cache)
        except (InstantiationError, PlacementError, KeyError):
            return False
        total = self.add("op", "reduce_sum", [x.id], (("dim", dim),), gnode.shape, total_at)
        self.ident[gnode.name] = self.add("op", "scale", [total], (("c", 1.0 / x.shape[dim]),), gnode.shape,
                                          scaled_at, origin=gnode.name)
        return True

    def gathered_outputs(self, names: Sequence[str]) -> list[int] | None:
        """The graph outputs as every rank holds them: a partial sum reduced, a batch-split value combined, a
        value not split as it is; None when an output is split some other way."""
        outputs = []
        for name in names:
            node = self.nodes[self.ident[name]]
            code = node.placement.codes[0]
            if code == PARTIAL:                               # a loss summed over rows
                outputs.append(self.parallel(REDUCE, node.id))
            elif code == shard(0):
                outputs.append(self.parallel(COMBINE, node.id, 0))
            elif code in (FREE, REPLICA):                     # not split: held by every rank
                outputs.append(node.id)
            else:
                return None
        return outputs


@dataclass(kw_only=True)
class _DataTemplate(BlockTemplate):
    """A block's run as `_DataParallelBuilder` placed it node by node (`_Replay`; `BlockTemplate`'s fields): the
    node of each value from outside the block it read, as it stood before (`reads`: the node `ident` gave, and
    that node itself, `held`; what `whole_of` found of it, `wholes`), how many graph values had a node and a
    weight-only node before (`ident_from`, `whole_from`), and the nodes it gave its own values (`own`: `ident`'s
    entries it added)."""

    reads: dict
    held: dict
    ident_from: int
    whole_from: int
    wholes: dict
    own: list | None = None


class _Replay(BlockReplay):
    """A block's run of the data-parallel layout laid out as the builder laid the run of a block before it out (its
    template), renamed (`ir.block_replay.BlockReplay`, the mechanism `ir.megatron._Repeats` runs too; issue 28:
    llama-70b's 80 blocks placed operator by operator in each of a call's data-parallel builds).

    Why the same nodes. The leaves are all placed before any operator (`_built`), so a run places operators
    alone, one after another, and each step (`place_operator` and its repairs) reads only: the operator, its
    attributes, shape and inputs' names (the graph), the operator instance at its inputs' shapes and the
    placement analysis's answers (caches keyed by what they read), the node `ident` holds for each input (its
    placement and shape), and, in its repairs, the nodes it made earlier in the run, the builder's `devices` and,
    through `whole_of`, `whole` and the graph's operators. What it changes: nodes appended; `ident` for its own
    values (and, where `all_reduced` reduces an input, that input's node's origin and `ident`); `whole` where
    `whole_of` works a weight-only value out. A template is usable (`completed`) where it added no `whole` entry
    (so it read of `whole` nothing that a run of another block could find otherwise: `whole_of` of a value not
    worked out adds one, and one worked out is a weight-only value's node, which no node of the run may read
    from outside it), left every value it read from outside its block with the node it had, that node unchanged,
    gave `ident` entries to its own block's values alone, and made nodes that read, from outside the run, only
    those nodes. A run of block j is laid out from a template of block t where the run is the template's with
    every name of t in j and of t - 1 in j - 1 (`alike`; `value`: whether a name is a graph operator, all
    `whole_of` could read of the graph), and each value it reads from outside its block holds a node of the
    placement and shape the template's held and stands in `whole` as the template's stood (worked out or not, to
    a node or not: `whole_state`) (`outside`), no value of its own having a node yet. Then each step of
    the run reads what the template's step read, renamed, node ids moved by where the run begins (an outside
    value's node by its name), so it makes the same decision and the same nodes, renamed and renumbered: what
    `replayed` appends, and `ident` for the run's values, renamed likewise (`added`)."""

    def record(self, block: int, run: Sequence) -> _DataTemplate:
        b = self.build
        own = {gnode.name for gnode in run}
        reads = {name: b.ident.get(name) for gnode in run for name in gnode.inputs if name not in own}
        held = {name: b.nodes[node] for name, node in reads.items() if node is not None}
        return _DataTemplate(block, tuple(run), len(b.nodes), reads=reads, held=held, ident_from=len(b.ident),
                             whole_from=len(b.whole), wholes={name: self.whole_state(name) for name in reads})

    def whole_state(self, name: str) -> tuple[bool, bool]:
        """What `whole_of` finds of a value without working it out: whether it was worked out, and to a node."""
        return name in self.build.whole, self.build.whole.get(name) is not None

    def completed(self, mark: _DataTemplate) -> bool:
        b = self.build
        mark.own = list(islice(b.ident.items(), mark.ident_from, None))
        ids = set(mark.reads.values())
        return len(b.whole) == mark.whole_from and len(mark.held) == len(mark.reads) and \
            all(b.ident.get(name) == node and b.nodes[node] is mark.held[name] for name, node in mark.reads.items()) \
            and all(block_of(name) == mark.block for name, _node in mark.own) and \
            all(i >= mark.first or i in ids for node in b.nodes[mark.first:mark.end] for i in node.inputs)

    def outside(self, t: _DataTemplate, name_of: Callable[[str], str]) -> dict[int, int] | None:
        b = self.build
        outside: dict[int, int] = {}
        for read, node in t.reads.items():
            now = b.ident.get(name_of(read))
            if now is None or b.nodes[now].placement != t.held[read].placement or \
                    b.nodes[now].shape != t.held[read].shape or self.whole_state(name_of(read)) != t.wholes[read]:
                return None
            if outside.setdefault(node, now) != now:
                return None   # two values the template read from one node, held by two nodes now
        if any(name_of(n) in b.ident for n, _node in t.own):
            return None   # a value of the run placed already: not the state the template began from
        return outside

    def added(self, t: _DataTemplate, moved: Callable[[int], int], name_of: Callable[[str], str]) -> None:
        self.build.ident.update((name_of(n), moved(node)) for n, node in t.own)

    def value(self, name: str) -> tuple:
        return (name in self.build.graph_nodes,)


def _live(nodes: Sequence[PNode], outputs: Sequence[int], names: tuple[str, ...], mesh: Mesh) -> PCG:
    """The PCG of the nodes the outputs depend on, renumbered in order (a copy never used is not kept: its
    gradient all-reduce would be paid for nothing)."""
    live = _needed(nodes, outputs)
    if all(live):   # every node kept, none renumbered: the nodes as they are (what the walk below keeps each as)
        return PCG(tuple(nodes), tuple(outputs), names, mesh)
    order = [k for k, kept in enumerate(live) if kept]
    new = {old: k for k, old in enumerate(order)}
    # most layouts keep every node: a node whose id and inputs do not move is kept as it is (the same value
    # `replace` would make, without building it again: a whole model's layout has thousands of nodes)
    kept = tuple(nodes[old] if new[old] == old and all(new[i] == i for i in nodes[old].inputs) else
                 replace(nodes[old], id=new[old], inputs=tuple(new[i] for i in nodes[old].inputs))
                 for old in order)
    return PCG(kept, tuple(new[o] for o in outputs), names, mesh)


def _needed(nodes: Sequence[PNode], outputs: Sequence[int]) -> bytearray:
    """Position -> 1 where the outputs depend on the node there (itself one of them, or read by one that is). The
    builders append a node after the nodes it reads, so one sweep from the last node back marks them all (a
    node's readers all come after it, and are marked before it is reached); where some node reads one at or
    after its own position, a walk from the outputs marks them instead."""
    live = bytearray(len(nodes))
    for o in outputs:
        live[o] = 1
    for k in range(len(nodes) - 1, -1, -1):
        if live[k]:
            for i in nodes[k].inputs:
                if i >= k:
                    return _walked(nodes, outputs)
                live[i] = 1
    return live


def _walked(nodes: Sequence[PNode], outputs: Sequence[int]) -> bytearray:
    """`_needed` by a walk from the outputs, in any order of the nodes."""
    live, stack = bytearray(len(nodes)), list(outputs)
    while stack:
        i = stack.pop()
        if not live[i]:
            live[i] = 1
            stack.extend(nodes[i].inputs)
    return live
