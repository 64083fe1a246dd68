"""ZeRO stages 1 and 2 as the backend runs them: a weight's optimizer state sharded over its replicas.

A plan with `PCG.zero` 1 or 2 shards the state of every weight whose
gradient a `replicate` synchronises (`ir.pcg.state_shardings`) over that
replicate's devices, as the cost model prices it (`cost.model.shards_state`)
and as Megatron-LM's distributed optimizer runs it:

* the replicate runs no collective in backward (`collectives.parallel_op`
  with `deferred`): each rank's gradient stays its own until the step ends;
* the gradient, flattened and padded to a multiple of the group's size, is
  reduce-scattered: each rank gets the sum of its 1/p of it (tagged as the
  gradient synchronisation);
* the optimizer updates that shard only, so its moments are 1/p of the
  weight's (and the whole gradient is dropped: stage 2 keeps only the
  shard; stage 1, which Megatron holds in a whole buffer, is run the same
  here, since the backend keeps no gradient buffer between steps);
* the updated shards are all-gathered into the weight.

Reduce-scatter plus all-gather sends what a ring all-reduce sends. With
several micro-batches the accumulated gradient is reduce-scattered once
(stage 1); stage 2 would reduce-scatter every micro-batch's, which the
backend does not run, so such a plan is refused (`check_runnable`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from math import prod

import torch
import torch.distributed as dist

from parsat.backend.collectives import ALL_GATHER_KIND, GRAD_SYNC, REDUCE_SCATTER_KIND, CommCounter, CommEvent
from parsat.ir.pcg import PCG, state_shardings
from parsat.ir.placement import FREE


class ShardingError(Exception):
    """A ZeRO plan the backend does not run as the cost model prices it."""


def check_runnable(pcg: PCG, microbatches: int) -> None:
    """Refuse a ZeRO-2 plan over several micro-batches (see the module docstring)."""
    if pcg.zero == 2 and microbatches > 1 and state_shardings(pcg):
        raise ShardingError(f"a ZeRO-2 plan with {microbatches} micro-batches reduce-scatters every micro-batch's "
                            "gradient, which the backend does not run; optimize with --degrees zero=1 (the "
                            "accumulated gradient reduce-scattered once a step)")


@dataclass
class Shard:
    """This rank's shard of one weight: the flat slice it updates (its own tensor, with its gradient's sum)."""

    name: str
    weight: torch.Tensor      # the stored weight, whole on this rank
    tensor: torch.Tensor      # this rank's flat slice of it (padded to `chunk`)
    group: object
    size: int                 # the replicate's devices p
    position: int             # this rank's coordinate among them
    axis: str
    replicas: int             # ranks running this same collective redundantly (the weight is free on their axes)

    @property
    def chunk(self) -> int:
        return self.tensor.numel()

    def _record(self, counter: CommCounter, kind: str) -> None:
        counter.record(CommEvent("replicate", "backward", kind, self.axis, self.size, self.chunk * self.size,
                                 self.tensor.element_size(), self.replicas, GRAD_SYNC))

    def padded(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` with zeros after it up to `size` whole chunks."""
        return torch.nn.functional.pad(flat, (0, self.chunk * self.size - flat.numel()))

    def reduce(self, counter: CommCounter) -> None:
        """This shard's gradient: the sum over the replicas of their gradients' slices (reduce-scatter)."""
        grad = self.weight.grad
        flat = grad.detach().reshape(-1) if grad is not None else torch.zeros(self.weight.numel(),
                                                                             dtype=self.tensor.dtype,
                                                                             device=self.tensor.device)
        parts = list(self.padded(flat).contiguous().split(self.chunk))
        out = torch.empty_like(self.tensor)
        dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=self.group)
        self._record(counter, REDUCE_SCATTER_KIND)
        self.tensor.grad = out
        self.weight.grad = None   # only the shard's sum is kept

    def gather(self, counter: CommCounter) -> None:
        """The updated shards all-gathered into the weight."""
        parts = [torch.empty_like(self.tensor) for _ in range(self.size)]
        dist.all_gather(parts, self.tensor.detach().contiguous(), group=self.group)
        self._record(counter, ALL_GATHER_KIND)
        with torch.no_grad():
            self.weight.copy_(torch.cat(parts)[:self.weight.numel()].view_as(self.weight))

    def expected_gradient(self, whole_piece: torch.Tensor) -> torch.Tensor:
        """This shard's part of a reference gradient of the stored piece (for `--check`)."""
        flat = self.padded(whole_piece.reshape(-1))
        return flat[self.position * self.chunk:(self.position + 1) * self.chunk]


class StateShards:
    """The shards of one rank's ZeRO weights, by stored-at node, and the tensors its optimizer updates."""

    def __init__(self, program) -> None:
        pcg, mesh = program.pcg, program.pcg.mesh
        self.shards: dict[int, Shard] = {}
        self.replicates: frozenset[int] = frozenset()   # the replicates whose backward collective is deferred
        if not pcg.zero:
            return
        by_id = {n.id: n for n in pcg.nodes}
        for at, replicate in state_shardings(pcg).items():
            if at not in program.params or not program.computes(replicate):
                continue
            axis = by_id[replicate].axis(mesh)
            p = mesh.size(axis)
            if p == 1:
                continue
            param = program.params[at]
            position = mesh.coord(program.groups.rank, axis)
            chunk = math.ceil(param.tensor.numel() / p)
            flat = torch.nn.functional.pad(param.tensor.detach().reshape(-1), (0, chunk * p - param.tensor.numel()))
            mine = flat[position * chunk:(position + 1) * chunk].clone()
            replicas = prod(mesh.size(b) for b, code in enumerate(param.placement.codes) if b != axis and code == FREE)
            self.shards[at] = Shard(param.name, param.tensor, mine, program.groups.group(axis), p, position,
                                    mesh.names[axis], replicas)
        self.replicates = frozenset(r for at, r in state_shardings(pcg).items() if at in self.shards)

    def optimized(self, params: dict) -> list[torch.Tensor]:
        """What the optimizer updates: each weight, or in a ZeRO weight's place its shard."""
        return [self.shards[at].tensor if at in self.shards else p.tensor for at, p in params.items()]

    def reduce(self, counter: CommCounter) -> None:
        for at in sorted(self.shards):
            self.shards[at].reduce(counter)

    def gather(self, counter: CommCounter) -> None:
        for at in sorted(self.shards):
            self.shards[at].gather(counter)
