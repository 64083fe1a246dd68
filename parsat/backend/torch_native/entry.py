"""The way in to the torch-native runtime: one plan for every rank, read as torch's pieces, applied.

`parallelize_native` (what `parsat.parallelize(module, plan, runtime="torch")`
calls, on every rank) reads the plan, starts the process group under
torchrun when none is started, makes every rank hold rank 0's plan
(`plan_share`), compares the module's graph with the plan's when asked,
and then hands over: an unpipelined plan to `apply.apply_lowering` (the
user's module back, parameters DTensors), a pipelined one to
`pipelined.apply_pipeline` (a `PipelinedModule`: the module cut into
`torch.distributed.pipelining` stages, trained with `step`). Where an
unpipelined plan computes otherwise than the module's graph (an algebraic
rewrite) and the module's import is at hand, the module's forward is
replaced by one computing the plan's graph (`rewritten`).
"""

from __future__ import annotations

from functools import partial
from typing import Mapping

import torch.distributed as dist
from torch import nn

from parsat.backend.torch_native.apply import NativeParallelizeError, apply_lowering, module_info
from parsat.backend.torch_native.lowering import LoweringError
from parsat.backend.torch_native.pipeline_lowering import lower_pipeline
from parsat.backend.torch_native.rewritten import install, lowered_plan, place_parameters


def parallelize_native(module: nn.Module, plan, *, mp_policy=None, example_inputs=None, imported=None,
                       weight_names: Mapping[str, str] | None = None):
    """The module with `plan` lowered onto torch's stack; call it on every rank (docs/TORCH_NATIVE.md).

    `plan` is a parsat `Plan`, a plan dict or JSON file, or None on every rank
    but 0 (rank 0's is broadcast, `plan_share`). The module must hold the
    plan's weights under the plan's names and shapes, or under the names
    `weight_names` (graph weight -> parameter name) or the import
    (`imported.weights`) give them. Unpipelined plans: give `example_inputs`
    or `imported` to have the module's whole graph compared with the plan's
    as `parallelize` does; the module itself comes back. Pipelined plans:
    `example_inputs` (one step's local batch, as `PipelinedModule.step` will
    be given it) is required, to trace the module; a `PipelinedModule` comes
    back. Raises `NativeParallelizeError` (naming the plan node) where the
    plan cannot be lowered.
    """
    from parsat.backend.parallelize import graph_difference, import_difference, resolved_plan, started_process_group
    from parsat.backend.plan_share import PlanMismatch, shared_plan

    resolve = _resolver(resolved_plan)
    if plan is not None:   # a plan that cannot be read, or run so, is refused before any process group starts
        if resolve(plan)[2] is not None and example_inputs is None:
            raise NativeParallelizeError(_NO_EXAMPLE)
    device = started_process_group(NativeParallelizeError)
    try:
        pcg, graph, pipeline, regathers = shared_plan(plan, resolve, device)
    except (PlanMismatch, ValueError) as err:
        raise NativeParallelizeError(str(err)) from None
    devices = pcg.mesh.world * (pipeline.layout.degree if pipeline else 1)
    if dist.get_world_size() != devices:
        where = (f"{pipeline.layout.degree} pipeline stages of {pipeline.stage_devices} device(s)" if pipeline
                 else str(pcg.mesh or "one device"))
        raise NativeParallelizeError(f"the plan runs on {devices} device(s) ({where}) but the job has "
                                     f"{dist.get_world_size()} rank(s)")
    aliases = dict(imported.weights) if imported is not None else {}
    aliases.update(weight_names or {})
    if pipeline is not None:
        return _pipelined(module, pcg, graph, pipeline, module_info(module, aliases), example_inputs, device,
                          mp_policy, regathers)
    if imported is not None or example_inputs is not None:
        if imported is None:
            from parsat.importer.export import import_module

            imported = import_module(module, example_inputs, check=False)
            aliases = {**imported.weights, **(weight_names or {})}
            difference = graph_difference(imported.graph, graph)
        else:
            difference = import_difference(module, imported) or graph_difference(imported.graph, graph)
        if difference:
            raise NativeParallelizeError(difference)
    try:
        lowering, rewrite = lowered_plan(pcg, graph, module_info(module, aliases), imported)
    except LoweringError as err:
        raise NativeParallelizeError(str(err)) from None
    if rewrite is None:
        return apply_lowering(module, lowering, device, mp_policy)
    model = apply_lowering(module, lowering, device, mp_policy, blocks=False,
                           tensor_parallel=partial(place_parameters, rewrite=rewrite))
    return install(model, rewrite, imported, lowering.mesh)


_NO_EXAMPLE = ("a pipelined plan needs example_inputs (one step's local batch, as you will pass it to "
               "PipelinedModule.step): torch.distributed.pipelining traces the module on one micro-batch of it")


def _resolver(resolve_plan):
    """`resolve_plan` (`parallelize.resolved_plan`) with its refusals as NativeParallelizeError."""
    def resolve(plan):
        try:
            return resolve_plan(plan)
        except ValueError as err:
            raise NativeParallelizeError(str(err)) from None
    return resolve


def _pipelined(module, pcg, graph, pipeline, info, example_inputs, device, mp_policy, regathers: bool = False):
    from parsat.backend.torch_native.pipelined import apply_pipeline

    if example_inputs is None:
        raise NativeParallelizeError(_NO_EXAMPLE)
    try:
        lowering = lower_pipeline(pcg, graph, pipeline, info, regathers=regathers)
    except LoweringError as err:
        raise NativeParallelizeError(str(err)) from None
    return apply_pipeline(module, lowering, tuple(example_inputs), device, mp_policy)
