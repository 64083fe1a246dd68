"""`--limit seconds` bounds a whole `optimize` call: every micro-batch count's search and every pipeline stage
plan get a part of one deadline (`search.deadline`), and what it leaves no time for is said, not searched."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

import pytest

import parsat.search.mesh as mesh_module
import parsat.search.microbatches as microbatches
import parsat.search.optimize as api
from parsat.ir.machine import Machine
from parsat.report.explain import explain
from parsat.ir.validate import validate_plan_report
from parsat.search.deadline import Deadline
from parsat.ir.errors import DoesNotFit, OptimizeError
from parsat.search.pipeline_search import (NOT_SEARCHED, best_of, microbatch_counts, pipeline_degrees,
                                             search_order, search_pipelines)
from parsat.egraph.runner import STOP_INTERRUPTED, STOP_SATURATED, STOP_SECONDS, Limits
from parsat.search.request import resolve_request

SIZES = {"blocks": 4, "batch": 8, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}


class Spent(Deadline):
    """A deadline with time left for the search under way, but none to start another."""

    @property
    def spent(self) -> bool:
        return True


def test_every_search_of_one_call_ends_by_the_call_s_one_deadline(monkeypatch):
    outer: list[Deadline] = []
    seen: list[Deadline | None] = []
    starting_now = Deadline.starting_now.__func__
    real_step = api.search_step

    def first_clock(cls, limits):
        outer.append(starting_now(cls, limits))
        return outer[-1]

    def recording(step, clock):
        seen.append(clock)
        return real_step(step, clock)

    monkeypatch.setattr(Deadline, "starting_now", classmethod(first_clock))
    monkeypatch.setattr(api, "search_step", recording)          # the pipeline's stage plans
    monkeypatch.setattr(microbatches, "search_step", recording)  # the unstaged micro-batch counts
    # a limit the call never reaches, however loaded the box: what is checked is how it is shared, not what it cuts
    plan = api.optimize("gpt", "cpu", devices=4, sizes=SIZES, limits={"seconds": 600}, pipeline=True, baselines=False)
    assert plan.saturation.get("pipeline_search")
    # the unstaged search and the stage plans: several searches, each within the one deadline, none its own 600 s
    assert len(seen) >= 3 and all(clock is not None for clock in seen)
    deadline = outer[0].at
    assert all(clock.at <= deadline + 1e-9 for clock in seen)
    assert seen[0].at <= deadline - 600 * (1 - api.UNSTAGED_SHARE) + 1e-9


def test_a_spent_limit_stops_the_micro_batch_search_and_says_what_it_left_out():
    whole = api.optimize("mlp", machine="cpu", devices=2, baselines=False)
    activations = sum(c.activation_bytes for c in whole.costs.values())
    tight = replace(Machine.resolve("cpu"), memory_capacity=whole.totals.peak_memory_bytes - activations // 3)
    # with time (test_microbatches) the batch is split until it fits; with none left after the first count the
    # search stops there, and the error says what the limit left out rather than that nothing can fit
    with pytest.raises(DoesNotFit, match=r"no plan fits .*micro-batch count \d+ not searched: --limit seconds"):
        microbatches.search_unstaged(resolve_request("mlp", tight, None, None, 2, baselines=False),
                                     Spent(time.perf_counter() + 60, Limits()))


def test_a_spent_limit_leaves_later_stage_plans_unsearched_and_listed():
    machine = Machine.resolve("h100x8").with_devices(64)
    calls = []

    def search(stage_machine, devices, m, in_flight, fit, clock, scout):
        calls.append((devices, m, in_flight))
        assert clock is not None and clock.left > 0
        raise OptimizeError("no stage plan here")

    found = search_pipelines(search, machine, 64, 512, 10 ** 9, 25, clock=Spent(time.perf_counter() + 60, Limits()))
    # in the order the search takes them (`search_order`: least bubble first)
    pairs = search_order([(p, m) for p in pipeline_degrees(64, machine, 10 ** 9, 25, None)
                          for m in microbatch_counts(512, p, None)])
    assert len(pairs) > 1 and calls == [(64 // pairs[0][0], pairs[0][1], 1)]   # the first is always searched
    unsearched = {(t["pp"], t["microbatches"]) for t in found.tried if t.get("error") == NOT_SEARCHED}
    assert unsearched == set(pairs)   # the first pair's retry with more in flight, and every later pair
    assert not found.plans
    # the plan that comes back says which pairs the limit left out, where explain shows it
    flat = api.optimize("mlp", machine="cpu", devices=2, baselines=False)
    said = best_of(flat, found, flat.machine).saturation["search_limit"]
    assert all(f"pp {p} x {m} micro-batches" in said for p, m in pairs[1:]) and "--limit seconds" in said


def test_explain_says_what_the_limit_left_out():
    plan = api.optimize("mlp", machine="cpu", devices=2, baselines=False)
    assert "search cut short" not in explain(plan.to_dict())
    cut = replace(plan, saturation={**plan.saturation, "search_limit": "micro-batch count 4 not searched: --limit "
                                                                      "seconds=5 reached"})
    assert "search cut short: micro-batch count 4 not searched" in explain(cut.to_dict())
    validate_plan_report(cut.to_dict(), ValueError, "plan")
    bad = cut.to_dict()
    bad["saturation"]["search_limit"] = 5
    with pytest.raises(ValueError, match="saturation.search_limit"):
        validate_plan_report(bad, ValueError, "plan")


@dataclass(frozen=True)
class RunsOutAfterSaturation(Deadline):
    """`--limit seconds` whose time runs out the moment the call's first saturation ends (that saturation runs
    on its work budgets): what a limit that saturation nearly spends does, on any box at any load."""

    saturated: threading.Event = field(default_factory=threading.Event, compare=False)   # shared by every part

    def remaining(self, share: float = 1.0) -> Limits:
        if share == mesh_module.SATURATION_SHARE and not self.saturated.is_set():
            self.saturated.set()
            return self.limits_given
        return super().remaining(share)

    def limits(self, share: float = 1.0) -> Limits | None:
        return None if self.saturated.is_set() else super().limits(share)

    @property
    def left(self) -> float:
        return 0.0 if self.saturated.is_set() else super().left


def test_a_limit_that_cuts_a_repeated_block_search_falls_back_to_the_best_baseline_and_says_so(monkeypatch,
                                                                                               unrepeatable_blocks):
    # cut to its greedy passes, extraction laid the searched blocks out unlike each other (a residual sum
    # reassociated across two blocks): the joint plan could not be repeated, and the call ended with "the plan's
    # blocks cannot be repeated (...); --all-blocks searches every block" while every baseline fit
    monkeypatch.setattr(Deadline, "starting_now",
                        classmethod(lambda cls, limits: RunsOutAfterSaturation(time.perf_counter() + 600, limits)))
    said: list[str] = []
    plan = api.optimize("gpt", "cpu", devices=4, sizes=SIZES, limits={"seconds": 600}, progress=said.append)
    assert plan.saturation["repeated_blocks"]["blocks"] == 4
    # the joint plan could not be repeated: the plan is the best baseline built apart from the e-graph that fits
    assert "cannot be repeated" in plan.extraction["fallback"]
    assert plan.extraction["chosen"] in ("best_grid", "data_parallel") and plan.totals.fits(plan.machine)
    assert plan.extraction["method"] == "none"
    # which limit cut it: the extraction, then the search of every mesh at the count the scout chose
    limit = plan.saturation["search_limit"]
    assert "mesh gpu 4: extraction cut to its greedy passes by --limit seconds=600" in limit
    assert "every mesh at micro-batch count 1 not searched: --limit seconds=600 reached" in limit
    validate_plan_report(plan.to_dict(), ValueError, "plan")
    shown = explain(plan.to_dict())
    assert f"this plan is the best baseline that fits, {plan.extraction['chosen']}'s PCG" in shown
    assert "search cut short: mesh gpu 4: extraction cut" in shown
    assert f"extraction: no joint plan, the plan is the {plan.extraction['chosen']} baseline's" in shown
    assert any("the plan is the best baseline that fits" in line for line in said)


def test_no_valve_means_no_cut_whatever_a_search_ends_with():
    """Without --limit seconds and Ctrl-C a search that finds no joint plan keeps its error: the outcome is the
    work budgets', the same on any machine (only a cut search falls back to a baseline)."""

    class Stopped:
        def __init__(self, stop):
            self.stop = stop

    free = Deadline.starting_now(Limits())
    assert mesh_module.valve_cut(free, Stopped(STOP_SATURATED)) == ""
    limited_ = Deadline.starting_now(Limits(seconds=600))
    assert mesh_module.valve_cut(limited_, Stopped(STOP_SATURATED)) == ""
    assert mesh_module.valve_cut(limited_, Stopped(STOP_SECONDS)) == \
        "saturation stopped by its part of --limit seconds=600"
    assert mesh_module.valve_cut(replace(limited_, at=time.perf_counter() - 1), Stopped(STOP_SATURATED)) == \
        "extraction cut to its greedy passes by --limit seconds=600"
    assert mesh_module.valve_cut(free, Stopped(STOP_INTERRUPTED)) == "interrupted (Ctrl-C)"


def test_every_stage_mesh_is_searched_only_for_a_scout_ahead_of_the_sharpened_unstaged_plan(monkeypatch):
    """`optimize` searches every unstaged mesh between the pipeline's scouts and its search of every stage mesh
    (`sharpen`), and that search must beat what it returns: on llama-70b:64 the unstaged plan on two axes (14.985
    s) beats the scout's PP 8 (16.156 s), so the two stage meshes of 17,000 e-nodes each are no longer saturated."""
    from types import SimpleNamespace

    import parsat.search.pipeline_search as pipeline_search

    def plan(time_s):
        totals = SimpleNamespace(time_s=time_s, peak_memory_bytes=1, fits=lambda machine: True)
        return SimpleNamespace(totals=totals, machine=None, saturation={"scouted": True}, baselines={})

    def priced(stage, p, m, schedule, machine, in_flight, tried, plans, grid, *rest):
        plans.append(plan(16.156 if stage.saturation.get("scouted") else 15.0))
        return plans[-1:]

    monkeypatch.setattr(pipeline_search, "_priced", priced)
    machine = Machine.resolve("h100x8").with_devices(64)
    for unstaged_s, every_stage_mesh in ((14.985, False), (16.539, True)):
        scouts: list[bool] = []
        seen: list[tuple] = []

        def search(stage_machine, devices, m, in_flight, fit, clock, scout):
            scouts.append(scout)
            return SimpleNamespace(saturation={"scouted": True} if scout else {})

        def sharpen(pipelined):
            seen.append((tuple(p.totals.time_s for p in pipelined), list(scouts)))
            return plan(unstaged_s)

        found = search_pipelines(search, machine, 64, 512, 10 ** 9, 25, bar=plan(16.539), sharpen=sharpen)
        assert len(seen) == 1 and seen[0][0] and set(seen[0][0]) == {16.156} and all(seen[0][1])   # scouts only
        assert (False in scouts) is every_stage_mesh
        assert found.unstaged.totals.time_s == unstaged_s
