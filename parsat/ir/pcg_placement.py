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
from parsat.ir.mesh import Mesh, MeshError
from parsat.ir.pcg import PCG, Degrees, PNode
from parsat.ir.placement import Placement, PlacementError, apply_parallel, compute_placement


def derive_placements(pcg: PCG, ops: Mapping[str, ast.OpDecl]) -> dict[int, Placement]:
    """Every node's placement on the PCG's mesh; PlacementError naming the first node that cannot be placed or
    whose stated placement (or degrees) is not the one it lays out as.

    A node's placement and spread are worked out once per (kind, operator, attributes, shape, inputs' shapes
    and placements): `_laid_out` reads nothing else of the node but those and the PCG's mesh, so a node alike
    in all of them lays out alike. A whole model's PCG repeats one block's nodes (llama-70b: 80 blocks, ~5,000
    nodes, ~80 distinct, every leaf alike but for its shape), and the search checks every candidate it may return
    (`step._unplaceable`)."""
    mesh = pcg.mesh
    shapes = {node.id: node.shape for node in pcg}
    placements: dict[int, Placement] = {}
    laid: dict[tuple, tuple[Placement, Degrees]] = {}
    cache: dict = {}
    instances: dict = {}
    for node in pcg:
        try:
            if node.kind == "leaf" or not node.inputs:   # whole: its shape is all `_laid_out` reads of it
                inputs, read, key = (), (), (_WHOLE, node.shape)
            else:
                inputs, read = tuple(placements[i] for i in node.inputs), tuple(shapes[i] for i in node.inputs)
                key = (node.kind, node.op, node.attrs, node.shape, inputs, read)
            found = laid.get(key)
            if found is None:
                found = laid[key] = _laid_out(node, inputs, read, mesh, ops, cache, instances)
        except PlacementError as err:
            raise PlacementError(f"at node #{node.id}, {node.label}: {err}") from None
        except (KeyError, ValueError, MeshError, InstantiationError) as err:  # unknown axis, missing attribute
            raise PlacementError(f"at node #{node.id}, {node.label}: {err}") from None
        placement, degrees = found
        if node.placement != placement:
            raise PlacementError(f"at node #{node.id}, {node.label}: the plan states placement {node.placement}, "
                                 f"but it lays out as {placement}")
        if node.degrees != degrees:
            raise PlacementError(f"at node #{node.id}, {node.label}: the plan states spread {node.degrees}, but "
                                 f"its placement {placement} amounts to {degrees}")
        placements[node.id] = placement
    return placements


_WHOLE = "whole"   # `derive_placements`' key of a leaf or constant: laid out whole, whatever its operator


def _laid_out(node: PNode, inputs: tuple[Placement, ...], shapes: tuple, mesh: Mesh, ops: Mapping[str, ast.OpDecl],
              cache: dict, instances: dict) -> tuple[Placement, Degrees]:
    """The placement `node` lays out as from its inputs' placements (`inputs`) and shapes, and the spread it
    amounts to; PlacementError (or the errors `derive_placements` names the node with) where it cannot be placed
    or its pieces do not divide its shape."""
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
        placement = apply_parallel(inputs[0], node.op, axis, dims.get("dim"), dims.get("to_dim"))
    else:
        instance = instance_for(ops[node.op], shapes, dict(node.attrs), instances)
        placement = compute_placement(instance, inputs, cache)
    placement.local_shape(node.shape, mesh.shape)
    return placement, Degrees.of_placement(placement, mesh, len(node.shape))
