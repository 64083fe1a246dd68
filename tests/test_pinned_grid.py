"""A pinned search returns a plan that keeps its pins, and the grid point of the pinned layout where it is faster.

The joint plan of a pinned search is extracted within the pins, but its
extraction is bounded, so the grid point of the same degrees (Megatron's
column/row layout, a restriction of the same e-graph or built directly) can
be the faster plan; a grid point whose PCG leaves a pinned axis idle (an
MLP's dp 2 point computed whole on both ranks) never stands for the pin
(`search.step.keeps_pins`, docs/MESH.md "Pins are promises"); nor does a
joint plan, a pipeline stage's included (`search.step.idle_pinned_axes`).
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from parsat import optimize
from parsat.ir.errors import OptimizeError
from parsat.ir.parallelism import describe
from parsat.ir.placement import Placement
from parsat.search.request import resolve_request
from parsat.search.step import idle_pinned_axes, uses_pinned_axes

PINS = {"tp": 8, "dp": 2}
GPT = {"blocks": 1, "hidden": 1024, "heads": 16, "seq": 512, "vocab": 32000, "batch": 8}
MLP = {"batch": 16, "d_in": 30, "d_hidden": 7, "d_out": 5}
SMALL_GPT = {"blocks": 2, "hidden": 64, "heads": 4, "batch": 8, "seq": 32, "vocab": 256}


def test_the_grid_point_of_the_pinned_layout_is_the_plan_where_it_is_faster():
    plan = optimize("gpt", machine="h100x8", devices=16, sizes=GPT, degrees=PINS, pipeline=False)
    joint = plan.saturation["meshes"][0]["time_s"]
    config = plan.baseline_plans["best_grid"].config
    assert plan.extraction["chosen"] == "best_grid" and plan.totals.time_s < joint
    assert (config["dp"], config["tp"]) == (2, 8) and uses_pinned_axes(plan.pcg, PINS)
    assert plan.totals.time_s == plan.baselines["best_grid"].time_s


def test_a_grid_point_that_leaves_a_pinned_axis_idle_never_stands_for_the_pin():
    plan = optimize("mlp", machine="cpu", devices=2, sizes=MLP, degrees={"dp": 2})
    assert plan.extraction["chosen"] == "joint" and uses_pinned_axes(plan.pcg, {"dp": 2})
    unpinned = optimize("mlp", machine="cpu", devices=2, sizes=MLP)
    assert not uses_pinned_axes(unpinned.pcg, {"dp": 2})   # the unsplit plan the cost model prefers


def test_a_pinned_pipeline_s_tensor_axis_splits_work_in_each_stage():
    """`--degrees pp=2,tp=2` on 4 cpu devices: each stage's plan on its tp 2 mesh splits work on tp, the joint one
    (`baselines=False`) and whichever the baselines leave. On the `cpu` machine a collective costs more than this
    tiny step, and the stage plan used to come back with nothing split on tp (every tp rank the same work)."""
    for baselines in (False, True):
        plan = optimize("gpt", machine="cpu", devices=4, sizes=SMALL_GPT, degrees={"pp": 2, "tp": 2},
                        baselines=baselines)
        assert plan.pipeline.degree == 2 and plan.pipeline.stage_devices == 2 and plan.pcg.mesh.names == ("tp",)
        assert idle_pinned_axes(plan.pcg, {"tp": 2}) == {}, plan.extraction
        assert baselines or plan.extraction["chosen"] == "joint"
        weights = {n.id for n in plan.pcg.nodes if n.kind == "leaf" and n.role == "weight"}
        assert any(n.op == "partition" and n.inputs[0] in weights for n in plan.pcg.nodes)   # Megatron's splits
    # the same PCG with every value whole on tp is what the pin refuses, and says why
    idle = replace(plan.pcg, nodes=tuple(replace(n, placement=Placement.whole(1)) if n.kind == "op" else n
                                         for n in plan.pcg.nodes))
    assert idle_pinned_axes(idle, {"tp": 2, "pp": 2}) == {"tp": "no operator is split on it, so every rank of "
                                                                "the axis does the same work"}


def test_a_pinned_sequence_degree_cuts_the_norms_along_the_sequence_on_the_tensor_axis():
    """`--degrees tp=2,sp=2` is Megatron-LM's sequence parallelism: some operator computes a piece cut along the
    sequence on tp (the joint plan, or the grid point with `sp` on where the joint plan cuts nothing); `sp=1`
    pins it off, and nothing is cut along the sequence. The unpinned cpu plan of this gpt cuts nothing (a
    collective costs more than this tiny step), so the pin is what turns it on."""
    on = optimize("gpt", machine="cpu", devices=2, sizes=SMALL_GPT, degrees={"tp": 2, "sp": 2})
    off = optimize("gpt", machine="cpu", devices=2, sizes=SMALL_GPT, degrees={"tp": 2, "sp": 1})
    assert idle_pinned_axes(on.pcg, {"tp": 2}, sequence=True) == {}, on.extraction
    assert on.extraction["chosen"] == "joint" or on.baseline_plans["best_grid"].config["sp"] is True
    assert idle_pinned_axes(off.pcg, {"tp": 2}, sequence=False) == {}
    assert "sp" in idle_pinned_axes(off.pcg, {"tp": 2}, sequence=True)   # the off plan would break an on pin
    assert "sp" in idle_pinned_axes(on.pcg, {"tp": 2}, sequence=False)
    assert "sequence-parallel" in describe(on.pcg) and "sequence-parallel" not in describe(off.pcg)


@pytest.mark.parametrize("degrees, says", [
    ({"sp": 2}, "needs tp pinned to the same degree (tp=2,sp=2)"),
    ({"tp": 2, "sp": 4}, "(sp=2 with tp=2)"),
    ({"tp": 2, "sp": 0}, "sp must be a positive integer"),
    ({"tp": 2, "sp": True}, "sp must be a positive integer")])
def test_a_sequence_pin_that_cannot_hold_is_refused_before_the_rules_load(degrees, says):
    def no_rules(_library):
        raise AssertionError("the rules were chosen before the pin was checked")
    with pytest.raises(OptimizeError, match=re.escape(says)):
        resolve_request("gpt", "cpu", None, None, 2, sizes=SMALL_GPT, degrees=degrees, choose_rules=no_rules)


def test_a_pinned_recomputation_is_the_policy_of_every_independent_grid_point():
    """`--recompute blocks` pinned (SC'21's Megatron-LM rows): the grid built apart from the e-graph prices every
    point recomputing blocks, so the points that fit keeping their activations still keep the pin
    (`keeps_pins`) and may be the plan. The grid recomputed only where a point did not fit: sc21-18.4b's
    sequence-parallel layout (t 8) fitted keeping its activations, so no independent point kept the pin and the
    pinned search never compared it (issue 31)."""
    from parsat.search.mesh import CandidateSteps
    from parsat.search.request import step_context
    from parsat.search.step import independent_points, keeps_pins

    found = {}
    for recompute in ("auto", "blocks"):
        request = resolve_request("gpt", "h100x8", None, None, 16, sizes=GPT, degrees=PINS, recompute=recompute)
        step = step_context(request, 1)
        steps = CandidateSteps(request.library, step.machine, step.graph.microbatches, request.simulations)
        points = independent_points(step, steps)
        found[recompute] = [p for p in points if keeps_pins(p, request)]
        assert points and all(step.memory.fits(p) for p in points)
    assert found["auto"] and all(p.pcg.recompute == "none" for p in found["auto"])   # they fit keeping activations
    assert {p.config["sp"] for p in found["blocks"]} == {False, True}
    assert all(p.pcg.recompute == "blocks" and p.config["recompute"] == "blocks" for p in found["blocks"])
    fastest = min(found["blocks"], key=lambda p: p.totals.time_s)
    assert fastest.totals.simulation is not None   # simulated: it may be the best grid point


def test_a_pinned_zero_stage_0_never_stands_for_a_zero_3_grid_point():
    """`--degrees zero=0` (SC'21's rows: the weights' state whole on every data-parallel rank): a grid point that
    stores the weights split over the data axis (ZeRO-3, whose PCG reports stage 0: its sharding is in the
    weights' storage, not `PCG.zero`) does not keep the pin; `zero=3` keeps only those."""
    from parsat.search.mesh import CandidateSteps
    from parsat.search.request import step_context
    from parsat.search.step import independent_points, keeps_pins

    kept = {}
    for zero in (0, 3):
        request = resolve_request("gpt", "h100x8", None, None, 8, sizes=GPT, degrees={"dp": 8, "zero": zero})
        step = step_context(request, 1)
        steps = CandidateSteps(request.library, step.machine, step.graph.microbatches, request.simulations)
        points = independent_points(step, steps)
        assert {p.config["zero"] for p in points} >= {0, 3}   # the grid has both
        kept[zero] = {p.config["zero"] for p in points if keeps_pins(p, request)}
    assert kept == {0: {0}, 3: {3}}
