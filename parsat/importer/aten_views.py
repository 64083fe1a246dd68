"""ATen view, slicing, joining and reduction operators onto library operators.

Views become reshapes (`ShapeOps.reshape`: `flatten` and `unflatten`),
transposes and permutations `transpose`s, slices, `select`, `split` and
`chunk` the library's `split`, `cat` a chain of `concat`s, and `mean` and
`sum` one reduction per dim (`global_avgpool` for a mean over H and W).

Every handler takes the translator `t` (`translator.Translator`), the ATen
node, and the node's own arguments as torch passes them, and returns the
graph tensor (or list of tensors) of the node, or raises `Refused`.
"""

from __future__ import annotations

import math

from parsat.importer.errors import Refused


def _h_view(t, node, x, shape):
    return t.reshape(t.tensor(x), shape)


def _h_flatten(t, node, x, start_dim=0, end_dim=-1):
    a = t.tensor(x)
    shape = t.shape(a)
    if not shape:
        return t.reshape(a, (1,))
    s, e = t.dim(a, start_dim), t.dim(a, end_dim)
    return t.reshape(a, shape[:s] + (math.prod(shape[s:e + 1]),) + shape[e + 1:])


def _h_unflatten(t, node, x, dim, sizes):
    a = t.tensor(x)
    shape = list(t.shape(a))
    d = t.dim(a, dim)
    return t.reshape(a, tuple(shape[:d] + [int(s) for s in sizes] + shape[d + 1:]))


def _h_unbind(t, node, x, dim=0):
    a = t.tensor(x)
    d = t.dim(a, dim)
    shape = t.shape(a)
    return [t.reshape(t.op("split", a, dim=d, start=i, size=1, tag=f"part{i}") if shape[d] > 1 else a,
                      shape[:d] + shape[d + 1:]) for i in range(shape[d])]


def _h_unsqueeze(t, node, x, dim):
    a = t.tensor(x)
    shape = list(t.shape(a))
    d = dim % (len(shape) + 1)
    return t.reshape(a, tuple(shape[:d] + [1] + shape[d:]))


def _h_squeeze(t, node, x, dims=None):
    a = t.tensor(x)
    shape = list(t.shape(a))
    if dims is None:
        keep = [s for s in shape if s != 1]
    else:
        drop = {t.dim(a, d) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
        keep = [s for k, s in enumerate(shape) if not (k in drop and s == 1)]
    return t.reshape(a, tuple(keep))


def _h_expand(t, node, x, sizes, implicit=False):
    a = t.tensor(x)
    shape = t.shape(a)
    out = [int(s) for s in sizes]
    pad = len(out) - len(shape)
    out = [shape[k - pad] if s == -1 else s for k, s in enumerate(out)]
    return t.expand_to(a, out)


def _h_transpose(t, node, x, d0, d1):
    return t.transpose(t.tensor(x), d0, d1)


def _h_t(t, node, x):
    return t.transpose(t.tensor(x), 0, 1)


def _h_permute(t, node, x, dims):
    return t.permute(t.tensor(x), dims)


def _h_slice(t, node, x, dim=0, start=None, end=None, step=1):
    a = t.tensor(x)
    d = t.dim(a, dim)
    n = t.shape(a)[d]
    lo, hi, stride = slice(start, end, step).indices(n)
    if stride != 1:
        raise Refused("slicing with a step other than 1 is not supported")
    if hi <= lo:
        raise Refused("an empty slice")
    if lo == 0 and hi == n:
        return a
    return t.op("split", a, dim=d, start=lo, size=hi - lo)


def _h_narrow(t, node, x, dim, start, length):
    return _h_slice(t, node, x, dim, start, start + length)


def _h_select(t, node, x, dim, index):
    a = t.tensor(x)
    d = t.dim(a, dim)
    shape = t.shape(a)
    i = index % shape[d]
    piece = a if shape[d] == 1 else t.op("split", a, dim=d, start=i, size=1)
    return t.reshape(piece, shape[:d] + shape[d + 1:])


def _h_split(t, node, x, split_size, dim=0):
    a = t.tensor(x)
    d = t.dim(a, dim)
    n = t.shape(a)[d]
    sizes = list(split_size) if isinstance(split_size, (list, tuple)) else \
        [min(split_size, n - s) for s in range(0, n, split_size)]
    pieces, start = [], 0
    for i, size in enumerate(sizes):
        pieces.append(a if size == n else t.op("split", a, dim=d, start=start, size=size, tag=f"part{i}"))
        start += size
    return pieces


def _h_chunk(t, node, x, chunks, dim=0):
    a = t.tensor(x)
    n = t.shape(a)[t.dim(a, dim)]
    return _h_split(t, node, x, -(-n // chunks), dim)


def _h_cat(t, node, tensors, dim=0):
    items = [t.tensor(v) for v in tensors]
    if not items:
        raise Refused("cat of no tensors")
    out = items[0]
    for other in items[1:]:
        out = t.op("concat", out, other, dim=t.dim(out, dim))
    return out


def _h_reduce(kind: str):
    def handler(t, node, x, dim=None, keepdim=False, *, dtype=None):
        return t.reduce(kind, t.tensor(x), dim, keepdim)
    return handler


HANDLERS = {
    "view": _h_view, "reshape": _h_view, "_unsafe_view": _h_view, "flatten": _h_flatten,
    "unsqueeze": _h_unsqueeze, "unflatten": _h_unflatten, "unbind": _h_unbind, "squeeze": _h_squeeze,
    "expand": _h_expand, "transpose": _h_transpose, "t": _h_t, "permute": _h_permute,
    "slice": _h_slice, "narrow": _h_narrow, "select": _h_select, "split": _h_split,
    "split_with_sizes": _h_split, "chunk": _h_chunk, "cat": _h_cat,
    "mean": _h_reduce("mean"), "sum": _h_reduce("reduce_sum"),
}
