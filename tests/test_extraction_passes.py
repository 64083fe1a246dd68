"""The greedy extraction passes (`extract.bottom_up`, `extract.greedy_dag`) choose what the passes written plainly
choose, e-node for e-node and rank for rank, on random e-graphs with cycles, self-loops, unusable e-nodes and many
tied costs: the e-nodes they may choose and their weights are worked out once per extraction (`Choosable`) and
shared by its passes, which must change no choice, no tie-break and no float of any sum."""

from __future__ import annotations

import heapq
import math
import random

import pytest

from parsat.egraph.snapshot import ENode, Snapshot
from parsat.ir.costs import NodeCost
from parsat.search.extract import EPSILON, Choosable, bottom_up, greedy_dag


def _plain_start(snapshot, usable, weight):
    """Both passes' start as written before `Choosable`: every e-node scanned; the usable ones that do not read their
    own class wait for their children, the leaves among them pushed with their weight."""
    pending, heap = {}, []
    for nid, kids in snapshot.kids.items():
        if nid[0] in kids or not usable(nid):
            continue
        pending[nid] = len(kids)
        if not kids:
            heapq.heappush(heap, (weight(nid), nid[0], nid[1]))
    return pending, heap


def _plain_bottom_up(snapshot, costs, usable, prefer=None, memory_price=0.0):
    """The bottom-up pass as written before `Choosable`: every e-node scanned, each weight worked out as met."""
    prefer = prefer or {}

    def weight(nid):
        if prefer.get(nid[0]) == nid[1]:
            return 0.0
        cost = costs[nid]
        return cost.time_s + memory_price * cost.memory_bytes + EPSILON

    pending, heap = _plain_start(snapshot, usable, weight)
    best, choice, rank = {}, {}, {}
    while heap:
        value, cid, index = heapq.heappop(heap)
        if cid in best:
            continue
        best[cid], choice[cid], rank[cid] = value, index, len(rank)
        for nid in snapshot.readers.get(cid, ()):
            if nid not in pending:
                continue
            pending[nid] -= 1
            if pending[nid] == 0 and nid[0] not in best:
                heapq.heappush(heap, (weight(nid) + sum(best[k] for k in snapshot.kids[nid]), nid[0], nid[1]))
    return choice, rank


def _plain_greedy_dag(snapshot, costs, usable):
    """The greedy DAG pass as written before `Choosable`: a class's value is the cost of the set below it."""
    pending, ready = _plain_start(snapshot, usable, lambda nid: costs[nid].time_s + EPSILON)
    below, value_of, own, choice = {}, {}, [], {}

    def union(children):
        kids = sorted(children, key=value_of.__getitem__, reverse=True)
        if not kids:
            return 0, 0.0
        mask, total = below[kids[0]], value_of[kids[0]]
        for child in kids[1:]:
            for bit in range(len(own)):
                if below[child] >> bit & 1 and not mask >> bit & 1:
                    mask |= 1 << bit
                    total += own[bit]
        return mask, total

    while ready:
        value, cid, index = heapq.heappop(ready)
        if cid in choice:
            continue
        mask, _total = union(snapshot.kids[(cid, index)])
        own.append(costs[(cid, index)].time_s + EPSILON)
        below[cid], value_of[cid], choice[cid] = mask | (1 << (len(own) - 1)), value, index
        for nid in snapshot.readers.get(cid, ()):
            if nid not in pending:
                continue
            pending[nid] -= 1
            if pending[nid] == 0 and nid[0] not in choice:
                _mask, total = union(snapshot.kids[nid])
                heapq.heappush(ready, (total + costs[nid].time_s + EPSILON, nid[0], nid[1]))
    return choice


def _random_egraph(rng: random.Random):
    """An e-graph of 4-40 classes, 1-4 e-nodes each, reading up to three classes (any class, so with cycles and
    self-loops, and repeated children), costs from a few values (ties everywhere), some e-nodes unpriced."""
    count = rng.randint(4, 40)
    classes = {}
    for cid in range(count):
        nodes = []
        for k in range(rng.randint(1, 4)):
            arity = rng.choice((0, 0, 1, 1, 2, 3)) if cid else 0
            nodes.append(ENode(f"op{k}", tuple(rng.randrange(count) for _ in range(arity)), ()))
        classes[cid] = tuple(nodes)
    snapshot = Snapshot(classes, {}, {}, {})
    times = (0.0, 0.1, 0.1, 0.3, 1e-13, 0.7)
    costs = {nid: NodeCost(forward_s=rng.choice(times), comm_s=rng.choice(times),
                           memory_bytes=rng.choice((0, 1, 5, 1 << 30)))
             for nid in snapshot.kids if rng.random() < 0.9}
    banned = frozenset(nid for nid in costs if rng.random() < 0.1)
    return snapshot, costs, (lambda nid: nid in costs and nid not in banned)


@pytest.mark.parametrize("seed", range(300))
def test_the_passes_choose_what_the_plain_passes_choose(seed):
    rng = random.Random(seed)
    snapshot, costs, usable = _random_egraph(rng)
    choosable = Choosable.of(snapshot, costs, usable)
    tree, rank = _plain_bottom_up(snapshot, costs, usable)
    assert bottom_up(snapshot, costs, usable) == (tree, rank)
    assert bottom_up(snapshot, costs, usable, choosable=choosable) == (tree, rank)
    # a preferred choice (the ILP's warm start) and a memory price (`lean_choices`), sharing the same `choosable`
    prefer = {cid: rng.randrange(len(snapshot.classes[cid])) for cid in snapshot.classes if rng.random() < 0.5}
    assert bottom_up(snapshot, costs, usable, prefer=prefer, choosable=choosable) == \
        _plain_bottom_up(snapshot, costs, usable, prefer=prefer)
    price = rng.choice((1e-12, 3e-10, 0.25))
    priced = _plain_bottom_up(snapshot, costs, usable, memory_price=price)
    assert bottom_up(snapshot, costs, usable, memory_price=price, choosable=choosable) == priced
    # `lean_choices`' Choosable: its extraction's e-nodes and readers taken, each e-node's memory beside its time
    lean = Choosable.of(snapshot, costs, usable, choosable).with_memory(costs)
    assert (lean.walk, lean.time) == (choosable.walk, choosable.time)
    assert bottom_up(snapshot, costs, usable, memory_price=price, choosable=lean) == priced
    plain = _plain_greedy_dag(snapshot, costs, usable)
    assert greedy_dag(snapshot, costs, usable) == plain
    assert greedy_dag(snapshot, costs, usable, math.inf, choosable) == plain


def test_the_random_e_graphs_hold_what_the_comparison_needs():
    """The cases above are not all trivial: ties broken by class id, cycles left out, unusable e-nodes skipped."""
    tied = cyclic = skipped = 0
    for seed in range(300):
        snapshot, costs, usable = _random_egraph(random.Random(seed))
        choice, _rank = _plain_bottom_up(snapshot, costs, usable)
        weights = [costs[nid].time_s for nid in costs]
        tied += len(weights) != len(set(weights))
        cyclic += any(nid[0] in kids for nid, kids in snapshot.kids.items())
        skipped += any(not usable(nid) for nid in snapshot.kids)
        assert choice
    assert min(tied, cyclic, skipped) > 100
