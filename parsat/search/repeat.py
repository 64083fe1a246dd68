"""Repeated blocks: search three of a model's N identical blocks, then repeat the middle one's plan N - 2 times.

Language models are stacks of identical blocks (`ir.models`: every weight
and node of block i is named `b{i}_...`; the importer names an imported
stack so, found by structure). Saturating all N of them costs N times one
block's e-graph (a 32-block GPT on a two-axis mesh passes 200,000 e-nodes
before partitions reach the later blocks), yet the best plan for block 7 is
the best plan for block 8. So, where the names give N > 3 blocks that are
alike (`ir.block_layout.named_layout` checks operators, shapes and wiring),
the search saturates the model cut to three blocks (first, middle, last:
a middle block's inputs and outputs both meet blocks, as every block but
the ends does; `ir.block_layout.searched_blocks`, for a built-in example
the graph it builds with three blocks) and:

1. prices every e-node of the middle block `N - 2` times (`weigh`): time,
   communication and memory, so extraction ranks and fits plans as the
   whole model (a plan that fits three blocks but not 32 is not chosen),
   and obliges a plan whose block 1 reads a value of block 0 in a
   placement to make its own value in that placement too
   (`copy_obligations`): what every copy reads of the one before;
2. repeats the extracted plan's middle block for blocks 1 to N - 2
   (`stamp`), renaming `b1_` to `b{j}_`, and its last block as block N - 1.
   The PCG that comes back computes the whole model, every node is
   priced again on it and its step simulated, like any other plan.

Why the stamped plan is sound: each rule is proven for all tensors, so an
equality saturation derived for block 1 holds for block j, whose operators
are the same with other weights; a copy reads, in place of what block 1
read from block 0, the same value of block j - 1 in the same placement.
`stamp` checks that last part: the values block 1 reads from block 0 and
block 2 reads from block 1 must be the same graph tensors up to the block
prefix (`value_names`: the e-graph knows which tensor each class holds),
in the same placements. How block 0 computes its output does not matter
(it may differ from block 1's: it reads the embeddings). A plan whose
blocks are not laid out alike is refused (`RepeatError`): the caller then
has no stamped plan for that mesh, never a wrong one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Mapping

from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.ir.block_layout import named_layout, searched_blocks
from parsat.ir.blocks import OUTSIDE, block_of, in_block, node_blocks, past_block
from parsat.ir.costs import NodeCost
from parsat.ir.graph import Graph
from parsat.ir.pcg import PCG, Degrees, PNode
from parsat.ir.placement import Placement
from parsat.egraph.encoding import PIN_SUFFIX
from parsat.egraph.snapshot import ENode, Snapshot, parallel_attrs

SEARCHED_BLOCKS = 3            # first, middle (repeated), last
REPEATED = 1                   # the searched block whose plan repeats


class RepeatError(Exception):
    """The searched blocks' plan cannot be repeated (its blocks are not laid out alike)."""


@dataclass(frozen=True)
class Repetition:
    """A model of `blocks` identical blocks searched as `searched` (cut to `SEARCHED_BLOCKS`)."""

    whole: Graph
    searched: Graph
    blocks: int

    @property
    def copies(self) -> int:
        """How many blocks the middle block's plan stands for."""
        return self.blocks - SEARCHED_BLOCKS + 1

    def with_microbatches(self, count: int) -> "Repetition":
        return replace(self, whole=self.whole.with_microbatches(count),
                       searched=self.searched.with_microbatches(count))

    def to_dict(self) -> dict:
        return {"blocks": self.blocks, "searched_blocks": SEARCHED_BLOCKS, "repeated_block": REPEATED,
                "copies": self.copies}


def repetition_for(whole: Graph) -> Repetition | None:
    """How to search `whole`: as three of its blocks, when its names give more than three identical ones
    (`ir.block_layout.named_layout`: a built-in example's, or an imported module's stack, which the importer
    names so); None for any other graph (its blocks are not known to be alike)."""
    layout = named_layout(whole)
    if layout is None or layout.count <= SEARCHED_BLOCKS:
        return None
    return Repetition(whole, searched_blocks(whole, layout.count, SEARCHED_BLOCKS), layout.count)


# ------------------------------------------------------------------ weighing the e-graph


def class_blocks(snapshot: Snapshot) -> dict[int, int]:
    """E-class -> the latest block whose weights it depends on (OUTSIDE for none): a fixpoint from the leaves.

    A value of block 1 depends on block 1's weights (and earlier ones'); a conversion of block 1's output that
    block 2 reads depends on no later weight, so it counts with block 1, as every block but the last has one.
    """
    blocks = {cid: OUTSIDE for cid in snapshot.classes}
    for cid, nodes in snapshot.classes.items():
        for node in nodes:
            if node.op == "leaf":
                blocks[cid] = max(blocks[cid], block_of(str(node.attrs[0]).removesuffix(PIN_SUFFIX)))
    # a worklist over the snapshot's readers, not sweeps over every class until none changes: a class is looked
    # at again only when a class it reads got a later block (the same fixpoint; sweeps cost 40 s on a 2-axis
    # mesh's e-graph)
    work = [cid for cid, block in blocks.items() if block != OUTSIDE]
    while work:
        child = work.pop()
        for cid, _index in snapshot.readers.get(child, ()):
            if blocks[child] > blocks[cid]:
                blocks[cid] = blocks[child]
                work.append(cid)
    return blocks


def snapshot_blocks(snapshot: Snapshot) -> Mapping[int, int]:
    """`class_blocks(snapshot)`, worked out once per snapshot (`Snapshot.derived`): every extraction policy
    weighs and recomputes the same e-graph's costs again. Shared: read it, never change it."""
    return snapshot.derive("class_blocks", lambda: class_blocks(snapshot))


def weigh(costs: Mapping[tuple[int, int], NodeCost], snapshot: Snapshot, repetition: Repetition) -> dict:
    """Every e-node's cost with the middle block's counted `copies` times: extraction then prices the whole model.

    An e-node of a block that reads a block other than its own or the one before (a residual sum reassociated
    across two blocks) is left out: the searched blocks' plan is copied as a chain (`stamp`), and extraction
    only chooses among the e-nodes that keep it one. Which e-nodes keep it is the snapshot's alone (its blocks and
    e-nodes' children, never `costs`), worked out once per snapshot (`chain_nodes`): every policy's and every
    grid point's pricing weighs the same e-graph again (gpt-6.7b:64: 20 weighings, 159,000 e-nodes looked at)."""
    blocks = snapshot_blocks(snapshot)
    chained = chain_nodes(snapshot)
    factor = repetition.copies
    # e-nodes alike share one cost object (`extract.node_costs`): each is counted `factor` times once, by its
    # identity, while `costs` holds it
    scaled: dict[int, NodeCost] = {}

    def counted(cost: NodeCost) -> NodeCost:
        found = scaled.get(id(cost))
        if found is None:
            found = scaled[id(cost)] = cost.times(factor)
        return found

    return {nid: counted(cost) if blocks.get(nid[0]) == REPEATED else cost for nid, cost in costs.items()
            if nid in chained}


def chain_nodes(snapshot: Snapshot) -> frozenset[tuple[int, int]]:
    """The snapshot's e-nodes that keep the blocks a chain (`_keeps_chain`), worked out once per snapshot
    (`Snapshot.derived`). Shared: read it, never change it."""
    def make() -> frozenset[tuple[int, int]]:
        blocks = snapshot_blocks(snapshot)
        return frozenset(nid for nid in snapshot.kids if _keeps_chain(snapshot, blocks, nid))
    return snapshot.derive("chain_nodes", make)


Obligations = Mapping[tuple[int, int], tuple[tuple[int, ...], ...]]


def copy_obligations(snapshot: Snapshot, classes: Mapping[str, int]) -> Obligations:
    """What a middle-block e-node obliges a plan to hold beside its children, for extraction to price the copies
    the way `stamp` chains them: e-node -> groups of classes, one of each group to be chosen (an empty group: the
    e-node cannot be chosen).

    Extraction weighs block 0 once and block 1 `copies` times (`weigh`), and each copy of block 1 reads from the
    copy before it what block 1 reads from block 0. So where block 1 reads a value of block 0 in a placement
    (`b0_res2` whole on the tensor axis), every copy of block 1 must make its own value in that placement
    (`b1_res2` whole), or `stamp` bridges it there between every two copies. Without this, the bridge was priced
    nowhere: block 0 (once) could hand block 1 a placement block 1 itself never makes, and llama-70b's pinned
    dp 16 x tp 4 plan read each block's residual whole (norm on every tensor rank) and produced it
    sequence-parallel, gathered between the 78 copies (0.51 s a step the extraction did not see;
    benchmarks/search_results.md, 2026-12-04 helper M). The obligation is the class of block 1 holding the same
    value one block later in the same placement (`value_names`, `in_block`): chosen, its own e-node (a
    conversion, weighed as block 1's) is what each copy pays. Worked out once per snapshot and `classes`."""
    def make() -> dict:
        names = value_names(snapshot, classes)
        blocks = snapshot_blocks(snapshot)
        made: dict[tuple, list[int]] = {}   # (value as block 0 names it, placement) -> block 1's classes holding it
        for cid in sorted(names):
            if blocks.get(cid) == REPEATED:
                made.setdefault((in_block(names[cid], REPEATED - 1), snapshot.placement[cid]), []).append(cid)
        out: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}
        for nid, kids in snapshot.kids.items():
            if blocks.get(nid[0]) != REPEATED:
                continue
            groups = tuple(dict.fromkeys(tuple(made.get((in_block(names[ch], REPEATED - 1), snapshot.placement[ch]), ()))
                                         for ch in kids if blocks.get(ch) == REPEATED - 1 and ch in names))
            if groups:
                out[nid] = groups
        return out
    return snapshot.derive(("copy_obligations", tuple(classes.items())), make)


def _keeps_chain(snapshot: Snapshot, blocks: Mapping[int, int], nid: tuple[int, int]) -> bool:
    """Whether an e-node reads only from outside the blocks, its own class's block or the one before."""
    own = blocks.get(nid[0], OUTSIDE)
    return all(blocks.get(child, OUTSIDE) in (OUTSIDE, own, own - 1) for child in snapshot.kids[nid])


# ------------------------------------------------------------------ stamping the PCG


def value_names(snapshot: Snapshot, classes: Mapping[str, int]) -> dict[int, str]:
    """E-class -> the graph tensor whose value it holds, however spread: the classes the graph names, and every
    class joined to one of them by a parallel operator (which moves a value between devices, never changes it).
    Worked out once per snapshot and `classes` (`Snapshot.derived`: every repeated extraction asks); each caller
    gets its own copy."""
    return dict(snapshot.derive(("value_names", tuple(classes.items())), lambda: _value_names(snapshot, classes)))


def _value_names(snapshot: Snapshot, classes: Mapping[str, int]) -> dict[int, str]:
    """`value_names`, worked out."""
    names: dict[int, str] = {}
    for name, cid in classes.items():
        if not name.startswith("pin:"):
            names.setdefault(cid, name)
    changed = True
    while changed:
        changed = False
        for cid, nodes in snapshot.classes.items():
            for node in nodes:
                if node.op not in PARALLEL_OPS:
                    continue
                child = node.children[0]
                if cid not in names and child in names:
                    names[cid], changed = names[child], True
                elif child not in names and cid in names:
                    names[child], changed = names[cid], True
    return names


@dataclass(frozen=True)
class Step:
    """One parallel operator of a conversion between two placements of a value (`conversions`)."""

    op: str
    attrs: tuple
    shape: tuple[int, ...]
    degrees: Degrees
    placement: Placement


Converter = Callable[[str, Placement, Placement], "tuple[Step, ...] | None"]


def conversions(snapshot: Snapshot, names: Mapping[int, str]) -> Converter:
    """How to move a graph tensor's value from one placement to another with the e-graph's own parallel
    e-nodes (None when saturation made no such path): the shortest chain of parallel operators from a class
    holding the value in the source placement to one holding it in the target's (`names`: `value_names`).
    Parallel operators move values and never change them, and each e-node is one the rules made, so the
    chain is what a plan could have chosen. The e-graph is indexed on the first call only: most plans'
    blocks are laid out alike and never ask."""
    holding: dict[str, list[int]] = {}
    made_from: dict[int, list[tuple[int, ENode]]] = {}    # class -> (class it converts into, by which e-node)
    mesh = snapshot.mesh

    def index() -> None:
        for cid, name in names.items():
            holding.setdefault(name, []).append(cid)
        for cid, nodes in snapshot.classes.items():
            for node in nodes:
                if node.op in PARALLEL_OPS and names.get(cid) is not None:
                    made_from.setdefault(node.children[0], []).append((cid, node))

    def convert(name: str, source: Placement, target: Placement) -> tuple[Step, ...] | None:
        if not holding:
            index()
        mine = set(holding.get(name, ()))
        frontier = [c for c in mine if snapshot.placement.get(c) == source]
        path: dict[int, tuple[int, ENode] | None] = {c: None for c in frontier}
        while frontier:
            following = []
            for cid in frontier:
                if snapshot.placement.get(cid) == target:
                    steps = []
                    while path[cid] is not None:
                        before, node = path[cid]
                        steps.append(Step(node.op, parallel_attrs(node, mesh), snapshot.shape[cid],
                                          snapshot.degrees[cid], snapshot.placement[cid]))
                        cid = before
                    return tuple(reversed(steps))
                for after, node in made_from.get(cid, ()):
                    if after in mine and after not in path:
                        path[after] = (cid, node)
                        following.append(after)
            frontier = following
        return None

    return convert


def stamp(pcg: PCG, repetition: Repetition, values: Mapping[int, str], convert: Converter | None = None) -> PCG:
    """The searched blocks' PCG repeated into the whole model's (module docstring); RepeatError if it cannot be.

    `values` names, for PCG nodes, the graph tensor each holds (`value_names`): a copy of block 1 reads from
    the copy before it the value block 1 read from block 0, one block later, in the same placement. Where
    block 2 reads that value of block 1 in another placement than block 1 read it of block 0 (extraction
    weighs block 0 once and block 1 N - 2 times, so their outputs may be laid out apart), `convert`
    (`conversions`) gives the parallel operators that move it into block 1's placement: they run between
    every two copies (the PCG's placement check, `pcg_placement`, checks each placement again)."""
    blocks = node_blocks(pcg)
    links = _link_copies(pcg, blocks, values, convert)
    stamped = _Copies(pcg, repetition.blocks, blocks, values, links).build()
    _check_leaves(stamped, repetition.whole)
    return stamped


@dataclass(frozen=True)
class _Links:
    """How a copy of block 1 reads the copy before it (`_link_copies`): kept apart from the copying so that
    a plan whose blocks are not laid out alike is refused before any node is made."""

    successor: Mapping[int, int]                # node of block 0 block 1 reads -> its counterpart in block 1
    bridges: Mapping[int, tuple[Step, ...]]     # such a node -> the parallel operators that move its successor
                                                # into the placement block 1 read it in (only where they differ)


def _link_copies(pcg: PCG, blocks: Mapping[int, int], values: Mapping[int, str],
                 convert: Converter | None) -> _Links:
    """What block 1 reads from block 0 matched to what block 2 reads from block 1, the reads a copy makes of the
    copy before it (RepeatError when the blocks are not a chain or a read holds no named value)."""
    by_id = {n.id: n for n in pcg.nodes}
    last = SEARCHED_BLOCKS - 1
    readers = {b: {i for n in pcg.nodes if blocks[n.id] == b for i in n.inputs} for b in range(SEARCHED_BLOCKS)}
    _check_chain(pcg, blocks)
    into_middle = sorted(i for i in readers[REPEATED] if blocks[i] == REPEATED - 1)
    into_last = sorted(i for i in readers[last] if blocks[i] == REPEATED)
    ahead = {_read_key(i, values, by_id): i for i in into_last}
    behind = {_read_key(i, values, by_id): i for i in into_middle}
    return _match_reads(behind, ahead, values, convert)


def _check_chain(pcg: PCG, blocks: Mapping[int, int]) -> None:
    """Every node reads from outside the blocks, its own block or the one before: only a chain can be copied."""
    for n in pcg.nodes:
        for i in n.inputs:
            if blocks[i] not in (OUTSIDE, blocks[n.id], blocks[n.id] - 1):
                raise RepeatError(f"node {n.id} ({n.label}) of block {blocks[n.id]} reads block {blocks[i]}: "
                                  "the blocks are not a chain")


def _read_key(i: int, values: Mapping[int, str], by_id: Mapping[int, PNode]) -> tuple:
    """What a block reads from the one before: which value (up to the block prefix), where it lies."""
    if i not in values:
        raise RepeatError(f"node {i} ({by_id[i].label}), read across blocks, holds no value the graph names")
    return in_block(values[i], 0), by_id[i].shape, by_id[i].placement


def _match_reads(behind: Mapping[tuple, int], ahead: Mapping[tuple, int], values: Mapping[int, str],
                 convert: Converter | None) -> _Links:
    """What block 1 read from block 0, copy j reads from copy j - 1: the same value one block later, laid out
    alike, or moved there by parallel operators (`convert`); RepeatError when neither."""
    successor: dict[int, int] = {}
    bridges: dict[int, tuple[Step, ...]] = {}
    for key, i in behind.items():
        if key in ahead:
            successor[i] = ahead[key]
            continue
        name, shape, placement = key
        for (other, other_shape, other_placement), a in sorted(ahead.items(), key=lambda kv: kv[1]):
            steps = convert(values[a], other_placement, placement) if convert and other == name \
                and other_shape == shape else None
            if steps:
                successor[i], bridges[i] = a, steps
                break
        else:
            raise RepeatError("the blocks are not laid out alike: block 1 reads "
                              f"{_reads(behind)} from block 0, block 2 reads {_reads(ahead)} from block 1")
    return _Links(successor, bridges)


@dataclass
class _Copies:
    """Writes the whole model's PCG from the searched one's: what lies outside the blocks and block 0 once,
    block 1 once per middle block of the model (each after the bridge from the copy before), block 2 last.
    One `stamp` call's state: the nodes made so far and which new node each searched node became where."""

    pcg: PCG
    count: int                       # blocks of the whole model
    blocks: Mapping[int, int]        # searched node id -> its block (`node_blocks`)
    values: Mapping[int, str]
    links: _Links
    nodes: list[PNode] = field(default_factory=list)
    # (block of the whole model, searched node id) -> new id, for the nodes outside the copies of block 1
    new_id: dict[tuple[int, int], int] = field(default_factory=dict)
    # copy of block 1 -> the new id of its first node (`copied`)
    starts: dict[int, int] = field(default_factory=dict)
    # (copy, node it reads of block 0) -> the bridge's last node
    bridged: dict[tuple[int, int], int] = field(default_factory=dict)
    # searched block that is not repeated -> the block of the whole model it stands for
    ends: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.ends = {OUTSIDE: OUTSIDE, 0: 0, SEARCHED_BLOCKS - 1: self.count - 1}

    def build(self) -> PCG:
        """The whole model's PCG, its nodes in the order they run: each reads only nodes made before it."""
        pcg, blocks = self.pcg, self.blocks
        for node in pcg.nodes:
            if blocks[node.id] in (OUTSIDE, 0):
                self.emit(node, self.ends[blocks[node.id]], self.at_end)
        template = _Template.of(pcg, blocks, self.at_end)
        for block in range(REPEATED, self.count - 1):
            if block > REPEATED:
                self.bridge(block)
            self.copy(template, block)
        for node in pcg.nodes:
            if blocks[node.id] == SEARCHED_BLOCKS - 1:
                self.emit(node, self.count - 1, self.in_last)
        outputs = tuple(self.in_last(o) if blocks[o] == REPEATED else self.at_end(o) for o in pcg.outputs)
        return PCG(tuple(self.nodes), outputs, pcg.output_names, pcg.mesh, pcg.recompute, pcg.zero)

    def emit(self, node: PNode, block: int, source: Callable[[int], int]) -> None:
        """`node` as block `block`'s, reading the new ids `source` gives for its inputs."""
        nodes = self.nodes
        self.new_id[(block, node.id)] = len(nodes)
        # every field of PNode, in order, made directly (`dataclasses.replace` took half of stamping a plan:
        # bert-large:64 stamps 48,000 nodes); tests/test_repeat.py checks that these are all of PNode's fields
        nodes.append(PNode(len(nodes), node.kind, in_block(node.op, block) if node.kind == "leaf" else node.op,
                           tuple(source(i) for i in node.inputs), node.attrs, node.shape, node.degrees, node.role,
                           in_block(node.origin, block), node.placement, node.rules))

    def copy(self, template: "_Template", block: int) -> None:
        """Copy `block` of block 1: each of block 1's nodes as `emit(node, block, self.in_copy(block))` makes it
        (`tests/test_stamp_rescale.py` compares the two), with what `emit` works out per node and input worked out
        once per stamp (`_Template`): the copy's nodes are block 1's, in order, from `starts[block]` on, so a node
        that block 1's node at position p reads of block 1 is the copy's node `starts[block] + p`; what it reads of
        block 0 is what `in_copy` gives (the copy before it, or the bridge from it: a handful of values a copy);
        what it reads outside the blocks is the same node for every copy. A name in a block is moved by its prefix
        alone (`past_block`: `in_block(name, block)` is `b{block}_` and the name past its prefix)."""
        nodes = self.nodes
        start = self.starts[block] = len(nodes)
        source = self.in_copy(block)
        table = [*range(start, start + template.length), *map(source, template.behind), *template.outside]
        ids = table.__getitem__
        prefix = f"b{block}_"
        for (node, codes, op, origin) in template.entries:
            nodes.append(PNode(len(nodes), node.kind, node.op if op is None else prefix + op,
                               tuple(map(ids, codes)), node.attrs, node.shape, node.degrees, node.role,
                               node.origin if origin is None else prefix + origin, node.placement, node.rules))

    def copied(self, block: int, i: int) -> int:
        """The new id of searched node `i` of block 1 in copy `block` (`copy`: the copy's nodes are block 1's, in
        order, from its start)."""
        return self.starts[block] + self.position[i]

    def at_end(self, i: int) -> int:
        """The new id of a node outside the blocks, of block 0 or of the last block."""
        return self.new_id[(self.ends[self.blocks[i]], i)]

    def bridge(self, block: int) -> None:
        """The parallel operators that move what copy `block - 1` made into the placements copy `block` reads."""
        nodes, successor, values = self.nodes, self.links.successor, self.values
        for i, steps in sorted(self.links.bridges.items()):
            at = self.copied(block - 1, successor[i])
            for step in steps:
                nodes.append(PNode(len(nodes), "parallel", step.op, (at,), step.attrs, step.shape, step.degrees,
                                   origin=in_block(values[successor[i]], block - 1), placement=step.placement))
                at = nodes[-1].id
            self.bridged[(block, i)] = at

    def in_copy(self, block: int) -> Callable[[int], int]:
        """Where copy `block` of block 1 finds a node it reads: in itself, the copy before it (or the bridge
        from it), or outside the repeated blocks."""
        blocks, links = self.blocks, self.links

        def source(i: int) -> int:
            if blocks[i] == REPEATED:
                return self.copied(block, i)
            if blocks[i] == REPEATED - 1 and block > REPEATED:
                return self.bridged[(block, i)] if i in links.bridges else self.copied(block - 1, links.successor[i])
            return self.at_end(i)
        return source

    def in_last(self, i: int) -> int:
        """Where the last block (and the model's outputs) find a node: the last copy of block 1, or its end."""
        return self.copied(self.count - 2, i) if self.blocks[i] == REPEATED else self.at_end(i)

    @cached_property
    def position(self) -> dict[int, int]:
        """Searched node id of block 1 -> its place among block 1's nodes (`copied`)."""
        return {node.id: p for p, node in enumerate(n for n in self.pcg.nodes if self.blocks[n.id] == REPEATED)}


@dataclass(frozen=True)
class _Template:
    """What copying block 1 reads of each of its nodes, worked out once per stamp (`_Copies.copy`): the node, its
    inputs as places in a copy's table of ids (block 1's nodes first, by position; then the nodes it reads of
    block 0, `behind`; then those outside the blocks, whose ids every copy shares, `outside`), and its leaf name
    and origin past their block prefix (None where a copy keeps it: not a leaf, or a name outside every block)."""

    length: int                                  # block 1's nodes
    behind: tuple[int, ...]                      # searched nodes of block 0 that block 1 reads
    outside: tuple[int, ...]                     # new ids of the nodes outside the blocks that block 1 reads
    entries: tuple[tuple[PNode, tuple[int, ...], str | None, str | None], ...]

    @staticmethod
    def of(pcg: PCG, blocks: Mapping[int, int], at_end: Callable[[int], int]) -> "_Template":
        repeated = [n for n in pcg.nodes if blocks[n.id] == REPEATED]
        position = {n.id: p for p, n in enumerate(repeated)}
        behind: dict[int, int] = {}
        outside: dict[int, int] = {}
        for node in repeated:
            for i in node.inputs:
                if i not in position:
                    (behind if blocks[i] == REPEATED - 1 else outside).setdefault(i, 0)
        code = {**position, **{i: len(repeated) + k for k, i in enumerate(behind)},
                **{i: len(repeated) + len(behind) + k for k, i in enumerate(outside)}}
        entries = tuple((n, tuple(code[i] for i in n.inputs), past_block(n.op) if n.kind == "leaf" else None,
                         past_block(n.origin)) for n in repeated)
        return _Template(len(repeated), tuple(behind), tuple(at_end(i) for i in outside), entries)


def _reads(found: Mapping[tuple, int]) -> str:
    return ", ".join(sorted(f"{name} as {placement}" for name, _shape, placement in found)) or "nothing"


def _check_leaves(pcg: PCG, whole: Graph) -> None:
    """The stamped PCG reads exactly the whole model's leaves, at their shapes."""
    want = {leaf.name: tuple(leaf.shape) for leaf in whole.leaves}
    have = {n.op: tuple(n.shape) for n in pcg.nodes if n.kind == "leaf"}
    if have != want:
        missing = sorted(set(want) - set(have))[:3]
        extra = sorted(set(have) - set(want))[:3]
        raise RepeatError(f"the repeated plan's leaves differ from the model's (missing {missing}, extra {extra})")
