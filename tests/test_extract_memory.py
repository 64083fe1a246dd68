"""Extraction where the fastest trees hold too much: the least-memory tree is considered (`search.extract`)."""

import pytest

from parsat.egraph.runner import Limits
from parsat.egraph.snapshot import ENode, Snapshot
from parsat.ir.costs import NodeCost
from parsat.search.extract import ExtractionError, extract


def _graph() -> tuple[Snapshot, dict]:
    """Class 0 a leaf; class 1 computed fast holding 100 bytes or slowly holding 10; class 2, the root, reads 1."""
    classes = {0: (ENode("leaf", (), ("x",)),),
               1: (ENode("fast", (0,), ()), ENode("small", (0,), ())),
               2: (ENode("out", (1,), ()),)}
    snapshot = Snapshot(classes, {c: (4,) for c in classes}, {}, {})
    costs = {(0, 0): NodeCost(), (1, 0): NodeCost(forward_s=1.0, memory_bytes=100),
             (1, 1): NodeCost(forward_s=2.0, memory_bytes=10), (2, 0): NodeCost(forward_s=1.0)}
    return snapshot, costs


def test_greedy_extraction_finds_the_plan_that_fits_when_the_fastest_does_not():
    snapshot, costs = _graph()
    found = extract(snapshot, costs, [2], 50.0, Limits(ilp_seconds=0))   # the greedy passes only
    assert found.choice[1] == 1 and found.memory_bytes == 10 and found.method == "least_memory"


def test_the_fastest_plan_that_fits_is_kept_and_none_fitting_still_says_what_the_smallest_needs():
    snapshot, costs = _graph()
    assert extract(snapshot, costs, [2], 500.0, Limits(ilp_seconds=0)).choice[1] == 0
    with pytest.raises(ExtractionError) as err:
        extract(snapshot, costs, [2], 5.0, Limits(ilp_seconds=0))
    assert err.value.needed_bytes == 10
