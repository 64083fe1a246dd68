"""torch's `fully_shard` of a `_StridedShard` parameter, and the head-major permutation parsat holds instead.

    .venv/bin/python benchmarks/strided_fully_shard.py [--hidden 8]

GPT-2's fused `c_attn` laid out head by head on a tp mesh is, in torch's terms, the weight [h, 3h] as
`_StridedShard(1, split_factor=3)` and the bias [3h] as `_StridedShard(0, split_factor=3)`: each tp rank its
heads' q, k and v columns (`benchmarks/strided_fused_weight.py`). On 4 gloo ranks (dp 2 x tp 2, float64) this
script places both so on the tp mesh, wraps their module in `fully_shard` over dp (ZeRO-3: FSDP2 shards each
parameter again along dim 0 on dp) and compares what FSDP's all-gather gives the forward, and its
`full_tensor()` after the step's reshard, with the original values. Then the same with the parameter held in
head-major order (`parsat.backend.torch_native.head_major`: its columns permuted once so that each tp rank's
strided block is a contiguous `Shard(d)` block) and the forward re-reading the gathered local block as the
strided DTensor (`DTensor.from_local`), its state dict in the module's order and loaded back
(`checkpoint_in_module_order`). One JSON line per rank: the relative error (Frobenius) of each.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from parsat.backend.torch_native.head_major import checkpoint_in_module_order, head_major, strided_view

PARTS = 3   # q, k, v


class Fused(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(hidden, PARTS * hidden, generator=gen, dtype=torch.float64))
        self.bias = torch.nn.Parameter(torch.randn(PARTS * hidden, generator=gen, dtype=torch.float64))


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def job(rank: int, hidden: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    out = {"rank": rank}
    for how in ("strided", "head_major"):
        module = Fused(hidden)
        want = {n: p.detach().clone() for n, p in module.named_parameters()}
        for name, p in list(module.named_parameters()):
            dim = p.dim() - 1
            if how == "strided":
                placed = distribute_tensor(p.data, tp, [_StridedShard(dim, split_factor=PARTS)])
            else:
                placed = distribute_tensor(head_major(p.data, dim, PARTS, tp.size()), tp, [Shard(dim)])
            setattr(module, name, torch.nn.Parameter(placed))
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=True)
        module.unshard()   # what the forward reads: the all-gathered parameters on the tp mesh
        for name, p in module.named_parameters():
            seen = p if how == "strided" else strided_view(p, p.dim() - 1, PARTS)
            out[f"{how} {name} gathered"] = _error(seen.full_tensor(), want[name])
        module.reshard()
        for name, p in module.named_parameters():   # the stored (sharded) parameter, read whole
            whole = p.full_tensor()
            if how == "head_major":
                whole = head_major(whole, p.dim() - 1, PARTS, tp.size(), inverse=True)
            out[f"{how} {name} stored"] = _error(whole, want[name])
            out[f"{how} {name} placements"] = str(list(p.placements))
        if how == "head_major":   # its checkpoint in the module's order, and loaded back
            for name, p in module.named_parameters():
                checkpoint_in_module_order(module, name, p.dim() - 1, PARTS, tp.size())
            state = module.state_dict()
            with torch.no_grad():
                for p in module.parameters():
                    p.zero_()
            module.load_state_dict(state)
            for name, p in module.named_parameters():
                out[f"{how} {name} state_dict"] = _error(state[name].full_tensor(), want[name])
                out[f"{how} {name} loaded back"] = _error(
                    head_major(p.full_tensor(), p.dim() - 1, PARTS, tp.size(), inverse=True), want[name])
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=8)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(job, args=(args.hidden, port), nprocs=4)


if __name__ == "__main__":
    main()
