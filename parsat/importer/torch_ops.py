"""Torch implementations of the operators of `rules/ops.rule`, on local pieces; a graph evaluated with them.

Here, below the backend, because two stages run the library's operators:
the importer evaluates each imported graph against the module it came from
(`self_check`), and the backend runs plans on every rank (`executor`).
`evaluate_graph` is a graph's single-process semantics.

Compute operators run SPMD: every rank applies the same torch op to the
pieces it holds. The spread analysis (`parsat.dsl.spread.infer_compute`)
only accepts spreads under which the op on a local piece is the op on the
logical tensor restricted to that piece (a sharded dim is indexed only
plainly, never used as a value), so one implementation per operator serves
the whole tensor and every piece of it.

Attributes are passed by the names the `.rule` declaration gives them
(`softmax(x, dim)` -> `{"dim": 1}`), so a plan node's attributes map
straight onto a call. An operator of the library without an implementation
here is an `UnsupportedOpError` that names it, never a silent fallback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from parsat.dsl import ast
from parsat.ir.graph import Graph

Tensor = torch.Tensor
Attrs = Mapping[str, "int | float"]


class UnsupportedOpError(Exception):
    """An operator the backend cannot run (no torch implementation)."""

    def __init__(self, name: str, where: str | None = None):
        place = f" (declared at {where})" if where else ""
        super().__init__(f"operator '{name}'{place} has no torch implementation in parsat.importer.torch_ops; "
                         f"add one to OPS there to run plans that use it")
        self.name = name


class OpCallError(Exception):
    """A call whose inputs or attributes do not fit the operator's declaration."""


# ----------------------------------------------------------------- the operators


def _embedding(onehot: Tensor, table: Tensor) -> Tensor:
    """`sum(t < v) onehot[*i, t] * table[t, j]` run as a gather.

    The semantics is a contraction with a one-hot row (at most one non-zero
    per row: a vocabulary-sharded piece has all-zero rows for ids held by
    another rank). A gather of the row's non-zero position, scaled by its
    value, equals the contraction for such rows at O(rows * d) instead of
    O(rows * v * d). When the one-hot input itself needs a gradient (it
    never does for data), the contraction is run as a matmul so that the
    gradient with respect to every entry is exact.
    """
    if onehot.requires_grad:
        return torch.matmul(onehot, table)
    ids = onehot.abs().argmax(dim=-1)
    weight = torch.gather(onehot, -1, ids.unsqueeze(-1))
    return table[ids] * weight


def _embedding_padded(onehot: Tensor, table: Tensor, pad: int) -> Tensor:
    """The lookup with row `pad` detached: its value is read, its gradient is zero (torch's padding_idx).
    The parallel rules keep the whole vocabulary on a device, so `pad` is a local row index too."""
    pad = int(pad)
    frozen = torch.cat([table[:pad], table[pad:pad + 1].detach(), table[pad + 1:]])
    return _embedding(onehot, frozen)


def _transpose(x: Tensor, d0: int, d1: int) -> Tensor:
    return x.transpose(d0, d1)


def _unflatten(x: Tensor, dim: int, k: int) -> Tensor:
    return x.unflatten(dim, (x.shape[dim] // k, k))


def _split(x: Tensor, dim: int, start: int, size: int) -> Tensor:
    return x.narrow(dim, start, size)


def _layernorm(x: Tensor, gamma: Tensor, beta: Tensor, eps: float) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), gamma, beta, float(eps))


def _softmax_causal(x: Tensor) -> Tensor:
    """Softmax along the last dim, query q over keys j <= q (`torch.tril` of the last two dims): the mask is
    made from positions, never read, as in `scaled_dot_product_attention(..., is_causal=True)`."""
    s = x.shape[-1]
    keep = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    return torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)


def _attention_causal(q: Tensor, k: Tensor, v: Tensor, c: float) -> Tensor:
    """Fused causal attention as torch runs it: `scaled_dot_product_attention` with `is_causal=True` (the mask
    from positions) and the operator's scale, so a GPU runs FlashAttention (or the memory-efficient kernel) and
    keeps no [*a, s, s] scores for backward; on CPU, in float64 too, torch's math path. Rank-polymorphic:
    any leading dims, as SDPA takes them."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=float(c))


def _attention(q: Tensor, k: Tensor, v: Tensor, c: float) -> Tensor:
    """Fused bidirectional attention as torch runs it: `scaled_dot_product_attention` without a mask, with the
    operator's scale (FlashAttention on a GPU, no [*a, s, n] scores kept for backward; the math path on CPU).
    Keys may number other than queries (cross-attention), as SDPA takes them."""
    return F.scaled_dot_product_attention(q, k, v, scale=float(c))


def _causal_mask(s: int) -> Tensor:
    """The [s, s] causal mask, 1 where key t <= query r (`torch.ones(s, s).tril()`), in torch's default dtype:
    `attention_masked` takes it in its queries' dtype. Made from positions, as the operator's semantics say."""
    return torch.ones(int(s), int(s)).tril()


def _attention_masked(q: Tensor, k: Tensor, v: Tensor, m: Tensor, c: float) -> Tensor:
    """Fused attention under the mask m [s, n]: `scaled_dot_product_attention` with the additive mask log(m), so
    softmax(c q.k + log m) = m exp(c q.k) / sum(m exp(c q.k)), the operator's value for every m >= 0 (a 0/1 mask
    keeps its 1s and drops its 0s, as a boolean mask would); a row without a kept key is NaN, as the semantics
    leave it undefined. The mask is a constant (`causal_mask`, or its rows on a rank of the causal ring): no
    gradient flows into it."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.log(m.detach().to(q.dtype)), scale=float(c))


def zigzag_order(s: int, g: int) -> list[int]:
    """The zigzag order of a dim of `s` positions in `g` (even) chunks (`zigzag`, rules/ops.rule): output chunk
    2i is input chunk i and output chunk 2i + 1 input chunk g - 1 - i, so a p-way split (g = 2p) gives rank i
    chunks i and 2p - 1 - i (the balanced causal ring); each output position's input position."""
    w = s // g
    chunks = [c // 2 if c % 2 == 0 else g - 1 - c // 2 for c in range(g)]
    return [chunk * w + r for chunk in chunks for r in range(w)]


def _zigzag(x: Tensor, dim: int, g: int) -> Tensor:
    """`x` with dim `dim` in zigzag order (`zigzag_order`): an index_select, its backward the scatter back."""
    order = torch.tensor(zigzag_order(x.shape[int(dim)], int(g)), device=x.device)
    return x.index_select(int(dim), order)


def _unzigzag(x: Tensor, dim: int, g: int) -> Tensor:
    """`x` with dim `dim` taken back from zigzag order: the inverse permutation of `zigzag_order`."""
    order = torch.tensor(zigzag_order(x.shape[int(dim)], int(g)), device=x.device)
    return x.index_select(int(dim), torch.argsort(order))


def _softmax_masked(x: Tensor, m: Tensor) -> Tensor:
    """`m * exp(x) / sum(m * exp(x))` along the last dim, shifted by the row's largest kept entry.

    Entries with m == 0 never reach `exp`, so neither a large masked score
    nor its gradient can overflow; a row with no kept entry is 0/0 (NaN), as
    in torch's attention.
    """
    keep = m != 0
    top = x.masked_fill(~keep, float("-inf")).amax(dim=-1, keepdim=True).detach()
    shifted = torch.where(keep, x - top, torch.zeros_like(x))
    e = m * torch.exp(shifted)
    return e / e.sum(dim=-1, keepdim=True)


def _maxpool2d_padded(x: Tensor, size: int, stride: int, pad: int) -> Tensor:
    """torch's max pooling with -inf padding: the index semantics' max over each window's real elements
    (the declaration requires 2 * pad < size, so every window holds one)."""
    return F.max_pool2d(x, int(size), int(stride), padding=int(pad))


def _pad(x: Tensor, dim: int, before: int, after: int, c: float) -> Tensor:
    """Constant padding of one dim; torch's `F.pad` lists (before, after) per dim from the last dim backwards."""
    widths = [0, 0] * (x.dim() - 1 - int(dim)) + [int(before), int(after)]
    return F.pad(x, widths, value=float(c))


def _conv2d_grouped(x: Tensor, k: Tensor, groups: int, stride: int, pad: int) -> Tensor:
    return F.conv2d(x, k, stride=int(stride), padding=int(pad), groups=int(groups))


def _nll_sum(x: Tensor, lse: Tensor, y: Tensor) -> Tensor:
    return (y * (lse.unsqueeze(-1) - x)).sum()


def _per_channel(v: Tensor) -> Tensor:
    return v.view(1, -1, 1, 1)


def _bn_mean(x: Tensor, count: int) -> Tensor:
    return x.sum(dim=(0, 2, 3)) / int(count)


def _bn_var(x: Tensor, mean: Tensor, count: int) -> Tensor:
    return ((x - _per_channel(mean)) ** 2).sum(dim=(0, 2, 3)) / int(count)


def _bn_normalize(x: Tensor, mean: Tensor, var: Tensor, gamma: Tensor, beta: Tensor, eps: float) -> Tensor:
    return (x - _per_channel(mean)) / torch.sqrt(_per_channel(var) + float(eps)) * _per_channel(gamma) \
        + _per_channel(beta)


def _rmsnorm(x: Tensor, gamma: Tensor, eps: float) -> Tensor:
    # written as transformers' LlamaRMSNorm (`pow(2)`, not `x * x`): autograd then sums x's gradient from two reads,
    # not three, so in a float32 normalization (`rewritten`'s module dtypes) it rounds as the module's does
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + float(eps)) * gamma


def _broadcast(x: Tensor, dim: int, n: int) -> Tensor:
    out = x.unsqueeze(int(dim))
    shape = list(out.shape)
    shape[int(dim)] = int(n)
    return out.expand(shape)


@dataclass(frozen=True)
class TorchOp:
    """One operator: its tensor arity, attribute names in call order, and the torch function."""

    tensors: int
    attrs: tuple[str, ...]
    fn: Callable[..., Tensor]


def _topk_onehot(x: Tensor, k: int) -> Tensor:
    """Row r: the one-hot of the r-th largest entry of the last dim, equal entries ranked by position (a stable
    descending sort, the declared tie-break); no gradient, as the selection is piecewise constant in x."""
    order = torch.sort(x.detach(), dim=-1, descending=True, stable=True).indices[..., :int(k)]
    return F.one_hot(order, x.shape[-1]).to(x.dtype)


OPS: Mapping[str, TorchOp] = {
    "matmul": TorchOp(2, (), torch.matmul),
    "bmm": TorchOp(2, (), torch.matmul),
    "linear": TorchOp(3, (), lambda x, w, b: torch.matmul(x, w) + b),
    "bias_add": TorchOp(2, (), lambda x, b: x + b),
    "add": TorchOp(2, (), torch.add),
    "sub": TorchOp(2, (), torch.sub),
    "mul": TorchOp(2, (), torch.mul),
    "scale": TorchOp(1, ("c",), lambda x, c: x * float(c)),
    "relu": TorchOp(1, (), torch.relu),
    "gelu": TorchOp(1, (), lambda x: F.gelu(x, approximate="none")),
    "tanh": TorchOp(1, (), torch.tanh),
    "sigmoid": TorchOp(1, (), torch.sigmoid),
    "exp": TorchOp(1, (), torch.exp),
    # Identity in value, as declared; a training mask would make single- and
    # multi-process runs differ and is not part of the semantics.
    "dropout": TorchOp(1, ("rate",), lambda x, rate: x),
    "softmax": TorchOp(1, ("dim",), lambda x, dim: torch.softmax(x, dim=int(dim))),
    "layernorm": TorchOp(3, ("eps",), _layernorm),
    "reduce_sum": TorchOp(1, ("dim",), lambda x, dim: x.sum(dim=int(dim))),
    "mean": TorchOp(1, ("dim",), lambda x, dim: x.mean(dim=int(dim))),
    "concat": TorchOp(2, ("dim",), lambda x, y, dim: torch.cat([x, y], dim=int(dim))),
    "split": TorchOp(1, ("dim", "start", "size"), _split),
    "transpose": TorchOp(1, ("d0", "d1"), _transpose),
    "unflatten": TorchOp(1, ("dim", "k"), _unflatten),
    "flatten": TorchOp(1, ("dim",), lambda x, dim: x.flatten(int(dim), int(dim) + 1)),
    "embedding": TorchOp(2, (), _embedding),
    "embedding_padded": TorchOp(2, ("pad",), _embedding_padded),
    "conv2d": TorchOp(2, ("stride", "pad"), lambda x, k, stride, pad: F.conv2d(x, k, stride=int(stride),
                                                                                padding=int(pad))),
    "conv2d_grouped": TorchOp(2, ("groups", "stride", "pad"), _conv2d_grouped),
    "conv1d": TorchOp(2, ("stride", "pad"), lambda x, k, stride, pad: F.conv1d(x, k, stride=int(stride),
                                                                                padding=int(pad))),
    "pad": TorchOp(1, ("dim", "before", "after", "c"), _pad),
    "avgpool2d": TorchOp(1, ("size", "stride"), lambda x, size, stride: F.avg_pool2d(x, int(size), int(stride))),
    "global_avgpool": TorchOp(1, (), lambda x: x.mean(dim=(2, 3))),
    "neg": TorchOp(1, (), torch.neg),
    "add_scalar": TorchOp(1, ("c",), lambda x, c: x + float(c)),
    "div": TorchOp(2, (), torch.div),
    "reciprocal": TorchOp(1, (), torch.reciprocal),
    "sqrt": TorchOp(1, (), torch.sqrt),
    "rsqrt": TorchOp(1, (), torch.rsqrt),
    "log": TorchOp(1, (), torch.log),
    "sin": TorchOp(1, (), torch.sin),
    "cos": TorchOp(1, (), torch.cos),
    "silu": TorchOp(1, (), F.silu),
    "gelu_tanh": TorchOp(1, (), lambda x: F.gelu(x, approximate="tanh")),
    "linear_nobias": TorchOp(2, (), torch.matmul),
    "linear_nobias_t": TorchOp(2, (), F.linear),      # torch's own: the weight [out, in]
    "linear_t": TorchOp(3, (), F.linear),
    # Broadcasting aligns trailing dims, which is exactly `[*a, *t]` with `[*t]`.
    "add_bcast": TorchOp(2, (), torch.add),
    "mul_bcast": TorchOp(2, (), torch.mul),
    "add_bcast_dim": TorchOp(2, ("dim",), lambda x, y, dim: x + y.unsqueeze(int(dim))),
    "mul_bcast_dim": TorchOp(2, ("dim",), lambda x, y, dim: x * y.unsqueeze(int(dim))),
    "broadcast": TorchOp(1, ("dim", "n"), _broadcast),
    "softmax_masked": TorchOp(2, (), _softmax_masked),
    "softmax_causal": TorchOp(1, (), _softmax_causal),
    "attention_causal": TorchOp(3, ("c",), _attention_causal),
    "attention": TorchOp(3, ("c",), _attention),
    "causal_mask": TorchOp(0, ("s",), _causal_mask),
    "attention_masked": TorchOp(4, ("c",), _attention_masked),
    "zigzag": TorchOp(1, ("dim", "g"), _zigzag),
    "unzigzag": TorchOp(1, ("dim", "g"), _unzigzag),
    "logsumexp": TorchOp(1, (), lambda x: torch.logsumexp(x, dim=-1)),
    "amax": TorchOp(1, (), lambda x: x.amax(dim=-1)),
    "sumexp_shifted": TorchOp(2, (), lambda x, m: torch.exp(x - m.unsqueeze(-1)).sum(dim=-1)),
    "maxpool2d": TorchOp(1, ("size", "stride"), lambda x, size, stride: F.max_pool2d(x, int(size), int(stride))),
    "maxpool2d_padded": TorchOp(1, ("size", "stride", "pad"), _maxpool2d_padded),
    "nll_sum": TorchOp(3, (), _nll_sum),
    "bn_mean": TorchOp(1, ("count",), _bn_mean),
    "bn_var": TorchOp(2, ("count",), _bn_var),
    "bn_normalize": TorchOp(5, ("eps",), _bn_normalize),
    "rmsnorm": TorchOp(2, ("eps",), _rmsnorm),
    "dropout_masked": TorchOp(2, ("rate",), lambda x, m, rate: x * m / (1.0 - float(rate))),
    "topk_onehot": TorchOp(1, ("k",), _topk_onehot),
}


def torch_op(op: str | ast.OpDecl) -> TorchOp:
    """The implementation of an operator, or `UnsupportedOpError` naming it.

    Given the declaration, the implementation is also checked against it
    (tensor arity and attribute names), so a `.rule` edit that changes a
    signature cannot silently shift attributes onto the wrong parameter.
    """
    name = op if isinstance(op, str) else op.name
    impl = OPS.get(name)
    if impl is None:
        where = str(op.span) if isinstance(op, ast.OpDecl) and op.span is not None else None
        raise UnsupportedOpError(name, where)
    if isinstance(op, ast.OpDecl):
        declared = tuple(p.name for p in op.attr_params)
        if len(op.tensor_params) != impl.tensors or declared != impl.attrs:
            raise OpCallError(f"operator '{name}' is declared with {len(op.tensor_params)} tensor(s) and attributes "
                              f"{list(declared)}, but its torch implementation takes {impl.tensors} tensor(s) and "
                              f"{list(impl.attrs)}")
    return impl


def apply_op(op: str | ast.OpDecl, tensors: Sequence[Tensor], attrs: Attrs | None = None) -> Tensor:
    """Run operator `op` on (local pieces of) `tensors` with attributes by name."""
    impl = torch_op(op)
    name = op if isinstance(op, str) else op.name
    attrs = dict(attrs or {})
    if len(tensors) != impl.tensors:
        raise OpCallError(f"{name} takes {impl.tensors} tensor(s), got {len(tensors)}")
    missing = [a for a in impl.attrs if a not in attrs]
    extra = sorted(set(attrs) - set(impl.attrs))
    if missing or extra:
        raise OpCallError(f"{name} takes attributes {list(impl.attrs)}; missing {missing}, unknown {extra}")
    return impl.fn(*tensors, *(attrs[a] for a in impl.attrs))


def evaluate_graph(graph: Graph, leaves: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every node's value, given every leaf's (the single-process semantics of a graph)."""
    env = dict(leaves)
    for node in graph.nodes:
        env[node.name] = apply_op(node.op, [env[i] for i in node.inputs], dict(node.attrs))
    return env
