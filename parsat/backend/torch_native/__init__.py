"""parsat.backend.torch_native: a plan lowered onto PyTorch's own distributed stack (docs/TORCH_NATIVE.md).

The user's module keeps its own forward; what the plan decides becomes
torch's pieces: its mesh a `DeviceMesh`, its weights DTensors with the
plan's placements, tensor parallelism `parallelize_module` styles
(`ColwiseParallel`, `RowwiseParallel`), data parallelism `replicate` and
ZeRO-3 (and ZeRO-1/2) `fully_shard`. So `clip_grad_norm_`, optimizers,
LR schedulers, `torch.distributed.checkpoint`, `torch.compile` and
autocast see ordinary DTensor parameters.

Modules: `lowering` (a plan read as those pieces, per mesh axis and per
weight, or refused naming the node torch's pieces cannot express; torch
is not imported there), `apply` (the pieces applied to the user's module
on every rank; `parallelize_native`, `local_batch`, `lowering_of`).
`parsat.parallelize(module, plan, runtime="torch")` is the way in.
"""
