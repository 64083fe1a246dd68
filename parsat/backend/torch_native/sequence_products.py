"""A tensor-parallel traced stage's products and lookups on this rank's pieces: the plan's collectives, no more.

A traced stage runs its aten operators on DTensors (`apply.traced_tensor_parallel`). Its `x @ w` on
[batch, seq, hidden] is `aten.matmul`, which DTensor decomposes into a view to [batch x seq, hidden], `mm`
and a view back; the view keeps the sequence split as a `_StridedShard(0)` that `mm` has no strategy for,
so each `mm` (the forward and each backward product) gathers its strided operand on its own: a row-parallel
product's output gradient is gathered twice, a column-parallel product's input gathered again for the
weight's gradient (measured 2026-12-04, benchmarks/backend_results.md).

`local_products` points each such product of a stage module's graph (a `matmul` of a parameter the plan
splits) at `sequence_parallel_matmul`, which computes the product on the local pieces between DTensor's own
differentiable conversions, so that what runs is what the plan (`cost.model`) prices, forward and backward:

* column-parallel (`x` split along the sequence, `w` Shard(1)): the plan's all-gather of `x` (`redistribute`
  to Replicate), the product on the gathered input and this rank's columns; backward: the input gradient's
  partial sums reduce-scattered back onto the sequence (the `redistribute`'s backward), the weight's gradient
  from the gathered input autograd kept, gathered nothing again: as the cost model prices a runtime that does
  not re-gather (`cost.saved.runtime_regathers`, `_parallel_memory`: the gathered value kept for backward).
  Where the plan's machine is priced as one that re-gathers (`Machine.runtime_regathers`: the GPU presets,
  Megatron-LM's choice) `local_products(..., regather=True)` points it at the `*_regathering_*` functions
  instead: autograd keeps this rank's shard in place of the gathered input (`torch.autograd.graph.
  saved_tensors_hooks` around the product: packing the gathered input keeps the shard, unpacking it in backward
  gathers it again with the same `redistribute`), so backward runs one more all-gather and the forward's
  gathered input is freed after the product. Why hooks and not `torch.utils.checkpoint` around the gather and
  product: checkpointing would recompute the product too (Megatron recomputes only the gather); why not an
  autograd Function: it would repeat the redistribution's collectives;
* row-parallel (`x` Shard(-1), `w` Shard(0)): the product of the local pieces, a `Partial()` sum that the
  code after it reduces as DTensor chooses (the residual add's reduce-scatter onto the sequence); backward:
  the output's gradient gathered once (`from_local`'s backward: a Partial's gradient is Replicate), both
  products computed from it;
* a vocabulary-parallel lookup (`aten.embedding` of a `Shard(0)` table, `vocabulary_parallel_embedding`):
  likewise a `Partial()` sum of this rank's rows, its gradient gathered once and the table's made on this
  rank's rows (DTensor's own lookup slices the ids for it and reduce-scatters a whole-table partial sum).

Without sequence parallelism (the stage's inputs `Replicate()`) DTensor's own products left each row-parallel
sum and the lookup `Partial`, so the residual stream after them stayed a partial sum that each norm all-reduced
forward and again backward (16 backward all-reduces a micro-batch on the gpt's two stages where the plan has 9,
measured 2026-12-04): `local_products(..., sequence=False)` points them at the `tensor_parallel_*` functions,
the same local computation with the row-parallel sum and the lookup all-reduced at once (the plan's), a whole
column-parallel input's gradient left a partial sum that the products reading it add up and `whole_gradient`
(Megatron-LM's f, made once for each input however many products read it) all-reduces once (the plan's): what
ran before the products (a norm) then sees the whole gradient, as the plan's backward has it. An `nn.Linear` traces as `aten.linear` (weight [out, in], a bias): pointed at
the `*_linear` functions likewise (imported Hugging Face modules).

Any other placement falls back to DTensor's own `matmul` (or `linear`). Why not a 3-D `mm` strategy or a placement rule for
the view: both are DTensor internals (private registries that change between torch releases). Why not explicit
functional collectives in an autograd function: it would repeat what DTensor's redistribution does. These
conversions are DTensor's public API, and each collective they run is one the plan has (docs/TORCH_NATIVE.md,
"Products and loss of a sequence-parallel stage").
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from parsat.backend.torch_native.lowering import SEQ_DIM
from parsat.backend.torch_native.traced_graphs import retarget


def sequence_parallel_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w` in a sequence-parallel traced stage (module docstring): on the local pieces where `w` is a tensor-
    parallel weight split as a column- or row-parallel product on a one-axis mesh (a row-parallel product's
    partial sum left to the code after it: the residual add's reduce-scatter), DTensor's own `matmul` otherwise."""
    return _local_product(x, w, None, transposed=False, reduce=False)


def tensor_parallel_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w` in a traced stage without sequence parallelism: as `sequence_parallel_matmul`, but a row-parallel
    product's partial sum all-reduced at once (the plan's one all-reduce; left `Partial`, DTensor carries it
    along the residual stream and all-reduces it again at each norm, forward and backward)."""
    return _local_product(x, w, None, transposed=False, reduce=True)


def sequence_parallel_regathering_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`sequence_parallel_matmul` on a machine priced as a runtime that re-gathers (module docstring): a column-
    parallel product keeps this rank's shard of the input for the weight's gradient and gathers it again then."""
    return _local_product(x, w, None, transposed=False, reduce=False, regather=True)


def sequence_parallel_regathering_linear(x: torch.Tensor, w: torch.Tensor,
                                         b: torch.Tensor | None = None) -> torch.Tensor:
    """`sequence_parallel_linear` re-gathering as `sequence_parallel_regathering_matmul` does."""
    return _local_product(x, w, b, transposed=True, reduce=False, regather=True)


def sequence_parallel_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`aten.linear(x, w, b)` (an `nn.Linear`: `w` is [out, in]) in a sequence-parallel traced stage: as
    `sequence_parallel_matmul` on `w`'s transpose, a column-parallel bias added to this rank's columns, a
    row-parallel one after the partial sum."""
    return _local_product(x, w, b, transposed=True, reduce=False)


def tensor_parallel_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`aten.linear(x, w, b)` in a traced stage without sequence parallelism (`tensor_parallel_matmul`'s
    reduction, `sequence_parallel_linear`'s layout)."""
    return _local_product(x, w, b, transposed=True, reduce=True)


WHOLE_GRADIENT_ATTRIBUTE = "_parsat_whole_gradient"   # an input's `whole_gradient`, kept on the input itself


def whole_gradient(x: torch.Tensor) -> torch.Tensor:
    """Megatron-LM's f on a whole (`Replicate()`) input of a stage's column-parallel products: the same value; in
    backward the products' partial gradients, added up first (q, k and v's), all-reduced here once, into the whole
    gradient the code before them reads. Made once for each input (kept on it: the products of one input may sit
    in separate traced submodules, HF's `q_proj`, `k_proj`, `v_proj`, which see the same DTensor). Without it the
    partial sum ran back through what made the input wherever DTensor let it (an element-wise decomposed norm: HF
    LLaMA's RMSNorm), each rank's piece rounded on its own in the norm's float32 section (1e-9 of a gradient,
    2e-4 of a weight after 3 AdamW steps), and the norm's weight's gradient was all-reduced once more after the
    step. Any other input is returned as it is."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(x, DTensor) or x.placements != (Replicate(),) or not x.requires_grad:
        return x
    made = x.__dict__.get(WHOLE_GRADIENT_ATTRIBUTE)
    if made is None:
        made = DTensor.from_local(x.to_local(), x.device_mesh, [Replicate()], run_check=False, shape=x.shape,
                                  stride=x.stride())
        setattr(x, WHOLE_GRADIENT_ATTRIBUTE, made)
    return made


def tensor_parallel_addmm(b: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    """`aten.addmm(b, x, w)` in a traced stage without sequence parallelism: transformers' `Conv1D` (GPT-2's
    projections, weight [in, out], `x` flattened to [rows, in]), as `tensor_parallel_linear` computes it on the
    local pieces: column-parallel of a whole `x` (its gradient's partial sum reduced once, `whole_gradient`), or
    row-parallel of an `x` split along its last dim (the sum all-reduced at once, the bias added after); DTensor's
    own `addmm` otherwise (another placement, a scaled product)."""
    if beta != 1 or alpha != 1:
        return torch.addmm(b, x, w, beta=beta, alpha=alpha)
    return _local_product(x, w, b, transposed=False, reduce=True, flat=True)


def tensor_parallel_add(a: torch.Tensor, b: torch.Tensor, *, alpha=1) -> torch.Tensor:
    """`aten.add.Tensor(a, b)` in a traced stage without sequence parallelism: where one operand is split along its
    last dim (a column-parallel product's output that no row-parallel product reads: HF GPT-2's attention
    `c_proj`, column-parallel because the fused `c_attn` output is gathered before its q / k / v split) and the
    other is the whole residual stream of the same shape, the sum is made on the pieces (the residual sliced: its
    gradient all-gathered back) and gathered once, here (`redistribute` to `Replicate()`), so every reader of the
    sum reads the whole value: the plan's `combine` after the add, whose gathered form `megatron_pcg` keeps for
    every later reader (the norm and the next residual add). Left to DTensor, each reader converted the split sum
    on its own: the norm by an all-to-all onto the rows (gloo: an all-gather), the next product then gathering its
    row-split input, the next residual add split again and gathered before the stage sends it (2-3 forward and 5
    backward all-gathers a micro-batch beyond the plan's, 1-2 of its backward all-reduces missing). Any other
    add is DTensor's own."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not (isinstance(a, DTensor) and isinstance(b, DTensor) and a.shape == b.shape and a.ndim >= 2
            and a.device_mesh.ndim == 1 and b.device_mesh == a.device_mesh
            and sorted(_is_shard(t.placements[0], t.ndim - 1) or 2 * (t.placements[0] == Replicate())
                       for t in (a, b)) == [1, 2]):   # one split along its last dim, the other whole
        return torch.add(a, b, alpha=alpha)
    mesh, piece = a.device_mesh, [Shard(a.ndim - 1)]
    # the whole operand sliced by its own redistribution, whose backward gathers its gradient here (the plan's
    # partition): DTensor's add slices it without one, and its gradient ran back split into what made it
    a, b = (t if _is_shard(t.placements[0], t.ndim - 1) else t.redistribute(mesh, piece) for t in (a, b))
    return torch.add(a, b, alpha=alpha).redistribute(mesh, [Replicate()])


def _local_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool,
                   reduce: bool, regather: bool = False, flat: bool = False) -> torch.Tensor:
    """The product of `x` and `w` (`w` [in, out], or [out, in] when `transposed`: `aten.linear`), plus `b`, on the
    local pieces: column-parallel (`w` split along out, `x` whole or split along the sequence: gathered, the
    plan's all-gather, its gradient's partial sums reduced back as it entered) or row-parallel (`x` split along
    its last dim, `w` along in: a `Partial()` sum, all-reduced here when `reduce`); DTensor's own product of
    any other placement. `regather`: a column-parallel product of a sequence-split input keeps the input's shard
    for backward, not the gathered input (`_keeping_the_shard`). `flat`: `x` is [rows, in] (`addmm`), whole or
    split along its last dim only (no sequence dim to be split along)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    def dtensor_own():
        if flat:
            return torch.addmm(b, x, w)
        return torch.nn.functional.linear(x, w, b) if transposed else torch.matmul(x, w)

    if not (isinstance(x, DTensor) and isinstance(w, DTensor)) or w.ndim != 2 \
            or x.ndim <= (1 if flat else SEQ_DIM + 1) or (flat and b is None) \
            or x.device_mesh.ndim != 1 or w.device_mesh != x.device_mesh \
            or (b is not None and (not isinstance(b, DTensor) or b.device_mesh != x.device_mesh)):
        return dtensor_own()
    mesh, (xp,), (wp,) = x.device_mesh, x.placements, w.placements
    out_dim, in_dim = (0, 1) if transposed else (1, 0)
    shape = (*x.shape[:-1], w.shape[out_dim])
    stride = torch.empty(shape, device="meta").stride()

    def product(a: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if transposed:
            return torch.nn.functional.linear(a, w.to_local(), bias)
        return a @ w.to_local() if bias is None else torch.addmm(bias, a, w.to_local())   # `flat` alone has one

    if _is_shard(wp, out_dim) and ((_is_piece(xp) and not flat) or xp == Replicate()) \
            and (b is None or _is_shard(b.placements[0], 0)):   # column-parallel
        # a whole input's gradient is left a partial sum, reduced once where it is read (every product reading
        # the input adds its own first: q, k and v's); redistributing it would all-reduce it for each product
        gathered = whole_gradient(x) if xp == Replicate() else x.redistribute(mesh, [Replicate()])
        whole = gathered.to_local(grad_placements=[Partial()])
        bias = None if b is None else b.to_local()
        local = _keeping_the_shard(x, whole, lambda a: product(a, bias)) if regather and xp != Replicate() \
            else product(whole, bias)
        return DTensor.from_local(local, mesh, [Shard(x.ndim - 1)], run_check=False, shape=shape, stride=stride)
    if _is_shard(wp, in_dim) and _is_shard(xp, x.ndim - 1) and (b is None or b.placements == (Replicate(),)):  # row
        out = DTensor.from_local(product(x.to_local()), mesh, [Partial()], run_check=False, shape=shape,
                                 stride=stride)
        out = out.redistribute(mesh, [Replicate()]) if reduce else out
        return out if b is None else out + b
    return dtensor_own()


@dataclass(frozen=True)
class _Shard:
    """What autograd keeps in place of a gathered input (`_keeping_the_shard`): this rank's shard (a DTensor) and
    the shape the product read the gathered input in."""

    shard: torch.Tensor
    shape: tuple[int, ...]

    def gathered(self) -> torch.Tensor:
        """The gathered input again: the forward's all-gather (`redistribute` to `Replicate()`), run in backward."""
        from torch.distributed.tensor import Replicate

        return self.shard.redistribute(self.shard.device_mesh, [Replicate()]).to_local().reshape(self.shape)


def _keeping_the_shard(x: torch.Tensor, whole: torch.Tensor,
                       product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`product(whole)` (`whole`: `x`, a sequence-split DTensor, gathered and made local) with autograd keeping `x`'s
    shard where it would keep the gathered input, and gathering it again when backward reads it (Megatron-LM's
    sequence-parallel linear layer). The product runs on the [batch x seq, hidden] view, which is what its `mm`
    keeps (recognized by identity through a weak reference, so the hooks hold no gathered memory)."""
    flat = whole.reshape(-1, whole.shape[-1])
    seen, shard = weakref.ref(flat), x.detach()

    def pack(t: torch.Tensor):
        return _Shard(shard, tuple(t.shape)) if t is seen() else t

    def unpack(kept):
        return kept.gathered() if isinstance(kept, _Shard) else kept

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = product(flat)
    return out.reshape(*whole.shape[:-1], out.shape[-1])


def _is_piece(placement) -> bool:
    """`placement` splits an activation [batch, seq, ...] into the pieces a stage keeps its residual stream in: a
    plain `Shard` along the sequence, or along the batch (`PipelineLowering.piece_dim`)."""
    return _is_shard(placement, SEQ_DIM) or _is_shard(placement, 0)


def _is_shard(placement, dim: int) -> bool:
    """`placement` is a plain `Shard(dim)` (not a `_StridedShard`, which compares equal to it)."""
    from torch.distributed.tensor import Shard

    return type(placement) is Shard and placement.dim == dim


def vocabulary_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1,
                                  scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
    """`aten.embedding(weight, indices, ...)` in a sequence-parallel traced stage (`_local_lookup`): the looked-up
    rows a `Partial()` sum the code after it reduces as DTensor chooses (the plan's reduce-scatter onto the
    sequence, in the add of the positions)."""
    return _local_lookup(weight, indices, padding_idx, scale_grad_by_freq, sparse, reduce=False)


def tensor_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1,
                              scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
    """`aten.embedding(weight, indices, ...)` in a traced stage without sequence parallelism (`_local_lookup`):
    the looked-up rows all-reduced at once (the plan's all-reduce; left `Partial`, DTensor carries the partial
    sum along the residual stream and all-reduces it again at each norm, forward and backward)."""
    return _local_lookup(weight, indices, padding_idx, scale_grad_by_freq, sparse, reduce=True)


def _local_lookup(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int, scale_grad_by_freq: bool,
                  sparse: bool, reduce: bool) -> torch.Tensor:
    """`aten.embedding(weight, indices, ...)` for a traced stage on DTensors: where the table is split along the
    vocabulary (`Shard(0)`, one-axis mesh) and the ids are whole, this rank's rows looked up locally (ids outside
    them give zeros), a `Partial()` sum (all-reduced here when `reduce`); backward: the output's gradient
    gathered once where it is split along the sequence (`from_local`'s backward, the plan's all-gather) and the table's gradient made on this rank's rows, already placed as the table: DTensor's own
    embedding slices the ids along the sequence instead and reduce-scatters a whole-table partial gradient.
    DTensor's own lookup otherwise (a padding index, frequency scaling, sparse gradients included)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or weight.placements != (Shard(0),) or \
            (isinstance(indices, DTensor) and indices.placements != (Replicate(),)) or padding_idx != -1 or \
            scale_grad_by_freq or sparse:
        return torch.ops.aten.embedding.default(weight, indices, padding_idx, scale_grad_by_freq, sparse)
    mesh = weight.device_mesh
    ids = indices.to_local() if isinstance(indices, DTensor) else indices
    table = weight.to_local()
    start = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)[1][0]
    def scalar(n):   # the offset and the row count as tensors (`LocalTensorMode`'s ranks differ in them)
        return torch.full((), n, dtype=ids.dtype, device=ids.device)

    local = ids - scalar(start)
    outside = (local < 0) | (local >= scalar(table.shape[0]))
    found = torch.nn.functional.embedding(local.masked_fill(outside, 0), table)
    shape = (*ids.shape, weight.shape[1])
    out = DTensor.from_local(found.masked_fill(outside.unsqueeze(-1), 0), mesh, [Partial()], run_check=False,
                             shape=shape, stride=torch.empty(shape, device="meta").stride())
    return out.redistribute(mesh, [Replicate()]) if reduce else out


def local_products(module: nn.Module, split: Callable[[str], bool], sequence: bool, regather: bool = False,
                   recomputed: Sequence[str] = ()) -> int:
    """Each `aten.matmul(x, p)` and `aten.linear(x, p, b)` in the graphs of `module` and its submodules, `p` a
    parameter read directly (`get_attr`, or a matmul's transpose of it) for which `split(its full name)` holds,
    made a call of the local product, and each `aten.embedding(p, ids)` of such a table one of the local lookup:
    `sequence` (the stage keeps its residual stream split along the sequence) the `sequence_parallel_*` ones and
    `vocabulary_parallel_embedding`, which leave a row-parallel partial sum to the code after it, otherwise the
    `tensor_parallel_*` ones, which all-reduce it at once; `sequence` and `regather` (the plan's machine is priced
    as a runtime that re-gathers) the `sequence_parallel_regathering_*` products, except in the submodules named
    in `recomputed` (full names: the checkpointed blocks, whose recomputation gathers the input again already, as
    the cost model keeps nothing of them); without `sequence`, each `aten.add.Tensor` a call of
    `tensor_parallel_add` (a residual add of a column-parallel output gathered once, as the plan gathers it); the
    count made."""
    matmul, linear, embedding = torch.ops.aten.matmul.default, torch.ops.aten.linear.default, \
        torch.ops.aten.embedding.default
    addmm, add = torch.ops.aten.addmm.default, torch.ops.aten.add.Tensor
    products = (sequence_parallel_matmul, sequence_parallel_linear) if sequence else \
        (tensor_parallel_matmul, tensor_parallel_linear)
    local = {matmul: products[0], linear: products[1], addmm: tensor_parallel_addmm,
             embedding: vocabulary_parallel_embedding if sequence else tensor_parallel_embedding}
    regathering = {matmul: sequence_parallel_regathering_matmul, linear: sequence_parallel_regathering_linear}

    def choose(prefix: str, node: torch.fx.Node):
        if node.target is add and not sequence and len(node.args) == 2:
            return tensor_parallel_add
        if node.target is matmul and len(node.args) == 2:
            weight = _read_weight(node.args[1])
        elif node.target is linear and len(node.args) >= 2:
            weight = node.args[1] if _is_attr(node.args[1]) else None
        elif node.target is embedding and node.args and _is_attr(node.args[0]):
            weight = node.args[0]
        elif node.target is addmm and not sequence and len(node.args) == 3 and _is_attr(node.args[2]):
            weight = node.args[2]   # transformers' Conv1D; under sequence parallelism DTensor's own (not reached)
        else:
            return None
        if weight is None or not split(f"{prefix}.{weight.target}" if prefix else str(weight.target)):
            return None
        if sequence and regather and not any(prefix == r or prefix.startswith(r + ".") for r in recomputed):
            return regathering.get(node.target, local[node.target])
        return local[node.target]

    return retarget(module, choose)


def _is_attr(arg) -> bool:
    """Whether a node's argument reads a parameter directly (a `get_attr` node)."""
    return isinstance(arg, torch.fx.Node) and arg.op == "get_attr"


def _read_weight(arg) -> torch.fx.Node | None:
    """The `get_attr` node a product's second operand reads: the parameter itself, or its transpose (`aten.t`:
    the tied head's `wte.t()`, a column-parallel product on the vocabulary-split table); None otherwise."""
    if isinstance(arg, torch.fx.Node) and arg.op == "call_function" and arg.target is torch.ops.aten.t.default:
        arg = arg.args[0]
    return arg if _is_attr(arg) else None


def split_weights(dims: Mapping[str, int], prefix: str) -> Callable[[str], bool]:
    """The test `local_products` takes: a module's parameter name (after `prefix`) the plan stores split."""
    return lambda name: (name[len(prefix):] if name.startswith(prefix) else name) in dims
