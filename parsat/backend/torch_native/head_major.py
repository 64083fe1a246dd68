"""A fused projection's parameter held in head-major order: its tensor-parallel strided block made contiguous.

Laid out head by head (`ir.fused_projections`, `rewritten.parameter_placement`), each tensor-parallel rank of
HF GPT-2's fused `c_attn` ([h, 3h], q | k | v along dim 1; the bias [3h]) holds its heads' q, k and v columns:
a strided block of the parameter, torch's `_StridedShard(d, split_factor=3)`. torch 2.13's `fully_shard` over
the data axis does not gather such a parameter back (`benchmarks/strided_fully_shard.py`: the bias, sharded
along the same dim on both axes, comes back with its blocks in the wrong order), and DCP refuses to save it
("overlapping chunks"). So the parameter is held with the blocks of dim d permuted once, when the plan is
applied (`head_major`): [part, rank, m] -> [rank, part, m], so that rank r's strided block is the r-th
contiguous block and its placement on the tensor axis a plain `Shard(d)`, which ZeRO-3, DCP, optimizers and
`clip_grad_norm_` handle as any column-parallel weight (a permutation changes no norm, and AdamW is elementwise).
The forward reads the rank's local block back as the strided DTensor of the module's own parameter
(`strided_view`: no copy, no collective), so the plan's graph sees the values the unmodified module holds;
`state_dict()` presents the parameter in the module's order and `load_state_dict` permutes what it is given
(`checkpoint_in_module_order`), so a checkpoint written on the ranks loads into the unmodified module.
"""

from __future__ import annotations

import torch


def head_major(t: torch.Tensor, dim: int, parts: int, ranks: int, inverse: bool = False) -> torch.Tensor:
    """`t` (a plain tensor) with dim `dim`'s `parts` x `ranks` blocks reordered from part-major (the module's:
    q | k | v, each cut into `ranks` blocks) to rank-major (each rank's q, k and v blocks together), or back where
    `inverse`. A copy, contiguous."""
    size = t.shape[dim]
    if size % (parts * ranks):
        raise ValueError(f"dim {dim} of size {size} does not cut into {parts} parts of {ranks} blocks")
    outer = (parts, ranks) if not inverse else (ranks, parts)
    blocks = t.unflatten(dim, (*outer, size // (parts * ranks)))
    return blocks.transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()


def strided_view(param, dim: int, parts: int):
    """The module's parameter as the plan's graph reads it: `param` (a DTensor on the tensor axis's mesh, held
    head-major as `Shard(dim)`) re-read as `_StridedShard(dim, split_factor=parts)`, whose rank-local block is the
    same tensor. Differentiable: the gradient reaches `param`'s local block unchanged."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return DTensor.from_local(param.to_local(), param.device_mesh, [_StridedShard(dim, split_factor=parts)],
                              run_check=False, shape=param.shape, stride=param.stride())


def in_module_order(value, dim: int, parts: int, ranks: int):
    """A head-major parameter's value (`value`, a DTensor on any mesh, e.g. sharded again by `fully_shard` on the
    data axis) as the module holds it, placed alike (a strided placement there as the plain `Shard` DCP saves).
    Gathers the whole parameter on each rank once (checkpoints only)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    whole = head_major(value.full_tensor(), dim, parts, ranks, inverse=True)
    plain = [Shard(p.dim) if isinstance(p, Shard) else p for p in value.placements]   # _StridedShard is a Shard
    return distribute_tensor(whole, value.device_mesh, plain, src_data_rank=None)


def checkpoint_in_module_order(owner: torch.nn.Module, local: str, dim: int, parts: int, ranks: int) -> None:
    """`owner.<local>`, held head-major (module docstring), checkpointed in the module's order: `state_dict()`
    presents it so (`in_module_order`), and `load_state_dict` permutes what it is given back to head-major order
    at the parameter's placements. The presented tensor is a copy: `dcp.load` into `model.state_dict()` alone does
    not change the parameter; follow it with `model.load_state_dict(state)` (or `set_model_state_dict`)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def presented(_module, state, prefix, _metadata) -> None:
        value = state.get(prefix + local)
        if isinstance(value, DTensor):
            state[prefix + local] = in_module_order(value, dim, parts, ranks)

    def received(module, state, prefix, *_rest) -> None:
        value, param = state.get(prefix + local), getattr(module, local)
        if value is None or not isinstance(param, DTensor):
            return
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        state[prefix + local] = distribute_tensor(head_major(whole.to(param.dtype), dim, parts, ranks),
                                                  param.device_mesh, param.placements, src_data_rank=None)

    owner.register_state_dict_post_hook(presented)
    owner.register_load_state_dict_pre_hook(received)
