"""parsat.backend: plans run for real on torch.distributed; with `parsat.importer`, the only packages that import torch.

Modules:
`launch` (N ranks spawned here or joined under torchrun; a rank that dies,
raises or hangs ends the job with its name), `rank_guard` (a rank dies
with its launcher, from its first moment), `main_guard` (a job started
from the launching script's unguarded top level, told before spawning),
`collectives` (one process
group per group of each mesh axis; the parallel operators as one table of
autograd-aware collectives on them),
`executor` (a PCG as training steps on every rank, checked against one
process; the library's operators in torch are `parsat.importer.torch_ops`,
which the importer's self-check runs too), `cli`
(`parsat run`, `parsat calibrate`), `calibrate` (this machine's speeds for
the cost model), `step_statistic` (a run's step and a calibrated figure
told by one statistic: each round the slowest rank's, the median, the
middle half), `parallelize` (a user's module run as a plan, fed from its
import: a torch `nn.Module` as a parsat graph is `parsat.importer`'s),
`running_stats` (batch norm's running statistics kept as torch keeps
them), `training_data` (seeded weights, inputs and targets, cut into
micro-batches; the objective), `plan_check` (a plan computes what its own
graph computes, checked before any rank starts), `recompute_regions` (the
order a rank runs its part of a PCG in, each recomputed block one
checkpointed region), `pipeline_run` (a pipelined plan: each stage's
chunks on its own ranks, micro-batches moved point to point),
`plan_share` (one plan for every rank: rank 0's handed to the ranks that
hold none, different plans refused), `state_shards` (ZeRO stages 1 and 2:
each weight's update on this rank's shard, its gradient reduce-scattered
and the shards all-gathered), `torch_native` (a plan lowered onto torch's
own stack for `parallelize(..., runtime="torch")`: DTensor parameters on
the plan's DeviceMesh, tensor-parallel styles, replicate / fully_shard;
docs/TORCH_NATIVE.md).

It reads plans through `parsat.ir` (docs/plan-schema.md) and nothing of the
optimizer.
"""
