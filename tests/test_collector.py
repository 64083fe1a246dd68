"""The search's collector thresholds are its own: set for the search, put back after it, whatever happens."""

import gc

import pytest

from parsat.search.collector import SEARCH_THRESHOLD, fewer_collections


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_a_search_collects_less_often_and_puts_the_thresholds_back(thresholds):
    gc.set_threshold(700, 10, 10)
    with fewer_collections():
        assert gc.get_threshold() == (SEARCH_THRESHOLD, 10, 10)
        with fewer_collections():          # a stage search inside the search
            assert gc.get_threshold() == (SEARCH_THRESHOLD, 10, 10)
        assert gc.get_threshold() == (SEARCH_THRESHOLD, 10, 10)
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
    gc.set_threshold(10 * SEARCH_THRESHOLD, 5, 5)   # rarer than the search's
    with fewer_collections():
        assert gc.get_threshold() == (10 * SEARCH_THRESHOLD, 5, 5)


def test_optimize_runs_under_it_and_restores(thresholds, monkeypatch):
    import parsat.search.optimize as optimize
    seen = []
    monkeypatch.setattr(optimize, "_optimize", lambda *args: seen.append(gc.get_threshold()) or "plan")
    gc.set_threshold(700, 10, 10)
    assert optimize.optimize("mlp") == "plan"
    assert seen == [(SEARCH_THRESHOLD, 10, 10)] and gc.get_threshold() == (700, 10, 10)
