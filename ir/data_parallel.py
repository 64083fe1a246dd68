"""Data parallelism, by its textbook definition: the PCG every baseline table starts from.

Every graph input split along dim 0 over all devices, every weight
replicated, outputs gathered; a partial sum (a statistic over the split
batch: batch norm's mean and variance) all-reduced where an operator
needs it whole, which is synchronized batch normalization, the data
parallelism torch's SyncBatchNorm runs. It is built from the graph alone, not found
by the rules, so the optimizer can price it as a baseline
(`saturate/baselines.py`) and the backend can rebuild it for a plan file
that predates baselines carrying their PCGs (`backend/cli.py`).
"""

from __future__ import annotations

from parsat.dsl.instantiate import InstantiationError
from parsat.dsl.library import Library
from parsat.dsl.parallel_ops import COMBINE, PARTITION, REDUCE, REPLICATE
from parsat.dsl.spread import infer_compute
from parsat.ir.graph import Graph, instance_for
from parsat.ir.pcg import PCG, Degrees, PNode

from dataclasses import replace


def data_parallel_pcg(graph: Graph, library: Library, devices: int) -> PCG | None:
    """Data parallelism: every input split along dim 0, every weight replicated, outputs gathered.

    An input whose dim 0 does not split evenly (a constant of batch size 1,
    a scalar such as cross-entropy's inverse count) is replicated instead.

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
        if leaf.role == "input" and leaf.shape and leaf.shape[0] % devices == 0:
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
        if inferred.problems and any(n.degrees.sum != 1 for n in inputs):
            # Synchronize: all-reduce the partial inputs; the reduced value is the graph node's (its origin).
            reduced = {}
            for n in inputs:
                if n.degrees.sum != 1 and n.id not in reduced:
                    whole = Degrees(n.degrees.shard, n.degrees.copy)
                    nodes[n.id] = replace(n, origin="")
                    total = add("parallel", REDUCE, (n.id,), (("degree", n.degrees.sum),), n.shape, whole,
                                origin=n.origin)
                    copies = devices // whole.pieces  # as many pieces as every other tensor of the plan
                    reduced[n.id] = total if copies == 1 else add(
                        "parallel", REPLICATE, (total,), (("degree", copies),), n.shape,
                        Degrees(whole.shard, whole.copy * copies))
                    ident[n.origin] = reduced[n.id]
            inputs = [nodes[reduced.get(n.id, n.id)] for n in inputs]
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
        elif node.degrees.sum == devices and all(d == 1 for d in node.degrees.shard):  # a loss summed over rows
            outputs.append(add("parallel", REDUCE, (node.id,), (("degree", devices),), node.shape,
                               Degrees(node.degrees.shard)))
        elif node.degrees.sum != 1:
            return None
        elif all(d == 1 for d in node.degrees.shard):
            outputs.append(node.id)
        elif node.degrees.shard and node.degrees.shard[0] == devices and node.degrees.pieces == devices:
            outputs.append(add("parallel", COMBINE, (node.id,), (("dim", 0), ("degree", devices)), node.shape,
                               Degrees.whole(len(node.shape))))
        else:
            return None
    return PCG(tuple(nodes), tuple(outputs), tuple(graph.outputs))
