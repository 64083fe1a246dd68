"""`parallelize(module, plan, example_inputs)`: the user's module, trained by the user's loop, run as a plan.

Under torchrun (one process per device), every rank calls

    pmodule = parsat.parallelize(module, plan, example_inputs)
    optimizer = torch.optim.SGD(pmodule.parameters(), lr=0.01)
    for batch in batches:                  # the same global batch on every rank
        loss = pmodule(*batch)
        optimizer.zero_grad(); loss.backward(); optimizer.step()
    state = parsat.gather_weights(pmodule)  # on every rank: the module's own state_dict, trained

`example_inputs` serve to export the module (`import_module`) to learn how
its inputs feed the plan's graph; a caller that has imported it already
passes that import instead, `parallelize(module, plan, imported=imported)`,
and the module is not exported a second time. A `Plan` object's PCG and
graph are used as they are (a plan dict or file is read).

What the returned module is:

* its parameters are this rank's pieces of the user's own weights, as the
  plan stores them (a weight the plan only partitions, or partitions and
  gathers for use as ZeRO-3 does, is stored as its piece; any other weight
  whole). Rank 0's weights are broadcast first, so
  every rank starts from the same values (as DDP does). A tied parameter
  (one tensor under two names) is one graph weight and one parameter here;
* its forward takes the module's own inputs. **Input convention: every
  rank passes the same global batch**; the plan decides which piece each
  rank reads (a data-parallel plan partitions the batch, so each rank
  computes on its rows only). Integer and boolean work on the inputs
  (shifted labels, masks) runs in torch on every rank, as the import
  recorded it (`importer.imported.ImportedModule.data_values`);
* it returns the module's outputs, whole on every rank: a scalar loss as
  the value every rank holds, a sharded output gathered. Backward through
  it yields the same gradients the unmodified module would get, summed
  over ranks by the plan's own collectives (the gradient of an output
  that is a replica on axes of `c` ranks in all is divided by `c`, so
  `replicate`'s all-reduce adds up one gradient, not `c`; on its free axes
  ranks compute the same gradient redundantly and nothing is divided);
* batch norm in training mode keeps its running statistics as torch does:
  after each training forward the module's `running_mean`, `running_var`
  and `num_batches_tracked` buffers are updated from the global batch
  statistics the plan computed (`backend.running_stats`), the same on every
  rank; `gather_weights` returns them in the `state_dict`. Evaluation
  (`pmodule.eval()`) is refused for such a plan: it normalizes with batch
  statistics, and evaluation uses the module itself;
* dropout draws real masks: a dropout's mask is a data input of the graph
  (`dropout_masked`), drawn at step `t` from a generator seeded by
  (seed, mask name, t) over the whole logical tensor, and each rank reads
  its piece through the plan like any input, so ranks agree and the
  `--check` reference can draw the same masks (`ReferenceDropout`).

A plan that recomputes activations (`PCG.recompute`) recomputes them here
too: each block is a checkpointed region of the forward, run again in the
user's `backward()` (the batch statistics stay alive for the running
statistics). Blocks are `ir.blocks`' (weights named `b{i}_...`): the import
names a stack of identical blocks so (`ir.block_layout`, found by structure),
keeping the module's parameter names beside the graph's
(`ImportedModule.weights`: pieces, placements and `gather_weights` use the
module's); a module without such a stack has none, and nothing is
recomputed, as the plan's costs say.

A plan of m micro-batches (`Graph.microbatches`) is a plan for one
micro-batch here: each call runs one, and the user's loop accumulates
(each loss divided by m); every backward then synchronises the gradients,
m times a step rather than the once the plan prices (`parsat run` runs
such a plan as priced; `parsat run --model` refuses it).

`gather_weights(pmodule)` (a collective: call it on every rank) writes the
trained pieces back into the user's module, in its own names and layouts,
and returns `module.state_dict()`.
"""

from __future__ import annotations

import copy
import time
import zlib
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parsat.backend import running_stats
from parsat.backend.collectives import CommCounter
from parsat.backend.executor import (Comparison, ExecutionError, Optimizer, RankProgram, TrainConfig, _job_summary,
                                     check_mesh, compare_values, gradient_of, operator_library, output_holders,
                                     step_comm)
from parsat.backend.launch import RankContext
from parsat.backend.plan_share import PlanMismatch, shared_plan
from parsat.importer.export import example_tuple, import_module
from parsat.importer.imported import ImportedModule, dropout_mask
from parsat.ir.graph import Graph
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import PCG
from parsat.ir.placement import Placement, piece_index


class ParallelizeError(ValueError):
    """A module and plan that cannot run together (a different graph, a different device count)."""


# ------------------------------------------------------------------ outputs


class _HeldGradient(torch.autograd.Function):
    """Identity forward; backward divides the gradient by the number of copies holding the value."""

    @staticmethod
    def forward(ctx, x, copies):
        ctx.copies = copies
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.copies, None


class _Assemble(torch.autograd.Function):
    """A sharded output gathered whole on every rank; backward takes this rank's piece (over its replicas)."""

    @staticmethod
    def forward(ctx, x, placement, shape, mesh, replicas):
        ctx.placement, ctx.shape, ctx.mesh, ctx.replicas = placement, shape, mesh, replicas
        return _assembled(x, placement, shape, mesh)

    @staticmethod
    def backward(ctx, grad):
        where = piece_index(ctx.placement, ctx.shape, ctx.mesh, dist.get_rank())
        return grad[where].contiguous() / ctx.replicas, None, None, None, None


def _whole(x: torch.Tensor, placement: Placement, shape: tuple[int, ...], mesh: Mesh, name: str) -> torch.Tensor:
    replicas, _ = output_holders(placement, mesh, name)
    if not any(placement.shard_axes(d) for d in range(len(shape))):
        return _HeldGradient.apply(x, replicas)
    return _Assemble.apply(x, placement, tuple(shape), mesh, replicas)


def _assembled(x: torch.Tensor, placement: Placement, shape: Sequence[int], mesh: Mesh) -> torch.Tensor:
    """The whole tensor from every rank's piece (all-gather over the job; ranks holding the same piece write
    equal values)."""
    pieces = [torch.empty_like(x) for _ in range(mesh.world)]
    dist.all_gather(pieces, x.detach().contiguous())
    full = torch.empty(tuple(shape), dtype=x.dtype, device=x.device)
    for rank, piece in enumerate(pieces):
        full[piece_index(placement, shape, mesh, rank)] = piece
    return full


def _gather_full(x: torch.Tensor, placement: Placement, shape: tuple[int, ...], mesh: Mesh) -> torch.Tensor:
    """A whole tensor from its pieces on every rank (no gradient)."""
    if not any(placement.shard_axes(d) for d in range(len(shape))):
        return x.detach().clone()
    with torch.no_grad():
        return _assembled(x, placement, shape, mesh)


# ------------------------------------------------------------------ the module


class ParallelModule(torch.nn.Module):
    """The user's module as a plan on this rank: see the module docstring."""

    def __init__(self, module: torch.nn.Module, imported: ImportedModule, pcg: PCG, ctx: RankContext,
                 dtype: torch.dtype | None = None, seed: int = 0):
        super().__init__()
        self._module = [module]  # a list: not a submodule, so parameters() is this rank's pieces only
        self.imported = imported
        self.pcg = pcg
        self.ctx = ctx
        self.seed = seed
        self.step = 0
        first = next(iter(module.parameters()), None)
        self.dtype = dtype or (first.dtype if first is not None else torch.float32)
        library = operator_library()
        check_mesh(pcg, ctx.world, library)
        weights = {}
        for name, parameter in imported.weights.items():
            value = module.get_parameter(parameter).detach().to(self.dtype).clone().contiguous()
            if dist.is_initialized() and ctx.world > 1:
                dist.broadcast(value, src=0)  # every rank starts from rank 0's weights
            weights[name] = value
        config = TrainConfig(dtype=str(self.dtype).replace("torch.", ""), seed=seed)
        # the batch statistics the running statistics are updated from are read after forward: kept alive
        # even inside a recomputed block (`RankProgram.keep`)
        stats = frozenset(running_stats.node_of(pcg, name) for stat in imported.running_stats
                          for name in (stat.mean, stat.var))
        self.program = RankProgram(pcg, ctx, config, library, weights, keep=stats)
        self.pieces = torch.nn.ParameterDict()
        for param in self.program.params.values():
            tensor = torch.nn.Parameter(param.tensor.detach().clone())
            param.tensor = tensor
            self.pieces[imported.weights[param.name].replace(".", "/")] = tensor
        self.counter = CommCounter()
        self._constants = imported.constant_values(self.dtype)

    @property
    def module(self) -> torch.nn.Module:
        """The user's module (its parameters are updated only by `gather_weights`)."""
        return self._module[0]

    def parameter(self, weight: str) -> str:
        """The module's name of a graph weight (a block's weight is renamed in the graph, `ImportedModule.weights`)."""
        return self.imported.weights[weight]

    def piece_placements(self) -> dict[str, tuple[Placement, tuple[int, ...]]]:
        """Module parameter name -> (the placement its stored piece has, the weight's full shape)."""
        return {self.parameter(p.name): (p.placement, p.shape) for p in self.program.params.values()}

    def named_pieces(self) -> dict[str, torch.Tensor]:
        """Module parameter name -> this rank's piece (the parameters the optimizer updates)."""
        return {self.parameter(p.name): p.tensor for p in self.program.params.values()}

    def forward(self, *inputs):
        data = dict(self._constants)
        moved = [t.to(self.ctx.device) if isinstance(t, torch.Tensor) else t for t in inputs]
        data.update(self.imported.data_values(moved, self.dtype, self.seed, self.step))
        if not self.training:  # evaluation: no dropout (every mask keeps everything, scaled back)
            for leaf in self.imported.data.values():
                if leaf.encoding == "dropout" and leaf.name in data:
                    data[leaf.name] = torch.full_like(data[leaf.name], 1.0 - leaf.rate)
        if not self.training and self.imported.running_stats:
            raise ExecutionError("this plan's batch norms normalize with the statistics of the batch (the module "
                                 "was imported in training mode); to evaluate with the running statistics, call "
                                 "parsat.gather_weights(pmodule) and run the module itself in eval mode")
        env = self.program.forward(self.step, self.counter, data)
        if self.training and self.imported.running_stats:
            running_stats.update(self.module, self.imported.running_stats, self.pcg, env, self.counter)
        outs = []
        for out_id, name in zip(self.pcg.outputs, self.program.output_names):
            x, placement = env[out_id]
            outs.append(_whole(x, placement, self.pcg.node(out_id).shape, self.pcg.mesh, name))
        if self.training:
            self.step += 1
        spec = self.imported.output_spec
        if spec is not None and spec.num_leaves == len(outs):
            return torch.utils._pytree.tree_unflatten(outs, spec)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every weight whole, by the module's parameter name (a collective: every rank must call it)."""
        out = {}
        for param in self.program.params.values():
            out[self.parameter(param.name)] = _gather_full(param.tensor, param.placement, param.shape, self.pcg.mesh)
        return out


def gather_weights(pmodule: ParallelModule) -> dict[str, torch.Tensor]:
    """The trained weights written back into the user's module; its `state_dict()` (call on every rank).

    Names and layouts are the module's own: a tied parameter appears under
    both of its names, as torch's own `state_dict` gives it.
    """
    full = pmodule.full_weights()
    module = pmodule.module
    with torch.no_grad():
        for name, value in full.items():
            target = module.get_parameter(name)
            target.copy_(value.to(target.dtype))
    return module.state_dict()


_PIPELINED = ("pipelined plans run through `parsat run` (each stage runs its part of the graph on its own ranks in "
              "the plan's schedule; the interpreter's parallelize wraps one module on one mesh) or through "
              "parallelize(..., runtime='torch') (torch.distributed.pipelining stages and schedules)")


_ZERO = ("the plan shards its weights' optimizer state (ZeRO-{stage}), which a module trained with its own optimizer "
         "does not run yet (`parsat run plan.json` without --model does); optimize with --degrees zero=0")


def resolve_plan(plan) -> tuple[PCG, Graph, "PipelinePlan | None"]:
    """(PCG, graph, pipeline or None) of a `Plan` (taken as they are), a plan dict or a plan JSON file."""
    return resolved_plan(plan)[:3]


def resolved_plan(plan) -> tuple[PCG, Graph, "PipelinePlan | None", bool]:
    """`resolve_plan`'s, and whether the plan's machine is priced as a runtime that re-gathers
    (`Machine.runtime_regathers`; False for a plan dict without a machine): the torch runtime's traced stages
    then re-gather as priced (`torch_native.sequence_products`)."""
    from parsat.ir.errors import MachineError
    from parsat.ir.machine import Machine
    from parsat.ir.pipeline import PipelinePlan
    from parsat.ir.plan import Plan, load_plan_dict, pcg_from_dict

    if isinstance(plan, Plan):
        return plan.pcg, plan.graph, plan.pipeline, plan.machine.runtime_regathers
    if isinstance(plan, (str, bytes)) or hasattr(plan, "__fspath__"):
        plan = load_plan_dict(plan)
    if not isinstance(plan, Mapping):
        raise ParallelizeError("plan must be a parsat Plan, a plan dict or a plan JSON file")
    pipeline = None
    if plan.get("pipeline"):
        try:
            pipeline = PipelinePlan.from_dict(plan["pipeline"])
        except (KeyError, TypeError, ValueError) as err:
            raise ParallelizeError(f"the plan's pipeline does not follow the plan schema ({type(err).__name__}: "
                                   f"{err})") from None
    try:
        regathers = isinstance(plan.get("machine"), Mapping) and Machine.from_dict(plan["machine"]).runtime_regathers
    except MachineError as err:
        raise ParallelizeError(f"the plan's machine: {err}") from None
    library = operator_library()
    return pcg_from_dict(plan), Graph.from_dict(plan["graph"], library), pipeline, regathers


def _resolve_plan(plan) -> tuple[PCG, Graph]:
    """(PCG, graph) of a plan as `resolve_plan` reads it; a pipelined plan refused (the interpreter's
    `parallelize` wraps one module on one mesh)."""
    pcg, graph, pipeline = resolve_plan(plan)
    if pipeline:
        raise ParallelizeError(_PIPELINED)
    return pcg, graph


def started_process_group(error: type[Exception]) -> torch.device:
    """This rank's device, the default process group started from the torchrun environment when none is (`error`
    when there is none to start from)."""
    from parsat.backend.launch import under_torchrun

    if not dist.is_initialized():
        if not under_torchrun():
            raise error("parallelize runs under torchrun (one process per device): no process group is started and "
                        "RANK/WORLD_SIZE are not set")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def parallelize(module: torch.nn.Module, plan, example_inputs=None, *, imported: ImportedModule | None = None,
                seed: int = 0, dtype: torch.dtype | None = None) -> ParallelModule:
    """The module as `plan` runs it on this rank (see the module docstring); call it on every rank.

    `plan` is a parsat `Plan` (its PCG and graph are used as they are), a
    plan dict or a plan JSON file, or None on every rank but 0, which then
    receive rank 0's (`plan_share`: optimize once, on rank 0); ranks holding
    different plans are refused, naming them. The module's graph must be
    the plan's.
    How the module's inputs feed the graph comes from its import: give
    `imported`, the `ImportedModule` the caller already made
    (`parsat.importer.export.import_module(module, inputs)`, whose `.graph`
    is what `from_torch` returns), and the module is not exported again
    (`example_inputs` is then not needed); or give `example_inputs`, inputs
    of the shapes the plan was made for, and the module is exported here.
    Starts the default process group from the torchrun environment when
    none is started.
    """
    if plan is not None:
        _resolve_plan(plan)   # a plan that cannot be read is refused before any process group starts
    device = started_process_group(ParallelizeError)
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        pcg, graph = shared_plan(plan, _resolve_plan, device)
    except PlanMismatch as err:
        raise ParallelizeError(str(err)) from None
    if pcg.zero:
        raise ParallelizeError(_ZERO.format(stage=pcg.zero))
    if world != pcg.mesh.world:
        raise ParallelizeError(f"the plan runs on a mesh of {pcg.mesh.world} device(s) ({pcg.mesh or 'one device'}) "
                               f"but the job has {world} rank(s)")
    if imported is None:
        if example_inputs is None:
            raise ParallelizeError("give the example inputs the plan was made for, or the module's import "
                                   "(imported=)")
        # Not checked against the module again on every rank: the graph must be the plan's, made by an import
        # that checked it (`from_torch`).
        imported = import_module(module, example_inputs, check=False)
        difference = graph_difference(imported.graph, graph)
    else:  # the caller's import: of this module, and of the plan's graph
        difference = import_difference(module, imported) or graph_difference(imported.graph, graph)
    if difference:
        raise ParallelizeError(difference)
    ctx = RankContext(rank, world, dist.get_backend(), device)
    return ParallelModule(module, imported, pcg, ctx, dtype, seed)


def import_difference(module: torch.nn.Module, imported: ImportedModule) -> str:
    """'' when every weight of the import is a parameter of `module` of the same shape, else the first that is not
    (an import of another module)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    for leaf in imported.graph.weights:
        param = params.get(imported.weights.get(leaf.name, leaf.name))
        if param is None or tuple(param.shape) != tuple(leaf.shape):
            found = "not a parameter of it" if param is None else f"of shape {list(param.shape)} in it"
            return (f"the import is not this module's: its weight '{leaf.name}' {list(leaf.shape)} is {found}; "
                    "import the module you parallelize")
    return ""


def weights_difference(module: torch.nn.Module, graph: Graph) -> str:
    """'' when `module`'s trained parameters can hold the plan graph's weights, else why not: what a launcher
    checks before any rank starts, without exporting the module (each rank exports it, seconds, and compares its
    whole graph: `graph_difference`). An import makes each weight of the graph from one trained parameter of the
    same shape (tied parameters, one tensor, are one weight; a frozen one is a constant, never a weight), under a
    name of its own where it names a stack of blocks (`ImportedModule.weights`), so the shapes are what can be
    compared: every weight's shape must find a trained parameter of its own with that shape. A module that passes
    may still differ (its ranks then refuse it); one that fails is surely not the plan's."""
    trained: dict[tuple[int, ...], int] = {}
    for param in module.parameters():   # each tensor once: tied parameters are one
        if param.requires_grad:
            trained[tuple(param.shape)] = trained.get(tuple(param.shape), 0) + 1
    wanted: dict[tuple[int, ...], list[str]] = {}
    for leaf in graph.weights:
        wanted.setdefault(tuple(leaf.shape), []).append(leaf.name)
    for shape, names in wanted.items():
        if len(names) > trained.get(shape, 0):
            return (f"the module's graph is not the plan's: the plan trains {len(names)} weight(s) of shape "
                    f"{list(shape)} ('{names[0]}' first), the module {trained.get(shape, 0)} parameter(s) of that "
                    "shape; run the module the plan was optimized for")
    return ""


def graph_difference(got: Graph, want: Graph) -> str:
    """'' when the module's graph is the plan's (names of graphs aside), else the first difference."""
    g, w = got.to_dict(), want.to_dict()
    for key in ("inputs", "weights", "nodes", "outputs"):
        if g[key] != w[key]:
            for a, b in zip(g[key], w[key]):
                if a != b:
                    return (f"the module's graph is not the plan's: its {key} differ first at {a!r} (plan: {b!r}); "
                            "optimize the module with these input shapes")
            return f"the module's graph is not the plan's: it has {len(g[key])} {key}, the plan {len(w[key])}"
    return ""


# ------------------------------------------------------------------ the --check reference


class ReferenceDropout(torch.overrides.TorchFunctionMode):
    """Runs the unmodified module with the masks the plan draws: the k-th dropout the module applies (an
    `F.dropout` in training, or the attention dropout of `F.scaled_dot_product_attention`) gets the mask of
    the k-th dropout of the import, in the order the module calls them (the order export recorded)."""

    def __init__(self, names: Sequence[str], seed: int, step: int):
        super().__init__()
        self.names, self.seed, self.step, self.k = list(names), seed, step, 0

    def _next(self, shape, rate, dtype) -> torch.Tensor:
        if self.k >= len(self.names):
            raise ExecutionError("the module applied more dropouts than its export recorded")
        name = self.names[self.k]
        self.k += 1
        return dropout_mask(self.seed, name, self.step, shape, rate, dtype) / (1.0 - rate)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            call = dict(zip(("input", "p", "training", "inplace"), args), **kwargs)
            x, p, training = call["input"], float(call.get("p", 0.5)), call.get("training", True)
            if training and p > 0:
                return x * self._next(x.shape, p, x.dtype).to(x.device)
            return x
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            call = dict(zip(names, args), **kwargs)
            p = float(call.get("dropout_p", 0.0) or 0.0)
            if p > 0:
                return self._attention(call, p)
        return func(*args, **kwargs)

    def _attention(self, call: dict, p: float) -> torch.Tensor:
        q, k, v = call["query"], call["key"], call["value"]
        scale = call.get("scale") or 1.0 / q.shape[-1] ** 0.5
        scores = q @ k.transpose(-2, -1) * scale
        mask = call.get("attn_mask")
        if call.get("is_causal"):
            s, t = scores.shape[-2:]
            mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(diagonal=t - s)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = torch.softmax(scores, dim=-1)
        probs = probs * self._next(probs.shape, p, probs.dtype).to(probs.device)
        return probs @ v


def _batches(example_inputs, data, steps: int) -> list[tuple]:
    """The batch of each step: `data` (a list of batches) in turn, or the example inputs every step."""
    if data is None:
        return [example_tuple(example_inputs)] * steps
    batches = [example_tuple(b) for b in data]
    if not batches:
        raise ExecutionError("--data holds no batches")
    return [batches[i % len(batches)] for i in range(steps)]


def _cast(batch: tuple, dtype) -> tuple:
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in batch)


def _same_on_every_rank(batch: tuple, ctx: RankContext) -> tuple:
    """The batch as rank 0 has it (the input convention: every rank passes the same global batch)."""
    out = []
    for t in batch:
        if isinstance(t, torch.Tensor) and ctx.world > 1:
            t = t.clone().contiguous()
            dist.broadcast(t, src=0)
        out.append(t)
    return tuple(out)


def run_module_rank(ctx: RankContext, pcg: PCG, graph: Graph, model_spec: str, data_path: str | None,
                    config: TrainConfig) -> dict:
    """One rank of `parsat run plan.json --model model.py:factory`: the user's module trained as the plan,
    and with `config.check`, the unmodified module trained in this process with the same batches, masks
    and optimizer, compared step by step (`compare_values`)."""
    from parsat.importer.model_file import load_model_factory

    torch.manual_seed(config.seed)  # a factory that draws weights or inputs draws the same on every rank
    module, example = load_model_factory(model_spec)
    dtype = config.torch_dtype()
    module = module.to(dtype)
    example = _cast(example_tuple(example), dtype)
    data = None
    if data_path is not None:
        try:
            data = torch.load(data_path, weights_only=True)
        except Exception as err:  # noqa: BLE001 - a user's file
            raise ExecutionError(f"cannot read --data {data_path}: {type(err).__name__}: {err}") from None
    batches = [_same_on_every_rank(_cast(b, dtype), ctx) for b in _batches(example, data, config.steps)]
    imported = import_module(module, example, check=False)   # the plan's graph, checked when it was imported
    difference = graph_difference(imported.graph, graph)
    if difference:
        raise ExecutionError(difference)
    pmodule = ParallelModule(module, imported, pcg, ctx, dtype, config.seed)
    reference = copy.deepcopy(module) if config.check else None  # after the broadcast: rank 0's weights
    if reference is not None:
        with torch.no_grad():
            for name, value in pmodule.program.weights.items():
                reference.get_parameter(pmodule.parameter(name)).copy_(value)
    optimizer = Optimizer(list(pmodule.parameters()), config)
    ref_params = list(reference.parameters()) if reference is not None else []
    ref_optimizer = Optimizer(ref_params, config) if reference is not None else None
    losses, times, comm, found = [], [], [], Comparison()
    for step, batch in enumerate(batches):
        pmodule.counter = CommCounter()
        start = ctx.step_start()
        loss = pmodule(*batch)
        value = loss if isinstance(loss, torch.Tensor) else loss[0]
        optimizer.zero_grad()
        value.sum().backward() if value.dim() else value.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(float(value.detach().sum()))
        comm.append(step_comm(pmodule.counter, pcg.mesh))
        if reference is not None:
            found = found.merge(_reference_step(reference, ref_optimizer, imported, pmodule, batch, step, value))
    report = {"rank": ctx.rank, "losses": losses, "step_times": times, "comm": comm,
              "max_abs_diff": found.max_abs if reference is not None else None,
              "max_rel_diff": found.max_rel if reference is not None else None, "worst": found.worst,
              "nonfinite": list(found.nonfinite[:20]), "peak_memory_bytes": 0, "process_rss_bytes": 0}
    report["job"] = _job_summary(report, ctx)
    return report


def run_module_many(ctx: RankContext, jobs: Sequence[tuple[str, PCG, Graph, str]], config: TrainConfig) -> dict:
    """Several `(label, pcg, graph, model_spec)` module runs trained in turn in one process group: label -> this
    rank's `run_module_rank` report (each run seeds itself, so the order does not matter).

    For tests that run many small modules: one launch instead of one per module (process start-up, each rank
    importing torch, dominates them), as `executor.run_many` is for plans."""
    return {label: run_module_rank(ctx, pcg, graph, spec, None, config) for label, pcg, graph, spec in jobs}


def _reference_step(reference, optimizer: Optimizer, imported: ImportedModule, pmodule: ParallelModule,
                    batch: tuple, step: int, loss: torch.Tensor) -> Comparison:
    """One step of the unmodified module, then every compared value of this rank against it."""
    reference.train()
    with ReferenceDropout(imported.dropout, pmodule.seed, step):
        want = reference(*batch)
    want_loss = want if isinstance(want, torch.Tensor) else torch.utils._pytree.tree_leaves(want)[0]
    optimizer.zero_grad()
    want_loss.sum().backward() if want_loss.dim() else want_loss.backward()
    optimizer.step()
    rank = pmodule.ctx.rank
    pairs = [("loss", loss.detach(), want_loss.detach())]
    for name, (placement, shape) in pmodule.piece_placements().items():
        where = piece_index(placement, shape, pmodule.pcg.mesh, rank)
        piece = pmodule.named_pieces()[name]
        ref = reference.get_parameter(name)
        pairs.append((f"gradient of {name}", gradient_of(piece), gradient_of(ref)[where]))
        pairs.append((f"weight {name}", piece.detach(), ref.detach()[where]))
    pairs += running_stats.compared(pmodule.module, reference, imported.running_stats)
    return compare_values(pairs)


def run_module_plan(pcg: PCG, graph: Graph, model_spec: str, data_path: str | None, nproc: int,
                    config: TrainConfig, predicted=None, backend: str | None = None, timeout_s: float = 600.0,
                    collective_timeout_s: float = 30.0):
    """`parsat run plan.json --model model.py:factory`: the module trained as `pcg` (a plan's, or one of its
    baselines') on `nproc` ranks; `graph` is the plan's graph, which the module's must equal."""
    from parsat.backend.executor import RunResult
    from parsat.backend.launch import LaunchConfig, launch

    if config.steps < 1:
        raise ExecutionError(f"--steps must be >= 1, got {config.steps}")
    if pcg.zero:
        raise ExecutionError(_ZERO.format(stage=pcg.zero))
    check_mesh(pcg, nproc)  # before any rank starts
    from parsat.importer.model_file import load_model_factory
    module, _example = load_model_factory(model_spec)
    difference = weights_difference(module, graph)   # before any rank starts (each exports the module: seconds)
    del module, _example
    if difference:
        raise ExecutionError(difference)
    reports = launch(run_module_rank, (pcg, graph, model_spec, data_path, config),
                     LaunchConfig(nproc=nproc, backend=backend, timeout_s=timeout_s,
                                  collective_timeout_s=collective_timeout_s))
    return RunResult.of_job(reports, config, predicted, recompute=pcg.recompute)


__all__ = ["run_module_plan", "ParallelModule", "ParallelizeError", "ReferenceDropout", "gather_weights", "parallelize",
           "run_module_many", "run_module_rank"]
