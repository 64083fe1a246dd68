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

Experts: a batched matmul of each (token, choice) row by its picked
expert's weights (`bmm(w[ids], x.unsqueeze(-1))`, Hugging Face's
`batched_mm`, or `bmm(x.unsqueeze(1), w[ids])` for transposed weights) is
imported as the dispatch form the expert rules match (`expert_matmul`):
the rows spread over an experts dim and zeroed where the row did not pick
the expert (`broadcast`, `mul_bcast_dim` by the one-hot), one `bmm` over
the experts dim by the weights as stored ([experts, k, n]), and the
experts' rows summed (`reduce_sum` over the experts dim: only the picked
expert's row is non-zero). That is the same value: out[s] =
sum_e onehot[s, e] * (x[s] @ w[e]) = x[s] @ w[ids[s]], with the gradients
of x and w the same sums. Dropless: every row reaches its expert. It
multiplies every row by every expert (experts times the FLOPs of the
pick), the price of static shapes that the built-in `moe` pays too, and
it is what lets `rules/parallel.rule`'s `bmm_expert_parallel` and
`ir.expert_parallel` store the experts split over a mesh axis and move the
rows by all-to-all. Each such bmm is dispatched and combined on its own:
between two of them (Mixtral's up and down projections) the activation
runs on the combined rows, so no all-to-all pair cancels there.
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


def note_picked_rows(t, rows, indices: RoutedIndices, table) -> None:
    """Remember that `rows` is `table[indices]` (a 1-D top-k's indices into dim 0 of a rank-3 table) for
    `expert_matmul`; the pick itself stays in the graph for any other reader (pruned where there is none)."""
    if len(t.shape(indices.onehot)) == 2 and len(t.shape(table)) == 3:
        t.picked_rows[rows.name] = (indices.onehot, table)


def expert_matmul(t, a, b):
    """The dispatch form (module docstring) of `bmm(a, b)` where one operand is a table's rows picked by a top-k's
    indices, [s, n, k] by x [s, k, 1] or x [s, 1, k] by [s, k, n]; None for any other bmm."""
    sa, sb = t.shape(a), t.shape(b)
    if a.name in t.picked_rows and len(sb) == 3 and sb[2] == 1 and sb[:2] == (sa[0], sa[2]):
        onehot, table = t.picked_rows[a.name]
        weights, rows, out_shape = t.transpose(table, 1, 2), b, (sa[0], sa[1], 1)
    elif b.name in t.picked_rows and len(sa) == 3 and sa[1] == 1 and (sa[0], sa[2]) == sb[:2]:
        onehot, table = t.picked_rows[b.name]
        weights, rows, out_shape = table, a, (sb[0], 1, sb[2])
    else:
        return None
    experts = t.shape(table)[0]
    tokens = t.reshape(rows, (t.shape(rows)[0], -1))
    spread = t.op("broadcast", tokens, dim=0, n=experts, tag="to_experts")
    chosen = t.transpose(onehot, 0, 1)
    dispatched = t.op("mul_bcast_dim", spread, chosen, dim=2, tag="dispatch")
    ran = t.op("bmm", dispatched, weights, tag="experts")
    return t.reshape(t.op("reduce_sum", ran, dim=0, tag="combine"), out_shape)


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
