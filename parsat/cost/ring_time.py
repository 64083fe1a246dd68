"""Ring attention's pass on its slowest rank: the one price the step simulator and extraction both read.

A rank of ring attention over p ranks holds its block of queries and meets the p key/value blocks one ring step
after another (`ir.ring_attention`). The kernel it is priced from is the dense block row: its queries against
every key, what `attention` / `attention_masked` cost on their pieces (`cost.op_time.FUSED`). How much of that row
a rank computes at each step (`ring_work`) is the only difference between the rings:

* bidirectional (`attention_query_parallel`): every step a whole block, 1/p of the row each;
* causal, contiguous blocks (`attention_causal_query_parallel`): rank i meets the i blocks before its own in full,
  its own block causally (half its scores) and skips the p - 1 - i after it, so the ranks are unbalanced and the
  pass is the last rank's: its diagonal (1/(2p)) and then p - 1 full blocks, (p - 1/2)/p of the row;
* causal, zigzag (load-balanced: Megatron-LM's context parallelism, torchtitan's): the sequence in 2p chunks,
  rank i holding query chunks i and 2p - 1 - i (and the key/value chunks alike). Each chunk meets the chunks
  before it in full and itself causally: chunk i meets i + 1/2 chunks, chunk 2p - 1 - i meets 2p - 1 - i + 1/2,
  together 2p of the rank's 2 x 2p chunk pairs, half the dense row, on every rank. Step by step it is half a
  block each: at its own block, chunk pairs (i, i) and (2p-1-i, 2p-1-i) on the diagonal (half each) and
  (2p-1-i, i) in full; at the block of a rank j < i, both query chunks against chunk j in full and neither
  against chunk 2p-1-j (after both); at the block of a rank j > i, the late query chunk against both of j's
  chunks and the early one against neither: 2 of 4 chunk pairs at every step, 1/(2p) of the row each.

The step simulator runs the pass on its streams (`cost.pcg_tasks._Builder._ring`): compute chunk i waits for the
send/recv bringing block i and for chunk i - 1; the send/recvs run back to back on the communication stream.
Extraction prices a ring-form attention's compute as `ring_compute_s` (the same chunks, summed) and its transfers
on the gathers of k and v (all-gathers, not overlapped: an upper bound of the pass, as an e-node's cost cannot
know which of its class's readers a plan picks, `search.extract`).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from parsat.ir.pcg import PCG, weight_chains
from parsat.ir.ring_attention import RingAttention, ring_attentions


def rings_run(pcg: PCG, overlap: bool) -> dict[int, RingAttention]:
    """The plan's ring attentions a profile runs as rings (`ring_attentions`: by the attention node and by each
    of its gathers): none where it does not overlap communication (`parsat run`'s interpreter all-gathers k and
    v and runs the query block's attention, priced as it runs), nor one whose k or v is a weight's gather."""
    if not overlap:
        return {}
    params = weight_chains(pcg)
    return {i: r for i, r in ring_attentions(pcg).items() if not params & set(r.gathers)}


def ring_shares(rings: Mapping[int, RingAttention], node_id: int) -> tuple[float, ...]:
    """`ring_work` of the ring whose attention is `node_id`, or () where it is none."""
    ring = rings.get(node_id)
    return ring_work(ring.parts, ring.causal, ring.balanced) if ring is not None and ring.attention == node_id else ()


def ring_work(parts: int, causal: bool, balanced: bool = False) -> tuple[float, ...]:
    """The fractions of the dense block row's kernel the slowest rank computes at each of the ring's `parts`
    steps, in order (the module docstring): bidirectional 1/p each; causal contiguous blocks the diagonal's
    1/(2p) then p - 1 full blocks; causal zigzag (`balanced`) 1/(2p) each."""
    if parts < 1:
        raise ValueError(f"a ring of {parts} ranks")
    if not causal:
        return (1.0 / parts,) * parts
    if balanced:
        return (1.0 / (2 * parts),) * parts
    return (1.0 / (2 * parts),) + (1.0 / parts,) * (parts - 1)


def ring_chunks_s(kernel_s: float, work: Sequence[float], op_time: Callable[[float], float]) -> tuple[float, ...]:
    """Each step's compute: the kernel's share `work[i]` of `kernel_s` as it runs (`op_time`: the profile's
    efficiency and launch, `OpEfficiency.op_time` with its direction)."""
    return tuple(op_time(kernel_s * share) for share in work)


def ring_compute_s(kernel_s: float, work: Sequence[float], op_time: Callable[[float], float]) -> float:
    """The slowest rank's compute over the pass (the chunks summed, no transfer): what extraction charges a
    ring-form attention's e-node."""
    return sum(ring_chunks_s(kernel_s, work, op_time))


__all__ = ["ring_chunks_s", "ring_compute_s", "ring_shares", "ring_work", "rings_run"]
