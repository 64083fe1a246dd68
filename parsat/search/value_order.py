"""The order of an e-graph's values: the ILP's acyclic sub-e-graph reads it (`extract._ilp_columns`).

A value is the set of classes parallel e-nodes join (one tensor in its
placements); compute e-nodes read values computed before their own. Algebra
can make two values from each other (a transpose of a transpose): such a
cycle of values is one strongly connected component, one position.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.egraph.snapshot import Snapshot


def value_order(snapshot: Snapshot) -> Mapping[int, int]:
    """E-class -> the position of its value in an order where a value comes after every value it is computed from:
    the ILP (`extract._ilp_columns`) may re-make a class of its warm start from classes of earlier values whatever
    order the bottom-up pass finalised them in, and falls back on that order only among the placements of one
    value (parallel e-nodes join them: a partition and a combine make a cycle) and values that algebra makes
    from each other (a cycle of values, one strongly connected component, one position).

    Before, the order was the bottom-up pass's alone: a class finalised before another of a later value could
    not read it, whatever it cost. llama-70b's pinned dp 16 x tp 4 plan kept its keys and values row-parallel on
    a norm computed whole on every tensor rank, where reading the all-gathered sequence-parallel norm the query
    already reads was cheaper: its class came later in the warm start's order (benchmarks/search_results.md,
    2026-12-04 helper M). Worked out once per snapshot (`Snapshot.derive`). Shared: read it, never change it."""
    return snapshot.derive("value_order", lambda: _value_order(snapshot))


def values(snapshot: Snapshot) -> dict[int, int]:
    """E-class -> its value: the least class id of the classes parallel e-nodes join to it (union-find), one tensor
    in its placements (the module docstring; `benchmarks/egraph_growth.py` counts placements per value by it)."""
    parent = {cid: cid for cid in snapshot.classes}

    def find(cid: int) -> int:
        while parent[cid] != cid:
            parent[cid] = parent[parent[cid]]
            cid = parent[cid]
        return cid

    for cid, nodes in snapshot.classes.items():
        for node in nodes:
            if node.op in PARALLEL_OPS and node.children and node.children[0] in parent:
                a, b = find(cid), find(node.children[0])
                if a != b:
                    parent[max(a, b)] = min(a, b)
    return {cid: find(cid) for cid in snapshot.classes}


def _value_order(snapshot: Snapshot) -> dict[int, int]:
    """`value_order`, worked out: values (`values`), the edges from the values compute e-nodes read to their own,
    strongly connected components (Tarjan's, iterative) in topological order."""
    value = values(snapshot)
    after: dict[int, set[int]] = {v: set() for v in set(value.values())}   # value -> values computed from it
    for cid, nodes in snapshot.classes.items():
        for node in nodes:
            if node.op not in PARALLEL_OPS:
                for child in node.children:
                    if child in value and value[child] != value[cid]:
                        after[value[child]].add(value[cid])
    position = _topological_components({v: sorted(ws) for v, ws in after.items()})
    return {cid: position[v] for cid, v in value.items()}


def _topological_components(after: Mapping[int, Sequence[int]]) -> dict[int, int]:
    """Node -> the position of its strongly connected component in a topological order of the components (a node
    comes after every node with an edge to it, unless they share a component): Tarjan's algorithm, iterative."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    components: list[list[int]] = []
    for start in sorted(after):
        if start in index:
            continue
        work = [(start, iter(after[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(after[nxt])))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
    # Tarjan's finishes a component after every component it reaches: reversed, sources come first
    return {member: position for position, component in enumerate(reversed(components)) for member in component}
