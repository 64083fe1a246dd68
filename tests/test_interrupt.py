"""Ctrl-C ends a search with the best plan found so far, and says so; only an interrupt before any plan is an
interrupt for the user (exit 130)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import parsat.search.baselines as baselines_module
import parsat.search.mesh as mesh_module
import parsat.search.step as step_module
from parsat.egraph import session as session_module
from parsat.egraph.runner import STOP_INTERRUPTED, Limits
from parsat.egraph.saturate import saturate
from parsat.ir.models import build_example
from parsat.search.optimize import optimize


def test_ctrl_c_inside_egglog_ends_saturation_with_the_e_graph_as_it_stands(monkeypatch):
    real, calls = session_module.Session.run, []

    def run(self, step, budget=None):
        calls.append(step)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, step, budget)

    monkeypatch.setattr(session_module.Session, "run", run)
    graph = build_example("mlp")
    from parsat.dsl.checker import resolve_library

    library = resolve_library(None)
    result = saturate(graph, library, library.rules, 2, Limits())
    assert result.stop == STOP_INTERRUPTED and "interrupted" in result.note
    assert result.snapshot.enodes > 0          # what was there is read back, for extraction


def test_ctrl_c_after_a_mesh_returns_that_mesh_s_plan_and_says_what_it_left_out(monkeypatch):
    interrupted = 2
    real, calls = step_module.search_mesh, []

    def search_mesh(step, mesh, config, pins, clock):
        calls.append(mesh)
        if len(calls) == interrupted:
            raise KeyboardInterrupt
        return real(step, mesh, config, pins, clock)

    monkeypatch.setattr(step_module, "search_mesh", search_mesh)
    plan = optimize("mlp", machine="cpu", devices=4, baselines=False)
    # the scout searches the one-axis mesh; then every mesh is searched at its count, the one-axis mesh's
    # search found again (`step.searched_once`: the same inputs, no wall-clock limit), so Ctrl-C cuts it at
    # its 2 x 2 mesh and the one-axis mesh's plan comes back
    assert len(calls) == interrupted and [len(mesh.axes) for mesh in calls] == [1, 2]
    assert plan.devices == 4 and "interrupted (Ctrl-C)" in plan.saturation["search_limit"]


def test_ctrl_c_before_any_plan_is_the_user_s_interrupt(monkeypatch):
    def search_mesh(step, mesh, config, pins, clock):
        raise KeyboardInterrupt

    monkeypatch.setattr(step_module, "search_mesh", search_mesh)
    with pytest.raises(KeyboardInterrupt):
        optimize("mlp", machine="cpu", devices=4, baselines=False)


def _interrupted_once(real):
    """`real` (a saturate), whose first run ends as if Ctrl-C landed in egglog's last chunk of it: the e-graph as
    it stands, stop reason `interrupted` (the runner's, test_ctrl_c_inside_egglog_ends_saturation_...)."""
    calls = []

    def saturate(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(result)
        return replace(result, stop=STOP_INTERRUPTED) if len(calls) == 1 else result
    return saturate


def test_ctrl_c_in_a_repeated_block_search_returns_the_best_baseline_not_an_error(monkeypatch, unrepeatable_blocks):
    # interrupted, extraction runs its greedy passes only, and the searched blocks come out laid out apart: the
    # call ended with "the plan's blocks cannot be repeated" although every baseline fit; without baselines asked
    # for, they are built all the same (the only plans there are)
    monkeypatch.setattr(mesh_module, "saturate", _interrupted_once(mesh_module.saturate))
    sizes = {"blocks": 4, "batch": 8, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}
    plan = optimize("gpt", machine="cpu", devices=4, sizes=sizes, baselines=False)
    assert "cannot be repeated" in plan.extraction["fallback"] and plan.totals.fits(plan.machine)
    assert plan.extraction["chosen"] in ("best_grid", "data_parallel")
    assert "mesh gpu 4: interrupted (Ctrl-C)" in plan.saturation["search_limit"]
    assert "every mesh at micro-batch count 1 not searched: interrupted (Ctrl-C)" in plan.saturation["search_limit"]


def test_ctrl_c_in_the_sequential_baseline_ends_the_search_as_anywhere_else(monkeypatch):
    # egglog's run absorbs Ctrl-C (stop `interrupted`): the sequential baseline's two saturations went on, and so
    # did the search (every mesh after the scout's), the plan never saying it was interrupted
    searched = []
    real_search_mesh = step_module.search_mesh

    def search_mesh(step, mesh, config, pins, clock):
        searched.append(mesh)
        return real_search_mesh(step, mesh, config, pins, clock)

    monkeypatch.setattr(step_module, "search_mesh", search_mesh)
    monkeypatch.setattr(baselines_module, "saturate", _interrupted_once(baselines_module.saturate))
    plan = optimize("mlp", machine="cpu", devices=4)
    assert len(searched) == 1                                   # the scout's mesh; no mesh after the interrupt
    assert "interrupted (Ctrl-C)" in plan.saturation["search_limit"]
    assert plan.baselines["sequential"] is None


def test_ctrl_c_before_any_rule_spread_the_graph_is_said_not_a_crash(monkeypatch):
    # the unspread note formatted the stop reason as a limit's value ("--limit interrupted=..."): ValueError
    real, calls = session_module.Session.run, []

    def run(self, step, budget=None):
        calls.append(step)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, step, budget)

    monkeypatch.setattr(session_module.Session, "run", run)
    plan = optimize("mlp", machine="cpu", devices=2, baselines=False)
    assert plan.saturation["stop"] == STOP_INTERRUPTED
    assert plan.saturation["unspread"].startswith("saturation interrupted (Ctrl-C) before any parallel rule spread")
