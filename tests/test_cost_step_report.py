"""The simulated step in the plan: every candidate simulated alike, the plan chosen by simulated time, the
per-stream totals and the timeline in the JSON and in `explain`, micro-batches."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from parsat.api import optimize
from parsat.dsl.library import load_library, shipped_rules_dir
from parsat.ir.data_parallel import data_parallel_pcg
from parsat.ir.errors import PlanError
from parsat.ir.machine import Machine
from parsat.ir.models import mlp, stack
from parsat.ir.pcg import weight_chains
from parsat.report.explain import explain
from parsat.ir.validate import validate_plan_report
from parsat.cost.pcg_tasks import DDP, PARSAT_RUN, StepPrediction, profile_for, simulate_pcg
from parsat.cost.simulator import COMM, COMPUTE, StepBuilder
from parsat.cost.step_report import simulate_step, simulated_step, summarize
from parsat.ir.costs import SimulatedStep, Totals

LIB = load_library([shipped_rules_dir() / "ops.rule"])[0]
PRESET = Machine.preset("h100x8")
DDP_H100 = replace(PRESET, comm=replace(PRESET.comm, bucket_elements=0, bucket_elements_per_rank=0))
"""h100x8 with PyTorch DDP's 25 MiB buckets: the preset's Megatron-Core buckets (>= 40M elements) hold each of these
small models whole, so its one bucket cannot start before backward ends."""


@pytest.fixture(scope="module")
def plan():
    return optimize("transformer", machine=DDP_H100, devices=8,
                    sizes=dict(batch=8, seq=128, hidden=256, heads=4, ffn=1024))


def test_every_candidate_is_simulated_and_the_plan_is_the_fastest_simulated_one(plan):
    data = json.loads(plan.to_json())
    totals = data["totals"]
    assert totals["step"]["profile"] == DDP.name                    # a GPU preset runs as a GPU framework does
    assert totals["node_sum_s"] == pytest.approx(sum(n["cost"]["time_s"] for n in data["nodes"]))
    assert totals["time_s"] != totals["node_sum_s"]                  # the simulated step, not the sum
    present = {k: v for k, v in data["baselines"].items() if v is not None}
    assert "data_parallel" in present
    for name, baseline in present.items():
        assert "step" in baseline and baseline["node_sum_s"] > 0
        assert totals["time_s"] <= baseline["time_s"] + 1e-15, name
    # the figures hold together: the step is at least the compute lane, overlap at most either lane
    assert totals["compute_busy_s"] <= totals["time_s"] + 1e-15
    assert totals["exposed_comm_s"] == pytest.approx(totals["time_s"] - totals["compute_busy_s"])
    dp = present["data_parallel"]
    assert 0 < dp["overlap_s"] <= min(dp["comm_busy_s"], dp["compute_busy_s"])   # buckets overlap backward
    validate_plan_report(data, PlanError, "plan")


def test_explain_draws_the_step_as_two_lanes(plan):
    text = explain(json.loads(plan.to_json()))
    lines = text.splitlines()
    compute = next(l for l in lines if l.startswith("  compute |"))
    comm = next(l for l in lines if l.startswith("  comm    |"))
    assert compute.index("|") == comm.index("|") and len(compute.split("|")[1]) == len(comm.split("|")[1])
    assert "F" in compute and "B" in compute and "O" in compute
    both = next(l for l in lines if l.startswith("  both    |"))
    assert set(both.split("|")[1]) <= {" ", "^"}
    assert "per-node sum extraction ranks by" in text
    for phase in ("forward", "backward", "optimizer"):
        assert any(l.startswith(f"  {phase} ") for l in lines)


def test_data_parallel_timeline_shows_gradient_sync_overlapping_backward():
    graph = stack(2, batch=64, seq=128, hidden=256, heads=4, ffn=1024, library=LIB)
    streams, step = simulate_step(data_parallel_pcg(graph, LIB, 8, 8), LIB, DDP_H100)
    lanes = dict(step.lanes)
    overlapped = [i for i, (a, b) in enumerate(zip(lanes["compute"], lanes["comm"])) if a == "B" and b == "G"]
    assert overlapped                                   # a bucket's all-reduce drawn under the backward pass
    assert streams.overlap_s > 0 and streams.time_s < streams.compute_busy_s + streams.comm_busy_s
    assert [p.phase for p in step.phases][:3] == ["forward", "backward", "grad_sync"]


def test_a_step_s_figures_worked_out_when_read_are_the_eager_ones():
    """`simulated_step` (what a search ranks candidates by) gives `simulate_step`'s time at once and its figures
    when first read, once: the same figures, so the same totals in the plan JSON, under DDP and `parsat run`."""
    graph = stack(2, batch=64, seq=128, hidden=256, heads=4, ffn=1024, library=LIB)
    for machine, microbatches in ((DDP_H100, 4), (Machine.preset("cpu").with_devices(8), 2)):
        pcg = data_parallel_pcg(graph, LIB, 8, 8)
        streams, step = simulate_step(pcg, LIB, machine, microbatches)
        lazy = simulated_step(pcg, LIB, machine, microbatches)
        calls = []
        counted = replace(lazy, report=lambda: calls.append(1) or lazy.report())
        assert counted.time_s == streams.time_s and not calls         # ranked by its time: nothing worked out
        assert counted.figures == (streams, step) and (counted.streams, counted.step) == (streams, step)
        assert len(calls) == 1                                          # worked out once, kept
        base = Totals(1.0, 0, 0, 0, 0, 0.5, 0.5)
        eager = base.simulated(SimulatedStep.known(streams, step))
        assert json.dumps(base.simulated(lazy).to_dict()) == json.dumps(eager.to_dict())
        assert base.simulated(lazy) == eager and hash(lazy) == hash(SimulatedStep.known(streams, step))
    wrong = SimulatedStep(streams.time_s + 1.0, lambda: (streams, step))
    with pytest.raises(ValueError, match="reported as"):
        wrong.streams


def test_summary_of_a_small_step():
    builder = StepBuilder()
    compute, comm = builder.stream(0, COMPUTE), builder.stream(0, COMM)
    f = builder.add("f", compute, 2.0, phase="forward")
    b1 = builder.add("b1", compute, 1.0, [f], phase="backward")
    sync = builder.add("ar", comm, 2.0, [b1], phase="grad_sync")
    builder.add("b2", compute, 1.0, [b1], phase="backward")
    builder.add("opt", compute, 1.0, [sync], phase="optimizer")
    streams, step = summarize(StepPrediction(builder.simulate(), 0), "test", width=6)
    # compute: f 0-2, b1 2-3, b2 3-4, idle 4-5 (waiting for the all-reduce 3-5), opt 5-6
    assert (streams.time_s, streams.compute_busy_s, streams.comm_busy_s) == (6.0, 5.0, 2.0)
    assert streams.overlap_s == 1.0 and streams.exposed_comm_s == 1.0
    assert dict(step.lanes) == {"compute": "FFBB O", "comm": "   GG ", "overlap": "   ^  "}
    assert [(p.phase, p.start_s, p.end_s, p.compute_s, p.comm_s) for p in step.phases] == [
        ("forward", 0.0, 2.0, 2.0, 0.0), ("backward", 2.0, 4.0, 2.0, 0.0), ("grad_sync", 3.0, 5.0, 0.0, 2.0),
        ("optimizer", 5.0, 6.0, 1.0, 0.0)]


def test_micro_batches_repeat_the_passes_and_sync_once():
    pcg = data_parallel_pcg(mlp(library=LIB), LIB, 2, 8)
    machine = Machine.preset("h100x8")
    one = simulate_pcg(pcg, LIB, machine, DDP).result
    four = simulate_pcg(pcg, LIB, machine, DDP, microbatches=4).result
    count = lambda result, phase: sum(1 for s in result.spans if s.phase == phase)
    chains = [n.id for n in pcg if n.kind == "parallel" and n.id in weight_chains(pcg)]   # the weights' replicas
    made = lambda result: sum(1 for s in result.spans if s.phase == "forward" and any(
        s.name.endswith(f"#{i}") for i in chains))
    assert made(one) == made(four) == 2                # a weight's chain is made once per step
    assert count(four, "forward") - made(four) == 4 * (count(one, "forward") - made(one))
    assert count(four, "grad_sync") == count(one, "grad_sync") >= 1     # the last micro-batch's buckets only
    assert count(four, "optimizer") == count(one, "optimizer")
    assert one.step_s < four.step_s < 4 * one.step_s


def test_profile_follows_the_machine():
    assert profile_for(Machine.preset("h100x8")) is DDP
    assert profile_for(Machine.preset("cpu")) is PARSAT_RUN


@pytest.mark.slow
def test_bert_large_data_parallelism_scales_from_8_to_64_devices():
    """Issue 17's must-show through the facade (about 3 CPU minutes: benchmarks/dp_scaling.md): the
    data_parallel baseline of BERT-Large, batch 256, on 64 h100x8 devices at most half its 8-device time."""
    dp = {n: optimize("bert-large", machine="h100x8", devices=n).baselines["data_parallel"]
          for n in (8, 64)}
    assert dp[8] is not None and dp[64] is not None
    assert dp[64].time_s <= dp[8].time_s / 2
