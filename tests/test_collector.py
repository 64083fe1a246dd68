"""The search pauses the cyclic collector and puts it back as the caller had it, whatever happens; when the collector
runs never changes the plan; the operator walks every search runs thousands of times leave no reference cycle."""

import contextlib
import gc
import json

import pytest

from parsat.dsl.instantiate import index_bounds
from parsat.dsl.library import load_library, shipped_rules_dir
from parsat.dsl.work import contraction, work
from parsat.ir.graph import instance_for
from parsat.ir.plan import without_timing
from parsat.search.collector import paused_while_searching


@pytest.fixture
def collector():
    """The collector's state and thresholds put back after the test."""
    enabled, before = gc.isenabled(), gc.get_threshold()
    yield
    gc.set_threshold(*before)
    (gc.enable if enabled else gc.disable)()


def test_a_search_pauses_the_collector_and_puts_it_back(collector):
    gc.enable()
    with paused_while_searching():
        assert not gc.isenabled()
        with paused_while_searching():          # a stage search inside the search
            assert not gc.isenabled()
        assert not gc.isenabled()               # the inner one leaves it as the outer one set it
    assert gc.isenabled()


def test_a_search_that_raises_puts_the_collector_back(collector):
    gc.enable()
    with pytest.raises(ValueError):
        with paused_while_searching():
            raise ValueError("bad input")
    assert gc.isenabled()


def test_a_caller_s_own_choice_is_kept(collector):
    gc.disable()                                # the caller's choice: collection off
    with paused_while_searching():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_optimize_runs_under_it_and_restores(collector, monkeypatch):
    import parsat.search.optimize as optimize
    seen = []
    monkeypatch.setattr(optimize, "_optimize", lambda *args: seen.append(gc.isenabled()) or "plan")
    gc.enable()
    assert optimize.optimize("mlp") == "plan"
    assert seen == [False] and gc.isenabled()


def _plan_under(monkeypatch, thresholds: tuple[int, int, int] | None) -> dict:
    """mlp's plan on 4 cpu devices, the search run with the collector on at `thresholds` (None: paused, as
    `optimize` runs it), timing fields left out."""
    import parsat.search.optimize as optimize

    @contextlib.contextmanager
    def collecting():
        before, enabled = gc.get_threshold(), gc.isenabled()
        gc.set_threshold(*thresholds)
        gc.enable()
        try:
            yield
        finally:
            gc.set_threshold(*before)
            (gc.enable if enabled else gc.disable)()

    with monkeypatch.context() as patch:
        if thresholds is not None:
            patch.setattr(optimize, "paused_while_searching", collecting)
        plan = optimize.optimize("mlp", machine="cpu", devices=4)
    return without_timing(json.loads(plan.to_json()))


def test_when_the_collector_runs_leaves_the_plan_alone(collector, monkeypatch):
    """The collector only frees unreachable cycles: the plan is the one a search gets collecting at Python's
    defaults, and collecting all the time (every 50 allocations, every older generation at each chance), which
    would show a result that read an object's identity after the object was freed."""
    searched = _plan_under(monkeypatch, None)
    assert searched == _plan_under(monkeypatch, (700, 10, 10))
    assert searched == _plan_under(monkeypatch, (50, 1, 1))


OPS = load_library([shipped_rules_dir() / "ops.rule"])[0].ops


@pytest.mark.parametrize("op, shapes, attrs", [
    ("matmul", ((4, 5), (5, 6)), {}),
    ("bmm", ((2, 3, 4, 5), (2, 3, 5, 6)), {}),
    ("softmax", ((3, 4),), {"dim": 1}),
    ("layernorm", ((3, 4), (4,), (4,)), {"eps": 1e-5}),
])
def test_the_operator_walks_leave_no_cycle(collector, op, shapes, attrs):
    """`work`, `contraction` and `index_bounds` are called for every operator instance a search prices; a
    recursive nested function is a cycle with its closure, so each call left garbage (with all it held) that only
    the collector frees, which a search pauses: they leave none."""
    instance = instance_for(OPS[op], shapes, attrs)
    gc.disable()
    gc.collect()
    for _ in range(3):
        work(instance), contraction(instance), index_bounds(instance)
    assert gc.collect() == 0


def _cyclic_garbage_types(run) -> set[str]:
    """The types of the objects that `run()` leaves for the cyclic collector to free (unreachable once it
    returns, yet not freed by reference counting: in a cycle, or held by one)."""
    gc.disable()
    gc.collect()
    run()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return {type(obj).__qualname__ for obj in gc.garbage}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_a_search_leaves_its_e_graphs_to_reference_counting(collector):
    """A search's snapshots, their provenance and the PCGs worked out from them are freed as the search lets
    them go, not held in cycles until the collection after the search (which walked 700,000 objects of
    llama-70b:64's: a snapshot's provenance and its two views of it, and a grid pass kept with the snapshot by
    a function that held the snapshot)."""
    import parsat

    left = _cyclic_garbage_types(lambda: parsat.optimize("gpt", machine="cpu", devices=2, pipeline=False,
                                                          sizes={"blocks": 2, "hidden": 64, "heads": 4, "seq": 16,
                                                                 "batch": 8, "vocab": 128}))
    assert not left & {"Snapshot", "Provenance", "_Applied", "_Equated", "ENode", "PNode", "PCG", "NodeCost"}
