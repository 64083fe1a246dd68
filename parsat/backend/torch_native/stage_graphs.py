"""A traced stage module's fx graphs, taken from a trace at another batch shape and installed in the stage module a
pipelined module keeps, so one set of parameters runs every shape (`pipelined.PipelinedModule.step`).

`torch.distributed.pipelining.pipeline()` bakes the micro-batch's shape into every graph it traces (`view(x,
[2, 8, 32])`, the receive buffers' sizes in the placeholders' values), so another shape needs another trace.
The trace re-registers the module's own parameter objects in its stage modules (a tied one, held by two
stages, is a copy on each), but the stage modules a `PipelinedModule` trains are no longer those: their
parameters are DTensors (`replicate`, `fully_shard`, the stage's tensor axis), FSDP's hooks and its
parameter swaps are registered on them, their blocks' forwards are checkpointed, and the optimizer holds their
parameters. So a new trace gives only its graphs: each graph of the new stage module (the root `GraphModule`
and each `InterpreterModule` below it) replaces the graph of the module at the same path in the kept stage
module, whose attributes the graph reads by name. The graphs of each shape are kept (`StageGraphs`), so a
shape met again is installed, not traced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from parsat.backend.torch_native.apply import NativeParallelizeError


@dataclass(frozen=True)
class ModuleGraph:
    """One module's graph at one shape, and the tensors it reads that are not parameters (a constant the trace
    lifted, a buffer), by the name the graph reads them: installed with the graph, as the trace made them."""

    graph: torch.fx.Graph
    tensors: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class StageGraphs:
    """A stage module's graphs at one shape: its submodule path ('' for the root) -> that module's graph."""

    modules: Mapping[str, ModuleGraph]


def graphs_of(traced: nn.Module, kept: nn.Module) -> StageGraphs:
    """The graphs of `traced` (a stage module just traced) for installing in `kept` (the stage module of the same
    index that trains): every module holding a graph in `traced` exists in `kept` at the same path, of the same
    kind, and every module and parameter its graph reads by name is there; refused by name otherwise (the module
    traced as another structure)."""
    out = {}
    for path, module in traced.named_modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        target = _submodule(kept, path)
        if target is None or isinstance(target, torch.fx.GraphModule) != isinstance(module, torch.fx.GraphModule):
            raise NativeParallelizeError(f"the stage module traced at the new batch shape has a module {path!r} "
                                         f"({type(module).__name__}) that the trained stage module lacks")
        tensors = {}
        for node in graph.nodes:
            if node.op == "call_module" and _submodule(target, node.target) is None:
                raise NativeParallelizeError(f"the graph traced for {path or 'the stage'} at the new batch shape "
                                             f"calls {node.target}, which the trained stage module lacks")
            if node.op != "get_attr":
                continue
            value = _attribute(module, node.target)
            if isinstance(value, nn.Parameter):
                if not isinstance(_attribute(target, node.target), nn.Parameter):
                    raise NativeParallelizeError(f"the graph traced for {path or 'the stage'} at the new batch shape "
                                                 f"reads parameter {node.target}, which the trained stage module "
                                                 "lacks")
            elif isinstance(value, torch.Tensor):
                tensors[node.target] = value
        out[path] = ModuleGraph(graph, tensors)
    return StageGraphs(out)


def install(kept: nn.Module, graphs: StageGraphs) -> None:
    """`graphs` made the graphs `kept` runs: each module's graph replaced (an fx `GraphModule` recompiled, an
    `InterpreterModule` finalized: both run the graph they hold), the tensors each reads set beside it; the
    parameters, hooks and wrapped forwards of `kept` untouched."""
    from torch.export.unflatten import InterpreterModule

    for path, held in graphs.modules.items():
        module = kept.get_submodule(path)
        for name, value in held.tensors.items():
            owner, _, local = name.rpartition(".")
            setattr(module.get_submodule(owner), local, value)
        if isinstance(module, InterpreterModule):
            module.graph = held.graph
            held.graph.owning_module = module
            module.finalize()
        elif isinstance(module, torch.fx.GraphModule):
            _calls_as_traced(type(module))
            module.graph = held.graph   # the setter recompiles its forward
        else:
            raise NativeParallelizeError(f"stage module {path!r} ({type(module).__name__}) runs no fx graph")


def _calls_as_traced(cls: type) -> None:
    """A stage module's class ready for `GraphModule.recompile`: `replicate` and `fully_shard` made it a subclass
    of the class fx made for the module, and `recompile` on that subclass would wrap its `__call__` as one calling
    the subclass's parent's `__call__`, which is that wrapper again (a RecursionError at the first call). Given fx's
    own call wrapper, the subclass's recompiled forward runs under nn.Module's call (the hooks, then forward)."""
    if "_wrapped_call" not in vars(cls):
        made = next(c for c in cls.__mro__ if "_wrapped_call" in vars(c))
        cls._wrapped_call = vars(made)["_wrapped_call"]


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _attribute(module: nn.Module, name: str):
    owner, _, local = name.rpartition(".")
    found = _submodule(module, owner)
    return getattr(found, local, None) if found is not None else None
