"""`parsat run plan.json --runtime torch` on a pipelined plan file: its graph cut into `torch.distributed.pipelining`
stages and trained with the plan's schedule, as a user's pipelined module is (`pipelined.py`).

The plan's graph becomes a `staged_graph.StagedGraphModule` (block L's
weights in submodule `blocks.L`, seeded as the interpreter seeds them; its
forward computes the graph block after block and returns the interpreter's
objective), which `entry.parallelize_native` cuts where the plan's chunks
begin and applies as it applies any pipelined plan: the stages, the
schedule (GPipe, 1F1B, interleaved) with the plan's micro-batch count,
tensor / data / ZeRO axes inside each stage, the shared weights'
gradients summed over their stages. Each rank passes its local batch of
the interpreter's seeded data (the step's whole batch cut as the stage
plan splits it, `apply.lowering_batch`) to `PipelinedModule.step`, which
cuts it into the plan's micro-batches (every tensor along dim 0) and
returns the step's loss; torch's SGD or Adam (`run._optimizer`) steps on
each rank's stage's parameters. With `--check` every rank also trains the
unmodified module (the same `StagedGraphModule`, whole) on the whole
batch in one process; the losses (the ranks' mean) and each rank's final
weights (gathered whole on its stage) are compared, the worst over every
rank reported.

Refused before any rank starts (`check_runnable`): a graph that is no
built-in example (its stages are traced at one micro-batch, which only an
example rebuilt at that batch computes: the loss's 1 / count is fixed at
the plan's batch), and a tensor the module takes (an input, or an output's
target) whose batch is not its dim 0 (the schedule cuts every argument
along dim 0), each named. The lowering's refusals (a cut with no block
module, a crossing split otherwise than along the sequence or the batch,
...) come from every rank with the lowering's message.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from parsat.backend.executor import ExecutionError, operator_library, seeded_weights, step_data
from parsat.backend.launch import RankContext
from parsat.backend.torch_native.run import (GraphModule, _optimizer, loss_difference, reference_step,
                                             run_torch_plan, weight_difference)
from parsat.backend.torch_native.staged_graph import StagedGraphModule
from parsat.backend.training_data import TrainConfig
from parsat.ir.graph import Graph
from parsat.ir.microbatch import step_batch


def check_runnable(graph: Graph) -> None:
    """What a pipelined plan file is refused for before any rank starts (module docstring)."""
    library = operator_library()
    doubled = GraphModule(graph, {}, library).at_batch_scale(2, 1)
    if doubled is None or step_batch(graph, library).whole is None:
        raise ExecutionError("--runtime torch runs a pipelined plan file of a built-in example only: its stages are "
                             "traced at one micro-batch, and this graph (no built-in example, or edited since it "
                             "was built) is known at the plan's batch alone; run it with the interpreter (the "
                             "default runtime), or train your module with parsat.parallelize(module, plan, "
                             "example_inputs, runtime='torch')")
    module = StagedGraphModule(graph, {}, library)
    shapes, twice = graph.shapes(), doubled.shapes()
    for name in module.tensor_names:
        grown = [d for d, (a, b) in enumerate(zip(shapes[name], twice[name])) if a != b]
        if grown != [0]:
            what = "input" if name in module.input_names else "target of output"
            raise ExecutionError(f"the {what} {name} {list(shapes[name])} carries the batch "
                                 f"{'nowhere' if not grown else f'along dim {grown[0]}'}: the pipeline schedule cuts "
                                 "every tensor a step takes into micro-batches along dim 0; run the plan with the "
                                 "interpreter (the default runtime)")


def run_pipelined_torch_plan(path: str, nproc: int, config: TrainConfig, backend: str | None = None,
                             timeout_s: float = 600.0, collective_timeout_s: float = 30.0) -> dict:
    """The pipelined plan file at `path` trained on `nproc` ranks (module docstring); rank 0's report."""
    return run_torch_plan(path, nproc, config, backend, timeout_s, collective_timeout_s, rank=pipelined_rank)


def pipelined_rank(ctx: RankContext, path: str, config: TrainConfig) -> dict:
    """One rank: the staged graph module lowered (`parallelize_native`), trained `config.steps` steps with
    `PipelinedModule.step` on this rank's local batch, beside the unmodified module on the whole batch when
    `config.check`."""
    from parsat.backend.parallelize import resolved_plan
    from parsat.backend.torch_native.apply import NativeParallelizeError, lowering_batch, lowering_of, module_info
    from parsat.backend.torch_native.entry import parallelize_native
    from parsat.backend.torch_native.lowering import LoweringError
    from parsat.backend.torch_native.pipeline_lowering import lower_pipeline

    library = operator_library()
    pcg, graph, pipeline, regathers = resolved_plan(path)
    module = StagedGraphModule(graph, seeded_weights(graph, config), library)
    reference = copy.deepcopy(module).to(ctx.device) if config.check else None
    batch = step_batch(graph, library)
    try:   # this rank's part of a step, to trace the stages on (parallelize_native lowers the plan again)
        lowering = lower_pipeline(pcg, graph, pipeline, module_info(module, module.param_names), regathers)
        example = tuple(lowering_batch(lowering, t) for t in _step_tensors(module, step_data(graph, batch, config, 0)))
        model = parallelize_native(module, path, weight_names=module.param_names, example_inputs=example)
    except (LoweringError, NativeParallelizeError) as err:
        return {"refused": str(err)}
    optimizer, ref_optimizer = (_optimizer(m, config) if m is not None else None for m in (model, reference))
    losses, ref_losses = [], []
    for step in range(config.steps):
        whole = tuple(t.to(ctx.device) for t in _step_tensors(module, step_data(graph, batch, config, step)))
        loss = model.step(*(lowering_batch(lowering, t) for t in whole))
        optimizer.step()
        optimizer.zero_grad()
        held = loss.detach().to(ctx.device, torch.float64)
        dist.all_reduce(held)
        losses.append(float(held) / ctx.world)
        if reference is not None:
            ref_losses.append(reference_step(reference(*whole), ref_optimizer))
    report = _report(model, reference, losses, ref_losses, config, lowering_of(model).describe())
    return {**report, "optimizer": type(optimizer).__name__}


def _step_tensors(module: StagedGraphModule, data) -> tuple[torch.Tensor, ...]:
    """The step's whole batch as the module takes it (`tensor_names`: the inputs, then the outputs' targets)."""
    values = {**data.whole_inputs(), **{n: t for n, t in data.whole_targets().items() if t is not None}}
    return tuple(values[name] for name in module.tensor_names)


def _report(model, reference, losses: list, ref_losses: list, config: TrainConfig, lowering: str) -> dict:
    """What rank 0 reports: losses, the lowering, the parameters (of any stage) that are no DTensor, and with a
    reference the largest relative difference of a loss or of a final weight over every rank (each rank's own
    stage's, gathered whole on its stage: collectives, on every rank)."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    plain = sorted(n for n, t in params.items() if not isinstance(t, DTensor))
    worst, where = loss_difference(losses, ref_losses)
    if reference is not None:
        worst, where = weight_difference(((name, got, reference.get_parameter(name)) for name, got in params.items()),
                                         worst, where)
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, (worst, where, plain))
    out = {"runtime": "torch", "losses": losses, "lowering": lowering,
           "not_dtensor": sorted({n for _, _, names in found for n in names})}
    if reference is None:
        return out
    worst, where, _ = max(found, key=lambda f: f[0])
    out.update(ref_losses=ref_losses, max_rel_diff=worst, worst=where,
               check="passed" if worst <= config.tolerance else "failed")
    return out
