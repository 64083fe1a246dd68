"""Where the pieces of a parallel tensor live: a `Spread` mapped onto ranks.

The world of N ranks is cut into *atoms*: the prime factors of N, each a
mesh axis `Axis(stride, size)` of the rank space (rank r has coordinate
`(r // stride) % size` on it). A tensor's `Placement` gives every atom one
role:

* `shard[d]`: the atoms whose coordinates, read as a mixed-radix number
  (first atom most significant), are the block index of dim d;
* `copy`: the atoms that make the copy index (explicit replicas, whose
  gradients are summed by the `replicate` that made them);
* `sum`: the atoms that make the partial-sum index;
* `free`: atoms the tensor is not spread over. Ranks that differ only on
  free atoms hold the same piece and compute the same values *and the same
  gradients*: this is how a tensor with fewer pieces than ranks lives on
  all of them (SPMD), with no data movement to start a partition.

The parallel operators move atoms between roles, which gives each its
collective and the ranks it runs among (the atoms it takes or gives back):
`partition(x, d, n)` takes free atoms of product n and appends them to
`shard[d]` (block `b' = b*n + t`: a local slice); `combine` gives the last
atoms of `shard[d]` back (`b' = b // n`: an all-gather over them);
`replicate` appends free atoms to `copy` (`k' = k*n + t`); `reduce` gives
the last atoms of `sum` back (`s' = s // n`: an all-reduce over them).
Working on atoms rather than arbitrary axes makes two layouts comparable
by equality, so a compute operator can check that its inputs' pieces line
up on every rank (`compute_layout`) instead of trusting the plan.

The atom choice is deterministic (the most significant free atoms of the
needed primes), so every rank derives the same layouts and the same
collective groups from the same plan, with no communication.

The optimizer uses the same model (`term_layout`): two terms with the same
spread may lay their pieces on different atoms (`replicate(partition(x))`
shards on the first atom, `partition(replicate(x))` on the second), and a
compute operator whose inputs do not line up cannot run. Rules are applied
only at degrees where both sides lay out alike (`saturate.guards`),
so every plan the optimizer returns is one the backend can lay out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

from parsat.dsl import ast, parallel_ops
from parsat.dsl.instantiate import OpInstance, index_bounds
from parsat.dsl.parallel_ops import COMBINE, PARALLEL_OPS, PARTITION, REPLICATE
from parsat.dsl.spread import Spread, block_read, infer_compute
from parsat.dsl.symbolic import Poly
from parsat.dsl.typecheck import TypedTerm


class PlacementError(Exception):
    """A spread or parallel operator that cannot be laid out on the ranks."""


def prime_factors(n: int) -> list[int]:
    """Prime factors of n in ascending order, with multiplicity (`dsl.parallel_ops.prime_factors`)."""
    try:
        return parallel_ops.prime_factors(n)
    except ValueError as err:
        raise PlacementError(str(err)) from None


@dataclass(frozen=True, order=True)
class Axis:
    """A mesh axis of the rank space: `size` ranks `stride` apart."""

    stride: int
    size: int

    def coord(self, rank: int) -> int:
        return (rank // self.stride) % self.size


def world_atoms(world: int) -> tuple[Axis, ...]:
    """The atoms of a world, most significant first (smallest primes outermost)."""
    atoms, stride = [], world
    for p in prime_factors(world):
        stride //= p
        atoms.append(Axis(stride, p))
    return tuple(atoms)


def mixed_radix(axes: Sequence[Axis], rank: int) -> int:
    """The index a rank has along a list of atoms (first most significant)."""
    index = 0
    for axis in axes:
        index = index * axis.size + axis.coord(rank)
    return index


def product(axes: Iterable[Axis]) -> int:
    total = 1
    for axis in axes:
        total *= axis.size
    return total


def group_ranks(axes: Sequence[Axis], rank: int) -> tuple[int, ...]:
    """The ranks that agree with `rank` off `axes`, in mixed-radix order of `axes`.

    Position t in the result is the rank whose index along `axes` is t:
    the order in which `combine` concatenates blocks.
    """
    base = rank - sum(axis.coord(rank) * axis.stride for axis in axes)
    members = [base]
    for axis in axes:
        members = [m + c * axis.stride for m in members for c in range(axis.size)]
    return tuple(members)


def all_groups(axes: Sequence[Axis], world: int) -> tuple[tuple[int, ...], ...]:
    """Every group of `group_ranks(axes, .)`, each once, ordered by its smallest rank."""
    seen: dict[int, tuple[int, ...]] = {}
    for rank in range(world):
        members = group_ranks(axes, rank)
        seen.setdefault(min(members), members)
    return tuple(seen[k] for k in sorted(seen))


@dataclass(frozen=True)
class Slot:
    """Which piece a rank holds: block per dim, copy index, partial-sum index."""

    blocks: tuple[int, ...]
    copy: int
    sum: int


@dataclass(frozen=True)
class Placement:
    """Where a tensor's pieces live on the ranks: the role of every atom (module docstring).

    Its `degrees` are what a PCG node states (`pcg.Degrees`: how many pieces
    per dim, copies, partial sums); two placements with equal degrees can
    still put their pieces on different ranks, which is why the plan is laid
    out (`pcg_layout.lay_out`) and not only compared by degrees.
    """

    world: int
    shard: tuple[tuple[Axis, ...], ...]
    copy: tuple[Axis, ...] = ()
    sum: tuple[Axis, ...] = ()

    @staticmethod
    def whole(rank: int, world: int) -> "Placement":
        """An unsplit tensor held by every rank (all atoms free)."""
        return Placement(world, tuple(() for _ in range(rank)))

    @property
    def rank(self) -> int:
        return len(self.shard)

    @property
    def used(self) -> tuple[Axis, ...]:
        return tuple(a for dim in self.shard for a in dim) + self.copy + self.sum

    @property
    def free(self) -> tuple[Axis, ...]:
        used = set(self.used)
        return tuple(a for a in world_atoms(self.world) if a not in used)

    @property
    def degrees(self) -> tuple[tuple[int, ...], int, int]:
        """(shard degree per dim, copy degree, sum degree)."""
        return tuple(product(d) for d in self.shard), product(self.copy), product(self.sum)

    @property
    def pieces(self) -> int:
        return product(self.used)

    def spread(self) -> Spread:
        """The `Spread` (with constant degrees) this layout realises."""
        shard, copy, total = self.degrees
        return Spread(tuple(Poly.const(d) for d in shard), Poly.const(copy), Poly.const(total))

    def slot(self, rank: int) -> Slot:
        return Slot(tuple(mixed_radix(d, rank) for d in self.shard), mixed_radix(self.copy, rank),
                    mixed_radix(self.sum, rank))

    def block_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of one piece of a tensor of logical `shape`."""
        if len(shape) != self.rank:
            raise PlacementError(f"a layout of rank {self.rank} cannot hold a tensor of shape {list(shape)}")
        out = []
        for dim, (size, degree) in enumerate(zip(shape, self.degrees[0])):
            if size % degree:
                raise PlacementError(f"dim {dim} of size {size} does not split into {degree} equal blocks")
            out.append(size // degree)
        return tuple(out)

    # ------------------------------------------------------- parallel operators

    def partition(self, dim: int, degree: int) -> tuple["Placement", tuple[Axis, ...]]:
        """Shard dim `dim` `degree` more ways; returns the layout and the atoms taken."""
        self._check_dim(PARTITION, dim)
        taken = self._take_free(PARTITION, degree)
        shard = list(self.shard)
        shard[dim] = shard[dim] + taken
        return replace(self, shard=tuple(shard)), taken

    def combine(self, dim: int, degree: int) -> tuple["Placement", tuple[Axis, ...]]:
        """Undo the last `degree`-way split of dim `dim`; returns the layout and the atoms given back."""
        self._check_dim(COMBINE, dim)
        kept, given = _pop_suffix(self.shard[dim], degree, f"combine: degree {degree} does not undo the last "
                                                           f"splits of dim {dim} (degrees {_sizes(self.shard[dim])})")
        shard = list(self.shard)
        shard[dim] = kept
        return replace(self, shard=tuple(shard)), given

    def replicate(self, degree: int) -> tuple["Placement", tuple[Axis, ...]]:
        """`degree` more copies; returns the layout and the atoms taken."""
        taken = self._take_free(REPLICATE, degree)
        return replace(self, copy=self.copy + taken), taken

    def reduce(self, degree: int) -> tuple["Placement", tuple[Axis, ...]]:
        """Sum groups of `degree` partial pieces; returns the layout and the atoms given back."""
        kept, given = _pop_suffix(self.sum, degree, f"reduce: degree {degree} does not divide out the last "
                                                    f"partial-sum splits (degrees {_sizes(self.sum)})")
        return replace(self, sum=kept), given

    def apply_parallel(self, name: str, degree: int, dim: int | None = None) -> tuple["Placement", tuple[Axis, ...]]:
        """Dispatch on a parallel operator's name (`partition`, `combine`, `replicate`, `reduce`)."""
        if name not in PARALLEL_OPS:
            raise PlacementError(f"'{name}' is not a parallel operator")
        if PARALLEL_OPS[name].has_dim:
            if dim is None:
                raise PlacementError(f"{name} needs a dim")
            return getattr(self, name)(dim, degree)
        return getattr(self, name)(degree)

    def _check_dim(self, what: str, dim: int) -> None:
        if not 0 <= dim < self.rank:
            raise PlacementError(f"{what}: dim {dim} is out of range for a tensor of rank {self.rank}")

    def _take_free(self, what: str, degree: int) -> tuple[Axis, ...]:
        free = list(self.free)
        taken: list[Axis] = []
        for p in prime_factors(degree):
            pick = next((a for a in free if a.size == p), None)
            if pick is None:
                raise PlacementError(f"{what}: degree {degree} needs more devices than are left to this tensor "
                                     f"({self.world} ranks, {self.pieces} pieces already)")
            free.remove(pick)
            taken.append(pick)
        return tuple(sorted(taken, reverse=True))


def _sizes(axes: Sequence[Axis]) -> list[int]:
    return [a.size for a in axes]


def _pop_suffix(axes: tuple[Axis, ...], degree: int, message: str) -> tuple[tuple[Axis, ...], tuple[Axis, ...]]:
    total, cut = 1, len(axes)
    while total < degree and cut > 0:
        cut -= 1
        total *= axes[cut].size
    if total != degree:
        raise PlacementError(message)
    return axes[:cut], axes[cut:]


# ---------------------------------------------------------------- compute ops


def compute_layout(instance: OpInstance, inputs: Sequence[Placement]) -> Placement:
    """The layout of a compute op's output, after checking its inputs line up.

    Legality (which spreads the op accepts) is the DSL's `infer_compute`;
    on top of it, the pieces must line up rank by rank: an index variable
    must read the same atoms (in the same order) in every input, and every
    input must be spread over the same atoms, else a rank would combine
    pieces of different blocks, or a free input would miss the gradient
    sum that a `replicate` gives the others.
    """
    if len(inputs) != len(instance.inputs):
        raise PlacementError(f"{instance.name} takes {len(instance.inputs)} tensor(s), got {len(inputs)}")
    worlds = {layout.world for layout in inputs}
    if len(worlds) != 1:
        raise PlacementError(f"{instance.name}: inputs laid out on different worlds {sorted(worlds)}")
    (world,) = worlds
    inferred = infer_compute(instance, [layout.spread() for layout in inputs])
    if not inferred.legal:
        raise PlacementError("; ".join(inferred.problems))

    by_name = dict(zip(instance.inputs, inputs))
    bounds = index_bounds(instance)
    var_axes: dict[str, tuple[Axis, ...]] = {}
    for node in ast.walk(instance.body):
        if not isinstance(node, ast.Access) or node.tensor not in by_name:
            continue
        layout = by_name[node.tensor]
        for position, index in enumerate(node.indices):
            axes = layout.shard[position]
            if isinstance(index, ast.Name):
                var = index.id
            elif axes:
                # a block read (unflatten's j * k + r, flatten's j / n): its leading index owns the blocks
                read = block_read(node, position, layout.spread(), instance, bounds)
                if read is None:
                    continue  # infer_compute already refused this sharded dim
                var = read[0]
            else:
                continue
            seen = var_axes.setdefault(var, axes)
            if seen != axes:
                raise PlacementError(f"{instance.name}: index '{var.replace('#', '')}' reads blocks laid out "
                                     f"on different ranks (dim {position} of '{node.tensor}'); the plan needs a "
                                     "data movement the backend does not insert")

    spread_sets = {frozenset(layout.used) for layout in inputs}
    if len(spread_sets) != 1:
        raise PlacementError(f"{instance.name}: inputs are spread over different ranks "
                             f"({', '.join(f'{n}: {l.degrees}' for n, l in by_name.items())}); replicate the "
                             "smaller ones first")
    sums = {layout.sum for layout in inputs if layout.sum}
    if len(sums) > 1:
        raise PlacementError(f"{instance.name}: partial inputs are split over different ranks")
    out_shard = tuple(var_axes.get(v, ()) for v in instance.out_vars)
    summed = [node.var for node in ast.walk(instance.body) if isinstance(node, ast.Sum)]
    out_sum = (next(iter(sums)) if sums else ()) + tuple(a for v in dict.fromkeys(summed) for a in var_axes.get(v, ()))
    taken = {a for dim in out_shard for a in dim} | set(out_sum)
    out_copy = tuple(a for a in world_atoms(world) if a in next(iter(spread_sets)) and a not in taken)
    out = Placement(world, out_shard, out_copy, out_sum)
    if out.spread() != inferred.spread:
        raise PlacementError(f"{instance.name}: internal: layout {out.degrees} disagrees with the spread "
                             f"analysis ({inferred.spread})")
    return out


# ------------------------------------------------------------ pieces and values


def piece_index(layout: Placement, rank: int, shape: Sequence[int]) -> tuple[slice, ...]:
    """The slices of the logical tensor that `rank`'s piece covers."""
    block = layout.block_shape(shape)
    slot = layout.slot(rank)
    return tuple(slice(b * size, (b + 1) * size) for b, size in zip(slot.blocks, block))


def holders(layout: Placement) -> Mapping[Slot, tuple[int, ...]]:
    """Which ranks hold each slot (more than one where atoms are free)."""
    found: dict[Slot, list[int]] = {}
    for rank in range(layout.world):
        found.setdefault(layout.slot(rank), []).append(rank)
    return {slot: tuple(ranks) for slot, ranks in found.items()}


def term_layout(term: TypedTerm, world: int, degrees: Mapping[str, int]) -> Placement:
    """The layout of a typed rule term on `world` ranks, its metavariables whole, at concrete `degrees`.

    With whole inputs a term's layout depends only on its structure, its
    degrees and the world, not on its dims. Raises PlacementError when the
    term cannot be laid out (a compute operator's inputs do not line up, a
    degree needs more devices than are left) and KeyError when a degree is
    not in `degrees`.
    """
    if term.kind == "input":
        return Placement.whole(len(term.shape), world)
    args = [term_layout(arg, world, degrees) for arg in term.args]
    if term.kind == "parallel":
        return args[0].apply_parallel(term.name, term.degree.evaluate(degrees), term.dim)[0]
    return compute_layout(term.instance, args)

