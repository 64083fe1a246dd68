"""Fused operators recognised in the ATen graph: a pattern of several ATen nodes mapped onto one library operator.

A model written with torch's small operators pays, in the cost model as on
a GPU, one kernel per operator and one stored activation per intermediate
value. Where a pattern's value is exactly a library operator's, it is
imported as that operator, as `aten_attention` imports a causal
`scaled_dot_product_attention` as `attention_causal`:

* RMS normalization, as Hugging Face's `LlamaRMSNorm` (and Mistral's, Qwen's,
  Gemma's) writes it: `gain * (x * rsqrt(mean(x^2, -1, keepdim) + eps))`, with
  casts anywhere along it, is `rmsnorm(x, gain, eps)` (`rules/ops.rule`:
  `x[j] / sqrt(sum_l x[l]^2 / n + eps) * gain[j]`, the same value). The gain
  is any tensor of the last dim's size (Gemma's is `1 + weight`).

A pattern is taken only when each of its inner nodes has one reader (the
pattern's next node): a value read elsewhere too would be computed twice.
The importer's self-check (`self_check`) evaluates the fused graph against
the module, so a pattern recognised wrongly is refused, never trained.
"""

from __future__ import annotations

from parsat.importer.errors import aten_short
from parsat.ir.graph import Tensor

# ATen nodes that keep a value as it is (casts between floating dtypes, copies): see aten_elementwise's `_IDENTITY`.
_CASTS = frozenset({"clone", "contiguous", "alias", "_to_copy", "to", "type_as"})
_CHECKS = frozenset({"_assert_tensor_metadata"})


def rmsnorm_of(t, x, y):
    """`rmsnorm(input, gain, eps)` when `x * y` is an RMS normalization times its gain (see the module docstring),
    else None. `t` is the translator; `x` and `y` the ATen `mul`'s operands."""
    for normed, gain in ((x, y), (y, x)):
        parts = _normalized(t, normed)
        if parts is None or not isinstance(gain, t.torch.fx.Node) or not _mapped(t, parts[0]):
            continue
        source, eps, read = parts
        base, gamma = t.tensor(source), t.tensor(gain)
        shape = t.shape(base)
        if shape and t.shape(gamma) == (shape[-1],):
            out = t.op("rmsnorm", base, gamma, eps=eps)
            t.read_as(out, 0, read)   # LlamaRMSNorm normalizes `hidden_states.to(torch.float32)`
            return out
    return None


def _normalized(t, value):
    """(x, eps, the value normalized: x as cast) when `value` is `x * rsqrt(mean(x * x, -1, keepdim=True) + eps)`
    (casts aside), each inner node read once; else None."""
    product = _uncast(value)
    if not _is(product, "mul") or not _read_once(value, product):
        return None
    for a, b in (product.args[:2], product.args[1::-1]):
        root = _uncast(b)
        if not _is(root, "rsqrt") or not _read_once(b, root):
            continue
        shifted = _uncast(root.args[0])
        eps = _scalar_term(t, shifted)
        if eps is None or not _read_once(root.args[0], shifted):
            continue
        mean = _uncast(shifted.args[0])
        if not _is_last_dim_mean(t, mean) or not _read_once(shifted.args[0], mean):
            continue
        square = _uncast(mean.args[0])
        if _squares(square, _uncast(a)) and _read_once(mean.args[0], square):
            return _uncast(a), eps, a
    return None


def _mapped(t, value) -> bool:
    """Whether `value` is data or a compute node already mapped to a graph tensor (not a weight not yet read)."""
    return not t.is_compute(value) or isinstance(t.env.get(value.name), Tensor)


def _uncast(value):
    """The node a chain of casts and copies starts from (`value` itself when it is none)."""
    while _is_node(value) and aten_short(value) in _CASTS and value.args:
        value = value.args[0]
    return value


def _read_once(value, inner) -> bool:
    """Whether every node from `value` back through its casts to `inner` has exactly one reader (the checks of a
    value's dtype that export records, `_assert_tensor_metadata`, compute nothing and are not readers)."""
    node = value
    while True:
        if sum(1 for user in node.users if aten_short(user) not in _CHECKS) != 1:
            return False
        if node is inner:
            return True
        node = node.args[0]


def _is_node(value) -> bool:
    return hasattr(value, "op") and hasattr(value, "users") and getattr(value, "op", None) == "call_function"


def _is(value, name: str) -> bool:
    return _is_node(value) and aten_short(value) == name


def _scalar_term(t, node) -> float | None:
    """c when `node` is `v + c` for a constant c (alpha 1), else None."""
    if not _is(node, "add") or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    return t.scalar(node.args[1])


def _is_last_dim_mean(t, node) -> bool:
    """Whether `node` is a mean over its input's last dim, the dim kept."""
    if not _is(node, "mean") or len(node.args) < 3:
        return False
    dims, keep = node.args[1], node.args[2]
    rank = len(t.values[node.args[0].name].shape) if _is_node(node.args[0]) else 0
    return bool(keep) and isinstance(dims, (list, tuple)) and len(dims) == 1 and rank > 0 \
        and dims[0] % rank == rank - 1


def _squares(node, base) -> bool:
    """Whether `node` is `base` squared: `pow(base, 2)` or `base * base` (casts aside)."""
    if _is(node, "pow") and len(node.args) == 2 and node.args[1] == 2:
        return _uncast(node.args[0]) is base
    return _is(node, "mul") and _uncast(node.args[0]) is base and _uncast(node.args[1]) is base
