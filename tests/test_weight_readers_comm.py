"""A weight's partitions that do not store it: measured communication equals predicted on 2x2 meshes.

The backend stores a weight as the piece its chain of partitions gives when
each partition is the only reader of the node before it
(`ir.pcg.weight_storage`); a partition anywhere else (after a replicate or
an all_gather of the weight, or beside another reader of it: a tied
weight) slices a weight held whole and all-gathers its gradient in
backward. The cost model used to price every partition of a weight as
storage, free: the optimizer's 2x2 plans for `transformer` (a layernorm
vector replicated, then partitioned and all-gathered for ZeRO-3) and `gpt`
(the tied embedding read by two partitions) sent more than their plans
predicted (benchmarks/mesh_results.md).

Here: a hand-built 2x2 plan with both patterns, its communication written
out from the ring formulas, equal to the cost model's (`solve.price_pcg`)
and to what 4 gloo ranks send, with `--check`; the optimizer's own 2x2
plans for a small transformer (fast) and gpt (slow) run the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from mesh_optimizer_run import CASES, TWO_BY_TWO  # noqa: E402
from mesh_plans import Collective, MeshPlanBuilder  # noqa: E402

from parsat.api import optimize  # noqa: E402
from parsat.backend.cli import load_plan  # noqa: E402
from parsat.backend.executor import Prediction, TrainConfig, operator_library, run_many  # noqa: E402
from parsat.backend.launch import LaunchConfig, launch  # noqa: E402
from parsat.ir.costs import totals  # noqa: E402
from parsat.ir.graph import GraphBuilder  # noqa: E402
from parsat.ir.machine import Machine  # noqa: E402
from parsat.ir.mesh import Mesh  # noqa: E402
from parsat.ir.pcg import WEIGHT_PIECE, WEIGHT_VALUE, pcg_roles, weight_storage  # noqa: E402
from parsat.search.solve import price_pcg  # noqa: E402

LIBRARY = operator_library()
B, K = 8, 4
STEPS = 2


def tied_graph():
    """z = relu(x @ w) @ w + v: `w` read by two operators (a tied weight)."""
    g = GraphBuilder(LIBRARY, name="tied")
    x, w, v = g.input("x", [B, K]), g.weight("w", [K, K]), g.weight("v", [K])
    h = g.op("relu", g.op("matmul", x, w, name="mm1"), name="act")
    g.output(g.op("bias_add", g.op("matmul", h, w, name="mm2"), v, name="out"))
    return g.build()


def tied_plan():
    """DP x TP: `w` column-parallel for mm1 and row-parallel for mm2 (two partitions of one weight: held whole,
    each partition gathers its gradient), the output cut on tp as well, and `v` replicated on tp, then
    partitioned and all-gathered on dp (ZeRO-3 of a replicated value: the partition does not store it)."""
    p = MeshPlanBuilder(Mesh.of((2, 2), names=("dp", "tp")), LIBRARY)
    x = p.chain(p.leaf("x", (B, K), "input"), ("partition", "dp", 0), ("replicate", "tp"))
    w = p.leaf("w", (K, K), "weight")
    w_col = p.chain(w, ("partition", "tp", 1), ("replicate", "dp"))
    w_row = p.chain(w, ("partition", "tp", 0), ("replicate", "dp"))
    h = p.op("relu", p.op("matmul", x, w_col, origin="mm1"), origin="act")
    y = p.chain(p.op("matmul", h, w_row, origin="mm2"), ("reduce", "tp"), ("partition", "tp", 0))
    v = p.chain(p.leaf("v", (K,), "weight"), ("replicate", "tp"), ("partition", "dp", 0), ("all_gather", "dp", 0))
    out = p.op("bias_add", y, v, origin="out")
    return p.pcg((out,), ("out",))


# The ring formulas (benchmarks/mesh_plans.py): n is what one group's collective works on.
TIED_COLLECTIVES = (
    Collective("tp", "all_gather", 2, K * K),                     # w's column piece: its gradient gathered whole
    Collective("tp", "all_gather", 2, K * K),                     # w's row piece: likewise
    Collective("dp", "all_reduce", 2, K * K // 2, grad_sync=True),  # w's column piece's gradient over dp
    Collective("dp", "all_reduce", 2, K * K // 2, grad_sync=True),  # w's row piece's
    Collective("tp", "all_reduce", 2, B // 2 * K),                # mm2's partial sums
    Collective("tp", "all_gather", 2, B // 2 * K),                # the output's tp cut, in backward
    Collective("tp", "all_reduce", 2, K, grad_sync=True),         # v replicated on tp
    Collective("dp", "all_gather", 2, K),                         # v's dp slice of the replicated value, backward
    Collective("dp", "all_gather", 2, K),                         # v gathered on dp (ZeRO-3) ...
    Collective("dp", "reduce_scatter", 2, K, grad_sync=True),     # ... and its gradient reduce-scattered
)


def test_partitions_that_do_not_store_the_weight_are_known():
    pcg = tied_plan()
    chains = weight_storage(pcg)
    by_name = {n.op: n.id for n in pcg if n.kind == "leaf"}
    assert chains[by_name["w"]] == (by_name["w"],)    # two readers: held whole
    assert chains[by_name["v"]] == (by_name["v"],)    # read by a replicate: held whole
    roles = pcg_roles(pcg)
    slicing = [n for n in pcg if n.kind == "parallel" and n.op == "partition" and roles.get(n.id) == WEIGHT_VALUE]
    assert len(slicing) == 3 and not any(r == WEIGHT_PIECE for r in roles.values())


def test_the_cost_model_prices_what_the_formulas_say():
    pcg = tied_plan()
    costs = price_pcg(pcg, LIBRARY, Machine.preset("cpu").with_devices(4))
    figures = totals(costs, Machine.preset("cpu"))
    world = pcg.mesh.world
    assert figures.comm_elements == sum(c.sent(world) for c in TIED_COLLECTIVES) == 8 * K * K + 3 * B * K + 10 * K
    assert figures.grad_sync_elements == sum(c.sent(world) for c in TIED_COLLECTIVES if c.grad_sync)


def _optimizer_plans(tmp_path, model: str, pinned_only: bool = False) -> list[tuple]:
    """(label, pcg, graph, prediction) of the optimizer's 2x2 plans for `model`, read back from their files."""
    out = []
    for degrees in ([] if pinned_only else [None]) + [{"dp": 2, "tp": 2}]:
        label = f"{model}-{'pinned' if degrees else 'free'}"
        path = tmp_path / f"{label}.json"
        optimize(model, machine=TWO_BY_TWO, devices=4, sizes=CASES[model], degrees=degrees, baselines=False).save(path)
        out.append((label, *load_plan(str(path), 4)))
    return out


def _run_and_compare(plans: list[tuple]) -> None:
    config = TrainConfig(steps=STEPS, optimizer="adam", check=True)
    jobs = [(label, pcg, graph) for label, pcg, graph, _ in plans]
    results = launch(run_many, (jobs, config), LaunchConfig(nproc=4, backend="gloo", timeout_s=600))[0]
    for label, _pcg, _graph, predicted in plans:
        job = results[label]
        assert job["nonfinite"] == 0 and job["max_rel_diff"] is not None
        assert job["max_rel_diff"] <= config.tolerance, (label, job["worst"], job["max_rel_diff"])
        assert job["sent"] == predicted.comm_elements, (label, job["sent"], predicted.comm_elements)
        assert job["grad_sync"] == predicted.grad_sync_elements, (label, job["grad_sync"])


def test_hand_built_and_transformer_plans_send_what_they_predict(tmp_path):
    """The tied plan (prediction: the cost model's) and the optimizer's free and dp=2,tp=2 transformer plans,
    in one 4-rank launch."""
    pcg = tied_plan()
    figures = totals(price_pcg(pcg, LIBRARY, Machine.preset("cpu").with_devices(4)), Machine.preset("cpu"))
    predicted = Prediction(comm_elements=figures.comm_elements, grad_sync_elements=figures.grad_sync_elements)
    _run_and_compare([("tied", pcg, tied_graph(), predicted)] + _optimizer_plans(tmp_path, "transformer"))


@pytest.mark.slow
def test_gpt_plan_with_a_tied_embedding_sends_what_it_predicts(tmp_path):
    """The optimizer's dp=2,tp=2 plan for the small gpt reads the tied embedding through two partitions."""
    plans = _optimizer_plans(tmp_path, "gpt", pinned_only=True)
    roles = pcg_roles(plans[0][1])
    assert any(n.op == "partition" and roles.get(n.id) == WEIGHT_VALUE for n in plans[0][1]), \
        "the plan no longer reads a weight through a partition that does not store it"
    _run_and_compare(plans)
