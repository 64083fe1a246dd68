"""Data parallelism, by its textbook definition: the PCG every baseline table starts from.

Every graph input split along dim 0 over all devices, every weight
replicated, outputs gathered. It is built from the graph alone, not found
by the rules, so the optimizer can price it as a baseline
(`saturate/baselines.py`) and the backend can rebuild it for a plan file
that predates baselines carrying their PCGs (`backend/cli.py`).
"""

from __future__ import annotations

from parsat.dsl.instantiate import InstantiationError
from parsat.dsl.library import Library
from parsat.dsl.parallel_ops import COMBINE, PARTITION, REPLICATE
from parsat.dsl.spread import infer_compute
from parsat.ir.graph import Graph, instance_for
from parsat.ir.pcg import PCG, Degrees, PNode


def data_parallel_pcg(graph: Graph, library: Library, devices: int) -> PCG | None:
    """Data parallelism: every input split along dim 0, every weight replicated, outputs gathered.

    Built directly (the textbook definition, independent of the rules) and
    checked operator by operator with spread inference; None when an
    operator does not accept it or a batch does not split evenly.
    """
    if devices < 2:
        return None
    nodes: list[PNode] = []
    ident: dict[str, int] = {}

    def add(kind, op, inputs, attrs, shape, degrees, role="", origin="") -> int:
        nodes.append(PNode(len(nodes), kind, op, tuple(inputs), tuple(attrs), tuple(shape), degrees, role, origin))
        return len(nodes) - 1

    for leaf in graph.leaves:
        base = add("leaf", leaf.name, (), (), leaf.shape, Degrees.whole(len(leaf.shape)), leaf.role, leaf.name)
        if leaf.role == "input":
            if not leaf.shape or leaf.shape[0] % devices:
                return None
            shard = (devices,) + (1,) * (len(leaf.shape) - 1)
            ident[leaf.name] = add("parallel", PARTITION, (base,), (("dim", 0), ("degree", devices)), leaf.shape,
                                   Degrees(shard))
        else:
            ident[leaf.name] = add("parallel", REPLICATE, (base,), (("degree", devices),), leaf.shape,
                                   Degrees(Degrees.whole(len(leaf.shape)).shard, devices))
    for gnode in graph.nodes:
        op = library.ops[gnode.op]
        inputs = [nodes[ident[i]] for i in gnode.inputs]
        try:
            instance = instance_for(op, [n.shape for n in inputs], dict(gnode.attrs))
        except InstantiationError:
            return None
        inferred = infer_compute(instance, [n.degrees.to_spread() for n in inputs])
        if inferred.problems:
            return None
        degrees = Degrees.of(inferred.spread)
        ident[gnode.name] = add("op", gnode.op, [n.id for n in inputs], gnode.attrs, gnode.shape, degrees,
                                origin=gnode.name)
    outputs = []
    for name in graph.outputs:
        node = nodes[ident[name]]
        if node.degrees.is_whole:
            outputs.append(node.id)
        elif node.degrees.shard and node.degrees.shard[0] == devices and node.degrees.pieces == devices:
            outputs.append(add("parallel", COMBINE, (node.id,), (("dim", 0), ("degree", devices)), node.shape,
                               Degrees.whole(len(node.shape))))
        else:
            return None
    return PCG(tuple(nodes), tuple(outputs), tuple(graph.outputs))
