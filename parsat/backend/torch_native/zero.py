"""The plan's ZeRO-1 on DTensor parameters: whole gradients, the optimizer state sharded over the data ranks.

ZeRO-1 (Megatron's distributed optimizer, `PCG.zero == 1`) keeps every
rank's gradients whole, reduced by an all-reduce, and shards only the
optimizer's state: each data rank updates its 1/N of the flattened
parameters and the updated shards are all-gathered. torch's FSDP2 has no
such mode (`fully_shard` reduce-scatters the gradients: ZeRO-2), and
`torch.distributed.optim.ZeroRedundancyOptimizer` works on plain tensors,
assigning whole parameters to ranks. So the runtime lowers ZeRO-1 as
`replicate` (DDP's gradient all-reduce, parameters `Replicate()` DTensors)
plus this optimizer, which the training loop builds instead of its own:

    optimizer = zero_optimizer(model, torch.optim.AdamW, lr=1e-3)   # any plan

`ZeroOneOptimizer` wraps the user's optimizer class around one flat
parameter per dtype: a 1-D `Shard(0)` DTensor over the data mesh holding
this rank's chunk of every parameter's local values (its tensor-parallel
piece, if any) laid end to end, padded to an equal chunk per rank. The
inner optimizer's state is then `Shard(0)` DTensors too: 1/N of it on each
rank. `step` copies this rank's chunk of the whole (all-reduced, perhaps
clipped) gradients into the flat parameter's gradient, steps the inner
optimizer, all-gathers the flat parameter (`full_tensor`) and copies it
back into the module's parameters. Elementwise optimizers (SGD, Adam,
AdamW: every update reads one element's own state) give the same values as
on the whole parameters; one that reads a whole tensor (LAMB's trust
ratio, Adafactor) would not, and is not checked.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

ZERO1_MESH_ATTRIBUTE = "_parsat_zero1_mesh"


def zero_optimizer(model: nn.Module, optimizer_class: Callable[..., torch.optim.Optimizer],
                   **defaults: Any) -> torch.optim.Optimizer:
    """The optimizer the plan asks for: a `ZeroOneOptimizer` over the data mesh for a plan with ZeRO-1, else
    `optimizer_class(model.parameters(), **defaults)` (ZeRO-2 and ZeRO-3 shard the state through
    `fully_shard`'s sharded parameters already; without ZeRO every rank keeps all of it)."""
    mesh = getattr(model, ZERO1_MESH_ATTRIBUTE, None)
    if mesh is None:
        return optimizer_class(model.parameters(), **defaults)
    return ZeroOneOptimizer(model.parameters(), optimizer_class, mesh, **defaults)


class ZeroOneOptimizer(torch.optim.Optimizer):
    """`optimizer_class` run on this data rank's shard of the flattened parameters (module docstring). It is a
    `torch.optim.Optimizer` whose `param_groups` and `state` are the inner optimizer's, so LR schedulers drive
    it; `zero_grad` clears the module's gradients."""

    def __init__(self, params, optimizer_class: Callable[..., torch.optim.Optimizer], mesh, **defaults: Any):
        from torch.distributed.tensor import DTensor, Shard

        self.mesh = mesh
        size, rank = mesh.size(), mesh.get_local_rank()
        seen: dict[int, nn.Parameter] = {}
        for p in params:
            if p.requires_grad:
                seen.setdefault(id(p), p)
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in seen.values():
            by_dtype.setdefault(p.dtype, []).append(p)
        self.groups: list[tuple[list[nn.Parameter], nn.Parameter, int]] = []
        for members in by_dtype.values():
            whole = torch.cat([_local(p).detach().reshape(-1) for p in members])
            chunk = -(-whole.numel() // size)
            mine = _padded(whole, chunk * size).narrow(0, rank * chunk, chunk).clone()
            flat = nn.Parameter(DTensor.from_local(mine, mesh, [Shard(0)], run_check=False))
            self.groups.append((members, flat, whole.numel()))
        self.inner = optimizer_class([flat for _, flat, _ in self.groups], **defaults)
        super().__init__([flat for _, flat, _ in self.groups], self.inner.defaults)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """This rank's chunk of the whole gradients into the flat parameters, the inner step on them, then the
        updated chunks all-gathered and copied into the module's parameters."""
        from torch.distributed.tensor import DTensor, Shard

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        size, rank = self.mesh.size(), self.mesh.get_local_rank()
        for members, flat, total in self.groups:
            chunk = flat.to_local().numel()
            grads = torch.cat([_local(p.grad).reshape(-1) if p.grad is not None else
                               torch.zeros(_local(p).numel(), dtype=p.dtype, device=_local(p).device)
                               for p in members])
            mine = _padded(grads, chunk * size).narrow(0, rank * chunk, chunk).clone()
            flat.grad = DTensor.from_local(mine, self.mesh, [Shard(0)], run_check=False)
        self.inner.step()
        for members, flat, total in self.groups:
            whole = flat.full_tensor()[:total]
            offset = 0
            for p in members:
                local = _local(p)
                local.copy_(whole[offset:offset + local.numel()].view_as(local))
                offset += local.numel()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The module's gradients (what backward writes) and the flat parameters' cleared."""
        for members, flat, _ in self.groups:
            for p in members + [flat]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local values (a view: writing it writes the parameter), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _padded(flat: torch.Tensor, length: int) -> torch.Tensor:
    """`flat` with zeros after it up to `length`: every rank's chunk the same size (the padding's state stays 0)."""
    if flat.numel() == length:
        return flat
    return torch.cat([flat, flat.new_zeros(length - flat.numel())])
