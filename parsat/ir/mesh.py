"""The device mesh: the ranks of a job as named axes that follow the machine.

A mesh is an ordered tuple of axes, major first: rank r has coordinate
`(r // stride(a)) % size(a)` on axis a, where `stride(a)` is the product of
the sizes of the axes after a (the last axis varies fastest, as in
`torch.distributed.DeviceMesh(..., mesh=arange(world).reshape(sizes))`).
Ranks fill nodes in order (ranks [k*g, (k+1)*g) share node k, g devices per
node), so an axis's topology follows from its stride: its groups (the ranks
that differ only on that axis) have `members_per_node` members inside one
node and span `nodes_spanned` nodes. The cost model prices a collective on
an axis by that topology (NVLink inside a node, the network between nodes,
hierarchical when both); the backend builds one process group per group.

Every parallel operator of a plan acts on one axis; a tensor's placement is
one entry per axis (`ir.placement`). A machine's natural mesh is
nodes x GPUs; the optimizer also tries factorisations (e.g. 64 = 16 x 4 on
h100x8: the 4-axis inside a node, the 16-axis across nodes and 2 GPUs of
each), which is how tensor parallelism of 2 or 4 meets data parallelism
over the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Iterator, Sequence


class MeshError(Exception):
    """A mesh that cannot be built or does not fit the machine."""


@dataclass(frozen=True)
class MeshAxis:
    name: str
    size: int


@dataclass(frozen=True)
class Mesh:
    """Named axes over `world` ranks, major first, on nodes of `devices_per_node` devices."""

    axes: tuple[MeshAxis, ...]
    devices_per_node: int = 1

    def __post_init__(self) -> None:
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise MeshError(f"mesh axis names must differ: {names}")
        for axis in self.axes:
            if axis.size < 1:
                raise MeshError(f"mesh axis '{axis.name}' has size {axis.size}; sizes are at least 1")
        if self.devices_per_node < 1:
            raise MeshError("devices_per_node must be at least 1")

    # ------------------------------------------------------------ building
    @staticmethod
    def of(sizes: Sequence[int], devices_per_node: int = 1, names: Sequence[str] | None = None) -> "Mesh":
        """A mesh of the given sizes; axes named by their topology unless `names` is given."""
        sizes = tuple(int(s) for s in sizes)
        if names is None:
            names = _topology_names(sizes, devices_per_node)
        if len(names) != len(sizes):
            raise MeshError(f"{len(names)} names for {len(sizes)} mesh axes")
        return Mesh(tuple(MeshAxis(n, s) for n, s in zip(names, sizes)), devices_per_node)

    # ------------------------------------------------------------ geometry
    @property
    def world(self) -> int:
        return prod(a.size for a in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    def __len__(self) -> int:
        return len(self.axes)

    def __iter__(self) -> Iterator[MeshAxis]:
        return iter(self.axes)

    def index(self, name: str) -> int:
        for i, axis in enumerate(self.axes):
            if axis.name == name:
                return i
        raise MeshError(f"the mesh has no axis '{name}' (axes: {', '.join(self.names)})")

    def size(self, axis: int) -> int:
        return self.axes[axis].size

    def stride(self, axis: int) -> int:
        return prod(a.size for a in self.axes[axis + 1:])

    def coord(self, rank: int, axis: int) -> int:
        return (rank // self.stride(axis)) % self.size(axis)

    def coords(self, rank: int) -> tuple[int, ...]:
        return tuple(self.coord(rank, i) for i in range(len(self.axes)))

    def group(self, axis: int, rank: int) -> tuple[int, ...]:
        """The ranks that differ from `rank` only on `axis`, in coordinate order."""
        stride = self.stride(axis)
        base = rank - self.coord(rank, axis) * stride
        return tuple(base + c * stride for c in range(self.size(axis)))

    def groups(self, axis: int) -> tuple[tuple[int, ...], ...]:
        """Every group of `axis`, each once, ordered by its first rank."""
        seen: dict[int, tuple[int, ...]] = {}
        for rank in range(self.world):
            members = self.group(axis, rank)
            seen.setdefault(members[0], members)
        return tuple(seen[k] for k in sorted(seen))

    # ------------------------------------------------------------ topology
    def members_per_node(self, axis: int) -> int:
        """How many members of one group of `axis` share a node."""
        g, stride, size = self.devices_per_node, self.stride(axis), self.size(axis)
        if stride >= g:
            return 1
        return min(size, max(1, g // stride))

    def nodes_spanned(self, axis: int) -> int:
        """How many nodes one group of `axis` touches."""
        return -(-self.size(axis) // self.members_per_node(axis))

    def describe_axis(self, axis: int) -> str:
        """"over nodes", "over NVLink" or "over 2 nodes x 4 GPUs", for explanations."""
        inside, nodes = self.members_per_node(axis), self.nodes_spanned(axis)
        if nodes == 1:
            return "inside a node"
        if inside == 1:
            return "across nodes"
        return f"across {nodes} nodes x {inside} devices"

    # ------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return {"axes": [{"name": a.name, "size": a.size} for a in self.axes],
                "devices_per_node": self.devices_per_node}

    @staticmethod
    def from_dict(data: dict) -> "Mesh":
        try:
            axes = tuple(MeshAxis(str(a["name"]), int(a["size"])) for a in data["axes"])
            return Mesh(axes, int(data.get("devices_per_node", 1)))
        except (KeyError, TypeError, ValueError) as err:
            raise MeshError(f"bad mesh description: {err}") from None

    def __str__(self) -> str:
        return " x ".join(f"{a.name} {a.size}" for a in self.axes)


def _topology_names(sizes: Sequence[int], devices_per_node: int) -> list[str]:
    """'node' for an axis only across nodes, 'gpu' for one inside a node, 'mixed' for both; numbered when repeated."""
    probe = Mesh(tuple(MeshAxis(f"a{i}", s) for i, s in enumerate(sizes)), devices_per_node)
    kinds = []
    for i in range(len(sizes)):
        if probe.nodes_spanned(i) == 1:
            kinds.append("gpu")
        elif probe.members_per_node(i) == 1:
            kinds.append("node")
        else:
            kinds.append("mixed")
    out = []
    for i, kind in enumerate(kinds):
        same = [k for k in kinds if k == kind]
        out.append(kind if len(same) == 1 else f"{kind}{kinds[:i].count(kind)}")
    return out


def factorisations(world: int, devices_per_node: int, max_axes: int = 2) -> list[tuple[int, ...]]:
    """Mesh shapes the optimizer tries for `world` ranks: every ordered factorisation into at most `max_axes`
    factors >= 2 whose minor axis fits inside a node (tensor parallelism stays on NVLink), plus (world,)."""
    shapes: list[tuple[int, ...]] = [(world,)] if world > 1 else [()]

    def extend(prefix: tuple[int, ...], rest: int) -> None:
        for f in range(2, rest + 1):
            if rest % f == 0 and rest // f >= 2:
                shape = prefix + (rest // f, f)
                if len(shape) <= max_axes and f <= devices_per_node:
                    shapes.append(shape)
                if len(prefix) + 2 < max_axes:
                    extend(prefix + (rest // f,), f)

    if world > 1:
        extend((), world)
    return sorted(set(shapes), key=lambda s: (len(s), s))
