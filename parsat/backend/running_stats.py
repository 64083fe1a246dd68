"""Batch normalization's running statistics, kept by a parallel run as torch keeps them.

A batch norm in training mode normalizes with the statistics of the batch
(the graph's `bn_mean` and `bn_var` nodes; under data parallelism the plan
all-reduces their partial sums: a synchronized batch norm) and, as a side
effect that is not part of the loss, moves its module's running statistics
towards them (`importer.imported.RunningStats`). Those buffers are what the
module uses in evaluation and what a checkpoint saves, so `parallelize`
updates them after every training forward with torch's own formula, from
the *global* batch statistics: every rank then holds the same running
statistics, equal to those of the unmodified module trained on the same
global batch (which `--check` compares).

A statistic the plan leaves spread over ranks (split by channel, or a
partial sum not yet reduced) is assembled first with one all-gather of its
pieces over the job (C values per statistic), recorded in the rank's
`CommCounter` with the tag "running_stats"; a synchronized plan holds it
whole on every rank and moves nothing.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from parsat.backend.collectives import CommCounter, CommEvent
from parsat.backend.executor import ExecutionError
from parsat.importer.imported import RunningStats
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import PCG
from parsat.ir.placement import Placement, piece_index

TAG = "running_stats"


def node_of(pcg: PCG, name: str) -> int:
    """The PCG node that computes graph node `name` whole (its `origin`), for the statistics to read."""
    found = [node.id for node in pcg if node.origin == name]
    if not found:
        raise ExecutionError(f"the plan has no node for the batch statistic '{name}' (no PCG node has it as its "
                             "origin), so the running statistics cannot be updated")
    return found[-1]


def whole_value(x: torch.Tensor, placement: Placement, shape: Sequence[int], mesh: Mesh,
                counter: CommCounter) -> torch.Tensor:
    """The logical value of a piece under any placement (no gradient): blocks put together, partial sums
    added, one copy taken. A collective over the whole job unless every rank already holds the whole value."""
    if not placement.partial_axes and not any(placement.shard_axes(d) for d in range(len(shape))):
        return x.detach()
    pieces = [torch.empty_like(x) for _ in range(mesh.world)]
    with torch.no_grad():
        dist.all_gather(pieces, x.detach().contiguous())
    counter.record(CommEvent(TAG, "forward", "all_gather", "*", mesh.world, x.numel() * mesh.world,
                             x.element_size(), tag=TAG))
    full = torch.zeros(tuple(shape), dtype=x.dtype, device=x.device)
    seen = set()
    for rank, piece in enumerate(pieces):
        coords = mesh.coords(rank)
        held = (tuple(placement.block(d, coords, mesh.shape) for d in range(len(shape))),
                placement.summand(coords, mesh.shape))
        if held in seen:        # a copy of a piece already added
            continue
        seen.add(held)
        full[piece_index(placement, shape, mesh, rank)] += piece
    return full


def update(module: torch.nn.Module, stats: Sequence[RunningStats], pcg: PCG,
           env: Mapping[int, tuple[torch.Tensor, Placement]], counter: CommCounter) -> None:
    """torch's update of every running statistic from this forward's batch statistics (call on every rank)."""
    buffers = dict(module.named_buffers())
    for stat in stats:
        values = []
        for name in (stat.mean, stat.var):
            ident = node_of(pcg, name)
            x, placement = env[ident]
            values.append(whole_value(x, placement, pcg.node(ident).shape, pcg.mesh, counter))
        mean, var = values
        running_mean, running_var = buffers[stat.running_mean], buffers[stat.running_var]
        m = stat.momentum
        with torch.no_grad():
            running_mean.mul_(1.0 - m).add_(mean.to(running_mean.dtype), alpha=m)
            unbiased = var.to(running_var.dtype) * (stat.count / (stat.count - 1))
            running_var.mul_(1.0 - m).add_(unbiased, alpha=m)
            if stat.batches_tracked is not None:
                buffers[stat.batches_tracked].add_(1)


def compared(module: torch.nn.Module, reference: torch.nn.Module, stats: Sequence[RunningStats]) -> list[tuple]:
    """--check's pairs for the running statistics: this rank's buffers against the reference module's."""
    mine, theirs = dict(module.named_buffers()), dict(reference.named_buffers())
    pairs = []
    for stat in stats:
        pairs.append((f"running_mean {stat.running_mean}", mine[stat.running_mean], theirs[stat.running_mean]))
        pairs.append((f"running_var {stat.running_var}", mine[stat.running_var], theirs[stat.running_var]))
        if stat.batches_tracked is not None:
            pairs.append((f"batches_tracked {stat.batches_tracked}", mine[stat.batches_tracked],
                          theirs[stat.batches_tracked]))
    return pairs
