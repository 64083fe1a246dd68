"""Data parallelism, by its textbook definition: the PCG every baseline table starts from.

Every graph input split along dim 0 over all devices (one mesh axis, `dp`),
every weight replicated, outputs gathered; a partial sum (a statistic over
the split batch: batch norm's mean and variance) all-reduced where an
operator needs it whole, which is synchronized batch normalization, the
data parallelism torch's SyncBatchNorm runs; and a value computed from the
weights alone that meets the batch along its dim 0 (ViT's class token,
broadcast over the batch and concatenated with the patches) computed whole
on every device and split with the batch, as each rank would slice it. It
is built from the graph alone, not found by the rules, so the optimizer can
price it as a baseline (`parsat/search/baselines.py`) and the backend can run it
for a plan that names it (`parsat/backend/cli.py`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from parsat.dsl.instantiate import InstantiationError
from parsat.dsl.library import Library
from parsat.dsl.parallel_ops import ALL_GATHER, COMBINE, PARTITION, REDUCE, REPLICATE
from parsat.ir.graph import Graph, instance_for
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import PCG, Degrees, PNode
from parsat.ir.placement import (FREE, PARTIAL, REPLICA, Placement, PlacementError, apply_parallel,
                                 compute_placement, shard)

DP_AXIS = "dp"


def data_parallel_pcg(graph: Graph, library: Library, devices: int, devices_per_node: int = 1,
                      zero3: bool = False) -> PCG | None:
    """Data parallelism: every input split along dim 0, every weight replicated, outputs gathered.

    An input whose dim 0 does not split evenly (a constant of batch size 1,
    a scalar such as cross-entropy's inverse count) is replicated instead.
    With `zero3`, ZeRO-3 (FSDP's full sharding): each weight is stored split
    along its first dim the devices divide and all-gathered where it is
    used (its gradient reduce-scattered back); a weight with no such dim
    stays replicated.

    Built directly (the textbook definition, independent of the rules) and
    checked operator by operator with the placement analysis; None when an
    operator does not accept it.
    """
    if devices < 2:
        return None
    mesh = Mesh.of((devices,), devices_per_node, names=(DP_AXIS,))
    nodes: list[PNode] = []
    ident: dict[str, int] = {}
    whole: dict[str, int | None] = {}  # graph name -> its value whole on every device, for weight-only values

    def add(kind, op, inputs, attrs, shape, placement: Placement, role="", origin="") -> int:
        degrees = Degrees.of_placement(placement, mesh, len(shape))
        nodes.append(PNode(len(nodes), kind, op, tuple(inputs), tuple(attrs), tuple(shape), degrees, role, origin,
                           placement))
        return len(nodes) - 1

    def parallel(op: str, source: int, dim: int | None = None, degree: int = devices, origin: str = "") -> int:
        node = nodes[source]
        attrs = ((("dim", dim),) if dim is not None else ()) + (("axis", DP_AXIS), ("degree", degree))
        return add("parallel", op, (source,), attrs, node.shape, apply_parallel(node.placement, op, 0, dim),
                   origin=origin)

    def whole_of(name: str) -> int | None:
        """The node computing `name` whole (every device the same), if it depends on weights only."""
        if name in whole:
            return whole[name]
        gnode = graph_nodes.get(name)
        found = None
        if gnode is not None:
            parts = [whole_of(i) for i in gnode.inputs]
            if None not in parts:
                found = add("op", gnode.op, parts, gnode.attrs, gnode.shape, Placement.whole(1))
        whole[name] = found
        return found

    def all_reduced(inputs: list[PNode]) -> list[PNode]:
        """Synchronize: all-reduce the partial inputs; the reduced value is the graph node's (its origin)."""
        reduced: dict[int, int] = {}
        for n in inputs:
            if n.placement.codes[0] == PARTIAL and n.id not in reduced:
                nodes[n.id] = replace(n, origin="")
                total = parallel(REDUCE, n.id, origin=n.origin)
                reduced[n.id] = parallel(REPLICATE, total)
                ident[n.origin] = reduced[n.id]
        return [nodes[reduced.get(n.id, n.id)] for n in inputs]

    def split_with_batch(names: Sequence[str], inputs: list[PNode]) -> list[PNode]:
        """Copies of a weight-only value beside batch-split operands: split it with the batch instead."""
        split = []
        for name, n in zip(names, inputs):
            source = whole_of(name) if n.placement.codes[0] == REPLICA else None
            if source is not None and n.shape and n.shape[0] % devices == 0:
                n = nodes[parallel(PARTITION, source, 0)]
            split.append(n)
        return split

    graph_nodes = {n.name: n for n in graph.nodes}
    for leaf in graph.leaves:
        base = add("leaf", leaf.name, (), (), leaf.shape, Placement.whole(1), leaf.role, leaf.name)
        whole[leaf.name] = base if leaf.role == "weight" else None
        stored = next((d for d, size in enumerate(leaf.shape) if size % devices == 0), None)
        if leaf.role == "input" and leaf.shape and leaf.shape[0] % devices == 0:
            ident[leaf.name] = parallel(PARTITION, base, 0)
        elif leaf.role == "weight" and zero3 and stored is not None:
            ident[leaf.name] = parallel(ALL_GATHER, parallel(PARTITION, base, stored), stored)
        else:
            ident[leaf.name] = parallel(REPLICATE, base)
    cache: dict = {}
    for gnode in graph.nodes:
        op = library.ops[gnode.op]
        inputs = [nodes[ident[i]] for i in gnode.inputs]
        try:
            instance = instance_for(op, [n.shape for n in inputs], dict(gnode.attrs))
        except InstantiationError:
            return None
        placement = None
        for repair in (lambda ins: ins, all_reduced, lambda ins: split_with_batch(gnode.inputs, ins)):
            inputs = repair(inputs)
            try:
                placement = compute_placement(instance, [n.placement for n in inputs], cache)
                break
            except PlacementError:
                continue
        if placement is None:
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
    return _live(nodes, outputs, tuple(graph.outputs), mesh)


def _live(nodes: Sequence[PNode], outputs: Sequence[int], names: tuple[str, ...], mesh: Mesh) -> PCG:
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
    return PCG(kept, tuple(new[o] for o in outputs), names, mesh)
