"""A sequence-parallel traced stage's products and lookups on this rank's pieces: the plan's collectives, no more.

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
  not re-gather (`cost.saved.runtime_regathers`, `_parallel_memory`: the gathered value kept for backward);
* row-parallel (`x` Shard(-1), `w` Shard(0)): the product of the local pieces, a `Partial()` sum that the
  code after it reduces as DTensor chooses (the residual add's reduce-scatter onto the sequence); backward:
  the output's gradient gathered once (`from_local`'s backward: a Partial's gradient is Replicate), both
  products computed from it;
* a vocabulary-parallel lookup (`aten.embedding` of a `Shard(0)` table, `vocabulary_parallel_embedding`):
  likewise a `Partial()` sum of this rank's rows, its gradient gathered once and the table's made on this
  rank's rows (DTensor's own lookup slices the ids for it and reduce-scatters a whole-table partial sum).

Any other placement falls back to DTensor's own `matmul`. Why not a 3-D `mm` strategy or a placement rule for
the view: both are DTensor internals (private registries that change between torch releases). Why not explicit
functional collectives in an autograd function: it would repeat what DTensor's redistribution does. These
conversions are DTensor's public API, and each collective they run is one the plan has (docs/TORCH_NATIVE.md,
"Products and loss of a sequence-parallel stage").
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from parsat.backend.torch_native.lowering import SEQ_DIM
from parsat.backend.torch_native.traced_graphs import retarget


def sequence_parallel_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w` for a traced stage on DTensors (module docstring): on the local pieces where `w` is a tensor-
    parallel weight split as a column- or row-parallel product on a one-axis mesh, DTensor's own `matmul`
    otherwise."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if not (isinstance(x, DTensor) and isinstance(w, DTensor)) or w.ndim != 2 or x.ndim <= SEQ_DIM + 1 \
            or x.device_mesh.ndim != 1 or w.device_mesh != x.device_mesh:
        return torch.matmul(x, w)
    mesh, (xp,), (wp,) = x.device_mesh, x.placements, w.placements
    shape = (*x.shape[:-1], w.shape[1])
    stride = torch.empty(shape, device="meta").stride()
    if type(wp) is Shard and wp.dim == 1 and type(xp) is Shard and xp.dim == SEQ_DIM:   # column-parallel
        whole = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        return DTensor.from_local(whole @ w.to_local(), mesh, [Shard(x.ndim - 1)], run_check=False,
                                  shape=shape, stride=stride)
    if type(wp) is Shard and wp.dim == 0 and type(xp) is Shard and xp.dim == x.ndim - 1:   # row-parallel
        return DTensor.from_local(x.to_local() @ w.to_local(), mesh, [Partial()], run_check=False,
                                  shape=shape, stride=stride)
    return torch.matmul(x, w)


def vocabulary_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1,
                                  scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
    """`aten.embedding(weight, indices, ...)` for a traced stage on DTensors: where the table is split along the
    vocabulary (`Shard(0)`, one-axis mesh) and the ids are whole, this rank's rows looked up locally (ids outside
    them give zeros), a `Partial()` sum the code after it reduces as DTensor chooses (the plan's reduce-scatter
    onto the sequence); backward: the output's gradient gathered once (`from_local`'s backward, the plan's
    all-gather) and the table's gradient made on this rank's rows, already placed as the table: DTensor's own
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
    return DTensor.from_local(found.masked_fill(outside.unsqueeze(-1), 0), mesh, [Partial()], run_check=False,
                              shape=shape, stride=torch.empty(shape, device="meta").stride())


def local_products(module: nn.Module, split: Callable[[str], bool]) -> int:
    """Each `aten.matmul(x, p)` in the graphs of `module` and its submodules, `p` a parameter read directly
    (`get_attr`, or its transpose) for which `split(its full name)` holds, made a call of
    `sequence_parallel_matmul`, and each `aten.embedding(p, ids)` of such a table one of
    `vocabulary_parallel_embedding`; the count made."""
    matmul, embedding = torch.ops.aten.matmul.default, torch.ops.aten.embedding.default

    def choose(prefix: str, node: torch.fx.Node):
        if node.target is matmul and len(node.args) == 2:
            weight, local = _read_weight(node.args[1]), sequence_parallel_matmul
        elif node.target is embedding and node.args and isinstance(node.args[0], torch.fx.Node) and \
                node.args[0].op == "get_attr":
            weight, local = node.args[0], vocabulary_parallel_embedding
        else:
            return None
        if weight is not None and split(f"{prefix}.{weight.target}" if prefix else str(weight.target)):
            return local
        return None

    return retarget(module, choose)


def _read_weight(arg) -> torch.fx.Node | None:
    """The `get_attr` node a product's second operand reads: the parameter itself, or its transpose (`aten.t`:
    the tied head's `wte.t()`, a column-parallel product on the vocabulary-split table); None otherwise."""
    if isinstance(arg, torch.fx.Node) and arg.op == "call_function" and arg.target is torch.ops.aten.t.default:
        arg = arg.args[0]
    return arg if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" else None


def split_weights(dims: Mapping[str, int], prefix: str) -> Callable[[str], bool]:
    """The test `local_products` takes: a module's parameter name (after `prefix`) the plan stores split."""
    return lambda name: (name[len(prefix):] if name.startswith(prefix) else name) in dims
