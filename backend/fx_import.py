"""`from_torch(module, example_inputs)`: a torch `nn.Module` as a parsat graph, via torch.fx.

The module is traced symbolically (`torch.fx.symbolic_trace`) and run once
on the example inputs with an fx `Interpreter`, which gives every fx node
its concrete value: tensors' shapes, and the plain Python values of shape
arithmetic (`x.shape`, `b, s, d = x.size()`), which parsat graphs do not
have and which become constants here. Each tensor-valued node is then
mapped onto operators of the library (`rules/ops.rule`) with `GraphBuilder`,
which infers and checks every shape again.

Names: graph inputs keep the fx placeholder names; weights are named by the
module's qualified parameter names (`blocks.0.fc1.weight`), so a plan's
weights map back to `module.get_parameter(name)` (`torch_parameter`). One
convention to know: the library's `linear` reads its weight as `[in, out]`
while `nn.Linear` stores `[out, in]`, so the weight leaf of a Linear (and
`in_proj_weight` of `nn.MultiheadAttention`) is the parameter transposed;
`module_weights` applies it.

Anything without a faithful mapping (max pooling, masks, a constant tensor,
broadcasting other than a bias) is an `FxImportError` naming the operator,
the fx node and the module path, never a silently different graph.
"""

from __future__ import annotations

import importlib.util
import math
import operator
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from parsat.ir.graph import Graph, GraphBuilder, GraphError, Tensor


class FxImportError(ValueError):
    """A module parsat cannot import: the message names the operator and where it is.

    A ValueError, so that `parsat optimize model.py:factory` reports it like any bad model argument.
    """


@dataclass(frozen=True)
class _Where:
    """Where an fx node comes from, for error messages."""

    node: str
    module: str

    def __str__(self) -> str:
        inside = f" in module '{self.module}'" if self.module else " in the top-level forward"
        return f"fx node '{self.node}'{inside}"


def _where(node) -> _Where:
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
    if node.op == "call_module":
        path = str(node.target)
    return _Where(node.name, path)


# ------------------------------------------------------------------ the importer


def from_torch(module, example_inputs, library=None, name: str | None = None) -> Graph:
    """The parsat graph of `module` applied to `example_inputs` (a tensor or a tuple of tensors).

    Raises `FxImportError` for an operator or a use of one that parsat cannot
    express, naming it and its place in the module.
    """
    import torch
    import torch.fx

    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise FxImportError("example inputs must be tensors (a tensor or a tuple of tensors)")
    try:
        traced = torch.fx.symbolic_trace(module)
    except Exception as err:  # noqa: BLE001 - fx raises many kinds; the user needs the reason, not a trace
        raise FxImportError(f"torch.fx cannot trace {type(module).__name__}: {type(err).__name__}: {err}") from None
    traced.graph.eliminate_dead_code()
    traced.recompile()
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise FxImportError(f"{type(module).__name__}.forward takes {len(placeholders)} input(s) but "
                            f"{len(inputs)} example input(s) were given")
    values = _concrete_values(traced, inputs)
    translator = _Translator(module, traced, values, GraphBuilder(library, name=name or type(module).__name__))
    return translator.run()


def _concrete_values(traced, inputs: Sequence[Any]) -> dict:
    """Every fx node's value on the example inputs (one eager run)."""
    import torch
    import torch.fx

    values: dict = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            values[node] = result
            return result

    try:
        with torch.no_grad():
            Recorder(traced).run(*inputs)
    except Exception as err:  # noqa: BLE001
        raise FxImportError(f"the module does not run on the example inputs: {type(err).__name__}: {err}") from None
    return values


@dataclass(frozen=True)
class _Absent:
    """A value the graph cannot hold (MultiheadAttention's attention weights); an error if used."""

    what: str


class _Translator:
    """Walks the fx graph once, node by node, building the parsat graph."""

    def __init__(self, module, traced, values: dict, builder: GraphBuilder):
        import torch

        self.torch = torch
        self.module = module
        self.traced = traced
        self.values = values
        self.g = builder
        self.env: dict = {}                  # fx node -> Tensor handle or a Python value
        self.weights: dict[str, Tensor] = {}  # parameter name (+ orientation) -> leaf
        self.where = _Where("", "")
        self.names: set[str] = set()

    # -- helpers ---------------------------------------------------------
    def fail(self, message: str) -> FxImportError:
        return FxImportError(f"{self.where}: {message}")

    def fresh(self, base: str) -> str:
        name, index = base, 1
        while name in self.names:
            index += 1
            name = f"{base}_{index}"
        self.names.add(name)
        return name

    def op(self, kind: str, *args, tag: str = "", **attrs) -> Tensor:
        try:
            return self.g.op(kind, *args, name=self.fresh(self.where.node + (f"_{tag}" if tag else "")), **attrs)
        except GraphError as err:
            raise self.fail(str(err)) from None

    def shape(self, t: Tensor) -> tuple[int, ...]:
        return self.g.shape(t)

    def weight(self, name: str, transposed: bool = False) -> Tensor:
        """The leaf of parameter `name` (transposed: the `[in, out]` form of a Linear weight)."""
        key = name + ("^T" if transposed else "")
        other = name + ("" if transposed else "^T")
        if other in self.weights:
            raise self.fail(f"parameter '{name}' is used both as a Linear weight and directly; parsat keeps one "
                            "orientation per weight")
        if key not in self.weights:
            try:
                param = self.module.get_parameter(name)
            except AttributeError:
                raise self.fail(f"'{name}' is not a parameter of the module (buffers and constant tensors "
                                "cannot be graph weights)") from None
            shape = tuple(param.shape)
            if transposed:
                shape = tuple(reversed(shape))
            self.names.add(name)
            try:
                self.weights[key] = self.g.weight(name, shape)
            except GraphError as err:
                raise self.fail(str(err)) from None
        return self.weights[key]

    def arg(self, value):
        """An fx argument with nodes replaced by what they became (handles or constants)."""
        import torch.fx

        if isinstance(value, torch.fx.Node):
            return self.env[value]
        if isinstance(value, (tuple, list)):
            return type(value)(self.arg(v) for v in value)
        if isinstance(value, dict):
            return {k: self.arg(v) for k, v in value.items()}
        return value

    def tensor(self, value, what: str = "input") -> Tensor:
        if isinstance(value, Tensor):
            return value
        if isinstance(value, _Absent):
            raise self.fail(f"{value.what} is not supported")
        raise self.fail(f"expected a tensor as {what}, got the constant {value!r} (parsat graphs have no constants)")

    def dim(self, t: Tensor, d: int) -> int:
        rank = len(self.shape(t))
        if not -rank <= d < rank:
            raise self.fail(f"dim {d} is out of range for a tensor of rank {rank}")
        return d % rank

    # -- the walk --------------------------------------------------------
    def run(self) -> Graph:
        torch = self.torch
        onehot = self._onehot_inputs()
        for node in self.traced.graph.nodes:
            self.where = _where(node)
            value = self.values.get(node)
            if node.op == "placeholder":
                if node in onehot:
                    shape = tuple(value.shape) + (onehot[node],)
                elif value.is_floating_point():
                    shape = tuple(value.shape)
                else:
                    raise self.fail(f"input '{node.name}' has dtype {value.dtype}; integer inputs are only "
                                    "supported as the ids of an nn.Embedding")
                self.names.add(node.name)
                self.env[node] = self.g.input(node.name, shape)
            elif node.op == "get_attr":
                self.env[node] = self.weight(str(node.target))
            elif node.op == "output":
                outs = node.args[0]
                outs = outs if isinstance(outs, (tuple, list)) else (outs,)
                for out in outs:
                    self.g.output(self.tensor(self.arg(out), "a model output"))
            elif not isinstance(value, torch.Tensor) and not _holds_tensor(value):
                self.env[node] = value  # shape arithmetic: a constant of the graph
            elif node.op == "call_module":
                self.env[node] = self._module(node, self.module.get_submodule(str(node.target)))
            else:
                self.env[node] = self._function(node)
        try:
            return self.g.build()
        except GraphError as err:
            raise FxImportError(str(err)) from None

    def _onehot_inputs(self) -> dict:
        """Integer inputs read by an nn.Embedding: they become one-hot inputs `[*ids, vocabulary]`."""
        torch = self.torch
        found = {}
        for node in self.traced.graph.nodes:
            if node.op != "placeholder" or self.values[node].is_floating_point():
                continue
            for user in node.users:
                sub = self.module.get_submodule(str(user.target)) if user.op == "call_module" else None
                if isinstance(sub, torch.nn.Embedding) and user.args and user.args[0] is node:
                    found[node] = sub.num_embeddings
        return found

    # -- modules ---------------------------------------------------------
    def _module(self, node, sub):
        nn = self.torch.nn
        path = str(node.target)
        args = [self.arg(a) for a in node.args]
        kwargs = {k: self.arg(v) for k, v in node.kwargs.items()}
        simple = {nn.ReLU: "relu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid"}
        for cls, op in simple.items():
            if type(sub) is cls:
                return self.op(op, self.tensor(args[0]))
        if isinstance(sub, nn.Identity):
            return self.tensor(args[0])
        if isinstance(sub, nn.GELU):
            return self._gelu(self.tensor(args[0]), sub.approximate)
        if isinstance(sub, nn.Dropout):
            return self.op("dropout", self.tensor(args[0]), rate=float(sub.p))
        if isinstance(sub, nn.Softmax):
            x = self.tensor(args[0])
            if sub.dim is None:
                raise self.fail("nn.Softmax without an explicit dim is not supported")
            return self.op("softmax", x, dim=self.dim(x, sub.dim))
        if isinstance(sub, nn.Linear):
            return self._linear(self.tensor(args[0]), path + ".weight", None if sub.bias is None else path + ".bias")
        if isinstance(sub, nn.LayerNorm):
            if len(sub.normalized_shape) != 1 or not sub.elementwise_affine or sub.bias is None:
                raise self.fail("nn.LayerNorm is supported over the last dim with elementwise affine weight and bias")
            return self.op("layernorm", self.tensor(args[0]), self.weight(path + ".weight"),
                           self.weight(path + ".bias"), eps=float(sub.eps))
        if isinstance(sub, nn.Embedding):
            if sub.max_norm is not None:
                raise self.fail("nn.Embedding with max_norm is not supported")
            return self.op("embedding", self.tensor(args[0]), self.weight(path + ".weight"))
        if isinstance(sub, nn.Conv2d):
            return self._conv2d(self.tensor(args[0]), sub, path)
        if isinstance(sub, nn.AvgPool2d):
            return self._avgpool(self.tensor(args[0]), sub.kernel_size, sub.stride, sub.padding, sub.ceil_mode)
        if isinstance(sub, nn.AdaptiveAvgPool2d):
            return self._adaptive_avgpool(self.tensor(args[0]), sub.output_size)
        if isinstance(sub, nn.Flatten):
            return self._flatten(self.tensor(args[0]), sub.start_dim, sub.end_dim)
        if isinstance(sub, nn.MultiheadAttention):
            return self._mha(sub, path, args, kwargs)
        raise self.fail(f"unsupported operator: module {type(sub).__module__}.{type(sub).__name__}")

    # -- functions and methods -------------------------------------------
    def _function(self, node):
        torch, F = self.torch, self.torch.nn.functional
        target = node.target
        args = [self.arg(a) for a in node.args]
        kwargs = {k: self.arg(v) for k, v in node.kwargs.items()}
        key = target if node.op == "call_method" else getattr(target, "__name__", str(target))
        if node.op == "call_function" and target is operator.getitem:
            return self._getitem(args[0], args[1])
        table: dict[str, Callable] = {
            "relu": lambda x, *a, **k: self.op("relu", self.tensor(x)),
            "tanh": lambda x, *a, **k: self.op("tanh", self.tensor(x)),
            "sigmoid": lambda x, *a, **k: self.op("sigmoid", self.tensor(x)),
            "exp": lambda x, *a, **k: self.op("exp", self.tensor(x)),
            "gelu": lambda x, approximate="none": self._gelu(self.tensor(x), approximate),
            "softmax": self._softmax,
            "dropout": lambda x, p=0.5, *a, **k: self.op("dropout", self.tensor(x), rate=float(p)),
            "layer_norm": self._layer_norm,
            "matmul": self._matmul, "bmm": self._matmul,
            "add": self._add, "iadd": self._add, "sub": self._sub, "mul": self._mul, "truediv": self._div,
            "div": self._div,
            "transpose": lambda x, d0, d1: self._transpose(self.tensor(x), d0, d1),
            "permute": lambda x, *dims: self._permute(self.tensor(x), dims),
            "view": lambda x, *shape: self._reshape(self.tensor(x), shape),
            "reshape": lambda x, *shape: self._reshape(self.tensor(x), shape),
            "flatten": lambda x, start_dim=0, end_dim=-1: self._flatten(self.tensor(x), start_dim, end_dim),
            "contiguous": lambda x, *a, **k: self.tensor(x),
            "cat": self._cat, "concat": self._cat,
            "sum": lambda x, dim=None, keepdim=False: self._reduce("reduce_sum", self.tensor(x), dim, keepdim),
            "mean": lambda x, dim=None, keepdim=False: self._reduce("mean", self.tensor(x), dim, keepdim),
            "avg_pool2d": lambda x, kernel_size, stride=None, padding=0, ceil_mode=False, *a, **k:
                self._avgpool(self.tensor(x), kernel_size, stride, padding, ceil_mode),
            "adaptive_avg_pool2d": lambda x, output_size: self._adaptive_avgpool(self.tensor(x), output_size),
            "scaled_dot_product_attention": self._sdpa,
        }
        handler = table.get(key)
        if handler is None:
            kind = "method" if node.op == "call_method" else "function"
            raise self.fail(f"unsupported operator: {kind} '{key}'")
        if key == "permute" and len(args) == 2 and isinstance(args[1], (tuple, list)):
            args = [args[0], *args[1]]
        if key in ("view", "reshape") and len(args) == 2 and isinstance(args[1], (tuple, list)):
            args = [args[0], *args[1]]
        try:
            return handler(*args, **kwargs)
        except TypeError as err:
            raise self.fail(f"unsupported call of '{key}': {err}") from None

    def _getitem(self, source, index):
        if isinstance(source, (tuple, list)):
            return source[index]
        raise self.fail("unsupported operator: indexing or slicing a tensor")

    # -- operator mappings -------------------------------------------------
    def _gelu(self, x: Tensor, approximate: str) -> Tensor:
        if approximate != "none":
            raise self.fail(f"GELU with approximate='{approximate}' is not supported (the library's gelu is exact)")
        return self.op("gelu", x)

    def _softmax(self, x, dim=None, *args, **kwargs) -> Tensor:
        x = self.tensor(x)
        if dim is None:
            raise self.fail("softmax without an explicit dim is not supported")
        return self.op("softmax", x, dim=self.dim(x, dim))

    def _layer_norm(self, x, normalized_shape, weight=None, bias=None, eps=1e-5) -> Tensor:
        x = self.tensor(x)
        if len(tuple(normalized_shape)) != 1 or not isinstance(weight, Tensor) or not isinstance(bias, Tensor):
            raise self.fail("layer_norm is supported over the last dim with weight and bias parameters")
        return self.op("layernorm", x, weight, bias, eps=float(eps))

    def _linear(self, x: Tensor, weight: str, bias: str | None) -> Tensor:
        w = self.weight(weight, transposed=True)
        if bias is not None:
            return self.op("linear", x, w, self.weight(bias))
        return self._matmul(x, w)

    def _matmul(self, a, b) -> Tensor:
        a, b = self.tensor(a), self.tensor(b)
        sa, sb = self.shape(a), self.shape(b)
        if len(sa) == 2 and len(sb) == 2:
            return self.op("matmul", a, b)
        if len(sa) == len(sb) and len(sa) > 2:
            return self.op("bmm", a, b)
        if len(sa) > 2 and len(sb) == 2:  # [*s, k] @ [k, n]: rows merged, multiplied, split again
            flat = a
            for _ in range(len(sa) - 2):
                flat = self.op("flatten", flat, dim=0, tag="rows")
            out = self.op("matmul", flat, b)
            return self._reshape(out, tuple(sa[:-1]) + (sb[-1],))
        raise self.fail(f"unsupported operator: matmul of shapes {list(sa)} and {list(sb)} (broadcasting)")

    def _binary(self, kind: str, x, y) -> Tensor:
        x, y = self.tensor(x, "left operand"), self.tensor(y, "right operand")
        sx, sy = self.shape(x), self.shape(y)
        if sx == sy:
            return self.op(kind, x, y)
        if kind == "add" and len(sy) == 1 and sx[-1:] == sy:
            return self.op("bias_add", x, y)
        if kind == "add" and len(sx) == 1 and sy[-1:] == sx:
            return self.op("bias_add", y, x)
        raise self.fail(f"unsupported operator: {kind} of shapes {list(sx)} and {list(sy)} (parsat supports equal "
                        "shapes, and adding a bias along the last dim)")

    def _add(self, x, y, *, alpha=1) -> Tensor:
        if alpha != 1:
            raise self.fail("add with alpha is not supported")
        return self._binary("add", x, y)

    def _sub(self, x, y, *, alpha=1) -> Tensor:
        if alpha != 1:
            raise self.fail("sub with alpha is not supported")
        return self._binary("sub", x, y)

    def _mul(self, x, y) -> Tensor:
        if isinstance(y, (int, float)) and isinstance(x, Tensor):
            return self.op("scale", x, c=float(y))
        if isinstance(x, (int, float)) and isinstance(y, Tensor):
            return self.op("scale", y, c=float(x))
        return self._binary("mul", x, y)

    def _div(self, x, y, rounding_mode=None) -> Tensor:
        if rounding_mode is None and isinstance(y, (int, float)) and isinstance(x, Tensor) and y != 0:
            return self.op("scale", x, c=1.0 / float(y))
        raise self.fail("unsupported operator: division other than by a constant")

    def _transpose(self, x: Tensor, d0: int, d1: int) -> Tensor:
        a, b = sorted((self.dim(x, d0), self.dim(x, d1)))
        return x if a == b else self.op("transpose", x, d0=a, d1=b)

    def _permute(self, x: Tensor, dims: Sequence[int]) -> Tensor:
        target = [self.dim(x, d) for d in dims]
        if sorted(target) != list(range(len(self.shape(x)))):
            raise self.fail(f"permute{tuple(dims)} is not a permutation of the dims")
        current = list(range(len(target)))
        for i, want in enumerate(target):
            j = current.index(want)
            if j != i:
                x = self.op("transpose", x, d0=i, d1=j, tag="perm")
                current[i], current[j] = current[j], current[i]
        return x

    def _flatten(self, x: Tensor, start: int = 0, end: int = -1) -> Tensor:
        rank = len(self.shape(x))
        if rank == 0:
            return x
        start, end = self.dim(x, start), self.dim(x, end)
        for _ in range(end - start):
            x = self.op("flatten", x, dim=start)
        return x

    def _reshape(self, x: Tensor, shape: Sequence[int]) -> Tensor:
        """A reshape as `flatten`s and `unflatten`s of consecutive groups of dims with equal products."""
        src = list(self.shape(x))
        total = math.prod(src)
        dst = [int(d) for d in shape]
        if dst.count(-1) == 1:
            known = math.prod(d for d in dst if d != -1)
            dst[dst.index(-1)] = total // known if known else 0
        if math.prod(dst) != total or any(d < 1 for d in dst):
            raise self.fail(f"cannot reshape {src} to {list(shape)}")
        groups = _reshape_groups(src, dst)
        if groups is None:
            raise self.fail(f"unsupported operator: reshape of {src} to {dst}")
        pos = 0
        for n_in, outs in groups:
            for _ in range(n_in - 1):
                x = self.op("flatten", x, dim=pos, tag="merge")
            for i in range(len(outs) - 1):
                x = self.op("unflatten", x, dim=pos + i, k=math.prod(outs[i + 1:]), tag="split")
            pos += len(outs)
        return x

    def _cat(self, tensors, dim=0) -> Tensor:
        items = [self.tensor(t) for t in tensors]
        if not items:
            raise self.fail("cat of no tensors")
        out = items[0]
        for other in items[1:]:
            out = self.op("concat", out, other, dim=self.dim(out, dim))
        return out

    def _reduce(self, kind: str, x: Tensor, dim, keepdim: bool) -> Tensor:
        if keepdim or dim is None:
            raise self.fail(f"{'sum' if kind == 'reduce_sum' else 'mean'} is supported over given dims, without "
                            "keepdim")
        dims = sorted({self.dim(x, d) for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}, reverse=True)
        if kind == "mean" and dims == [3, 2] and len(self.shape(x)) == 4:
            return self.op("global_avgpool", x)
        for d in dims:
            x = self.op(kind, x, dim=d)
        return x

    def _avgpool(self, x: Tensor, kernel, stride, padding, ceil_mode) -> Tensor:
        size, step, pad = _square(kernel), _square(stride if stride else kernel), _square(padding)
        if None in (size, step) or pad != 0 or ceil_mode:
            raise self.fail("avg_pool2d is supported with square kernels and strides, no padding, no ceil_mode")
        return self.op("avgpool2d", x, size=size, stride=step)

    def _adaptive_avgpool(self, x: Tensor, output_size) -> Tensor:
        if _square(output_size) != 1:
            raise self.fail("adaptive_avg_pool2d is supported with output size 1 (global average pooling)")
        out = self.op("global_avgpool", x)
        return self._reshape(out, self.shape(out) + (1, 1))

    def _conv2d(self, x: Tensor, conv, path: str) -> Tensor:
        stride, pad = _square(conv.stride), _square(conv.padding)
        if (stride is None or pad is None or _square(conv.dilation) != 1 or conv.groups != 1
                or conv.padding_mode != "zeros"):
            raise self.fail("nn.Conv2d is supported with square stride and padding, no dilation, groups=1, zero "
                            "padding")
        out = self.op("conv2d", x, self.weight(path + ".weight"), stride=stride, pad=pad)
        if conv.bias is None:
            return out
        moved = self.op("transpose", out, d0=1, d1=3, tag="bias_in")  # channels last, for bias_add
        biased = self.op("bias_add", moved, self.weight(path + ".bias"))
        return self.op("transpose", biased, d0=1, d1=3, tag="bias_out")

    def _attention(self, q: Tensor, k: Tensor, v: Tensor, scale: float, dropout: float) -> Tensor:
        """softmax(q k^T * scale) v on [b, heads, s, dh] tensors."""
        scores = self.op("bmm", q, self.op("transpose", k, d0=2, d1=3, tag="kT"), tag="scores")
        probs = self.op("softmax", self.op("scale", scores, c=scale, tag="scaled"), dim=3, tag="probs")
        if dropout:
            probs = self.op("dropout", probs, rate=float(dropout), tag="attn_drop")
        return self.op("bmm", probs, v, tag="ctx")

    def _sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **rest) -> Tensor:
        if attn_mask is not None or is_causal or rest.get("enable_gqa"):
            raise self.fail("scaled_dot_product_attention with a mask, is_causal or GQA is not supported")
        q, k, v = self.tensor(q), self.tensor(k), self.tensor(v)
        if not len(self.shape(q)) == 4:
            raise self.fail("scaled_dot_product_attention is supported on [batch, heads, seq, dim] tensors")
        return self._attention(q, k, v, scale if scale is not None else 1.0 / math.sqrt(self.shape(q)[-1]),
                               dropout_p)

    def _mha(self, mha, path: str, args, kwargs):
        """nn.MultiheadAttention as linear projections, head split, scaled dot products and the out projection."""
        names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
                 "is_causal")
        call = {**dict(zip(names, args)), **kwargs}
        if call.get("key_padding_mask") is not None or call.get("attn_mask") is not None or call.get("is_causal"):
            raise self.fail("nn.MultiheadAttention with masks or is_causal is not supported")
        if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
            raise self.fail("nn.MultiheadAttention is supported with equal q/k/v dims, no bias_kv, no add_zero_attn")
        e, heads = mha.embed_dim, mha.num_heads
        dh = e // heads
        q_in, k_in, v_in = (self.tensor(call[n], n) for n in ("query", "key", "value"))
        if not mha.batch_first:  # [s, b, e] -> [b, s, e]
            q_in, k_in, v_in = (self._transpose(t, 0, 1) for t in (q_in, k_in, v_in))
        w = self.weight(path + ".in_proj_weight", transposed=True)   # [e, 3e]
        b = None if mha.in_proj_bias is None else self.weight(path + ".in_proj_bias")
        if q_in == k_in == v_in:
            both = self.op("linear", q_in, w, b, tag="qkv") if b is not None else self._matmul(q_in, w)
            projected = [self.op("split", both, dim=2, start=i * e, size=e, tag="qkv"[i]) for i in range(3)]
        else:
            projected = []
            for i, t in enumerate((q_in, k_in, v_in)):
                wi = self.op("split", w, dim=1, start=i * e, size=e, tag="w" + "qkv"[i])
                if b is None:
                    projected.append(self._matmul(t, wi))
                else:
                    bi = self.op("split", b, dim=0, start=i * e, size=e, tag="b" + "qkv"[i])
                    projected.append(self.op("linear", t, wi, bi, tag="qkv"[i]))
        q, k, v = (self.op("transpose", self.op("unflatten", t, dim=2, k=dh, tag=tag + "_split"), d0=1, d1=2,
                           tag=tag + "_heads") for t, tag in zip(projected, "qkv"))
        ctx = self._attention(q, k, v, 1.0 / math.sqrt(dh), mha.dropout)
        merged = self.op("flatten", self.op("transpose", ctx, d0=1, d1=2, tag="ctx_t"), dim=2, tag="ctx_merged")
        out = self._linear(merged, path + ".out_proj.weight",
                           None if mha.out_proj.bias is None else path + ".out_proj.bias")
        if not mha.batch_first:
            out = self._transpose(out, 0, 1)
        return (out, _Absent("the attention weights returned by nn.MultiheadAttention"))


def _holds_tensor(value) -> bool:
    import torch

    if isinstance(value, (tuple, list)):
        return any(isinstance(v, torch.Tensor) or _holds_tensor(v) for v in value)
    return False


def _square(value) -> int | None:
    """An int from an int or a pair of equal ints (kernel sizes, strides, paddings); None otherwise."""
    if isinstance(value, int):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2 and value[0] == value[1] and isinstance(value[0], int):
        return value[0]
    return None


def _reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, list[int]]] | None:
    """Consecutive groups (number of source dims, target dims) with equal products; size-1 dims join a neighbour."""
    groups: list[tuple[int, list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i == len(src) or j == len(dst):  # only size-1 dims may be left: they join the last group
            rest_src, rest_dst = list(src[i:]), list(dst[j:])
            if any(d != 1 for d in rest_src + rest_dst):
                return None
            if groups:
                n_in, outs = groups[-1]
                groups[-1] = (n_in + len(rest_src), outs + rest_dst)
            else:
                groups.append((len(rest_src), rest_dst))
            break
        n_in, outs = 1, [dst[j]]
        a, b = src[i], dst[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                if i == len(src):
                    return None
                a *= src[i]
                n_in += 1
                i += 1
            else:
                if j == len(dst):
                    return None
                b *= dst[j]
                outs.append(dst[j])
                j += 1
        groups.append((n_in, outs))
    return [g for g in groups if g[0] or g[1]]


# ------------------------------------------------------------ weights and files


def torch_parameter(module, name: str):
    """(the module's parameter behind graph weight `name`, whether the leaf is its transpose)."""
    import torch

    param = module.get_parameter(name)
    owner_path, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    transposed = ((isinstance(owner, torch.nn.Linear) and attr == "weight")
                  or (isinstance(owner, torch.nn.MultiheadAttention) and attr == "in_proj_weight"))
    return param, transposed


def module_weights(module, graph: Graph) -> dict:
    """Every weight of `graph` taken from `module`'s parameters, in the graph's orientation (detached copies)."""
    out = {}
    for leaf in graph.weights:
        param, transposed = torch_parameter(module, leaf.name)
        value = param.detach().t() if transposed else param.detach()
        out[leaf.name] = value.clone().contiguous()
    return out


def load_model_file(path_spec: str, library=None) -> Graph:
    """The graph of `file.py:factory`: the factory returns (module, example inputs).

    The file is imported as a module of its own (its folder is not added to
    sys.path); every failure is an `FxImportError` with the reason.
    """
    try:
        import torch  # noqa: F401 - only to give a clear message when it is missing
    except ImportError:
        raise FxImportError("importing a torch model needs torch: pip install torch==2.13.0") from None
    file_part, sep, factory = path_spec.rpartition(":")
    if not sep or not file_part or not factory:
        raise FxImportError(f"'{path_spec}': give a Python file and a factory, like model.py:make_model")
    path = Path(file_part)
    if not path.is_file():
        raise FxImportError(f"'{file_part}' is not a file")
    module_name = f"parsat_user_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise FxImportError(f"'{file_part}' cannot be imported as Python")
    user = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = user
    try:
        spec.loader.exec_module(user)
    except Exception as err:  # noqa: BLE001 - a user's file: report its error, not ours
        raise FxImportError(f"importing {file_part} failed: {type(err).__name__}: {err}") from None
    finally:
        sys.modules.pop(module_name, None)
    make = getattr(user, factory, None)
    if not callable(make):
        raise FxImportError(f"{file_part} has no function '{factory}'")
    try:
        made = make()
    except Exception as err:  # noqa: BLE001
        raise FxImportError(f"{file_part}:{factory}() failed: {type(err).__name__}: {err}") from None
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        raise FxImportError(f"{file_part}:{factory}() must return (module, example_inputs)")
    module, example_inputs = made
    return from_torch(module, example_inputs, library, name=path.stem)


__all__ = ["FxImportError", "from_torch", "load_model_file", "module_weights", "torch_parameter"]
