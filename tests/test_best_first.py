"""Best-bound-first simulation (`mesh.BestFirst`): candidates added a group at a time (the independent grid's
layouts, `step.independent_points`) are simulated in the order of their step floors across the groups, and the
fastest that fits, with every one as fast, is what simulating every one gives; a candidate whose floor is
above a step simulated is never run."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

from parsat.search.mesh import BestFirst


class _Steps:
    """A stand-in for `CandidateSteps`: each candidate's floor and simulated step given, the runs recorded."""

    def __init__(self, fail: frozenset = frozenset()):
        self.ran, self.skipped, self.fail = [], 0, fail

    def floor(self, pcg):
        return pcg.floor

    def __call__(self, candidate):
        self.ran.append(candidate.name)
        if candidate.name in self.fail:   # the simulator could not run it: its per-node sum stays
            return candidate
        return SimpleNamespace(name=candidate.name, pcg=candidate.pcg, fits=candidate.fits,
                               totals=SimpleNamespace(simulation=True, time_s=candidate.pcg.time_s))


def _point(name: str, floor: float | None, time_s: float, fits: bool = True):
    return SimpleNamespace(name=name, fits=fits, pcg=SimpleNamespace(floor=floor, time_s=time_s),
                           totals=SimpleNamespace(simulation=None, time_s=floor or 0.0))


def _fits(candidate) -> bool:
    return candidate.fits


def test_a_later_group_s_point_sets_the_bar_before_an_earlier_group_s_slower_points_run():
    """llama-70b:64's stage grids: the layout first by its floor (7) holds only points recomputing blocks
    (floors 10, steps 13 and 13.5); the next layout (floor 8) has a point of step 9. Simulated group by group,
    all three ran; waiting across groups, only the fastest does, and the best is the same."""
    steps = _Steps()
    search = BestFirst(steps, _fits)
    search.add([(("a", 0), _point("a0", 10.0, 13.0)), (("a", 1), _point("a1", 10.0, 13.5))])
    search.run(8.0)   # the next group's bound: nothing waiting is at or below it
    assert steps.ran == []
    search.add([(("b", 0), _point("b0", 8.5, 9.0))])
    search.run()
    assert steps.ran == ["b0"] and steps.skipped == 2 and search.bar == 9.0
    assert [c.name for c in search.kept.values()] == ["b0"]


def test_points_as_fast_as_the_fastest_are_all_kept_and_the_ones_that_do_not_fit_unsimulated():
    steps = _Steps()
    search = BestFirst(steps, _fits, rivals=lambda c: c.name != "rival")
    search.add([(0, _point("slow", 6.0, 7.0)), (1, _point("big", 1.0, 2.0, fits=False)),
                (2, _point("tie", 5.0, 5.0)), (3, _point("rival", 0.5, 1.0))])
    search.add([(4, _point("tie2", 5.0, 5.0))])
    search.run()
    assert sorted(steps.ran) == ["tie", "tie2"]
    assert {k: c.name for k, c in search.kept.items()} == {1: "big", 2: "tie", 3: "rival", 4: "tie2"}
    assert search.kept[1].totals.simulation is None and search.kept[3].totals.simulation is None


def test_a_candidate_the_simulator_cannot_run_sets_no_bar():
    steps = _Steps(fail=frozenset({"broken"}))
    search = BestFirst(steps, _fits)
    search.add([(0, _point("broken", 1.0, 1.5)), (1, _point("next", 2.0, 3.0))])
    search.run()
    assert steps.ran == ["broken", "next"] and search.bar == 3.0 and len(search.kept) == 2


def test_any_grouping_gives_the_fastest_and_every_point_as_fast_as_simulating_every_one():
    """Random floors (each at or below its step, some None, ties on purpose) added in random groups, each group
    preceded by a run up to a random bound: the kept points that were simulated include every one as fast as
    the fastest, and no left-out point is as fast."""
    rng = random.Random(28)
    for _trial in range(300):
        points = []
        for k in range(rng.randint(1, 12)):
            time_s = float(rng.choice([3, 4, 5, 5, 6, 8, 9]))
            floor = None if rng.random() < 0.1 else time_s - rng.choice([0.0, 0.5, 1.0, 3.0])
            points.append((k, _point(f"p{k}", floor, time_s, fits=rng.random() < 0.85)))
        fastest = min((p.pcg.time_s for _k, p in points if p.fits), default=None)
        steps, search, at = _Steps(), BestFirst(_Steps(), _fits), 0
        search.steps = steps
        while at < len(points):
            size = rng.randint(1, 4)
            search.run(rng.choice([-math.inf, 2.0, 4.0, 6.0]))
            search.add(points[at:at + size])
            at += size
        search.run()
        assert all(not p.fits or k in search.kept for k, p in points if p.pcg.time_s == fastest)
        assert all(k in search.kept or p.pcg.time_s > fastest for k, p in points)
        assert fastest is None or search.bar == fastest
        assert all(search.kept[k].totals.simulation for k, p in points if p.fits and k in search.kept)
