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
* BLOCKS: each block (`ir.blocks.node_blocks`) is a checkpoint: its nodes
  computed per micro-batch (not leaves, not a weight's chain: a ZeRO-3
  gathered weight is made once per step and kept) run in forward, and all
  of them run again before the block's backward (Megatron's and
  `torch.utils.checkpoint`'s semantics: the whole block re-runs from its
  kept inputs). Of their values only those another block, the outside
  (the head, the loss) or the plan's outputs read are kept after forward:
  what the next block's recomputation starts from.

Recomputing moves no value and changes none: the recomputed forward is
the same operators on the same kept inputs, so the gradients are the same
(`parsat run --check` compares them with one process).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Mapping

from parsat.ir.blocks import OUTSIDE, node_blocks
from parsat.ir.pcg import PCG, weight_chains

NONE = "none"
BLOCKS = "blocks"
POLICIES = (NONE, BLOCKS)
AUTO = "auto"   # a search option, not a policy: keep every activation where that fits, else recompute blocks


class RecomputeError(ValueError):
    """An unknown recomputation policy."""


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise RecomputeError(f"unknown recomputation policy {policy!r} (known: {', '.join(POLICIES)})")
    return policy


@dataclass(frozen=True)
class Checkpoint:
    """One block under recomputation: the nodes its forward runs (again before its backward), in topological
    order, and those of them whose values are kept (read outside the block, or plan outputs)."""

    block: int
    runs: tuple[int, ...]
    kept: frozenset[int]

    @property
    def dropped(self) -> tuple[int, ...]:
        """The nodes whose values are freed after forward (the activations recomputation saves)."""
        return tuple(i for i in self.runs if i not in self.kept)

    @cached_property
    def kept_at(self) -> tuple[int, ...]:
        """The places in `runs` of the kept nodes, worked out once per block (a layout's forms share their
        checkpoints, `checkpoints`): what `search.recompute.recomputed_pcg_costs` reads per block priced."""
        return tuple(k for k, i in enumerate(self.runs) if i in self.kept)


def checkpoints(pcg: PCG) -> tuple[Checkpoint, ...]:
    """The blocks `pcg.recompute` recomputes, in order (none for NONE; see the module docstring)."""
    if check_policy(pcg.recompute) == NONE:
        return ()
    return pcg.derive("block_checkpoints", None, lambda: _block_checkpoints(pcg), structural=True)


def _block_checkpoints(pcg: PCG) -> tuple[Checkpoint, ...]:
    """`checkpoints` of a PCG that recomputes blocks, worked out once per PCG (`PCG.derive`): they read its nodes
    and outputs alone, not its policy nor its ZeRO stage, so a layout's forms (`ir.pcg.restated`) share
    them; its pricing (`search.recompute.recomputed_pcg_costs`), step floor and simulation each asked again.

    A block's node is kept where it is an output or a node of another block reads it (`_crossing`); each block's
    kept nodes are those of its runs in that set. The same checkpoints as a set of reader blocks per value (whose
    sets were most of the work: a PCG's ~6,000 nodes read ~11,000 values)."""
    blocks = node_blocks(pcg)
    chains = weight_chains(pcg)
    kept = _crossing(pcg, blocks)
    kept.update(pcg.outputs)
    runs: dict[int, list[int]] = {}
    for node in pcg.nodes:
        ident = node.id
        block = blocks[ident]
        if block == OUTSIDE or node.kind == "leaf" or ident in chains:
            continue
        found = runs.get(block)
        if found is None:
            runs[block] = [ident]
        else:
            found.append(ident)
    return tuple(Checkpoint(b, tuple(ids), frozenset(kept.intersection(ids))) for b, ids in sorted(runs.items()))


def _crossing(pcg: PCG, blocks: Mapping[int, int]) -> set[int]:
    """The nodes some node of another block (or outside every block) reads: a node whose readers' blocks are not
    all its own (the readers' blocks as a set, `<= {block}`, asked no more than this)."""
    return {i for node in pcg.nodes for block in (blocks[node.id],) for i in node.inputs if blocks[i] != block}


def describe(policy: str) -> str:
    """How `explain` says it."""
    if policy == NONE:
        return "no activation recomputation"
    return "full activation recomputation per block (only values crossing blocks kept)"


__all__ = ["AUTO", "BLOCKS", "Checkpoint", "NONE", "POLICIES", "RecomputeError", "check_policy", "checkpoints",
           "describe"]
