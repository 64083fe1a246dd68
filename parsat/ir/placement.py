"""Where a tensor's pieces live on a device mesh: one entry per mesh axis.

Each mesh axis holds a tensor in one of four ways (DTensor's placements,
with DTensor's Replicate split in two because the backward pass differs):

* FREE: not spread over the axis. Every rank of an axis group holds the same
  value, computes it redundantly, and computes the same gradient.
* REPLICA: an explicit copy made by `replicate` on this axis. The values
  agree but the ranks use them with different partners, so their gradients
  differ and `replicate`'s backward sums them (an all-reduce).
* PARTIAL: each rank of a group holds a summand; the value is their sum.
* SHARD(d): dim d is cut into `size` blocks, one per coordinate.

A dim sharded on several axes is cut in mesh order: the earlier axis is the
major block index (DTensor's convention). Parallel operators keep that
order: a partition on axis a of a dim that a later axis already shards, or
a combine on a that is not the last axis sharding the dim, is refused.

How a compute operator changes placements is the DSL's spread analysis
(`dsl.spread.infer_compute`) applied to one axis at a time, with the axis's
size as a symbolic degree: the index semantics decides which placements an
operator accepts and what it produces, for every axis alike. Working axis
by axis is what lets a rule proven for whole tensors apply to tensors
already spread over other axes (docs/MESH.md: lifting).

Codes (small ints) are what the e-graph stores: FREE 0, REPLICA 1,
PARTIAL 2, SHARD(d) 3 + d. docs/MESH.md is the contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from math import prod
from typing import Mapping, Sequence

from parsat.dsl.instantiate import OpInstance
from parsat.dsl.spread import ONE, SymbolicDegrees, infer_compute
from parsat.dsl.parallel_ops import COMBINE, PARALLEL_OPS, PARTITION, REDUCE, REPLICATE, step_calls
from parsat.dsl.symbolic import Poly
from parsat.ir.mesh import Mesh

FREE, REPLICA, PARTIAL = 0, 1, 2
SHARD0 = 3
AXIS_DEGREE = Poly.sym("axis#size")   # the symbolic size of the one axis that single-axis inference looks at



class PlacementError(Exception):
    """A placement or parallel operator that cannot be realised on the mesh."""


def shard(dim: int) -> int:
    return SHARD0 + dim


def shard_dim(code: int) -> int | None:
    return code - SHARD0 if code >= SHARD0 else None


def codes_for_rank(rank: int) -> tuple[int, ...]:
    """Every code a tensor of `rank` dims can have on one axis."""
    return (FREE, REPLICA, PARTIAL) + tuple(shard(d) for d in range(rank))


def code_text(code: int) -> str:
    """DTensor's name for the entry (FREE and REPLICA are both Replicate)."""
    if code in (FREE, REPLICA):
        return "Replicate()"
    if code == PARTIAL:
        return "Partial()"
    return f"Shard({shard_dim(code)})"


def code_short(code: int) -> str:
    return {FREE: "-", REPLICA: "R", PARTIAL: "P"}.get(code) or f"S{shard_dim(code)}"


# ------------------------------------------------------------ one axis at a time


def code_spread(code: int, rank: int) -> SymbolicDegrees | None:
    """The single-axis spread of a code (None: a shard of a dim the tensor lacks)."""
    ones = [ONE] * rank
    if code == FREE:
        return SymbolicDegrees(tuple(ones))
    if code == REPLICA:
        return SymbolicDegrees(tuple(ones), AXIS_DEGREE, ONE)
    if code == PARTIAL:
        return SymbolicDegrees(tuple(ones), ONE, AXIS_DEGREE)
    dim = shard_dim(code)
    if dim is None or dim >= rank:
        return None
    ones[dim] = AXIS_DEGREE
    return SymbolicDegrees(tuple(ones))


def spread_code(spread: SymbolicDegrees) -> int | None:
    """The code of a single-axis spread; None if it is not one (two factors of the axis size)."""
    factors = [(shard(i), d) for i, d in enumerate(spread.shard)] + [(REPLICA, spread.copy), (PARTIAL, spread.sum)]
    used = [(c, d) for c, d in factors if d != ONE]
    if not used:
        return FREE
    if len(used) == 1 and used[0][1] == AXIS_DEGREE:
        return used[0][0]
    return None


def axis_compute(instance: OpInstance, codes: Sequence[int], cache: dict | None = None) -> tuple[int | None, str]:
    """A compute operator on one axis: the output code, or None and why the op does not accept the inputs."""
    key = (_signature(instance, cache), tuple(codes))
    if cache is not None and key in cache:
        return cache[key]
    spreads = [code_spread(c, len(s)) for c, s in zip(codes, instance.input_shapes)]
    if any(s is None for s in spreads):
        out: tuple[int | None, str] = (None, f"{instance.name}: a shard of a dim the input does not have")
    else:
        inferred = infer_compute(instance, spreads)
        if inferred.problems:
            out = (None, "; ".join(inferred.problems))
        else:
            code = spread_code(inferred.spread)
            out = (code, "") if code is not None else (None, f"{instance.name}: output spread "
                                                              f"{inferred.spread} is not one placement")
    if cache is not None:
        cache[key] = out
    return out


def _signature(instance: OpInstance, cache: dict | None = None) -> tuple:
    """What an operator's acceptance of placements depends on: the operator, its ranks and its attributes (the
    index structure of its semantics), not the names or values of its sizes. Kept in `cache` by the instance's
    identity, beside the instance (so the identity is not reused): a layout asks again for every block and axis,
    and spelling the attributes out (symbolic sizes as text) was a quarter of `axis_compute`."""
    known = cache.get((_SIGNATURE, id(instance))) if cache is not None else None
    if known is not None and known[0] is instance:
        return known[1]
    signature = (instance.name, tuple(len(s) for s in instance.input_shapes),
                 tuple(sorted((k, str(v)) for k, v in instance.attrs.items())),
                 tuple(sorted(instance.groups.items())))
    if cache is not None:
        cache[(_SIGNATURE, id(instance))] = (instance, signature)
    return signature


_SIGNATURE = "signature"   # `_signature`'s entries in an `axis_compute` cache (whose own keys are tuples of tuples)


def axis_parallel(op: str, code: int, dim: int | None, acts_here: bool, here_before_op_axis: bool,
                  to_dim: int | None = None) -> int | None:
    """A parallel operator seen from one axis: the code after it, None if illegal.

    `acts_here`: the operator acts on this axis. Otherwise it leaves this
    axis's code alone, except that a partition or combine of a dim this axis
    also shards must act on an axis after this one (mesh order stays the
    order of the blocks; `here_before_op_axis`). `to_dim`: all_to_all's second dim.
    """
    if op in PARALLEL_OPS and PARALLEL_OPS[op].steps:
        for step, step_dim in step_calls(op, {"dim": dim, "to_dim": to_dim}):
            code = axis_parallel(step, code, step_dim, acts_here, here_before_op_axis)
            if code is None:
                return None
        return code
    if acts_here:
        if op == PARTITION:
            return shard(dim) if code == FREE else None
        if op == COMBINE:
            return FREE if code == shard(dim) else None
        if op == REPLICATE:
            return REPLICA if code == FREE else None
        if op == REDUCE:
            return FREE if code == PARTIAL else None
        raise PlacementError(f"'{op}' is not a parallel operator")
    if op in (PARTITION, COMBINE) and code == shard(dim) and not here_before_op_axis:
        return None
    return code


# -------------------------------------------------------------- whole placements


@dataclass(frozen=True)
class Placement:
    """One code per mesh axis (module docstring)."""

    codes: tuple[int, ...]

    @staticmethod
    def whole(axes: int) -> "Placement":
        return Placement((FREE,) * axes)

    def shard_axes(self, dim: int) -> tuple[int, ...]:
        """The axes that shard `dim`, major first."""
        return tuple(i for i, c in enumerate(self.codes) if c == shard(dim))

    @property
    def replica_axes(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.codes) if c == REPLICA)

    @property
    def partial_axes(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.codes) if c == PARTIAL)

    @property
    def spread_axes(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.codes) if c != FREE)

    def degrees(self, sizes: Sequence[int], rank: int) -> tuple[tuple[int, ...], int, int]:
        """(shard degree per dim, copy degree, partial-sum degree) on a mesh of `sizes`."""
        shard_degrees = tuple(prod(sizes[a] for a in self.shard_axes(d)) for d in range(rank))
        return (shard_degrees, prod(sizes[a] for a in self.replica_axes),
                prod(sizes[a] for a in self.partial_axes))

    def pieces(self, sizes: Sequence[int]) -> int:
        return prod(sizes[a] for a in self.spread_axes)

    def local_shape(self, shape: Sequence[int], sizes: Sequence[int]) -> tuple[int, ...]:
        out = []
        for d, size in enumerate(shape):
            degree = prod(sizes[a] for a in self.shard_axes(d))
            if size % degree:
                raise PlacementError(f"dim {d} of size {size} does not split into {degree} equal blocks")
            out.append(size // degree)
        return tuple(out)

    def block(self, dim: int, coords: Sequence[int], sizes: Sequence[int]) -> int:
        """The block index of `dim` at mesh coordinates `coords` (mixed radix over its axes, major first)."""
        index = 0
        for a in self.shard_axes(dim):
            index = index * sizes[a] + coords[a]
        return index

    def piece_slices(self, shape: Sequence[int], sizes: Sequence[int], coords: Sequence[int]) -> tuple[slice, ...]:
        """The slices of the logical tensor that the rank at `coords` holds."""
        local = self.local_shape(shape, sizes)
        return tuple(slice(self.block(d, coords, sizes) * n, (self.block(d, coords, sizes) + 1) * n)
                     for d, n in enumerate(local))

    def summand(self, coords: Sequence[int], sizes: Sequence[int]) -> int:
        """Which summand a rank holds (mixed radix over the partial axes)."""
        index = 0
        for a in self.partial_axes:
            index = index * sizes[a] + coords[a]
        return index

    def dtensor(self) -> list[str]:
        return [code_text(c) for c in self.codes]

    def __str__(self) -> str:
        return "[" + " ".join(code_short(c) for c in self.codes) + "]"


def apply_parallel(placement: Placement, op: str, axis: int, dim: int | None = None,
                   to_dim: int | None = None) -> Placement:
    """The placement after a parallel operator on `axis` (raises PlacementError); a fused operator
    (`dsl.parallel_ops`: reduce_scatter, all_gather, all_to_all, whose second dim is `to_dim`) is its steps
    in turn."""
    if not 0 <= axis < len(placement.codes):
        raise PlacementError(f"{op}: mesh axis {axis} does not exist (the mesh has {len(placement.codes)})")
    steps = PARALLEL_OPS[op].steps if op in PARALLEL_OPS else ()
    if steps:
        for step, step_dim in step_calls(op, {"dim": dim, "to_dim": to_dim}):
            try:
                placement = apply_parallel(placement, step, axis, step_dim)
            except PlacementError as err:
                raise PlacementError(f"{op} ({' then '.join(steps)}): {err}") from None
        return placement
    out = []
    for i, code in enumerate(placement.codes):
        new = axis_parallel(op, code, dim, i == axis, i < axis)
        if new is None:
            raise PlacementError(_parallel_refusal(op, placement, axis, i, dim))
        out.append(new)
    return Placement(tuple(out))


def _parallel_refusal(op: str, placement: Placement, axis: int, at: int, dim: int | None) -> str:
    have = code_text(placement.codes[axis])
    if at == axis:
        need = {PARTITION: "not spread", COMBINE: f"Shard({dim})", REPLICATE: "not spread",
                REDUCE: "Partial()"}[op]
        return f"{op} on mesh axis {axis} needs the tensor {need} there, it is {have}"
    return (f"{op} of dim {dim} on mesh axis {axis}: axis {at} shards that dim too and comes later in the mesh, "
            "so the blocks would not be in mesh order")


def compute_placement(instance: OpInstance, inputs: Sequence[Placement], cache: dict | None = None) -> Placement:
    """A compute operator's output placement, axis by axis (raises PlacementError naming the axis)."""
    axes = {len(p.codes) for p in inputs}
    if len(axes) > 1:
        raise PlacementError(f"{instance.name}: inputs placed on meshes of different sizes")
    naxes = axes.pop() if axes else 0
    out = []
    for axis in range(naxes):
        code, why = axis_compute(instance, [p.codes[axis] for p in inputs], cache)
        if code is None:
            raise PlacementError(f"on mesh axis {axis}: {why}")
        out.append(code)
    return Placement(tuple(out))


def piece_index(placement: Placement, shape: Sequence[int], mesh: Mesh, rank: int) -> tuple[slice, ...]:
    """The slices of the logical tensor that `rank` holds."""
    return placement.piece_slices(shape, mesh.shape, mesh.coords(rank))


def from_dtensor(entries: Sequence[str], replicated_on: Sequence[int] = ()) -> Placement:
    """A placement from DTensor strings ("Shard(0)", "Replicate()", "Partial()"); `replicated_on`: the axes whose
    Replicate() is an explicit replica (its gradient summed), the others are free."""
    codes = []
    for axis, text in enumerate(entries):
        text = str(text).replace(" ", "")
        if text == "Replicate()":
            codes.append(REPLICA if axis in replicated_on else FREE)
        elif text == "Partial()":
            codes.append(PARTIAL)
        elif text.startswith("Shard(") and text.endswith(")") and text[6:-1].isdigit():
            codes.append(shard(int(text[6:-1])))
        else:
            raise PlacementError(f"'{entries[axis]}' is not a placement (Shard(d), Replicate() or Partial())")
    return Placement(tuple(codes))


def placement_for_degrees(shard_degrees: Sequence[int], copy: int, sizes: Sequence[int]) -> Placement | None:
    """A placement on a mesh of `sizes` with the given shard degree per dim and copy degree: each dim takes the
    earliest unused axes whose sizes multiply to its degree, then the copies; None when the mesh cannot."""
    codes = [FREE] * len(sizes)
    free = list(range(len(sizes)))

    def take(degree: int) -> list[int] | None:
        if degree == 1:
            return []
        for count in range(1, len(free) + 1):
            for subset in combinations(free, count):
                if prod(sizes[a] for a in subset) == degree:
                    return list(subset)
        return None

    for dim, degree in enumerate(shard_degrees):
        axes = take(degree)
        if axes is None:
            return None
        for a in axes:
            codes[a] = shard(dim)
            free.remove(a)
    axes = take(copy)
    if axes is None:
        return None
    for a in axes:
        codes[a] = REPLICA
    return Placement(tuple(codes))


