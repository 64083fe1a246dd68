"""Ctrl-C ends a search with the best plan found so far, and says so; only an interrupt before any plan is an
interrupt for the user (exit 130)."""

from __future__ import annotations

import pytest

import parsat.search.step as step_module
from parsat.egraph import session as session_module
from parsat.egraph.runner import STOP_INTERRUPTED, Limits
from parsat.egraph.saturate import saturate
from parsat.ir.models import build_example
from parsat.search.optimize import optimize


def test_ctrl_c_inside_egglog_ends_saturation_with_the_e_graph_as_it_stands(monkeypatch):
    real, calls = session_module.Session.run, []

    def run(self, step):
        calls.append(step)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, step)

    monkeypatch.setattr(session_module.Session, "run", run)
    graph = build_example("mlp")
    from parsat.dsl.checker import resolve_library

    library = resolve_library(None)
    result = saturate(graph, library, library.rules, 2, Limits())
    assert result.stop == STOP_INTERRUPTED and "interrupted" in result.note
    assert result.snapshot.enodes > 0          # what was there is read back, for extraction


@pytest.mark.parametrize("interrupted", [2, 3])
def test_ctrl_c_after_a_mesh_returns_that_mesh_s_plan_and_says_what_it_left_out(monkeypatch, interrupted):
    real, calls = step_module.search_mesh, []

    def search_mesh(step, mesh, config, pins, clock):
        calls.append(mesh)
        if len(calls) == interrupted:
            raise KeyboardInterrupt
        return real(step, mesh, config, pins, clock)

    monkeypatch.setattr(step_module, "search_mesh", search_mesh)
    plan = optimize("mlp", machine="cpu", devices=4, baselines=False)
    # the scout searches the one-axis mesh; then every mesh is searched at its count: Ctrl-C cuts that search
    # at its one-axis mesh (the scout's plan comes back) or at its 2 x 2 mesh (the one-axis mesh's plan)
    assert len(calls) == interrupted
    assert plan.devices == 4 and "interrupted (Ctrl-C)" in plan.saturation["search_limit"]


def test_ctrl_c_before_any_plan_is_the_user_s_interrupt(monkeypatch):
    def search_mesh(step, mesh, config, pins, clock):
        raise KeyboardInterrupt

    monkeypatch.setattr(step_module, "search_mesh", search_mesh)
    with pytest.raises(KeyboardInterrupt):
        optimize("mlp", machine="cpu", devices=4, baselines=False)
