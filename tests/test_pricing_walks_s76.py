"""A PCG's readers and a restaged form's pricing, walked cheaper (issue 28, session 76, helper C):
`ir.pcg.PCG.readers_of` grows each value's readers as a tuple (longer ones listed apart and joined), and
`search.solve.restaged_node_costs` walks the parallel nodes alone (`_parallel_positions`, kept per structure)
rather than every node through a callback. Each must give exactly what the computation it replaces gives: the
references below are those computations, as written before (main e2a9a68)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.cost.model import shards_state
from parsat.ir import pcg as pcg_module
from parsat.ir.pcg import PCG, PNode, pcg_roles, readers, restated
from parsat.search import solve
from parsat.search.solve import pcg_node_costs, restaged_node_costs
from test_pcg_pricing_by_key import H100, _fresh, layouts, library  # noqa: F401 (a sibling test module's fixtures)



def _readers_as_written(pcg: PCG) -> dict[int, tuple[PNode, ...]]:
    """`PCG.readers_of` as written before: a list per value, each reader appended, then each made a tuple."""
    users: dict[int, list[PNode]] = {}
    for node in pcg.nodes:
        for i in node.inputs:
            users.setdefault(i, []).append(node)
    return {ident: tuple(found) for ident, found in users.items()}


def _fan_out(readers_count: int) -> PCG:
    """A PCG whose one leaf is read by `readers_count` nodes, one of them twice (a node once per operand)."""
    shape, spread = (4,), pcg_module.Degrees((1,))
    leaf = PNode(0, "leaf", "x", (), (), shape, spread, role="input")
    other = PNode(1, "leaf", "y", (), (), shape, spread, role="input")
    nodes = [leaf, other]
    for k in range(readers_count):
        inputs = (0, 0) if k == 3 else (1, 0) if k % 2 else (0,)
        nodes.append(PNode(2 + k, "op", "relu" if len(inputs) == 1 else "add", inputs, (), shape, spread))
    return PCG(tuple(nodes), (nodes[-1].id,))


@pytest.mark.parametrize("count", [1, 2, pcg_module.READERS_GROWN, pcg_module.READERS_GROWN + 1, 100])
def test_readers_are_the_list_built_readers(count):
    """Below, at and past the length a value's tuple is grown to: the same readers, in order, once per operand,
    the ids in the order of their first reader."""
    pcg = _fan_out(count)
    want = _readers_as_written(pcg)
    assert list(pcg.readers_of.items()) == list(want.items())
    assert {i: list(r) for i, r in want.items()} == readers(_fresh(pcg))


def test_readers_past_the_grown_length_are_joined_in_order(monkeypatch):
    """With tuples grown to one reader only, every further reader goes through the joined list: the same."""
    monkeypatch.setattr(pcg_module, "READERS_GROWN", 1)
    for count in (2, 5, 40):
        pcg = _fan_out(count)
        assert list(pcg.readers_of.items()) == list(_readers_as_written(pcg).items())


def test_layouts_readers(layouts):
    """Every layout's readers, as the list-built ones, ids in the same order; `readers` hands out lists."""
    for _graph, pcg in layouts:
        want = _readers_as_written(pcg)
        assert list(_fresh(pcg).readers_of.items()) == list(want.items())
        mine = readers(pcg)
        assert all(isinstance(found, list) for found in mine.values())
        mine[next(iter(mine))].append(None)   # the caller's to change: the shared table stays
        assert list(pcg.readers_of.items()) == list(want.items())


def _restaged_as_written(raw, pcg: PCG, zero: int, library, machine, microbatches: int):
    """`restaged_node_costs` as written before: every node of the form offered to `pcg_node_costs` through a test."""
    roles = pcg_roles(pcg)

    def resharded(node: PNode) -> bool:
        role = roles.get(node.inputs[0], "") if node.kind == "parallel" else ""
        return node.kind == "parallel" and any(shards_state(node.op, role, z) for z in (pcg.zero, zero))

    again = pcg_node_costs(replace(pcg, zero=zero), library, machine, True, microbatches, None, resharded)
    return None if again is None else {**raw, **again}


def test_restaged_walks_the_parallel_nodes_as_every_node_through_a_test(library, layouts):
    """Each layout restaged between ZeRO stages 0, 1 and 2: the same costs, node for node, in the same order, and
    the same cost objects as the form priced with nothing shared; the positions are every parallel node's."""
    for graph, pcg in layouts:
        mb = graph.microbatches
        for start, zero in ((0, 1), (0, 2), (1, 2), (2, 0)):
            first = _fresh(pcg, zero=start)
            raw = pcg_node_costs(first, library, H100, True, mb)
            got = restaged_node_costs(raw, first, zero, library, H100, True, mb,
                                      form=restated(first, zero, first.recompute))
            want = _restaged_as_written(raw, _fresh(pcg, zero=start), zero, library, H100, mb)
            assert list(got.items()) == list(want.items())
            assert got == pcg_node_costs(_fresh(pcg, zero=zero), library, H100, True, mb)
        assert solve._parallel_positions(pcg) == tuple(at for at, n in enumerate(pcg.nodes) if n.kind == "parallel")


def test_only_prices_the_nodes_it_accepts_in_order(library, layouts):
    """`only` (the step's floor prices leaves and compute nodes): the nodes it accepts, in the nodes' order,
    each cost the whole pricing's for that node."""
    for graph, pcg in layouts:
        whole = pcg_node_costs(_fresh(pcg), library, H100, True, graph.microbatches)
        part = pcg_node_costs(_fresh(pcg), library, H100, True, graph.microbatches,
                              only=lambda node: node.kind != "parallel")
        assert list(part) == [n.id for n in pcg.nodes if n.kind != "parallel"]
        assert all(part[i] == whole[i] for i in part)
