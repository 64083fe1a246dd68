"""Where every node of a PCG puts its pieces: the plan laid out on ranks (`ir.placement`).

The e-graph compares spreads (degrees); the backend places pieces on mesh
atoms, and a compute operator runs only when its inputs' pieces line up on
the same ranks. The two views agree because a rule applies only at degrees
where it keeps the layout (`saturate.guards.layout_guard`). `lay_out` is the
check that they did: `optimize` runs it on every plan it returns, and
`parsat run` before it starts a rank, so a plan that cannot run is refused
with the node that cannot be placed, not found out by every rank at once.
"""

from __future__ import annotations

from typing import Mapping

from parsat.dsl import ast
from parsat.ir.graph import instance_for
from parsat.ir.pcg import PCG
from parsat.ir.placement import Placement, PlacementError, compute_layout


def lay_out(pcg: PCG, ops: Mapping[str, ast.OpDecl], world: int) -> dict[int, Placement]:
    """Every node's layout on `world` ranks; PlacementError naming the first node that cannot be placed or
    whose layout is not the spread the plan states."""
    shapes = {node.id: node.shape for node in pcg}
    layouts: dict[int, Placement] = {}
    for node in pcg:
        try:
            if node.kind == "leaf":
                layout = Placement.whole(len(node.shape), world)
            elif node.kind == "parallel":
                dim = dict(node.attrs).get("dim")
                layout, _atoms = layouts[node.inputs[0]].apply_parallel(
                    node.op, int(node.attr("degree")), None if dim is None else int(dim))
            else:
                instance = instance_for(ops[node.op], [shapes[i] for i in node.inputs], dict(node.attrs))
                layout = compute_layout(instance, [layouts[i] for i in node.inputs])
        except PlacementError as err:
            raise PlacementError(f"at node #{node.id}, {err}") from None
        shard, copy, total = layout.degrees
        stated = node.degrees
        if (shard, copy, total) != (tuple(stated.shard), stated.copy, stated.sum):
            raise PlacementError(f"at node #{node.id}, {node.label}: the plan states spread {stated}, but it lays out "
                                 f"as shard {list(shard)}, copy {copy}, sum {total}")
        layouts[node.id] = layout
    return layouts
