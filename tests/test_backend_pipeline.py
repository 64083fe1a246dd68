"""Pipelined plans run for real: stages on their own ranks, micro-batches sent point to point, checked.

A small `gpt` (4 blocks) is cut into 2 stages and run on gloo ranks with 4
micro-batches per step: PP 2 on 2 ranks (1F1B through `parsat run --check
--json`, GPipe, interleaved 1F1B with 2 chunks per stage), PP 2 x TP 2 and
PP 2 x DP 2 on 4 ranks. Each must train like the whole batch's graph in one
process (`--check`: loss, outputs, every stage's gradients and updated
weights, the tied embedding on both stages), and each stage's collectives,
each rank's point-to-point elements and its part of the tied weight's
gradient sum must equal what `ir.pipeline` predicts. Leaving out the tied
weight's sum across stages fails the check. A pipeline that cannot run (a
rank count other than stages x stage devices) is refused with a clear error.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from parsat.api import optimize  # noqa: E402
from parsat.cost.pipeline import pipelined  # noqa: E402
from parsat.backend.cli import load_plan, pipeline_of  # noqa: E402
from parsat.backend.executor import ExecutionError, TrainConfig  # noqa: E402
from parsat.backend.launch import LaunchConfig, launch  # noqa: E402
from parsat.backend.pipeline_run import (PipelinePrediction, StageRank, check_pipeline,  # noqa: E402
                                         pipeline_comparison, run_stage_rank)
from parsat.cli import main  # noqa: E402
from parsat.ir.machine import Machine  # noqa: E402
from parsat.ir.microbatch import step_batch  # noqa: E402


SIZES = {"blocks": 4, "batch": 8, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}
MICROBATCHES = 4
STEPS = 2
# Compute slow and links nearly free: at these tiny sizes the stage plan splits (on "cpu" nothing would).
MACHINE = Machine("two-nodes-of-two", 2, 2, peak_flops=1e8, memory_bandwidth=1e12, memory_capacity=2 ** 30,
                  intra_bandwidth=1e12, intra_latency=1e-9, inter_bandwidth=1e9, inter_latency=1e-6)


def pipelined_plan(stage_plan, schedule: str, starts: list[int], stages: int = 2):
    """`stage_plan` (one stage mesh's plan) cut into chunks at `starts` (layer ids, -1 the prelude) on
    `stages` stages, priced by the cost model (`cost.pipeline.pipelined`)."""
    machine = stage_plan.machine.with_devices(stages * stage_plan.devices)
    return pipelined(stage_plan, stages, schedule, machine, chunks_per_stage=len(starts) // stages, starts=starts)


@pytest.fixture(scope="module")
def stage_plans():
    """The stage plans, once: one device, TP 2 and DP 2 (each a 4-micro-batch plan of the small gpt)."""
    made = {}

    def get(devices: int, kind: str | None = None):
        key = (devices, kind)
        if key not in made:
            made[key] = optimize("gpt", MACHINE, devices=devices, sizes=SIZES, microbatches=MICROBATCHES,
                                 degrees={kind: devices} if kind else None)
        return made[key]

    return get


def _saved(tmp_path, name: str, plan):
    path = tmp_path / f"{name}.json"
    plan.save(path)
    return str(path)


def _jobs(tmp_path, plans: dict) -> list[tuple]:
    """(label, pcg, pipeline, graph, prediction) per plan, read back from its file as `parsat run` reads it."""
    jobs = []
    for label, plan in plans.items():
        path = _saved(tmp_path, label, plan)
        pcg, graph, _ = load_plan(path, plan.devices)
        pipeline, costs = pipeline_of(path)
        jobs.append((label, pcg, pipeline, graph, PipelinePrediction.of(pcg, pipeline, costs)))
    return jobs


def _run_all(ctx, jobs, config):
    """Every job in one process group: label -> its job summary."""
    return {label: run_stage_rank(ctx, pcg, pipeline, config, graph, step_batch(graph))["job"]
            for label, pcg, pipeline, graph in jobs}


def _without_shared_sum(ctx, jobs, config):
    """`_run_all` with the tied weight's gradient left unsummed across stages."""
    StageRank.sum_shared = lambda self, counter: None
    return _run_all(ctx, jobs, config)


def _launch(jobs, nproc: int, fn=_run_all) -> dict:
    config = TrainConfig(steps=STEPS, check=True)
    return launch(fn, ([(label, pcg, pipeline, graph) for label, pcg, pipeline, graph, _ in jobs], config),
                  LaunchConfig(nproc=nproc, backend="gloo", timeout_s=600, collective_timeout_s=60))[0]


def _assert_checked_and_counted(jobs, results) -> None:
    for label, _pcg, pipeline, _graph, predicted in jobs:
        job = results[label]
        assert job["max_rel_diff"] is not None and job["max_rel_diff"] <= TrainConfig().tolerance \
            and not job["nonfinite"], (label, job["max_rel_diff"], job["worst"])
        comparison = pipeline_comparison(job["pipeline"], predicted, pipeline)
        assert comparison["matches"], (label, comparison)
        for stage in comparison["stages"]:   # something really moved, and was predicted to
            assert all(x > 0 for xs in stage["p2p_sent_measured"].values() for x in xs), (label, stage)
            assert stage["shared_sum_predicted"] > 0, (label, stage)
        assert job["sent"] == sum(predicted.collectives)


def test_pp2_1f1b_runs_checked_through_parsat_run(tmp_path, stage_plans, capsys):
    path = _saved(tmp_path, "pp2", pipelined_plan(stage_plans(1), "1f1b", [-1, 1]))
    code = main(["run", path, "--nproc", "2", "--check", "--steps", str(STEPS), "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["check"] == "passed"
    pipeline = result["pipeline"]
    assert pipeline["matches"] and pipeline["schedule"] == "1f1b" and pipeline["degree"] == 2
    stage0, stage1 = pipeline["stages"]
    # the residual stream of one micro-batch (2 x 16 x 32) forward and its gradient back, 4 micro-batches
    assert stage0["p2p_sent_measured"] == {"1": [4 * 2 * 16 * 32]} == {"1": [stage0["p2p_sent_predicted"]["1"]]}
    assert stage1["p2p_sent_measured"] == {"0": [4 * 2 * 16 * 32]}
    assert stage0["shared_sum_measured"] == [64 * 32] == stage1["shared_sum_measured"]   # the tied wte
    assert "stage 1 (ranks 1-1) collectives measured 0, predicted 0 (equal); p2p to stage 0 per rank measured " \
           "4,096, predicted 4,096 (equal)" in out


def _run_all_then_without_shared_sum(ctx, jobs, config):
    """`_run_all` of every job but the last, then the last with the tied weight's gradient left unsummed
    (`_without_shared_sum`, which patches `StageRank` for the rest of the process): one process group."""
    return {**_run_all(ctx, jobs[:-1], config), **_without_shared_sum(ctx, jobs[-1:], config)}


@pytest.fixture(scope="module")
def two_rank_pipelines(tmp_path_factory, stage_plans):
    """GPipe and interleaved 1F1B trained as planned, then 1F1B with its tied weight left unsummed, in ONE 2-rank
    launch (a launch is two fresh processes importing torch): (the planned jobs, label -> job summary)."""
    plans = {"gpipe": pipelined_plan(stage_plans(1), "gpipe", [-1, 1]),
             "interleaved": pipelined_plan(stage_plans(1), "interleaved", [-1, 1, 2, 3]),
             "unsummed": pipelined_plan(stage_plans(1), "1f1b", [-1, 1])}
    assert plans["interleaved"].pipeline.layout.chunks_per_stage == 2
    jobs = _jobs(tmp_path_factory.mktemp("pipelines"), plans)
    return jobs[:-1], _launch(jobs, 2, _run_all_then_without_shared_sum)


def test_gpipe_and_interleaved_on_2_ranks_train_like_the_whole_batch(two_rank_pipelines):
    jobs, results = two_rank_pipelines
    _assert_checked_and_counted(jobs, results)


def test_a_tied_weight_left_unsummed_across_stages_fails_the_check(two_rank_pipelines):
    job = two_rank_pipelines[1]["unsummed"]
    assert job["max_rel_diff"] > TrainConfig().tolerance
    assert "wte" in job["worst"]


@pytest.mark.slow
def test_pp2_x_tp2_on_4_ranks(tmp_path, stage_plans):
    jobs = _jobs(tmp_path, {"pp2xtp2": pipelined_plan(stage_plans(2, "tp"), "1f1b", [-1, 1])})
    results = _launch(jobs, 4)
    _assert_checked_and_counted(jobs, results)
    assert all(c > 0 for c in results["pp2xtp2"]["pipeline"]["collectives"])   # TP inside each stage


@pytest.mark.slow
def test_pp2_x_dp2_and_interleaved_pp2_x_tp2_on_4_ranks(tmp_path, stage_plans):
    jobs = _jobs(tmp_path, {"pp2xdp2": pipelined_plan(stage_plans(2, "dp"), "1f1b", [-1, 1]),
                            "pp2xtp2-interleaved": pipelined_plan(stage_plans(2, "tp"), "interleaved",
                                                                  [-1, 1, 2, 3])})
    results = _launch(jobs, 4)
    _assert_checked_and_counted(jobs, results)
    assert all(g > 0 for g in results["pp2xdp2"]["pipeline"]["grad_sync"])   # DP's gradient sync per stage


def test_a_pipeline_on_the_wrong_rank_count_is_a_clear_error(tmp_path, stage_plans, capsys):
    plan = pipelined_plan(stage_plans(1), "1f1b", [-1, 1])
    path = _saved(tmp_path, "pp2", plan)
    assert main(["run", path, "--nproc", "3", "--check"]) == 1
    err = capsys.readouterr().err
    assert "plan for 2 device(s); --nproc is 3" in err and "Traceback" not in err
    with pytest.raises(ExecutionError, match="2 pipeline stages of 1 rank.*--nproc is 3"):
        check_pipeline(plan.pcg, plan.pipeline, 3, plan.graph)
    with pytest.raises(ExecutionError, match="interleaved 1F1B needs the micro-batches"):
        bad = replace(plan.pipeline, schedule="interleaved", microbatches=3)
        check_pipeline(plan.pcg, bad, 2)


def test_parallelize_refuses_a_pipelined_plan(stage_plans):
    from parsat.backend.parallelize import ParallelizeError, parallelize

    plan = pipelined_plan(stage_plans(1), "1f1b", [-1, 1])
    with pytest.raises(ParallelizeError, match="pipelined plans run through `parsat run`"):
        parallelize(torch.nn.Linear(2, 2), plan, (torch.zeros(1, 2),))
