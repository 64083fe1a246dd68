"""Where every node of a PCG puts its pieces, recomputed from the plan's structure (`ir.placement`).

A PCG states every node's placement; `derive_placements` derives them again from the
leaves (not spread), each parallel operator (on its mesh axis) and each
compute operator (axis by axis, by its index semantics), and refuses the
plan at the first node whose stated placement or degrees differ or that
cannot be placed at all. `optimize` runs it on every plan it returns and
`parsat run` before any rank starts, so a plan the backend would run
differently from what the optimizer costed is refused with the node, not
found out by every rank at once.
"""

from __future__ import annotations

from typing import Mapping

from parsat.dsl import ast
from parsat.dsl.instantiate import InstantiationError
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.ir.graph import instance_for
from parsat.ir.mesh import MeshError
from parsat.ir.pcg import PCG, Degrees
from parsat.ir.placement import Placement, PlacementError, apply_parallel, compute_placement


def derive_placements(pcg: PCG, ops: Mapping[str, ast.OpDecl]) -> dict[int, Placement]:
    """Every node's placement on the PCG's mesh; PlacementError naming the first node that cannot be placed or
    whose stated placement (or degrees) is not the one it lays out as."""
    mesh = pcg.mesh
    shapes = {node.id: node.shape for node in pcg}
    placements: dict[int, Placement] = {}
    cache: dict = {}
    instances: dict = {}
    for node in pcg:
        try:
            if node.kind == "leaf" or not node.inputs:   # a constant made from sizes (`causal_mask`) is whole too
                placement = Placement.whole(len(mesh))
            elif node.kind == "parallel":
                if node.op not in PARALLEL_OPS:
                    raise PlacementError(f"'{node.op}' is not a parallel operator")
                axis = node.axis(mesh)
                if int(node.attr("degree")) != mesh.size(axis):
                    raise PlacementError(f"{node.label}: degree {node.attr('degree')} is not the size "
                                         f"{mesh.size(axis)} of mesh axis '{mesh.axes[axis].name}'")
                dims = {k: int(v) for k, v in node.attrs if k in ("dim", "to_dim")}
                placement = apply_parallel(placements[node.inputs[0]], node.op, axis, dims.get("dim"),
                                           dims.get("to_dim"))
            else:
                instance = instance_for(ops[node.op], [shapes[i] for i in node.inputs], dict(node.attrs), instances)
                placement = compute_placement(instance, [placements[i] for i in node.inputs], cache)
            placement.local_shape(node.shape, mesh.shape)
        except PlacementError as err:
            raise PlacementError(f"at node #{node.id}, {node.label}: {err}") from None
        except (KeyError, ValueError, MeshError, InstantiationError) as err:  # unknown axis, missing attribute
            raise PlacementError(f"at node #{node.id}, {node.label}: {err}") from None
        if node.placement != placement:
            raise PlacementError(f"at node #{node.id}, {node.label}: the plan states placement {node.placement}, "
                                 f"but it lays out as {placement}")
        degrees = Degrees.of_placement(placement, mesh, len(node.shape))
        if node.degrees != degrees:
            raise PlacementError(f"at node #{node.id}, {node.label}: the plan states spread {node.degrees}, but "
                                 f"its placement {placement} amounts to {degrees}")
        placements[node.id] = placement
    return placements
