"""The extraction passes over numbered e-nodes (`extract._Numbering`, `_Walk`) choose what the passes written plainly
choose: e-nodes numbered in (class, index) order break ties as (weight, class, index) did, whatever order the
snapshot holds its classes in; an entry pushed after a lesser one of its class is left out of the heap
(`_least_entries`) with no choice changed; `dag_cost` with its look-ups bound counts what the plain walk counts."""

from __future__ import annotations

import heapq
import math
import random

import pytest

from parsat.egraph.snapshot import ENode, Snapshot
from parsat.ir.costs import NodeCost
from parsat.search.extract import Choosable, _Walk, bottom_up, dag_cost, greedy_dag, numbering

from test_extraction_passes import _plain_bottom_up, _plain_greedy_dag, _random_egraph  # noqa: E402 (a sibling)


def _shuffled(snapshot: Snapshot, rng: random.Random) -> Snapshot:
    """The same e-graph with its classes held in another order (class ids and e-nodes unchanged)."""
    order = list(snapshot.classes)
    rng.shuffle(order)
    return Snapshot({cid: snapshot.classes[cid] for cid in order}, {}, {}, {})


@pytest.mark.parametrize("seed", range(150))
def test_passes_over_shuffled_classes_break_ties_by_class_then_index(seed):
    """A snapshot whose classes are not held in id order: the numbered passes break ties by class id and index, as
    the heap of (weight, class, index) did, not by the order the snapshot holds them in."""
    rng = random.Random(seed)
    plain, costs, usable = _random_egraph(rng)
    snapshot = _shuffled(plain, rng)
    numbers = numbering(snapshot)
    assert list(numbers.nids) == sorted(snapshot.kids)
    expected = _plain_bottom_up(plain, costs, usable)
    assert bottom_up(snapshot, costs, usable) == expected
    choosable = Choosable.of(snapshot, costs, usable)
    prefer = {cid: rng.randrange(len(snapshot.classes[cid])) for cid in snapshot.classes if rng.random() < 0.5}
    assert bottom_up(snapshot, costs, usable, prefer=prefer, choosable=choosable) == \
        _plain_bottom_up(plain, costs, usable, prefer=prefer)
    price = rng.choice((1e-12, 3e-10, 0.25))
    assert bottom_up(snapshot, costs, usable, memory_price=price, choosable=choosable.with_memory(costs)) == \
        _plain_bottom_up(plain, costs, usable, memory_price=price)
    assert greedy_dag(snapshot, costs, usable, math.inf, choosable) == _plain_greedy_dag(plain, costs, usable)


def _many_ways() -> tuple[Snapshot, dict, object]:
    """A chain of classes, each made by 12 e-nodes from the class before it, dearer one after another: every e-node
    of a class is ready once the class before it is final, and only the cheapest can make its class final."""
    classes = {0: (ENode("leaf", (), ("x",)),)}
    for cid in range(1, 30):
        classes[cid] = tuple(ENode(f"op{k}", (cid - 1,), ()) for k in range(12))
    snapshot = Snapshot(classes, {}, {}, {})
    costs = {nid: NodeCost(forward_s=0.1 * (1 + nid[1] % 5), memory_bytes=nid[1]) for nid in snapshot.kids}
    return snapshot, costs, costs.__contains__


def test_an_entry_after_a_lesser_one_of_its_class_is_not_pushed(monkeypatch):
    """Both passes push one entry per class where every e-node of a class is ready at once (the plain passes push
    twelve), and choose what the plain passes choose."""
    snapshot, costs, usable = _many_ways()
    expected = (_plain_bottom_up(snapshot, costs, usable), _plain_greedy_dag(snapshot, costs, usable))
    pushed = []
    push = heapq.heappush
    monkeypatch.setattr(heapq, "heappush", lambda heap, entry: pushed.append(entry) or push(heap, entry))
    assert bottom_up(snapshot, costs, usable) == expected[0]
    assert len(pushed) == len(snapshot.classes) - 1
    del pushed[:]
    assert greedy_dag(snapshot, costs, usable) == expected[1]
    assert len(pushed) == len(snapshot.classes) - 1


def test_a_walk_and_its_numbering_are_shared():
    """The numbering is worked out once per snapshot; a `Choosable` made `like` another takes its walk, and its own
    times from its own costs."""
    snapshot, costs, usable = _many_ways()
    first = Choosable.of(snapshot, costs, usable)
    dearer = {nid: NodeCost(forward_s=2 * cost.forward_s) for nid, cost in costs.items()}
    second = Choosable.of(snapshot, dearer, usable, first)
    assert second.walk is first.walk and first.walk.numbers is numbering(snapshot)
    assert second.time == [2 * t for t in first.time]
    assert _Walk.of(snapshot, usable) == first.walk


def _plain_dag_cost(snapshot, costs, choice, roots, obliged=None):
    """`dag_cost` as written before its look-ups were bound."""
    order, state, pending, scanned = [], {}, list(roots), 0
    while pending:
        stack = [(pending.pop(0), False)]
        while stack:
            cid, exiting = stack.pop()
            if exiting:
                state[cid] = 2
                order.append(cid)
                continue
            if state.get(cid) == 2:
                continue
            if state.get(cid) == 1 or cid not in choice or (cid, choice[cid]) not in costs:
                return None
            state[cid] = 1
            stack.append((cid, True))
            for child in snapshot.classes[cid][choice[cid]].children:
                if state.get(child) == 1:
                    return None
                if state.get(child) != 2:
                    stack.append((child, False))
        if obliged and not pending:
            for cid in order[scanned:]:
                for group in obliged.get((cid, choice[cid]), ()):
                    if any(state.get(c) == 2 for c in group):
                        continue
                    held = next((c for c in group if c in choice), None)
                    if held is None:
                        return None
                    pending.append(held)
            scanned = len(order)
    return (sum(costs[(c, choice[c])].time_s for c in order), sum(costs[(c, choice[c])].memory_bytes for c in order),
            order)


@pytest.mark.parametrize("seed", range(200))
def test_dag_cost_counts_what_the_plain_walk_counts(seed):
    """Random choices (cyclic, incomplete, unpriced) with random obligations: the same result, order included."""
    rng = random.Random(seed)
    snapshot, costs, _usable = _random_egraph(rng)
    choice = {cid: rng.randrange(len(nodes)) for cid, nodes in snapshot.classes.items() if rng.random() < 0.9}
    roots = rng.sample(sorted(snapshot.classes), rng.randint(1, 3))
    obliged = {nid: tuple(tuple(rng.sample(sorted(snapshot.classes), rng.randint(0, 2)))
                          for _ in range(rng.randint(1, 2)))
               for nid in snapshot.kids if rng.random() < 0.1}
    for groups in (None, obliged):
        assert dag_cost(snapshot, costs, choice, roots, groups) == _plain_dag_cost(snapshot, costs, choice, roots,
                                                                                   groups)


def test_the_pass_choices_found_by_dag_cost_are_not_all_trivial():
    """The cases above hold complete plans, cycles and incomplete choices alike."""
    found = [dag_cost(snapshot, costs, {cid: rng.randrange(len(nodes)) for cid, nodes in snapshot.classes.items()},
                      [max(snapshot.classes)]) is None
             for rng in map(random.Random, range(200)) for snapshot, costs, _usable in [_random_egraph(rng)]]
    assert 20 < sum(found) < 180
