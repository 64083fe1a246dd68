"""Which block of a stack a value belongs to: what repeated-block search (`search.repeat`) and pipeline
stages (`ir.pipeline`) both cut a model by.

Language models are stacks of blocks (`ir.models`: every weight and node
of block i is named `b{i}_...`). A PCG node belongs to the latest block
whose weights it depends on; values that depend on no block's weights
(embeddings, masks, positions) are OUTSIDE every block.
"""

from __future__ import annotations

import re
from typing import Mapping

from parsat.ir.pcg import PCG

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
