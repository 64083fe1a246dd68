"""The Parallel Computation Graph (PCG): what extraction picks out of the e-graph.

A PCG runs on a device mesh (`ir.mesh`). A node is a leaf (graph input or
weight, whole), a compute operator on local pieces, or a parallel operator
acting on one mesh axis (attributes `axis`, the axis's name, and `degree`,
its size; `dim` for partition and combine). Every node carries its logical
shape, its `Placement` (one entry per mesh axis: where its pieces live,
docs/MESH.md) and its `Degrees`: the integer shard degree per dim, copy
degree and partial-sum degree that the placement amounts to (the plan
JSON's `spread`; `Degrees.of` is the one conversion from a symbolic
`dsl.spread.SymbolicDegrees`, `Degrees.of_placement` the one from a placement).
Placements are not computed here: they come from the e-graph analysis, and
`pcg_placement.derive_placements` checks that every node's follows from its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from math import prod
from operator import attrgetter
from typing import Iterator, Mapping, Sequence

from parsat.dsl.parallel_ops import PARTITION, REPLICATE
from parsat.dsl.spread import SymbolicDegrees
from parsat.dsl.symbolic import Poly
from parsat.ir.hashed import hash_once, state_without_hash
from parsat.ir.mesh import Mesh
from parsat.ir.placement import Placement

@dataclass(frozen=True)
class Degrees:
    """How a tensor is spread over devices, with concrete degrees."""

    shard: tuple[int, ...]
    copy: int = 1
    sum: int = 1

    @staticmethod
    def whole(rank: int) -> "Degrees":
        return Degrees(tuple(1 for _ in range(rank)))

    @staticmethod
    def of(spread: SymbolicDegrees, sizes: Mapping[str, int] | None = None) -> "Degrees":
        """A symbolic spread's degrees at `sizes` (its symbols' values; none needed when it is concrete)."""
        env = dict(sizes or {})
        return Degrees(tuple(int(d.evaluate(env)) for d in spread.shard), int(spread.copy.evaluate(env)),
                       int(spread.sum.evaluate(env)))

    @staticmethod
    def of_placement(placement: Placement, mesh: Mesh, rank: int) -> "Degrees":
        shard, copy, total = placement.degrees(mesh.shape, rank)
        return Degrees(shard, copy, total)

    @property
    def pieces(self) -> int:
        return prod(self.shard) * self.copy * self.sum

    @property
    def is_whole(self) -> bool:
        return self.pieces == 1

    def piece_elements(self, shape: tuple[int, ...]) -> int:
        """Elements of one local piece."""
        return prod(shape) // prod(self.shard) if shape else 1

    def to_symbolic(self) -> SymbolicDegrees:
        return SymbolicDegrees(tuple(Poly.const(d) for d in self.shard), Poly.const(self.copy), Poly.const(self.sum))

    def to_dict(self) -> dict:
        return {"shard": list(self.shard), "copy": self.copy, "sum": self.sum}

    @staticmethod
    def from_dict(data: dict) -> "Degrees":
        return Degrees(tuple(int(d) for d in data["shard"]), int(data.get("copy", 1)), int(data.get("sum", 1)))

    def __str__(self) -> str:
        if self.is_whole:
            return "whole"
        parts = []
        if any(d != 1 for d in self.shard):
            parts.append("shard[" + ",".join(str(d) for d in self.shard) + "]")
        if self.copy != 1:
            parts.append(f"copy {self.copy}")
        if self.sum != 1:
            parts.append(f"sum {self.sum}")
        return " ".join(parts)


_UNPLACED = Placement(())   # `PNode.placement`'s default
_set = object.__setattr__   # how a frozen dataclass sets its fields (`PNode.__init__`)


@dataclass(frozen=True)
class PNode:
    """One PCG node. `inputs` are ids of earlier nodes; `origin` names the graph node it computes, if any;
    `rules` the rules whose rewrites produced it, each `name (file:line)` (none for the graph's own nodes)."""

    id: int
    kind: str  # "leaf" | "op" | "parallel"
    op: str    # operator name, parallel operator name, or the leaf's name
    inputs: tuple[int, ...]
    attrs: tuple[tuple[str, int | float | str], ...]
    shape: tuple[int, ...]
    degrees: Degrees
    role: str = ""     # leaves: "input" | "weight"
    origin: str = ""
    placement: Placement = _UNPLACED   # one entry per mesh axis (empty only for a 1-device PCG)
    rules: tuple[str, ...] = ()

    def __init__(self, id: int, kind: str, op: str, inputs: tuple[int, ...],
                 attrs: tuple[tuple[str, int | float | str], ...], shape: tuple[int, ...], degrees: Degrees,
                 role: str = "", origin: str = "", placement: Placement = _UNPLACED,
                 rules: tuple[str, ...] = ()) -> None:
        """Every field, in order, with the fields' defaults (tests/test_layouts_provenance_s77.py compares this with
        the fields): what the generated frozen `__init__` sets, each through `object.__setattr__` as it does, but
        without looking that up again per field (`__dataclass_builtins_object__.__setattr__`): ~20% of making a
        node, and a search makes ~700,000 (stamped copies, rescaled and replayed layouts)."""
        _set(self, "id", id)
        _set(self, "kind", kind)
        _set(self, "op", op)
        _set(self, "inputs", inputs)
        _set(self, "attrs", attrs)
        _set(self, "shape", shape)
        _set(self, "degrees", degrees)
        _set(self, "role", role)
        _set(self, "origin", origin)
        _set(self, "placement", placement)
        _set(self, "rules", rules)

    def attr(self, key: str):
        return dict(self.attrs)[key]

    def axis(self, mesh: Mesh) -> int:
        """The mesh axis a parallel node acts on."""
        return mesh.index(str(self.attr("axis")))

    @cached_property
    def label(self) -> str:
        """The node as a report names it; kept once made (the step simulator names millions of tasks)."""
        if self.kind == "leaf":
            return self.op
        attrs = ", ".join(f"{k}={v}" for k, v in self.attrs)
        return f"{self.op}({attrs})" if attrs else self.op

    @cached_property
    def piece_size(self) -> int:
        """Elements of one device's piece of this node's value (`Degrees.piece_elements`), kept once made."""
        return self.degrees.piece_elements(tuple(self.shape))


STRUCTURE = ("id", "kind", "op", "inputs", "role", "origin")
"""The fields of a node that a PCG's structural facts read (`PCG.structural`): which operator reads which values
and what each value is, never how large it is nor how it is spread."""


_structure = attrgetter(*STRUCTURE)
_NODE_ID = attrgetter("id")   # `PCG.ids`
"""A node's `STRUCTURE` fields, as a tuple (`reshaped` compares every node's: a C getter, not a generator)."""


def _same_structure(nodes: Sequence[PNode], others: Sequence[PNode]) -> bool:
    """Whether two PCGs' nodes have the same `STRUCTURE`, node for node (the same node object is its own)."""
    return len(nodes) == len(others) and all(a is b or _structure(a) == _structure(b) for a, b in zip(nodes, others))


@dataclass(frozen=True)
class PCG:
    """Nodes in topological order (inputs before users), the output ids, the mesh they run on, which
    activations are recomputed in backward rather than kept (`ir.recompute`: "none" or "blocks"), and the ZeRO
    stage of its weights' state: 0, or 1 / 2, where every weight whose gradient a replicate synchronises has its
    optimizer state (1) and gradient (2) sharded over that replicate's devices (`cost.model.shards_state`).
    ZeRO-3 is not a flag: it is the layout itself (weights stored split and all-gathered)."""

    nodes: tuple[PNode, ...]
    outputs: tuple[int, ...]
    output_names: tuple[str, ...] = ()
    mesh: Mesh = Mesh(())
    recompute: str = "none"
    zero: int = 0

    # hashed once and kept (`ir.hashed`): the search keys memos by whole PCGs (simulated steps, stage figures)
    __hash__ = hash_once
    __getstate__ = state_without_hash

    def __iter__(self) -> Iterator[PNode]:
        return iter(self.nodes)

    def node(self, ident: int) -> PNode:
        return self._by_id[ident]

    @cached_property
    def _by_id(self) -> Mapping[int, PNode]:
        """Node id -> node, made once per PCG: `node` was a scan building this table on every call (24,531 calls,
        6.5 of llama-70b:64's profiled 100 CPU s, mostly `attention_views` asking per flatten)."""
        return {n.id: n for n in self.nodes}

    @cached_property
    def ids(self) -> tuple[int, ...]:
        """The nodes' ids, in the PCG's order, read once per PCG (in C): the pricing keys' table and the layer
        structure each walk them (`search.solve._NodeKeys`, `ir.pipeline.LayerStructure`)."""
        return tuple(map(_NODE_ID, self.nodes))

    @cached_property
    def readers_of(self) -> Mapping[int, tuple[PNode, ...]]:
        """Node id -> the nodes that read it, in the PCG's order (`readers`), worked out once per PCG and shared:
        the step simulator, its floor and the weights' storage each walk them, for every grid point a search
        bounds or simulates. Read only; `readers` gives a copy to change."""
        return _readers_of(self.nodes)

    @cached_property
    def derived(self) -> dict:
        """Facts a later stage works out from this PCG and inputs it names in the key (the cost model's
        `needs_gradient`, which also reads the operator library), kept with the PCG: a search's grid PCG is
        priced, bounded twice and simulated, and each asks for them. Shared: read the values, never change them
        (a table whose every entry is worked out from its own key alone, the compute nodes' times, is filled as
        they are asked: `cost.pcg_tasks`)."""
        return {}

    @cached_property
    def structural(self) -> dict:
        """`derived`'s part for facts read from the nodes' structure alone (`STRUCTURE`) and the outputs (and inputs
        the key names), never a node's shape, attributes, degrees or placement: shared, beside `derived`, by a PCG
        of the same structure with other shapes (`reshaped`: a grid layout rescaled to a graph at another
        micro-batch size, `ir.megatron._rescaled`). Read the values, never change them."""
        return {}

    def derive(self, key, owner, make, structural: bool = False):
        """`derived`'s value for `key` and `owner` (the other input it reads, by identity: the operator library),
        made by `make()` the first time it is asked for. The owner is kept beside the value, so that another
        object given a freed owner's id never reads it. `structural`: the fact reads the nodes' `STRUCTURE` and
        the outputs alone, so it is kept in `structural`, which a reshaped PCG shares. Shared: read it, never
        change it."""
        table = self.structural if structural else self.derived
        known = table.get((key, id(owner)))
        if known is None or known[0] is not owner:
            known = table[(key, id(owner))] = (owner, make())
        return known[1]

    def reshaped(self, nodes: tuple["PNode", ...], *, kept_structure: bool = False) -> "PCG":
        """This PCG with `nodes`, which must have its nodes' `STRUCTURE` (ids, kinds, operators, inputs, roles,
        origins) and may differ in shapes and attributes (a layout rescaled to another graph's sizes), sharing the
        facts worked out from that structure alone (`structural`, `storage_chains`: each reads those fields and
        the outputs, which both PCGs have alike, so either PCG working a fact out gives the same value). Raises
        ValueError where a node's structure differs: sharing would then be wrong. `kept_structure`: the caller
        made each of `nodes` that is not this PCG's own node at its position from that node, its `STRUCTURE` fields
        copied (`ir.megatron._rescaled`), so the comparison, node by node, cannot fail and is left out."""
        if not kept_structure and not _same_structure(self.nodes, nodes):
            raise ValueError("reshaped: the nodes' structure differs from the PCG's")
        return replace(self, nodes=tuple(nodes))._sharing(self)   # the outputs are this PCG's own

    def sharing(self, other: "PCG") -> "PCG":
        """This PCG, sharing the facts `other` works out from its structure alone (`structural`, `storage_chains`),
        where the two have the same nodes' `STRUCTURE` (ids, kinds, operators, inputs, roles, origins) and the same
        outputs; they may differ in anything else (shapes, attributes, spreads, placements, mesh, ZeRO stage,
        recomputation). Each such fact reads those fields and the outputs alone (`structural`), which both PCGs
        have alike, so either PCG working a fact out gives the same value: a layout of one graph on another mesh
        (llama-70b:64's dp 8 x tp 8, 16 x 4 and 32 x 2 hold the same operators reading the same values), or a stage
        grid's on 16 and on 8 devices (`StructureTable`). A new PCG with this one's fields; raises ValueError
        where the structure or the outputs differ: sharing would then be wrong."""
        if self.outputs != other.outputs or not _same_structure(self.nodes, other.nodes):
            raise ValueError("sharing: the PCGs' structure differs")
        return self._sharing(other)

    def _sharing(self, other: "PCG") -> "PCG":
        """`sharing`, the structure and outputs known to be the same (`StructureTable` and `reshaped` compared
        them)."""
        form = replace(self)
        form.__dict__["structural"] = other.structural
        if "storage_chains" in other.__dict__:
            form.__dict__["storage_chains"] = other.storage_chains
        return form

    @cached_property
    def storage_chains(self) -> Mapping[int, tuple[int, ...]]:
        """`weight_storage`'s chains, worked out once per PCG: the step simulator, its floor, the pricer and the
        roles (`pcg_roles`) each ask for them, several times per PCG of a search's grid. Read it through
        `weight_storage`, which hands out a copy: this one is shared."""
        return _weight_storage(self)

    @property
    def max_pieces(self) -> int:
        return max((n.degrees.pieces for n in self.nodes), default=1)


class StructureTable:
    """PCGs by their structure (every node's `STRUCTURE` and the outputs), for a caller that lays out many PCGs
    of few structures (`ir.megatron.megatron_pcg`'s `kin`: llama-70b:64's grids lay out 40 PCGs that work their
    facts out apart, of 12 structures): a PCG of a structure met before shares that one's facts (`PCG.sharing`),
    worked out once rather than once per PCG (roles, blocks, checkpoints, saved values, the step simulator's
    reader counts: ~50-80 ms each on a whole llama-70b layout). The first PCG of each structure is kept, by its
    node count and outputs (a PCG is compared node by node only with those of its count and outputs, and a
    comparison stops at the first node that differs); a table lives as long as its caller's call."""

    def __init__(self) -> None:
        self._known: dict[tuple, list[PCG]] = {}

    def shared(self, pcg: PCG) -> PCG:
        """`pcg`, sharing the facts of the first PCG of its structure kept here (that PCG's `sharing`), or `pcg`
        itself, kept, where it is the first."""
        kept = self._known.setdefault((len(pcg.nodes), pcg.outputs), [])
        first = next((other for other in kept if _same_structure(other.nodes, pcg.nodes)), None)
        if first is None:
            kept.append(pcg)
            return pcg
        return pcg._sharing(first)   # the same outputs (the key) and structure (compared just above)


LAYOUT_FACTS = ("readers_of", "storage_chains", "derived", "structural")
"""What a PCG works out from its nodes and outputs alone and keeps (`PCG`): its readers, its weights' storage
chains, `structural` (the cost model's `needs_gradient`, `kept_values`, `regathered`, `unkept`, the roles and blocks,
each read from the nodes' structure, the outputs and the operator library) and `derived` (a micro-batch's part of
the step floor, `pcg_tasks.step_floor`, read from the nodes and the machine, profile and compute times): never from
the ZeRO stage or the recomputation policy."""


def restated(pcg: PCG, zero: int, recompute: str) -> PCG:
    """`pcg` with ZeRO stage `zero` and recomputation `recompute`, sharing what `pcg` works out from its nodes
    (`LAYOUT_FACTS`): the same nodes and outputs give the same facts, so a layout's forms (ZeRO 0 and 1, keeping or
    recomputing: priced, judged, bounded and simulated, each once) work them out once between them, where each
    form worked out its readers (0.1 CPU s for a llama-70b stage) and saved values again. The shared `derived`
    and `structural` tables are the same objects: a fact one form works out, every form reads (each fact reads nothing the forms
    differ in)."""
    form = replace(pcg, zero=zero, recompute=recompute)
    if form is not pcg:
        for name in LAYOUT_FACTS:
            form.__dict__[name] = getattr(pcg, name)
    return form


# What a value is made from, as the cost model prices the parallel operators reading it (`cost.model`):
# a graph input or a piece of one; a weight leaf; a weight stored sharded (a partition on its storage chain,
# `weight_storage`); a weight's value made by any other parallel operator (a replicate, an all_gather, a
# partition that does not store it), which no rank stores in that layout.
INPUT, WEIGHT, WEIGHT_PIECE, WEIGHT_VALUE = "input", "weight", "weight-piece", "weight-value"
WEIGHT_ROLES = (WEIGHT, WEIGHT_PIECE, WEIGHT_VALUE)
STORED_ROLES = (WEIGHT, WEIGHT_PIECE)   # a further partition of these can store the weight finer


VIEW_OPS = frozenset({"unflatten", "transpose"})
"""Operators that re-index a value without computing (one input, every element kept): a weight read through a
chain of them, the first an `unflatten` (`STRIDED_VIEW`), and then partitioned is stored as that partition
(`weight_storage`; `ir.fused_projections`)."""
STRIDED_VIEW = "unflatten"
"""The view a weight's storage chain starts its views with: a split of an unflattened dim's inner part is a strided
block of the weight, what no partition of the weight itself stores. A chain of transposes alone is left as it was
(its readers slice the weight where they read it), so plans that read a weight through a transpose keep their
storage."""


SHARDED_STATE_STAGES = (1, 2)   # the ZeRO stages `PCG.zero` states (0: none); stage 3 is the layout itself


def describe_zero(stage: int) -> str:
    """A ZeRO stage of `PCG.zero` in words, as `explain`, the plan's parallelism and progress lines say it."""
    held = "optimizer state" if stage == 1 else "gradients and optimizer state"
    return f"ZeRO-{stage} ({held} sharded over each synchronised weight's replicas)"


def readers(pcg: PCG) -> dict[int, list[PNode]]:
    """Node id -> the nodes that read it, in the PCG's order (`PCG.readers_of`, as lists: the caller's to change)."""
    return {ident: list(users) for ident, users in pcg.readers_of.items()}


READERS_GROWN = 32
"""`_readers_of`: how many readers a value's tuple is grown to one at a time before the rest are listed apart."""


def _readers_of(nodes: Sequence[PNode]) -> dict[int, tuple[PNode, ...]]:
    """`PCG.readers_of` worked out: node id -> the nodes that read it, in the nodes' order (a node once per operand
    it reads the value as), ids in the order their first reader comes. Most values have one or two readers, so each
    value's tuple is grown by one reader at a time (no list per value made and then copied to a tuple: half the
    time on a llama-70b layout's ~5,000 nodes, asked for ~250 PCGs a call); a value with more than
    `READERS_GROWN` readers (a rotary table read by every block) has its further readers listed apart and joined
    once at the end, so no value's tuple is copied more than `READERS_GROWN` times."""
    users: dict[int, tuple[PNode, ...]] = {}
    more: dict[int, list[PNode]] = {}
    found_of = users.get
    for node in nodes:
        for i in node.inputs:
            found = found_of(i)
            if found is None:
                users[i] = (node,)
            elif len(found) < READERS_GROWN:
                users[i] = found + (node,)
            else:
                more.setdefault(i, []).append(node)
    for i, rest in more.items():
        users[i] += tuple(rest)   # the value's key keeps its place: its first reader's
    return users


def state_shardings(pcg: PCG) -> dict[int, int]:
    """Stored-at node (`weight_storage`'s last) -> the `replicate` reading it that synchronises its gradient (the
    first, if several): the weights whose state ZeRO stage 1 or 2 (`PCG.zero`) shards over that replicate's
    devices, as the cost model (`cost.model.shards_state`), the step simulator and the backend all take them."""
    users = pcg.readers_of
    out: dict[int, int] = {}
    for chain in weight_storage(pcg).values():
        for user in users.get(chain[-1], []):
            if user.kind == "parallel" and user.op == REPLICATE and chain[-1] not in out:
                out[chain[-1]] = user.id
    return out


def weight_storage(pcg: PCG) -> dict[int, tuple[int, ...]]:
    """`_weight_storage`, kept with the PCG (`PCG.storage_chains`); a copy, the caller's to change."""
    return dict(pcg.storage_chains)


def _weight_storage(pcg: PCG) -> dict[int, tuple[int, ...]]:
    """Weight leaf id -> its storage chain: the leaf, then each partition that is the only reader of the node
    before it. The weight is stored as the last node's piece, and the partitions on the chain run nothing.
    Before the first partition the chain may pass through views of the leaf (`VIEW_OPS`, each the only reader
    of the node before it, the first an unflatten: `STRIDED_VIEW`): the weight is then stored as a piece of its
    view, a contiguous block of the view that is a strided block of the weight (Megatron-LM's head-ordered fused
    QKV weight, `ir.fused_projections`; torch's `_StridedShard`). Views that no partition follows are not storage:
    the chain stops at the leaf.

    This is how the backend stores weights (`backend.executor`), how the step simulator runs them and how
    the cost model prices a PCG (`pcg_roles`): a weight with several readers is held whole (or as the piece
    its chain gives), and a partition reading it beside another reader slices it and gathers the gradient.
    """
    users = pcg.readers_of
    chains: dict[int, tuple[int, ...]] = {}
    for node in pcg.nodes:
        if node.kind != "leaf" or node.role != WEIGHT:
            continue
        chain = [node.id]
        first = users.get(node.id, ())
        if len(first) == 1 and first[0].kind == "op" and first[0].op == STRIDED_VIEW:
            while len(users.get(chain[-1], ())) == 1 and users[chain[-1]][0].kind == "op" \
                    and users[chain[-1]][0].op in VIEW_OPS:
                chain.append(users[chain[-1]][0].id)
        while len(users.get(chain[-1], ())) == 1 and users[chain[-1]][0].kind == "parallel" \
                and users[chain[-1]][0].op == PARTITION:
            chain.append(users[chain[-1]][0].id)
        while pcg.node(chain[-1]).kind == "op":   # views no partition follows
            chain.pop()
        chains[node.id] = tuple(chain)
    return chains


def storage_views(pcg: PCG, chain: Sequence[int]) -> tuple[PNode, ...]:
    """The views (`VIEW_OPS`) a weight's storage chain (`weight_storage`) passes through before its partitions:
    none where the weight is stored as a block of itself. A backend that stores a weight as a block of the
    parameter refuses a chain with views (the parameter's piece is then a strided block, `ir.fused_projections`)."""
    return tuple(node for node in (pcg.node(i) for i in chain[1:]) if node.kind == "op")


def weight_placement(pcg: PCG, chain: Sequence[int]) -> tuple[Placement, tuple[int, ...]]:
    """(placement, split factor on each mesh axis) of the weight whose storage chain is `chain`, in the weight's
    own dims: the chain's end's placement and factors 1 where the weight is stored as a block of itself. Stored as a block of
    its view `unflatten(w, u, k)` ([.., m / k, k, ..]: HF GPT-2's q, k and v column blocks of its fused `c_attn`,
    `ir.fused_projections`), a split of the view's dim u + 1 is the weight's dim u split with split factor m / k
    (each rank its block of every one of the m / k column blocks: torch's `_StridedShard(u, m / k)`), a split of
    dim u the weight's dim u (factor 1), of a dim after u + 1 the weight's dim before it. Raises ValueError for
    another view, or for dim u and u + 1 both split (no one split of the weight)."""
    from parsat.ir.placement import shard, shard_dim

    end = pcg.node(chain[-1]).placement
    views = storage_views(pcg, chain)
    if not views:
        return end, (1,) * len(end.codes)
    view = views[0]
    if len(views) != 1 or view.op != STRIDED_VIEW:
        raise ValueError(f"weight '{pcg.node(chain[0]).op}' is stored as {end} of its view "
                         f"{' -> '.join(v.label for v in views)}: only a split of one unflatten's dims is a split of "
                         "the weight")
    u = int(view.attr("dim"))
    dims = [shard_dim(code) for code in end.codes]
    if u in dims and u + 1 in dims:
        raise ValueError(f"weight '{pcg.node(chain[0]).op}' is stored as {end} of its view {view.label}: both "
                         f"halves of its dim {u} split")
    codes = tuple(code if d is None else shard(d if d <= u else d - 1) for code, d in zip(end.codes, dims))
    return Placement(codes), tuple(int(view.shape[u]) if d == u + 1 else 1 for d in dims)


def weight_chains(pcg: PCG) -> frozenset[int]:
    """The weight leaves and the values made from them by parallel operators only (`pcg_roles`): what a step
    of several micro-batches makes once and reduces the gradient of once (`ir.costs.NodeCost.per_step`). Worked
    out once per PCG (`PCG.derive`, as `pcg_roles`)."""
    return pcg.derive("weight_chains", None,
                      lambda: frozenset(ident for ident, role in pcg_roles(pcg).items() if role in WEIGHT_ROLES),
                      structural=True)


def pcg_roles(pcg: PCG) -> Mapping[int, str]:
    """`_pcg_roles`, worked out once per PCG and shared (`PCG.derive`): it reads the nodes and the weights'
    storage alone, never the ZeRO stage or recomputation, so a layout's forms share it too; pricing, the saved
    values, the step simulator and the recomputation's checkpoints each asked again (753 times on
    llama-70b:64). Read it, never change it."""
    return pcg.derive("pcg_roles", None, lambda: _pcg_roles(pcg), structural=True)


def _pcg_roles(pcg: PCG) -> dict[int, str]:
    """Node id -> role, as `extract.leaf_roles` gives e-classes: leaves by their role, values made from them by
    parallel operators only as INPUT, WEIGHT_PIECE (on a weight's storage chain, `weight_storage`) or
    WEIGHT_VALUE. Unlike an e-class, a PCG node knows its readers: a partition of a weight that has other
    readers too is WEIGHT_VALUE, not a stored piece. A view on a storage chain (`weight_storage`) is the whole
    weight seen in another shape: WEIGHT, so the partition storing it is priced as the weight's storage."""
    stored = {i for chain in weight_storage(pcg).values() for i in chain[1:]}
    roles: dict[int, str] = {}
    for node in pcg.nodes:
        if node.kind == "leaf":
            roles[node.id] = node.role or INPUT
        elif node.kind == "op" and node.id in stored:
            roles[node.id] = WEIGHT
        elif node.kind == "parallel" and node.inputs[0] in roles:
            source = roles[node.inputs[0]]
            roles[node.id] = INPUT if source == INPUT else WEIGHT_PIECE if node.id in stored else WEIGHT_VALUE
    return roles
