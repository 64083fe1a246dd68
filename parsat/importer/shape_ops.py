"""`ShapeOps`: torch's broadcasting, reshapes, permutations and reductions, written with library operators.

The library's operators are exact about shapes (`add` takes equal shapes,
`add_bcast` a trailing-dims operand, `flatten` merges two neighbouring dims),
while torch broadcasts and views freely. These methods of the translator
(a mixin of `translator.Translator`, which provides `op`, `shape`, `dim`,
`tensor` and `scalar`) pick the cheapest exact form: a scalar becomes
`add_scalar` or `scale`, a broadcast operand `*_bcast` or `*_bcast_dim`
where it fits and explicit `broadcast` nodes otherwise, a reshape the
`flatten`s and `unflatten`s of groups of neighbouring dims with equal
products, a permutation a sequence of `transpose`s. What has no exact form
raises `Refused`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from parsat.importer.errors import Refused
from parsat.ir.graph import Tensor


@dataclass(frozen=True)
class Empty:
    """A compute value with no elements: an empty slice (Phi-3's `q[..., rotary_dim:]` when the rotary dims are
    all of them). A graph tensor has no size-0 dim, so it is never a graph tensor: `cat` leaves it out (joining
    nothing changes nothing), and any other operator that reads it is refused (`translator.Translator.tensor`)."""

    shape: tuple[int, ...]


class ShapeOps:
    """Broadcasting arithmetic and shape changes for `Translator` (see the module docstring)."""

    def binary(self, kind: str, x, y) -> Tensor:
        """x (+ or *) y with torch's broadcasting, by the cheapest exact form."""
        xs, ys = self.scalar(x), self.scalar(y)
        if xs is not None and ys is not None:
            raise Refused("arithmetic on two constants")
        if ys is not None or xs is not None:
            t, c = (self.tensor(x), ys) if ys is not None else (self.tensor(y), xs)
            if kind == "add":
                return t if c == 0 else self.op("add_scalar", t, c=c)
            return t if c == 1 else self.op("scale", t, c=c)
        return self.binary_handles(kind, self.tensor(x), self.tensor(y))

    def binary_handles(self, kind: str, a: Tensor, b: Tensor) -> Tensor:
        """x (+ or *) y of two graph tensors with torch's broadcasting."""
        sa, sb = self.shape(a), self.shape(b)
        if sa == sb:
            return self.op(kind, a, b)
        out = broadcast_shape(sa, sb)
        if out is None:
            raise Refused(f"shapes {list(sa)} and {list(sb)} do not broadcast")
        if sa != out and sb == out:
            a, b = b, a
        elif sa != out:
            a = self.expand_to(a, out)
        return self.broadcast_into(kind, a, b, out)

    def broadcast_into(self, kind: str, big: Tensor, small: Tensor, out: tuple[int, ...]) -> Tensor:
        ss = self.shape(small)
        padded = (1,) * (len(out) - len(ss)) + tuple(ss)
        lead = 0
        while lead < len(out) and padded[lead] == 1 and out[lead] != 1:
            lead += 1
        rest = padded[lead:]
        if tuple(rest) == tuple(out[lead:]):
            if rest == tuple(ss):
                return self.op(f"{kind}_bcast", big, small)
            return self.op(f"{kind}_bcast", big, self.reshape(small, rest))
        differ = [d for d in range(len(out)) if padded[d] != out[d]]
        if len(differ) == 1 and len(ss) == len(out):
            d = differ[0]
            squeezed = self.reshape(small, tuple(s for k, s in enumerate(ss) if k != d))
            return self.op(f"{kind}_bcast_dim", big, squeezed, dim=d)
        return self.op(kind, big, self.expand_to(small, out))

    def expand_to(self, t: Tensor, out: Sequence[int]) -> Tensor:
        """`t` broadcast to shape `out` with `broadcast` operators (one per expanded dim)."""
        shape = list(self.shape(t))
        shape = [1] * (len(out) - len(shape)) + shape
        if len(shape) != len(self.shape(t)):
            if not self.shape(t):
                raise Refused("broadcasting a 0-d tensor computed from the weights is not supported")
            t = self.reshape(t, tuple(shape))
        for d, (have, want) in enumerate(zip(shape, out)):
            if have == want:
                continue
            if have != 1:
                raise Refused(f"cannot expand {shape} to {list(out)}")
            t = self.reshape(t, tuple(shape[:d] + shape[d + 1:]))
            t = self.op("broadcast", t, dim=d, n=int(want), tag="expand")
            shape[d] = int(want)
        return t

    # -- shapes -------------------------------------------------------------
    def reshape(self, x: Tensor, shape: Sequence[int]) -> Tensor:
        """A reshape as `flatten`s and `unflatten`s of consecutive groups of dims with equal products."""
        src = list(self.shape(x))
        total = math.prod(src)
        dst = [int(d) for d in shape]
        if dst.count(-1) == 1:
            known = math.prod(d for d in dst if d != -1)
            dst[dst.index(-1)] = total // known if known else 0
        if math.prod(dst) != total or any(d < 1 for d in dst):
            raise Refused(f"cannot reshape {src} to {list(shape)}")
        if src == dst:
            return x
        shared = self.shared_reshapes.get((x.name, tuple(dst)))
        if shared is not None:   # a data leaf reshaped so before (`Translator.view_root`): once for all readers
            return shared
        key = (x.name, tuple(dst))
        if not src or not dst:
            raise Refused(f"reshape between a 0-d tensor and {src or dst} is not supported")
        groups = reshape_groups(src, dst)
        if groups is None:
            raise Refused(f"reshape of {src} to {dst} is not a split or merge of neighbouring dims")
        pos = 0
        for n_in, outs in groups:
            for _ in range(n_in - 1):
                x = self.op("flatten", x, dim=pos, tag="merge")
            for i in range(len(outs) - 1):
                x = self.op("unflatten", x, dim=pos + i, k=math.prod(outs[i + 1:]), tag="split")
            pos += len(outs)
        if key[0] in self.leaf_nodes:
            self.shared_reshapes[key] = x
        return x

    def transpose(self, x: Tensor, d0: int, d1: int) -> Tensor:
        a, b = sorted((self.dim(x, d0), self.dim(x, d1)))
        return x if a == b else self.op("transpose", x, d0=a, d1=b)

    def permute(self, x: Tensor, dims: Sequence[int]) -> Tensor:
        target = [self.dim(x, d) for d in dims]
        if sorted(target) != list(range(len(self.shape(x)))):
            raise Refused(f"permute{tuple(dims)} is not a permutation of the dims")
        current = list(range(len(target)))
        for i, want in enumerate(target):
            j = current.index(want)
            if j != i:
                x = self.op("transpose", x, d0=i, d1=j, tag="perm")
                current[i], current[j] = current[j], current[i]
        return x

    def reduce(self, kind: str, x: Tensor, dims, keepdim: bool) -> Tensor:
        shape = self.shape(x)
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = list(range(len(shape)))
        dims = dims if isinstance(dims, (tuple, list)) else [dims]
        dims = sorted({self.dim(x, d) for d in dims}, reverse=True)
        if kind == "mean" and dims == [3, 2] and len(shape) == 4 and not keepdim:
            return self.op("global_avgpool", x)
        out = x
        for d in dims:
            out = self.op(kind, out, dim=d)
        if keepdim:
            out = self.reshape(out, tuple(1 if d in dims else s for d, s in enumerate(shape)))
        return out


def broadcast_shape(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...] | None:
    rank = max(len(a), len(b))
    pa = (1,) * (rank - len(a)) + tuple(a)
    pb = (1,) * (rank - len(b)) + tuple(b)
    out = []
    for x, y in zip(pa, pb):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(out)


def reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, list[int]]] | None:
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
