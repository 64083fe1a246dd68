"""Activation recomputation run for real: each block checkpointed, checked against one process.

A small `gpt` (3 blocks) planned by the optimizer on 1 rank, on 2 ranks
under tensor and under data parallelism (4 ranks DP x TP, slow), with 1 and
2 micro-batches, run as planned and again with `recompute="blocks"`
(`ir.recompute`). With recomputation each plan must still train like the
whole batch in one process (`--check`), report the same losses and the same
gradient synchronisation, run every forward collective of its recomputed
blocks once more per micro-batch (counted from the PCG: the extra elements
and collectives are those of the checkpoints' parallel nodes, nothing else),
and hold less memory. A recomputed block's dropped values are not in the
rank's values after forward; a pipelined plan recomputes per chunk; a user's
module under `parsat run --model` recomputes its blocks; a plan file with
an unknown policy is refused with a clear message.
"""

from __future__ import annotations

import json
from dataclasses import replace
from fractions import Fraction
from math import prod
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from parsat.api import optimize  # noqa: E402
from parsat.backend.cli import load_plan  # noqa: E402
from parsat.backend.collectives import IDENTITY, PARALLEL_TABLE, REDUCE_SCATTER_KIND, SLICE, CommCounter, \
    CommEvent  # noqa: E402
from parsat.backend.executor import RankProgram, TrainConfig, operator_library, run_rank  # noqa: E402
from parsat.backend.launch import LaunchConfig, RankContext, launch  # noqa: E402
from parsat.backend.pipeline_run import run_stage_rank  # noqa: E402
from parsat.backend.recompute_regions import Region, forward_units  # noqa: E402
from parsat.cli import main  # noqa: E402
from parsat.ir.machine import Machine  # noqa: E402
from parsat.ir.microbatch import step_batch  # noqa: E402
from parsat.ir.pcg import PCG  # noqa: E402
from parsat.ir.pcg_placement import derive_placements  # noqa: E402
from parsat.ir.recompute import checkpoints  # noqa: E402

GPT = {"blocks": 3, "hidden": 32, "heads": 2, "seq": 8, "vocab": 64, "batch": 8}
STEPS = 2
# Compute slow and links nearly free inside a node: at these tiny sizes a plan splits.
TWO_BY_TWO = Machine("two-nodes-of-two", 2, 2, peak_flops=1e8, memory_bandwidth=1e12, memory_capacity=2 ** 30,
                     intra_bandwidth=1e12, intra_latency=1e-9, inter_bandwidth=1e9, inter_latency=1e-6)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """The optimizer's plan file of the small gpt for (devices, degrees, micro-batches), made once per module."""
    folder, made = tmp_path_factory.mktemp("recompute-plans"), {}

    def get(devices: int, degrees: dict | None, m: int) -> str:
        key = (devices, tuple(sorted((degrees or {}).items())), m)
        if key not in made:
            path = folder / f"gpt-{len(made)}.json"
            optimize("gpt", machine=TWO_BY_TWO, devices=devices, sizes=GPT, degrees=degrees, microbatches=m,
                     baselines=False).save(path)
            made[key] = str(path)
        return made[key]

    return get


def _plan(plan_file, devices: int, degrees: dict | None, m: int):
    """(pcg, graph) of the optimizer's plan, read back from its file as `parsat run` reads it."""
    pcg, graph, _ = load_plan(plan_file(devices, degrees, m), devices)
    return pcg, graph


def _run_all(ctx, jobs, config):
    """label -> (the last step's per-rank comm figures, the job summary, the losses), one process group."""
    out = {}
    for label, pcg, graph in jobs:
        report = run_rank(ctx, pcg, config, graph)
        out[label] = (report["comm"][-1], report["job"], report["losses"])
    return out


def _with_and_without(plans: dict) -> list[tuple]:
    return [(f"{label}/{policy}", replace(pcg, recompute=policy), graph)
            for label, (pcg, graph) in plans.items() for policy in ("none", "blocks")]


def _launch(jobs, nproc: int) -> dict:
    return launch(_run_all, (jobs, TrainConfig(steps=STEPS, check=True)),
                  LaunchConfig(nproc=nproc, backend="gloo", timeout_s=600))[0]


def recomputed_forward(pcg: PCG) -> tuple[Fraction, int]:
    """What recomputing `pcg`'s blocks adds to one micro-batch, read off the PCG: (elements summed over ranks,
    collectives per rank) of the forward collectives of every parallel node in a checkpoint's `runs`."""
    placements = derive_placements(pcg, operator_library().ops)
    mesh = pcg.mesh
    elements, count = Fraction(0), 0
    for checkpoint in checkpoints(pcg):
        for ident in checkpoint.runs:
            node = pcg.node(ident)
            if node.kind != "parallel":
                continue
            kind, p = PARALLEL_TABLE[node.op].forward, mesh.size(node.axis(mesh))
            if kind in (SLICE, IDENTITY) or p == 1:
                continue
            piece = placements[node.inputs[0] if kind == REDUCE_SCATTER_KIND else ident]
            n = prod(piece.local_shape(node.shape, mesh.shape))
            elements += CommEvent(node.op, "forward", kind, "", p, n, 8).sent * mesh.world
            count += 1
    return elements, count


def _assert_recomputes_as_planned(plans: dict, results: dict) -> None:
    tolerance = TrainConfig().tolerance
    for label, (pcg, graph) in plans.items():
        (plain_comm, plain, plain_losses) = results[f"{label}/none"]
        (comm, job, losses) = results[f"{label}/blocks"]
        for name, j in (("none", plain), ("blocks", job)):
            assert j["max_rel_diff"] is not None and j["max_rel_diff"] <= tolerance and not j["nonfinite"], \
                (label, name, j["max_rel_diff"], j["worst"])
        assert losses == pytest.approx(plain_losses, rel=1e-12), label
        m = graph.microbatches
        extra, collectives = recomputed_forward(replace(pcg, recompute="blocks"))
        assert job["sent"] == plain["sent"] + m * extra, (label, job["sent"], plain["sent"], extra)
        assert comm["events"] == plain_comm["events"] + m * collectives, label
        assert job["grad_sync"] == plain["grad_sync"] and comm["grad_sync_events"] == plain_comm["grad_sync_events"]
        assert job["peak_memory_bytes"] < plain["peak_memory_bytes"], (label, job["peak_memory_bytes"],
                                                                       plain["peak_memory_bytes"])


def _run_meshes_and_stages(ctx, jobs, stage_jobs, config):
    """`_run_all` of the one-mesh jobs, then `_run_stages` of the pipelined ones, in one process group."""
    return _run_all(ctx, jobs, config), _run_stages(ctx, stage_jobs, config)


@pytest.fixture(scope="module")
def two_rank_runs(plan_file):
    """The 2-rank one-mesh plans and the pipelined ones, with and without recomputation, in ONE launch (a launch
    is two fresh processes importing torch): (plans, their results, the pipelined jobs, their results).
    Data parallelism at m = 1 (the weights' chains, gradient sync included, run inside the batch's own forward
    and backward, beside the recomputation), tensor parallelism at m = 2; interleaved 1F1B, 2 chunks per stage
    on 2 stages."""
    plans = {"dp/m1": _plan(plan_file, 2, {"dp": 2}, 1), "tp/m2": _plan(plan_file, 2, {"tp": 2}, 2)}
    stage_jobs = _pipelined_jobs(1, None, (("interleaved", [-1, 1, 2, 3]),))
    results, stage_results = launch(_run_meshes_and_stages, (_with_and_without(plans), stage_jobs,
                                                             TrainConfig(steps=STEPS, check=True)),
                                    LaunchConfig(nproc=2, backend="gloo", timeout_s=600, collective_timeout_s=60))[0]
    return plans, results, stage_jobs, stage_results


@pytest.fixture(scope="module")
def two_rank_plans(two_rank_runs):
    plans, results, _, _ = two_rank_runs
    return plans, results


def _one_rank_here(fn, *args):
    """`fn(ctx, *args)` as the one rank of a 1-rank gloo group in this process, its result through JSON as `launch`
    returns it: a 1-rank launch was a fresh process importing torch (~4 CPU s) for a job that needs no other rank
    (spawning ranks and joining their group is every other launch's, this file's two-rank one included)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return json.loads(json.dumps(fn(RankContext(0, 1, "gloo", torch.device("cpu")), *args)))
    finally:
        dist.destroy_process_group()


def test_one_rank_recomputes_blocks_and_trains_like_one_process(plan_file):
    plans = {"m1": _plan(plan_file, 1, None, 1)}
    results = _one_rank_here(_run_all, _with_and_without(plans), TrainConfig(steps=STEPS, check=True))
    _assert_recomputes_as_planned(plans, results)
    assert results["m1/blocks"][1]["sent"] == 0


def test_tensor_and_data_parallel_plans_recompute_their_collectives(two_rank_plans):
    plans, results = two_rank_plans
    _assert_recomputes_as_planned(plans, results)
    # tensor parallelism has collectives inside its blocks: recomputing them really moves more
    extra, collectives = recomputed_forward(replace(plans["tp/m2"][0], recompute="blocks"))
    assert extra > 0 and collectives > 0


@pytest.mark.slow
def test_a_dp_x_tp_plan_recomputes_on_four_ranks(plan_file):
    plans = {f"dpxtp/m{m}": _plan(plan_file, 4, {"dp": 2, "tp": 2}, m) for m in (1, 2)}
    _assert_recomputes_as_planned(plans, _launch(_with_and_without(plans), 4))


def test_a_recomputed_block_keeps_only_what_crosses_it(plan_file):
    """One rank, in process: after forward the rank holds each checkpoint's kept values and none it drops, and
    every value of a plan without recomputation."""
    pcg, graph = _plan(plan_file, 1, None, 1)
    ctx = RankContext(0, 1, "gloo", torch.device("cpu"))
    config = TrainConfig(steps=1)
    found = {}
    for policy in ("none", "blocks"):
        program = RankProgram(replace(pcg, recompute=policy), ctx, config, operator_library())
        data = program.step_data(step_batch(graph), 0)
        found[policy] = program.forward(0, CommCounter(), data.inputs(0))
    marks = checkpoints(replace(pcg, recompute="blocks"))
    assert len(marks) == GPT["blocks"]
    dropped = {i for c in marks for i in c.dropped}
    kept = {i for c in marks for i in c.kept}
    assert dropped and not dropped & set(found["blocks"])
    assert kept <= set(found["blocks"]) and dropped | kept <= set(found["none"])
    assert set(found["none"]) - set(found["blocks"]) == dropped
    for ident in kept:   # the same values, placed the same
        (x, where), (y, there) = found["blocks"][ident], found["none"][ident]
        assert where == there and torch.equal(x, y)


def test_regions_follow_dependencies_not_only_the_pcg_order(plan_file):
    """A block's nodes are interleaved in the PCG with a later block's weight chain; each region runs after
    everything it reads and before everything that reads it, and a chunk's region keeps what another chunk
    reads."""
    pcg, _ = _plan(plan_file, 2, {"tp": 2}, 2)
    pcg = replace(pcg, recompute="blocks")
    units = forward_units(pcg, [n.id for n in pcg.nodes])
    done: set[int] = set()
    for unit in units:
        ids = unit.runs if isinstance(unit, Region) else (unit,)
        for ident in ids:
            assert all(i in done or (isinstance(unit, Region) and i in unit.runs) for i in pcg.node(ident).inputs)
        done.update(ids)
    assert done == {n.id for n in pcg.nodes}
    first = next(u for u in units if isinstance(u, Region))
    half = frozenset(first.runs[: len(first.runs) // 2])
    part = next(u for u in forward_units(pcg, half) if isinstance(u, Region))
    readers = {i for n in pcg.nodes if n.id not in half for i in n.inputs}
    assert set(part.kept) == {i for i in half if i in readers or i in checkpoints(pcg)[0].kept}


def _pipelined_jobs(devices: int, kind: str | None, schedules=(("1f1b", [-1, 1]), ("interleaved", [-1, 1, 2, 3]))):
    from parsat.cost.pipeline import pipelined

    sizes = {"blocks": 4, "batch": 8, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}   # test_backend_pipeline's
    stage = optimize("gpt", TWO_BY_TWO, devices=devices, sizes=sizes, microbatches=4,
                     degrees={kind: devices} if kind else None, baselines=False)
    jobs = []
    for schedule, starts in schedules:
        plan = pipelined(stage, 2, schedule, stage.machine.with_devices(2 * devices),
                         chunks_per_stage=len(starts) // 2, starts=starts)
        jobs += [(f"{schedule}/{policy}", replace(plan.pcg, recompute=policy), plan.pipeline, plan.graph)
                 for policy in ("none", "blocks")]
    return jobs


def _run_stages(ctx, jobs, config):
    return {label: run_stage_rank(ctx, pcg, pipeline, config, graph, step_batch(graph))["job"]
            for label, pcg, pipeline, graph in jobs}


def _assert_pipelines_recompute(jobs, results) -> None:
    for label in {j[0].split("/")[0] for j in jobs}:
        plain, job = results[f"{label}/none"], results[f"{label}/blocks"]
        for j in (plain, job):
            assert j["max_rel_diff"] is not None and j["max_rel_diff"] <= TrainConfig().tolerance \
                and not j["nonfinite"], (label, j["max_rel_diff"], j["worst"])
        pcg = next(p for lab, p, _, _ in jobs if lab == f"{label}/blocks")
        extra, _ = recomputed_forward(pcg)   # every stage's ranks recompute the blocks of its chunks
        assert job["sent"] == plain["sent"] + 4 * extra, label
        assert job["pipeline"]["p2p"] == plain["pipeline"]["p2p"], label   # recomputation sends nothing more
        assert all(a < b for a, b in zip(job["pipeline"]["peak_memory_bytes"], plain["pipeline"]["peak_memory_bytes"])), \
            (label, job["pipeline"]["peak_memory_bytes"], plain["pipeline"]["peak_memory_bytes"])


def test_pipelined_plans_recompute_per_chunk(two_rank_runs):
    """Interleaved 1F1B, 2 chunks per stage on 2 stages: each chunk recomputes its own blocks."""
    _, _, jobs, results = two_rank_runs
    _assert_pipelines_recompute(jobs, results)


@pytest.mark.slow
def test_pipelined_tensor_parallel_plans_recompute_their_collectives():
    jobs = _pipelined_jobs(2, "tp")
    results = launch(_run_stages, ([j for j in jobs], TrainConfig(steps=STEPS, check=True)),
                     LaunchConfig(nproc=4, backend="gloo", timeout_s=600, collective_timeout_s=60))[0]
    _assert_pipelines_recompute(jobs, results)
    assert recomputed_forward(jobs[1][1])[0] > 0


def _plan_file(plan_file, tmp_path, recompute) -> str:
    """The tensor-parallel plan's file with its `recompute` set to `recompute`."""
    data = json.loads(Path(plan_file(2, {"tp": 2}, 2)).read_text(encoding="utf-8"))
    data["recompute"] = recompute
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def test_the_cli_runs_a_plan_optimized_to_recompute_as_predicted(tmp_path, capsys):
    """`parsat.optimize(..., recompute="blocks")`: the plan's own totals (its blocks' forward collectives
    priced twice) are what `parsat run --check` measures."""
    path = tmp_path / "recomputing.json"
    plan = optimize("gpt", machine=TWO_BY_TWO, devices=2, sizes=GPT, degrees={"tp": 2}, microbatches=2,
                    baselines=False, recompute="blocks")
    plan.save(path)
    assert plan.pcg.recompute == "blocks" and recomputed_forward(plan.pcg)[0] > 0
    capsys.readouterr()
    assert main(["run", str(path), "--nproc", "2", "--check", "--json", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["check"] == "passed" and result["recompute"] == "blocks" and "recomputation" in out
    assert result["comm_matches"] is True and result["comm_elements_measured"] > 0
    assert result["grad_sync_elements_measured"] == result["grad_sync_elements_predicted"]


def test_an_unknown_recomputation_policy_is_a_clear_error(plan_file, tmp_path, capsys):
    path = _plan_file(plan_file, tmp_path, "everything")
    capsys.readouterr()
    assert main(["run", path, "--nproc", "2"]) == 1
    err = capsys.readouterr().err
    assert "recompute" in err and "'everything' is not a recomputation policy" in err and "Traceback" not in err


MODULE = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Stack(nn.Module):
    """Two blocks whose weights are named b0_..., b1_... (what `ir.blocks` cuts a model by), and a head."""

    def __init__(self, width=8):
        super().__init__()
        self.b0_block = Block(width)
        self.b1_block = Block(width)
        self.head = nn.Linear(width, 2)

    def forward(self, x, y):
        return ((self.head(self.b1_block(self.b0_block(x))) - y) ** 2).mean()


def stack():
    return Stack(), (torch.randn(8, 8), torch.randn(8, 2))
'''


@pytest.mark.slow
def test_a_users_module_recomputes_its_blocks(tmp_path, capsys):
    """`parsat run --model` (the `parallelize` path): the module's own loop, its blocks recomputed, checked
    against the unmodified module; the recomputed blocks' collectives run again."""
    import importlib.util

    import parsat

    source = tmp_path / "stack.py"
    source.write_text(MODULE, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("stack_module", source)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    # a short search (the full one takes a minute on this graph): any tensor-parallel plan will do
    plan = parsat.optimize(parsat.from_torch(*loaded.stack()), machine=TWO_BY_TWO, devices=2, degrees={"tp": 2},
                           baselines=False, limits={"iterations": 6, "ilp_seconds": 0})
    extra, collectives = recomputed_forward(replace(plan.pcg, recompute="blocks"))
    assert len(checkpoints(replace(plan.pcg, recompute="blocks"))) == 2 and extra > 0
    measured = {}
    for policy in ("none", "blocks"):
        path = tmp_path / f"{policy}.json"
        plan.save(path)
        data = json.loads(path.read_text(encoding="utf-8"))
        data["recompute"] = policy
        path.write_text(json.dumps(data), encoding="utf-8")
        capsys.readouterr()
        code = main(["run", str(path), "--nproc", "2", "--check", "--json", "--steps", "2", "--model",
                     f"{source}:stack"])
        out = capsys.readouterr()
        assert code == 0, out.err
        measured[policy] = json.loads(out.out.strip().splitlines()[-1])
        assert measured[policy]["check"] == "passed" and measured[policy]["recompute"] == policy, measured[policy]
    assert measured["blocks"]["losses"] == pytest.approx(measured["none"]["losses"], rel=1e-12)
    assert measured["blocks"]["comm_elements_measured"] == measured["none"]["comm_elements_measured"] + extra
