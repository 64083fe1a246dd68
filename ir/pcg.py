"""The Parallel Computation Graph (PCG): what extraction picks out of the e-graph.

A PCG runs on a device mesh (`ir.mesh`). A node is a leaf (graph input or
weight, whole), a compute operator on local pieces, or a parallel operator
acting on one mesh axis (attributes `axis`, the axis's name, and `degree`,
its size; `dim` for partition and combine). Every node carries its logical
shape, its `Placement` (one entry per mesh axis: where its pieces live,
docs/MESH.md) and its `Degrees`: the integer shard degree per dim, copy
degree and partial-sum degree that the placement amounts to (the plan
JSON's `spread`; `Degrees.of` is the one conversion from a symbolic
`dsl.spread.Spread`, `Degrees.of_placement` the one from a placement).
Placements are not computed here: they come from the e-graph analysis, and
`pcg_layout.lay_out` checks that every node's follows from its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Iterator, Mapping

from parsat.dsl.spread import Spread
from parsat.dsl.symbolic import Poly
from parsat.ir.mesh import Mesh
from parsat.ir.placement import Placement

@dataclass(frozen=True)
class Degrees:
    """How a tensor is spread over devices, with concrete degrees."""

    shard: tuple[int, ...]
    copy: int = 1
    sum: int = 1

    @staticmethod
    def whole(rank: int) -> "Degrees":
        return Degrees(tuple(1 for _ in range(rank)))

    @staticmethod
    def of(spread: Spread, sizes: Mapping[str, int] | None = None) -> "Degrees":
        """A symbolic spread's degrees at `sizes` (its symbols' values; none needed when it is concrete)."""
        env = dict(sizes or {})
        return Degrees(tuple(int(d.evaluate(env)) for d in spread.shard), int(spread.copy.evaluate(env)),
                       int(spread.sum.evaluate(env)))

    @staticmethod
    def of_placement(placement: Placement, mesh: Mesh, rank: int) -> "Degrees":
        shard, copy, total = placement.degrees(mesh.shape, rank)
        return Degrees(shard, copy, total)

    @property
    def pieces(self) -> int:
        return prod(self.shard) * self.copy * self.sum

    @property
    def is_whole(self) -> bool:
        return self.pieces == 1

    def piece_elements(self, shape: tuple[int, ...]) -> int:
        """Elements of one local piece."""
        return prod(shape) // prod(self.shard) if shape else 1

    def to_spread(self) -> Spread:
        return Spread(tuple(Poly.const(d) for d in self.shard), Poly.const(self.copy), Poly.const(self.sum))

    def to_dict(self) -> dict:
        return {"shard": list(self.shard), "copy": self.copy, "sum": self.sum}

    @staticmethod
    def from_dict(data: dict) -> "Degrees":
        return Degrees(tuple(int(d) for d in data["shard"]), int(data.get("copy", 1)), int(data.get("sum", 1)))

    def __str__(self) -> str:
        if self.is_whole:
            return "whole"
        parts = []
        if any(d != 1 for d in self.shard):
            parts.append("shard[" + ",".join(str(d) for d in self.shard) + "]")
        if self.copy != 1:
            parts.append(f"copy {self.copy}")
        if self.sum != 1:
            parts.append(f"sum {self.sum}")
        return " ".join(parts)


@dataclass(frozen=True)
class PNode:
    """One PCG node. `inputs` are ids of earlier nodes; `origin` names the graph node it computes, if any."""

    id: int
    kind: str  # "leaf" | "op" | "parallel"
    op: str    # operator name, parallel operator name, or the leaf's name
    inputs: tuple[int, ...]
    attrs: tuple[tuple[str, int | float | str], ...]
    shape: tuple[int, ...]
    degrees: Degrees
    role: str = ""     # leaves: "input" | "weight"
    origin: str = ""
    placement: Placement = Placement(())   # one entry per mesh axis (empty only for a 1-device PCG)

    def attr(self, key: str):
        return dict(self.attrs)[key]

    def axis(self, mesh: Mesh) -> int:
        """The mesh axis a parallel node acts on."""
        return mesh.index(str(self.attr("axis")))

    @property
    def label(self) -> str:
        if self.kind == "leaf":
            return self.op
        attrs = ", ".join(f"{k}={v}" for k, v in self.attrs)
        return f"{self.op}({attrs})" if attrs else self.op


@dataclass(frozen=True)
class PCG:
    """Nodes in topological order (inputs before users), the output ids, and the mesh they run on."""

    nodes: tuple[PNode, ...]
    outputs: tuple[int, ...]
    output_names: tuple[str, ...] = ()
    mesh: Mesh = Mesh(())

    def __iter__(self) -> Iterator[PNode]:
        return iter(self.nodes)

    def node(self, ident: int) -> PNode:
        return self._by_id()[ident]

    def _by_id(self) -> dict[int, PNode]:
        return {n.id: n for n in self.nodes}

    @property
    def max_pieces(self) -> int:
        return max((n.degrees.pieces for n in self.nodes), default=1)


WEIGHT_ROLES = ("weight", "weight-piece")


def weight_chains(pcg: PCG) -> set[int]:
    """The weight leaves and the values made from them by parallel operators only (`pcg_roles`): what a step
    of several micro-batches makes once and reduces the gradient of once (`ir.costs.NodeCost.per_step`)."""
    return {ident for ident, role in pcg_roles(pcg).items() if role in WEIGHT_ROLES}


def pcg_roles(pcg: PCG) -> dict[int, str]:
    """Node id -> role, as `extract.leaf_roles` gives e-classes: leaves by their role, values made from them by
    parallel operators only as "input" or "weight-piece"."""
    roles: dict[int, str] = {}
    for node in pcg.nodes:
        if node.kind == "leaf":
            roles[node.id] = node.role or "input"
        elif node.kind == "parallel" and node.inputs[0] in roles:
            roles[node.id] = "input" if roles[node.inputs[0]] == "input" else "weight-piece"
    return roles
