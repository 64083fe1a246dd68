"""Joint beats sequential (issue 15): an algebraic choice one device makes closes the cheaper parallel plan.

On `factorized`, relu((h @ u) @ v) with u [hidden, rank], one device computes
h @ (u @ v) with fewer FLOPs once rank > tokens * hidden / (2 * tokens - hidden),
so the sequential baseline (algebraic rules extracted on one device first)
reassociates; split over the contraction, its devices must then add up
[tokens, hidden] partial sums, where the joint search keeps the product as
written and adds up [tokens, rank] ones (benchmarks/joint_results.md).
"""

from __future__ import annotations

import pytest

from parsat.api import optimize
from parsat.dsl.library import load_library
from parsat.ir.models import build_example
from parsat.search.optimize import optimize as optimize_with
from parsat.search.baselines import pcg_to_graph

SIZES = {"tokens": 4096, "hidden": 2048, "rank": 1408}   # rank above 4096 * 2048 / (2 * 4096 - 2048) = 1365.3


@pytest.fixture(scope="module")
def shipped():
    return load_library()[0]


def _matmul_shapes(pcg) -> set[tuple[int, ...]]:
    return {tuple(n.shape) for n in pcg.nodes if n.kind == "op" and n.op == "matmul"}


def _one_device_time(pcg, graph, library) -> float:
    """The algebraic form `pcg` computes (its parallel operators left out), as written, on one device."""
    form = pcg_to_graph(pcg, graph, library, drop_parallel=True)
    plan = optimize_with(form, "h100x8", library, devices=1, baselines=False, choose_rules=lambda _lib: ([], "none"))
    return plan.totals.time_s


def test_joint_keeps_the_association_whose_partial_sums_are_narrow(shipped):
    graph = build_example("factorized", SIZES, shipped)
    plan = optimize(graph, machine="h100x8", devices=8, rules=shipped, allow_unverified=True)
    # the plan comes from the joint e-graph: the joint extraction or a grid/Megatron restriction of the same
    # e-graph, which the step simulator may rank first (they have the algebraic rewrites too)
    assert plan.extraction["chosen"] in ("joint", "best_grid", "megatron")
    sequential = plan.baseline_plans["sequential"].pcg
    assert plan.baselines["sequential"].time_s > 1.03 * plan.totals.time_s

    tokens, hidden, rank = SIZES["tokens"], SIZES["hidden"], SIZES["rank"]
    assert (tokens, rank) in _matmul_shapes(plan.pcg) and (hidden, hidden) not in _matmul_shapes(plan.pcg)
    assert (hidden, hidden) in _matmul_shapes(sequential) and (tokens, rank) not in _matmul_shapes(sequential)

    # Not a tie the joint search broke: on one device the sequential baseline's form is strictly cheaper.
    assert _one_device_time(sequential, graph, shipped) < _one_device_time(plan.pcg, graph, shipped)

    # What the reassociation costs in parallel: where the plan splits a contraction it adds up [tokens, rank]
    # partial sums across devices, never a hidden-wide product (on GPUs the fastest plan here is data parallel
    # with ZeRO-1, which sums no activation at all: only the loss over the data ranks); the sequential one has
    # no such tensor and moves a hidden-wide one instead: a [tokens, hidden] activation (it reduces that
    # product's partial sums or gathers h) or, under data parallelism, the [hidden, hidden] product weight's
    # gradient, whichever its sizes and the GEMMs' measured rates make cheaper.
    by_id = {n.id: n for n in plan.pcg.nodes}
    summed = {tuple(by_id[n.inputs[0]].shape) for n in plan.pcg.nodes if n.op in ("reduce", "reduce_scatter")}
    assert summed - {()} <= {(tokens, rank)}, summed
    costs = plan.baseline_plans["sequential"].costs
    costliest = max((n for n in sequential.nodes if n.kind == "parallel"), key=lambda n: costs[n.id].comm_s)
    assert tuple(costliest.shape) in ((tokens, hidden), (hidden, hidden))
    assert not any(tuple(n.shape) == (tokens, rank) for n in sequential.nodes if n.kind == "parallel")
