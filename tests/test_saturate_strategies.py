"""Kinds of parallelism on a device mesh: read off plans, pinned by the user, and the Megatron-style grid."""

from __future__ import annotations

import pytest

from parsat.ir.parallelism import DATA, SEQUENCE, TENSOR, ZERO3, axis_uses, describe
from parsat.search.optimize import optimize
from parsat.ir.errors import OptimizeError
from parsat.search.strategies import Config, grid, pinned_meshes
from parsat.report.explain import explain_plan


@pytest.fixture(scope="module")
def transformer8():
    return optimize("transformer", machine="h100x8", devices=8)


def test_best_grid_is_priced_and_spelled_and_never_beats_the_plan(transformer8):
    data = transformer8.to_dict()
    grid_plan = data["baselines"]["best_grid"]
    assert grid_plan is not None and grid_plan["pcg"]["mesh"]["axes"]
    config = grid_plan["config"]
    assert config["dp"] * config["tp"] == 8 and config["zero"] in (0, 1, 3) and isinstance(config["sp"], bool)
    assert transformer8.totals.time_s <= grid_plan["time_s"] + 1e-12
    assert "best_grid: dp" in explain_plan(transformer8)


def test_pinned_tensor_degree_is_the_minor_axis_and_the_rest_is_searched():
    plan = optimize("transformer", machine="h100x8", devices=8, degrees={"tp": 4})
    uses = {u.name: u for u in axis_uses(plan.pcg)}
    assert plan.pcg.mesh.shape == (2, 4) and TENSOR in uses["tp"].kinds
    plan = optimize("transformer", machine="h100x8", devices=8, degrees={"dp": 8})
    assert [u.kinds - {ZERO3} for u in axis_uses(plan.pcg)] == [frozenset({DATA})]  # ZeRO-3 may shard it too
    assert describe(plan.pcg).startswith("DP 8 inside a node")


@pytest.mark.parametrize("degrees,words", [({"tp": 3}, "does not divide the 8 devices"),
                                           ({"dp": 2, "tp": 2}, "dp 2 x tp 2 = 4 devices"),
                                           ({"xp": 2}, "unknown parallelism xp"),
                                           ({"tp": 0}, "positive integer")])
def test_pins_that_cannot_hold_are_clear_errors(degrees, words):
    with pytest.raises(OptimizeError, match=words):
        optimize("mlp", machine="h100x8", devices=8, degrees=degrees)


def test_the_grid_covers_data_tensor_sequence_and_zero3():
    from parsat.ir.mesh import Mesh

    points = grid(Mesh.of((8, 8), 8))
    assert Config(0, 1, True, True, query_blocks=False) in points and \
        Config(0, 1, False, False, query_blocks=False) in points and len(points) == 4   # heads, never query blocks
    assert {p.tensor_axis for p in grid(Mesh.of((8,), 8))} == {None, 0}      # pure DP or pure TP in a node
    assert {p.tensor_axis for p in grid(Mesh.of((64,), 8))} == {None}          # TP across nodes is not a grid point
    assert pinned_meshes({}, 8, 8) == []


def test_hand_built_plans_are_described_by_what_their_axes_do():
    """The backend's reference plans (benchmarks/mesh_plans.py): DP x TP, TP x SP, ZeRO-3 x TP."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import mesh_plans
    from parsat.dsl.checker import load_checked

    library = load_checked(None)
    assert describe(mesh_plans.dp_tp_mlp(library).pcg).startswith("DP 2")
    assert "TP 2" in describe(mesh_plans.dp_tp_mlp(library).pcg)
    text = describe(mesh_plans.tp_sp_block(library).pcg)
    assert "TP 2" in text and "sequence-parallel norms" in text
    assert "ZeRO-3 over DP" in describe(mesh_plans.zero3_tp_mlp(library).pcg)


def test_best_grid_reports_its_fastest_point_when_none_fits(kept_programs):
    """A grid whose every configuration needs more memory than the device has still says what the fastest
    one would take and how much it needs (a baseline shown as 'needs X GiB'), never None."""
    from dataclasses import replace as _replace

    from parsat.ir.machine import Machine
    from parsat.ir.models import build_example
    from parsat.search.baselines import best_grid
    from parsat.search.extract import node_costs
    from parsat.dsl.checker import resolve_library
    from parsat.egraph.runner import Limits
    from parsat.egraph.saturate import saturate

    library = resolve_library(None)
    graph = build_example("transformer", {}, library)
    machine = Machine.resolve("h100x8").with_devices(8)
    # the program kept in the cache folder (the conftest's `kept_programs`): this test is about `best_grid`, and
    # compiling the program was most of its CPU
    result = saturate(graph, library, library.rules, 8, Limits(iterations=4), caches=kept_programs)
    roots = [result.classes[n] for n in graph.outputs]
    priced = node_costs(result.snapshot, graph, library, machine)
    roomy = best_grid(result, graph, library, machine, roots, Limits(seconds=30), True, priced, {})
    assert roomy is not None and roomy.totals.fits(machine)
    tiny = _replace(machine, memory_capacity=1024)
    cramped = best_grid(result, graph, library, tiny, roots, Limits(seconds=30), True, priced, {})
    assert cramped is not None and not cramped.totals.fits(tiny)
    assert cramped.config["dp"] * cramped.config["tp"] == 8


def _no_rules():
    """The shipped operators without a rule: no joint plan splits anything."""
    from dataclasses import replace as replaced

    from parsat.dsl import ast
    from parsat.dsl.checker import resolve_library
    from parsat.dsl.library import Library

    shipped = resolve_library(None)
    return Library(tuple(replaced(m, items=tuple(d for d in m.items if not isinstance(d, ast.RuleDecl)))
                         for m in shipped.modules), shipped.sources)


def test_a_data_parallel_pin_the_rules_cannot_reach_is_kept_by_the_data_parallel_point():
    """A data-parallel plan exists whatever the rules reach: `--degrees dp=2` with a library of operators and no
    rule (so no joint plan splits anything) answers with the grid's data-parallel point, built apart from the
    e-graph, and says why; before, the pin was refused as one that cannot hold."""
    import parsat

    plan = parsat.optimize("mlp", machine="cpu", devices=2, degrees={"dp": 2}, rules=_no_rules(),
                           allow_unverified=True)
    assert plan.extraction["chosen"] == "best_grid"
    assert plan.extraction["fallback"].startswith("no joint plan keeps --degrees dp=2")
    assert plan.pcg.mesh.shape == (2,) and plan.pcg.mesh.axes[0].name == "dp"
    inputs = [n for n in plan.pcg.nodes if n.kind == "parallel" and n.op == "partition"
              and plan.pcg.nodes[n.inputs[0]].role == "input"]
    assert inputs and all(dict(n.attrs)["dim"] == 0 for n in inputs)   # the batch, split on the dp axis
    assert "no joint plan keeps --degrees dp=2" in explain_plan(plan)


def test_where_no_joint_plan_fits_the_grid_point_that_fits_is_the_plan():
    """Unpinned, a step whose every mesh's joint plan is too large answers with the baseline that fits and says
    why; before, it failed with DoesNotFit though a grid point fitted (mcore-119b's stage at 4 stages x 16
    micro-batches: every joint plan 444+ GiB where the grid's tp 8 point fits, so the free search missed the
    published configuration it could have pinned). Here no rule splits anything: the joint plan is the whole
    MLP on each device (6.7 MiB), the grid's tensor-parallel point half of it, the device 4.77 MiB. One
    micro-batch count is pinned: a count search's scouts still raise (the micro-batch search reads DoesNotFit
    to try other counts), so without the pin this MLP still fails (a known gap: docs/MESH.md "Time")."""
    from dataclasses import replace as replaced

    import parsat
    from parsat.ir.errors import DoesNotFit
    from parsat.ir.machine import Machine

    machine = replaced(Machine.resolve("cpu"), memory_capacity=5_000_000)
    plan = parsat.optimize("mlp", machine=machine, devices=2, rules=_no_rules(), allow_unverified=True, microbatches=1)
    assert plan.extraction["chosen"] == "best_grid" and plan.totals.fits(machine)
    assert plan.extraction["fallback"].startswith("no joint plan (mesh gpu 2: no plan fits in memory")
    with pytest.raises(DoesNotFit):   # where nothing fits, the error stands
        parsat.optimize("mlp", machine=replaced(machine, memory_capacity=1_000_000), devices=2, rules=_no_rules(),
                        allow_unverified=True, microbatches=1)
