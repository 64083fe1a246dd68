"""ATen elementwise operators onto library operators: casts and copies, unary functions, + - * / and pow.

Arithmetic follows torch's broadcasting and folds constant operands
(`Translator.binary`): `x - c` is `add_scalar`, `x / c` a `scale`, `c / x`
a `reciprocal` scaled. `pow` maps the exponents the library has operators
for (1, 2, 3, 0.5, -0.5, -1). `torch.where` on a condition that is data
(a mask from the inputs or from positions) is `mul` and `add` with data
leaves (`_h_where`).

Every handler takes the translator `t` (`translator.Translator`), the ATen
node, and the node's own arguments as torch passes them, and returns the
graph tensor (or list of tensors) of the node, or raises `Refused`.
"""

from __future__ import annotations

from parsat.importer.aten_patterns import rmsnorm_of
from parsat.importer.errors import Refused, aten_short


_IDENTITY = {"clone", "contiguous", "alias", "detach_", "lift_fresh_copy", "_to_copy", "to", "type_as"}
_UNARY = {"relu": "relu", "tanh": "tanh", "sigmoid": "sigmoid", "exp": "exp", "neg": "neg", "rsqrt": "rsqrt",
          "sqrt": "sqrt", "silu": "silu", "sin": "sin", "cos": "cos", "log": "log", "reciprocal": "reciprocal"}


def _h_identity(t, node, x, *rest, **kwargs):
    dtype = kwargs.get("dtype")
    if dtype is not None and not dtype.is_floating_point:
        raise Refused(f"a cast of a weight-dependent tensor to {dtype} is not differentiable")
    return t.tensor(x)


def _h_assert(t, node, *args, **kwargs):
    return None


def _h_unary(t, node, x, *rest, **kwargs):
    return t.op(_UNARY[aten_short(node)], t.tensor(x))


def _h_gelu(t, node, x, approximate="none"):
    return t.op("gelu" if approximate == "none" else "gelu_tanh", t.tensor(x))


def _h_add(t, node, x, y, alpha=1):
    if alpha != 1:
        y_s = t.scalar(y)
        if y_s is None:
            raise Refused("add with alpha other than 1 is not supported")
        y = y_s * alpha
    return t.binary("add", x, y)


def _h_sub(t, node, x, y, alpha=1):
    if alpha != 1:
        raise Refused("sub with alpha other than 1 is not supported")
    ys, xs = t.scalar(y), t.scalar(x)
    if ys is not None:
        return t.binary("add", x, -ys)
    if xs is not None:
        return t.binary("add", t.op("neg", t.tensor(y)), xs)
    a, b = t.tensor(x), t.tensor(y)
    if t.shape(a) == t.shape(b):
        return t.op("sub", a, b)
    return t.binary_handles("add", a, t.op("neg", b))


def _h_rsub(t, node, x, y, alpha=1):
    return _h_sub(t, node, y, x, alpha)


def _h_mul(t, node, x, y):
    return rmsnorm_of(t, x, y) or t.binary("mul", x, y)


def _h_div(t, node, x, y, rounding_mode=None):
    if rounding_mode is not None:
        raise Refused("division with rounding is not differentiable")
    ys, xs = t.scalar(y), t.scalar(x)
    if ys is not None:
        if ys == 0:
            raise Refused("division by the constant 0")
        return t.binary("mul", x, 1.0 / ys)
    if xs is not None:
        return t.binary("mul", t.op("reciprocal", t.tensor(y)), xs)
    a, b = t.tensor(x), t.tensor(y)
    if t.shape(a) == t.shape(b):
        return t.op("div", a, b)
    return t.binary_handles("mul", a, t.op("reciprocal", b))


def _h_pow(t, node, x, exponent):
    e = t.scalar(exponent)
    if e is None:
        raise Refused("pow with a tensor exponent is not supported")
    a = t.tensor(x)
    if e == 1:
        return a
    if e == 2:
        return t.op("mul", a, a)
    if e == 3:
        return t.op("mul", t.op("mul", a, a, tag="sq"), a)
    if e == 0.5:
        return t.op("sqrt", a)
    if e == -0.5:
        return t.op("rsqrt", a)
    if e == -1:
        return t.op("reciprocal", a)
    raise Refused(f"pow with exponent {e:g} (parsat maps 1, 2, 3, 0.5, -0.5 and -1)")


def _h_where(t, node, cond, x, y):
    """`torch.where(cond, x, y)` with a data condition, exactly: each tensor branch times the condition's 0/1
    factor where it is taken (`mul`), a scalar branch folded into a data leaf holding it where it is taken and 0
    elsewhere, the two added (T5's position bias where a mask keeps it, the float32 minimum elsewhere). In
    floating point too: x * 1 + 0 is x, x * 0 + s is s, for a finite branch x where the other is taken."""
    if t.is_compute(cond):
        raise Refused("torch.where with a condition computed from the weights is not differentiable in it")
    if not isinstance(cond, t.torch.fx.Node):
        raise Refused("torch.where with a constant condition")
    shape = tuple(t.values[node.name].shape)
    terms = []
    for branch, on in ((x, (1.0, 0.0)), (y, (0.0, 1.0))):
        c = t.scalar(branch)
        if c is None:
            factor = t.data_leaf(cond, "select", shape, select=on)
            terms.append(t.binary_handles("mul", t.tensor(branch), factor))
        elif c != 0:
            terms.append(t.data_leaf(cond, "select", shape, select=(on[0] * c, on[1] * c)))
    if len(terms) == 1:
        return terms[0]
    return t.op("add", terms[0], terms[1])


HANDLERS = {
    **{name: _h_identity for name in _IDENTITY},
    "_assert_tensor_metadata": _h_assert,
    **{name: _h_unary for name in _UNARY},
    "gelu": _h_gelu,
    "add": _h_add, "sub": _h_sub, "rsub": _h_rsub, "mul": _h_mul, "div": _h_div, "pow": _h_pow,
    "where": _h_where,
}
