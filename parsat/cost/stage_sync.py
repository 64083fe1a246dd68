"""A pipeline stage's gradient synchronisation priced in buckets, as the frameworks run it.

The per-node costs a pipelined plan is priced from (`cost.pipeline`) price
each weight's gradient reduction as a collective of its own: every weight
pays a launch and the group's latency (a ring reduce-scatter over 48 ranks
across nodes: 47 steps of 5 us), which on a stage of hundreds of weights is
hundreds of milliseconds no framework spends. DDP and Megatron-LM put the
gradients into buckets (`comm.bucket_caps`; the step simulator's
`schedules.GradientBuckets` does the same for an unstaged plan) and run one
collective per bucket. This module finds a stage plan's weight reductions
(every `replicate` on a weight's chain: its backward all-reduces the
gradient; under ZeRO-1 the synchronising one reduce-scatters it and
all-gathers the updated shard after the optimizer) and prices a chunk's in
buckets, per group and kind, in the order they are given. ZeRO-2 (a
reduce-scatter per micro-batch) and ZeRO-3 gathers keep their per-node
prices.

Under ZeRO-1 and 2, where the profile overlaps them (Megatron-Core's
`overlap_param_gather`, `pcg_tasks.ExecutionProfile`), the all-gathers of
the updated shards run during the next step's forward, bucket by bucket
(`weight_gathers`, `gather_buckets`): `cost.pipeline` charges each chunk's
first forward the wait its first layers cannot hide
(`schedules.prefetch_delay`), as the step simulator does for an unstaged
plan (`schedules.ParamGathers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from parsat.dsl.parallel_ops import REPLICATE
from parsat.ir.machine import Machine
from parsat.ir.pcg import PCG, PNode, state_shardings
from parsat.ir.plan import Plan
from parsat.cost.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, GroupTopology, price
from parsat.cost.schedules import Gradient, assign_buckets

SHARDING_STAGES = (1, 2)   # ZeRO stages whose updated shards are all-gathered into the weight after the update


@dataclass(frozen=True)
class Reduction:
    """One weight's gradient reduction on a stage: how it is run and what the per-node costs charged for it."""

    node: int                  # the replicate
    kind: str                  # ALL_REDUCE, or REDUCE_SCATTER under ZeRO-1 (then an ALL_GATHER after the update)
    group: GroupTopology
    nbytes: int                # the gradient piece reduced, in the compute dtype (as the per-node costs count it)
    per_node_s: float          # what the per-node cost charged: the reduction and, under ZeRO-1, the gather


def weight_reductions(plan: Plan) -> dict[int, Reduction]:
    """Replicate node -> its gradient reduction, for every replicate on a weight's chain that reduces a
    gradient (`NodeCost.grad_reduce_s` > 0). None under ZeRO-2: its reduce-scatters run per micro-batch."""
    pcg, costs = plan.pcg, plan.costs
    if pcg.zero == 2:
        return {}
    sharded = set(state_shardings(pcg).values()) if pcg.zero == 1 else set()
    by_id = {n.id: n for n in pcg.nodes}
    groups: dict[tuple, GroupTopology] = {}
    dtype = plan.machine.dtype_bytes
    out = {}
    for node in pcg.nodes:
        cost = costs.get(node.id)
        if node.kind != "parallel" or node.op != REPLICATE or cost is None or not cost.weight_chain:
            continue
        if cost.grad_reduce_s <= 0:
            continue
        kind = REDUCE_SCATTER if node.id in sharded else ALL_REDUCE
        nbytes = by_id[node.inputs[0]].piece_size * dtype
        out[node.id] = Reduction(node.id, kind, _axis_group(pcg, node, groups), nbytes, cost.comm_s)
    return out


def _axis_group(pcg: PCG, node: PNode, groups: dict[tuple, GroupTopology]) -> GroupTopology:
    """The group of parallel `node`'s axis (`GroupTopology.of_axis`), worked out once per distinct `attrs` and kept
    in `groups` (the caller's, for one PCG). Why the same group: a node's axis is one of its attributes read on
    the PCG's mesh (`PNode.axis`), and the group is a function of the mesh and the axis alone; a stage plan of
    llama-70b holds ~1,000 replicates of a few attribute tuples, and each asked built a dict of its attributes
    and the mesh's group."""
    found = groups.get(node.attrs)
    if found is None:
        found = groups[node.attrs] = GroupTopology.of_axis(pcg.mesh, node.axis(pcg.mesh))
    return found


def bucketed_seconds(reductions: Iterable[Reduction], machine: Machine) -> tuple[float, float]:
    """(seconds reducing, seconds after the optimizer) of `reductions` run in buckets of `comm.bucket_caps` (DDP's
    bytes, or Megatron-Core's elements per rank), one bucket sequence per group and kind, as DDP assigns them; under
    ZeRO-1 each reduce-scattered bucket's updated shards are all-gathered after the update, bucket by bucket."""
    by_group: dict[tuple[str, GroupTopology], list[Reduction]] = {}
    for r in reductions:
        by_group.setdefault((r.kind, r.group), []).append(r)
    reducing = after = 0.0
    comm = machine.comm
    seconds = _Seconds(machine)
    for (kind, group), found in by_group.items():
        gradients = [Gradient(str(r.node), r.nbytes) for r in found]
        for bucket in assign_buckets(gradients, *comm.bucket_caps(group.size, machine.dtype_bytes)):
            nbytes = sum(g.nbytes for g in bucket)
            reducing += seconds(kind, group, nbytes)
            if kind == REDUCE_SCATTER:
                after += seconds(ALL_GATHER, group, nbytes)
    return reducing, after


class _Seconds(dict):
    """`price(kind, group, nbytes, machine).seconds` for one machine, worked out once per (kind, group, bytes): a
    pure function of those (`cost.collectives.price`), and a stage's buckets are cut by a fixed cap from alike
    blocks' alike weights, so most of them hold the same bytes (llama-70b:64: ~60 buckets a call, a few sizes).
    The same float for the same key, so every sum adds the same values in the same order."""

    def __init__(self, machine: Machine):
        super().__init__()
        self.machine = machine

    def __call__(self, kind: str, group: GroupTopology, nbytes: int) -> float:
        key = (kind, group, nbytes)
        found = self.get(key)
        if found is None:
            found = self[key] = price(kind, group, nbytes, self.machine).seconds
        return found


def weight_gathers(plan: Plan) -> dict[int, Reduction]:
    """Replicate node -> the all-gather of its weight's updated shards, for every weight whose state ZeRO-1 or 2
    shards (`ir.pcg.state_shardings`): kind ALL_GATHER, the weight's piece in the compute dtype, and what the
    per-node cost charged for it after the update (`NodeCost.comm_s` less `grad_reduce_s`). None otherwise."""
    pcg, costs = plan.pcg, plan.costs
    if pcg.zero not in SHARDING_STAGES:
        return {}
    by_id = {n.id: n for n in pcg.nodes}
    groups: dict[tuple, GroupTopology] = {}
    dtype = plan.machine.dtype_bytes
    out = {}
    for replicate in sorted(set(state_shardings(pcg).values())):
        cost = costs.get(replicate)
        if cost is None or not cost.weight_chain:
            continue
        node = by_id[replicate]
        nbytes = by_id[node.inputs[0]].piece_size * dtype
        out[replicate] = Reduction(replicate, ALL_GATHER, _axis_group(pcg, node, groups), nbytes,
                                   cost.comm_s - cost.grad_reduce_s)
    return out


def gather_buckets(gathers: Sequence[Reduction], machine: Machine
                   ) -> dict[GroupTopology, list[tuple[tuple[int, ...], float]]]:
    """`gathers` (in forward order) in the buckets Megatron gathers them in: per group (one link each: the groups'
    gathers run at once), the gradient buckets (`assign_buckets` over the weights in reverse order, as backward
    fills them) in forward order, each as (its replicate nodes, the seconds of its all-gather)."""
    by_group: dict[GroupTopology, list[Reduction]] = {}
    for g in gathers:
        by_group.setdefault(g.group, []).append(g)
    comm = machine.comm
    seconds = _Seconds(machine)
    out = {}
    for group, found in by_group.items():
        backward = [Gradient(str(g.node), g.nbytes) for g in reversed(found)]
        out[group] = [(tuple(int(g.name) for g in reversed(bucket)),
                       seconds(ALL_GATHER, group, sum(g.nbytes for g in bucket)))
                      for bucket in reversed(assign_buckets(backward, *comm.bucket_caps(group.size,
                                                                                         machine.dtype_bytes)))]
    return out
