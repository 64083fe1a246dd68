"""ATen view, slicing, joining and reduction operators onto library operators.

Views become reshapes (`ShapeOps.reshape`: `flatten` and `unflatten`),
transposes and permutations (`.T`, `numpy_T`, reverses every dim)
`transpose`s, slices, `select`, `split` and `chunk` the library's `split`,
`cat` and `stack` a chain of `concat`s (indexing with constant positions,
`x[..., [-2], :]`, too), and `mean` and `sum` one reduction
per dim (`global_avgpool` for a mean over H and W). A slice with a step is
exact without an operator of its own (`strided`: the whole steps that hold
its elements, one row per step, and the column it reads); an empty slice is
an `Empty`, which `cat` leaves out. Constant padding is one `pad` per
padded dim; `roll` two `split`s and a `concat` per rolled dim.

Every handler takes the translator `t` (`translator.Translator`), the ATen
node, and the node's own arguments as torch passes them, and returns the
graph tensor (or list of tensors) of the node, or raises `Refused`.
"""

from __future__ import annotations

import math

from parsat.importer.errors import Refused
from parsat.importer.aten_routing import note_picked_rows, reshaped, routed
from parsat.importer.shape_ops import Empty


def _h_view(t, node, x, shape):
    indices = routed(t, x)
    return reshaped(t, indices, shape) if indices is not None else t.reshape(t.tensor(x), shape)


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
    """`w.t()`: a matrix's is the one transpose made per operand (`Translator.weight_t`), which a product reading
    it turns into `F.linear` on `w` (`aten_layers._h_matmul`)."""
    a = t.tensor(x)
    return t.weight_t(a) if len(t.shape(a)) == 2 else a


def _h_permute(t, node, x, dims):
    return t.permute(t.tensor(x), dims)


def _h_numpy_t(t, node, x):
    """`x.T`: every dim reversed; a matrix's is the one transpose made per operand (`Translator.weight_t`), so a
    weight read as `w.T` (Falcon's linear layers) shares it with every other reader."""
    a = t.tensor(x)
    rank = len(t.shape(a))
    return t.weight_t(a) if rank == 2 else t.permute(a, list(reversed(range(rank))))


def _h_slice(t, node, x, dim=0, start=None, end=None, step=1):
    a = t.tensor(x)
    d = t.dim(a, dim)
    shape = t.shape(a)
    lo, hi, stride = slice(start, end, step).indices(shape[d])
    count = len(range(lo, hi, stride))
    if count == 0:
        return Empty(shape[:d] + (0,) + shape[d + 1:])
    if lo == 0 and count == shape[d]:
        return a
    if stride == 1 or count == 1:
        return t.op("split", a, dim=d, start=lo, size=count)
    return strided(t, a, d, lo, stride, count)


def strided(t, a, d: int, lo: int, step: int, count: int):
    """`a[lo : lo + step * count : step]` along dim d (count >= 2), exactly, with library operators: the
    `count` whole steps from the one holding `lo` (a `split`) as rows of `step` (`unflatten`), then the column
    `lo % step` of each row (a `split`, its size-1 dim reshaped away). When those whole steps run past the end
    of the dim (its size is not a multiple of the step), the last element is a split of its own, concatenated."""
    shape = t.shape(a)
    q, r = divmod(lo, step)
    if (q + count) * step > shape[d]:
        head = strided(t, a, d, lo, step, count - 1) if count > 2 else \
            t.op("split", a, dim=d, start=lo, size=1, tag="first")
        last = t.op("split", a, dim=d, start=lo + (count - 1) * step, size=1, tag="last")
        return t.op("concat", head, last, dim=d)
    block = a if q == 0 and count * step == shape[d] else \
        t.op("split", a, dim=d, start=q * step, size=count * step, tag="steps")
    rows = t.op("unflatten", block, dim=d, k=step, tag="rows")
    column = t.op("split", rows, dim=d + 1, start=r, size=1, tag="column")
    return t.reshape(column, shape[:d] + (count,) + shape[d + 1:])


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
    """A chain of `concat`s of the tensors that have elements (an `Empty` adds nothing)."""
    items = [t.tensor(v) for v in tensors if not t.is_empty(v)]
    if not items:
        raise Refused("cat of no tensors with elements")
    out = items[0]
    for other in items[1:]:
        out = t.op("concat", out, other, dim=t.dim(out, dim))
    return out


def _h_stack(t, node, tensors, dim=0):
    """`torch.stack`: each tensor with a new size-1 dim at `dim`, then `cat` along it."""
    items = [t.tensor(v) for v in tensors]
    if not items:
        raise Refused("stack of no tensors")
    shape = t.shape(items[0])
    d = dim % (len(shape) + 1)
    return _h_cat(t, node, [t.reshape(x, shape[:d] + (1,) + shape[d:]) for x in items], d)


def _h_index(t, node, x, indices):
    """`x[..., idx, ...]` with one constant integer index tensor: a few runs of consecutive positions (Falcon's
    `fused_qkv[..., [-2], :]`) as `split`s joined by `cat`; many (Swin's and BEiT's relative position bias,
    `table[index.view(-1)]`), or an index tensor of rank 2 and up into dim 0 (Whisper's
    `weight[position_ids]`), as an `embedding` of a constant one-hot of the positions (`gather_rows`). A top-k's
    indices (`aten_routing.RoutedIndices`: Mixtral's `gate_up_proj[expert_ids]`) pick rows by their computed
    one-hot the same way. Other indices from the inputs or the weights (a gather) are refused."""
    a = t.tensor(x)
    picked = [(d, i) for d, i in enumerate(indices) if i is not None]
    if len(picked) != 1:
        raise Refused("indexing with more than one index tensor is not supported")
    d, idx = picked[0]
    chosen = routed(t, idx)
    if chosen is not None:   # a top-k's indices, computed from the weights: rows picked by their one-hot
        index_shape = t.shape(chosen.onehot)[:-1]
        if len(index_shape) > 1 and d != 0:
            raise Refused("indexing with computed indices of rank 2 and up is supported into dim 0")
        out = t.reshape(gather_rows(t, chosen.onehot, a, d, index_shape),
                        t.shape(a)[:d] + index_shape + t.shape(a)[d + 1:])
        if d == 0:
            note_picked_rows(t, out, chosen, a)
        return out
    constant = isinstance(idx, t.torch.fx.Node) and not t.is_compute(idx) and idx.name not in t.varying
    value = t.constant_value(idx) if constant else None   # on meta tensors made again on the CPU
    if not isinstance(value, t.torch.Tensor) or value.dtype == t.torch.bool or value.is_floating_point() \
            or (value.dim() > 1 and d != 0):
        raise Refused("indexing is supported with one constant integer index tensor (1-D, or of any rank into dim "
                      "0), not a gather by indices from the inputs, nor a boolean mask")
    shape = t.shape(a)
    positions = [int(p) % shape[d] for p in value.reshape(-1).tolist()]
    runs = position_runs(positions)
    if (len(runs) > 2 or value.dim() > 1) and bool((value >= 0).all()):
        out = gather_rows(t, t.data_leaf(idx, "onehot", tuple(value.shape) + (shape[d],), classes=shape[d]), a, d,
                          tuple(value.shape))
    else:
        pieces = [a if len(r) == shape[d] else t.op("split", a, dim=d, start=r[0], size=len(r), tag=f"run{k}")
                  for k, r in enumerate(runs)]
        out = _h_cat(t, node, pieces, d)
    return t.reshape(out, shape[:d] + tuple(value.shape) + shape[d + 1:])


def position_runs(positions: list[int]) -> list[list[int]]:
    """The positions cut into runs of consecutive ones (3, 4, 5, 0, 1 -> [3, 4, 5], [0, 1])."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and p == runs[-1][-1] + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def gather_rows(t, onehot, a, d: int, picked: tuple[int, ...]):
    """`a` at the positions `onehot` holds (of shape `picked`, one-hot over dim d's size: a constant data leaf,
    or a top-k's computed one) along dim d, as an `embedding` (a contraction with a one-hot row per position,
    run as a gather): dim d moved first and the others flattened into the table's columns; the result has the
    positions' dims first, then the others, in dim d's place when d > 0 (picked then has one dim)."""
    shape = t.shape(a)
    moved = t.transpose(a, 0, d)
    rest = t.shape(moved)[1:]
    table = t.reshape(moved, (shape[d], math.prod(rest)))
    rows = t.reshape(t.op("embedding", onehot, table, tag="gather"), picked + tuple(rest))
    return t.transpose(rows, 0, d)


def _h_roll(t, node, x, shifts, dims=()):
    """`torch.roll` (Swin's shifted windows), one dim at a time: the last `s` entries of the dim, then the rest
    (two `split`s and a `concat`)."""
    a = t.tensor(x)
    shifts = list(shifts) if isinstance(shifts, (list, tuple)) else [shifts]
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    if len(dims) != len(shifts):
        raise Refused("torch.roll without dims (a roll of the flattened tensor) is not supported")
    for shift, dim in zip(shifts, dims):
        d = t.dim(a, dim)
        n = t.shape(a)[d]
        s = int(shift) % n
        if s:
            tail = t.op("split", a, dim=d, start=n - s, size=s, tag="tail")
            head = t.op("split", a, dim=d, start=0, size=n - s, tag="head")
            a = t.op("concat", tail, head, dim=d, tag="roll")
    return a


def _h_pad(t, node, x, pad, mode="constant", value=None):
    """`F.pad` in constant mode: one library `pad` per padded dim (torch lists (before, after) pairs from the
    last dim backwards); dims padded by 0 on both sides are left as they are."""
    if mode != "constant":
        raise Refused(f"padding in mode '{mode}' (parsat maps constant padding)")
    a = t.tensor(x)
    rank = len(t.shape(a))
    widths = [int(w) for w in pad]
    if len(widths) % 2 or len(widths) > 2 * rank:
        raise Refused(f"padding {widths} of a tensor of rank {rank}")
    if any(w < 0 for w in widths):
        raise Refused("negative padding (cropping) is not supported")
    for k in range(len(widths) // 2):
        before, after = widths[2 * k], widths[2 * k + 1]
        if before or after:
            a = t.op("pad", a, dim=rank - 1 - k, before=before, after=after, c=float(value or 0.0), tag=f"d{k}")
    return a


def _h_constant_pad_nd(t, node, x, pad, value=0):
    return _h_pad(t, node, x, pad, "constant", value)


def _h_reduce(kind: str):
    def handler(t, node, x, dim=None, keepdim=False, *, dtype=None):
        return t.reduce(kind, t.tensor(x), dim, keepdim)
    return handler


HANDLERS = {
    "view": _h_view, "reshape": _h_view, "_unsafe_view": _h_view, "flatten": _h_flatten,
    "unsqueeze": _h_unsqueeze, "unflatten": _h_unflatten, "unbind": _h_unbind, "squeeze": _h_squeeze,
    "expand": _h_expand, "transpose": _h_transpose, "t": _h_t, "permute": _h_permute, "numpy_T": _h_numpy_t,
    "slice": _h_slice, "narrow": _h_narrow, "select": _h_select, "split": _h_split,
    "split_with_sizes": _h_split, "chunk": _h_chunk, "cat": _h_cat, "stack": _h_stack, "index": _h_index,
    "pad": _h_pad, "constant_pad_nd": _h_constant_pad_nd, "roll": _h_roll,
    "mean": _h_reduce("mean"), "sum": _h_reduce("reduce_sum"),
}
