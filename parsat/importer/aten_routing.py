"""ATen top-k routing (a mixture of experts' gate) onto library operators.

`torch.topk(x, k, dim=-1)` over values computed from the weights (router
probabilities) is the library's `topk_onehot`: row r the one-hot of the
r-th largest entry. Its values are that one-hot contracted with x
(`mul_bcast_dim`, then `reduce_sum` over the last dim), which is also
torch's gradient (each picked entry gets its value's gradient, the others
none). Its indices are integers computed from the weights, which no
library operator computes: they stay that one-hot (`RoutedIndices`), which
reshapes follow (`reshaped`) and which picks rows of a tensor (`x[idx]`:
`aten_views.gather_rows`, an `embedding` of the one-hot, which is how
Hugging Face's `batched_mm` experts read each token's expert weights); any
other use of them is refused. `repeat_interleave` (each token once per
chosen expert) is a `broadcast` and a `flatten`.
"""

from __future__ import annotations

from dataclasses import dataclass

from parsat.importer.errors import Refused
from parsat.ir.graph import Tensor


@dataclass(frozen=True)
class RoutedIndices:
    """Integer indices computed from the weights (a top-k's), held as their one-hot graph tensor: the indices'
    shape plus a last dim of `classes`. Never a graph tensor itself (`translator.Translator.tensor` refuses
    it): only reshapes and row picks read it."""

    onehot: Tensor
    classes: int


def routed(t, value) -> RoutedIndices | None:
    """The `RoutedIndices` a compute operand is, or None."""
    got = t.env.get(value.name) if t.is_compute(value) else None
    return got if isinstance(got, RoutedIndices) else None


def reshaped(t, indices: RoutedIndices, shape) -> RoutedIndices:
    """The indices viewed as `shape` (-1 allowed): their one-hot reshaped with its classes dim kept last."""
    dims = [int(d) for d in shape]
    return RoutedIndices(t.reshape(indices.onehot, tuple(dims) + (indices.classes,)), indices.classes)


def _h_topk(t, node, x, k, dim=-1, largest=True, sorted=True):
    a = t.tensor(x)
    shape = t.shape(a)
    if t.dim(a, dim) != len(shape) - 1:
        raise Refused("topk is supported along the last dim")
    if not largest or not sorted:
        raise Refused("topk is supported for the largest entries in sorted order (largest=True, sorted=True)")
    onehot = t.op("topk_onehot", a, k=int(k), tag="onehot")
    picked = t.op("mul_bcast_dim", onehot, a, dim=len(shape) - 1, tag="picked")
    values = t.op("reduce_sum", picked, dim=len(shape), tag="values")
    return [values, RoutedIndices(onehot, shape[-1])]


def _h_repeat_interleave(t, node, x, repeats, dim=None, *, output_size=None):
    if not isinstance(repeats, int) or dim is None:
        raise Refused("repeat_interleave is supported with an integer count along a given dim")
    a = t.tensor(x)
    d = t.dim(a, dim)
    spread = t.op("broadcast", a, dim=d + 1, n=int(repeats), tag="repeat")
    return t.op("flatten", spread, dim=d, tag="interleave")


HANDLERS = {"topk": _h_topk, "repeat_interleave": _h_repeat_interleave}
