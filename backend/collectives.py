"""The four parallel operators as autograd-aware collectives on process subgroups.

| op | forward | backward |
|---|---|---|
| partition | local slice | all-gather |
| combine | all-gather | local slice |
| replicate | identity (the piece is already on the free ranks) | all-reduce |
| reduce | all-reduce | identity |

Each runs among the ranks that differ only on the atoms the operator takes
or gives back (`placement.group_ranks`), which can be any degree, 3 ranks
as well as 2 or 4. DTensor's placements would cover the power-of-a-mesh
cases but not partial sums split over arbitrary atoms nor the explicit
copy/free distinction the gradient rule needs, so the collectives are
explicit `torch.distributed` calls on subgroups inside `autograd.Function`s;
every call is recorded in a `CommCounter` the caller passes in.

Counting convention (ring algorithms, elements a rank sends per call): an
all-gather of a full tensor of n elements over p ranks sends (p-1)/p * n
per rank, (p-1) * n over the group; an all-reduce of n elements sends
2(p-1)/p * n per rank, 2(p-1) * n over the group (with p = 2, 2n: the
813,056 of data-parallel MLP training, docs/ARCHITECTURE.md). Where a
tensor has fewer pieces than ranks, the ranks that differ only on its free
atoms run the same collective redundantly; `sent` counts every one of them
(what went over the wire, and what the cost model predicts: each replica
set runs its own collective, saturate/cost.py), `distinct_sent` each
distinct collective once. Events tagged `grad_sync` are the gradient
all-reduces of replicated weights (the cost model's `grad_sync_elements`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from fractions import Fraction
from typing import Sequence

import torch
import torch.distributed as dist

from parsat.dsl.parallel_ops import COMBINE, PARTITION, REPLICATE
from parsat.ir.placement import Axis, Placement, all_groups, group_ranks, mixed_radix, product


@dataclass(frozen=True)
class CommEvent:
    """One collective one rank took part in."""

    op: str          # partition | combine | replicate | reduce
    phase: str       # forward | backward
    kind: str        # all_gather | all_reduce
    group_size: int
    elements: int    # n: the gathered tensor's size, or the all-reduced tensor's size
    itemsize: int
    replicas: int = 1  # ranks running this same collective redundantly (free atoms), counted once
    tag: str = ""      # "grad_sync": the all-reduce of a replicated weight's gradient (data parallelism)

    @property
    def sent(self) -> Fraction:
        """Elements this rank sends (ring algorithm)."""
        p = self.group_size
        factor = 1 if self.kind == "all_gather" else 2
        return Fraction(factor * (p - 1) * self.elements, p)

    @property
    def sent_bytes(self) -> Fraction:
        return self.sent * self.itemsize

    @property
    def distinct_sent(self) -> Fraction:
        """`sent`, shared among the redundant replicas: summed over ranks, each distinct collective once."""
        return self.sent / self.replicas


@dataclass
class CommCounter:
    """Every collective a rank ran, in order; passed explicitly to each collective."""

    events: list[CommEvent] = field(default_factory=list)

    def record(self, event: CommEvent) -> None:
        self.events.append(event)

    def sent(self, phase: str | None = None) -> Fraction:
        return sum((e.sent for e in self.events if phase in (None, e.phase)), Fraction(0))

    def sent_bytes(self, phase: str | None = None) -> Fraction:
        return sum((e.sent_bytes for e in self.events if phase in (None, e.phase)), Fraction(0))

    def distinct_sent(self, phase: str | None = None) -> Fraction:
        return sum((e.distinct_sent for e in self.events if phase in (None, e.phase)), Fraction(0))

    def sent_tagged(self, tag: str) -> Fraction:
        """Elements sent by the collectives carrying `tag` (e.g. the gradient synchronisation)."""
        return sum((e.sent for e in self.events if e.tag == tag), Fraction(0))

    def clear(self) -> None:
        self.events.clear()

    def to_json(self) -> list[dict]:
        return [{"op": e.op, "phase": e.phase, "kind": e.kind, "group_size": e.group_size,
                 "elements": e.elements, "itemsize": e.itemsize, "replicas": e.replicas, "tag": e.tag}
                for e in self.events]


class GroupCache:
    """Process subgroups by atom set, created once and on every rank in the same order.

    `dist.new_subgroups_by_enumeration` must be called by all ranks for all
    groups; since every rank derives the same layouts from the same plan,
    they reach each atom set in the same order, so creating on first use is
    safe (and lets a plan use only the groups it needs). Subgroups get the
    job's collective timeout: torch gives a new group 30 minutes otherwise,
    so a rank that stalls would hang its peers until the job timeout.
    """

    def __init__(self, world: int, rank: int, timeout_s: float = 30.0):
        self.world = world
        self.rank = rank
        self.timeout = timedelta(seconds=timeout_s)
        self._groups: dict[tuple[Axis, ...], object] = {}

    def group(self, axes: Sequence[Axis]):
        key = tuple(sorted(axes))
        if key not in self._groups:
            enumeration = [sorted(members) for members in all_groups(key, self.world)]
            mine, _ = dist.new_subgroups_by_enumeration(enumeration, timeout=self.timeout)
            self._groups[key] = mine
        return self._groups[key]


@dataclass(frozen=True)
class Comm:
    """What a collective needs: this rank's subgroup, its members in mixed-radix order, the counter."""

    group: object
    members: tuple[int, ...]  # position t = the rank with index t along the atoms
    position: int             # this rank's t
    counter: CommCounter
    op: str
    replicas: int = 1
    tag: str = ""

    @property
    def size(self) -> int:
        return len(self.members)


def make_comm(cache: GroupCache, axes: Sequence[Axis], counter: CommCounter, op: str,
              replicas: int = 1, tag: str = "") -> Comm:
    """The `Comm` for a parallel operator over `axes`, on this rank."""
    members = group_ranks(axes, cache.rank)
    group = cache.group(axes) if len(members) > 1 else None
    return Comm(group, members, mixed_radix(axes, cache.rank), counter, op, replicas, tag)


def _all_gather(x: torch.Tensor, dim: int, comm: Comm, phase: str) -> torch.Tensor:
    x = x.contiguous()
    buffers = [torch.empty_like(x) for _ in comm.members]
    dist.all_gather(buffers, x, group=comm.group)
    by_rank = dict(zip(sorted(comm.members), buffers))
    comm.counter.record(CommEvent(comm.op, phase, "all_gather", comm.size, x.numel() * comm.size, x.element_size(),
                                  comm.replicas, comm.tag))
    return torch.cat([by_rank[r] for r in comm.members], dim=dim)


def _all_reduce(x: torch.Tensor, comm: Comm, phase: str) -> torch.Tensor:
    out = x.detach().clone().contiguous()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=comm.group)
    comm.counter.record(CommEvent(comm.op, phase, "all_reduce", comm.size, out.numel(), out.element_size(),
                                  comm.replicas, comm.tag))
    return out


def _slice(x: torch.Tensor, dim: int, comm: Comm) -> torch.Tensor:
    size = x.shape[dim] // comm.size
    return x.narrow(dim, comm.position * size, size).contiguous()


class _Partition(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _slice(x, dim, comm)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.comm, "backward"), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _all_gather(x, dim, comm, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _slice(grad, ctx.dim, ctx.comm), None, None


class _Replicate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm, "backward"), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def parallel_op(name: str, x: torch.Tensor, layout: Placement, degree: int, dim: int | None,
                cache: GroupCache, counter: CommCounter, tag: str = "") -> tuple[torch.Tensor, Placement]:
    """Apply parallel operator `name` to this rank's piece `x` of a tensor laid out as `layout`.

    Returns the new local piece and the new layout. Degree 1 is the identity
    and moves nothing. `tag` labels the collectives in the counter.
    """
    new_layout, axes = layout.apply_parallel(name, degree, dim)
    if degree == 1 or not axes:
        return x, new_layout
    # Ranks that differ only on the input's other free atoms run the same collective redundantly.
    replicas = product(a for a in layout.free if a not in axes)
    comm = make_comm(cache, axes, counter, name, replicas, tag)
    if name == PARTITION:
        return _Partition.apply(x, dim, comm), new_layout
    if name == COMBINE:
        return _Combine.apply(x, dim, comm), new_layout
    if name == REPLICATE:
        return _Replicate.apply(x, comm), new_layout
    return _Reduce.apply(x, comm), new_layout
