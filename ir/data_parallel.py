"""Data parallelism, by its textbook definition: the PCG every baseline table starts from.

Every graph input split along dim 0 over all devices, every weight
replicated, outputs gathered; a partial sum (a statistic over the split
batch: batch norm's mean and variance) all-reduced where an operator
needs it whole, which is synchronized batch normalization, the data
parallelism torch's SyncBatchNorm runs; and a value computed from the
weights alone that meets the batch along its dim 0 (ViT's class token,
broadcast over the batch and concatenated with the patches) computed whole
on every device and split with the batch, as each rank would slice it. It is built from the graph alone, not found
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
from typing import Sequence


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
    whole: dict[str, int | None] = {}  # graph name -> its value whole on every device, for weight-only values

    def add(kind, op, inputs, attrs, shape, degrees, role="", origin="") -> int:
        nodes.append(PNode(len(nodes), kind, op, tuple(inputs), tuple(attrs), tuple(shape), degrees, role, origin))
        return len(nodes) - 1

    def whole_of(name: str) -> int | None:
        """The node computing `name` whole (every device the same), if it depends on weights only."""
        if name in whole:
            return whole[name]
        gnode = graph_nodes.get(name)
        found = None
        if gnode is not None:
            parts = [whole_of(i) for i in gnode.inputs]
            if None not in parts:
                found = add("op", gnode.op, parts, gnode.attrs, gnode.shape, Degrees.whole(len(gnode.shape)))
        whole[name] = found
        return found

    graph_nodes = {n.name: n for n in graph.nodes}
    for leaf in graph.leaves:
        base = add("leaf", leaf.name, (), (), leaf.shape, Degrees.whole(len(leaf.shape)), leaf.role, leaf.name)
        whole[leaf.name] = base if leaf.role == "weight" else None
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
        if inferred.problems and any(n.degrees.shard and n.degrees.shard[0] == devices for n in inputs):
            # Copies of a weight-only value beside batch-split operands: split it with the batch instead.
            split = []
            for name, n in zip(gnode.inputs, inputs):
                source = whole_of(name) if n.degrees.copy == devices else None
                if source is not None and n.shape and n.shape[0] % devices == 0:
                    shard = (devices,) + (1,) * (len(n.shape) - 1)
                    n = nodes[add("parallel", PARTITION, (source,), (("dim", 0), ("degree", devices)), n.shape,
                                  Degrees(shard))]
                split.append(n)
            inferred = infer_compute(instance, [n.degrees.to_spread() for n in split])
            inputs = split
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
    return _live(nodes, outputs, tuple(graph.outputs))


def _live(nodes: Sequence[PNode], outputs: Sequence[int], names: tuple[str, ...]) -> PCG:
    """The PCG of the nodes the outputs depend on, renumbered in order (a copy never used is not kept: its
    gradient all-reduce would be paid for nothing)."""
    needed, stack = set(), list(outputs)
    while stack:
        i = stack.pop()
        if i not in needed:
            needed.add(i)
            stack.extend(nodes[i].inputs)
    new = {old: k for k, old in enumerate(sorted(needed))}
    kept = tuple(replace(nodes[old], id=new[old], inputs=tuple(new[i] for i in nodes[old].inputs))
                 for old in sorted(needed))
    return PCG(kept, tuple(new[o] for o in outputs), names)
