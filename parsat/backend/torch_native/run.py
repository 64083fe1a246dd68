"""`parsat run plan.json --runtime torch`: a plan's own graph trained on PyTorch's own distributed stack.

The interpreter (`parsat run`'s default runtime, `backend/executor.py`)
runs the plan node by node. This runs the same plan file the way a user's
module would be run with `parsat.parallelize(module, plan,
runtime="torch")`: the plan's graph becomes a module (`GraphModule`:
each graph weight a parameter, seeded as the interpreter seeds it; its
forward evaluates the graph with parsat's torch operators and returns its
outputs, of which `graph_objective` makes the interpreter's objective),
`entry.parallelize_native` lowers the plan onto it (`replicate`,
`fully_shard`, ZeRO-1/2, on a `DeviceMesh`: gloo on CPU,
nccl where CUDA has a device per rank), and each rank trains it on its
local batch of the interpreter's seeded data with torch's SGD or Adam.
With `--check` every rank also trains the unmodified module on the whole
batch in one process, and the losses (the ranks' mean) and final weights
(gathered whole) are compared.

Where the plan's PCG computes otherwise than its graph (an algebraic
rewrite), or where the module's own forward cannot run the plan, the module
computes the plan's graph: `GraphImport` is its import for `parallelize`,
which then replaces its forward by `rewritten.RewrittenForward` (the same
code as for a user's imported module). The graph's weights are plain
parameters of one module, not `nn.Linear` / `nn.Embedding` modules, so
torch's tensor-parallel styles cannot split them: a plan splitting a weight
on a tensor axis runs the plan's graph on DTensors (every parameter placed
as the plan stores it, each parallel operator on the tensor axis a
redistribute: tp, dp x tp); the module holds no submodule per block, so a
plan recomputing blocks checkpoints the plan's blocks' steps
(`lowering.UncheckpointedBlocks`). An example whose nodes fix an attribute
at the plan's batch (the loss's 1 / count: `GraphModule.batch_fixed`) has
them computed at each rank's local batch (`GraphImport.local_attrs`,
`rewritten.local_attrs`), so each rank's loss is its local batch's mean and
torch's average over the data ranks the plan's; a plan in which a rule
moved such a constant is refused, naming the node. The optimizer is
`zero.zero_optimizer`'s: its state sharded under the plan's ZeRO-1.

The module's forward evaluates the graph at the batch it is given: for a
built-in example (`Graph.example`) the example rebuilt at the local batch
size (the same weights: a batch changes no weight's shape); any other
graph as it is, its operators run on the local batch (one whose attributes
fix the batch size fails there, or `--check` says the values differ:
nothing passes silently). Each rank's
objective averages its local batch, and torch averages the gradients over
the data ranks: the plan's global mean when the local batches are equal.

A plan of m micro-batches a step (`Graph.microbatches`) trains as a user's
gradient-accumulation loop does: micro-batch k is block k of the step's
batch (`StepData.inputs(k)`, as the interpreter cuts it), each rank's part
of it through the module, its objective divided by m, the gradient sync of
`replicate` / `fully_shard` off in every backward but the last
(`FSDPModule.set_requires_gradient_sync`), one optimizer step; `--check`
trains the unmodified module on the whole batch. Micro-batches of a graph
that is no built-in example are refused up front (their whole batch is not
known).

A pipelined plan file runs through `run_pipelined.py`: the graph as a
module with one submodule a block (`staged_graph.StagedGraphModule`), cut
into `torch.distributed.pipelining` stages where the plan's chunks begin,
trained with the plan's schedule and micro-batches (`PipelinedModule.step`)
as a user's pipelined module is; `--check` as here.

The lowering's own refusals (an all_to_all, two tensor axes, ...) come from
every rank with the lowering's message, naming the node.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from parsat.backend.executor import ExecutionError, operator_library, seeded_weights, step_data
from parsat.backend.launch import LaunchConfig, RankContext, launch
from parsat.backend.training_data import TrainConfig, objective
from parsat.importer.imported import DataLeaf
from parsat.importer.torch_ops import evaluate_graph
from parsat.ir.graph import Graph
from parsat.ir.microbatch import batch_dims, step_batch
from parsat.ir.models import BATCH, EXAMPLES, build_example


class GraphModule(nn.Module):
    """A plan's graph as a module (module docstring): `forward(inputs)` (a dict by graph leaf name) returns the
    graph's outputs, a tuple in `graph.outputs` order (`graph_objective` makes the objective of them: the tuple is
    what a rewritten forward returns too, `rewritten.RewrittenForward` through `GraphImport.output_spec`).
    Parameter names are the graph's weight names with `.` as `_` (`param_names`: graph weight -> parameter name,
    what `parallelize` is given as `weight_names`)."""

    def __init__(self, graph: Graph, weights: Mapping[str, torch.Tensor], library=None):
        super().__init__()
        self.graph, self.library = graph, library or operator_library()
        self.param_names = {name: name.replace(".", "_") for name in weights}
        for name, value in weights.items():
            self.register_parameter(self.param_names[name], nn.Parameter(value.detach().clone()))
        self._at_batch: dict[int, Graph] = {}   # the graph rebuilt per local batch size (its example's)

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The graph's outputs on this rank's local `inputs`."""
        graph = self.graph_for(inputs)
        leaves = {name: self.get_parameter(param) for name, param in self.param_names.items()}
        env = evaluate_graph(graph, {**leaves, **inputs})
        return tuple(env[o] for o in graph.outputs)

    def graph_for(self, inputs: Mapping[str, torch.Tensor]) -> Graph:
        """The graph at the batch of `inputs`: the plan's own at its shapes, else its example rebuilt at that
        batch, else (not an example) the plan's own, whose operators then run on the local batch as they can."""
        shapes = {leaf.name: tuple(leaf.shape) for leaf in self.graph.leaves if leaf.role == "input"}
        if all(tuple(inputs[name].shape) == shape for name, shape in shapes.items()):
            return self.graph
        dims = batch_dims(self.graph, self.library)
        first = next((n for n in shapes if n in dims), None)
        if first is None:
            return self.graph
        return self.at_batch_scale(inputs[first].shape[dims[first]], shapes[first][dims[first]]) or self.graph

    def at_batch_scale(self, num: int, den: int) -> Graph | None:
        """The graph's example rebuilt at its batch times num / den (the same weights), None when the graph is
        no built-in example."""
        example = self.graph.example
        if example is None or example[0] not in EXAMPLES:
            return None
        name, sizes = example[0], dict(example[1])
        local = {**EXAMPLES[name].defaults(), **sizes}[BATCH] * num // den
        if local not in self._at_batch:
            self._at_batch[local] = build_example(name, {**sizes, BATCH: local}, self.library)
        return self._at_batch[local]

    def batch_fixed(self) -> tuple[str, ...]:
        """The graph's nodes whose attributes its example fixes at the global batch (they change when the example
        is rebuilt at twice the batch: the loss's 1 / count): a rank's local batch runs them as rebuilt, which the
        plan's own (rewritten) nodes cannot be."""
        other = self.at_batch_scale(2, 1)
        if other is None:
            return ()
        attrs = {n.name: n.attrs for n in other.nodes}
        return tuple(n.name for n in self.graph.nodes if attrs.get(n.name, n.attrs) != n.attrs)


def graph_objective(model: nn.Module, graph: Graph, outputs: tuple[torch.Tensor, ...],
                    targets: Mapping[str, torch.Tensor | None]) -> torch.Tensor:
    """The interpreter's objective of `outputs` (the graph's, in order) against `targets` whole, each cut here as
    its output came out (along the dim the local batch shrank, the rank's block of `model`: `apply.local_batch`)."""
    from parsat.backend.torch_native.apply import local_batch

    total = 0.0
    for o, out in zip(graph.outputs, outputs):
        target = targets.get(o)
        dim = None if target is None else next(
            (d for d, (a, b) in enumerate(zip(target.shape, out.shape)) if a != b), None)
        total = total + objective(out, target if dim is None else local_batch(model, target, dim=dim),
                                  out.numel())
    return total


@dataclass(frozen=True)
class GraphImport:
    """What `parallelize` reads of an import (`importer.imported.ImportedModule`), for a `GraphModule`: so that
    a plan computing otherwise than its graph (an algebraic rewrite) runs the plan's graph through
    `torch_native/rewritten.py`, as a user's imported module does. Every input leaf is data the rank is given
    as it is (`value`, at its local batch); no constants, dropout masks or running statistics; the module
    returns the tuple of the graph's outputs. `fixed`: the nodes whose attributes the example fixes at the plan's
    batch (`GraphModule.batch_fixed`: the loss's 1 / count), which a rank computes at its local batch
    (`local_attrs`, read by `rewritten.local_attrs`), the example rebuilt there by `rebuild`."""

    graph: Graph
    weights: Mapping[str, str]
    data: Mapping[str, DataLeaf]
    output_spec: Any
    fixed: tuple[str, ...] = ()
    rebuild: Callable[[int, int], Graph | None] | None = None
    running_stats: tuple = ()
    constants: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, module: GraphModule) -> "GraphImport":
        """The record of `module`'s graph."""
        graph = module.graph
        data = {leaf.name: DataLeaf(leaf.name, leaf.name, "value", tuple(leaf.shape))
                for leaf in graph.leaves if leaf.role == "input"}
        spec = torch.utils._pytree.tree_flatten(tuple(graph.outputs))[1]
        return cls(graph, dict(module.param_names), data, spec, module.batch_fixed(), module.at_batch_scale)

    def local_attrs(self, count: int) -> dict[str, tuple]:
        """The `fixed` nodes' attributes at 1 / `count` of the plan's batch (a rank's local batch): graph node name
        -> attributes."""
        if not self.fixed:
            return {}
        at_local = {n.name: n.attrs for n in self.rebuild(1, count).nodes}
        return {name: at_local[name] for name in self.fixed}

    def data_values(self, inputs, dtype, seed: int = 0, step: int = 0, shapes=None) -> dict[str, torch.Tensor]:
        """The leaves' values: the forward's one argument (the dict of local inputs), in `dtype`."""
        return {name: value.to(dtype) for name, value in inputs[0].items()}

    def constant_values(self, dtype) -> dict[str, torch.Tensor]:
        """No leaf is a constant."""
        return {}


def check_runnable(graph: Graph) -> None:
    """What `--runtime torch` refuses of an unpipelined plan file before any rank starts (module docstring)."""
    if graph.microbatches != 1 and step_batch(graph, operator_library()).whole is None:
        raise ExecutionError(f"the plan runs its step as {graph.microbatches} micro-batches of a graph that is no "
                             "built-in example, so the step's whole batch (what --check trains the unmodified module "
                             "on, and how each micro-batch is cut from it) is not known: run it with the interpreter "
                             "(the default runtime)")


def run_torch_plan(path: str, nproc: int, config: TrainConfig, backend: str | None = None,
                   timeout_s: float = 600.0, collective_timeout_s: float = 30.0, rank=None) -> dict:
    """The plan file at `path` trained on `nproc` ranks through `parallelize(runtime="torch")`; rank 0's report
    (`rank`'s: `torch_rank` by default, `run_pipelined.pipelined_rank` for a pipelined plan file). Raises
    ExecutionError with the lowering's refusal when the plan cannot be lowered."""
    results = launch(rank or torch_rank, (path, config),
                     LaunchConfig(nproc=nproc, backend=backend, timeout_s=timeout_s,
                                  collective_timeout_s=collective_timeout_s))
    refused = next((r["refused"] for r in results if r.get("refused")), None)
    if refused:
        raise ExecutionError(f"the torch runtime cannot run this plan: {refused} (--runtime torch runs the plan's "
                             "graph as a module of plain parameters, one module or one a block; run the plan with "
                             "the interpreter, the default runtime, or your own module with "
                             "parsat.parallelize(module, plan, example_inputs, runtime='torch'))")
    return results[0]


def torch_rank(ctx: RankContext, path: str, config: TrainConfig) -> dict:
    """One rank: the graph's module lowered (`parallelize_native`), trained `config.steps` steps on this rank's
    local batch, beside the unmodified module on the whole batch when `config.check`."""
    from parsat.backend.torch_native.apply import NativeParallelizeError, local_batch, lowering_of
    from parsat.backend.torch_native.entry import parallelize_native
    from parsat.ir.plan import load_plan_dict

    library = operator_library()
    graph = Graph.from_dict(load_plan_dict(path)["graph"], library)
    module = GraphModule(graph, seeded_weights(graph, config), library)
    reference = copy.deepcopy(module).to(ctx.device) if config.check else None
    try:
        model = parallelize_native(module, path, weight_names=module.param_names, imported=GraphImport.of(module))
    except NativeParallelizeError as err:
        return {"refused": str(err)}
    optimizer, ref_optimizer = (_optimizer(m, config) if m is not None else None for m in (model, reference))
    batch, dims = step_batch(graph, library), batch_dims(graph, library)
    losses, ref_losses = [], []
    m = batch.microbatches
    for step in range(config.steps):
        data = step_data(graph, batch, config, step)
        held = torch.zeros((), device=ctx.device, dtype=torch.float64)
        for k in range(m):   # micro-batch k: block k of the step's batch (as the interpreter cuts it), its rank's part
            inputs = {n: t.to(ctx.device) for n, t in data.inputs(k).items()}
            targets = {n: None if t is None else t.to(ctx.device) for n, t in data.targets(k).items()}
            mine = {n: local_batch(model, t, dim=dims[n]) if n in dims else t for n, t in inputs.items()}
            _gradient_sync(model, k == m - 1)
            loss = graph_objective(model, graph, model(mine), targets) / m
            loss.backward()
            held += loss.detach().to(held.dtype)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(held)
        losses.append(float(held) / ctx.world)
        if reference is not None:
            inputs = {n: t.to(ctx.device) for n, t in data.whole_inputs().items()}
            targets = {n: None if t is None else t.to(ctx.device) for n, t in data.whole_targets().items()}
            ref_losses.append(reference_step(graph_objective(reference, graph, reference(inputs), targets),
                                             ref_optimizer))
    report = _report(model, reference, losses, ref_losses, config, lowering_of(model).describe())
    return {**report, "optimizer": type(optimizer).__name__}


def _gradient_sync(model: nn.Module, on: bool) -> None:
    """Gradient accumulation: `replicate` / `fully_shard` (both `FSDPModule`s) synchronise the gradients in the
    last micro-batch's backward only, each earlier one accumulating the rank's own; a module with no data axis
    has nothing to synchronise."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(on)


def _optimizer(module: nn.Module, config: TrainConfig):
    """torch's SGD or Adam as the plan asks for it (`zero.zero_optimizer`: its state sharded over the data ranks
    under the plan's ZeRO-1; the unmodified reference module's whole)."""
    from parsat.backend.torch_native.zero import zero_optimizer

    kind = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[config.optimizer]
    return zero_optimizer(module, kind, lr=config.lr)


def _report(model: nn.Module, reference, losses: list, ref_losses: list, config: TrainConfig,
            lowering: str) -> dict:
    """What rank 0 reports: losses, the lowering, every parameter a DTensor or not, and with a reference the
    largest relative difference of a loss or a final weight (gathered whole: a collective, on every rank)."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    out = {"runtime": "torch", "losses": losses, "lowering": lowering,
           "not_dtensor": sorted(n for n, t in params.items() if not isinstance(t, DTensor))}
    if reference is None:
        return out
    worst, where = weight_difference(((name, params[name], want) for name, want in reference.named_parameters()),
                                     *loss_difference(losses, ref_losses))
    out.update(ref_losses=ref_losses, max_rel_diff=worst, worst=where,
               check="passed" if worst <= config.tolerance else "failed")
    return out


def weight_difference(pairs, worst: float, where: str) -> tuple[float, str]:
    """The largest relative difference of a final weight from the reference's over `pairs` (name, weight, reference
    weight; a DTensor gathered whole: a collective, in the same order on every rank), or `worst` / `where` where
    none is larger."""
    from torch.distributed.tensor import DTensor

    for name, got, want in pairs:
        whole = got.full_tensor() if isinstance(got, DTensor) else got
        rel = float((whole.detach() - want.detach()).abs().max() / want.detach().abs().max().clamp_min(1e-30))
        if rel > worst:
            worst, where = rel, f"weight {name}"
    return worst, where


def loss_difference(losses: list, ref_losses: list) -> tuple[float, str]:
    """The largest relative difference of a step's loss from the reference's, and "the loss" where there is one."""
    worst, where = 0.0, ""
    for got, want in zip(losses, ref_losses):
        rel = abs(got - want) / max(abs(want), 1e-30)
        if rel > worst:
            worst, where = rel, "the loss"
    return worst, where


def reference_step(objective_value: torch.Tensor, optimizer) -> float:
    """One step of the unmodified module on the whole batch (`--check`'s reference): the objective's backward, the
    optimizer's step; the objective's value."""
    objective_value.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(objective_value.detach())
