"""GPT-2's fused q, k, v weight laid out head by head on a tp mesh with torch 2.13's `_StridedShard`: what works.

    .venv/bin/python benchmarks/strided_fused_weight.py [--hidden 8] [--ranks 2]

Megatron-LM stores its fused QKV weight so that each tensor-parallel rank holds its heads' q, k and v columns.
For transformers' `Conv1D` c_attn (weight [h, 3h], q | k | v along dim 1) that is `_StridedShard(1,
split_factor=3)` on the tp mesh: the weight cut in 3 along dim 1, each third sharded over the ranks, rank r
holding the r-th block of each third. On gloo ranks, float64, one JSON line per rank: whether its local block
is those columns, `full_tensor()` the weight, a forward computing each third's product from the local block
(`DTensor.from_local(..., Shard(1))`, the heads-parallel q, k, v) gives the whole computation's loss and
gradient (which comes back `_StridedShard`), `clip_grad_norm_` gives the whole gradient's norm, AdamW steps
the DTensor, and `torch.distributed.checkpoint.save` of it succeeds (it does not in torch 2.13: DCP records each
rank's block as one contiguous chunk, and the two chunks overlap).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

PARTS = 3   # q, k, v


def job(rank: int, ranks: int, hidden: int, folder: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    weight = torch.randn(hidden, PARTS * hidden, dtype=torch.float64)
    x = torch.randn(5, hidden, dtype=torch.float64)
    block = hidden // ranks
    param = torch.nn.Parameter(distribute_tensor(weight, mesh, [_StridedShard(1, split_factor=PARTS)]))
    local = param.to_local()
    full = param.detach().full_tensor()
    heads = torch.cat([weight[:, t * hidden + rank * block: t * hidden + (rank + 1) * block] for t in range(PARTS)], 1)
    is_heads = torch.equal(local, heads)   # before the step changes the block in place
    thirds = [DTensor.from_local(local[:, t * block:(t + 1) * block], mesh, [Shard(1)]) for t in range(PARTS)]
    loss = sum(((x @ third.to_local()) ** 2).sum() for third in thirds)   # each rank its heads' products
    total = loss.detach().clone()
    dist.all_reduce(total)
    loss.backward()
    whole = weight.clone().requires_grad_()
    reference = sum(((x @ whole[:, t * hidden:(t + 1) * hidden]) ** 2).sum() for t in range(PARTS))
    reference.backward()
    grad = param.grad
    norm = torch.nn.utils.clip_grad_norm_([param], 1e9)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    torch.optim.AdamW([param], lr=1e-2).step()
    try:
        dcp.save({"w": param.detach()}, checkpoint_id=folder)
        saved = "saved"
    except BaseException as err:   # DCP raises its CheckpointException on every rank
        text = " ".join(str(err).split())
        saved = text[text.find("key:"):][:170] if "key:" in text else text[:170]
    print(json.dumps({"rank": rank, "local_is_its_heads_qkv": is_heads,
                      "full_tensor_is_the_weight": torch.equal(full, weight),
                      "loss_equal": torch.allclose(total, reference.detach()),
                      "grad_placements": str(grad.placements), "grad_equal": torch.allclose(grad.full_tensor(),
                                                                                            whole.grad),
                      "clip_norm_equal": torch.allclose(norm, whole.grad.norm()),
                      "adamw_step_keeps_a_dtensor": isinstance(param.data, DTensor), "dcp_save": saved}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="strided_fused_")
    try:
        mp.spawn(job, args=(args.ranks, args.hidden, folder, 29631), nprocs=args.ranks)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
