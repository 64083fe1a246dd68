"""`ir.pcg_placement.derive_placements` works a node's placement out once per alike node (kind, operator,
attributes, shape, inputs' shapes and placements): the placements are every node's as worked out alone, and a
node stated otherwise than its alike predecessors is still refused, by its own id."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.dsl.library import load_library
from parsat.ir.data_parallel import data_parallel_pcg
from parsat.ir.models import build_example
from parsat.ir.pcg_placement import _laid_out, derive_placements
from parsat.ir.placement import Placement, PlacementError

SIZES = {"blocks": 3, "batch": 8, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}


@pytest.fixture(scope="module")
def case():
    library = load_library()[0]
    graph = build_example("gpt", SIZES, library)
    pcg = data_parallel_pcg(graph, library, 4, zero3=True)
    assert pcg is not None
    return pcg, library.ops


def test_every_node_placed_as_worked_out_alone(case):
    pcg, ops = case
    placements = derive_placements(pcg, ops)
    shapes = {node.id: node.shape for node in pcg}
    alone = {}
    for node in pcg:   # each node from fresh caches, its inputs' placements as derived
        inputs = tuple(alone[i] for i in node.inputs)
        alone[node.id] = _laid_out(node, inputs, tuple(shapes[i] for i in node.inputs), pcg.mesh, ops, {}, {})[0]
    assert placements == alone
    assert len(set(map(str, placements.values()))) > 2   # not every node whole: the check has work to do


def test_a_repeated_node_stated_otherwise_is_refused_by_its_own_id(case):
    pcg, ops = case
    by_key: dict = {}
    for node in pcg:   # the last node of a kind met before (a later block's copy of an earlier block's node)
        if node.kind == "op":
            by_key.setdefault((node.op, node.attrs, node.shape), []).append(node)
    repeated = next(nodes[-1] for nodes in by_key.values() if len(nodes) > 1)
    whole = Placement.whole(len(pcg.mesh))
    wrong = whole if repeated.placement != whole else Placement((3,) * len(pcg.mesh))
    bad = replace(pcg, nodes=tuple(replace(n, placement=wrong) if n.id == repeated.id else n for n in pcg.nodes))
    with pytest.raises(PlacementError, match=f"at node #{repeated.id},"):
        derive_placements(bad, ops)
