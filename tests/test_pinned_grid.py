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

from dataclasses import replace

from parsat import optimize
from parsat.ir.placement import Placement
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
