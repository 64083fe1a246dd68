"""Ring attention in a plan: which fused attentions a GPU framework runs as a ring.

The search's form of ring attention (`attention_query_parallel`, rules/parallel_layers.rule) is fused
bidirectional attention whose queries are split along their sequence on a mesh axis and whose keys and values
are all-gathered along their sequence on that axis, for that attention alone. Written so, every rank would hold
the whole k and v; a framework runs it as a ring instead (Liu et al., 2023, "Ring Attention with Blockwise
Transformers"; Transformer Engine's `cp_comm_type="p2p"`): each rank keeps its block of queries, computes
against the key/value block it holds while it sends that block to the next rank and receives the next one, and
merges the blocks' partial results (the online softmax), so a rank holds one block of k and v at a time, never
the gathered sequence, and the blocks' transfers run under the blocks' attention.

The step simulator (`cost.pcg_tasks`, `_Builder._ring`) prices it so under a profile that overlaps
communication (a GPU framework; `parsat run`'s interpreter all-gathers k and v, and is priced as it runs):
forward, p chunks of 1/p of the attention kernel on the compute stream and p - 1 send/recv steps of one k
block and one v block on the communication stream, chunk i waiting for block i, so the pass takes the first
block plus p - 1 times the larger of a block's attention and a block's transfer; backward, p chunks of the
backward kernel while each step sends a k and v block on with the dk and dv accumulated for it (twice the
bytes), and one last step that brings each block's dk and dv home. The all-gathers themselves issue nothing
and hold one block each (the block in flight), not the gathered sequence.

The causal ring (`attention_causal_query_parallel`) is `attention_masked` in that form whose mask is the rows of
`causal_mask` split along the queries on the same axis: rank i meets the key blocks before its own in full, its
own block causally (the diagonal) and skips the blocks after it, so the ranks are unbalanced and the pass is the
slowest rank's (the last: p - 1 full blocks and the diagonal). A GPU framework makes the mask block from the
rank's offset inside the kernel (FlashAttention's causal flag on the diagonal block, none on the others), so the
mask and its split (`RingAttention.generated`) run nothing and hold nothing there; `parsat run`'s interpreter
makes the whole mask and slices it, and is priced as it runs.

The zigzag ring (`attention_causal_zigzag_query_parallel`) is the causal ring whose mask is the rows of
`zigzag(causal_mask(s), 0, 2p)` split on the same axis: rank i's queries are chunks i and 2p - 1 - i of the
sequence, every rank does the same causal work (`RingAttention.balanced`, `cost.ring_time.ring_work`), and the
zigzag of the mask is made in the kernel too.

Not priced as a ring: causal attention written as `attention_causal` (its query blocks need the mask block:
docs/MESH.md, "Ring attention"), a gather that another node also reads, and a weight's gather.
"""

from __future__ import annotations

from dataclasses import dataclass

from parsat.dsl import parallel_ops
from parsat.ir.pcg import PCG
from parsat.ir.placement import shard

RING_ATTENTION = frozenset({"attention", "attention_masked"})
"""The fused attention operators a ring runs: bidirectional attention, whose query split is proven
(`attention_query_parallel`), and attention under a mask whose rows are split with the queries
(`attention_masked_query_parallel`; over the causal mask, the causal ring: `attention_causal_query_parallel`)."""

CAUSAL_MASK = "causal_mask"
"""The operator that makes the causal mask from positions (rules/ops.rule)."""

ZIGZAG = "zigzag"
"""The operator that puts a sequence's 2p chunks in zigzag order (rules/ops.rule): rank i's block holds chunks i
and 2p - 1 - i, the balanced causal ring's layout."""


@dataclass(frozen=True)
class RingAttention:
    """A fused attention run as a ring over `parts` ranks: its node, and the all-gathers of its k and v; `causal`
    when its mask is the causal mask's rows (the causal ring), `balanced` when the ranks' rows are the zigzag
    chunks (every rank the same causal work, `cost.ring_time.ring_work`), `generated` the mask's nodes a GPU
    kernel makes from the rank's offset instead (its split, and the whole mask where only such splits read it)."""

    attention: int
    gathers: tuple[int, int]
    parts: int
    causal: bool = False
    generated: tuple[int, ...] = ()
    balanced: bool = False


def ring_attentions(pcg: PCG) -> dict[int, RingAttention]:
    """The plan's ring attentions, by the attention node and by each of its two gathers: a `RING_ATTENTION` node
    whose q is split along its sequence (dim -2) on a mesh axis and whose k and v are `all_gather`s along their
    sequence on the same axis that it alone reads. Its inputs and readers are looked up only where an attention
    node is met (`PCG.node`, `PCG.readers_of`, kept with the PCG): most PCGs priced have none."""
    found: dict[int, RingAttention] = {}
    for node in pcg.nodes:
        if node.kind != "op" or node.op not in RING_ATTENTION:
            continue
        readers = pcg.readers_of
        q, k, v = (pcg.node(i) for i in node.inputs[:3])
        if not all(g.kind == "parallel" and g.op == parallel_ops.ALL_GATHER and int(g.attr("dim")) == len(g.shape) - 2
                   and [r.id for r in readers.get(g.id, [])] == [node.id] for g in (k, v)):
            continue
        axis = k.axis(pcg.mesh)
        if v.axis(pcg.mesh) != axis or q.placement.codes[axis:axis + 1] != (shard(len(q.shape) - 2),):
            continue
        causal, balanced, generated = _causal_rows(pcg, node, axis) if node.op == "attention_masked" \
            else (False, False, ())
        if node.op == "attention_masked" and pcg.node(node.inputs[3]).placement.codes[axis:axis + 1] != (shard(0),):
            continue   # the mask's rows not split with the queries on the ring's axis
        ring = RingAttention(node.id, (k.id, v.id), pcg.mesh.size(axis), causal, generated, balanced)
        found[node.id] = found[k.id] = found[v.id] = ring
    return found


def _causal_rows(pcg: PCG, node, axis: int) -> tuple[bool, bool, tuple[int, ...]]:
    """Whether masked attention's mask is the causal mask's rows split on `axis` (a `partition` of dim 0 of a
    `causal_mask`, or of its rows in zigzag order, `zigzag_mask_rows`: the balanced ring), whether they are in
    zigzag order, and the nodes a kernel makes from the offset instead: that split, and the whole mask (and the
    causal mask under its zigzag) where only such splits read it."""
    split = pcg.node(node.inputs[3])
    if split.kind != "parallel" or split.op != "partition" or int(split.attr("dim")) != 0 \
            or split.axis(pcg.mesh) != axis:
        return False, False, ()
    mask = pcg.node(split.inputs[0])
    under = zigzag_mask_rows(pcg, mask, 2 * pcg.mesh.size(axis))
    balanced = under is not None
    if not balanced and (mask.kind != "op" or mask.op != CAUSAL_MASK):
        return False, False, ()
    readers = pcg.readers_of
    if not all(r.kind == "op" and r.op == "attention_masked" for r in readers.get(split.id, [])):
        return True, balanced, ()
    made = [split.id]
    if all(r.kind == "parallel" and r.op == "partition"
           and all(u.kind == "op" and u.op == "attention_masked" for u in readers.get(r.id, []))
           for r in readers.get(mask.id, [])):
        made.append(mask.id)
        if balanced and [r.id for r in readers.get(under.id, [])] == [mask.id]:
            made.append(under.id)
    return True, balanced, tuple(made)


def zigzag_mask_rows(pcg: PCG, node, chunks: int):
    """The `causal_mask` node whose rows `node` is in zigzag order over `chunks` chunks (`zigzag` of dim 0 of a
    causal mask: the balanced ring's mask, `attention_causal_zigzag_query_parallel`), or None."""
    if node.kind != "op" or node.op != ZIGZAG or int(node.attr("dim")) != 0 or int(node.attr("g")) != chunks:
        return None
    mask = pcg.node(node.inputs[0])
    return mask if mask.kind == "op" and mask.op == CAUSAL_MASK else None


__all__ = ["CAUSAL_MASK", "RING_ATTENTION", "ZIGZAG", "RingAttention", "ring_attentions", "zigzag_mask_rows"]
