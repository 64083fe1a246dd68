"""A pipelined plan applied with `torch.distributed.pipelining`: the module cut into stages, trained with `step`.

Under torchrun, every rank calls

    model = parsat.parallelize(module, plan, example_inputs, runtime="torch")   # a PipelinedModule
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # this rank's stage's parameters
    for ids, labels in loader:                 # one step's local batch (`local_batch` cuts a global one)
        loss = model.step(ids, labels)         # forward and backward of every micro-batch, in the schedule
        model.clip_grad_norm_(1.0)             # the norm over every stage (a tied weight counted once)
        optimizer.step(); optimizer.zero_grad()

`apply_pipeline` does, in this order (docs/TORCH_NATIVE.md, "Pipelining"):

1. rank 0's parameters and buffers broadcast (every rank traces the same module);
2. the job's `DeviceMesh`: the pipeline axis `pp` (major: rank r is
   stage r // S), then the stage mesh's axes (a one-rank `stage` axis for
   one-device stages);
3. `pipeline()` traces the module on one micro-batch and cuts it before
   each chunk's first block (`SplitPoint.BEGINNING`); each stage module
   must hold exactly the parameters of the weights its chunk reads (a tied
   embedding on the first and last stage); the module's inputs are carried
   from stage to stage (`_PassInputsThrough`), so labels reach the stage
   that computes the loss as an activation of the stage before it;
4. on this rank's stage modules, each block's forward under
   `torch.utils.checkpoint` when the plan recomputes blocks, then the
   stage plan's tensor axis (`apply.traced_tensor_parallel`: each
   parameter a DTensor on the stage's tensor-parallel slice, `Shard(d)`
   as the plan stores it, the stage's inputs entering as `Replicate()`
   DTensors and its outputs leaving whole; where the plan keeps every
   crossing split along the sequence, each tp rank sending and receiving
   its `Shard(1)` piece instead, `_sequence_pieces`), then its data / ZeRO-3 axes
   (`apply.data_parallel`: `replicate` or `fully_shard` over the stage's
   slice of the mesh), or `replicate` over the one-rank `stage` axis: every
   parameter a DTensor;
5. `build_stage` for each of this rank's chunks (over the `pp` group of
   this local rank), and the plan's schedule with its micro-batch count.
   The module's forward returns the loss (a mean over its micro-batch);
   the schedule backpropagates it and divides the gradients by the
   micro-batch count (`scale_grads`), so a step's gradient is the whole
   batch's mean's.

Every rank passes a batch of one shape in a step: the ranks exchange
their shapes first (`batch_agreement`), and refuse together, naming them.
A step's batch of another shape (micro-batch size, sequence length) is
traced again at its first step (the module kept for it holds no parameter
values between traces: `release_parameters`, `materialized`; the module
passed to `parallelize` is the pipelined module's from then on, its
trained weights `model.state_dict()`): step 3's trace and graph changes, the new
graphs installed in the stage modules of step 4 (`stage_graphs`: their
parameters, hooks and the optimizer's state untouched), new
`PipelineStage`s and the plan's schedule over them; each shape's kept, and
a shape the plan cannot cut refused by name first (`runnable_shape`).

With a tensor axis, the schedule runs under `apply.dtensor_step` (the
traced graph's own tensors `Replicate()`, CPU attention as its math
decomposition) and each gradient is then placed as its parameter.
`step` then sums the gradients of each weight several stages hold over
those stages (local rank i with local rank i), and returns the step's loss
(the micro-batches' mean) on every rank. `clip_grad_norm_` needs the norm
over every stage: each stage's (DTensor) norm, a shared weight counted on
its first stage only, summed over the `pp` group.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import distribute_tensor

from parsat.backend.torch_native.apply import (LOWERING_ATTRIBUTE, NativeParallelizeError, broadcast_state,
                                              checkpoint_blocks, data_parallel, dtensor_step, sequence_piece,
                                              traced_graph_passes, traced_parameters_placed, with_policy_axis)
from parsat.backend.torch_native.batch_agreement import check_same_batch
from parsat.backend.torch_native.lowering import SEQ_DIM
from parsat.backend.torch_native.pipeline_lowering import STAGE_AXIS_NAME, PIPELINE_AXIS_NAME, PipelineLowering
from parsat.backend.torch_native.stage_graphs import StageGraphs, graphs_of, install

TRACED_PREFIX = "module."   # the traced wrapper's name for the user's module


class _PassInputsThrough(nn.Module):
    """The user's module with its inputs carried from stage to stage, for tracing.

    torch's traced stages take the step's arguments on the first stage only
    (labels the last stage reads would be a root argument there, which torch
    refuses), and the multi-chunk schedules (interleaved) send only between
    adjacent chunks. So each input is copied first (the copy is made on the
    first stage), and at each cut a no-op in-place copy of it (`t.copy_(t)`,
    a forward pre-hook of the module the cut is before, traced on the stage
    before the cut) makes the next stage read it from the stage just before:
    an input hops along every stage up to the last that reads it, the same
    values, never changed. The traced copies are then made out of place
    (`_relays_out_of_place`), so no saved input is modified."""

    def __init__(self, module: nn.Module, cuts: Sequence[str]):
        super().__init__()
        self.module = module
        self.cuts = tuple(cuts)

    def forward(self, *inputs):
        carried = [x.clone() for x in inputs if isinstance(x, torch.Tensor)]

        def relay(_module, _args):
            for t in carried:
                t.copy_(t)

        hooks = [self.module.get_submodule(cut).register_forward_pre_hook(relay) for cut in self.cuts]
        try:
            it = iter(carried)
            return self.module(*(next(it) if isinstance(x, torch.Tensor) else x for x in inputs))
        finally:
            for hook in hooks:
                hook.remove()


def _module_loss(output, _target):
    """The schedule's loss: the module's own output (its forward computes the loss)."""
    if not isinstance(output, torch.Tensor) or output.dim() != 0:
        raise NativeParallelizeError("a pipelined module's forward must return its loss (a scalar mean over its "
                                     f"micro-batch); it returned {type(output).__name__}"
                                     f"{list(output.shape) if isinstance(output, torch.Tensor) else ''}")
    return output


BatchShape = tuple[tuple[tuple[int, ...], torch.dtype], ...]   # each input's shape and dtype: what a trace fixes


@dataclass(frozen=True)
class _ShapeRun:
    """What runs a step of one batch shape: the stage modules' graphs traced at it, and the schedule over the
    `PipelineStage`s built on them (their buffers sized by those graphs)."""

    graphs: tuple[StageGraphs, ...]
    schedule: object


class PipelinedModule:
    """This rank's part of a pipelined module: its stage modules, their `PipelineStage`s and the schedule
    (module docstring). Parameters keep the module's own names. A batch of another shape re-traces the module
    (`module`, kept for it, its parameters emptied between traces) and runs the new graphs on these stage modules
    (`stage_graphs`): one set of
    parameters, the plan's schedule and micro-batch count, each shape's graphs and schedule kept."""

    def __init__(self, lowering: PipelineLowering, module: nn.Module, modules: Sequence[nn.Module], stage: int,
                 mesh, shared_groups: dict, device: torch.device = torch.device("cpu")):
        self.lowering = lowering
        self.device = device
        self.stage_modules = tuple(modules)
        self.stage = stage
        self.mesh = mesh
        self.pp_group = mesh[PIPELINE_AXIS_NAME].get_group()
        self.shared_groups = shared_groups
        self._module = module   # the user's module, traced again at a new batch shape (its values unread)
        self._released = release_parameters(module)   # ... so its parameters hold no values between traces
        self._runs: dict[BatchShape, _ShapeRun] = {}
        self._installed: BatchShape | None = None
        self.traces = 0   # how many times the module was traced (once at parallelize, once per new shape)
        setattr(self, LOWERING_ATTRIBUTE, lowering)

    @property
    def traced_shapes(self) -> tuple[BatchShape, ...]:
        """The batch shapes this module has stages for, in the order first met."""
        return tuple(self._runs)

    @property
    def schedule(self):
        """The schedule of the batch shape the stage modules run now."""
        return self._runs[self._installed].schedule

    def _add_run(self, shape: BatchShape, stages: Sequence) -> None:
        self._runs[shape] = _ShapeRun(tuple(graphs_of(sub, sub) for sub in self.stage_modules),
                                      _schedule(self.lowering, list(stages)))
        self._installed = shape
        self.traces += 1

    def __call__(self, *args, **kwargs):
        raise NativeParallelizeError("a pipelined module runs whole steps: call model.step(*batch) (forward and "
                                     "backward of every micro-batch in the plan's schedule) instead of model(*batch) "
                                     "and loss.backward()")

    @property
    def first(self) -> bool:
        """Whether this rank's stage reads the step's inputs."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """Whether this rank's stage computes the loss."""
        return self.stage == self.lowering.degree - 1

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the module's names, each once."""
        seen = set()
        for module in self.stage_modules:
            for name, param in module.named_parameters():
                name = name[len(TRACED_PREFIX):] if name.startswith(TRACED_PREFIX) else name
                if name not in seen:
                    seen.add(name)
                    yield name, param

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (for its optimizer)."""
        return (param for _, param in self.named_parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under the module's names (DTensors on its stage's mesh), for
        `torch.distributed.checkpoint`: `dcp.save(model.state_dict(), ...)` on every rank writes the whole module
        (each stage its own keys, a weight several stages hold once: equal on every stage after each step), which
        loads into the unmodified module in one process, and into a PipelinedModule of another plan on another
        rank count (`load_state_dict`; tests/test_torch_native_pipeline.py). A tied parameter is there
        under every name the module gives it (the tracer keeps one: HF BERT's last stage holds
        `cls.predictions.decoder.bias`, whose module also names it `cls.predictions.bias`), as the module's own
        state dict has it."""
        held = dict(self.named_parameters())
        out = dict(held)
        for chunk in self.lowering.chunks_of(self.stage):
            for group in chunk.groups:
                found = next((held[name] for name in group if name in held), None)
                if found is not None:
                    out.update((name, found) for name in group)
        return out

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> list[str]:
        """This rank's parameters set from `state_dict`, by the module's names, in place (an optimizer built on
        `parameters()` keeps them): the usual `state = model.state_dict(); dcp.load(state, checkpoint_id=...);
        model.load_state_dict(state)`, or a whole module's plain state dict (`torch.load` of the unmodified
        module's), each tensor then cut to this rank's piece as its parameter is placed (no communication: every
        rank holds the whole value). Keys of weights other stages hold are ignored (a whole module's state dict
        is what every stage is given); returns the keys of this stage's parameters `state_dict` lacks, which
        `strict` refuses. A value of another shape is refused, naming it, before any parameter is changed."""
        own = self.state_dict()
        missing = sorted(name for name in own if name not in state_dict)
        if missing and strict:
            raise NativeParallelizeError(f"the state dict lacks {len(missing)} parameter(s) pipeline stage "
                                         f"{self.stage} holds: {', '.join(missing[:5])}")
        for name, param in own.items():
            if name in state_dict and tuple(state_dict[name].shape) != tuple(param.shape):
                raise NativeParallelizeError(f"the state dict's {name} is {list(state_dict[name].shape)}; "
                                             f"pipeline stage {self.stage} holds it as {list(param.shape)}")
        with torch.no_grad():
            for name, param in own.items():
                value = state_dict.get(name)
                if value is None or value is param:
                    continue
                if hasattr(param, "device_mesh") and not hasattr(value, "device_mesh"):
                    value = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh,
                                              param.placements, src_data_rank=None)
                elif hasattr(value, "device_mesh") and not hasattr(param, "device_mesh"):
                    value = value.full_tensor()
                param.copy_(value)
        return missing

    def get_parameter(self, name: str) -> nn.Parameter:
        """This rank's parameter `name` (the module's name)."""
        for found, param in self.named_parameters():
            if found == name:
                return param
        raise AttributeError(f"pipeline stage {self.stage} holds no parameter {name!r}")

    def held_parameter(self, names: Sequence[str]) -> nn.Parameter:
        """This rank's parameter of a weight the module names `names` (a tied one several ways: the tracer keeps one
        name a stage, the one that stage's code reads it by: HF GPT-2's `wte` on the first, `lm_head` on the
        last)."""
        held = dict(self.named_parameters())
        for name in names:
            if name in held:
                return held[name]
        raise AttributeError(f"pipeline stage {self.stage} holds no parameter {' = '.join(names)}")

    def step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one step's local batch (every rank passes it, of one shape on every rank; the
        first stage reads it), cut into the plan's micro-batches and run in its schedule; the shared weights'
        gradients summed over their stages. Returns the step's loss (the micro-batches' mean) on every rank. A
        batch shape not met before is traced first (`_run_for`); one the plan cannot cut is refused by name
        before anything runs; ranks passing batches of different shapes are refused on every rank, naming them
        (`batch_agreement`: one small exchange a step, before the schedule)."""
        check_same_batch(inputs, self.device)
        m = self.lowering.microbatches
        schedule = self._run_for(inputs)
        losses: list[torch.Tensor] = []
        target = torch.zeros(m)   # the schedule splits a target per micro-batch; the module computes its own loss
        tensor_parallel = self.lowering.stage is not None and self.lowering.stage.tensor_axis is not None
        try:
            with dtensor_step(self.device) if tensor_parallel else contextlib.nullcontext():
                schedule.step(*(inputs if self.first else ()), target=target, losses=losses,
                              return_outputs=False)
        except NotImplementedError as err:   # DTensor's: an operator without a sharding rule
            if not tensor_parallel:
                raise
            raise NativeParallelizeError("tensor parallelism inside a pipeline stage runs the traced stage's aten "
                                         f"operators on DTensors, and DTensor cannot run one of them: {err}") from err
        if tensor_parallel:
            self._grads_placed_as_parameters()
        self._sum_shared_gradients()
        loss = torch.stack([x.detach() for x in losses]).mean() if self.last else torch.zeros(())
        last_rank = dist.get_global_rank(self.pp_group, self.lowering.degree - 1)
        loss = loss.to(torch.float64)
        dist.broadcast(loss, src=last_rank, group=self.pp_group)
        return loss

    def _run_for(self, inputs: Sequence[torch.Tensor]):
        """The schedule that runs a batch of these inputs' shape, its graphs installed in the stage modules: traced
        now if the shape is new (the user's module cut as at `parallelize`, the new stage modules' graphs put in
        this rank's stage modules, new `PipelineStage`s on them), else the kept ones. Refused first, by name, where
        the plan cannot cut the batch (`runnable_shape`)."""
        shape = runnable_shape(self.lowering, inputs, self._arity())
        if shape not in self._runs:
            micro = _first_microbatch(tuple(inputs), self.lowering.microbatches)
            with materialized(self._module, self._released, self.device):
                pipe = _traced_pipe(self._module, self.lowering, micro, self.device)
            chunks, graphs = self.lowering.chunks_of(self.stage), []
            for chunk, kept in zip(chunks, self.stage_modules):   # every chunk's graphs checked before any installed
                traced = pipe.get_stage_module(chunk.index)
                _check_stage_params(traced, chunk)
                _stage_graph_passes(traced, chunk.index, self.lowering, self.mesh)
                graphs.append((traced, graphs_of(traced, kept)))
            stages = []
            for chunk, kept, (traced, made) in zip(chunks, self.stage_modules, graphs):
                install(kept, made)
                # torch's stage is built on the module pipe holds under that index: the kept one, with the new graphs
                name = next(n for n, sub in pipe.split_gm.named_children() if sub is traced)
                setattr(pipe.split_gm, name, kept)
                stages.append(pipe.build_stage(chunk.index, self.device, group=self.pp_group))
            self._add_run(shape, stages)
        elif shape != self._installed:
            for kept, graphs in zip(self.stage_modules, self._runs[shape].graphs):
                install(kept, graphs)
            self._installed = shape
        return self._runs[shape].schedule

    def _arity(self) -> int:
        return len(next(iter(self._runs)))

    def _grads_placed_as_parameters(self) -> None:
        """Each DTensor gradient in its parameter's placements: DTensor's backward may leave one otherwise (a
        `Shard(0)` table's gradient `Replicate()`), which the shared weights' sum (local pieces) and the optimizer
        would read as another layout."""
        for param in self.parameters():
            grad = param.grad
            if grad is not None and hasattr(grad, "placements") and grad.placements != param.placements:
                param.grad = grad.redistribute(param.device_mesh, param.placements)

    def _sum_shared_gradients(self) -> None:
        for names, stages in self.lowering.shared:
            if self.stage not in stages:
                continue
            param = self.held_parameter(names)
            if param.grad is not None:
                dist.all_reduce(_local(param.grad), group=self.shared_groups[stages])

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the whole pipelined module: the norm of every stage's gradients
        (a weight several stages hold counted once), the same on every rank; this rank's gradients scaled."""
        params = [p for p in self.parameters() if p.grad is not None]
        counted = [p for name, p in self.named_parameters() if p.grad is not None and self._counts(name)]
        norm = torch.nn.utils.get_total_norm([p.grad for p in counted], norm_type)
        norm = _whole(norm).to(torch.float64)
        if math.isinf(norm_type):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=self.pp_group)
        else:
            norm = norm ** norm_type
            dist.all_reduce(norm, group=self.pp_group)
            norm = norm ** (1.0 / norm_type)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def _counts(self, name: str) -> bool:
        """Whether this stage counts parameter `name` (any name of it) in the norm: a shared weight on its first
        stage only."""
        for names, stages in self.lowering.shared:
            if name in names:
                return self.stage == min(stages)
        return True


def release_parameters(module: nn.Module) -> dict[int, tuple[nn.Parameter, torch.Size, torch.dtype]]:
    """Each parameter of the user's module (each once) emptied, its shape and dtype kept: after `parallelize` the
    stage modules train their own parameters (DTensors, FSDP's), and re-tracing at a new shape reads the module's
    code, shapes and dtypes, not its values, so the whole module's values need not stay on every rank between
    traces (`materialized` gives the trace uninitialized tensors of those shapes). Its buffers stay: a trace
    lifts them into the stage graphs it makes (`stage_graphs.graphs_of`)."""
    held = {}
    with torch.no_grad():
        for param in module.parameters():
            held[id(param)] = (param, param.shape, param.dtype)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return held


@contextlib.contextmanager
def materialized(module: nn.Module, released: Mapping, device: torch.device):
    """The released parameters (`release_parameters`) as uninitialized tensors of their shapes on `device` for the
    duration (a trace), emptied again after."""
    with torch.no_grad():
        for param, shape, dtype in released.values():
            param.data = torch.empty(shape, dtype=dtype, device=device)
    try:
        yield module
    finally:
        with torch.no_grad():
            for param, _shape, dtype in released.values():
                param.data = torch.empty(0, dtype=dtype, device=device)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def apply_pipeline(module: nn.Module, lowering: PipelineLowering, example_inputs: tuple, device: torch.device,
                   mp_policy=None) -> PipelinedModule:
    """`lowering` applied on this rank (module docstring); `example_inputs` is one step's local batch (the first
    shape traced; `step` traces others as it meets them)."""
    from torch.distributed.device_mesh import init_device_mesh

    inputs = tuple(example_inputs)
    runnable_shape(lowering, inputs)
    micro = _first_microbatch(inputs, lowering.microbatches)
    module.to(device)
    broadcast_state(module)
    shape, names = lowering.device_mesh_shape()
    if lowering.stage is not None:   # a stage plan without a data axis: a one-rank axis for mp_policy's replicate
        shape, names = with_policy_axis(shape, names, lowering.stage, mp_policy)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    rank, stage_devices = dist.get_rank(), lowering.stage_devices
    stage = rank // stage_devices
    pipe = _traced_pipe(module, lowering, micro, device)
    pp_group = mesh[PIPELINE_AXIS_NAME].get_group()
    modules, stages = [], []
    for chunk in lowering.chunks_of(stage):
        sub = pipe.get_stage_module(chunk.index)
        _check_stage_params(sub, chunk)
        _tie_within(sub, chunk)
        _stage_graph_passes(sub, chunk.index, lowering, mesh)
        checkpoint_blocks(sub, lowering.recompute, prefix=TRACED_PREFIX)
        if lowering.stage is None:
            from torch.distributed._composable.replicate_with_fsdp import replicate
            from torch.distributed.fsdp import MixedPrecisionPolicy

            replicate(sub, mesh=mesh[STAGE_AXIS_NAME], mp_policy=stage_policy(sub, chunk.index, mp_policy)
                      or MixedPrecisionPolicy())
        else:
            if lowering.stage.tensor_axis is not None:
                _stage_tensor_parallel(sub, chunk.index, lowering, mesh)
            data_parallel(sub, lowering.stage, mesh, stage_policy(sub, chunk.index, mp_policy), prefix=TRACED_PREFIX)
        modules.append(sub)
        stages.append(pipe.build_stage(chunk.index, device, group=pp_group))
    shared = _shared_groups(lowering, stage_devices)
    pipelined = PipelinedModule(lowering, module, modules, stage, mesh, shared, device)
    pipelined._add_run(runnable_shape(lowering, inputs), stages)
    _carry_zero1(pipelined, modules)
    return pipelined


def runnable_shape(lowering: PipelineLowering, inputs: Sequence, arity: int | None = None) -> BatchShape:
    """The batch shape of one step's local `inputs` (each tensor's shape and dtype: what a trace fixes), refused by
    name where the plan cannot run it: `arity` tensors (the traced step's), each with a batch dim the plan's
    micro-batches divide; where the stage plan sends pieces of the crossings on its tensor axis, the tp ranks
    dividing what they split (each input's sequence dim, or the micro-batch). Torch's stage would otherwise fail
    inside the schedule, one rank at a time."""
    m = lowering.microbatches
    if arity is not None and len(inputs) != arity:
        raise NativeParallelizeError(f"step takes the {arity} tensor(s) parallelize was given; got {len(inputs)}")
    for x in inputs:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] % m:
            raise NativeParallelizeError(f"the plan's {m} micro-batches must divide each input's first dim (the "
                                         "local batch); got "
                                         f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if lowering.sequence_crossings:
        tp = lowering.stage.mesh.shape[lowering.stage.tensor_axis]
        for x in inputs:
            size = x.shape[0] // m if lowering.piece_dim == 0 else x.shape[SEQ_DIM] if x.dim() > SEQ_DIM else tp
            if size % tp:
                along = "micro-batch" if lowering.piece_dim == 0 else "sequence"
                raise NativeParallelizeError(f"the stages send each tp rank its piece of the {along} (dim "
                                             f"{lowering.piece_dim}), which the {tp} tp ranks must divide; the input "
                                             f"{list(x.shape)} gives a {along} of {size}")
    return tuple((tuple(x.shape), x.dtype) for x in inputs)


def _traced_pipe(module: nn.Module, lowering: PipelineLowering, micro: tuple, device: torch.device):
    """`pipeline()` on one micro-batch of the module with its inputs carried along (`_PassInputsThrough`), cut
    before each chunk's first block, its graphs made ready to send (the relays out of place, the outputs
    contiguous). `pipeline()` marks the cut submodules' forwards; the marks are taken off again, so the module
    can be traced once more (marked twice, the mark saves itself as the forward it wraps, and the next trace
    fails with a RecursionError under torch.export)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    cuts = lowering.split_points()
    split = {TRACED_PREFIX + name: SplitPoint.BEGINNING for name in cuts}
    marked = [module.get_submodule(name) for name in cuts]
    own = [sub.__dict__.get("forward") for sub in marked]
    try:
        pipe = pipeline(_PassInputsThrough(module, cuts), mb_args=tuple(x.to(device) for x in micro),
                        split_spec=split)
    except Exception as err:   # torch.export's own errors: say which step failed, keep torch's message
        raise NativeParallelizeError(f"torch.distributed.pipelining.pipeline() could not trace and cut the module "
                                     f"before {', '.join(cuts)} at micro-batch "
                                     f"{[list(x.shape) for x in micro]}: {type(err).__name__}: {err}") from None
    finally:
        for sub, forward in zip(marked, own):
            sub.__dict__.pop("_orig_forward", None)
            if forward is None:
                sub.__dict__.pop("forward", None)
            else:
                sub.forward = forward
    _relays_out_of_place(pipe.split_gm)
    _contiguous_outputs([pipe.get_stage_module(i) for i in range(pipe.num_stages)])
    if pipe.num_stages != len(lowering.chunks):
        raise NativeParallelizeError(f"the traced module has {pipe.num_stages} stages, the plan "
                                     f"{len(lowering.chunks)} chunks")
    return pipe


def _stage_graph_passes(sub: nn.Module, index: int, lowering: PipelineLowering, mesh) -> None:
    """What the stage plan's tensor axis changes in chunk `index`'s traced graphs (none without one): the values
    crossing as pieces sized so (`_sequence_pieces`), the products, lookups and loss on local pieces
    (`apply.traced_graph_passes`). Run on each trace, the first and every new shape's."""
    if lowering.stage is None or lowering.stage.tensor_axis is None:
        return
    if lowering.sequence_crossings:
        tp_name = lowering.stage.mesh.names[lowering.stage.tensor_axis]
        _sequence_pieces(sub, mesh[tp_name].size(), index > 0, lowering.piece_dim)
    traced_graph_passes(sub, lowering.stage, prefix=TRACED_PREFIX, sequence=lowering.sequence_crossings,
                        regather=lowering.regathers, recomputed=lowering.recompute)


def _stage_tensor_parallel(sub: nn.Module, index: int, lowering: PipelineLowering, mesh) -> None:
    """Chunk `index`'s stage module on the stage plan's tensor axis (`apply.traced_tensor_parallel`, its graphs
    changed already by `_stage_graph_passes`): its parameters placed, its inputs and outputs hooked. Where the
    plan keeps the crossings split along the sequence, the chunk sends and receives them as this rank's `Shard(1)`
    pieces (each tp rank to the same tp rank of the next stage, as Megatron does and the cost model prices them,
    `cost.pipeline.transfer_seconds`): its traced buffers are sized so (`_sequence_pieces`); chunk 0's inputs are
    the step's, whole."""
    tp_name = lowering.stage.mesh.names[lowering.stage.tensor_axis]
    traced_parameters_placed(sub, lowering.stage, mesh[tp_name], prefix=TRACED_PREFIX,
                             sequence=lowering.sequence_crossings, received=index > 0, piece_dim=lowering.piece_dim)


def _sequence_pieces(sub: nn.Module, tp: int, received: bool, dim: int = SEQ_DIM) -> None:
    """The traced stage module's floating outputs (and, when `received`, its floating inputs) with a sequence dim
    given the shape of one tp rank's `Shard(1)` piece in their traced values: torch's `PipelineStage` makes its
    receive buffers (activations forward, gradients backward) and checks what it sends from those values, and the
    stage now sends pieces (`apply.sequence_piece`; `dim`: the dim they are split along, the sequence's or, where
    the plan splits the residual stream along the batch, 0). A dim the tp ranks do not divide is refused by name
    (uneven pieces would make each rank's buffers another shape)."""
    graph = sub.graph
    out = next(node for node in graph.nodes if node.op == "output")
    inputs = [n for n in graph.nodes if n.op == "placeholder"] if received else []
    for node in inputs + _flat_nodes(out.args):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or not sequence_piece(value, dim):
            continue
        if value.shape[dim] % tp:
            along = "sequence" if dim == SEQ_DIM else "batch"
            raise NativeParallelizeError(f"the traced stage's {node.name} {list(value.shape)} crosses between "
                                         f"stages split along the {along} (dim {dim}) on {tp} tp ranks, which "
                                         "do not divide it")
        shape = (*value.shape[:dim], value.shape[dim] // tp, *value.shape[dim + 1:])
        mode = getattr(value, "fake_mode", None)
        with mode if mode is not None else contextlib.nullcontext():
            node.meta["val"] = value.new_empty(shape)


def stage_policy(sub: nn.Module, index: int, mp_policy):
    """`mp_policy` for stage module `index` (traced): the user's policy, its stage's outputs cast back to the dtype
    they were traced in. torch's `PipelineStage` sizes its receive buffers from the trace (the module's dtype), and
    a stage computing in bf16 sends bf16 values into them: on gloo they arrive as other bytes, and the next stage
    computes on garbage without an error (a bf16 policy left as given: the first loss 4 % off one process's, where
    bf16 itself is 0.1-0.2 % off). So the crossings travel in the traced dtype (fp32: twice the bytes of Megatron's
    bf16 sends; the next stage casts them to `param_dtype` on entry, `cast_forward_inputs`). A policy asking for
    another `output_dtype` is refused by name."""
    if mp_policy is None:
        return None
    from dataclasses import replace

    out = next(n for n in sub.graph.nodes if n.op == "output")
    traced = {n.meta["val"].dtype for n in _flat_nodes(out.args)
              if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point()}
    if len(traced) > 1:
        raise NativeParallelizeError(f"mp_policy on a pipelined plan: stage module {index} sends values traced in "
                                     f"{sorted(map(str, traced))}, and FSDP2 casts a module's outputs to one dtype")
    if mp_policy.output_dtype is not None and traced and mp_policy.output_dtype not in traced:
        raise NativeParallelizeError(
            f"mp_policy's output_dtype {mp_policy.output_dtype} on a pipelined plan: stage module {index} sends "
            f"values traced in {sorted(map(str, traced))}, and torch's pipeline stages receive them so (leave "
            "output_dtype unset: each stage's outputs are cast back to the traced dtype)")
    return replace(mp_policy, output_dtype=next(iter(traced))) if traced else mp_policy


def _flat_nodes(args) -> list:
    """The fx nodes in an output node's (nested) arguments, in order."""
    found: list = []
    torch.fx.node.map_arg(args, found.append)
    return found


def _carry_zero1(pipelined: PipelinedModule, modules: Sequence[nn.Module]) -> None:
    """A stage plan with ZeRO-1 (`apply.data_parallel` marks each stage module with its data mesh and its
    coordinate beside it: `pp=1,tp=0`) marks the PipelinedModule too, so `zero.zero_optimizer(model, ...)`
    shards the optimizer state of every chunk this rank holds over the stage's data ranks, as Megatron's
    distributed optimizer runs beside pipeline parallelism. Without it the user's loop would get a whole
    optimizer on every rank, silently holding the memory the plan was priced without."""
    from parsat.backend.torch_native.zero import ZERO1_BESIDE_ATTRIBUTE, ZERO1_MESH_ATTRIBUTE

    for name in (ZERO1_MESH_ATTRIBUTE, ZERO1_BESIDE_ATTRIBUTE):
        values = [value for value in (getattr(sub, name, None) for sub in modules) if value is not None]
        if any(value != values[0] for value in values):   # one data mesh for all of this rank's chunks
            raise NativeParallelizeError(f"this rank's chunks carry different ZeRO-1 {name.strip('_')}s")
        if values:
            setattr(pipelined, name, values[0])


def _relays_out_of_place(root: nn.Module) -> None:
    """Each traced `copy_(t, t)` (`_PassInputsThrough`'s relay) becomes `clone(t)`: the same value, a new tensor,
    so the autograd graph's saved inputs (the ids an embedding's backward reads) keep their version."""
    copy_, clone = torch.ops.aten.copy_.default, torch.ops.aten.clone.default
    for sub in root.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        changed = False
        for node in graph.nodes:
            if node.op == "call_function" and node.target is copy_ and len(node.args) >= 2 and \
                    node.args[0] is node.args[1]:
                node.target, node.args, node.kwargs = clone, (node.args[0],), {}
                changed = True
        if changed and hasattr(sub, "recompile"):   # an fx GraphModule; an InterpreterModule runs its graph as it is
            sub.recompile()


def _contiguous_outputs(stage_modules: Sequence[nn.Module]) -> None:
    """Each traced stage module's outputs made contiguous (`Tensor.contiguous`, a no-op where they are), and the
    traced values its inputs and outputs carry too: gloo sends and receives contiguous tensors only, torch's stage
    makes its receive buffers (activations forward, gradients backward) with the traced values' strides, and a
    value crossing a cut may be a view (BERT's attention mask, a mask of ones expanded over the query positions,
    crosses from the stage that builds it to the next)."""
    for sub in stage_modules:
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        out = next(node for node in graph.nodes if node.op == "output")

        def contiguous(node: torch.fx.Node) -> torch.fx.Node:
            if not isinstance(node.meta.get("val"), torch.Tensor):
                return node
            made = graph.call_method("contiguous", (node,))
            made.meta = {**node.meta, "val": _contiguous_value(node.meta["val"])}
            return made

        with graph.inserting_before(out):
            out.args = torch.fx.map_arg(out.args, contiguous)
        for node in graph.nodes:
            if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
                node.meta["val"] = _contiguous_value(node.meta["val"])
        if hasattr(sub, "recompile"):
            sub.recompile()


def _contiguous_value(value: torch.Tensor) -> torch.Tensor:
    """A traced (fake) value with contiguous strides: the same shape and dtype."""
    if value.is_contiguous():
        return value
    mode = getattr(value, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        return value.contiguous()


def _first_microbatch(inputs: tuple, microbatches: int) -> tuple:
    """The first of the `microbatches` micro-batches of each input (a shape `runnable_shape` accepted)."""
    return tuple(x[: x.shape[0] // microbatches] for x in inputs)


def _check_stage_params(sub: nn.Module, chunk) -> None:
    """The traced stage module holds exactly the parameters of the weights the plan's chunk reads, each under one
    of its names at least (the tracer keeps a tied parameter under the name the stage's code reads it by)."""
    held = {n[len(TRACED_PREFIX):] for n, _ in sub.named_parameters(remove_duplicate=False)}
    want = set(chunk.params)
    missing = sorted(n for group in chunk.groups if not held & set(group) for n in group)
    extra = sorted(held - want)
    if extra or missing:
        raise NativeParallelizeError(f"the module cut by pipeline() does not follow the plan's chunk {chunk.index} "
                                     f"(layers {chunk.layers[0]}..{chunk.layers[-1]}): its stage module also holds "
                                     f"{extra[:4]} and lacks {missing[:4]}")


def _tie_within(sub: nn.Module, chunk) -> None:
    """A tied parameter the tracer gave a stage module twice, as two tensors under two names (HF GPT-2's first
    stage: `transformer.wte.weight`, which it reads, and an unread `lm_head.weight`): one tensor under both again,
    as in the user's module, so the optimizer and the checkpoint see the trained one."""
    for group in chunk.groups:
        held = [TRACED_PREFIX + name for name in group]
        found = [(name, sub.get_parameter(name)) for name in held if _holds(sub, name)]
        for name, param in found[1:]:
            if param is not found[0][1]:
                owner, _, local = name.rpartition(".")
                setattr(sub.get_submodule(owner), local, found[0][1])


def _holds(sub: nn.Module, name: str) -> bool:
    try:
        sub.get_parameter(name)
    except AttributeError:
        return False
    return True


def _schedule(lowering: PipelineLowering, stages: list):
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, lowering.torch_schedule)
    if lowering.torch_schedule == "ScheduleInterleaved1F1B":
        return cls(stages, lowering.microbatches, loss_fn=_module_loss)
    return cls(stages[0], lowering.microbatches, loss_fn=_module_loss)


def _shared_groups(lowering: PipelineLowering, stage_devices: int) -> dict:
    """Per shared weight's stages, this rank's group of twin ranks (local rank i of each of those stages); every
    rank makes every group, in one order, as `new_group` needs."""
    mine, rank = {}, dist.get_rank()
    for _, stages in lowering.shared:
        for local in range(stage_devices):
            ranks = [s * stage_devices + local for s in stages]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[stages] = group
    return mine
