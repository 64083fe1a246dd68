"""The parallel operators as collectives on the process groups of one mesh axis, in one table.

Every parallel operator of a plan acts on one mesh axis (docs/MESH.md): it
runs among the ranks that differ only on that axis (`Mesh.group`), which is
one process group per group of each axis. `MeshGroups` builds them all, on
every rank in the same order as torch requires, as a
`torch.distributed.DeviceMesh` over `arange(world).reshape(sizes)` (the
plan's mesh is exactly that), with the job's collective timeout (torch
gives a new group 30 minutes otherwise, so a rank that stalls would hang
its peers until the job timeout).

The operators are rows of `PARALLEL_TABLE`: a forward and a backward
collective; the placement effect is `ir.placement.apply_parallel` (which
also knows the fused rows as the composition of their steps):

| op | on its axis | forward | backward |
|---|---|---|---|
| partition | free -> Shard(d) | local slice | all-gather |
| combine | Shard(d) -> free | all-gather | local slice |
| replicate | free -> replica | identity (the piece is already there) | all-reduce |
| reduce | partial -> free | all-reduce | identity |
| reduce_scatter | partial -> Shard(d) | reduce-scatter | all-gather |
| all_gather | Shard(d) -> replica | all-gather | reduce-scatter |
| all_to_all | Shard(d) -> Shard(e) | all-to-all | all-to-all back (e -> d) |

One `autograd.Function` runs any row, so a new fused operator is one more
row. A local slice takes block `coord(axis)` of the local piece along d:
the piece is already cut by the axes before this one that shard d, and an
operator on a dim that a later axis shards is refused by the placement
algebra, so nested blocks stay in mesh order (earlier axis major).

Counting convention (ring algorithms, elements a rank sends per call,
docs/plan-schema.md): an all-gather whose result has n elements over p
ranks sends (p-1)/p * n per rank, (p-1) * n over the group; a
reduce-scatter of n elements the same; an all-reduce of n elements
2(p-1)/p * n per rank, 2(p-1) * n over the group. Every group of the axis
runs its own collective, so summed over all ranks a collective on an axis
of size p moves world/p times the group's figure: what the cost model
predicts. Ranks that differ only on axes where the input is free run the
same collective redundantly; `sent` counts every one of them (what went
over the wire), `distinct_sent` each distinct collective once. Each event
records its axis (`CommCounter.by_axis`). Events tagged `grad_sync` are the
gradient reductions of weights (the cost model's `grad_sync_elements`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from fractions import Fraction
from math import prod
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from parsat.dsl.parallel_ops import ALL_GATHER, ALL_TO_ALL, COMBINE, PARTITION, REDUCE, REDUCE_SCATTER, REPLICATE
from parsat.ir.mesh import Mesh
from parsat.ir.placement import FREE, Placement, apply_parallel

# The collectives (and the two local steps) a parallel operator runs in one direction.
SLICE, IDENTITY = "slice", "identity"
ALL_GATHER_KIND, ALL_REDUCE_KIND, REDUCE_SCATTER_KIND = "all_gather", "all_reduce", "reduce_scatter"
ALL_TO_ALL_KIND, ALL_TO_ALL_BACK = "all_to_all", "all_to_all_back"   # the backward moves the shard back
GRAD_SYNC = "grad_sync"
PIPELINE_AXIS = "pipeline_stage"   # the DeviceMesh axis of a pipelined plan's stages (never a plan's mesh axis)


class CollectiveError(RuntimeError):
    """Process groups that are not the mesh's (a job of another size, a group with other members)."""


@dataclass(frozen=True)
class CommEvent:
    """One collective one rank took part in."""

    op: str          # the parallel operator (a PARALLEL_TABLE row)
    phase: str       # forward | backward
    kind: str        # all_gather | all_reduce | reduce_scatter | all_to_all
    axis: str        # the mesh axis it ran on
    group_size: int
    elements: int    # n: the gathered result's size, the reduce-scattered input's size, the all-reduced size, or
                     # the all-to-all's buffer on one rank (of which it sends (p-1)/p)
    itemsize: int
    replicas: int = 1  # ranks running this same collective redundantly (the input is free on their axes)
    tag: str = ""      # GRAD_SYNC: the reduction of a weight's gradient

    @property
    def sent(self) -> Fraction:
        """Elements this rank sends (ring algorithm)."""
        p = self.group_size
        factor = 2 if self.kind == ALL_REDUCE_KIND else 1
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

    def _sum(self, value: Callable[[CommEvent], Fraction], phase: str | None, axis: str | None) -> Fraction:
        return sum((value(e) for e in self.events if phase in (None, e.phase) and axis in (None, e.axis)),
                   Fraction(0))

    def sent(self, phase: str | None = None, axis: str | None = None) -> Fraction:
        return self._sum(lambda e: e.sent, phase, axis)

    def sent_bytes(self, phase: str | None = None, axis: str | None = None) -> Fraction:
        return self._sum(lambda e: e.sent_bytes, phase, axis)

    def distinct_sent(self, phase: str | None = None, axis: str | None = None) -> Fraction:
        return self._sum(lambda e: e.distinct_sent, phase, axis)

    def sent_tagged(self, tag: str) -> Fraction:
        """Elements sent by the collectives carrying `tag` (e.g. the gradient synchronisation)."""
        return sum((e.sent for e in self.events if e.tag == tag), Fraction(0))

    def by_axis(self) -> dict[str, Fraction]:
        """Elements sent per mesh axis, in the order the axes were first used."""
        out: dict[str, Fraction] = {}
        for e in self.events:
            out[e.axis] = out.get(e.axis, Fraction(0)) + e.sent
        return out

    def clear(self) -> None:
        self.events.clear()

    def to_json(self) -> list[dict]:
        return [{"op": e.op, "phase": e.phase, "kind": e.kind, "axis": e.axis, "group_size": e.group_size,
                 "elements": e.elements, "itemsize": e.itemsize, "replicas": e.replicas, "tag": e.tag}
                for e in self.events]


# ------------------------------------------------------------------ process groups


def _group_options(backend: str, timeout: timedelta):
    """Options that carry the timeout to every group DeviceMesh creates (its `backend_override`). NCCL insists on
    its own options type (also in a default group of several backends, "cpu:gloo,cuda:nccl"); gloo only reads
    the timeout."""
    if "nccl" in backend:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    from torch._C._distributed_c10d import Backend as C10dBackend  # the type DeviceMesh's backend_override takes

    return C10dBackend.Options("gloo", timeout)


class MeshGroups:
    """This rank's process group on every axis of `mesh`, built once per job on every rank.

    A `DeviceMesh` over the ranks `arange(world).reshape(sizes)` creates
    every group of every axis on every rank in one order (torch requires
    that); its group on each axis is checked to hold exactly `Mesh.group`'s
    ranks, in coordinate order (group rank t = coordinate t), which is what
    the slices and gathers below assume. A mesh of one rank needs no group.

    A pipelined plan runs `stages` copies of the mesh side by side (stage s
    on the global ranks s * world ... s * world + world - 1, `ir.pipeline`):
    the DeviceMesh then has a leading pipeline axis, each rank gets its own
    stage's groups, and `rank` here is its rank within the stage (what
    pieces and coordinates are computed from).
    """

    def __init__(self, mesh: Mesh, rank: int, device: torch.device, timeout_s: float = 30.0, stages: int = 1):
        self.mesh, self.rank = mesh, rank % mesh.world
        self.device_mesh = None
        self._groups: dict[int, object] = {}
        if mesh.world == 1:
            return
        if not dist.is_initialized() or dist.get_world_size() != stages * mesh.world:
            have = dist.get_world_size() if dist.is_initialized() else "no process group"
            what = f"{stages} stages of the mesh {mesh}" if stages > 1 else f"the mesh {mesh}"
            raise CollectiveError(f"{what} need {stages * mesh.world} ranks, the job has {have}")
        from torch.distributed.device_mesh import DeviceMesh

        options = _group_options(dist.get_backend(), timedelta(seconds=timeout_s))
        shape, names = tuple(mesh.shape), tuple(mesh.names)
        if stages > 1:
            if PIPELINE_AXIS in names:
                raise CollectiveError(f"a mesh axis may not be named '{PIPELINE_AXIS}' (the pipeline's own axis)")
            shape, names = (stages, *shape), (PIPELINE_AXIS, *names)
        self.device_mesh = DeviceMesh(device.type, torch.arange(prod(shape)).reshape(shape), mesh_dim_names=names,
                                      backend_override=tuple((None, options) for _ in shape))
        first = rank - self.rank   # the stage's first global rank
        for axis, spec in enumerate(mesh):
            group = self.device_mesh.get_group(spec.name)
            members = tuple(dist.get_process_group_ranks(group))
            if members != tuple(first + r for r in mesh.group(axis, self.rank)):
                raise CollectiveError(f"DeviceMesh's group on axis '{spec.name}' holds ranks {members}, the mesh "
                                      f"says {mesh.group(axis, self.rank)} (from rank {first})")
            self._groups[axis] = group

    def group(self, axis: int):
        """This rank's process group on `axis`."""
        return self._groups[axis]


# ------------------------------------------------------------------ the collectives


@dataclass(frozen=True)
class Comm:
    """What a collective needs: this rank's group on the axis, its coordinate there, the counter."""

    group: object
    size: int        # the axis's size p
    position: int    # this rank's coordinate on the axis (its rank in the group)
    counter: CommCounter
    op: str
    axis: str
    replicas: int = 1
    tag: str = ""    # labels the backward collective only (the gradient's reduction)

    def record(self, phase: str, kind: str, elements: int, like: torch.Tensor) -> None:
        self.counter.record(CommEvent(self.op, phase, kind, self.axis, self.size, elements, like.element_size(),
                                      self.replicas, self.tag if phase == "backward" else ""))


def _slice(x: torch.Tensor, dim: int, comm: Comm, phase: str) -> torch.Tensor:
    size = x.shape[dim] // comm.size
    return x.narrow(dim, comm.position * size, size).contiguous()


def _identity(x: torch.Tensor, dim: int | None, comm: Comm, phase: str) -> torch.Tensor:
    return x.view_as(x)


def _all_gather(x: torch.Tensor, dim: int, comm: Comm, phase: str) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(comm.size)]
    dist.all_gather(parts, x, group=comm.group)
    comm.record(phase, ALL_GATHER_KIND, x.numel() * comm.size, x)
    return torch.cat(parts, dim=dim)


def _all_reduce(x: torch.Tensor, dim: int | None, comm: Comm, phase: str) -> torch.Tensor:
    out = x.detach().clone().contiguous()  # never in place: x may be saved for another node's backward
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=comm.group)
    comm.record(phase, ALL_REDUCE_KIND, out.numel(), out)
    return out


def _reduce_scatter(x: torch.Tensor, dim: int, comm: Comm, phase: str) -> torch.Tensor:
    size = x.shape[dim] // comm.size
    parts = [x.narrow(dim, t * size, size).contiguous() for t in range(comm.size)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=comm.group)
    comm.record(phase, REDUCE_SCATTER_KIND, x.numel(), x)
    return out


def _all_to_all(x: torch.Tensor, dims: tuple[int, int], comm: Comm, phase: str) -> torch.Tensor:
    """`x`, this rank's block of dim `dims[0]` (whole along `dims[1]` on this axis), becomes its block of
    `dims[1]` (whole along `dims[0]`): block j of dims[1] is sent to rank j, and the blocks received are
    concatenated along dims[0] in rank order (one `all_to_all_single` of the blocks stacked)."""
    src, dst = dims
    send = torch.stack(x.chunk(comm.size, dim=dst)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=comm.group)
    comm.record(phase, ALL_TO_ALL_KIND, x.numel(), x)
    return torch.cat(received.unbind(0), dim=src)


def _all_to_all_back(x: torch.Tensor, dims: tuple[int, int], comm: Comm, phase: str) -> torch.Tensor:
    """The adjoint of `_all_to_all` with the same dims: the shard moved back from dims[1] to dims[0]."""
    return _all_to_all(x, (dims[1], dims[0]), comm, phase)


COLLECTIVES: Mapping[str, Callable[[torch.Tensor, int | None, Comm, str], torch.Tensor]] = {
    SLICE: _slice, IDENTITY: _identity, ALL_GATHER_KIND: _all_gather, ALL_REDUCE_KIND: _all_reduce,
    REDUCE_SCATTER_KIND: _reduce_scatter, ALL_TO_ALL_KIND: _all_to_all, ALL_TO_ALL_BACK: _all_to_all_back,
}


@dataclass(frozen=True)
class ParallelRow:
    """A parallel operator: the collective it runs forward and the one its backward runs (each the other's
    adjoint); its placement effect is `ir.placement.apply_parallel` of the same name."""

    name: str
    forward: str
    backward: str


PARALLEL_TABLE: Mapping[str, ParallelRow] = {row.name: row for row in (
    ParallelRow(PARTITION, SLICE, ALL_GATHER_KIND),
    ParallelRow(COMBINE, ALL_GATHER_KIND, SLICE),
    ParallelRow(REPLICATE, IDENTITY, ALL_REDUCE_KIND),
    ParallelRow(REDUCE, ALL_REDUCE_KIND, IDENTITY),
    ParallelRow(REDUCE_SCATTER, REDUCE_SCATTER_KIND, ALL_GATHER_KIND),
    ParallelRow(ALL_GATHER, ALL_GATHER_KIND, REDUCE_SCATTER_KIND),
    ParallelRow(ALL_TO_ALL, ALL_TO_ALL_KIND, ALL_TO_ALL_BACK),
)}


class _Parallel(torch.autograd.Function):
    """Any row of PARALLEL_TABLE: its forward collective, and its backward collective on the gradient."""

    @staticmethod
    def forward(ctx, x, row: ParallelRow, dim: int | None, comm: Comm):
        ctx.row, ctx.dim, ctx.comm = row, dim, comm
        return COLLECTIVES[row.forward](x, dim, comm, "forward")

    @staticmethod
    def backward(ctx, grad):
        return COLLECTIVES[ctx.row.backward](grad, ctx.dim, ctx.comm, "backward"), None, None, None


def parallel_op(name: str, x: torch.Tensor, placement: Placement, axis: int, dim: int | None,
                groups: MeshGroups, counter: CommCounter, tag: str = "",
                deferred: bool = False, to_dim: int | None = None) -> tuple[torch.Tensor, Placement]:
    """Apply parallel operator `name` on mesh `axis` to this rank's piece `x` of a tensor placed as `placement`.

    Returns the new local piece and placement (PlacementError if the
    operator does not apply). An axis of size 1 moves nothing. `tag`
    labels its backward collective in the counter (GRAD_SYNC: the reduction
    of a weight's gradient). `deferred` (a ZeRO weight's replicate,
    `state_shards`): its backward runs no collective, the step's end
    reduce-scatters the gradient instead. `to_dim`: all_to_all's second dim (its collectives take both).
    """
    if name not in PARALLEL_TABLE:
        raise KeyError(f"'{name}' is not a parallel operator ({', '.join(PARALLEL_TABLE)})")
    mesh = groups.mesh
    after = apply_parallel(placement, name, axis, dim, to_dim)
    size = mesh.size(axis)
    if size == 1:
        return x, after
    replicas = prod(mesh.size(b) for b, code in enumerate(placement.codes) if b != axis and code == FREE)
    comm = Comm(groups.group(axis), size, mesh.coord(groups.rank, axis), counter, name, mesh.names[axis],
                replicas, tag)
    row = ParallelRow(name, IDENTITY, IDENTITY) if deferred and name == REPLICATE else PARALLEL_TABLE[name]
    return _Parallel.apply(x, row, dim if to_dim is None else (dim, to_dim), comm), after
