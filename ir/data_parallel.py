"""Data parallelism, by its textbook definition: the PCG every baseline table starts from.

Every graph input split along dim 0 over all devices (one mesh axis, `dp`),
every weight replicated, outputs gathered. It is built from the graph alone,
not found by the rules, so the optimizer can price it as a baseline
(`saturate/baselines.py`) and the backend can run it for a plan that
names it (`backend/cli.py`).
"""

from __future__ import annotations

from parsat.dsl.instantiate import InstantiationError
from parsat.dsl.library import Library
from parsat.dsl.parallel_ops import COMBINE, PARTITION, REDUCE, REPLICATE
from parsat.ir.graph import Graph, instance_for
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import PCG, Degrees, PNode
from parsat.ir.placement import FREE, PARTIAL, REPLICA, Placement, PlacementError, apply_parallel, compute_placement, shard

DP_AXIS = "dp"


def data_parallel_pcg(graph: Graph, library: Library, devices: int, devices_per_node: int = 1) -> PCG | None:
    """Data parallelism: every input split along dim 0, every weight replicated, outputs gathered.

    An input whose dim 0 does not split evenly (a constant of batch size 1,
    a scalar such as cross-entropy's inverse count) is replicated instead.

    Built directly (the textbook definition, independent of the rules) and
    checked operator by operator with the placement analysis; None when an
    operator does not accept it.
    """
    if devices < 2:
        return None
    mesh = Mesh.of((devices,), devices_per_node, names=(DP_AXIS,))
    nodes: list[PNode] = []
    ident: dict[str, int] = {}

    def add(kind, op, inputs, attrs, shape, placement: Placement, role="", origin="") -> int:
        degrees = Degrees.of_placement(placement, mesh, len(shape))
        nodes.append(PNode(len(nodes), kind, op, tuple(inputs), tuple(attrs), tuple(shape), degrees, role, origin,
                           placement))
        return len(nodes) - 1

    def parallel(op: str, source: int, dim: int | None = None) -> int:
        node = nodes[source]
        attrs = ((("dim", dim),) if dim is not None else ()) + (("axis", DP_AXIS), ("degree", devices))
        return add("parallel", op, (source,), attrs, node.shape, apply_parallel(node.placement, op, 0, dim))

    whole = Placement.whole(1)
    for leaf in graph.leaves:
        base = add("leaf", leaf.name, (), (), leaf.shape, whole, leaf.role, leaf.name)
        if leaf.role == "input" and leaf.shape and leaf.shape[0] % devices == 0:
            ident[leaf.name] = parallel(PARTITION, base, 0)
        else:
            ident[leaf.name] = parallel(REPLICATE, base)
    cache: dict = {}
    for gnode in graph.nodes:
        op = library.ops[gnode.op]
        inputs = [nodes[ident[i]] for i in gnode.inputs]
        try:
            instance = instance_for(op, [n.shape for n in inputs], dict(gnode.attrs))
            placement = compute_placement(instance, [n.placement for n in inputs], cache)
        except (InstantiationError, PlacementError):
            return None
        ident[gnode.name] = add("op", gnode.op, [n.id for n in inputs], gnode.attrs, gnode.shape, placement,
                                origin=gnode.name)
    outputs = []
    for name in graph.outputs:
        node = nodes[ident[name]]
        code = node.placement.codes[0]
        if code == PARTIAL:                               # a loss summed over rows
            outputs.append(parallel(REDUCE, node.id))
        elif code == shard(0):
            outputs.append(parallel(COMBINE, node.id, 0))
        elif code in (FREE, REPLICA):                     # not split: held by every rank
            outputs.append(node.id)
        else:
            return None
    return PCG(tuple(nodes), tuple(outputs), tuple(graph.outputs), mesh)
