"""Activation recomputation: which values a plan drops after forward and computes again before their backward.

Training keeps every activation backward needs from forward to backward;
for a large model on few devices that, not the weights, is what does not
fit (a GPT-175B block at 2,048 tokens keeps gigabytes of attention scores
per sequence). Megatron-LM, DeepSpeed and torchtitan all offer full
recomputation of each transformer block ("activation checkpointing"): keep
only what crosses from one block to the next, and run a block's forward
again just before its backward. It costs one more forward of every block
(and of the collectives in it) and saves every activation inside the
blocks but one block's at a time.

The policy is a property of the PCG (`PCG.recompute`), so the cost model,
the step simulator and the backend all read it from the plan, and this
module is the one place that says which nodes it covers:

* NONE: nothing is recomputed;
* BLOCKS: every node of a block (`ir.blocks.node_blocks`) that is computed
  per micro-batch (not a leaf, not on a weight's chain: a ZeRO-3 gathered
  weight is made once per step and kept) and read only inside its own
  block. What another block, the outside (the head, the loss) or the
  plan's outputs read is kept: it is the checkpoint the next recompute
  starts from.

Recomputing moves no value and changes none: the recomputed forward is
the same operators on the same kept inputs, so the gradients are the same
(`parsat run --check` compares them with one process).
"""

from __future__ import annotations

from typing import Mapping

from parsat.ir.blocks import OUTSIDE, node_blocks
from parsat.ir.pcg import PCG, weight_chains

NONE = "none"
BLOCKS = "blocks"
POLICIES = (NONE, BLOCKS)


class RecomputeError(ValueError):
    """An unknown recomputation policy."""


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise RecomputeError(f"unknown recomputation policy {policy!r} (known: {', '.join(POLICIES)})")
    return policy


def recomputed_blocks(pcg: PCG) -> dict[int, tuple[int, ...]]:
    """Block -> the ids of its nodes that `pcg.recompute` drops after forward and computes again before the
    block's backward, in topological order (empty for NONE; see the module docstring)."""
    if check_policy(pcg.recompute) == NONE:
        return {}
    blocks = node_blocks(pcg)
    chains = weight_chains(pcg)
    readers: dict[int, set[int]] = {}
    for node in pcg.nodes:
        for i in node.inputs:
            readers.setdefault(i, set()).add(blocks[node.id])
    outputs = set(pcg.outputs)
    out: dict[int, list[int]] = {}
    for node in pcg.nodes:
        block = blocks[node.id]
        if block == OUTSIDE or node.kind == "leaf" or node.id in chains or node.id in outputs:
            continue
        if readers.get(node.id, set()) <= {block}:
            out.setdefault(block, []).append(node.id)
    return {b: tuple(ids) for b, ids in out.items()}


def recomputed_nodes(pcg: PCG) -> dict[int, int]:
    """Node id -> its block, for every node `pcg.recompute` recomputes."""
    return {ident: block for block, ids in recomputed_blocks(pcg).items() for ident in ids}


def describe(policy: str, recomputed: Mapping[int, tuple[int, ...]] | None = None) -> str:
    """How `explain` says it."""
    if policy == NONE:
        return "no activation recomputation"
    count = f" ({len(recomputed)} blocks)" if recomputed else ""
    return f"full activation recomputation per block{count}: only values crossing blocks kept"


__all__ = ["BLOCKS", "NONE", "POLICIES", "RecomputeError", "check_policy", "describe", "recomputed_blocks",
           "recomputed_nodes"]
