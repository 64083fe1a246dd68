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

Not priced as a ring: causal attention (its sequence split is not proven: docs/MESH.md, "Ring attention"), a
gather that another node also reads, and a weight's gather.
"""

from __future__ import annotations

from dataclasses import dataclass

from parsat.dsl import parallel_ops
from parsat.ir.pcg import PCG
from parsat.ir.placement import shard

RING_ATTENTION = frozenset({"attention"})
"""The fused attention operators a ring runs: bidirectional attention, whose query split is proven
(`attention_query_parallel`); causal attention's needs global positions the verifier does not give a block."""


@dataclass(frozen=True)
class RingAttention:
    """A fused attention run as a ring over `parts` ranks: its node, and the all-gathers of its k and v."""

    attention: int
    gathers: tuple[int, int]
    parts: int


def ring_attentions(pcg: PCG) -> dict[int, RingAttention]:
    """The plan's ring attentions, by the attention node and by each of its two gathers: a `RING_ATTENTION` node
    whose q is split along its sequence (dim -2) on a mesh axis and whose k and v are `all_gather`s along their
    sequence on the same axis that it alone reads."""
    by_id = {n.id: n for n in pcg.nodes}
    readers = pcg.readers_of
    found: dict[int, RingAttention] = {}
    for node in pcg.nodes:
        if node.kind != "op" or node.op not in RING_ATTENTION:
            continue
        q, k, v = (by_id[i] for i in node.inputs[:3])
        if not all(g.kind == "parallel" and g.op == parallel_ops.ALL_GATHER and int(g.attr("dim")) == len(g.shape) - 2
                   and [r.id for r in readers.get(g.id, [])] == [node.id] for g in (k, v)):
            continue
        axis = k.axis(pcg.mesh)
        if v.axis(pcg.mesh) != axis or q.placement.codes[axis:axis + 1] != (shard(len(q.shape) - 2),):
            continue
        ring = RingAttention(node.id, (k.id, v.id), pcg.mesh.size(axis))
        found[node.id] = found[k.id] = found[v.id] = ring
    return found


__all__ = ["RING_ATTENTION", "RingAttention", "ring_attentions"]
