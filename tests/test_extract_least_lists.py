"""A cost table's e-node times are kept once per snapshot (`extract.node_times`) and a guide's raised e-nodes written
over a copy of them (`Choosable.of`'s `raised`): the same times as read afresh from the guide, the same choices as
the passes written plainly; and a tie of an equal value and a lesser number pushed after the first entry of its
class is chosen, as the heap of (value, number) orders them (a case for any rewrite of the passes' pushes)."""

from __future__ import annotations

import math

from parsat.egraph.snapshot import ENode, Snapshot
from parsat.ir.costs import NodeCost
from parsat.search.extract import Choosable, bottom_up, greedy_dag, node_times, numbering

from test_extraction_passes import _plain_bottom_up, _plain_greedy_dag  # noqa: E402 (a sibling test module)


def _tied() -> tuple[Snapshot, dict, object]:
    """Two leaves of one cost, and a class made from either at one cost, its e-node reading the leaf that is final
    second numbered first: the entry of that one equals the entry already pushed, and must still be pushed (a
    lesser number), as the heap of (value, number) tuples orders them."""
    classes = {0: (ENode("leaf", (), ("x",)),), 1: (ENode("leaf", (), ("y",)),),
               2: (ENode("op", (1,), ()), ENode("op", (0,), ())),
               3: (ENode("add", (2, 0), ()), ENode("add", (1, 2), ()))}
    snapshot = Snapshot(classes, {}, {}, {})
    costs = {nid: NodeCost(forward_s=0.5, memory_bytes=8) for nid in snapshot.kids}
    return snapshot, costs, costs.__contains__


def test_a_tie_with_a_lesser_number_is_pushed_and_chosen():
    snapshot, costs, usable = _tied()
    choice, rank = bottom_up(snapshot, costs, usable)
    assert (choice, rank) == _plain_bottom_up(snapshot, costs, usable)
    assert choice[2] == 0   # pushed second, an equal value, the lesser number: it leaves the heap first
    assert greedy_dag(snapshot, costs, usable) == _plain_greedy_dag(snapshot, costs, usable)
    assert greedy_dag(snapshot, costs, usable)[2] == 0
    prefer = {2: 1, 3: 1}
    assert bottom_up(snapshot, costs, usable, prefer=prefer) == _plain_bottom_up(snapshot, costs, usable, prefer)
    assert bottom_up(snapshot, costs, usable, memory_price=1e-3) == \
        _plain_bottom_up(snapshot, costs, usable, memory_price=1e-3)


def test_a_tables_times_are_kept_per_snapshot_and_a_guide_patches_its_own():
    """`node_times` of one table is one list, of an equal table another (held by identity); a `Choosable` whose
    passes rank some e-nodes dearer (`raised`) holds the times of the table those make, and the kept list is left
    as it was."""
    snapshot, costs, usable = _tied()
    nids = numbering(snapshot).nids
    first = Choosable.of(snapshot, costs, usable)
    assert first.time is node_times(snapshot, costs)
    assert first.time == [costs[nid].time_s if nid in costs else 0.0 for nid in nids]
    equal = dict(costs)
    assert node_times(snapshot, equal) is not first.time and node_times(snapshot, equal) == first.time
    raised = {(2, 1): NodeCost(forward_s=0.5, comm_s=0.25, memory_bytes=8)}
    guided = Choosable.of(snapshot, costs, usable, first, raised=raised)
    guide = {**costs, **raised}
    assert guided.time == [guide[nid].time_s if nid in guide else 0.0 for nid in nids]
    assert guided.time != first.time and first.time == [costs[nid].time_s for nid in nids]
    assert guided.walk is first.walk
    assert bottom_up(snapshot, guide, usable, choosable=guided) == _plain_bottom_up(snapshot, guide, usable)
    assert greedy_dag(snapshot, guide, usable, math.inf, guided) == _plain_greedy_dag(snapshot, guide, usable)
