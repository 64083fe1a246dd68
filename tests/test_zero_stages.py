"""ZeRO stages 1 and 2 (`PCG.zero`): a weight's state sharded over the replicas that synchronise its gradient.

Priced by the cost model (`cost.model.shards_state`), simulated, chosen by the search where a plan would not
fit without it, pinned with `--degrees zero=N`, written to and read from the plan JSON, and run by the backend
(`backend.state_shards`) with `--check` against one process and its communication equal to the prediction.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat import optimize
from parsat.cost.model import parallel_cost
from parsat.ir.errors import OptimizeError
from parsat.ir.machine import Machine
from parsat.ir.pcg import Degrees
from parsat.ir.plan import PlanError, load_plan_dict, pcg_from_dict

MLP = {"batch": 16, "d_in": 30, "d_hidden": 7, "d_out": 5}   # 30 x 7 = 210 and 7 x 5 = 35: padded shards
CPU = Machine.resolve("cpu")


def _replicate(zero: int, microbatches: int = 1, degree: int = 4):
    whole, copies = Degrees((1, 1), 1, 1), Degrees((1, 1), degree, 1)
    return parallel_cost("replicate", degree, (1000, 10), whole, copies, CPU, "weight", degree, zero=zero,
                         microbatches=microbatches)


def test_a_synchronised_weight_s_state_is_sharded_and_its_sync_sends_what_an_all_reduce_sends():
    plain, one, two = _replicate(0), _replicate(1), _replicate(2)
    held = CPU.precision_spec.parameter_bytes("adam")
    assert plain.memory_bytes == 10_000 * held.total
    assert one.memory_bytes == round(10_000 * held.sharded(1, 4)) < plain.memory_bytes
    assert two.memory_bytes == round(10_000 * held.sharded(2, 4)) < one.memory_bytes
    assert one.comm_elements == two.comm_elements == plain.comm_elements == plain.grad_sync_elements
    assert [line.split(" x")[0] for line in one.collectives] == ["bwd reduce-scatter", "bwd all-gather"]
    assert one.optimizer_s == pytest.approx(plain.optimizer_s / 4)
    # stage 2 cannot accumulate a sharded gradient: one reduce-scatter per micro-batch
    assert _replicate(2, microbatches=3).comm_elements == plain.comm_elements + 2 * plain.comm_elements // 2
    assert _replicate(1, microbatches=3).comm_elements == plain.comm_elements


def test_a_weight_stored_split_is_not_sharded_again():
    piece = Degrees((4, 1), 1, 1)
    cost = parallel_cost("partition", 4, (1000, 10), Degrees((1, 1), 1, 1), piece, CPU, "weight", 4, zero=1)
    assert cost.collectives == () and cost.memory_bytes == 2_500 * CPU.precision_spec.parameter_bytes("adam").total


def test_a_pinned_stage_is_the_plan_s_and_survives_its_json(tmp_path):
    plans = {z: optimize("mlp", machine="cpu", devices=2, sizes=MLP, degrees={"dp": 2, "zero": z}) for z in (0, 1, 2)}
    assert [plans[z].pcg.zero for z in (0, 1, 2)] == [0, 1, 2]
    memory = [plans[z].totals.peak_memory_bytes for z in (0, 1, 2)]
    assert memory[0] > memory[1] > memory[2]
    assert plans[1].totals.grad_sync_elements == plans[0].totals.grad_sync_elements
    path = tmp_path / "plan.json"
    plans[1].save(path)
    data = load_plan_dict(path)
    assert data["zero"] == 1 and pcg_from_dict(data).zero == 1
    data["zero"] = 5
    bad = tmp_path / "bad.json"
    bad.write_text(__import__("json").dumps(data))
    with pytest.raises(PlanError, match="zero"):
        load_plan_dict(bad)


def test_pinned_zero_3_stores_every_weight_split_and_needs_a_data_axis():
    plan = optimize("mlp", machine="cpu", devices=2, sizes=MLP, degrees={"dp": 2, "zero": 3})
    assert plan.pcg.zero == 0
    assert all(node.op != "replicate" for node in plan.pcg.nodes if node.kind == "parallel"
               and plan.pcg.node(node.inputs[0]).kind == "leaf" and plan.pcg.node(node.inputs[0]).role == "weight")
    assert any(node.op == "all_gather" for node in plan.pcg.nodes)
    with pytest.raises(OptimizeError, match="dp=N"):
        optimize("mlp", machine="cpu", devices=2, sizes=MLP, degrees={"zero": 3})
    with pytest.raises(OptimizeError, match="ZeRO stage"):
        optimize("mlp", machine="cpu", devices=2, sizes=MLP, degrees={"dp": 2, "zero": 4})


def test_the_search_shards_the_state_where_the_plan_would_not_fit_otherwise():
    """A device smaller than every plan without sharded state needs (ZeRO-3's included: it keeps a gathered weight
    until backward) but larger than ZeRO-2's: the plan comes back with its state sharded, not refused (the mlp has
    no blocks to recompute); with room, nothing is sharded."""
    need = {z: optimize("mlp", machine="cpu", devices=2, sizes=MLP, degrees={"dp": 2, "zero": z}).totals.memory_bytes
            for z in (0, 1, 2, 3)}
    assert need[2] < min(need[0], need[1], need[3])
    tight = replace(CPU, memory_capacity=(need[2] + min(need[0], need[1], need[3])) // 2)
    plan = optimize("mlp", machine=tight, devices=2, sizes=MLP, degrees={"dp": 2})
    # memory as it decides (`Totals.memory_bytes`: the simulated peak, as `parsat run` holds it, with SGD, where
    # ZeRO-1 shards nothing): ZeRO-2, or weights stored split (ZeRO-3: gathered by `all_gather`)
    stored_split = any(node.op == "all_gather" for node in plan.pcg.nodes if node.kind == "parallel")
    assert (plan.pcg.zero == 2 or stored_split) and plan.totals.fits(plan.machine)
    assert optimize("mlp", machine="cpu", devices=2, sizes=MLP, degrees={"dp": 2}).pcg.zero == 0


torch = pytest.importorskip("torch")


def test_the_backend_trains_a_zero_plan_as_one_process_does_and_sends_what_it_predicts():
    from parsat.backend.executor import ExecutionError, TrainConfig, check_verdict, run_many, run_plan
    from parsat.backend.launch import LaunchConfig, launch
    from parsat.backend.state_shards import check_runnable

    plans = {zero: optimize("mlp", machine="cpu", devices=2, sizes=MLP, degrees={"dp": 2, "zero": zero},
                            microbatches=microbatches) for zero, microbatches in ((1, 2), (2, 1))}
    config = TrainConfig(steps=3, optimizer="adam", lr=0.05, check=True)
    jobs = [(f"zero{zero}", plan.pcg, plan.graph) for zero, plan in plans.items()]   # both in one 2-rank launch
    results = launch(run_many, (jobs, config), LaunchConfig(nproc=2, backend="gloo", timeout_s=300))[0]
    for zero, plan in plans.items():
        check_runnable(plan.pcg, plan.graph.microbatches)   # what `run_plan` asks before any rank starts: runnable
        job = results[f"zero{zero}"]
        assert check_verdict(job, config) == "passed", (zero, job["max_rel_diff"], job["nonfinite"], job["worst"])
        assert job["grad_sync"] == plan.totals.grad_sync_elements, (zero, job["grad_sync"])
        assert job["sent"] == plan.totals.comm_elements, (zero, job["sent"])
    stage2 = optimize("mlp", machine="cpu", devices=2, sizes=MLP, degrees={"dp": 2, "zero": 2}, microbatches=2)
    with pytest.raises(ExecutionError, match="ZeRO-2"):
        run_plan(stage2.pcg, 2, TrainConfig(steps=1, check=True), graph=stage2.graph, backend="gloo")


def test_the_gradient_s_reduction_is_what_runs_beside_the_backward_not_the_gather_after_the_update():
    plain, one = _replicate(0), _replicate(1)
    assert plain.comm_s > 0 and plain.grad_reduce_s == pytest.approx(plain.comm_s)   # the all-reduce, all of it
    # ZeRO-1: the reduce-scatter only; the all-gather of the updated shards waits for the optimizer
    assert 0 < one.grad_reduce_s < one.comm_s
    assert _replicate(2, microbatches=3).grad_reduce_s > one.grad_reduce_s   # stage 2: a reduce-scatter per micro-batch


def test_a_pinned_zero_1_search_may_answer_with_the_pinned_layout_holding_its_state_sharded():
    """`--degrees zero=1` with the layout pinned: the grid's point of that layout comes with its state sharded
    (Megatron's distributed optimizer), so the pinned search is never slower than that layout run with ZeRO-1,
    whose updated shards' gathers overlap the next forward (`cost.schedules.ParamGathers`)."""
    from parsat.cost.pcg_tasks import DDP, simulate_pcg
    from parsat.dsl.library import load_library

    sizes = {"blocks": 2, "batch": 32, "seq": 64, "hidden": 256, "heads": 4, "vocab": 2048}
    plain = optimize("gpt", machine="h100x8", devices=16, sizes=sizes, degrees={"dp": 16, "zero": 0},
                     pipeline=False, microbatches=2)
    sharded = optimize("gpt", machine="h100x8", devices=16, sizes=sizes, degrees={"dp": 16, "zero": 1},
                       pipeline=False, microbatches=2)
    assert plain.pcg.zero == 0 and sharded.pcg.zero == 1
    library = load_library()[0]
    layout = simulate_pcg(replace(plain.pcg, zero=1), library, plain.machine, DDP, microbatches=2).step_s
    assert sharded.totals.time_s <= layout * (1 + 1e-9)
