"""Tensor-parallel styles for transformers' `Conv1D` (GPT-2's projections), which torch's styles refuse.

`Conv1D` computes `y = x @ W + b` with its weight stored [in, out] (the
transpose of `nn.Linear`'s), and `ColwiseParallel` / `RowwiseParallel`
accept `nn.Linear` and `nn.Embedding` only. These subclasses keep
everything of torch's styles (input and output layouts, `use_local_output`,
the redistributions at the module's boundary) and change only how the
parameters are placed:

* column-parallel: the weight `Shard(1)` (its output features), the bias
  `Shard(0)`; the output comes out split along its last dim;
* row-parallel: the weight `Shard(0)` (its input features), the bias
  `Replicate()`; the output is a partial sum (DTensor adds the bias once).

The module's own forward runs on DTensors: it reads its sizes from its
input (global under DTensor) and its `nf` (the global output width), so
its `view`s hold. The module class and its parameter names stay as they
were: a checkpoint has the module's own keys.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


def _place(placements: dict, src_data_rank, _name: str, module: nn.Module, device_mesh) -> None:
    """Each of the module's own parameters a DTensor with its placement (`weight`, `bias`)."""
    for local, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(local, nn.Parameter(
            distribute_tensor(param, device_mesh, [placements[local]], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad))


class Conv1DColwiseParallel(ColwiseParallel):
    """`ColwiseParallel` for a `Conv1D`: weight `Shard(1)`, bias `Shard(0)` (module docstring)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, partial(_place, {"weight": Shard(1), "bias": Shard(0)}, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwiseParallel(RowwiseParallel):
    """`RowwiseParallel` for a `Conv1D`: weight `Shard(0)`, bias `Replicate()`, input split along its last dim
    (module docstring)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, partial(_place, {"weight": Shard(0), "bias": Replicate()}, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

