"""Extraction: the cheapest acyclic choice of one e-node per needed e-class.

The cost of a plan is additive over the e-nodes it uses, each counted once
(a DAG, not a tree): a node's cost depends only on its own e-class and its
children's e-classes (shape and spread are properties of the e-class), so
`node_costs` prices every e-node once with the cost model. Three passes:

1. bottom-up (Knuth's generalisation of Dijkstra): tree-optimal, and a class
   is only chosen after all children of its node are final, so it never picks
   a cycle;
2. DAG-aware greedy (extraction-gym's "faster greedy DAG"): the cost of a
   choice is the sum over the *set* of e-nodes below it, so shared subgraphs
   count once;
3. an ILP (HiGHS) under a time limit, warm-started from the best of the
   above, with the per-device memory limit as a constraint, over the acyclic
   sub-e-graph the bottom-up pass's order defines, and, for a repeated model,
   again from its plan with the e-nodes that re-make a class of the warm
   start from earlier values (see `ilp`, `value_order`).

The best plan that fits in memory wins.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import heapq
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence

from parsat.dsl.library import Library
from parsat.dsl.parallel_ops import PARALLEL_OPS, PARTITION, REPLICATE
from parsat.ir.costs import NodeCost
from parsat.ir.graph import Graph, instance_for
from parsat.ir.machine import Machine
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import INPUT, STORED_ROLES, WEIGHT, WEIGHT_PIECE, WEIGHT_VALUE, Degrees
from parsat.ir.ring_attention import CAUSAL_MASK, RING_ATTENTION, ZIGZAG
from parsat.ir.units import fmt_bytes_pair
from parsat.cost.collectives import BROADCAST, GroupTopology, price
from parsat.cost.model import compute_cost, gather_cost, parallel_cost
from parsat.cost.pcg_tasks import profile_for
from parsat.cost.ring_time import ring_work
from parsat.cost.saved import kept
from parsat.egraph.encoding import PIN_SUFFIX
from parsat.egraph.runner import Limits
from parsat.egraph.snapshot import ENode, Kept, Snapshot
from parsat.search.value_order import value_order

NodeId = tuple[int, int]  # (e-class, index of the e-node in the class)
EPSILON = 1e-12           # a strictly positive cost per node keeps tree costs strictly increasing


class ExtractionError(Exception):
    """No plan can be extracted (nothing reaches the roots, or nothing fits in memory)."""

    def __init__(self, message: str = "", needed_bytes: int = 0):
        super().__init__(message)
        self.needed_bytes = needed_bytes   # when nothing fits: what the smallest plan found needs per device


# ------------------------------------------------------------------- node costs


def leaf_roles(snapshot: Snapshot, graph: Graph) -> dict[int, str]:
    """E-class -> role (`ir.pcg`'s roles) for classes that hold a graph leaf ("input" / "weight") or a value made
    from one by parallel operators only: "input", "weight-piece" (made by partitions only: a weight can be
    stored so) or "weight-value" (anything else). The cost model prices their parallel operators as storage and
    gradient synchronisation, not as activations (`cost.parallel_cost`). Worked out once per snapshot and
    graph leaves' roles (`Snapshot.derived`); each caller gets its own copy."""
    roles = {leaf.name: leaf.role for leaf in graph.leaves}
    return dict(snapshot.derive(("leaf_roles", tuple(roles.items())), lambda: _leaf_roles(snapshot, roles)))


def _leaf_roles(snapshot: Snapshot, roles: Mapping[str, str]) -> dict[int, str]:
    """`leaf_roles`, worked out."""
    found: dict[int, str] = {}
    for cid, nodes in snapshot.classes.items():
        for node in nodes:
            if node.op == "leaf" and node.attrs[0].removesuffix(PIN_SUFFIX) in roles:
                found[cid] = roles[node.attrs[0].removesuffix(PIN_SUFFIX)]

    def spread(role_of: Callable[[str, str], str | None]) -> None:
        """Give every class without a role the one `role_of(op, its child's role)` says, to a fixpoint."""
        changed = True
        while changed:
            changed = False
            for cid, nodes in snapshot.classes.items():
                if cid in found:
                    continue
                for node in nodes:
                    role = role_of(node.op, found[node.children[0]]) if node.op in PARALLEL_OPS and \
                        node.children[0] in found else None
                    if role is not None:
                        found[cid] = role
                        changed = True
                        break

    # A class a partition chain reaches is a stored piece however else it is made, so those come first.
    spread(lambda op, child: WEIGHT_PIECE if op == PARTITION and child in STORED_ROLES else None)
    spread(lambda op, child: INPUT if child == INPUT else WEIGHT_VALUE)
    return found


def node_costs(snapshot: Snapshot, graph: Graph, library: Library, machine: Machine,
               free_input_placements: bool = True, input_pins: Mapping[str, Degrees] | None = None,
               zero: int = 0, only: Callable[[str, str], bool] | None = None,
               computed: dict | None = None) -> dict[NodeId, NodeCost]:
    """Every e-node priced by the cost model on the snapshot's mesh; e-nodes the model rejects are left out.
    `zero` is the plan's ZeRO stage (`Pricer`); `only(op, first child's role)`, when given, says which e-nodes
    to price (those a ZeRO stage prices differently, `cost.model.shards_state`); `computed`, compute operators'
    costs shared with other pricers of `library` (`Pricer`).

    With `free_input_placements` (the default) graph inputs may arrive in any
    placement (the data loader reads the pieces each device needs); otherwise a
    graph input arrives whole and replicating it is a broadcast. An input in
    `input_pins` arrives in that layout: reading it whole costs a gather.
    """
    roles = leaf_roles(snapshot, graph)
    held = kept_classes(snapshot, graph, library)
    overlap = profile_for(machine).overlap   # the profile runs ring attention as a ring (`cost.ring_time.rings_run`)
    pricer = Pricer(library, machine, snapshot.mesh or Mesh(()), free_input_placements, input_pins, graph.microbatches,
                    zero, computed)
    # What the pricer reads of a class is its shape, spread and role: classes are numbered by those, once, and an
    # e-node's cost is kept by its operator, attributes and its and its children's numbers. The classes of a
    # saturated e-graph repeat a few of them (every block alike), so most e-nodes are answered by a look-up of
    # small integers, not by the pricer's key of shapes and spreads, hashed afresh for each of 10^5 e-nodes.
    kinds: dict[tuple, int] = {}
    kind = {cid: kinds.setdefault((shape, snapshot.degrees[cid], roles.get(cid, "")), len(kinds))
            for cid, shape in snapshot.shape.items()}
    priced: dict[tuple, NodeCost | None] = {}
    out: dict[NodeId, NodeCost] = {}
    for cid, nodes in snapshot.classes.items():
        if cid not in kind:
            continue
        for index, node in enumerate(nodes):
            # two filters, either first: `only` (a ZeRO stage's few parallel e-nodes) first skips most e-nodes
            if only is not None and not only(node.op, roles.get(node.children[0], "") if node.children else ""):
                continue
            if any(ch not in kind for ch in node.children):
                continue
            if overlap and made_in_kernel(snapshot, node):
                out[(cid, index)] = NodeCost()
                continue
            ring = ring_form(snapshot, node) if overlap else ()
            key = (node.op, node.attrs, kind[cid], tuple(kind[ch] for ch in node.children), cid in held, ring)
            cost = priced.get(key, _UNPRICED)
            if cost is _UNPRICED:
                cost = priced[key] = _price_enode(pricer, snapshot, roles, cid, node, cid in held, ring)
            if cost is not None:
                out[(cid, index)] = cost
    return out


class ComputedCosts(dict):
    """Compute operators' costs by what they read (`Pricer`'s `computed`: tuple keys), and beside them the operators'
    instances by shapes and attributes (`instances`, `instance_for`'s memo), shared by the same pricers: compute
    costs differ by spreads, instances only by shapes (gpt-6.7b:64 worked out 2,759 compute costs of 360
    instances, and instantiating was a third of each). A plain dict given as `computed` shares costs only."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.instances: dict = {}
        self.inferred: dict = {}   # spread inference's findings (`cost.model.compute_time`'s memo)


_UNPRICED = object()   # `node_costs`: no e-node of this kind priced yet (None is a price: the model rejects it)


def _price_enode(pricer: "Pricer", snapshot: Snapshot, roles: Mapping[int, str], cid: int, node: ENode,
                 kept: bool = True, ring: tuple[float, ...] = ()) -> NodeCost | None:
    """One e-node of class `cid` priced (`Pricer.price`); `kept`: whether the class's value is kept for
    backward (`kept_classes`). A gather gathered again for backward is charged the whole second all-gather
    (no `cover`: which readers a plan picks is not known here, an upper bound as `kept_classes` is; per-class
    estimates of the readers' input gradients made extraction return plans 2-8% slower by exact pricing,
    docs/COSTMODEL.md "The backward re-gather")."""
    parallel = node.op in PARALLEL_OPS
    return pricer.price(node.op, node.attrs[:-1] if parallel else node.attrs, snapshot.shape[cid],
                        snapshot.degrees[cid], tuple(snapshot.shape[ch] for ch in node.children),
                        tuple(snapshot.degrees[ch] for ch in node.children),
                        tuple(roles.get(ch, "") for ch in node.children), node.attrs[-1] if parallel else None,
                        kept=kept, ring=ring)


def ring_form(snapshot: Snapshot, node: ENode) -> tuple[float, ...]:
    """A fused attention e-node in ring form, its slowest rank's shares of the dense block row step by step
    (`cost.ring_time.ring_work`), else (): q split along its sequence (p pieces), k and v whole along theirs, a
    mask's rows split with the queries; causal where the mask's class holds a row split of `causal_mask`, balanced
    where of its zigzag rows over 2p chunks (`attention_causal_zigzag_query_parallel`). The
    step simulator rings only k and v all-gathered on one axis for this attention alone (`ir.ring_attention`),
    which an e-node cannot know (which of its classes' e-nodes a plan picks): here the compute is the ring's
    wherever the placements are, its transfers priced on whatever makes k and v whole (an all-gather: not
    overlapped, an upper bound of the pass)."""
    if node.op not in RING_ATTENTION:
        return ()
    q, k, v = (snapshot.degrees[c] for c in node.children[:3])
    parts = q.shard[-2]
    if parts == 1 or k.shard[-2] != 1 or v.shard[-2] != 1:
        return ()
    causal = balanced = False
    if node.op == "attention_masked":
        mask = node.children[3]
        if snapshot.degrees[mask].shard[0] != parts:
            return ()
        rows = [n.children[0] for n in snapshot.classes[mask] if n.op == PARTITION and int(n.attrs[0]) == 0]
        causal = any(_holds_causal_mask(snapshot, r) for r in rows)
        balanced = any(_holds_zigzag_mask(snapshot, r, 2 * parts) for r in rows)
    return ring_work(parts, causal or balanced, balanced)


def _holds_causal_mask(snapshot: Snapshot, cid: int) -> bool:
    return any(m.op == CAUSAL_MASK for m in snapshot.classes.get(cid, ()))


def _holds_zigzag_mask(snapshot: Snapshot, cid: int, chunks: int | None = None) -> bool:
    """Whether class `cid` holds the causal mask's rows in zigzag order (of `chunks` chunks, any where None)."""
    return any(m.op == ZIGZAG and int(m.attrs[0]) == 0 and (chunks is None or int(m.attrs[1]) == chunks)
               and _holds_causal_mask(snapshot, m.children[0]) for m in snapshot.classes.get(cid, ()))


def made_in_kernel(snapshot: Snapshot, node: ENode) -> bool:
    """Whether `node` is the causal ring's mask, which a GPU kernel makes from the rank's offset and nobody stores
    (`ir.ring_attention.RingAttention.generated`, priced so by the step simulator): `causal_mask`, its rows in
    zigzag order, or a split of either's rows. Only the causal ring's rule makes the mask, so its class is read by the ring alone (the simulator
    checks that in the plan). Under `parsat run`'s interpreter the mask is made whole and sliced: not here."""
    if node.op == CAUSAL_MASK:
        return True
    if node.op == ZIGZAG:
        return int(node.attrs[0]) == 0 and _holds_causal_mask(snapshot, node.children[0])
    return node.op == PARTITION and int(node.attrs[0]) == 0 and (
        _holds_causal_mask(snapshot, node.children[0]) or _holds_zigzag_mask(snapshot, node.children[0]))


def kept_classes(snapshot: Snapshot, graph: Graph, library: Library) -> frozenset[int]:
    """The e-classes whose value is kept for backward (`cost.saved.kept`): some e-node reading the class has a
    backward that reads it, whichever of the class's readers a plan picks (an upper bound, as extraction needs
    a node's cost not to depend on the others picked). Worked out once per snapshot and library. A gather of a
    kept class is priced gathered again for backward whatever reads it (no `kept_whole`, `cost.saved.regathers`),
    though a plan's PCG is priced knowing which gathers a non-product's backward reads (`search.solve`): telling
    them here too made llama-70b's pinned extraction leave 81 of its 161 norms unsplit where main splits 158 or
    more (tests/test_sequence_parallel_extraction.py; not investigated further)."""
    roles = leaf_roles(snapshot, graph)
    readers = ((cid, node.op, node.children) for cid, nodes in snapshot.classes.items() for node in nodes
               if node.op != "leaf")
    return snapshot.derive(("kept_classes", tuple(sorted(roles.items()))), lambda: kept(readers, library, roles))


class Pricer:
    """Prices one node (an e-node or a PCG node) with the cost model on a mesh, memoised.

    `attrs` are the operator's non-tensor arguments in declaration order
    (reals may be strings, as the e-graph stores them; a parallel operator's
    dim, if it has one); `axis` is the mesh axis a parallel operator acts
    on; `roles` say which children are graph inputs or weights; `stores`
    whether a partition of a weight is its storage (`cost.parallel_cost`:
    an e-node assumes so, a PCG node knows).

    `computed` (a dict the pricers of one library share) keeps compute operators' costs by what they read: the
    operator, its attributes, shapes, spreads, which inputs are weights and the machine, never the mesh or
    the micro-batch count (`_compute` reads neither). The independent grid prices each layout's PCG again
    with its state sharded and recomputing blocks: the same compute nodes, each worked out once. The machine is
    kept less its node count (`_compute_machine`): `_compute` reads of the machine its kind's speeds and
    precision (`cost.model.compute_cost` and `cost.op_time`: `peak_flops`, `memory_bandwidth`, `efficiency`,
    `dtype_bytes`, `precision_spec`), never `nodes` or `devices`, so the stage steps of a pipeline (a machine of
    fewer nodes) and the sequential baseline's one device share the meshes' compute costs: bert-large:64 worked
    out 4,218 compute costs, 2,855 of them different.
    """

    def __init__(self, library: Library, machine: Machine, mesh: Mesh, free_input_placements: bool = True,
                 input_pins: Mapping[str, Degrees] | None = None, microbatches: int = 1, zero: int = 0,
                 computed: dict | None = None):
        self.library, self.machine, self.mesh, self.free_input_placements = library, machine, mesh, free_input_placements
        self.input_pins = dict(input_pins or {})
        self.microbatches = microbatches   # every cost is per step: `NodeCost.per_step`
        self.zero = zero                   # the plan's ZeRO stage 1 or 2 (`cost.model.shards_state`), or 0
        self.cache: dict = {}
        self.computed = ComputedCosts() if computed is None else computed
        # the operators' instances (`instance_for`'s memo): the call's, where `computed` is a `ComputedCosts`
        self.instances: dict = getattr(self.computed, "instances", {})
        self.inferred: dict = getattr(self.computed, "inferred", {})   # likewise `compute_time`'s memo
        self._compute_machine = _compute_machine(machine)

    def price(self, op: str, attrs: tuple, shape, degrees: Degrees, child_shapes, child_degrees, roles,
              axis: int | None = None, stores: bool = True, gradient: bool = True, kept: bool = True,
              cover: float = 0.0, kept_whole: bool = False, ring: tuple[float, ...] = ()) -> NodeCost | None:
        """`ring`: a ring-form attention's shares of its block row (`ring_form`), priced as the ring computes."""
        devices = self.mesh.world
        if op == "leaf":
            pinned = self.input_pins.get(attrs[0]) if attrs else None
            return gather_cost(self.machine, pinned, shape, devices).per_step(self.microbatches) if pinned else NodeCost()
        key = (op, tuple(attrs), tuple(shape), degrees, tuple(child_shapes), tuple(child_degrees), tuple(roles), axis,
               stores, gradient, kept, cover, kept_whole, ring)
        # one look-up where the node is known: the key's spreads hash afresh on every look-up (`Degrees` keeps no
        # hash), and `in` then `[]` hashed it twice per call, ~144,000 calls on llama-70b:64
        found = self.cache.get(key, _UNPRICED)
        if found is not _UNPRICED:
            return found
        if op in PARALLEL_OPS:
            role = roles[0]
            if role == INPUT and not self.free_input_placements and op == REPLICATE:
                role = "broadcast-input"
            cost = _parallel(op, GroupTopology.of_axis(self.mesh, axis), shape, child_degrees[0], degrees, self.machine,
                             role, devices, stores, self.zero, self.microbatches, gradient, kept, cover, kept_whole)
        else:
            weights = tuple(r == WEIGHT for r in roles)
            reads = (op, tuple(attrs), tuple(child_shapes), tuple(child_degrees), degrees, weights,
                     self._compute_machine, kept, ring)
            cost = self.computed.get(reads, _UNPRICED)
            if cost is _UNPRICED:
                cost = self.computed[reads] = _compute(self.library, op, attrs, child_shapes, child_degrees,
                                                       degrees, self.machine, weights, kept, self.instances, ring,
                                                       self.inferred)
        cost = self.cache[key] = cost.per_step(self.microbatches) if cost is not None else None
        return cost


def _parallel(op: str, group: GroupTopology, shape, source: Degrees, out: Degrees,
              machine: Machine, role: str, devices: int, stores: bool = True, zero: int = 0,
              microbatches: int = 1, gradient: bool = True, kept: bool = True, cover: float = 0.0,
              kept_whole: bool = False) -> NodeCost:
    degree = group.size
    if role == "broadcast-input":  # a whole input sent to the copies: (p-1) n elements
        n = source.piece_elements(shape)
        return NodeCost(comm_s=price(BROADCAST, group, n * machine.dtype_bytes, machine).seconds,
                        comm_elements=(degree - 1) * n * source.pieces * max(1, devices // out.pieces),
                        collectives=(f"fwd broadcast ({degree} devices, {n} elements)",))
    return parallel_cost(op, degree, shape, source, out, machine, role, devices, group, stores, zero, microbatches,
                         gradient, kept, cover, kept_whole)


def _compute_machine(machine: Machine) -> Machine:
    """What `_compute` reads of `machine`, as a key: the machine on one node (see `Pricer`)."""
    return machine if machine.nodes == 1 else replace(machine, nodes=1)


def _compute(library: Library, op_name: str, values: tuple, shapes, input_degrees, out: Degrees, machine: Machine,
             weights, kept: bool = True, instances: dict | None = None, ring: tuple[float, ...] = (),
             inferred: dict | None = None) -> NodeCost | None:
    """A compute operator's cost on its pieces (None where the model cannot price it). `instances`: `instance_for`'s
    memo, which gives the instance it makes (the same refusal where it refuses: `InstantiationError` is kept,
    any other error is raised again each time), so the cost is the same with or without it; `inferred` likewise
    (`cost.model.compute_time`'s memo)."""
    op = library.ops.get(op_name)
    if op is None:
        return None
    attrs = {}
    for param, value in zip(op.attr_params, values):
        attrs[param.name] = float(value) if param.type.kind == "real" else int(value)
    try:
        instance = instance_for(op, shapes, attrs, instances)
    except Exception:  # the cost model only prices what instantiates; anything else is not extractable
        return None
    cost = compute_cost(instance, input_degrees, out, machine, weights, kept, ring, inferred)
    return None if cost.problems else cost


# ---------------------------------------------------------------------- results


@dataclass(frozen=True)
class Extraction:
    """A choice of e-node per e-class (only the classes the plan needs)."""

    choice: Mapping[int, int]
    time_s: float
    memory_bytes: int
    method: str
    seconds: Mapping[str, float] = field(default_factory=dict)
    candidates: Mapping[str, float] = field(default_factory=dict)  # method -> DAG time (inf: none)
    ilp_status: str = ""

    @property
    def lean(self) -> bool:
        """Whether the plan came from `lean_choices` (no pass ranking by time alone found one that fits): a plan
        that fits, but maybe not the fastest a policy holding less would give (`mesh._extract_joint`)."""
        return self.method in (LEAN, LEAN_ILP)


Obliged = Mapping[NodeId, tuple[tuple[int, ...], ...]]   # e-node -> groups of classes, one of each to be held


def dag_cost(snapshot: Snapshot, costs: Mapping[NodeId, NodeCost], choice: Mapping[int, int],
             roots: Sequence[int], obliged: Obliged | None = None) -> tuple[float, int, list[int]] | None:
    """(time, memory, classes in topological order) of a choice, each class once; None if cyclic or incomplete.
    `obliged` (`repeat.copy_obligations`): what a chosen e-node obliges the plan to hold beside its children
    (the first class of each group the choice holds; None where it holds none), counted with them."""
    order: list[int] = []
    state: dict[int, int] = {}  # 1 visiting, 2 done
    state_of, chosen_in, classes = state.get, choice.get, snapshot.classes   # bound once: ~470 walks a search
    pending = list(roots)
    scanned = 0   # classes of `order` whose obligations are in `pending`
    while pending:
        stack = [(pending.pop(0), False)]
        while stack:
            cid, exiting = stack.pop()
            if exiting:
                state[cid] = 2
                order.append(cid)
                continue
            seen = state_of(cid)
            if seen == 2:
                continue
            if seen == 1:
                return None  # a cycle
            index = chosen_in(cid)
            if index is None or (cid, index) not in costs:
                return None
            state[cid] = 1
            stack.append((cid, True))
            for child in classes[cid][index].children:
                seen = state_of(child)
                if seen == 1:
                    return None
                if seen != 2:
                    stack.append((child, False))
        if obliged and not pending:
            # what the classes found so far oblige, as more roots; their subtrees may oblige more (to a fixpoint)
            for cid in order[scanned:]:
                for group in obliged.get((cid, choice[cid]), ()):
                    if any(state_of(c) == 2 for c in group):
                        continue
                    held = next((c for c in group if c in choice), None)
                    if held is None:
                        return None
                    pending.append(held)
            scanned = len(order)
    chosen = [costs[(c, choice[c])] for c in order]   # each summed in `order`, as before
    return sum(cost.time_s for cost in chosen), sum(cost.memory_bytes for cost in chosen), order


def _usable(costs, exclude, obliged: Obliged | None = None) -> Callable[[NodeId], bool]:
    """Whether an e-node may be chosen: priced, not excluded, and not obliging a plan to hold a class that no
    e-node makes (an empty group of `obliged`)."""
    if obliged:
        barred = frozenset(nid for nid, groups in obliged.items() if not all(groups))
        if barred:
            return _usable(costs, barred.__contains__ if exclude is None
                           else (lambda nid: nid in barred or exclude(nid)))
    if exclude is None:
        return lambda nid: nid in costs
    return lambda nid: nid in costs and not exclude(nid)


@dataclass(frozen=True)
class _Numbering:
    """A snapshot's e-nodes and classes as small integers, for the passes (`_Walk`, `bottom_up`, `greedy_dag`): every
    e-node numbered in (class, index) order, so that a pass's heap entry (weight, number) is ordered as (weight,
    class, index) was, and ties are broken as they were; every class read or holding an e-node numbered. A pass
    then walks lists indexed by these numbers rather than dicts keyed by (class, index) tuples, whose hashing was
    most of a pass's cost. Worked out once per snapshot (`numbering`); shared: read it, never change it."""

    nids: tuple[NodeId, ...]              # e-node number -> its id
    number: Mapping[NodeId, int]          # its id -> its number
    cls: tuple[int, ...]                  # e-node number -> its class's number
    kids: tuple[tuple[int, ...], ...]     # e-node number -> the numbers of the classes it reads (`Snapshot.kids`)
    waiting: tuple[int, ...]              # e-node number -> how many classes it reads
    # class number -> the numbers of the e-nodes reading it and other classes (`readers`) or it alone (`single`)
    readers: tuple[tuple[int, ...], ...]
    single: tuple[tuple[int, ...], ...]
    leaves: tuple[int, ...]               # the e-nodes reading no class
    loops: tuple[int, ...]                # the e-nodes that read their own class (never choosable)
    classes: int                          # how many classes are numbered
    class_number: Mapping[int, int]       # class id -> its number
    cids: tuple[int, ...]                 # class number -> its id
    # class number -> its first e-node's number, and one past the last class's: a class's e-nodes are numbered
    # `first[c]:first[c + 1]` (numbers follow (class, index), so a class's e-nodes are consecutive, and the classes
    # holding e-nodes are numbered first, in id order; a class read but holding none has an empty range at the end)
    first: tuple[int, ...]


def numbering(snapshot: Snapshot) -> _Numbering:
    """`_Numbering` of `snapshot`, worked out once (`Snapshot.derive`)."""
    return snapshot.derive("extract.numbering", lambda: _numbered(snapshot))


def _numbered(snapshot: Snapshot) -> _Numbering:
    """`numbering`, worked out."""
    kids_of = snapshot.kids
    nids = tuple(sorted(kids_of))
    class_number: dict[int, int] = {}
    number = class_number.setdefault
    cls = tuple(number(cid, len(class_number)) for cid, _index in nids)
    kids = tuple(tuple(number(child, len(class_number)) for child in kids_of[nid]) for nid in nids)
    readers: list[list[int]] = [[] for _ in range(len(class_number))]
    single: list[list[int]] = [[] for _ in range(len(class_number))]
    for n, read in enumerate(kids):
        for child in read:
            (readers if len(read) > 1 else single)[child].append(n)
    first = [len(nids)] * (len(class_number) + 1)
    for n in range(len(nids) - 1, -1, -1):
        first[cls[n]] = n
    return _Numbering(nids, {nid: n for n, nid in enumerate(nids)}, cls, kids, tuple(map(len, kids)),
                      tuple(map(tuple, readers)), tuple(map(tuple, single)),
                      tuple(n for n, read in enumerate(kids) if not read),
                      tuple(n for n, read in enumerate(kids) if cls[n] in read), len(class_number),
                      class_number, tuple(class_number), tuple(first))


@dataclass(frozen=True)
class _Walk:
    """What the passes of one `usable` walk, by `_Numbering`'s numbers: each class's choosable readers (a usable
    e-node that does not read its own class is choosable), apart by how many classes they read as `_Numbering`
    holds them (`readers`, `single`), and the choosable e-nodes reading nothing (`ready`). A reader of one class
    alone is ready as soon as that class is final, and its value is its weight plus that class's (the sum over
    one child): the passes need not count down what it waits for."""

    numbers: _Numbering
    readers: Sequence[Sequence[int]]   # class number -> its choosable readers that read other classes too
    single: Sequence[Sequence[int]]    # class number -> its choosable readers that read it alone
    ready: Sequence[int]
    ok: Sequence[bool]                 # e-node number -> whether it is choosable (the ILP's columns ask, `ilp`)

    @staticmethod
    def of(snapshot: Snapshot, usable: Callable[[NodeId], bool]) -> "_Walk":
        """The walk of `usable`'s e-nodes (`usable` is asked about every e-node, and must read nothing else)."""
        numbers = numbering(snapshot)
        ok = list(map(usable, numbers.nids))
        for n in numbers.loops:
            ok[n] = False
        return _Walk(numbers, [[n for n in read if ok[n]] for read in numbers.readers],
                     [[n for n in read if ok[n]] for read in numbers.single], [n for n in numbers.leaves if ok[n]],
                     ok)


@dataclass(frozen=True)
class Choosable:
    """The e-nodes one extraction's passes may choose, worked out once for all of them (`walk`: every `usable`
    e-node that does not read its own class, by `_Numbering`'s numbers, and which of them read each class), and
    each e-node's time (`time`, by number) and weight as the passes rank by time (`weight`: its time plus
    `EPSILON`, made when a pass first asks: the passes at a memory price never do). An extraction runs the
    bottom-up pass twice or more and the greedy DAG pass once over the same e-nodes and costs (`extract`); each
    scanned every e-node and priced each it met afresh. The lists hold an entry for every numbered e-node; only
    the choosable ones' are read (an unpriced e-node's time is 0.0)."""

    walk: _Walk
    time: Sequence[float]     # e-node number -> its time (`NodeCost.time_s`)
    # its times and memory bytes as arrays of floats (numpy's), by e-node number: what a pass at a price per byte
    # weighs e-nodes by (`with_memory`), or None
    priced: tuple | None = None

    @staticmethod
    def of(snapshot: Snapshot, costs: Mapping[NodeId, NodeCost], usable: Callable[[NodeId], bool],
           like: "Choosable | None" = None, raised: Mapping[NodeId, NodeCost] | None = None) -> "Choosable":
        """`like`: another `Choosable` of the same snapshot and `usable` over costs of the same e-nodes (its
        `walk` reads nothing else), taken rather than every e-node scanned again (`lean_choices` shares its
        extraction's). `raised`: e-nodes of `costs` whose cost the passes rank by another (`_guided`): the
        times are those of `costs` (`node_times`) with theirs replaced."""
        walk = _Walk.of(snapshot, usable) if like is None else like.walk
        time = node_times(snapshot, costs)
        if raised:
            time, number = list(time), walk.numbers.number
            for nid, cost in raised.items():
                time[number[nid]] = cost.time_s
        return Choosable(walk, time)

    @functools.cached_property
    def weight(self) -> Sequence[float]:
        """E-node number -> its time + EPSILON."""
        return [t + EPSILON for t in self.time]

    def with_memory(self, costs: Mapping[NodeId, NodeCost]) -> "Choosable":
        """This, with each e-node's memory beside its time (`priced`), for passes weighing memory at a price
        (`bottom_up`'s `memory_price`): `lean_choices` runs up to LEAN_PRICES + LEAN_BISECTIONS of them over the same
        e-nodes and costs, and each looked both figures up again per e-node (`NodeCost.time_s` a sum of four). The
        weight is the same float: the same time, plus the price times the same bytes, plus EPSILON, in that order,
        each an IEEE double operation whether Python or numpy does it (numpy's element-wise `+` and `*` round each
        result as Python's floats do; the bytes, below 2^53, are floats exactly), so a pass works its weights out
        as arrays: ~200 passes a search over 10^4 e-nodes. `costs` must be the costs `of` read."""
        import numpy as np

        memory = [0 if cost is None else cost.memory_bytes for cost in map(costs.get, self.walk.numbers.nids)]
        return replace(self, priced=(np.array(self.time, dtype=np.float64), np.array(memory, dtype=np.float64)))


TIMES_KEPT = 8   # the last cost tables whose e-node times `node_times` keeps per snapshot


def node_times(snapshot: Snapshot, costs: Mapping[NodeId, NodeCost]) -> Sequence[float]:
    """E-node number (`numbering`) -> its time in `costs` (`NodeCost.time_s`; 0.0 where it has none), kept for the
    last TIMES_KEPT tables (held, and checked by identity: a table is never changed once priced, and the times
    read nothing else of it). An extraction's passes, the extraction of a grid point again on a roomy machine
    and its lean passes read the times of one table: llama-70b:64's 116 extractions made 117 such lists of
    10^4 e-nodes from 51 tables, each a look-up and a `time_s` sum per e-node. Shared: read it, never change it."""
    kept = snapshot.derive("extract.node_times", functools.partial(Kept, TIMES_KEPT))
    owners = (costs,)
    found = kept.get(id(costs), owners)
    if found is None:
        found = [0.0 if cost is None else cost.time_s for cost in map(costs.get, numbering(snapshot).nids)]
        kept.put(id(costs), owners, found)
    return found


def bottom_up(snapshot: Snapshot, costs: Mapping[NodeId, NodeCost], usable: Callable[[NodeId], bool],
              prefer: Mapping[int, int] | None = None, memory_price: float = 0.0,
              choosable: Choosable | None = None, ranked: bool = True) -> tuple[dict[int, int], dict[int, int] | None]:
    """Tree-optimal choice; classes are final before any parent uses them (never a cycle).

    Also returns each class's finalisation rank: keeping only the e-nodes whose
    children rank below their class gives an acyclic sub-e-graph that still
    contains this choice (the ILP works on it). With `prefer` (a choice),
    those e-nodes cost nothing, so the order also contains that choice.
    `memory_price` (seconds per byte) adds each e-node's memory to its time:
    the Lagrangian weight `lean_choices` trades time for memory with.
    `choosable`: `Choosable.of(snapshot, costs, usable)`, when the caller has it. Without `ranked` the rank is
    None: only the ILP reads it, and the other passes (~280 a search) built it for nothing.
    """
    choosable = choosable or Choosable.of(snapshot, costs, usable)
    choice = dict(map(choosable.walk.numbers.nids.__getitem__, finalised(choosable, costs, prefer, memory_price)))
    return choice, {cid: position for position, cid in enumerate(choice)} if ranked else None


def finalised(choosable: Choosable, costs: Mapping[NodeId, NodeCost], prefer: Mapping[int, int] | None = None,
              memory_price: float = 0.0) -> list[int]:
    """`bottom_up`'s pass over `choosable` (`costs`: the costs it was made of): the e-nodes (by number) that make
    their classes final, in the order they do (a class's rank is its place here). The ILP reads this order by
    number (`ilp`) rather than a dict by class id."""
    walk = choosable.walk
    numbers = walk.numbers
    if memory_price:
        times, memory = (choosable.priced or choosable.with_memory(costs).priced)
        weight = (times + memory_price * memory + EPSILON).tolist()   # as `t + memory_price * m + EPSILON` does
    else:   # time + 0.0 x memory + EPSILON is time + EPSILON, float for float
        weight = choosable.weight
    if prefer:
        weight = list(weight)
        for nid in prefer.items():
            n = numbers.number.get(nid)
            if n is not None:
                weight[n] = 0.0

    # the same pass as written plainly (tests/test_extraction_passes.py), over lists indexed by e-node and class
    # numbers (`_Numbering`): extraction runs it ~400 times a search on 10^4 e-nodes, so its per-e-node overhead is
    # most of its cost. The heap's entries are distinct, (weight, e-node number) ordered as (weight, class, index),
    # so they leave it in one order whatever order they entered in; a class's rank is its place in `order`
    cls, kids, readers, single = numbers.cls, numbers.kids, walk.readers, walk.single
    push, pop = heapq.heappush, heapq.heappop
    pending = list(numbers.waiting)                  # choosable e-node -> its children not yet final
    best: list[float | None] = [None] * numbers.classes   # class -> its final value (None: not final)
    final = best.__getitem__
    heap = _least_per_class([(weight[n], n) for n in walk.ready], cls, numbers.classes)
    least = _least_entries(heap, cls, numbers.classes)
    order: list[int] = []
    while heap:
        value, n = pop(heap)
        cid = cls[n]
        if best[cid] is not None:
            continue
        best[cid] = value
        order.append(n)
        for reader in single[cid]:   # its sum over its one child is `value`: `sum` adds it to 0, which gives it
            own = cls[reader]
            if best[own] is None:
                entry = (weight[reader] + value, reader)
                known = least[own]
                if known is None or entry < known:   # else `known` leaves the heap first and makes `own` final
                    least[own] = entry
                    push(heap, entry)
        for reader in readers[cid]:
            left = pending[reader] - 1
            pending[reader] = left
            if not left:
                own = cls[reader]
                if best[own] is None:
                    entry = (weight[reader] + sum(map(final, kids[reader])), reader)
                    known = least[own]
                    if known is None or entry < known:
                        least[own] = entry
                        push(heap, entry)
    return order


def _least_per_class(entries: list[tuple[float, int]], cls: Sequence[int], classes: int) -> list[tuple[float, int]]:
    """A pass's first heap (`bottom_up`, `greedy_dag`): of `entries`, (key, e-node number), the least of each class,
    heapified. The others would leave the heap after it, once its class is final, and be passed over: the heap
    gives the same classes their values in the same order without them."""
    least = _least_entries(entries, cls, classes)
    heap = [entry for entry in least if entry is not None]
    heapq.heapify(heap)
    return heap


def _least_entries(entries: Iterable[tuple[float, int]], cls: Sequence[int],
                   classes: int) -> list[tuple[float, int] | None]:
    """Class number -> the least of `entries` (key, e-node number) of its e-nodes, or None. A pass keeps this for
    the entries it pushed: an entry of a class after that class's least one in the heap is never the one that makes
    it final, so it need not be pushed."""
    least: list[tuple[float, int] | None] = [None] * classes
    for entry in entries:
        cid = cls[entry[1]]
        known = least[cid]
        if known is None or entry < known:
            least[cid] = entry
    return least


def greedy_dag(snapshot: Snapshot, costs: Mapping[NodeId, NodeCost], usable: Callable[[NodeId], bool],
               deadline: float = math.inf, choosable: Choosable | None = None) -> dict[int, int] | None:
    """Faster-greedy-DAG: a class's cost is the summed cost of the set of e-nodes below its choice.

    Classes are final in the order they are popped, and each holds exactly
    one chosen e-node, so the set below a choice is a set of earlier
    classes: a bitset (a Python int, bit = finalisation rank). The cost of a
    candidate is that of its dearest child's set plus the nodes of the other
    children's sets that set lacks (usually few: the children of a residual
    add share their prefix), so a pass is near linear where summing whole
    sets was quadratic in the depth of the graph (10 s on a 24-block stack).
    `choosable`: `Choosable.of(snapshot, costs, usable)`, when the caller has it. Walks lists by `_Numbering`'s
    numbers, as `bottom_up` does, and pushes only an entry that may make its class final (`_least_entries`).
    """
    choosable = choosable or Choosable.of(snapshot, costs, usable)
    walk = choosable.walk
    numbers = walk.numbers
    time_of, weight, kids_of, cls = choosable.time, choosable.weight, numbers.kids, numbers.cls
    readers, single = walk.readers, walk.single
    pending = list(numbers.waiting)        # choosable e-node -> its children not yet final
    below: list[int] = [0] * numbers.classes           # class -> bitset of the classes its choice needs (itself too)
    value_of: list[float | None] = [None] * numbers.classes   # class -> summed cost of that set (None: not final)
    own: list[float] = []               # finalisation rank -> cost of the class's chosen e-node
    order: list[int] = []

    def union(children: Sequence[int]) -> tuple[int, float]:
        if len(children) == 1:   # what the general case gives for one child, without the sort
            return below[children[0]], value_of[children[0]]
        kids = sorted(children, key=value_of.__getitem__, reverse=True)
        if not kids:
            return 0, 0.0
        mask, total = below[kids[0]], value_of[kids[0]]
        for child in kids[1:]:
            extra = below[child] & ~mask
            mask |= extra
            while extra:
                low = extra & -extra
                total += own[low.bit_length() - 1]
                extra ^= low
        return mask, total

    ready = _least_per_class([(weight[n], n) for n in walk.ready], cls, numbers.classes)
    least = _least_entries(ready, cls, numbers.classes)
    timed, push, pop = math.isfinite(deadline), heapq.heappush, heapq.heappop
    while ready:
        if timed and time.perf_counter() > deadline:
            return None
        value, n = pop(ready)
        cid = cls[n]
        if value_of[cid] is not None:
            continue
        mask, _total = union(kids_of[n])
        own.append(weight[n])
        below[cid], value_of[cid] = mask | (1 << (len(own) - 1)), value
        order.append(n)
        for reader in single[cid]:   # `union` of its one child: this class's set and `value`
            mine = cls[reader]
            if value_of[mine] is None:
                entry = (value + time_of[reader] + EPSILON, reader)
                known = least[mine]
                if known is None or entry < known:
                    least[mine] = entry
                    push(ready, entry)
        for reader in readers[cid]:
            left = pending[reader] - 1
            pending[reader] = left
            if not left:
                mine = cls[reader]
                if value_of[mine] is None:
                    _mask, total = union(kids_of[reader])
                    entry = (total + time_of[reader] + EPSILON, reader)
                    known = least[mine]
                    if known is None or entry < known:
                        least[mine] = entry
                        push(ready, entry)
    return dict(map(numbers.nids.__getitem__, order))


@contextlib.contextmanager
def _quiet_stdout():
    """File descriptor 1 goes to /dev/null inside the block.

    HiGHS prints its banner from the C++ constructor, before any option
    (`output_flag`) can be set, straight to the process's stdout: it would
    end up in `parsat optimize -q` and in the JSON a caller reads.
    """
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:           # no stdout at all: nothing to protect
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).fflush(None)   # C stdio's buffer goes to /dev/null, not to the restored fd
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def ilp(snapshot: Snapshot, costs: Mapping[NodeId, NodeCost], roots: Sequence[int], walk: "_Walk", capacity: float,
        warm: Mapping[int, int] | None, nodes: int, rank: Sequence[int],
        seconds: float = math.inf, obliged: Obliged | None = None) -> tuple[dict[int, int] | None, str]:
    """Exact DAG extraction with a memory constraint, by HiGHS, within `nodes` branch-and-bound nodes.

    The budget is work, not time: HiGHS runs on one thread with its fixed
    seed, so the same model gives the same choice on any machine and under
    any load (`seconds`, a safety valve, is infinite unless the caller's
    `--limit ilp_seconds` or `seconds` says otherwise).

    Acyclicity: the ILP only sees e-nodes whose children were finalised
    before their own class by the bottom-up pass (`rank`: its e-nodes by
    number in the order they made their classes final, `finalised`), an acyclic
    sub-e-graph that contains the greedy plans. (Cycle constraints on the
    full e-graph, big-M orderings or lazy cycle cuts, were tried: the
    combine/partition round trips make their relaxation so weak that HiGHS
    did not close the gap on a single transformer block in 20 s.)

    `walk`: the extraction's `_Walk` (`Choosable.walk`), whose choosable e-nodes are the usable ones the ILP may
    choose (an e-node reading its own class, which the walk leaves out, is never one: its class does not rank
    below itself). The model is set up over the walk's e-node numbers (`_Numbering`), columns in number order,
    which is the (class, index) order it was set up in before.
    `obliged`: an e-node chosen holds a class of each of its groups (a row each), as `dag_cost` counts them.
    For a repeated model (`obliged`), a second ILP, started from the first's plan, may also re-make a class of
    the warm plan by value order (`_ilp_columns`); its plan is taken only where it is cheaper by more than the
    ILP's gap, so that ties the first breaks stay broken as they were (a tie re-broken reordered gpt-6.7b:64's
    last block at an equal cost; benchmarks/search_results.md, 2026-12-04 helper M2).
    """
    cols, more = _ilp_columns(snapshot, roots, walk, rank, obliged, warm if obliged else None)
    choice, status, objective = _solve_ilp(snapshot, costs, cols, _ilp_rows(snapshot, costs, roots, cols, capacity,
                                                                            obliged), warm, nodes, seconds)
    if more is None:
        return choice, status
    better, better_status, lower = _solve_ilp(snapshot, costs, more,
                                              _ilp_rows(snapshot, costs, roots, more, capacity, obliged),
                                              choice or warm, nodes, seconds)
    if better is not None and lower < objective - ILP_GAP * abs(objective):
        return better, better_status
    return choice, status


ILP_GAP = 1e-6   # HiGHS's relative gap: a plan within it of another is a tie


def _solve_ilp(snapshot: Snapshot, costs: Mapping[NodeId, NodeCost], cols: Sequence[int], rows: _IlpRows | None,
               warm: Mapping[int, int] | None, nodes: int,
               seconds: float) -> tuple[dict[int, int] | None, str, float]:
    """HiGHS on one ILP (`ilp`; `cols`: e-node numbers): the choice (None where it found none), its status and its
    time (the objective, in seconds: `_highs_lp` scales it by its columns' dearest)."""
    import highspy
    import numpy as np

    if rows is None:
        return None, "infeasible (a root has no usable e-node)", math.inf
    times = node_times(snapshot, costs)
    lp = _highs_lp(times, cols, rows)
    with _quiet_stdout():
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", ILP_GAP)
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_max_nodes", int(nodes))
    if math.isfinite(seconds):
        h.setOptionValue("time_limit", float(max(seconds, 0.05)))
    h.passModel(lp)
    if warm:
        h.setSolution(_warm_solution(snapshot, warm, cols))
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    if h.getInfo().primal_solution_status != 2:  # no feasible solution
        return None, status, math.inf
    chosen = [cols[c] for c in np.flatnonzero(np.asarray(h.getSolution().col_value) > 0.5).tolist()]
    nids = numbering(snapshot).nids
    # the objective summed over the chosen columns in column order, as `costs[nid].time_s` one after another
    return dict(map(nids.__getitem__, chosen)), status, sum(map(times.__getitem__, chosen))


# how many columns the value order may add to those `rank` admits, as a share of them: past it the ILP keeps the
# rank's alone. HiGHS's presolve grows faster than the model: bert-large:8's three ILPs whose columns the value order
# tripled (340 -> 981) took 0.9-2.0 CPU s each against 0.005, +5 CPU s a search; llama-70b's pinned plan needs +33%
# (290 -> 386; benchmarks/search_results.md, 2026-12-04 helper M2)
VALUE_ORDER_GROWTH = 0.5


def _ilp_columns(snapshot: Snapshot, roots: Sequence[int], walk: "_Walk", rank: Sequence[int],
                 obliged: Obliged | None = None,
                 warm: Mapping[int, int] | None = None) -> tuple[list[int], list[int] | None]:
    """The ILP's 0/1 variables, one per e-node it may choose (a column each, by `_Numbering`'s number), in the
    classes the roots reach through them and what they oblige (`obliged`): the choosable e-nodes of `walk` whose
    children `rank` finalised before their own class; and, given a `warm` plan, those columns with the e-nodes of
    the warm plan's classes whose children come before it in the order of values, then of `rank` (`value_order`),
    or None. Both are read in that one order (a child before its class in `rank` is before it there too), so
    either sub-e-graph is acyclic (see `ilp`); the second lets the ILP re-choose how a class of the warm plan is
    made from the values before it, which `rank` alone forbade for a class the warm plan finalised early. It is a
    bounded amount of work: None where it adds nothing or more than `VALUE_ORDER_GROWTH` of the first's columns.
    An e-node's children are its distinct children (`_Numbering.kids`): `all` over them asks what it asked over
    its children as written."""
    numbers = walk.numbers
    cls, kids, ok, number = numbers.cls, numbers.kids, walk.ok, numbers.class_number
    position = [math.inf] * numbers.classes   # class number -> its rank (inf: never finalised)
    for place, n in enumerate(rank):
        position[cls[n]] = place
    known: dict[int, bool] = {}   # e-node number -> `ranked`'s answer: the second walk asks most of them again
    at = position.__getitem__

    def ranked(n: int) -> bool:
        own = position[cls[n]]   # above every child's rank (the max of none: -1, a leaf)
        found = known[n] = own != math.inf and ok[n] and max(map(at, kids[n]), default=-1) < own
        return found

    cols = _columns(numbers, roots, ranked, obliged)
    if not warm:
        return cols, None
    values, cids = value_order(snapshot), numbers.cids
    held = {number[cid] for cid in warm if cid in number}

    def ordered(n: int) -> bool:
        own = cls[n]
        if known[n] if n in known else ranked(n):
            return True
        if own not in held or not ok[n] or position[own] == math.inf:
            return False
        key = (values[cids[own]], position[own])
        return all(position[k] != math.inf and (values[cids[k]], position[k]) < key for k in kids[n])

    more = _columns(numbers, roots, ordered, obliged)
    return cols, (more if len(cols) < len(more) <= len(cols) * (1 + VALUE_ORDER_GROWTH) else None)


def _columns(numbers: "_Numbering", roots: Sequence[int], allowed: Callable[[int], bool],
             obliged: Obliged | None) -> list[int]:
    """The `allowed` e-nodes (by number) of the classes the roots reach through them and what they oblige, in
    number order: (class, index) order, the order the columns were listed in by class id, then index. One walk
    asks each e-node of a reached class once; a class outside the numbering holds no e-node, so it adds none."""
    number, first, kids, nids = numbers.class_number, numbers.first, numbers.kids, numbers.nids
    obliged_by = obliged.get if obliged else None
    seen = [False] * numbers.classes
    stack: list[int] = []
    for root in roots:
        c = number.get(root)
        if c is not None and not seen[c]:
            seen[c] = True
            stack.append(c)
    found: list[int] = []
    while stack:
        c = stack.pop()
        for n in range(first[c], first[c + 1]):
            if not allowed(n):
                continue
            found.append(n)
            for k in kids[n]:
                if not seen[k]:
                    seen[k] = True
                    stack.append(k)
            if obliged_by is not None:
                for group in obliged_by(nids[n], ()):
                    for cid in group:
                        k = number.get(cid)
                        if k is not None and not seen[k]:
                            seen[k] = True
                            stack.append(k)
    found.sort()
    return found


@dataclass(frozen=True)
class _IlpRows:
    """The ILP's constraints, row-wise (`HighsLp`'s compressed sparse rows): `lower[r] <= sum of value * column
    over start[r]:start[r + 1] of index/value <= upper[r]`."""

    start: list[int]
    index: list[int]
    value: list[float]
    lower: list[float]
    upper: list[float]


def _ilp_rows(snapshot: Snapshot, costs: Mapping[NodeId, NodeCost], roots: Sequence[int], cols: Sequence[int],
              capacity: float, obliged: Obliged | None = None) -> _IlpRows | None:
    """What makes a choice of columns (e-node numbers, in number order) a plan that fits: one e-node per root, at
    most one per other class, an e-node's children chosen with it (a row per child, in the order
    `set(node.children)` gives them: HiGHS's model follows the rows' order), and a class of each group it obliges
    (`obliged`), the memory of what is chosen within `capacity` (None: a root has no column). A class's columns
    are consecutive (numbers follow (class, index)), so each is a range of column positions.
    """
    nids, classes = numbering(snapshot).nids, snapshot.classes
    span: dict[int, tuple[int, int]] = {}   # class id -> (its first column, one past its last), in column order
    for col, n in enumerate(cols):
        cid = nids[n][0]
        lo, _hi = span.get(cid, (col, col))
        span[cid] = (lo, col + 1)
    rows_start, rows_index, rows_value, lower, upper = [0], [], [], [], []
    index, value, start = rows_index.extend, rows_value.extend, rows_start.append
    none = (0, 0)
    if any(root not in span for root in roots):
        return None
    # one e-node per root (a row each, in `roots`' order), then at most one per other class of several
    whole = [span[root] for root in roots] + \
        [(lo, hi) for cid, (lo, hi) in span.items() if cid not in roots and hi - lo > 1]
    for lo, hi in whole:
        index(range(lo, hi))
        value([1.0] * (hi - lo))
        start(len(rows_index))
    lower += [1.0] * len(roots) + [0.0] * (len(whole) - len(roots))
    upper += [1.0] * len(whole)
    obliged_by = obliged.get if obliged else None
    rows = len(rows_start)
    for col, n in enumerate(cols):
        nid = nids[n]
        # a row per child (a group of one class), then per group it obliges: a class of it chosen with the e-node
        groups = [(child,) for child in set(classes[nid[0]][nid[1]].children)]
        if obliged_by is not None:
            groups += obliged_by(nid, ())
        for group in groups:
            for held in group:
                lo, hi = span.get(held, none)
                index(range(lo, hi))
                value([1.0] * (hi - lo))
            index((col,))
            value((-1.0,))
            start(len(rows_index))
    lower += [0.0] * (len(rows_start) - rows)
    upper += [math.inf] * (len(rows_start) - rows)
    if capacity and math.isfinite(capacity):
        index(range(len(cols)))
        value([costs[nids[n]].memory_bytes / capacity for n in cols])
        start(len(rows_index))
        lower.append(0.0)
        upper.append(1.0)
    return _IlpRows(rows_start, rows_index, rows_value, lower, upper)


def _highs_lp(times: Sequence[float], cols: Sequence[int], rows: _IlpRows):
    """The model HiGHS solves: 0/1 integer columns, `rows`, and the chosen e-nodes' time (`times`, by e-node number)
    to minimise, divided by the largest e-node's time so the objective's coefficients are at most 1."""
    import highspy
    import numpy as np

    ncols = len(cols)
    cost = np.array([times[n] for n in cols], dtype=np.float64)
    scale = (float(cost.max()) if ncols else 1.0) or 1.0
    lp = highspy.HighsLp()
    lp.num_col_ = ncols
    lp.num_row_ = len(rows.lower)
    lp.col_cost_ = cost / scale   # element-wise, each the IEEE quotient `time / scale` was
    lp.col_lower_ = np.zeros(ncols)
    lp.col_upper_ = np.ones(ncols)
    lp.row_lower_ = np.array(rows.lower)
    lp.row_upper_ = np.array(rows.upper)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.array(rows.start, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(rows.index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(rows.value)
    lp.a_matrix_.num_col_ = ncols
    lp.a_matrix_.num_row_ = len(rows.lower)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * ncols
    return lp


def _warm_solution(snapshot: Snapshot, warm: Mapping[int, int], cols: Sequence[int]):
    """The best plan the earlier passes found as a HiGHS starting solution (its e-nodes outside the ILP's
    columns, e-node numbers, left out), so the ILP starts from a known plan and only has to improve on it."""
    import highspy

    col_of = {n: c for c, n in enumerate(cols)}
    number = numbering(snapshot).number
    values = [0.0] * len(cols)
    for nid in warm.items():
        col = col_of.get(number.get(nid))
        if col is not None:
            values[col] = 1.0
    solution = highspy.HighsSolution()
    solution.col_value = values
    solution.value_valid = True
    return solution


LEAN = "lean"            # a plan of `lean_choices`: found only because none of the passes ranked by time fits
LEAN_ILP = "ilp_lean"    # the ILP started from the fastest such plan
LEAN_PRICES = 12         # memory prices tried (each doubling the last), then halved towards the fastest that fits
LEAN_BISECTIONS = 4


def lean_choices(snapshot: Snapshot, costs: Mapping[NodeId, NodeCost], roots: Sequence[int], usable,
                 capacity: float, time_s: float, memory_bytes: float,
                 obliged: Obliged | None = None,
                 like: Choosable | None = None,
                 known: dict[float, tuple] | None = None) -> list[tuple[dict[int, int] | None, tuple | None]]:
    """Plans that trade time for memory, for an extraction whose passes ranked by time found none that fits:
    bottom-up choices at a price per byte of memory (a Lagrangian weight, time + price x bytes), the price
    doubled from the fastest plan's own exchange rate (`time_s` / `memory_bytes`) until a choice fits, then
    bisected between the last that did not and the first that did, towards the fastest that fits. The prices are
    fixed by the costs alone (no clock), so the same e-graph gives the same plans. Every choice is judged by
    `dag_cost` as the other passes' are (each comes back cut to the classes it counts, with it, `_judged`: `extract`
    takes it rather than working it out again); none is guaranteed to fit (the weight counts a shared child's memory once per reader, the DAG once).
    `like`: the extraction's own `Choosable` (the same e-nodes and `usable`), whose e-nodes and readers are
    taken rather than worked out again. `known`: price -> (choice, its `dag_cost`) of passes made before from
    these very `costs`, `usable`, `roots` and `obliged` (`_TimeRanked.lean`), taken, and the passes made here added:
    a stage plan extracted again within less memory (`mesh._leaner_as_run`) starts from the same fastest plan, so
    from the same prices, and only the capacity, which judges each choice, differs."""
    chosen: list[tuple[dict[int, int] | None, tuple | None]] = []
    known = {} if known is None else known
    choosable: list[Choosable] = []   # made when a pass first needs it

    def fits_at(price: float) -> bool:
        found = known.get(price)
        if found is None:
            if not choosable:
                choosable.append(Choosable.of(snapshot, costs, usable, like).with_memory(costs))
            choice, _rank = bottom_up(snapshot, costs, usable, memory_price=price, choosable=choosable[0],
                                      ranked=False)
            found = known[price] = _judged(snapshot, costs, choice, roots, obliged)
        chosen.append(found)
        return found[1] is not None and found[1][1] <= capacity

    low, high = 0.0, time_s / max(memory_bytes, 1.0)
    for _ in range(LEAN_PRICES):
        if fits_at(high):
            break
        low, high = high, 2 * high
    else:
        return chosen
    for _ in range(LEAN_BISECTIONS):
        price = (low + high) / 2
        if fits_at(price):
            high = price
        else:
            low = price
    return chosen


def _guided(snapshot: Snapshot, costs: Mapping[NodeId, NodeCost], usable,
            obliged: Obliged | None) -> tuple[Mapping[NodeId, NodeCost], dict[NodeId, NodeCost]]:
    """`costs` as the greedy passes rank by, and the e-nodes it costs more, with their costs (`raised`: what a
    `Choosable` of it reads beside `costs`' own times): an e-node that obliges a plan to hold more (`obliged`) costs,
    beside its own time, the cheapest parallel e-node of each class it obliges (a conversion into that placement;
    nothing where the class has none: only computing makes it). The passes choose class by class and cannot hold an
    obligation (the class obliged is often made from the e-node's own output: a repeated block reading a value of the
    one before obliges the same value of its own), so this is only their guide; every plan is judged with its
    obligations (`dag_cost`), and the ILP holds them. The ILP's warm start and the order of its columns come from
    these passes: llama-70b's pinned dp 16 x tp 4 plan came out at a node sum of 20.344 s without the guide, 19.678 s
    with it (benchmarks/search_results.md, 2026-12-04 helper M)."""
    if not obliged:
        return costs, {}

    def conversion(cid: int) -> float:
        return min((costs[(cid, i)].time_s for i, node in enumerate(snapshot.classes.get(cid, ()))
                    if node.op in PARALLEL_OPS and usable((cid, i))), default=0.0)

    raised: dict[NodeId, NodeCost] = {}
    for nid, groups in obliged.items():
        if nid in costs and all(groups):
            extra = sum(min(conversion(c) for c in group) for group in groups)
            if extra > 0:
                raised[nid] = replace(costs[nid], comm_s=costs[nid].comm_s + extra)
    return {**costs, **raised}, raised


PASSES_KEPT = 8   # the last time-ranked passes `_time_ranked` keeps per e-graph (a grid's points, then again roomy)


@dataclass(frozen=True)
class _TimeRanked:
    """An extraction's passes ranked by time, which read neither its memory capacity nor its ILP limits: whether the
    bottom-up pass reaches every root (`reaches`), its choice and the greedy DAG pass's, each as `dag_cost` judged it
    (`judged`: None where it judged none) and cut to the classes it counted (`plans`: what `extract` reads of them;
    None where judged none), the seconds each took, and the lean passes made from the same costs (`lean`,
    `lean_choices`' `known`). Kept choices are cut so that the e-graph's kept passes hold plans, not choices of
    every class (an uncut copy per policy and grid point held ~150 MiB more on llama-70b:64)."""

    reaches: bool
    plans: tuple[dict[int, int] | None, dict[int, int] | None]
    judged: tuple[tuple | None, tuple | None]
    seconds: Mapping[str, float]
    lean: dict[float, tuple] = field(default_factory=dict)   # `lean_choices`' passes from these costs, by price


def _judged(snapshot: Snapshot, costs: Mapping[NodeId, NodeCost], choice: Mapping[int, int] | None,
            roots: Sequence[int], obliged: Obliged | None) -> tuple[dict[int, int] | None, tuple | None]:
    """`choice` cut to the classes `dag_cost` counts, and its `dag_cost` (None, None where it counts none): what
    `extract` reads of a pass's choice (`consider`)."""
    result = dag_cost(snapshot, costs, choice, roots, obliged) if choice is not None else None
    return (None, None) if result is None else ({c: choice[c] for c in result[2]}, result)


def _time_ranked(snapshot: Snapshot, costs: Mapping[NodeId, NodeCost], roots: Sequence[int], usable,
                 exclude: Callable[[NodeId], bool] | None, obliged: Obliged | None,
                 seconds: float) -> tuple[_TimeRanked, tuple | None]:
    """The passes ranked by time (`_TimeRanked`) of an extraction from `costs` less `exclude` with `obliged`
    (`usable` is theirs, `_usable`), with what they ranked by and walked ((`_guided`, `Choosable`), None where
    they were taken), or those of an extraction before from these very objects: the last PASSES_KEPT are kept with
    the snapshot, held by the objects themselves (a key of identities, checked), as they read nothing else but
    `roots`. Where they repeat: a grid point found too large is extracted again on a roomy machine
    (`baselines.best_grid`: 26 of llama-70b:64's 116 extractions), a stage plan again within less memory
    (`mesh._leaner_as_run`). `seconds`: the greedy DAG pass's safety valve (`extract`); a pass it cut is not
    kept."""
    kept = snapshot.derive(("extract._time_ranked", tuple(roots)), functools.partial(Kept, PASSES_KEPT))
    owners = (costs, exclude, obliged)
    key = tuple(map(id, owners))
    found = kept.get(key, owners)
    if found is not None:
        return replace(found, seconds={name: 0.0 for name in found.seconds}), None   # this one's: none
    t = time.perf_counter()
    guide, raised = _guided(snapshot, costs, usable, obliged)
    choosable = _choosable(snapshot, costs, raised, usable, exclude, obliged)
    tree, _rank = bottom_up(snapshot, guide, usable, choosable=choosable, ranked=False)
    took = {"bottom_up": time.perf_counter() - t}
    t = time.perf_counter()
    greedy = greedy_dag(snapshot, guide, usable, t + seconds, choosable)
    took["greedy_dag"] = time.perf_counter() - t
    (tree_plan, tree_judged), (greedy_plan, greedy_judged) = (_judged(snapshot, costs, c, roots, obliged)
                                                              for c in (tree, greedy))
    passes = _TimeRanked(all(r in tree for r in roots), (tree_plan, greedy_plan), (tree_judged, greedy_judged), took)
    if greedy is not None:
        kept.put(key, owners, passes)
    return passes, (guide, choosable)


def _choosable(snapshot: Snapshot, costs: Mapping[NodeId, NodeCost], raised: Mapping[NodeId, NodeCost], usable,
               exclude: Callable[[NodeId], bool] | None, obliged: Obliged | None) -> Choosable:
    """`Choosable.of(snapshot, guide, usable)` of the guide `_guided` makes of `costs` (`raised`: the e-nodes it
    costs more), its e-nodes and readers taken from the last one made with the same
    `exclude` and `obliged` objects over costs of the same e-nodes: `usable` reads nothing else of them
    (`_usable`), so the e-nodes a pass may choose are the same. The policies of one mesh (ZeRO stages, keeping
    or recomputing, `mesh._extract_joint`) price the same e-nodes differently, one after another, and each
    scanned every e-node again; a set of e-nodes is compared (a dict's keys) rather than worked out. One is kept
    per snapshot (its e-nodes and readers, and the costs whose keys they follow)."""
    kept = snapshot.derive("extract._choosable", dict)
    found = kept.get("last")
    like = found[3] if found is not None and found[0] is exclude and found[1] is obliged and \
        found[2].keys() == costs.keys() else None
    choosable = Choosable.of(snapshot, costs, usable, like, raised=raised)
    if like is None:
        kept["last"] = (exclude, obliged, costs, replace(choosable, time=()))
    return choosable


def extract(snapshot: Snapshot, costs: Mapping[NodeId, NodeCost], roots: Sequence[int], capacity: float,
            limits: Limits = Limits(), exclude: Callable[[NodeId], bool] | None = None,
            lean: bool = False, obliged: Obliged | None = None) -> Extraction:
    """The cheapest plan the three passes find; the memory limit is hard. The passes run to their end, the ILP
    within `limits.ilp_nodes`; `limits.seconds` (a safety valve, off by default) also bounds the greedy DAG
    pass and the ILP, and `ilp_seconds` 0 skips the ILP. With `lean`, where none of them fits, plans trading
    time for memory are asked for (`lean_choices`) and the ILP started from the fastest of them (the joint
    extraction's: a baseline's restriction is a layout a grid point fixes, its misses the grid's own).
    `obliged` (a repeated model's, `repeat.copy_obligations`): what an e-node obliges a plan to hold beside its
    children; every pass's plan is judged with it (`dag_cost`), the ILP holds it as constraints."""
    usable = _usable(costs, exclude, obliged)
    seconds: dict[str, float] = {}
    candidates: dict[str, float] = {}
    found: list[tuple[float, int, str, dict[int, int]]] = []

    def consider(method: str, choice: Mapping[int, int] | None, judged: tuple | None = None) -> None:
        """`judged`: `dag_cost` of `choice` (with `costs`, `roots`, `obliged`), where the caller has it."""
        result = judged if judged is not None else \
            dag_cost(snapshot, costs, choice, roots, obliged) if choice is not None else None
        if result is None:
            candidates.setdefault(method, math.inf)
            return
        time_s, memory, order = result
        candidates[method] = min(time_s, candidates.get(method, math.inf))   # a method may try several
        found.append((time_s, memory, method, {c: choice[c] for c in order}))

    passes, walked = _time_ranked(snapshot, costs, roots, usable, exclude, obliged, limits.seconds)
    seconds.update(passes.seconds)
    if not passes.reaches:
        raise ExtractionError("no plan reaches the graph's outputs with the e-nodes the cost model accepts")
    consider("bottom_up", passes.plans[0], passes.judged[0])
    consider("greedy_dag", passes.plans[1], passes.judged[1])
    made = [] if walked is None else [walked]

    def walk() -> tuple:
        """What the greedy passes rank by (`_guided`) and the e-nodes they walk: made here where they were taken."""
        if not made:
            guide, raised = _guided(snapshot, costs, usable, obliged)
            made.append((guide, _choosable(snapshot, costs, raised, usable, exclude, obliged)))
        return made[0]

    def fitting() -> list:
        return [f for f in found if f[1] <= capacity]

    def run_ilp(method: str) -> str:
        """The ILP, warm-started from the fastest plan found that fits (else the fastest), in an order that
        admits it; its status."""
        warm = min(found, key=lambda f: (f[1] > capacity, f[0]))[3]
        t = time.perf_counter()
        guide, choosable = walk()
        rank = finalised(choosable, guide, prefer=warm)  # an order that admits the warm start
        choice, status = ilp(snapshot, costs, roots, choosable.walk, capacity, warm, limits.ilp_nodes, rank,
                             min(limits.ilp_seconds, limits.seconds), obliged)
        seconds[method] = time.perf_counter() - t
        consider(method, choice)
        return status

    status = run_ilp("ilp") if limits.ilp_seconds > 0 else "skipped"
    if lean and not fitting() and 0 < capacity < math.inf:
        # every pass ranked by time alone, and the ILP sees only the e-nodes their order admits: a plan that fits
        # by sharding more (weights stored split, ZeRO-3 style) can lie outside it. Ask again, memory priced
        fastest = min(found, key=lambda f: f[0])
        # `guide` holds the e-nodes `costs` holds (`_guided`), so its passes' e-nodes are this pass's too
        for choice, judged in lean_choices(snapshot, costs, roots, usable, capacity, fastest[0], fastest[1], obliged,
                                           walk()[1], passes.lean):
            consider(LEAN, choice, judged)
        if fitting() and limits.ilp_seconds > 0:
            status = run_ilp(LEAN_ILP)
    if not fitting():
        least = min(found, key=lambda f: f[1])
        needs, has = fmt_bytes_pair(least[1], capacity)   # never "needs 0.00 GiB, the device has 0.00 GiB"
        # raised as made, never held in a local: the error's traceback holds this frame (the snapshot, the costs), so
        # a local holding the error made a reference cycle that only the cyclic collector freed
        # extraction's own figure (the per-node bound): no plan came within it, so none reached the step simulator
        raise ExtractionError(f"no plan fits in memory: the smallest plan found needs {needs} per device by the "
                              f"per-node bound, the device has {has} (use more devices or a smaller model)",
                              int(least[1]))
    best = min(fitting(), key=lambda f: (f[0], f[2] != "ilp"))
    return Extraction(best[3], best[0], best[1], best[2], seconds, candidates, status)
