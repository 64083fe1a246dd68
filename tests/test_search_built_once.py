"""The baselines a step builds apart from the e-graphs, built once per call (issue 28): the search of every mesh at
the count a scout chose builds the sequential baseline and data parallelism the scout built, and gets what
building them again gives (`step.built_once`, `step._two_phase`, `step._unplaceable`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import parsat.search.optimize as optimize_module
import parsat.search.step as step_module
from parsat.ir.machine import Machine
from parsat.ir.plan import without_timing
from parsat.search.optimize import optimize


class _Forgetful(dict):
    """A `SearchRequest.built` that keeps nothing: every step builds its baselines again, as before."""

    def __setitem__(self, key, value) -> None:
        pass




@pytest.fixture(scope="module")
def tight() -> Machine:
    """A cpu machine on which mlp's whole batch does not fit on 4 devices: micro-batch counts are scouted, then
    every mesh searched at the count chosen (`microbatches`)."""
    whole = optimize("mlp", machine="cpu", devices=4, baselines=False)
    activations = sum(c.activation_bytes for c in whole.costs.values())
    return replace(Machine.resolve("cpu"), memory_capacity=whole.totals.peak_memory_bytes - activations // 3)


def _search(monkeypatch, machine: Machine, forget: bool) -> tuple[dict, list, list]:
    """The plan, and the inputs of every sequential and data-parallel build the call made."""
    sequential, data_parallel, resolve = step_module.sequential, step_module.data_parallel, \
        optimize_module.resolve_request
    two_phase, dp = [], []

    def counted_sequential(graph, library, rules, mesh, *args, **kwargs):
        two_phase.append((graph, str(mesh)))
        return sequential(graph, library, rules, mesh, *args, **kwargs)

    def counted_data_parallel(graph, library, machine, free, devices, **kwargs):
        dp.append((graph, machine, devices))
        return data_parallel(graph, library, machine, free, devices, **kwargs)

    def resolved(*args, **kwargs):
        request = resolve(*args, **kwargs)
        return replace(request, built=_Forgetful()) if forget else request

    with monkeypatch.context() as patch:
        patch.setattr(step_module, "sequential", counted_sequential)
        patch.setattr(step_module, "data_parallel", counted_data_parallel)
        patch.setattr(optimize_module, "resolve_request", resolved)
        plan = optimize("mlp", machine=machine, devices=4)
    return without_timing(json.loads(plan.to_json())), two_phase, dp


def _repeated(calls: list) -> int:
    return sum(1 for i, call in enumerate(calls) if call in calls[:i])


def test_baselines_built_once_per_call_give_the_plan_building_them_again_gives(monkeypatch, tight):
    once, two_phase, dp = _search(monkeypatch, tight, forget=False)
    again, two_phase_again, dp_again = _search(monkeypatch, tight, forget=True)
    assert _repeated(two_phase_again) >= 1 and _repeated(dp_again) >= 1   # building again repeats work here
    assert _repeated(two_phase) == 0 and _repeated(dp) == 0                # built once: each inputs once
    assert len(two_phase) < len(two_phase_again)
    assert once == again                                                   # and the plan is the same, every field


def test_a_wall_clock_limit_builds_the_sequential_baseline_every_time(monkeypatch, tight):
    """Under `--limit ilp_seconds` an extraction may stop on the clock: the sequential baseline is not kept."""
    sequential, calls = step_module.sequential, []

    def counted(graph, library, rules, mesh, *args, **kwargs):
        calls.append((graph, str(mesh)))
        return sequential(graph, library, rules, mesh, *args, **kwargs)

    monkeypatch.setattr(step_module, "sequential", counted)
    optimize("mlp", machine=tight, devices=4, limits={"ilp_seconds": 600_000})
    assert _repeated(calls) >= 1
