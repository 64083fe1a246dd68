"""A graph's repeated blocks by structure: checked where the names say them, found where they do not.

The block-wise machinery (repeated-block search `search.repeat`, pipeline
stages, recomputation) cuts a model by names (`ir.blocks`: block i's
tensors are named `b{i}_...`; a node belongs to the latest block it
depends on). The built-in examples are written so; an imported module's
tensors are named by module path (`model.layers.3.mlp.up_proj.weight`)
and by the exporter's counters (`linear_17`). Two things here, one check:

* `named_layout`: the blocks a graph's names give, checked to be identical
  by structure (`BlockLayout`): every block but the last the same
  operators, attributes, shapes and wiring as block 1, each reading the
  block before it, its own tensors and tensors outside every block only,
  and its k-th tensor named as block 1's k-th one in its own block
  (`in_block`). The last block starts alike and goes on into the head
  (the final norm and the loss depend on it); block 0 reads, where block 1
  reads block 0, what comes before the blocks. A graph whose names say
  blocks that are not alike has no layout: its blocks are never repeated.
* `block_names`: where no name says a block, the renaming that makes a
  stack of identical blocks say it. Candidates come from the order in which
  the graph first reads its weights (a period of weight shapes: nine per
  LLaMA layer); each is taken only if the renamed graph passes
  `named_layout`, so an order that misleads gives no blocks, never wrong
  ones. Tensors that depend on no weight (a rotary table, a dropout mask)
  read by one block only are that block's (a layer's own dropout mask);
  one that every block reads (the importer's one leaf per rotary table) is
  the model's.

`searched_blocks` cuts a layout's graph to three blocks (first, middle,
last), the graph `search.repeat` saturates in place of the whole model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterator, Mapping, Sequence

from parsat.ir.blocks import OUTSIDE, block_of, in_block
from parsat.ir.graph import Graph, Leaf, OpNode

CANDIDATES = 16         # groupings of the weights into blocks tried (`_candidates`), likeliest first
_NUMBER = re.compile(r"(\d+)")


@dataclass(frozen=True)
class BlockLayout:
    """A graph's identical blocks: `members[b]` lists block b's leaves, then its nodes (graph order), the k-th of
    every block the same tensor of its block; the last block's head (what follows its nodes) is not listed."""

    members: tuple[tuple[str, ...], ...]

    @property
    def count(self) -> int:
        return len(self.members)


# ------------------------------------------------------------------ which block each tensor is in


def tensor_blocks(graph: Graph, leaf_block: Mapping[str, int]) -> dict[str, int]:
    """Tensor -> its block as `ir.blocks` sees it: a leaf's from `leaf_block`, a node's the latest of its name's
    and its inputs' (a node depends on every block its inputs do)."""
    blocks = {leaf.name: leaf_block.get(leaf.name, OUTSIDE) for leaf in graph.leaves}
    for node in graph.nodes:
        blocks[node.name] = max([block_of(node.name)] + [blocks[i] for i in node.inputs])
    return blocks


def readers_of(graph: Graph) -> dict[str, list[str]]:
    """Tensor -> the nodes that read it, in graph order."""
    readers: dict[str, list[str]] = {}
    for node in graph.nodes:
        for i in node.inputs:
            readers.setdefault(i, []).append(node.name)
    return readers


def _pull_data(graph: Graph, blocks: dict[str, int], entries: frozenset[str] = frozenset()) -> None:
    """Tensors that depend on no weight and that one block alone reads join that block (in place): a layer's
    own rotary tables or dropout mask are its inputs, not the model's. `entries` stay outside: what block 0
    reads where the next block reads block 0 (`_entries`), the model's input rather than the block's."""
    weighted = {leaf.name for leaf in graph.weights}
    for node in graph.nodes:
        if any(i in weighted for i in node.inputs):
            weighted.add(node.name)
    readers = readers_of(graph)
    outputs = set(graph.outputs)
    order = [n.name for n in reversed(graph.nodes)] + [leaf.name for leaf in graph.leaves]
    for name in order:     # readers come later in the graph: each is placed before what it reads
        if name in weighted or name in outputs or name in entries or blocks[name] != OUTSIDE:
            continue
        reading = {blocks[r] for r in readers.get(name, ())}
        if len(reading) == 1 and min(reading) != OUTSIDE:
            blocks[name] = reading.pop()


def _entries(graph: Graph, weighted: Mapping[str, int], pulled: Mapping[str, int]) -> frozenset[str]:
    """The tensors block 0 reads (`pulled` into it, not depending on a weight) where block 1 reads block 0: the
    model's input `x` a stack's first layer reads, which block 1 reads as block 0's output. Block 0's and 1's
    nodes that depend on their weights (`weighted`: blocks before any was pulled) are paired in graph order."""
    firsts = [[n for n in graph.nodes if weighted[n.name] == b] for b in (0, 1)]
    found = set()
    for mine, theirs in zip(*firsts):
        for i, j in zip(mine.inputs, theirs.inputs):
            if weighted[j] == 0 and weighted[i] == OUTSIDE and pulled[i] == 0:
                found.add(i)
    return frozenset(found)


# ------------------------------------------------------------------ the layout the names give, checked


def named_layout(graph: Graph) -> BlockLayout | None:
    """The identical blocks `graph`'s names give (module docstring); None where they give fewer than two, or
    blocks that are not alike."""
    blocks = tensor_blocks(graph, {leaf.name: block_of(leaf.name) for leaf in graph.leaves})
    count = max(blocks.values(), default=OUTSIDE) + 1
    if count < 2 or not _chained(graph, blocks, count):
        return None
    members = _members(graph, blocks, count)
    if members is None:
        return None
    reference = 1 if count > 2 else 0
    index = _Index.of(graph)
    pattern = index.pattern(blocks, members[reference], reference)
    for b in range(count):
        mine = index.pattern(blocks, members[b], b)
        if b != reference and not _alike(pattern, mine, 0 in (b, reference)):
            return None
        if b > 0 and not any(ref[0] == "prev" for entry in mine if entry[0] != "leaf" for ref in entry[3]):
            return None     # side by side, not one after the other (two branches of one layer)
        if any(name != in_block(ref, b) for name, ref in zip(members[b], members[reference])):
            return None
    return BlockLayout(tuple(members))


def _chained(graph: Graph, blocks: Mapping[str, int], count: int) -> bool:
    """Every block is there, each node reads only tensors outside the blocks, its own block's, or the block
    before's nodes (a weight belongs to one block), and the outputs are outside or in the last block."""
    if {b for b in blocks.values() if b != OUTSIDE} != set(range(count)):
        return False
    leaves = {leaf.name for leaf in graph.leaves}
    for node in graph.nodes:
        own = blocks[node.name]
        for i in node.inputs:
            if blocks[i] not in (OUTSIDE, own, own - 1) or (blocks[i] == own - 1 != OUTSIDE and i in leaves):
                return False
    return all(blocks[o] in (OUTSIDE, count - 1) for o in graph.outputs)


def _members(graph: Graph, blocks: Mapping[str, int], count: int) -> list[tuple[str, ...]] | None:
    """Each block's leaves (in the order its nodes first read them) then nodes, the last block's cut to as many
    nodes as block 1 has (the rest is the head); None when the blocks have unequal sizes."""
    nodes: list[list[str]] = [[] for _ in range(count)]
    for node in graph.nodes:
        if blocks[node.name] != OUTSIDE:
            nodes[blocks[node.name]].append(node.name)
    size = len(nodes[1 if count > 2 else 0])
    if any(len(nodes[b]) != size for b in range(count - 1)) or len(nodes[-1]) < size:
        return None
    by_name = {n.name: n for n in graph.nodes}
    own: list[set[str]] = [set() for _ in range(count)]
    for leaf in graph.leaves:
        if blocks[leaf.name] != OUTSIDE:
            own[blocks[leaf.name]].add(leaf.name)
    members = []
    for b in range(count):
        read = (i for name in nodes[b][:size] for i in by_name[name].inputs if i in own[b])
        leaves = tuple(dict.fromkeys(read))
        if b < count - 1 and len(leaves) != len(own[b]):
            return None     # a leaf of the block that none of its nodes reads: not a block of this stack
        members.append(leaves + tuple(nodes[b][:size]))
    return members


@dataclass(frozen=True)
class _Index:
    """A graph's tensors by name, looked up once for every block's pattern."""

    leaves: Mapping[str, Leaf]
    nodes: Mapping[str, OpNode]

    @staticmethod
    def of(graph: Graph) -> "_Index":
        return _Index({leaf.name: leaf for leaf in graph.leaves}, {n.name: n for n in graph.nodes})

    def pattern(self, blocks: Mapping[str, int], members: Sequence[str], block: int) -> tuple:
        """A block's structure, free of its names: each leaf's role and shape, each node's operator, attributes,
        shape and inputs (its own tensors by position, the block before's and outside tensors by name, the
        former with the block taken out: the names of alike blocks differ by the block alone)."""
        position = {name: k for k, name in enumerate(members)}
        out = []
        for name in members:
            leaf = self.leaves.get(name)
            if leaf is not None:
                out.append(("leaf", leaf.role, leaf.shape))
                continue
            node = self.nodes[name]
            refs = tuple(("own", position[i]) if i in position else
                         ("prev", in_block(i, 0)) if block > 0 and blocks[i] == block - 1 else ("out", i)
                         for i in node.inputs)
            out.append((node.op, node.attrs, node.shape, refs))
        return tuple(out)


def _alike(pattern: tuple, other: tuple, first: bool) -> bool:
    """Whether two blocks' patterns are the same; with `first` (one of them is block 0), a read of the block
    before may face a read of a tensor outside the blocks (block 0 reads there what comes before the stack)."""
    if len(pattern) != len(other):
        return False
    for mine, theirs in zip(pattern, other):
        if mine[0] == "leaf" or theirs[0] == "leaf":
            if mine != theirs:
                return False
            continue
        if mine[:3] != theirs[:3] or len(mine[3]) != len(theirs[3]):
            return False
        for a, b in zip(mine[3], theirs[3]):
            if a != b and not (first and {a[0], b[0]} == {"prev", "out"}):
                return False
    return True


# ------------------------------------------------------------------ blocks found where no name says them


def block_names(graph: Graph) -> dict[str, str]:
    """The renaming (old name -> `b{i}_...`) that makes `graph`'s identical blocks say themselves
    (`named_layout`), or {} where it has none, or where some name already says a block (the graph is then
    left as it is named)."""
    names = [leaf.name for leaf in graph.leaves] + [n.name for n in graph.nodes]
    if any(block_of(name) != OUTSIDE for name in names):
        return {}
    for groups in _candidates(graph):
        renaming = _renaming(graph, groups)
        if renaming:
            layout = named_layout(renamed(graph, renaming))
            if layout is not None and layout.count == len(groups):
                return renaming
    return {}


def _candidates(graph: Graph) -> Iterator[list[list[str]]]:
    """Weights grouped into blocks, the likeliest first (at most `CANDIDATES`): the weights in the order the
    graph first reads them, and for each period of their shapes the longest stretch it repeats over, by the
    weights it covers, then by the blocks it makes; each start within the stretch that makes as many blocks
    (BERT's embedding norm has the shapes of a layer's last norm: the stretch starts a layer early)."""
    first: dict[str, int] = {}
    for k, node in enumerate(graph.nodes):
        for i in node.inputs:
            first.setdefault(i, k)
    weights = sorted((leaf for leaf in graph.weights if leaf.name in first), key=lambda leaf: first[leaf.name])
    shapes = [leaf.shape for leaf in weights]
    found = []
    for width in range(1, len(shapes) // 2 + 1):
        run, length, start = 0, 0, 0
        for i in range(len(shapes) - width - 1, -1, -1):
            run = run + 1 if shapes[i] == shapes[i + width] else 0
            if run + width >= length:
                length, start = run + width, i
        count = length // width
        if count >= 2:
            found.append((-count * width, -count, width, start, length - count * width))
    tried = 0
    for _, count, width, start, slack in sorted(found):
        for first_weight in range(start, start + slack + 1):
            if tried == CANDIDATES:
                return
            tried += 1
            yield [[w.name for w in weights[first_weight + b * width:first_weight + (b + 1) * width]]
                   for b in range(-count)]


def _renaming(graph: Graph, groups: Sequence[Sequence[str]]) -> dict[str, str]:
    """Each block's tensors named `b{i}_` + a name its counterparts share (`_shared_names`), blocks by the
    weights in `groups`; {} when the blocks so made have unequal sizes."""
    weighted = tensor_blocks(graph, {name: b for b, group in enumerate(groups) for name in group})
    blocks = dict(weighted)
    _pull_data(graph, blocks)
    entries = _entries(graph, weighted, blocks)
    if entries:
        blocks = dict(weighted)
        _pull_data(graph, blocks, entries)
    members = _members(graph, blocks, len(groups))
    shared = _shared_names(members) if members is not None else None
    if shared is None:
        return {}
    return {name: f"b{b}_{common}" for b, block in enumerate(members) for name, common in zip(block, shared)}


def _shared_names(members: Sequence[Sequence[str]]) -> list[str] | None:
    """For each position of a block, a name its tensors in every block share: the names with the number that
    counts the blocks as `#` (`model.layers.#.mlp.up_proj.weight`), else block 0's name (the exporter's
    `linear_7`); None if two positions would share one."""
    columns = list(zip(*members))
    names = [_without_number(column) or column[0] for column in columns]
    taken: dict[str, int] = {}
    for name in names:
        taken[name] = taken.get(name, 0) + 1
    names = [column[0] if taken[name] > 1 else name for name, column in zip(names, columns)]
    return names if len(set(names)) == len(names) else None


def _without_number(column: Sequence[str]) -> str | None:
    """The names of `column` (a position's name in each block) with the one number in which they differ, one
    more from each block to the next, written `#`; None if they differ otherwise."""
    parts = [_NUMBER.split(name) for name in column]
    if any(len(p) != len(parts[0]) for p in parts):
        return None
    varying = [k for k in range(len(parts[0])) if len({p[k] for p in parts}) > 1]
    if len(varying) != 1 or varying[0] % 2 == 0:    # split keeps the numbers at the odd places
        return None
    k = varying[0]
    numbers = [int(p[k]) for p in parts]
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        return None     # not a count of the blocks (the exporter's `neg_1`, `neg_3`)
    return "".join(parts[0][:k]) + "#" + "".join(parts[0][k + 1:])


def renamed(graph: Graph, renaming: Mapping[str, str]) -> Graph:
    """`graph` with its tensors renamed (a name `renaming` lacks is kept), the inputs it names constant too."""
    new = lambda name: renaming.get(name, name)  # noqa: E731
    leaves = tuple(replace(leaf, name=new(leaf.name)) for leaf in graph.leaves)
    nodes = tuple(replace(n, name=new(n.name), inputs=tuple(new(i) for i in n.inputs)) for n in graph.nodes)
    return replace(graph, leaves=leaves, nodes=nodes, outputs=tuple(new(o) for o in graph.outputs),
                   constants=frozenset(new(c) for c in graph.constants))


# ------------------------------------------------------------------ cut to the blocks searched


def searched_blocks(graph: Graph, count: int, kept: int) -> Graph:
    """`graph`, whose `count` blocks `named_layout` checked, cut to `kept` of them: blocks 0 to kept - 2 as they
    are, and its last block, renamed block kept - 1, reading block kept - 2 as it read block count - 2 (the
    blocks are alike); the head and what precedes the blocks as they are. What `search.repeat` saturates."""
    shift = count - kept

    def moved(name: str) -> str:
        b = block_of(name)
        return in_block(name, b - shift) if b >= max(kept - 1, count - 2) else name

    def kept_(name: str) -> bool:
        return block_of(name) < kept - 1 or block_of(name) == count - 1

    leaves = tuple(replace(leaf, name=moved(leaf.name)) for leaf in graph.leaves if kept_(leaf.name))
    nodes = tuple(replace(n, name=moved(n.name), inputs=tuple(moved(i) for i in n.inputs))
                  for n in graph.nodes if kept_(n.name))
    return replace(graph, leaves=leaves, nodes=nodes, outputs=tuple(moved(o) for o in graph.outputs), example=None,
                   constants=frozenset(moved(c) for c in graph.constants if kept_(c)))
