"""The ILP set up over numbered e-nodes (`extract._ilp_columns`, `_ilp_rows`, `_highs_lp`, `_warm_solution` by
`_Numbering`'s numbers, session 77) gives the model the set-up by (class, index) gave: the same columns in the same
order, the same rows (child rows in `set(node.children)`'s order), the same coefficients and bounds, the same warm
start; and the bottom-up pass's order by number (`finalised`) is the rank `bottom_up` gives."""

from __future__ import annotations

import functools
import math
import random

import numpy as np
import pytest

from parsat.egraph.snapshot import ENode, Snapshot
from parsat.ir.costs import NodeCost
from parsat.search import extract
from parsat.search.extract import Choosable, bottom_up, finalised, numbering
from parsat.search.value_order import value_order

from test_extraction_passes import _random_egraph  # noqa: E402 (a sibling)


# ----------------------------------------------------------------- the set-up by (class, index), as written before


def _old_reachable(snapshot, roots, usable, obliged=None):
    seen, stack, obliged_by, found = set(roots), list(roots), (obliged or {}).get, {}
    while stack:
        cid = stack.pop()
        here = found[cid] = []
        for index, node in enumerate(snapshot.classes.get(cid, ())):
            nid = (cid, index)
            if not usable(nid):
                continue
            here.append(index)
            for child in node.children:
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
            for group in obliged_by(nid, ()):
                for child in group:
                    if child not in seen:
                        seen.add(child)
                        stack.append(child)
    return found


def _old_columns(snapshot, roots, allowed, obliged):
    reached = _old_reachable(snapshot, roots, allowed, obliged)
    return [(cid, index) for cid in sorted(reached) for index in reached[cid]]


def _old_ilp_columns(snapshot, roots, usable, rank, obliged=None, warm=None):
    kids, rank_of = snapshot.kids, rank.get

    @functools.cache
    def ranked(nid):
        own = rank_of(nid[0])
        return own is not None and usable(nid) and all(rank_of(ch, math.inf) < own for ch in kids[nid])

    cols = _old_columns(snapshot, roots, ranked, obliged)
    if not warm:
        return cols, None
    values = value_order(snapshot)

    @functools.cache
    def ordered(nid):
        cid = nid[0]
        if ranked(nid):
            return True
        if cid not in warm or not usable(nid) or cid not in rank:
            return False
        own = (values[cid], rank[cid])
        return all(ch in rank and (values[ch], rank[ch]) < own for ch in snapshot.classes[cid][nid[1]].children)

    more = _old_columns(snapshot, roots, ordered, obliged)
    return cols, (more if len(cols) < len(more) <= len(cols) * (1 + extract.VALUE_ORDER_GROWTH) else None)


def _old_ilp_rows(snapshot, costs, roots, cols, capacity, obliged=None):
    start, index, value, lower, upper = [0], [], [], [], []

    def row(entries, lo, hi):
        for col, val in entries:
            index.append(col)
            value.append(val)
        start.append(len(index))
        lower.append(lo)
        upper.append(hi)

    by_class = {}
    for col, (cid, _i) in enumerate(cols):
        by_class.setdefault(cid, []).append(col)
    for root in roots:
        if root not in by_class:
            return None
        row(((c, 1.0) for c in by_class[root]), 1.0, 1.0)
    for cid, cs in by_class.items():
        if cid not in roots and len(cs) > 1:
            row(((c, 1.0) for c in cs), 0.0, 1.0)
    for col, (cid, i) in enumerate(cols):
        for child in set(snapshot.classes[cid][i].children):
            row([(c, 1.0) for c in by_class.get(child, [])] + [(col, -1.0)], 0.0, math.inf)
        for group in (obliged or {}).get((cid, i), ()):
            row([(c, 1.0) for held in group for c in by_class.get(held, [])] + [(col, -1.0)], 0.0, math.inf)
    if capacity and math.isfinite(capacity):
        row(((col, costs[nid].memory_bytes / capacity) for col, nid in enumerate(cols)), 0.0, 1.0)
    return start, index, value, lower, upper


def _old_cost(costs, cols):
    scale = max((costs[nid].time_s for nid in cols), default=1.0) or 1.0
    return np.array([costs[nid].time_s / scale for nid in cols])


# ----------------------------------------------------------------------------------------------------- the tests


def _obligations(snapshot, rng):
    """Random groups of classes some e-nodes oblige (a class outside the e-graph now and then: it holds no e-node)."""
    count = len(snapshot.classes)
    return {nid: tuple(tuple(rng.randrange(count + 2) for _ in range(rng.randint(1, 2)))
                       for _ in range(rng.randint(1, 2)))
            for nid in snapshot.kids if rng.random() < 0.15}


def _model(snapshot, costs, roots, cols, capacity, obliged):
    """The new set-up's model as plain lists (`cols` as (class, index)), or None."""
    rows = extract._ilp_rows(snapshot, costs, roots, cols, capacity, obliged)
    if rows is None:
        return None
    return (rows.start, rows.index, rows.value, rows.lower, rows.upper)


@pytest.mark.parametrize("seed", range(200))
def test_the_numbered_model_is_the_model_by_class_and_index(seed):
    """Columns, the value order's columns, rows and objective of the numbered set-up equal the set-up by (class,
    index) on random e-graphs (cycles, self-loops, repeated children, unpriced and banned e-nodes), with and without
    obligations, a warm plan and a memory capacity; the rank by number is `bottom_up`'s rank."""
    rng = random.Random(seed)
    snapshot, costs, usable = _random_egraph(rng)
    obliged = _obligations(snapshot, rng) if rng.random() < 0.5 else None
    choosable = Choosable.of(snapshot, costs, usable)
    warm = {cid: rng.randrange(len(snapshot.classes[cid])) for cid in snapshot.classes if rng.random() < 0.6}
    order = finalised(choosable, costs, prefer=warm)
    _choice, rank = bottom_up(snapshot, costs, usable, prefer=warm, choosable=choosable)
    nids = numbering(snapshot).nids
    assert {nids[n][0]: place for place, n in enumerate(order)} == rank
    roots = sorted(rng.sample(sorted(snapshot.classes), rng.randint(1, 3)))
    capacity = rng.choice((0.0, math.inf, 7.0, 3.0 * (1 << 30)))
    cols, more = extract._ilp_columns(snapshot, roots, choosable.walk, order, obliged, warm if obliged else None)
    old_cols, old_more = _old_ilp_columns(snapshot, roots, usable, rank, obliged, warm if obliged else None)
    assert [nids[n] for n in cols] == old_cols
    assert (more is None) == (old_more is None)
    for new, old in ((cols, old_cols), (more, old_more)):
        if new is None:
            continue
        assert _model(snapshot, costs, roots, new, capacity, obliged) == \
            _old_ilp_rows(snapshot, costs, roots, old, capacity, obliged)
        times = extract.node_times(snapshot, costs)
        rows = extract._ilp_rows(snapshot, costs, roots, new, capacity, obliged)
        if rows is not None:
            lp = extract._highs_lp(times, new, rows)
            assert np.array_equal(np.asarray(lp.col_cost_), _old_cost(costs, old))
            solution = extract._warm_solution(snapshot, warm, new)
            assert list(solution.col_value) == [1.0 if warm.get(cid) == i else 0.0 for cid, i in old]


def test_child_rows_follow_the_set_of_children_not_their_tuple():
    """An e-node whose children a set iterates in another order than its tuple (and with a repeat): its child rows
    come in the set's order, as they did, since HiGHS's model follows the rows' order."""
    children = (12, 3, 12, 5)
    assert tuple(set(children)) != tuple(dict.fromkeys(children))   # the case this test is about
    classes = {cid: (ENode("leaf", (), (str(cid),)),) for cid in (3, 5, 12)}
    classes[20] = (ENode("op", children, ()),)
    snapshot = Snapshot(classes, {}, {}, {})
    costs = {nid: NodeCost(forward_s=0.1, memory_bytes=1) for nid in snapshot.kids}
    choosable = Choosable.of(snapshot, costs, costs.__contains__)
    order = finalised(choosable, costs)
    cols, _more = extract._ilp_columns(snapshot, [20], choosable.walk, order)
    nids = numbering(snapshot).nids
    old = [nids[n] for n in cols]
    assert _model(snapshot, costs, [20], cols, 10.0, None) == _old_ilp_rows(snapshot, costs, [20], old, 10.0)
    col_of = {nid[0]: c for c, nid in enumerate(old)}
    rows = extract._ilp_rows(snapshot, costs, [20], cols, 10.0)
    child_rows = [rows.index[rows.start[r]] for r in range(1, 4)]   # after the root's row: one row per child
    assert child_rows == [col_of[c] for c in set(children)]


def test_an_ilp_extraction_is_unchanged_by_the_numbered_set_up():
    """A whole ILP (HiGHS) on a random e-graph chooses what the model by (class, index) chooses: the same model,
    solved the same way."""
    for seed in range(40):
        rng = random.Random(1000 + seed)
        snapshot, costs, usable = _random_egraph(rng)
        choosable = Choosable.of(snapshot, costs, usable)
        tree, _rank = bottom_up(snapshot, costs, usable, choosable=choosable)
        roots = [max(tree)] if tree else []
        if not roots:
            continue
        order = finalised(choosable, costs, prefer=tree)
        choice, status = extract.ilp(snapshot, costs, roots, choosable.walk, math.inf, tree, 10_000, order)
        assert status and (choice is None or roots[0] in choice)
