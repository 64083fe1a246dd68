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
rank. `step` copies this rank's chunk of the parameters' current values into the
flat parameter (weights loaded or set since the last step are what it
updates) and of the whole (all-reduced, perhaps clipped) gradients into the
flat parameter's gradient, steps the inner
optimizer, all-gathers the flat parameter (`full_tensor`) and copies it
back into the module's parameters. Elementwise optimizers (SGD, Adam,
AdamW: every update reads one element's own state) give the same values as
on the whole parameters; one that reads a whole tensor (LAMB's trust
ratio, Adafactor) would not, and is not checked.

Checkpoints: `state_dict()` gives each flat parameter's state as a 1-D
`Shard(0)` DTensor of the unpadded length (this rank's chunk without the
padding, a view of the state: `dcp.load` writes into it), which is how
torch's even sharding lays the same chunks out (`torch.chunk`'s sizes), so
`torch.distributed.checkpoint` saves it once and loads it on another
number of data ranks, resharded, as Megatron's distributed optimizer
checkpoints its flattened ranges. The layout (each flat parameter's
members' sizes, in order) is saved beside it and checked on load. Beside a
tensor axis each tensor-parallel rank holds other flat parameters (its own
pieces of the weights): their state and layout are keyed by the rank's
coordinate on the axes beside the data axes (`tp=1`), so a checkpoint
loads on another data-parallel degree with the same tensor-parallel one.
`parameter_state_dict()` gives the state keyed by parameter name instead,
each moment shaped and placed as its parameter (torch's
`get_optimizer_state_dict` form): its checkpoint loads on another
tensor-parallel degree too, or into a plain optimizer of the unmodified
module, at the price of gathering each moment whole over the data ranks
while it is saved or loaded.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

ZERO1_MESH_ATTRIBUTE = "_parsat_zero1_mesh"
ZERO1_BESIDE_ATTRIBUTE = "_parsat_zero1_beside"   # this rank's coordinate on the mesh axes beside the data axes


def zero_optimizer(model: nn.Module, optimizer_class: Callable[..., torch.optim.Optimizer],
                   **defaults: Any) -> torch.optim.Optimizer:
    """The optimizer the plan asks for: a `ZeroOneOptimizer` over the data mesh for a plan with ZeRO-1, else
    `optimizer_class(model.parameters(), **defaults)` (ZeRO-2 and ZeRO-3 shard the state through
    `fully_shard`'s sharded parameters already; without ZeRO every rank keeps all of it)."""
    mesh = getattr(model, ZERO1_MESH_ATTRIBUTE, None)
    if mesh is None:
        return optimizer_class(model.parameters(), **defaults)
    return ZeroOneOptimizer(model.named_parameters(), optimizer_class, mesh,
                            beside=getattr(model, ZERO1_BESIDE_ATTRIBUTE, None), **defaults)


class ZeroOneOptimizer(torch.optim.Optimizer):
    """`optimizer_class` run on this data rank's shard of the flattened parameters (module docstring). It is a
    `torch.optim.Optimizer` whose `param_groups` and `state` are the inner optimizer's, so LR schedulers drive
    it; `zero_grad` clears the module's gradients."""

    def __init__(self, params, optimizer_class: Callable[..., torch.optim.Optimizer], mesh,
                 beside: str | None = None, **defaults: Any):
        """`params`: parameters, or (name, parameter) pairs (`zero_optimizer` gives the module's names, which key
        `parameter_state_dict`). `beside`: this rank's coordinate on the axes beside `mesh` ('' where there are
        none, None where it is not known: then a checkpoint needs `mesh` to be the whole job), which keys its state
        in a checkpoint."""
        from torch.distributed.tensor import DTensor, Shard

        self.mesh, self.beside = mesh, beside
        seen: dict[int, nn.Parameter] = {}
        self.names: dict[int, str] = {}   # a parameter's first name, where given
        for item in params:
            name, p = item if isinstance(item, tuple) else (None, item)
            if p.requires_grad:
                seen.setdefault(id(p), p)
                if name is not None:
                    self.names.setdefault(id(p), name)
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in seen.values():
            by_dtype.setdefault(p.dtype, []).append(p)
        self.groups: list[tuple[list[nn.Parameter], nn.Parameter, int]] = []
        for members in by_dtype.values():
            total = sum(_local(p).numel() for p in members)
            start, chunk = _chunk_of(mesh, total)
            mine = _local(members[0]).new_zeros(chunk)   # the last ranks' padding stays 0, and its state too
            for p, member, part in _overlaps(members, start, chunk):
                mine[part].copy_(_local(p).detach().reshape(-1)[member])
            flat = nn.Parameter(DTensor.from_local(mine, mesh, [Shard(0)], run_check=False))
            self.groups.append((members, flat, total))
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
        for members, flat, total in self.groups:
            mine = flat.to_local()
            start, _chunk = _chunk_of(self.mesh, total)
            # the parameters' values as they are now (loaded from a checkpoint, set by the user since the last
            # step): the flat chunk is this rank's copy of them, never a second source of the weights
            grad = torch.zeros_like(mine)
            for p, member, part in _overlaps(members, start, mine.numel()):
                mine[part].copy_(_local(p).reshape(-1)[member])
                if p.grad is not None:
                    grad[part].copy_(_local(p.grad).reshape(-1)[member])
            flat.grad = DTensor.from_local(grad, self.mesh, [Shard(0)], run_check=False)
        self.inner.step()
        for members, flat, total in self.groups:
            whole = flat.full_tensor()[:total]
            offset = 0
            for p in members:
                local = _local(p)
                local.copy_(whole[offset:offset + local.numel()].view_as(local))
                offset += local.numel()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state for `torch.distributed.checkpoint` (module docstring): `state` holds, per
        flat parameter, each state tensor of its length as a `Shard(0)` DTensor of the unpadded length (views of
        the state), the rest (a step count) as it is; `param_groups` the inner groups' settings; `layout` each flat
        parameter's members' sizes. A fresh optimizer's state is made first (a step of zero gradients at
        learning rate 0, as torch's `get_optimizer_state_dict` does), so that there is something to load into."""
        beside = self._beside()
        self._made_state()
        state = {}
        for index, (_members, flat, total) in enumerate(self.groups):
            state[f"{beside}{index}"] = {key: self._unpadded(value, total) if _is_flat_like(value, flat) else value
                                         for key, value in self.inner.state[flat].items()}
        groups = [{key: value for key, value in group.items() if key != "params"} for group in self.param_groups]
        return {"state": state, "param_groups": groups, "layout": {beside or "all": self._layout()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`state_dict()`'s form loaded: the state (in place; DTensors of another data-rank count are read as the
        whole length's pieces this rank holds) and the groups' settings. A checkpoint of another model or plan
        (another layout) is refused before anything changes."""
        beside = self._beside()
        layout = (state_dict.get("layout") or {}).get(beside or "all")
        if layout is not None and [list(map(int, sizes)) for sizes in layout] != self._layout():
            raise ValueError("this ZeRO-1 optimizer state was saved for other parameters (its layout: "
                             f"{len(layout)} flat parameter(s) of {[len(s) for s in layout]} members; this "
                             f"optimizer's: {[len(s) for s in self._layout()]})")
        self._made_state()
        with torch.no_grad():
            for index, (_members, flat, total) in enumerate(self.groups):
                for key, value in state_dict["state"][f"{beside}{index}"].items():
                    mine = self.inner.state[flat][key]
                    if _is_flat_like(mine, flat):
                        target = self._unpadded(mine, total)
                        piece = _piece(value, target)
                        if piece.data_ptr() != target.to_local().data_ptr():   # not dcp.load's own view
                            target.to_local().copy_(piece)
                    elif isinstance(mine, torch.Tensor):
                        if value is not mine:
                            mine.copy_(value)
                    else:
                        self.inner.state[flat][key] = value
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({key: value for key, value in saved.items() if key != "params"})

    def parameter_state_dict(self) -> dict[str, Any]:
        """The state keyed by parameter name, as torch's `get_optimizer_state_dict` keys a plain optimizer's:
        `state[name]` holds each per-element state (a moment) shaped and placed as the parameter (a DTensor of its
        placements: `Replicate()` on the data axes, its tensor-parallel `Shard(d)`), the rest (the step count) as
        the flat parameter's; `param_groups` the groups' settings with `params` the names. So a DCP checkpoint of
        it loads on another data-parallel degree, another tensor-parallel degree (DCP reshards each parameter's
        pieces), or into a plain optimizer of the unmodified module (`set_optimizer_state_dict`). Each moment is
        all-gathered over the data ranks to be cut by parameter: while it is saved, a rank holds its whole state
        of its pieces once more (what ZeRO-1 saves between checkpoints). Needs the parameters' names (built by
        `zero_optimizer`)."""
        self._made_state()
        state: dict[str, dict[str, Any]] = {}
        for members, flat, total in self.groups:
            inner = self.inner.state[flat]
            whole = {key: value.full_tensor()[:total] for key, value in inner.items() if _is_flat_like(value, flat)}
            offset = 0
            for p in members:
                local = _local(p)
                entry = {key: value.clone() if isinstance(value, torch.Tensor) else value
                         for key, value in inner.items() if key not in whole}
                for key, value in whole.items():
                    entry[key] = _placed_as(value[offset:offset + local.numel()].view_as(local).clone(), p)
                state[self._name(p)] = entry
                offset += local.numel()
        groups = [{**{key: value for key, value in group.items() if key != "params"},
                   "params": [self._name(p) for members, _flat, _total in self.groups for p in members]}
                  for group in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_parameter_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`parameter_state_dict()`'s form loaded (after `dcp.load` into it, each moment holds this rank's pieces
        of the parameters, whatever degrees wrote it; a whole tensor, as a one-process optimizer's state is, is
        cut to them): this rank's chunk of the flattened moments copied out of it, the step count and the groups'
        settings taken as given. A parameter missing from it is refused by name before anything changes."""
        self._made_state()
        missing = [self._name(p) for members, _flat, _total in self.groups for p in members
                   if self._name(p) not in state_dict["state"]]
        if missing:
            raise ValueError(f"this optimizer state holds no entry for parameter(s) {', '.join(missing[:4])}")
        with torch.no_grad():
            for members, flat, total in self.groups:
                inner = self.inner.state[flat]
                start, _chunk = _chunk_of(self.mesh, total)
                for key, value in inner.items():
                    if not _is_flat_like(value, flat):
                        given = state_dict["state"][self._name(members[0])][key]
                        if isinstance(value, torch.Tensor):
                            value.copy_(given)
                        else:
                            inner[key] = given
                        continue
                    mine = value.to_local()
                    for p, member, part in _overlaps(members, start, mine.numel()):
                        piece = _local_piece(state_dict["state"][self._name(p)][key], p)
                        mine[part].copy_(piece.reshape(-1)[member])
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({key: value for key, value in saved.items() if key != "params"})

    def _name(self, p: nn.Parameter) -> str:
        name = self.names.get(id(p))
        if name is None:
            raise ValueError("a ZeRO-1 state keyed by parameter needs the parameters' names: build the optimizer "
                             "with zero_optimizer(model, ...) or give ZeroOneOptimizer (name, parameter) pairs")
        return name

    def _layout(self) -> list[list[int]]:
        return [[_local(p).numel() for p in members] for members, _flat, _total in self.groups]

    def _beside(self) -> str:
        """The prefix of this rank's keys in a checkpoint: its coordinate beside the data mesh (`tp=1/`), or ''."""
        import torch.distributed as dist

        if self.beside is None and dist.is_initialized() and dist.get_world_size() != self.mesh.size():
            raise NotImplementedError(f"a checkpoint of ZeRO-1's optimizer state over {self.mesh.size()} of the "
                                      f"job's {dist.get_world_size()} ranks, built without its coordinate on the "
                                      "other axes (a pipeline stage's), is not supported: their ranks hold other "
                                      "flat parameters")
        return f"{self.beside}/" if self.beside else ""

    def _made_state(self) -> None:
        """The inner optimizer's state made, where no step has made it yet (torch's optimizers make it lazily).
        torch's `get_optimizer_state_dict` does this with a private helper (`_init_optim_state`) that does nothing
        where a gradient exists (after backward, before the first step), which would leave nothing to save or to
        load into: here the gradients are set aside for the zero-gradient step and put back."""
        if self.inner.state:
            return
        flats = [flat for _members, flat, _total in self.groups]
        saved = [(flat, flat.grad) for flat in flats]
        lrs = [group.get("lr") for group in self.param_groups]
        for flat in flats:
            flat.grad = torch.zeros_like(flat)
        for group in self.param_groups:
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        self.inner.step()
        for group, lr in zip(self.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for flat, grad in saved:
            flat.grad = grad

    def _unpadded(self, value, total: int):
        """`value` (a flat parameter's state: `Shard(0)` over the data mesh, padded) without the padding: this
        rank's part of the first `total` elements, a view of it, as a DTensor of length `total`."""
        from torch.distributed.tensor import DTensor, Shard

        local = value.to_local()
        start, chunk = _chunk_of(self.mesh, total)
        kept = max(0, min(chunk, total - start))
        return DTensor.from_local(local[:kept], self.mesh, [Shard(0)], run_check=False, shape=torch.Size([total]),
                                  stride=(1,))

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


def _placed_as(local: torch.Tensor, param: torch.Tensor):
    """`local` (this rank's values of a tensor shaped as `param`'s local piece) as a DTensor placed as `param` is
    (a plain tensor where `param` is one)."""
    if not hasattr(param, "placements"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _local_piece(value: Any, param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `value` (a tensor of `param`'s global shape: a DTensor of any placements, or whole)
    as `param` holds its own."""
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"a ZeRO-1 state of shape {tuple(value.shape)} for a parameter of {tuple(param.shape)}")
    if not hasattr(param, "placements"):
        return value.full_tensor() if hasattr(value, "full_tensor") else value
    if hasattr(value, "redistribute"):
        if value.device_mesh == param.device_mesh:
            return value.redistribute(param.device_mesh, param.placements).to_local()
        value = value.full_tensor()
    from torch.distributed.tensor import distribute_tensor

    # every rank holds the whole tensor: each cuts its own piece, no collective
    return distribute_tensor(value.to(_local(param).device), param.device_mesh, param.placements,
                             src_data_rank=None).to_local()


def _is_flat_like(value: Any, flat: torch.Tensor) -> bool:
    """Whether an optimizer state entry is per element of `flat` (a moment), not a scalar (a step count)."""
    return hasattr(value, "to_local") and tuple(value.shape) == tuple(flat.shape)


def _piece(value: Any, target) -> torch.Tensor:
    """This rank's piece of `target` (an unpadded flat state DTensor) from `value`: a DTensor of the same length
    (another sharding: redistributed) or the whole vector as a plain tensor."""
    if hasattr(value, "redistribute"):
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"a ZeRO-1 state of {value.shape[0]} elements where this optimizer's has {target.shape[0]}")
        if value.device_mesh == target.device_mesh and value.placements == target.placements:
            return value.to_local()
        value = value.full_tensor()
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"a ZeRO-1 state of {tuple(value.shape)} where this optimizer's is {tuple(target.shape)}")
    start, _chunk = _chunk_of(target.device_mesh, target.shape[0])
    return value[start:start + target.to_local().numel()]


def _chunk_of(mesh, total: int) -> tuple[int, int]:
    """Where this rank's chunk of a flat vector of `total` elements starts, and its padded length: torch's even
    sharding (`torch.chunk`'s sizes), which the flat parameters, their state and the checkpoints all follow."""
    chunk = -(-total // mesh.size())
    return mesh.get_local_rank() * chunk, chunk


def _overlaps(members: list[nn.Parameter], start: int, length: int):
    """(parameter, slice of its flattened local values, slice of the chunk) for each parameter that overlaps the
    chunk [start, start + length) of the members' values laid end to end: what `step` copies, and no more
    (not the whole model's weights and gradients each step)."""
    offset = 0
    for p in members:
        n = _local(p).numel()
        lo, hi = max(start, offset), min(start + length, offset + n)
        if lo < hi:
            yield p, slice(lo - offset, hi - offset), slice(lo - start, hi - start)
        offset += n


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local values (a view: writing it writes the parameter), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t
