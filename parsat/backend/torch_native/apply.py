"""A plan's lowering applied to the user's module, on every rank: DTensor parameters, torch's own parallelism.

Under torchrun (or `backend.launch`), every rank calls

    model = parsat.parallelize(model, plan, runtime="torch")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for ids, labels in loader:                     # this rank's local batch
        loss = model(ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(); optimizer.zero_grad()
    dcp.save(get_model_state_dict(model), checkpoint_id=path)

`entry.parallelize_native` reads the plan as `lowering.lower` says and
`apply_lowering` applies it in place, in this order (docs/TORCH_NATIVE.md):

1. rank 0's parameters and buffers are broadcast, so every rank starts
   from the same values (as DDP does);
2. the plan's mesh becomes a `DeviceMesh` (`init_device_mesh` with the
   plan's axis sizes and names; ranks laid out as the plan lays them, the
   last axis fastest);
3. on the tensor axis, `parallelize_module` with each module's style
   (`ColwiseParallel`, `RowwiseParallel`), and every other module that
   holds parameters computing with `Replicate()` DTensors
   (`distribute_module`); a tied parameter is tied again afterwards; a
   vocabulary-parallel loss leaves the head's logits a `Shard(-1)` DTensor
   and runs the module's cross-entropy as loss parallelism
   (`loss_parallel.install`);
4. on the data axes, `replicate` (`torch.distributed._composable.
   replicate_with_fsdp`: DDP's gradient all-reduce with DTensor
   parameters) or, for a ZeRO-3 axis, `fully_shard` on each block (each
   child of an `nn.ModuleList` holding parameters) and then the root, with
   the dim the plan shards each weight along; a plan's ZeRO-2 is
   `fully_shard(reshard_after_forward=False)` over its data axes, its
   ZeRO-1 `replicate` with `zero.zero_optimizer` sharding the state; a
   `MixedPrecisionPolicy` given as `mp_policy` goes to them (a plan with
   no data axis: `replicate` over a one-rank `policy` axis added to the
   mesh, `policy_on_one_rank`). Before all
   of these, a plan that recomputes blocks has each block's forward run
   under `torch.utils.checkpoint` (`checkpoint_blocks`).

The module returned is the user's (modified in place): its forward is its
own, run on this rank's local batch (`local_batch` cuts a global one as
the plan does), and every parameter is a DTensor on the plan's mesh (on
the data and tensor axes it uses).
"""

from __future__ import annotations

from math import prod
from functools import partial
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from parsat.backend.torch_native.lowering import (COLWISE, CONV1D, DATA, EMBEDDING, LINEAR, PREPARE_STYLE,
                                                  REPLICATE_STYLE,
                                                  ROWWISE, SEQ_DIM, SEQUENCE_STYLE, SPLIT, VOCAB, ZERO3, GATHERED,
                                                  Lowering, ModuleInfo, ParamInfo)

LOWERING_ATTRIBUTE = "_parsat_lowering"


class NativeParallelizeError(ValueError):
    """A module and plan that torch's stack cannot run together (the message says why, naming the node)."""


# ------------------------------------------------------------------ the module, described


def module_info(module: nn.Module, aliases: Mapping[str, str] | None = None) -> ModuleInfo:
    """What `lowering.lower` needs of `module`: parameters by every name (tied ones share one `ParamInfo`), each
    submodule's kind, the parameters each holds itself. `aliases` (graph weight -> parameter name, an import's
    `weights`) adds the graph's names: the importer names a stack's identical blocks `b{i}_...`, so a plan of
    a transformer names its weights so, not as the module does."""
    kinds: dict[str, str] = {}
    holds: dict[str, tuple[str, ...]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        kinds[name] = (LINEAR if isinstance(sub, nn.Linear) else EMBEDDING if isinstance(sub, nn.Embedding)
                       else CONV1D if _is_conv1d(sub) else type(sub).__name__)
        holds[name] = tuple(n for n, _ in sub.named_parameters(recurse=False, remove_duplicate=False))
    below = set()
    for name in holds:
        if holds[name]:
            parts = name.split(".") if name else []
            for i in range(len(parts)):
                below.add(".".join(parts[:i]))
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
        tensors[id(param)] = param
    params: dict[str, ParamInfo] = {}
    for key, names in groups.items():
        owners = tuple((n.rpartition(".")[0], kinds[n.rpartition(".")[0]]) for n in names)
        info = ParamInfo(tuple(names), tuple(tensors[key].shape), owners)
        for n in names:
            params[n] = info
    for graph_name, name in (aliases or {}).items():
        if graph_name not in params and name in params:
            params[graph_name] = params[name]
    return ModuleInfo(params, kinds, holds, frozenset(below))


def _is_conv1d(module: nn.Module) -> bool:
    """Whether `module` is transformers' `Conv1D` (GPT-2's projections: weight [in, out]), told by its class's name
    and module, so that transformers need not be imported."""
    kind = type(module)
    return kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers")


# ------------------------------------------------------------------ applying it


def apply_lowering(module: nn.Module, lowering: Lowering, device: torch.device, mp_policy=None,
                   blocks: bool = True, tensor_parallel=None) -> nn.Module:
    """`lowering` (of an unpipelined plan) applied to `module` in place on this rank (module docstring, steps 1-4);
    the process group is started and every rank holds the same plan (`entry.parallelize_native`). `blocks`:
    `fully_shard` each block before the root (False for a forward that calls no block: `rewritten`).
    `tensor_parallel(module, tp_mesh)`, when given, places the parameters on the tensor axis instead of the
    styles (`rewritten.place_parameters`: the plan's own placements, for a forward that calls no styled module)."""
    module.to(device)
    broadcast_state(module)
    checkpoint_blocks(module, lowering.recompute)
    mesh = _device_mesh(lowering, device, mp_policy)
    if lowering.tensor_axis is not None:
        tp_mesh = mesh[lowering.mesh.names[lowering.tensor_axis]]
        (tensor_parallel or partial(_tensor_parallel, lowering=lowering))(module, tp_mesh=tp_mesh)
    data_parallel(module, lowering, mesh, mp_policy, blocks=blocks)
    setattr(module, LOWERING_ATTRIBUTE, lowering)
    return module


def checkpoint_blocks(module: nn.Module, names: Sequence[str], prefix: str = "") -> None:
    """The plan's recomputation: each named block's forward run under `torch.utils.checkpoint` (non-reentrant),
    so its activations are recomputed in its backward instead of kept. The forward is wrapped in place (not
    `checkpoint_wrapper`, which renames the parameters), before `fully_shard` hooks the module's call. `prefix`:
    what `module`'s names carry before the plan's module's (a traced stage's); a block it lacks, or holds without
    parameters (a traced stage's scope of the next stage's block, with `pipelined`'s input relays only), is
    skipped."""
    from torch.utils.checkpoint import checkpoint

    held = dict(module.named_modules())
    for name in names:
        block = held.get(prefix + name)
        if block is not None and any(True for _ in block.parameters()):
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)


def lowering_of(module) -> Lowering:
    """The lowering `parallelize_native` applied to `module` (a `PipelineLowering` for a pipelined module)."""
    found = getattr(module, LOWERING_ATTRIBUTE, None)
    if found is None:
        raise NativeParallelizeError("this module was not parallelized with runtime='torch'")
    return found


def local_batch(module: nn.Module, *tensors: torch.Tensor, dim: int = 0, rank: int | None = None):
    """This rank's block of a global batch as the plan splits it (along `dim`, over the data axes, major first);
    every tensor-parallel rank of one data-parallel group takes the same block. One tensor in, one out. In a
    pipelined module, rank r is local rank r % S of its stage's S ranks, and the stage plan splits the batch."""
    return lowering_batch(lowering_of(module), *tensors, dim=dim, rank=rank)


def lowering_batch(lowering, *tensors: torch.Tensor, dim: int = 0, rank: int | None = None):
    """`local_batch` as `lowering` (a `Lowering` or `PipelineLowering`) splits it, before any module is lowered
    (the example batch a pipelined module is traced on)."""
    rank = (dist.get_rank() if rank is None else rank) % lowering.mesh.world
    coords = lowering.mesh.coords(rank)
    sizes = lowering.mesh.shape
    block, count = 0, prod(sizes[a] for a in lowering.batch_axes)
    for a in lowering.batch_axes:
        block = block * sizes[a] + coords[a]
    out = []
    for t in tensors:
        if t.shape[dim] % count:
            raise NativeParallelizeError(f"a batch of {t.shape[dim]} along dim {dim} does not split into {count} "
                                         "equal local batches")
        n = t.shape[dim] // count
        out.append(t.narrow(dim, block * n, n))
    return out[0] if len(out) == 1 else tuple(out)


def broadcast_state(module: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (each tensor once)."""
    seen = set()
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            dist.broadcast(t.data, src=0)


def _device_mesh(lowering: Lowering, device: torch.device, mp_policy=None):
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = with_policy_axis(lowering.mesh.shape, lowering.mesh.names, lowering, mp_policy)
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


# ------------------------------------------------------------------ a mixed-precision policy without a data axis

POLICY_AXIS_NAME = "policy"   # the one-rank mesh axis `replicate` carries a policy on where a plan has no data axis


def needs_policy_axis(lowering: Lowering, mp_policy) -> bool:
    """Whether `mp_policy` needs a mesh axis of its own: FSDP2 applies a `MixedPrecisionPolicy` through the
    module it manages (`replicate` / `fully_shard`), and a plan with no data or ZeRO axis (tensor parallelism
    alone) gives it none."""
    return mp_policy is not None and not (lowering.axes(DATA) or lowering.axes(ZERO3))


def with_policy_axis(shape: Sequence[int], names: Sequence[str], lowering: Lowering,
                     mp_policy) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The DeviceMesh's shape and names with a one-rank `policy` axis last where `needs_policy_axis`: one rank
    along it adds no rank, so every other axis keeps its ranks (the plan's layout), and `replicate` over it is
    FSDP2 on the same parent mesh as the tensor axis (its 2-D path: DTensor parameters on tp, `Replicate()` on
    the one rank)."""
    if not needs_policy_axis(lowering, mp_policy):
        return tuple(shape), tuple(names)
    return (*shape, 1), (*names, POLICY_AXIS_NAME)


def policy_on_one_rank(module: nn.Module, mesh, mp_policy) -> None:
    """`mp_policy` on a module whose plan has no data axis: `replicate` over the mesh's one-rank `policy` axis.
    FSDP2 then does what it does on a data axis: before the forward each parameter is cast to `param_dtype`
    (bf16 compute; on the tensor axis a DTensor of the same placements, so the styles' collectives move bf16
    activations, as Megatron's do), the gradients come back in `reduce_dtype` and are kept in the stored
    parameters' dtype (fp32), and the stored weights stay fp32. The gradient "all-reduce" over one rank moves
    nothing (a copy). Not a module pre-hook casting weights by hand: FSDP2 is what releases the bf16 copies after
    use, routes their gradients back to the fp32 parameters and honours `cast_forward_inputs` / `output_dtype`,
    the same policy object a data-parallel plan takes (docs/TORCH_NATIVE.md, "Mixed precision")."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicate(module, mesh=mesh[POLICY_AXIS_NAME], mp_policy=mp_policy)


def _tensor_parallel(module: nn.Module, lowering: Lowering, tp_mesh) -> None:
    """The tensor axis's styles on `module` (module docstring, step 3). Under sequence parallelism the values a
    style leaves split along the sequence, and the norms' outputs, stay `Shard(1)` DTensors of the global shape
    (`use_local_output=False`): the module's code between the styles runs on its slice, while a forward that
    reads the sequence length from them (HF LLaMA's positions and mask) reads the whole one."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    def layout(word: str):   # "shard" and "loss" (the logits left split for loss parallelism): Shard(-1)
        return Replicate() if word == "replicate" else Shard(SEQ_DIM) if word == "sequence" else Shard(-1)

    from parsat.backend.torch_native.conv1d import Conv1DColwiseParallel, Conv1DRowwiseParallel

    plan: dict[str, Any] = {}
    replicated = []
    for style in lowering.styles:
        local = style.output_layout not in ("sequence", "loss")   # DTensors for the code after the style
        if style.kind == COLWISE:
            kind = Conv1DColwiseParallel if style.conv1d else ColwiseParallel
            plan[style.module] = kind(input_layouts=layout(style.input_layout),
                                      output_layouts=layout(style.output_layout), use_local_output=local)
        elif style.kind in (ROWWISE, VOCAB):
            kind = Conv1DRowwiseParallel if style.conv1d else RowwiseParallel
            plan[style.module] = kind(input_layouts=layout(style.input_layout),
                                      output_layouts=layout(style.output_layout), use_local_output=local)
        elif style.kind == SEQUENCE_STYLE:
            plan[style.module] = SequenceParallel(sequence_dim=SEQ_DIM, use_local_output=False)
        elif style.kind == PREPARE_STYLE:
            # the parent's input converted once (gathered, or made a Replicate() DTensor) for its projections:
            # their input gradients meet as one partial sum, reduced once (`lowering.gathered_inputs`)
            first = _first_input_by_keyword(module.get_submodule(style.module), style.module)
            plan[style.module] = PrepareModuleInput(input_kwarg_layouts={first: layout(style.input_layout)},
                                                    desired_input_kwarg_layouts={first: Replicate()},
                                                    use_local_output=False)
        elif style.kind == REPLICATE_STYLE:
            replicated.append(style.module)
    if plan:
        styled = {k: v for k, v in plan.items() if k}
        if "" in plan:
            parallelize_module(module, tp_mesh, plan[""])
        if styled:
            parallelize_module(module, tp_mesh, styled)
    for name in replicated:
        distribute_module(module.get_submodule(name), tp_mesh, None, _replicated_inputs, _local_outputs)
    _tie_again(module, lowering)
    if lowering.loss_parallel:
        from parsat.backend.torch_native.loss_parallel import install

        install(module)


def _first_input_by_keyword(sub: nn.Module, name: str) -> str:
    """The name of `sub`'s first forward parameter, after a pre-hook that passes a lone positional input by that
    keyword: `PrepareModuleInput` takes positional inputs by count and keyword ones by name, and a Hugging Face
    attention is called with `hidden_states=` while its MLP is called positionally."""
    import inspect

    # the class's forward (after `self`): an instance's may be wrapped (`checkpoint_blocks`' partial)
    first = list(inspect.signature(type(sub).forward).parameters)[1]

    def by_keyword(_module, args, kwargs):
        if not args:
            return args, kwargs
        if len(args) > 1 or first in kwargs:
            raise NativeParallelizeError(f"module {name} gathers its first input '{first}' along the sequence "
                                         f"(PrepareModuleInput) but is called with {len(args)} positional inputs")
        return (), {first: args[0], **kwargs}

    sub.register_forward_pre_hook(by_keyword, with_kwargs=True)
    return first


def traced_tensor_parallel(module: nn.Module, lowering: Lowering, tp_mesh, prefix: str = "",
                           sequence: bool = False, received: bool = False, regather: bool = False,
                           recomputed: Sequence[str] = (), piece_dim: int = SEQ_DIM) -> None:
    """A traced stage module's tensor axis (`lower(traced=True)`): each parameter a DTensor on `tp_mesh`,
    `Shard(d)` where the plan stores its weight split along d, `Replicate()` otherwise; the module's tensor inputs
    enter as `Replicate()` DTensors and its outputs leave whole and local (the stages send plain, whole tensors),
    so its aten operators run on DTensors of the traced, global shapes. `prefix`: what the module's parameter
    names carry before the plan's module's. `sequence` (the plan keeps the values crossing between stages split
    along the sequence): its floating inputs enter as `Shard(1)` DTensors instead, so DTensor's propagation runs
    the stage as Megatron's sequence parallelism (norms and residual adds on the slice, an all-gather before each
    column-parallel contraction, a reduce-scatter after each row-parallel one, the norms' weight gradients
    `Partial` until read), and its floating outputs leave as this rank's `Shard(1)` piece: what Megatron sends to
    the same tp rank of the next stage, and its gradient back, with no gather before the send nor slice after it
    (`pipelined._sequence_pieces` sizes the traced stage's buffers so). `received`: the module's inputs are such
    pieces, received from the stage before (each is this rank's slice already); otherwise they are the step's
    whole inputs (the first stage), sliced on entry. With or without `sequence`, its products and lookups of
    split weights run on the local pieces with the plan's collectives only (`sequence_products`; `regather`: the
    plan's machine is priced as a runtime that gathers a column-parallel product's input again in backward, and
    the stage does so under `sequence`, outside the blocks `recomputed` names as the plan does). A plan's vocabulary-parallel loss: the stage's cross-entropy
    runs as loss parallelism (`loss_parallel.traced_losses`). `piece_dim`: the dim the pieces are split along
    (`SEQ_DIM`; 0 where the plan splits the residual stream along the batch instead, `PipelineLowering.piece_dim`).
    `dtensor_step` must be around its forward and backward."""
    traced_graph_passes(module, lowering, prefix, sequence, regather, recomputed)
    traced_parameters_placed(module, lowering, tp_mesh, prefix, sequence, received, piece_dim)


def traced_parameters_placed(module: nn.Module, lowering: Lowering, tp_mesh, prefix: str = "",
                             sequence: bool = False, received: bool = False, piece_dim: int = SEQ_DIM) -> None:
    """What `traced_tensor_parallel` does to a traced stage module apart from its graphs: each parameter a DTensor
    placed as the plan stores it, and the hooks its inputs enter and its outputs leave by (that function's
    docstring)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

    dims = _stored_dims(lowering, SPLIT)
    # one DTensor per parameter, however many names it has (a tie stays one); the original kept, so its id stays its
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}

    def partition(name: str, sub: nn.Module, mesh) -> None:
        for local, param in list(sub.named_parameters(recurse=False)):
            if id(param) not in made:
                full = f"{name}.{local}" if name else local
                dim = dims.get(full[len(prefix):] if full.startswith(prefix) else full)
                placement = Shard(dim) if dim is not None else Replicate()
                made[id(param)] = (param, nn.Parameter(distribute_tensor(param.data, mesh, [placement]),
                                                       param.requires_grad))
            sub.register_parameter(local, made[id(param)][1])

    if not sequence:
        distribute_module(module, tp_mesh, partition, _replicated_inputs, _whole_outputs)
    else:
        enter = _received_pieces if received else _sequence_inputs   # distribute_module calls 3-argument hooks
        distribute_module(module, tp_mesh, partition, lambda m, inputs, mesh: enter(m, inputs, mesh, piece_dim),
                          lambda m, outputs, mesh: _sequence_outputs(m, outputs, mesh, piece_dim))


def traced_graph_passes(module: nn.Module, lowering: Lowering, prefix: str = "", sequence: bool = False,
                        regather: bool = False, recomputed: Sequence[str] = ()) -> None:
    """What `traced_tensor_parallel` changes in a traced stage module's fx graphs, apart from its parameters and
    hooks: the vocabulary-parallel loss's calls, export's dtype assertions dropped, the split products and lookups
    on local pieces (`sequence_products`). Graphs only, so a pipelined module re-traced for another batch shape
    runs it on the new graphs of the stage modules it keeps (`pipelined.PipelinedModule.step`)."""
    from parsat.backend.torch_native.sequence_products import local_products, split_weights
    from parsat.backend.torch_native.traced_graphs import drop_assertions

    if lowering.loss_parallel:
        from parsat.backend.torch_native.loss_parallel import traced_losses

        traced_losses(module)
    drop_assertions(module)   # export's dtype checks, which DTensor cannot run (`traced_graphs.TRACED_ASSERTIONS`)
    local_products(module, split_weights(_stored_dims(lowering, SPLIT), prefix), sequence, regather,
                   [prefix + name for name in recomputed])


def sequence_piece(x, dim: int = SEQ_DIM) -> bool:
    """Whether a value crossing between sequence-parallel stages travels as its `Shard(dim)` piece: a floating
    tensor with a sequence dim ([batch, seq, ...]); integer ones (ids, labels carried along) travel whole, and so,
    with batch pieces (`dim` 0), does one of batch 1 (a table broadcast over the batch: HF LLaMA's rotary cos and
    sin [1, seq, head_dim])."""
    return x.is_floating_point() and x.dim() > SEQ_DIM and (dim == SEQ_DIM or x.shape[dim] > 1)


def dtensor_step(device: torch.device):
    """The context a traced stage with DTensor parameters runs its forward and backward in: tensors the traced
    graph makes itself (a causal mask) count as `Replicate()` (`implicit_replication`), and on CPU attention
    runs as its math decomposition (torch registers no DTensor sharding for the CPU flash-attention kernel)."""
    from contextlib import ExitStack

    from torch.distributed.tensor.experimental import implicit_replication

    stack = ExitStack()
    stack.enter_context(implicit_replication())
    if device.type == "cpu":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
    return stack


def _whole_outputs(_module, outputs, _mesh):
    from torch.distributed.tensor import DTensor, Replicate

    return torch.utils._pytree.tree_map(
        lambda x: x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim).to_local()
        if isinstance(x, DTensor) else x, outputs)


def _replicated_inputs(_module, inputs, mesh):
    from torch.distributed.tensor import DTensor, Replicate

    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)


def _sequence_inputs(_module, inputs, mesh, dim: int = SEQ_DIM):
    from torch.distributed.tensor import Replicate, Shard

    return tuple(x.redistribute(mesh, [Shard(dim)]) if sequence_piece(x, dim) and isinstance(x.placements[0], Replicate)
                 else x for x in _replicated_inputs(_module, inputs, mesh))


def _received_pieces(_module, inputs, mesh, dim: int = SEQ_DIM):
    """A later stage's inputs: each floating one this rank's `Shard(1)` piece as the stage before sent it (its
    gradient goes back as this rank's piece too: `from_local`'s backward), the others whole."""
    from torch.distributed.tensor import DTensor, Shard

    return _replicated_inputs(_module, tuple(
        DTensor.from_local(x, mesh, [Shard(dim)], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and sequence_piece(x, dim) else x
        for x in inputs), mesh)


def _sequence_outputs(_module, outputs, _mesh, dim: int = SEQ_DIM):
    """A sequence-parallel stage's outputs: each floating one this rank's `Shard(1)` piece (a reduce-scatter only
    where DTensor left it a partial sum, nothing where it is already split so), the others (the loss) whole."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def local(x):
        if not isinstance(x, DTensor):
            return x
        placements = [Shard(dim) if sequence_piece(x, dim) else Replicate()] * x.device_mesh.ndim
        return x.redistribute(x.device_mesh, placements).to_local()

    return torch.utils._pytree.tree_map(local, outputs)


def _local_outputs(_module, outputs, _mesh):
    from torch.distributed.tensor import DTensor

    return torch.utils._pytree.tree_map(lambda x: x.to_local() if isinstance(x, DTensor) else x, outputs)


def _tie_again(module: nn.Module, lowering: Lowering) -> None:
    """A tied parameter is one tensor under several names; distributing each module made one per name: keep the
    first styled name's (a DTensor) for all (the plan stores a graph weight once, so its styles place it alike; a
    name under an unstyled module, BERT's head bias beside its decoder's, takes the styled one)."""
    for w in lowering.weights:
        if len(w.params) < 2:
            continue
        held = [module.get_parameter(name) for name in w.params]
        first = next((p for p in held if hasattr(p, "placements")), held[0])
        for name in w.params:
            other = module.get_parameter(name)
            if other is first:
                continue
            if hasattr(other, "placements") and other.placements != getattr(first, "placements", None):
                raise NativeParallelizeError(f"tied parameter {' = '.join(w.params)} would be placed "
                                             f"{getattr(first, 'placements', None)} and "
                                             f"{getattr(other, 'placements', None)}")
            owner, _, local = name.rpartition(".")
            setattr(module.get_submodule(owner), local, first)


def data_parallel(module: nn.Module, lowering: Lowering, mesh, mp_policy, prefix: str = "",
                  blocks: bool = True) -> None:
    """The plan's data and ZeRO axes on `module`: `replicate`, or `fully_shard` on each block (unless `blocks` is
    False) and the root (module docstring, step 4). `prefix` is what `module`'s parameter names carry before the
    plan's module's names (a traced pipeline stage's)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    names = lowering.mesh.names
    data = [names[a] for a in lowering.axes(DATA)]
    zero3 = [names[a] for a in lowering.axes(ZERO3)]
    if not data and not zero3:
        if mp_policy is not None:
            policy_on_one_rank(module, mesh, mp_policy)
        return
    policy = mp_policy or MixedPrecisionPolicy()
    if zero3 or lowering.zero >= 2:
        from torch.distributed.fsdp import fully_shard

        if data and zero3:
            if len(data) > 1 or len(zero3) > 1:
                raise NativeParallelizeError(f"replicated over {data} and sharded over {zero3}: HSDP over more "
                                             "than one axis each is not lowered")
            dp_mesh = mesh[(data[0], zero3[0])]
        else:
            dp_mesh = _flattened(mesh, zero3 or data)
        reshard = None if zero3 else False
        wanted = _stored_dims(lowering, GATHERED)
        dims = {id(p): wanted[name[len(prefix):]] for name, p in module.named_parameters(remove_duplicate=False)
                if name.startswith(prefix) and name[len(prefix):] in wanted}
        place = (lambda p: _shard_of(p, dims)) if dims else None
        for block in _blocks(module) if blocks else ():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, shard_placement_fn=place,
                        mp_policy=policy)
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, shard_placement_fn=place, mp_policy=policy)
        return
    from torch.distributed._composable.replicate_with_fsdp import replicate

    from parsat.backend.torch_native.zero import ZERO1_BESIDE_ATTRIBUTE, ZERO1_MESH_ATTRIBUTE

    replicate(module, mesh=_flattened(mesh, data), mp_policy=policy)
    if lowering.zero == 1:   # whole gradients all-reduced; zero_optimizer shards the state over these ranks
        setattr(module, ZERO1_MESH_ATTRIBUTE, _flattened(mesh, data))
        # this rank's place on the other axes (tp): its flat parameters are its own pieces, keyed so in a checkpoint
        setattr(module, ZERO1_BESIDE_ATTRIBUTE, ",".join(
            f"{name}={coord}" for name, coord in zip(mesh.mesh_dim_names, mesh.get_coordinate()) if name not in data))


def _flattened(mesh, names: list[str]):
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[tuple(names)]._flatten("_".join(names))


def _stored_dims(lowering: Lowering, role: str) -> Mapping[str, int]:
    """Parameter name -> the dim the plan stores it split along on the axis where it has `role` (`gathered`: its
    ZeRO-3 axis, FSDP's default dim 0 for the others; `split`: its tensor axis)."""
    out = {}
    for w in lowering.weights:
        for axis, found in enumerate(w.roles):
            if found == role:
                out.update({name: w.stored_dim(axis) for name in w.params})
    return out


def _shard_of(param, dims: Mapping[int, int]):
    from torch.distributed.tensor import Shard

    dim = dims.get(id(param))
    return Shard(dim) if dim is not None else None


def _blocks(module: nn.Module) -> list[nn.Module]:
    """Each child of an nn.ModuleList that holds parameters: the groups FSDP gathers one at a time."""
    out = []
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList):
            out += [child for child in sub if any(True for _ in child.parameters())]
    return out
