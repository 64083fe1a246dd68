"""Which block of a stack a value belongs to: what repeated-block search (`search.repeat`) and pipeline
stages (`ir.pipeline`) both cut a model by, and a stack's PCG cut to a few of its blocks (`block_excerpt`, which
a stage plan's tensor-parallel overlap is read off: `cost.pipeline.tp_overlap`).

Language models are stacks of blocks (`ir.models`: every weight and node
of block i is named `b{i}_...`). A PCG node belongs to the latest block
whose weights it depends on; values that depend on no block's weights
(embeddings, masks, positions) are OUTSIDE every block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from parsat.ir.pcg import PCG, PNode, restated

OUTSIDE = -1                   # a value that depends on no block's weights (embeddings, masks, positions)
_BLOCK_NAME = re.compile(r"^b(\d+)_")


def block_of(name: str) -> int:
    """The block a graph name belongs to (`b3_wq` -> 3), OUTSIDE for names outside every block."""
    found = _BLOCK_NAME.match(name)
    return int(found.group(1)) if found else OUTSIDE


def has_blocks(names) -> bool:
    """Whether any of `names` (a graph's leaves) belongs to a block: a model the block-wise machinery (repeated
    search, pipeline stages, recomputation) can cut."""
    return any(block_of(name) != OUTSIDE for name in names)


def in_block(name: str, block: int) -> str:
    """`name` moved into `block` (`b1_wq` -> `b7_wq`); a name outside every block is kept."""
    found = _BLOCK_NAME.match(name)   # one match, not a match and a substitution: a stamped PCG moves every node
    return f"b{block}_{name[found.end():]}" if found else name


def past_block(name: str) -> str | None:
    """`name` past its block prefix (`b1_wq` -> `wq`), None for a name outside every block: `in_block(name, block)` is
    `f"b{block}_" + past_block(name)` where that is not None (the same match), `name` where it is. A stamp moves
    each of block 1's names into 78 blocks: matched once, each copy's name is one concatenation."""
    found = _BLOCK_NAME.match(name)
    return name[found.end():] if found else None


def node_blocks(pcg: PCG) -> Mapping[int, int]:
    """PCG node -> its block: the latest block whose weights it depends on (the PCG is in topological order),
    except that parallel operators that only a later block reads belong to that block: they are its entry,
    converting the value it reads into the placements it wants (block 1 may want the same value of block 0
    in two placements, and block 2 of block 1 in one: what crosses is the value, each block converts it).

    Worked out once per PCG (`PCG.derive`) and shared: it reads the nodes alone, so a layout's forms that
    differ in ZeRO stage or recomputation (`ir.pcg.restated`) share it too; the recomputation's
    checkpoints, the step simulator and the pipeline's layer map each asked for it again (261 times on
    llama-70b:64). Read it, never change it."""
    return pcg.derive("node_blocks", None, lambda: _node_blocks(pcg), structural=True)


def _node_blocks(pcg: PCG) -> dict[int, int]:
    """`node_blocks` worked out. A name's block is read once per name (`named`: a graph node's PCG nodes share its
    origin), the readers are the PCG's own (`PCG.readers_of`, worked out once per PCG and shared) and the latest
    block is found without a list per node: 140 calls were ~2% of llama-70b:64's search. The same blocks."""
    blocks: dict[int, int] = {}
    named: dict[str, int] = {}
    for node in pcg.nodes:
        name = node.op if node.kind == "leaf" else node.origin
        latest = named.get(name)
        if latest is None:
            latest = named[name] = block_of(name)
        for i in node.inputs:
            if blocks[i] > latest:
                latest = blocks[i]
        blocks[node.id] = latest
    readers = pcg.readers_of
    for node in reversed(pcg.nodes):
        if node.kind != "parallel" or blocks[node.id] == OUTSIDE or node.id in pcg.outputs:
            continue
        later = {blocks[r.id] for r in readers.get(node.id, ())}
        if len(later) == 1 and next(iter(later)) > blocks[node.id]:
            blocks[node.id] = next(iter(later))
    return blocks


def block_excerpt(pcg: PCG, count: int) -> PCG | None:
    """`pcg` cut to `count` of its N blocks: what lies outside the blocks, blocks 0 to count - 2, and its last block
    (N - 1) renamed block count - 1, reading of block count - 2 what it read of block N - 2 (the node at the same
    place in that block); the nodes in `pcg`'s order, numbered afresh. None where `pcg` is no stack of alike
    blocks the cut keeps alike: fewer than count + 2 blocks, blocks 2 to N - 2 not alike (`_block_forms`: the
    same nodes in the same order up to the `b{i}_` prefix, reading their own block, the blocks before it at the
    same places, and the same nodes outside the blocks), a model output in a block the cut drops, or count < 4
    (the last block must read a block alike to block N - 2: block 1 may differ from block 2, its reads of block 0
    being where a repeated plan's copies have bridges, `search.repeat`).

    Why: a stage plan of a stack of N alike blocks (llama-70b: 80) is simulated for its tensor-parallel overlap
    (`cost.pipeline.tp_overlap`), whose extents grow by one block's period a block once past the first blocks;
    excerpts of a few blocks give that line (the caller checks they are on one). Worked out once per PCG's nodes
    (`PCG.derive`: a layout's ZeRO and recomputation forms share it) and given in `pcg`'s form (`restated`)."""
    made = pcg.derive(("block excerpt", count), None, lambda: _excerpt(pcg, count))
    return None if made is None else restated(made, pcg.zero, pcg.recompute)


@dataclass(frozen=True)
class _Blocks:
    """A PCG's blocks as `block_excerpt` reads them (`_block_forms`)."""

    of: Mapping[int, int]                  # node -> its block (`node_blocks`)
    members: Mapping[int, list[int]]       # block -> its nodes, in the PCG's order
    place: Mapping[int, int]               # node of a block -> its place in `members`
    alike: bool                            # blocks 2 to N - 2 alike


def _block_forms(pcg: PCG) -> _Blocks | None:
    """`pcg`'s blocks, and whether blocks 2 to N - 2 are alike: per node the same fields up to the block prefix
    (names moved back to block 0) and the same reads: of its own block or the blocks before it at the same places,
    or the same nodes outside the blocks. None where the blocks are not numbered 0 to N - 1. Worked out once per
    PCG's nodes (`PCG.derive`), for every count; one pass (llama-70b's 80 blocks, 5,000-6,600 nodes), each node's
    form compared with block 2's at its place and dropped (kept, 6,000 forms a PCG woke the collector)."""
    blocks = node_blocks(pcg)
    members: dict[int, list[int]] = {}
    place: dict[int, int] = {}
    model: list[tuple] = []                   # block 2's forms
    unlike: set[int] = set()                  # blocks with a node unlike block 2's at its place
    for node in pcg.nodes:
        block = blocks[node.id]
        if block == OUTSIDE:
            continue
        found = members.get(block)
        if found is None:
            found = members[block] = []
        at = place[node.id] = len(found)
        found.append(node.id)
        if block < 2 or block in unlike:
            continue
        form = (node.kind, _relative(node.op, block) if node.kind == "leaf" else node.op, node.attrs, node.shape,
                node.degrees, node.role, _relative(node.origin, block), node.placement,
                tuple(i if blocks[i] == OUTSIDE else (block - blocks[i], place[i]) for i in node.inputs))
        if block == 2:
            model.append(form)
        elif at >= len(model) or form != model[at]:
            unlike.add(block)
    count = len(members)
    if sorted(members) != list(range(count)):
        return None
    alike = count > 3 and all(b not in unlike and len(members[b]) == len(model) for b in range(3, count - 1))
    return _Blocks(blocks, members, place, alike)


def _excerpt(pcg: PCG, count: int) -> PCG | None:
    """`block_excerpt` worked out (in `pcg`'s ZeRO stage and recomputation; the caller restates it)."""
    found = pcg.derive("block forms", None, lambda: _block_forms(pcg))
    if count < 4 or found is None or not found.alike:
        return None
    blocks, members, place = found.of, found.members, found.place
    last = len(members) - 1
    if last < count + 1:
        return None
    shift = last - (count - 1)                # the last block reads block b - shift for block b (b >= count - 1)
    new_id: dict[int, int] = {}
    nodes: list[PNode] = []
    for node in pcg.nodes:
        block = blocks[node.id]
        if block != OUTSIDE and count - 1 <= block < last:
            continue
        inputs, op, origin = node.inputs, node.op, node.origin
        if block == last:
            read = [blocks[i] for i in inputs if blocks[i] not in (OUTSIDE, last)]
            if any(b < count - 1 or b - shift < 2 for b in read):
                return None   # it reads a block the excerpt keeps, or one it would move to block 0 or 1
            inputs = tuple(members[blocks[i] - shift][place[i]] if blocks[i] not in (OUTSIDE, last) else i
                           for i in inputs)
            op, origin = _moved(op, shift) if node.kind == "leaf" else op, _moved(origin, shift)
        new_id[node.id] = len(nodes)
        # every field of PNode, in order, made directly (as `search.repeat` stamps: `dataclasses.replace` is slow)
        nodes.append(PNode(len(nodes), node.kind, op, tuple(new_id[i] for i in inputs), node.attrs, node.shape,
                           node.degrees, node.role, origin, node.placement, node.rules))
    if any(o not in new_id for o in pcg.outputs):
        return None
    return PCG(tuple(nodes), tuple(new_id[o] for o in pcg.outputs), pcg.output_names, pcg.mesh, pcg.recompute,
               pcg.zero)


def _relative(name: str, block: int) -> tuple[int, str] | str:
    """`name` as seen from `block`: (how many blocks back it lies, the name past its `b{i}_` prefix); a name
    outside every block as it is."""
    found = _BLOCK_NAME.match(name)
    return (block - int(found.group(1)), name[found.end():]) if found else name


def _moved(name: str, back: int) -> str:
    """`name` moved `back` blocks back (`b79_wq`, 76 -> `b3_wq`); a name outside every block is kept."""
    block = block_of(name)
    return name if block == OUTSIDE else in_block(name, block - back)
