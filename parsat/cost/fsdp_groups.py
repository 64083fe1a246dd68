"""Which weights torch's FSDP2 (`replicate`, `fully_shard`) communicates together: its parameter groups.

The torch-native runtime (parsat/backend/torch_native/apply.py) applies a
plan's data parallelism as FSDP2 does it, not weight by weight:

* `replicate(module)` on the root: every weight synchronised over the data
  axes is in one group, and its gradients are all-reduced as one flat
  buffer (`chunk_cat` copy in, one all-reduce, copy out) when backward
  ends;
* `fully_shard` on each block (each child of an `nn.ModuleList`), then the
  root: a block's weights are one group, every weight outside the blocks
  the root's. A group is all-gathered in one collective before its forward
  (a copy of the shards in, one all-gather, a copy of the whole out),
  gathered again before its backward unless it is the root (FSDP2 frees a
  non-root group after forward, `reshard_after_forward`), and its
  gradients are reduce-scattered in one collective (`chunk_cat` copy in).

So the step simulator (`cost.pcg_tasks`, profile `TORCH_NATIVE`) prices
one collective per group where the interpreter runs one per weight: on
gloo the per-call latency (hundreds of microseconds) is what dominates
these small models' synchronisation. A PCG's block of a weight is its
leaf's name (`ir.blocks.block_of`: `b{i}_...`), which is how the lowering
finds the block modules it shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from parsat.dsl import parallel_ops
from parsat.dsl.parallel_ops import REPLICATE
from parsat.ir.blocks import OUTSIDE, block_of
from parsat.ir.pcg import PCG, PNode, readers, weight_storage


@dataclass(frozen=True)
class ParamGroup:
    """One FSDP2 group: the stored-at nodes of its weights, whether it is sharded (`fully_shard`: gathered and
    reduce-scattered) or replicated (`replicate`: all-reduced), and whether it is gathered again in backward."""

    key: int                     # the block (OUTSIDE: the root's group)
    members: tuple[int, ...]     # stored-at node ids (`ir.pcg.weight_storage`'s last), in the PCG's order
    sharded: bool
    reshard: bool
    sync: tuple[int, ...]        # per member, the parallel node that synchronises it (an all_gather or a replicate)


def param_groups(pcg: PCG) -> dict[int, ParamGroup]:
    """Stored-at node -> its group, for every weight FSDP2 would communicate (one read through an `all_gather`:
    ZeRO-3; one whose gradient a `replicate` synchronises: data parallelism). Weights read otherwise (split or
    whole on a tensor axis only) are in no group. With any sharded weight every group is per block
    (`fully_shard` on each block and the root); otherwise one group holds them all (`replicate` on the root)."""
    users = readers(pcg)
    found: list[tuple[int, str, PNode]] = []     # (stored-at, leaf name, the synchronising node)
    for leaf, chain in weight_storage(pcg).items():
        name = next(n.op for n in pcg.nodes if n.id == leaf)
        sync = _synchroniser(users.get(chain[-1], []))
        if sync is not None:
            found.append((chain[-1], name, sync))
    sharded = any(sync.op == parallel_ops.ALL_GATHER for _at, _name, sync in found)
    keyed: dict[int, list[tuple[int, PNode]]] = {}
    for at, name, sync in found:
        keyed.setdefault(block_of(name) if sharded else OUTSIDE, []).append((at, sync))
    out: dict[int, ParamGroup] = {}
    for key, members in keyed.items():
        group = ParamGroup(key, tuple(at for at, _s in members), sharded, sharded and key != OUTSIDE,
                           tuple(s.id for _at, s in members))
        out.update({at: group for at, _s in members})
    return out


def _synchroniser(users: list[PNode]) -> PNode | None:
    """The parallel node reading a stored weight that FSDP2 would run: its all_gather (ZeRO-3), else its
    first replicate (the gradient's all-reduce); None for a weight neither gathers nor synchronises."""
    for user in users:
        if user.kind == "parallel" and user.op == parallel_ops.ALL_GATHER:
            return user
    for user in users:
        if user.kind == "parallel" and user.op == REPLICATE:
            return user
    return None


def group_elements(group: ParamGroup, by_id: Mapping[int, PNode]) -> tuple[int, int]:
    """(elements of the group's pieces on one device, elements once gathered): equal for a replicated group."""
    pieces = sum(by_id[at].piece_size for at in group.members)
    whole = sum(by_id[s].piece_size for s in group.sync) if group.sharded else pieces
    return pieces, whole


def tensor_axes(pcg: PCG) -> set[int]:
    """The mesh axes torch's tensor-parallel styles would take: those a weight is stored split on (a partition
    on its storage chain) and read split on (no all_gather on that axis: that is ZeRO-3, `fully_shard`)."""
    users = readers(pcg)
    by_id = {n.id: n for n in pcg.nodes}
    out: set[int] = set()
    for chain in weight_storage(pcg).values():
        split = {by_id[i].axis(pcg.mesh) for i in chain[1:]}
        gathered = {u.axis(pcg.mesh) for u in users.get(chain[-1], [])
                    if u.kind == "parallel" and u.op == parallel_ops.ALL_GATHER}
        out |= split - gathered
    return out


__all__ = ["ParamGroup", "group_elements", "param_groups", "tensor_axes"]
