"""The module's cross-entropy on logits split along the vocabulary: DTensor's loss parallelism, in its forward.

A plan whose loss is Megatron-LM's vocabulary-parallel cross-entropy
(`ir.megatron.vocabulary_steps`: each rank's block maximum and shifted sum
of exps, the target's logit on its rank, all-reduced; the logits never
gathered) is lowered with the head's `ColwiseParallel` leaving its logits a
`Shard(-1)` DTensor (`lowering.Lowering.loss_parallel`) and the module's
own `F.cross_entropy` (or `nn.CrossEntropyLoss`, which calls it) run as
`torch.distributed.tensor.parallel.loss_parallel` computes it: the
max, the sum of exps and the target's logit reduced across the tensor
ranks, on the shards.

torch's `loss_parallel()` is a context the forward's cross-entropy *and its
backward* must run in; a training loop calls `loss.backward()` outside the
module. So `install` wraps the module's forward in `_OnShards`, a
`TorchFunctionMode` that sees each `F.cross_entropy` call, and one on a
DTensor split along its class dim runs as `_LossParallel`: an autograd
function whose forward computes the cross-entropy under `loss_parallel()`
on a detached copy of the logits and whose backward differentiates that
inner graph under `loss_parallel()` again. The loss comes back a plain
tensor (the whole loss, the same on every tensor rank), as a module that
gathers its logits returns it. What loss parallelism does not compute
(label smoothing, class weights, probabilities as targets, the legacy
`size_average` / `reduce`) is refused by name, never computed otherwise.
The mode is on for the forward only (no global state); other calls pass
through unchanged.
"""

from __future__ import annotations

import inspect
from functools import wraps

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

_SIGNATURE = inspect.signature(F.cross_entropy)


class LossParallelError(ValueError):
    """A cross-entropy on vocabulary-split logits that loss parallelism does not compute (the message says why)."""


def install(module: nn.Module) -> None:
    """`module`'s forward (as it is now: the instance's own, so `fully_shard` / `replicate` hooks stay outside
    it) run with its cross-entropies on DTensor logits computed as loss parallelism (module docstring)."""
    forward = module.forward

    @wraps(forward)
    def on_shards(*args, **kwargs):
        with _OnShards():
            return forward(*args, **kwargs)

    module.forward = on_shards


# aten's `reduction` argument (`at::Reduction`) -> F.cross_entropy's
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def traced_losses(module: nn.Module) -> int:
    """A traced stage module's cross-entropies (`aten.cross_entropy_loss` in its graphs: `pipeline()` traces the
    module's `F.cross_entropy` so) made calls of `traced_cross_entropy`, so that one on vocabulary-split DTensor
    logits runs as loss parallelism as the module's own does under `install`; the count made. The stage's
    forward and backward already run as one (`apply.dtensor_step`), so no mode is needed around them."""
    from parsat.backend.torch_native.traced_graphs import retarget

    loss = torch.ops.aten.cross_entropy_loss.default
    return retarget(module, lambda _prefix, node: traced_cross_entropy if node.target is loss else None)


def traced_cross_entropy(input, target, weight=None, reduction: int = 1, ignore_index: int = -100,
                         label_smoothing: float = 0.0) -> torch.Tensor:
    """`aten.cross_entropy_loss(...)` (its arguments) as `cross_entropy_on_shards`."""
    return cross_entropy_on_shards(input, target, weight=weight, reduction=_REDUCTIONS[reduction],
                                   ignore_index=ignore_index, label_smoothing=label_smoothing)


class _OnShards(TorchFunctionMode):
    """`F.cross_entropy` on a DTensor split along its class dim -> `cross_entropy_on_shards`; all else unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            return cross_entropy_on_shards(*args, **kwargs)
        return func(*args, **kwargs)


def cross_entropy_on_shards(*args, **kwargs) -> torch.Tensor:
    """`F.cross_entropy(*args, **kwargs)`; where its input is a DTensor split along the class dim (dim 1, or 0 for
    one row) on a one-dimensional mesh, computed as loss parallelism, forward and backward (`_LossParallel`),
    the loss a plain tensor. Raises LossParallelError for what loss parallelism does not compute."""
    from torch.distributed.tensor import DTensor, Shard

    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    logits, target = a["input"], a["target"]
    if not isinstance(logits, DTensor):
        return F.cross_entropy(*args, **kwargs)
    class_dim = 1 if logits.ndim > 1 else 0
    split = [p for p in logits.placements if isinstance(p, Shard) and p.dim % logits.ndim == class_dim]
    if not split:
        return F.cross_entropy(*args, **kwargs)
    why = ("label smoothing" if a["label_smoothing"] else "class weights" if a["weight"] is not None else
           "the legacy size_average / reduce" if a["size_average"] is not None or a["reduce"] is not None else
           "probabilities as targets" if target.is_floating_point() else
           f"a {logits.device_mesh.ndim}-dimensional mesh" if logits.device_mesh.ndim != 1 else "")
    if why:
        raise LossParallelError(
            f"F.cross_entropy on logits {list(logits.shape)} split along the vocabulary ({logits.placements}) with "
            f"{why}: the plan computes the loss vocabulary-parallel (Megatron-LM's cross-entropy), and torch's "
            "loss_parallel() computes it with class indices as targets only, no weights, no label smoothing, on "
            "one tensor-parallel mesh dim; run the plan with the interpreter or use a plan that gathers the logits")
    if isinstance(target, DTensor):
        target = target.full_tensor()
    placement = split[0]
    if placement.dim < 0:   # loss_parallel finds the class dim by its index: Shard(-1) stated as Shard(class_dim)
        logits = DTensor.from_local(logits.to_local(), logits.device_mesh, [Shard(class_dim)], run_check=False,
                                    shape=logits.shape, stride=logits.stride())
    return _LossParallel.apply(logits, target, a["ignore_index"], a["reduction"])


class _LossParallel(torch.autograd.Function):
    """The cross-entropy of vocabulary-split DTensor logits under `loss_parallel()`, forward and backward: the
    forward builds the inner graph from a detached copy of the logits, the backward differentiates it, both in
    the context torch requires; the loss leaves as this rank's (whole, replicated) local tensor."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index: int, reduction: str):
        from torch.distributed.tensor.parallel import loss_parallel

        with torch.enable_grad(), loss_parallel():
            inner = logits.detach().requires_grad_(logits.requires_grad)
            loss = F.cross_entropy(inner, target, ignore_index=ignore_index, reduction=reduction)
        ctx.inner = (inner, loss)
        return loss.to_local().detach()

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        inner, loss = ctx.inner
        del ctx.inner
        with loss_parallel():
            (found,) = torch.autograd.grad(loss, inner, DTensor.from_local(grad, loss.device_mesh, loss.placements,
                                                                           run_check=False))
        return found, None, None, None
