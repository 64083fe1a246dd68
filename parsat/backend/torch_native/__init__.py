"""parsat.backend.torch_native: a plan lowered onto PyTorch's own distributed stack (docs/TORCH_NATIVE.md).

The user's module keeps its own forward; what the plan decides becomes
torch's pieces: its mesh a `DeviceMesh`, its weights DTensors with the
plan's placements, tensor parallelism `parallelize_module` styles
(`ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`,
`PrepareModuleInput`), data parallelism `replicate`, ZeRO-2 and ZeRO-3
`fully_shard`, ZeRO-1 `replicate` with an optimizer sharding its state
(`zero.zero_optimizer`). So `clip_grad_norm_`, optimizers,
LR schedulers, `torch.distributed.checkpoint`, `torch.compile` and
autocast see ordinary DTensor parameters.

A pipelined plan becomes `torch.distributed.pipelining` stages (the module
cut at the plan's chunks) and the plan's schedule, each stage's own plan
lowered on its stage modules.

Modules: `lowering` (a plan read as those pieces, per mesh axis and per
weight, or refused naming the node torch's pieces cannot express; torch
is not imported there), `pipeline_lowering` (a pipelined plan's cuts,
schedule and shared weights, also without torch), `apply` (the pieces
applied to the user's module on every rank; `local_batch`,
`lowering_of`), `conv1d` (the column- and row-parallel styles of transformers'
`Conv1D`, GPT-2's projections, which torch's own refuse), `zero` (ZeRO-1's optimizer: `zero_optimizer`,
`ZeroOneOptimizer`), `pipelined` (a pipelined plan applied: `PipelinedModule`;
`batch_agreement`: a pipelined step's batch the same shape on every rank),
`rewritten` (a plan whose graph an algebraic rule rewrote: the module's
forward replaced by one evaluating the plan's graph, `RewrittenForward`),
`entry` (`parallelize_native`: one plan for every rank, then one of the
two). `run` (`parsat run --runtime torch`: a plan file's graph as a module
(`GraphModule`), trained through this path on N ranks, with `--check`;
`run_pipelined` a pipelined plan file's, its graph as `staged_graph.StagedGraphModule`, one submodule a block). `parsat.parallelize(module, plan, runtime="torch")` is the way in.
"""
