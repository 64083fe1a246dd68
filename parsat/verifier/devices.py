"""The ground truth: what every device computes, on the piece it holds, with local indices.

A mesh is a tuple of named axes (`Mesh`); a device is a coordinate on
each. A tensor on the mesh is a `DeviceTensor`: its `MeshPlacement` (per
dim, the axes whose coordinates, first axis major, are the block index;
the axes of explicit copies; the axes of partial sums; every other axis
holds the same piece on all its devices, "not spread") and the piece each
device holds. This is DTensor's model: one entry per mesh axis, Shard(d) /
Replicate / Partial / not spread, with a dim sharded on several axes
nested in the order the axes are listed (`MeshPlacement.per_axis` shows it
in DTensor's terms; the mesh order is the usual one).

The four parallel operators are the collectives, run on the pieces:
`partition` slices each device's piece (its sub-block is its mixed-radix
coordinate on the axes taken, appended as the minor part of the block
index), `combine` all-gathers over the last axes of a dim, `replicate`
marks free axes as copies, `reduce` all-reduces over the last partial-sum
axes. A compute operator runs SPMD: every device instantiates the
operator at the sizes of *its own pieces* and evaluates the index
semantics on them (`dsl.evaluate`), so a window that crosses a block
boundary reads what the device really holds. Nothing here asks the
spread analysis what a device computes; the analysis only names the
placement the output *claims* (which index variable owns which axes), and
`gather` checks the claim: every device holding the same slot must agree,
and the assembled value must equal the global semantics (`global_value`).

`RuleSides` lays both sides of a rule instance out on one mesh; two
ways to give the parallel operators their axes:
* `FamilyAxes` (a rule on its own): each degree symbol `p` is an axis
  family `p`, `p#2`, ... of size p; `partition(x, d, p * q)` takes a free
  `p` and a free `q` axis, in that order (so `p` is major, as
  `partition(partition(x, d, p), d, q)` has it);
* `BoundAxes` (a lifted instance, `verifier.lifting`): each degree symbol
  is bound to given axes of a fixed mesh, and the metavariables arrive
  already spread over the other axes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import numpy as np

from parsat.dsl import ast
from parsat.dsl.conditions import symbolic_truth
from parsat.dsl.evaluate import EvaluationError, evaluate
from parsat.dsl.instantiate import InstantiationError, OpInstance, index_bounds, instantiate
from parsat.dsl.parallel_ops import prime_factors
from parsat.dsl.spread import SymbolicDegrees, block_read
from parsat.dsl.symbolic import Poly
from parsat.dsl.typecheck import TypedTerm

MAX_DEVICES = 512

Device = tuple[int, ...]


class DeviceError(Exception):
    """A device cannot do what the term asks (the message names the device and why)."""


class NotPlaceable(Exception):
    """The mesh has no axes for this parallel operator (a lifted instance that is not legal)."""


# ------------------------------------------------------------------------- mesh


@dataclass(frozen=True)
class Mesh:
    """Named axes, first axis major: `Mesh((("dp", 2), ("tp", 3)))` has 6 devices."""

    axes: tuple[tuple[str, int], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        return dict(self.axes)[name]

    def devices(self) -> Iterator[Device]:
        return itertools.product(*(range(s) for s in self.shape))

    def coord(self, device: Device, name: str) -> int:
        return device[self.names.index(name)]

    def radix(self, device: Device, names: Sequence[str]) -> int:
        """The index of `device` along `names`, read as a mixed-radix number (first name major)."""
        index = 0
        for name in names:
            index = index * self.axis_size(name) + self.coord(device, name)
        return index

    def product(self, names: Sequence[str]) -> int:
        return math.prod(self.axis_size(n) for n in names)

    def group(self, device: Device, names: Sequence[str]) -> list[Device]:
        """The devices that agree with `device` off `names`, in mixed-radix order of `names`."""
        positions = [self.names.index(n) for n in names]
        members = []
        for coords in itertools.product(*(range(self.axis_size(n)) for n in names)):
            other = list(device)
            for position, value in zip(positions, coords):
                other[position] = value
            members.append(tuple(other))
        return members

    def describe(self, device: Device) -> str:
        return "(" + ", ".join(f"{n}={c}" for n, c in zip(self.names, device)) + ")"

    def __str__(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in self.axes) or "one device"


@dataclass(frozen=True)
class MeshPlacement:
    """Which axes split each dim (major first), which hold copies, which hold partial sums."""

    shard: tuple[tuple[str, ...], ...]
    copy: tuple[str, ...] = ()
    sum: tuple[str, ...] = ()

    @staticmethod
    def whole(rank: int) -> "MeshPlacement":
        return MeshPlacement(tuple(() for _ in range(rank)))

    @property
    def used(self) -> tuple[str, ...]:
        return tuple(a for dim in self.shard for a in dim) + self.copy + self.sum

    def degrees(self, mesh: Mesh) -> tuple[tuple[int, ...], int, int]:
        return tuple(mesh.product(d) for d in self.shard), mesh.product(self.copy), mesh.product(self.sum)

    def slot(self, mesh: Mesh, device: Device) -> tuple[tuple[int, ...], int, int]:
        """(block per dim, copy index, partial-sum index) of the piece `device` holds."""
        return (tuple(mesh.radix(device, d) for d in self.shard), mesh.radix(device, self.copy),
                mesh.radix(device, self.sum))

    def per_axis(self, mesh: Mesh) -> dict[str, str]:
        """DTensor's view: one entry per mesh axis."""
        out = {}
        for name in mesh.names:
            dims = [d for d, axes in enumerate(self.shard) if name in axes]
            out[name] = (f"Shard({dims[0]})" if dims else "Replicate" if name in self.copy
                         else "Partial" if name in self.sum else "-")
        return out

    def __str__(self) -> str:
        parts = ["shard [" + ", ".join("*".join(d) if d else "1" for d in self.shard) + "]"]
        if self.copy:
            parts.append("copy " + "*".join(self.copy))
        if self.sum:
            parts.append("sum " + "*".join(self.sum))
        return ", ".join(parts)


@dataclass
class DeviceTensor:
    """A logical tensor of `shape`, placed on the mesh; `pieces[device]` is what that device holds."""

    shape: tuple[int, ...]
    placement: MeshPlacement
    pieces: dict[Device, np.ndarray]


def distribute(value: np.ndarray, placement: MeshPlacement, mesh: Mesh,
               rng: np.random.Generator | None = None) -> DeviceTensor:
    """The pieces of a global value under `placement`; partial sums are random integer summands."""
    shape = tuple(value.shape)
    shard, _, total = placement.degrees(mesh)
    for dim, (size, degree) in enumerate(zip(shape, shard)):
        if size % degree:
            raise DeviceError(f"dim {dim} of size {size} does not split into {degree} equal blocks")
    local = tuple(s // d for s, d in zip(shape, shard))
    summands: list[np.ndarray] = [value]
    if total > 1:
        rng = rng or np.random.default_rng(0)
        summands = [rng.integers(-3, 4, size=shape).astype(value.dtype) for _ in range(total - 1)]
        summands.append(value - sum(summands))
    pieces = {}
    for device in mesh.devices():
        blocks, _, s = placement.slot(mesh, device)
        index = tuple(slice(b * n, (b + 1) * n) for b, n in zip(blocks, local))
        pieces[device] = summands[s][index]
    return DeviceTensor(shape, placement, pieces)


class Inconsistent(Exception):
    """Devices that should hold the same piece do not (the message says which)."""


def gather(tensor: DeviceTensor, mesh: Mesh) -> list[np.ndarray]:
    """The logical value of every copy: blocks put together, partial sums added.

    Raises `Inconsistent` when two devices holding the same slot hold
    different pieces, or a piece does not have the block shape.
    """
    shard, copies, total = tensor.placement.degrees(mesh)
    local = tuple(s // d for s, d in zip(tensor.shape, shard))
    seen: dict[tuple, tuple[Device, np.ndarray]] = {}
    for device in mesh.devices():
        slot = tensor.placement.slot(mesh, device)
        piece = tensor.pieces[device]
        if tuple(piece.shape) != local:
            raise Inconsistent(f"device {mesh.describe(device)} holds a piece of shape {list(piece.shape)}; "
                               f"placed {tensor.placement} on a tensor of shape {list(tensor.shape)}, "
                               f"a piece has shape {list(local)}")
        if slot in seen:
            other, first = seen[slot]
            if not _same(first, piece):
                raise Inconsistent(f"devices {mesh.describe(other)} and {mesh.describe(device)} hold the same piece "
                                   f"(block {list(slot[0])}, copy {slot[1]}, sum {slot[2]}) but their values differ")
            continue
        seen[slot] = (device, piece)
    values = [np.zeros(tensor.shape, dtype=_dtype(tensor)) for _ in range(copies)]
    for (blocks, c, _s), (_, piece) in seen.items():
        index = tuple(slice(b * n, (b + 1) * n) for b, n in zip(blocks, local))
        values[c][index] = values[c][index] + piece
    return values


def _dtype(tensor: DeviceTensor):
    return next(iter(tensor.pieces.values())).dtype if tensor.pieces else np.float64


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a.astype(float)) & np.isnan(b.astype(float)))))


# ------------------------------------------------------------- parallel operators


def partition(tensor: DeviceTensor, mesh: Mesh, dim: int, axes: tuple[str, ...]) -> DeviceTensor:
    """A local slice: each device keeps sub-block (its coordinate on `axes`) of its piece along `dim`."""
    placement = tensor.placement
    _check_free(placement, axes, "partition")
    n = mesh.product(axes)
    pieces = {}
    for device, piece in tensor.pieces.items():
        size = piece.shape[dim]
        if size % n:
            raise DeviceError(f"partition: the piece on device {mesh.describe(device)} has {size} entries along "
                              f"dim {dim}, which do not split into {n} equal blocks")
        t, extent = mesh.radix(device, axes), size // n
        index = (slice(None),) * dim + (slice(t * extent, (t + 1) * extent),)
        pieces[device] = piece[index]
    shard = list(placement.shard)
    shard[dim] = shard[dim] + axes
    shape = tensor.shape
    return DeviceTensor(shape, MeshPlacement(tuple(shard), placement.copy, placement.sum), pieces)


def combine(tensor: DeviceTensor, mesh: Mesh, dim: int, axes: tuple[str, ...]) -> DeviceTensor:
    """An all-gather over the last `axes` of `dim`: each device gets the blocks of its group, concatenated."""
    placement = tensor.placement
    if not axes:
        return tensor
    if placement.shard[dim][-len(axes):] != axes:
        raise DeviceError(f"combine: dim {dim} is split over {list(placement.shard[dim])}, not last over "
                          f"{list(axes)}")
    pieces = {device: np.concatenate([tensor.pieces[d] for d in mesh.group(device, axes)], axis=dim)
              for device in tensor.pieces}
    shard = list(placement.shard)
    shard[dim] = shard[dim][:-len(axes)]
    return DeviceTensor(tensor.shape, MeshPlacement(tuple(shard), placement.copy, placement.sum), pieces)


def replicate(tensor: DeviceTensor, mesh: Mesh, axes: tuple[str, ...]) -> DeviceTensor:
    """Free axes become explicit copies; no data moves (their devices already hold the piece)."""
    _check_free(tensor.placement, axes, "replicate")
    placement = tensor.placement
    return DeviceTensor(tensor.shape, MeshPlacement(placement.shard, placement.copy + axes, placement.sum),
                        dict(tensor.pieces))


def reduce(tensor: DeviceTensor, mesh: Mesh, axes: tuple[str, ...]) -> DeviceTensor:
    """An all-reduce over partial-sum `axes` (any of them: a sum does not care which is added first)."""
    placement = tensor.placement
    if not axes:
        return tensor
    missing = [a for a in axes if a not in placement.sum]
    if missing:
        raise DeviceError(f"reduce: the partial sums are over {list(placement.sum)}, not over {missing}")
    pieces = {}
    for device in tensor.pieces:
        members = [tensor.pieces[d] for d in mesh.group(device, axes)]
        total = members[0]
        for other in members[1:]:
            total = total + other
        pieces[device] = total
    kept = tuple(a for a in placement.sum if a not in axes)
    return DeviceTensor(tensor.shape, MeshPlacement(placement.shard, placement.copy, kept), pieces)


def _check_free(placement: MeshPlacement, axes: tuple[str, ...], what: str) -> None:
    taken = [a for a in axes if a in placement.used]
    if taken:
        raise NotPlaceable(f"{what}: axes {taken} are already used by this tensor ({placement})")


# ---------------------------------------------------------------- compute operators


def compute_placement(instance: OpInstance, placements: Sequence[MeshPlacement],
                      mesh: Mesh) -> tuple[MeshPlacement, list[str]]:
    """The placement the output claims, and why the inputs do not line up (empty when they do).

    An index variable owns the axes of the dims it reads (plainly, or as
    the leading index of a block read); an output dim takes its variable's
    axes, a summed variable's axes become partial sums (after the inputs'
    own); every other axis the inputs use holds copies. Whether the claim
    is true is for `gather` and the global semantics to say.
    """
    problems: list[str] = []
    by_name = dict(zip(instance.inputs, placements))
    bounds, reads, summed, maxed = _structure(instance)
    var_axes: dict[str, tuple[str, ...]] = {}
    for node, position, index in reads:
        placement = by_name[node.tensor]
        axes = placement.shard[position] if position < len(placement.shard) else ()
        axes = tuple(a for a in axes if mesh.axis_size(a) > 1)  # an axis of size 1 splits nothing
        if isinstance(index, ast.Name) and index.id in bounds:
            var = index.id
        elif axes:
            spread = SymbolicDegrees(tuple(Poly.const(mesh.product(d)) for d in placement.shard))
            read = block_read(node, position, spread, instance, bounds)
            if read is None:
                problems.append(f"dim {position} of '{node.tensor}' is split over {list(axes)} but read "
                                "through an expression")
                continue
            var = read[0]
        else:
            continue
        seen = var_axes.setdefault(var, axes)
        if seen != axes:
            problems.append(f"index '{var.replace('#', '')}' reads dims split over different axes "
                            f"({list(seen)} and {list(axes)})")
    used_sets = {frozenset(a for a in p.used if mesh.axis_size(a) > 1) for p in placements}
    if len(used_sets) > 1:
        problems.append("the inputs are spread over different axes (" +
                        ", ".join(f"'{n}': {p}" for n, p in by_name.items()) + ")")
    sums = list(dict.fromkeys(p.sum for p in placements if mesh.product(p.sum) > 1))
    if len(sums) > 1:
        problems.append("partial inputs are summed over different axes")
    out_shard = tuple(var_axes.get(v, ()) for v in instance.out_vars)
    out_sum = sums[0] if sums else ()
    for v in summed:  # a summed variable's axes become partial sums, once (a partial input may have them already)
        out_sum += tuple(a for a in var_axes.get(v, ()) if a not in out_sum)
    for v in maxed:  # a block's max is no summand: claimed as one (what a naive run would do), and refused
        if var_axes.get(v):
            problems.append(f"a max over index '{v.replace('#', '')}', whose range is split over "
                            f"{list(var_axes[v])}: each device holds the max of its own block, not a summand")
            out_sum += tuple(a for a in var_axes[v] if a not in out_sum)
    taken = {a for d in out_shard for a in d} | set(out_sum)
    used = set().union(*used_sets) if used_sets else set()
    out_copy = tuple(a for a in mesh.names if a in used and a not in taken)
    return MeshPlacement(out_shard, out_copy, out_sum), problems


_STRUCTURE: dict[int, tuple] = {}
_LOCAL: dict[tuple, tuple] = {}


def _structure(instance: OpInstance) -> tuple[dict, list, list, list]:
    """(index bounds, every (access, position, index) reading an input, summed variables, maxed variables),
    memoized."""
    hit = _STRUCTURE.get(id(instance))
    if hit is not None and hit[0] is instance:
        return hit[1]
    bounds = index_bounds(instance)
    inputs = set(instance.inputs)
    reads = [(node, position, index) for node in ast.walk(instance.body)
             if isinstance(node, ast.Access) and node.tensor in inputs for position, index in enumerate(node.indices)]
    summed = list(dict.fromkeys(node.var for node in ast.walk(instance.body) if isinstance(node, ast.Sum)))
    maxed = list(dict.fromkeys(node.var for node in ast.walk(instance.body) if isinstance(node, ast.Max)))
    if len(_STRUCTURE) > 20000:
        _STRUCTURE.clear()
    _STRUCTURE[id(instance)] = (instance, (bounds, reads, summed, maxed))
    return bounds, reads, summed, maxed


def run_compute(instance: OpInstance, sizes: Mapping[str, int], args: Sequence[DeviceTensor], mesh: Mesh,
                reals: Mapping[str, float], shape: tuple[int, ...]) -> tuple[DeviceTensor, list[str]]:
    """Every device runs the operator on its own pieces, at their sizes (SPMD)."""
    placement, problems = compute_placement(instance, [a.placement for a in args], mesh)
    attrs = {name: Poly.const(poly.evaluate(sizes)) for name, poly in instance.attrs.items()}
    used = sorted({a for arg in args for a in arg.placement.used} | set(placement.used), key=mesh.names.index)
    local_instances: dict[tuple, OpInstance] = {}
    done: dict[tuple, np.ndarray] = {}
    pieces = {}
    for device in mesh.devices():
        key = tuple(mesh.coord(device, a) for a in used)
        if key in done:  # devices that differ only on axes no input uses compute the same thing
            pieces[device] = done[key]
            continue
        local = [arg.pieces[device] for arg in args]
        shapes = tuple(tuple(piece.shape) for piece in local)
        local_instance = local_instances.get(shapes)
        if local_instance is None:
            key = (id(instance), shapes, tuple(sorted((k, v.constant) for k, v in attrs.items())))
            hit = _LOCAL.get(key)
            if hit is not None and hit[0] is instance:
                local_instance = hit[1]
            else:
                local_instance = _local_instance(instance, shapes, attrs, mesh, device)
                if len(_LOCAL) > 20000:
                    _LOCAL.clear()
                _LOCAL[key] = (instance, local_instance)
            local_instances[shapes] = local_instance
        try:
            value = evaluate(local_instance, {}, dict(zip(instance.inputs, local)), reals)
        except (EvaluationError, IndexError, ValueError, ZeroDivisionError) as err:
            raise DeviceError(f"device {mesh.describe(device)} cannot run {instance.name} on its pieces: {err}") \
                from None
        done[key] = pieces[device] = value
    return DeviceTensor(shape, placement, pieces), problems


def _local_instance(instance: OpInstance, shapes, attrs, mesh: Mesh, device: Device) -> OpInstance:
    """The operator instantiated at the sizes of one device's pieces (its `where` checked there)."""
    try:
        local = instantiate(instance.op, [[Poly.const(n) for n in s] for s in shapes], attrs, instance.real_attrs,
                            groups=instance.groups)
    except InstantiationError as err:
        raise DeviceError(f"device {mesh.describe(device)} cannot run {instance.name} on pieces of shapes "
                          f"{', '.join(str(list(s)) for s in shapes)}: {err}") from None
    for cond in local.requirements:
        if symbolic_truth(cond) is False:
            raise DeviceError(f"device {mesh.describe(device)} cannot run {instance.name} on pieces of shapes "
                              f"{', '.join(str(list(s)) for s in shapes)}: it requires {cond}")
    return local


# ---------------------------------------------------------------- global semantics


def global_value(term: TypedTerm, sizes: Mapping[str, int], inputs: Mapping[str, np.ndarray],
                 reals: Mapping[str, float], memo: dict | None = None) -> np.ndarray:
    """The term's logical value: parallel operators are the identity, compute operators run whole."""
    memo = {} if memo is None else memo
    key = id(term)
    if key in memo:
        return memo[key]
    if term.kind == "input":
        value = inputs[term.name]
    elif term.kind == "parallel":
        value = global_value(term.args[0], sizes, inputs, reals, memo)
    else:
        args = [global_value(a, sizes, inputs, reals, memo) for a in term.args]
        value = evaluate(term.instance, sizes, dict(zip(term.instance.inputs, args)), reals)
    memo[key] = value
    return value


# ------------------------------------------------------------------ a rule's sides


class FamilyAxes:
    """Axes for a rule on its own: degree symbol `p` is a family of axes `p`, `p#2`, ... of size p.

    The mesh grows as parallel operators ask for axes. A product degree
    `p * q` takes a free axis of each factor, symbols in name order (`p`
    major, as `partition(partition(x, d, p), d, q)` has it); a constant
    factor c is a family named c; any other degree (a quotient, a sum) is
    a family named after its text. A tensor that already uses `p` (say
    `partition(partition(x, 0, p), 1, p)`) gets `p#2`.
    """

    def __init__(self, sizes: Mapping[str, int]):
        self.sizes = sizes
        self.axes: list[tuple[str, int]] = []

    def mesh(self) -> Mesh:
        return Mesh(tuple(self.axes))

    def take(self, term: TypedTerm, n: int, placement: MeshPlacement) -> tuple[str, ...]:
        busy = set(placement.used)
        out: list[str] = []
        for family, size in _factors(term.degree, self.sizes):
            k = 1
            while True:
                stem = family if k == 1 else f"{family}#{k}"
                names = _prime_axes(stem, size)
                if names[0][0] not in dict(self.axes):
                    self.axes.extend(names)
                    break
                if not any(name in busy for name, _ in names):
                    break
                k += 1
            busy.update(name for name, _ in names)
            out.extend(name for name, _ in names)
        if math.prod(dict(self.axes)[a] for a in out) != n:
            raise DeviceError(f"internal: axes {out} do not make degree {n}")
        return tuple(out)


    def give_back(self, term: TypedTerm, n: int, held: tuple[str, ...]) -> tuple[str, ...]:
        """The axes a combine (the last splits of the dim) or a reduce (its degree's families) gives back."""
        if term.name == "reduce":
            picked: list[str] = []
            for family, _size in _factors(term.degree, self.sizes):
                matches = [a for a in held if _stem(a) == family and a not in picked]
                if not matches:
                    break
                last = _stem_instance(matches[-1])
                picked += [a for a in held if _stem_instance(a) == last and a not in picked]
            else:
                if picked and self.mesh().product(picked) == n:
                    return tuple(a for a in held if a in picked)
        return _suffix(held, n, term, self.mesh())


def _stem_instance(axis: str) -> str:
    """`p#2:1` -> `p#2` (one allocation of a family, all its prime axes)."""
    return axis.split(":")[0]


def _stem(axis: str) -> str:
    """`p#2:1` -> `p` (the family)."""
    return axis.split(":")[0].split("#")[0]


class BoundAxes:
    """Axes for a lifted instance: each degree symbol is bound to axes of a fixed mesh."""

    def __init__(self, mesh: Mesh, binding: Mapping[str, tuple[str, ...]], sizes: Mapping[str, int]):
        self._mesh, self.binding, self.sizes = mesh, dict(binding), sizes

    def mesh(self) -> Mesh:
        return self._mesh

    def take(self, term: TypedTerm, n: int, placement: MeshPlacement) -> tuple[str, ...]:
        out: list[str] = []
        for family, _size in _factors(term.degree, self.sizes):
            if family not in self.binding:
                raise NotPlaceable(f"degree {term.degree} has a factor {family} bound to no mesh axis")
            out.extend(self.binding[family])
        _check_free(placement, tuple(out), term.name)
        if len(set(out)) != len(out) or self._mesh.product(out) != n:
            raise NotPlaceable(f"{term.name} by {n}: the bound axes {out} do not make that degree")
        return tuple(out)

    def give_back(self, term: TypedTerm, n: int, held: tuple[str, ...]) -> tuple[str, ...]:
        """A reduce gives back its bound axes wherever they are; a combine only when they are the last splits."""
        out: list[str] = []
        for family, _size in _factors(term.degree, self.sizes):
            if family not in self.binding:
                raise NotPlaceable(f"degree {term.degree} has a factor {family} bound to no mesh axis")
            out.extend(self.binding[family])
        if self._mesh.product(out) != n or any(a not in held for a in out):
            raise NotPlaceable(f"{term.name} by {n}: the bound axes {out} are not among {list(held)}")
        if term.name == "combine" and tuple(held[len(held) - len(out):]) != tuple(out):
            raise NotPlaceable(f"combine over {out}: the dim is split over {list(held)}, and only its last splits "
                               "can be gathered into whole blocks")
        return tuple(a for a in held if a in out)


def _prime_axes(stem: str, size: int) -> list[tuple[str, int]]:
    """One axis per prime factor (smallest major), so that a combine or reduce by a factor of a
    degree finds its axes: `p` = 4 is `p:0` x `p:1`, and `combine(., d, 2)` gives back `p:1`."""
    primes = prime_factors(size)
    if len(primes) <= 1:
        return [(stem, size)]
    return [(f"{stem}:{i}", prime) for i, prime in enumerate(primes)]


def _factors(degree: Poly, sizes: Mapping[str, int]) -> list[tuple[str, int]]:
    if len(degree.terms) == 1:
        mono, coeff = degree.terms[0]
        if coeff >= 1 and all(isinstance(atom, str) for atom, _ in mono):
            out = [(atom, sizes[atom]) for atom, exp in sorted(mono) for _ in range(exp)]
            if coeff > 1:
                out.append((str(coeff), coeff))
            return out
    if degree.is_const:
        return [(str(degree.constant), degree.constant)] if degree.constant > 1 else []
    return [(str(degree), degree.evaluate(sizes))]


@dataclass
class SideRun:
    """One side simulated on the devices: its value there, and what each node claimed."""

    tensor: DeviceTensor
    nodes: list[tuple[TypedTerm, DeviceTensor, list[str]]] = field(default_factory=list)  # post-order


class RuleSides:
    """Both sides of a rule instance, on one mesh, device by device.

    `axes` gives each parallel operator its axes (`FamilyAxes` by default,
    or `BoundAxes`); a first pass places every node without values, so
    that the mesh is known and both sides share it. With `strict`, a
    compute operator whose inputs do not line up on the mesh is a
    `DeviceError` where the spread analysis refuses it too (the backend
    could not run it: a tensor missing from an axis never gets its
    gradient summed there), and `NotPlaceable` where the analysis accepts
    it (a placement question for the layout guard, not a wrong value).
    """

    def __init__(self, terms: Sequence[TypedTerm], sizes: Mapping[str, int],
                 input_placements: Mapping[str, MeshPlacement] | None = None, axes=None, strict: bool = True):
        self.sizes = dict(sizes)
        self.strict = strict  # inputs that do not line up: an error (see `_run`), or run anyway
        self.input_placements = dict(input_placements or {})
        self.axes = axes if axes is not None else FamilyAxes(self.sizes)
        self.axes_of: dict[int, tuple[str, ...]] = {}
        for term in terms:
            self._place(term)
        self.mesh = self.axes.mesh()
        if self.mesh.size > MAX_DEVICES:
            raise DeviceError(f"the sides need {self.mesh.size} devices (at most {MAX_DEVICES} are simulated)")

    def _shape(self, term: TypedTerm) -> tuple[int, ...]:
        return tuple(d.evaluate(self.sizes) for d in term.shape)

    def _place(self, term: TypedTerm) -> MeshPlacement:
        """Placements only, allocating the axes of every parallel operator (the first pass)."""
        if term.kind == "input":
            return self.input_placements.get(term.name, MeshPlacement.whole(len(term.shape)))
        args = [self._place(a) for a in term.args]
        if term.kind != "parallel":
            return compute_placement(term.instance, args, self.axes.mesh())[0]
        source = args[0]
        n = term.degree.evaluate(self.sizes)
        if term.name in ("partition", "replicate"):
            axes = self.axes_of.get(id(term))
            if axes is None:
                axes = self.axes_of[id(term)] = self.axes.take(term, n, source)
            if term.name == "partition":
                shard = list(source.shard)
                shard[term.dim] = shard[term.dim] + axes
                return MeshPlacement(tuple(shard), source.copy, source.sum)
            return MeshPlacement(source.shard, source.copy + axes, source.sum)
        held = source.shard[term.dim] if term.name == "combine" else source.sum
        axes = self.axes_of[id(term)] = self.axes.give_back(term, n, held)
        kept = tuple(a for a in held if a not in axes)
        if term.name == "combine":
            shard = list(source.shard)
            shard[term.dim] = kept
            return MeshPlacement(tuple(shard), source.copy, source.sum)
        return MeshPlacement(source.shard, source.copy, kept)

    # -------------------------------------------------------------- values
    def run(self, term: TypedTerm, inputs: Mapping[str, DeviceTensor], reals: Mapping[str, float]) -> SideRun:
        """Every device's piece of `term`, with the piece of every node (post-order)."""
        nodes: list = []
        tensor = self._run(term, inputs, reals, nodes)
        return SideRun(tensor, nodes)

    def _run(self, term: TypedTerm, inputs, reals, nodes: list) -> DeviceTensor:
        if term.kind == "input":
            tensor = inputs[term.name]
            nodes.append((term, tensor, []))
            return tensor
        args = [self._run(a, inputs, reals, nodes) for a in term.args]
        problems: list[str] = []
        if term.kind == "parallel":
            source, axes = args[0], self.axes_of[id(term)]
            if term.name == "partition":
                tensor = partition(source, self.mesh, term.dim, axes)
            elif term.name == "combine":
                tensor = combine(source, self.mesh, term.dim, axes)
            elif term.name == "replicate":
                tensor = replicate(source, self.mesh, axes)
            else:
                tensor = reduce(source, self.mesh, axes)
        else:
            tensor, problems = run_compute(term.instance, self.sizes, args, self.mesh, reals, self._shape(term))
            if problems and self.strict:
                if term.problems:  # the analysis refuses it too: the devices cannot run it as a plan
                    raise DeviceError(f"{term.instance.name}: the pieces do not line up on the devices: {problems[0]} "
                                      "(a device would combine pieces of different blocks, or a tensor missing "
                                      "from an axis would never get its gradient summed over it)")
                raise NotPlaceable(f"{term.instance.name}: the pieces do not line up on this mesh: {problems[0]}")
        nodes.append((term, tensor, problems))
        return tensor


def _suffix(held: tuple[str, ...], n: int, term: TypedTerm, mesh: Mesh) -> tuple[str, ...]:
    """The last axes of `held` whose sizes multiply to n (combine and reduce undo the latest splits)."""
    total, cut = 1, len(held)
    while total < n and cut > 0:
        cut -= 1
        total *= mesh.axis_size(held[cut])
    if total != n:
        raise NotPlaceable(f"{term.name} by {n}: the last axes {list(held)} do not multiply to {n}")
    return held[cut:]
