"""The search's collector thresholds are its own: set for the search, put back after it, whatever happens."""

import contextlib
import gc
import json

import pytest

from parsat.ir.plan import without_timing
from parsat.search.collector import OLDER_THRESHOLD, SEARCH_THRESHOLD, fewer_collections

SEARCHING = (SEARCH_THRESHOLD, OLDER_THRESHOLD, OLDER_THRESHOLD)


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_a_search_collects_less_often_and_puts_the_thresholds_back(thresholds):
    gc.set_threshold(700, 10, 10)
    with fewer_collections():
        assert gc.get_threshold() == SEARCHING
        with fewer_collections():          # a stage search inside the search
            assert gc.get_threshold() == SEARCHING
        assert gc.get_threshold() == SEARCHING
    assert gc.get_threshold() == (700, 10, 10)


def test_a_search_that_raises_puts_the_thresholds_back(thresholds):
    gc.set_threshold(700, 10, 10)
    with pytest.raises(ValueError):
        with fewer_collections():
            raise ValueError("bad input")
    assert gc.get_threshold() == (700, 10, 10)


def test_a_caller_s_own_choice_is_kept(thresholds):
    gc.set_threshold(0)                     # collection off
    with fewer_collections():
        assert gc.get_threshold()[0] == 0
    gc.set_threshold(10 * SEARCH_THRESHOLD, 5, 5)   # the first generation rarer than the search's: kept
    with fewer_collections():
        assert gc.get_threshold() == (10 * SEARCH_THRESHOLD, OLDER_THRESHOLD, OLDER_THRESHOLD)
    gc.set_threshold(700, 10 * OLDER_THRESHOLD, 2 * OLDER_THRESHOLD)   # older ones rarer: kept
    with fewer_collections():
        assert gc.get_threshold() == (SEARCH_THRESHOLD, 10 * OLDER_THRESHOLD, 2 * OLDER_THRESHOLD)


def test_optimize_runs_under_it_and_restores(thresholds, monkeypatch):
    import parsat.search.optimize as optimize
    seen = []
    monkeypatch.setattr(optimize, "_optimize", lambda *args: seen.append(gc.get_threshold()) or "plan")
    gc.set_threshold(700, 10, 10)
    assert optimize.optimize("mlp") == "plan"
    assert seen == [SEARCHING] and gc.get_threshold() == (700, 10, 10)


def _plan_under(monkeypatch, thresholds: tuple[int, int, int] | None) -> dict:
    """mlp's plan on 4 cpu devices, the search run under `thresholds` (None: `fewer_collections`), timing fields
    left out."""
    import parsat.search.optimize as optimize

    @contextlib.contextmanager
    def fixed():
        before = gc.get_threshold()
        gc.set_threshold(*thresholds)
        try:
            yield
        finally:
            gc.set_threshold(*before)

    with monkeypatch.context() as patch:
        if thresholds is not None:
            patch.setattr(optimize, "fewer_collections", fixed)
        plan = optimize.optimize("mlp", machine="cpu", devices=4)
    return without_timing(json.loads(plan.to_json()))


def test_when_the_collector_runs_leaves_the_plan_alone(thresholds, monkeypatch):
    """The search's thresholds only move when unreachable cycles are freed: the plan is the one a search gets
    collecting at Python's defaults, and collecting all the time (every 50 allocations, every older generation at
    each chance), which would show a result that read an object's identity after the object was freed."""
    searched = _plan_under(monkeypatch, None)
    assert searched == _plan_under(monkeypatch, (700, 10, 10))
    assert searched == _plan_under(monkeypatch, (50, 1, 1))
