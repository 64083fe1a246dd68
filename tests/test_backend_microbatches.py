"""Plans of m micro-batches run for real: gradient accumulation, checked against the whole batch.

On 2 gloo ranks (4 for the 2x2 mesh, marked slow): plans of `mlp` and a
small `gpt` at m = 1, 2 and 4 micro-batches of one global batch train like
the whole batch's graph in one process (`--check`: the whole-batch
reference shares nothing with the backend's accumulation, so a gradient
not divided by m, or synchronised per micro-batch, fails it); they report
the same losses whatever m (the same data, the same objective); their
collectives send what the plan predicts; the gradient synchronisation runs
once per step while activations' collectives run once per micro-batch; a
ZeRO-3 weight is gathered once per step. What cannot run as priced is
refused before any rank starts.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from parsat.api import optimize  # noqa: E402
from parsat.backend.cli import load_plan  # noqa: E402
from parsat.backend.executor import (ExecutionError, TrainConfig, gradient_reductions, operator_library,  # noqa: E402
                                     reference_run, run_rank)
from parsat.backend.launch import LaunchConfig, launch  # noqa: E402
from parsat.backend.plan_check import micro_batches_make_the_step  # noqa: E402
from parsat.cli import main  # noqa: E402
from parsat.ir import models  # noqa: E402
from parsat.ir.graph import Graph, GraphBuilder  # noqa: E402
from parsat.ir.machine import Machine  # noqa: E402
from parsat.ir.microbatch import StepBatch, step_batch  # noqa: E402
from parsat.ir.parallelism import describe  # noqa: E402

STEPS = 2
MLP = {"batch": 16, "d_in": 32, "d_hidden": 16, "d_out": 8}
GPT = {"blocks": 1, "hidden": 32, "heads": 2, "seq": 8, "vocab": 64, "batch": 8}
# Two nodes of two devices, compute slow and links nearly free inside a node: at these tiny sizes a plan splits.
TWO_BY_TWO = Machine("two-nodes-of-two", 2, 2, peak_flops=1e8, memory_bandwidth=1e12, memory_capacity=2 ** 30,
                     intra_bandwidth=1e12, intra_latency=1e-9, inter_bandwidth=1e9, inter_latency=1e-6)


def _plans(tmp_path, name: str, sizes: dict, machine, devices: int, plan_of: tuple[str, ...],
           counts=(1, 2, 4), degrees=None) -> list[tuple[str, object, Graph, object]]:
    """(label, pcg, graph, prediction) of each PCG of the plan files of `name` at each micro-batch count."""
    jobs = []
    for m in counts:
        path = tmp_path / f"{name}-{m}.json"
        optimize(name, machine=machine, devices=devices, sizes=sizes, microbatches=m, degrees=degrees).save(path)
        for which in plan_of:
            pcg, graph, prediction = load_plan(str(path), devices, which)
            jobs.append((f"{which}/m{m}", pcg, graph, prediction))
    return jobs


def _run_all(ctx, jobs, config):
    """Every job in one process group: label -> (losses, last step's per-rank comm figures, job summary)."""
    out = {}
    for label, pcg, graph in jobs:
        report = run_rank(ctx, pcg, config, graph)
        out[label] = (report["losses"], report["comm"][-1], report["job"])
    return out


def _launch(jobs, nproc: int) -> dict:
    config = TrainConfig(steps=STEPS, check=True)
    results = launch(_run_all, ([(label, pcg, graph) for label, pcg, graph, _ in jobs], config),
                     LaunchConfig(nproc=nproc, backend="gloo", timeout_s=600))
    return results[0]


def _assert_trains_like_the_whole_batch(jobs, results) -> None:
    tolerance = TrainConfig().tolerance
    for label, _, graph, predicted in jobs:
        losses, comm, job = results[label]
        assert job["max_rel_diff"] is not None and job["max_rel_diff"] <= tolerance and not job["nonfinite"], \
            (label, job["max_rel_diff"], job["worst"])
        assert job["sent"] == predicted.comm_elements, (label, job["sent"], predicted.comm_elements)
        assert job["grad_sync"] == predicted.grad_sync_elements, (label, job["grad_sync"])


def _same_losses(results, plan_of: str) -> None:
    """One global batch, one objective: the same losses whatever the micro-batch count."""
    whole = results[f"{plan_of}/m1"][0]
    for m in (2, 4):
        assert results[f"{plan_of}/m{m}"][0] == pytest.approx(whole, rel=1e-12), m


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict:
    """The mlp's and the gpt's 2-rank jobs in ONE launch (a launch is two fresh processes importing torch):
    model -> (its jobs, label -> its results)."""
    mlp = _plans(tmp_path_factory.mktemp("mlp"), "mlp", MLP, "cpu", 2, ("data_parallel", "megatron"))
    # the same plan from a graph that is not an example: its step is 4 independent micro-batches, checked
    # against the micro-batch graph accumulated 4 times in one process
    label, pcg, graph, prediction = next(job for job in mlp if job[0] == "data_parallel/m4")
    mlp.append(("plain/m4", pcg, replace(graph, example=None), prediction))
    gpt = _plans(tmp_path_factory.mktemp("gpt"), "gpt", GPT, TWO_BY_TWO, 2, ("parsat", "data_parallel", "sequential"))
    models_jobs = {"mlp": mlp, "gpt": gpt}
    results = _launch([(f"{model}:{label}", *rest) for model, jobs in models_jobs.items()
                       for label, *rest in jobs], 2)
    return {model: (jobs, {job[0]: results[f"{model}:{job[0]}"] for job in jobs})
            for model, jobs in models_jobs.items()}


@pytest.fixture(scope="module")
def mlp_runs(two_rank_runs):
    return two_rank_runs["mlp"]


@pytest.fixture(scope="module")
def gpt_runs(two_rank_runs):
    return two_rank_runs["gpt"]


def test_mlp_micro_batches_train_the_whole_batch_and_move_what_is_predicted(mlp_runs):
    jobs, results = mlp_runs
    _assert_trains_like_the_whole_batch(jobs, results)
    _same_losses(results, "data_parallel")
    _same_losses(results, "megatron")
    assert all(results[f"data_parallel/m{m}"][2]["grad_sync"] > 0 for m in (1, 2, 4))
    assert results["plain/m4"][0] != results["data_parallel/m4"][0]   # other data: its own micro-batches


def test_gpt_micro_batches_train_the_whole_batch_and_move_what_is_predicted(gpt_runs):
    jobs, results = gpt_runs
    _assert_trains_like_the_whole_batch(jobs, results)
    _same_losses(results, "parsat")
    assert results["parsat/m4"][2]["sent"] > 0   # really parallel
    # the sequential baseline here is ZeRO-3 over the 2 ranks: its weights gathered and their gradients
    # reduce-scattered once per step (the prediction prices them so, and the measured figures equal it)
    assert "ZeRO-3" in describe(next(pcg for label, pcg, _, _ in jobs if label == "sequential/m4"))
    # one gradient reduction per weight's replicate or all_gather, whatever m: synchronised once per step
    for label, pcg, _, _ in jobs:
        assert results[label][1]["grad_sync_events"] == len(gradient_reductions(pcg)) > 0, label
    # micro-batching is for memory: a quarter of the batch's activations alive at once
    assert results["parsat/m4"][2]["peak_memory_bytes"] < results["parsat/m1"][2]["peak_memory_bytes"]


def test_gradients_are_synchronised_once_per_step_and_activations_once_per_micro_batch(mlp_runs):
    """Count the collectives one rank ran in a step: the gradient synchronisation (one all-reduce per
    replicated weight) does not grow with m; every other collective (the output's gather) runs m times."""
    _, results = mlp_runs
    one = results["data_parallel/m1"][1]
    assert one["grad_sync_events"] == 2   # w1 and w2
    for m in (2, 4):
        comm = results[f"data_parallel/m{m}"][1]
        assert comm["grad_sync_events"] == one["grad_sync_events"]
        assert comm["events"] - comm["grad_sync_events"] == m * (one["events"] - one["grad_sync_events"]) > 0


@pytest.mark.slow
def test_a_2x2_mesh_with_zero3_gathers_weights_once_per_step(tmp_path):
    """DP 2 x TP 2 with ZeRO-3 over DP (`--degrees dp=2,tp=2`), m = 1 and 4 on 4 ranks: checked against the
    whole batch, communication as predicted; the weights' all-gathers and reduce-scatters run once a step."""
    jobs = _plans(tmp_path, "mlp", {"batch": 8}, TWO_BY_TWO, 4, ("parsat",), counts=(1, 4),
                  degrees={"dp": 2, "tp": 2})
    results = _launch(jobs, 4)
    _assert_trains_like_the_whole_batch(jobs, results)
    assert results["parsat/m4"][0] == pytest.approx(results["parsat/m1"][0], rel=1e-12)
    one, four = results["parsat/m1"][1], results["parsat/m4"][1]
    assert one["grad_sync_events"] == four["grad_sync_events"] > 0
    assert four["events"] - four["grad_sync_events"] > one["events"] - one["grad_sync_events"]


def test_the_accumulated_reference_equals_the_whole_batch(tmp_path):
    """The 1/m scaling in one process: m micro-batches, each objective divided by m, accumulate the whole
    batch's gradient (the reference `--check` uses where the whole batch's graph is not known)."""
    graph = models.build_example("mlp", {**MLP, "batch": MLP["batch"] // 4}).with_microbatches(4)
    batch = step_batch(graph)
    config = TrainConfig(steps=2)
    whole = reference_run(graph, config, batch)                    # the whole batch's graph, in one pass
    accumulated = reference_run(graph, config, replace(batch, whole=None))   # the micro-batch graph, m passes
    assert accumulated.losses != whole.losses   # independent micro-batches: other data, but both are means
    # on the same data (the whole batch's blocks) the accumulated gradient is the whole batch's
    same_data = _accumulate_on_blocks(graph, batch, config)
    for name, grad in whole.grads[0].items():
        torch.testing.assert_close(same_data[name], grad, rtol=1e-12, atol=1e-15)
        assert not torch.allclose(4 * same_data[name], grad)   # and not m times it


def _accumulate_on_blocks(graph: Graph, batch: StepBatch, config: TrainConfig) -> dict:
    from parsat.backend.executor import evaluate_graph, seeded_weights, step_data
    from parsat.backend.training_data import objective

    weights = {k: w.requires_grad_() for k, w in seeded_weights(graph, config).items()}
    data = step_data(graph, batch, config, 0)
    for k in range(batch.microbatches):
        env = evaluate_graph(graph, {**weights, **data.inputs(k)})
        targets = data.targets(k)
        term = sum(objective(env[o], targets[o], env[o].numel()) for o in graph.outputs)
        (term / batch.microbatches).backward()
    return {k: w.grad for k, w in weights.items()}


def test_the_cli_runs_a_micro_batched_plan_with_check(tmp_path, capsys):
    path = tmp_path / "p.json"
    sizes = [a for k, v in MLP.items() for a in ("--set", f"{k}={v}")]
    assert main(["optimize", "mlp", *sizes, "--devices", "2", "--machine", "cpu", "-q", "--microbatches", "4",
                 "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["run", str(path), "--nproc", "2", "--check", "--json", "--plan-of", "data_parallel"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["check"] == "passed" and result["comm_matches"] is True
    # the gradients of both weights all-reduced once: 2 (p-1) (32*16 + 16*8) over the group
    assert result["grad_sync_elements_measured"] == 2 * (32 * 16 + 16 * 8)


def test_a_module_run_of_a_micro_batched_plan_is_refused(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert main(["optimize", "mlp", "--set", "batch=8", "--devices", "2", "--machine", "cpu", "-q",
                 "--microbatches", "2", "--no-baselines", "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["run", str(path), "--nproc", "2", "--model", "nowhere.py:factory"]) == 1
    err = capsys.readouterr().err
    assert "2 micro-batches" in err and "--model" in err and "Traceback" not in err


def test_batch_statistics_under_micro_batches_are_refused():
    g = GraphBuilder(operator_library(), name="bn")
    x = g.input("x", [4, 2, 3, 3])
    mean = g.op("bn_mean", x, count=36, name="mean")
    var = g.op("bn_var", x, mean, count=36, name="var")
    g.output(g.op("bn_normalize", x, mean, var, g.weight("gamma", [2]), g.weight("beta", [2]), eps=1e-5,
                  name="y"))
    graph = g.build()
    micro_batches_make_the_step(graph)  # one batch: nothing to refuse
    with pytest.raises(ExecutionError, match="statistics of the batch .*bn_mean, bn_var"):
        micro_batches_make_the_step(graph.with_microbatches(2))


def _summed_mlp(batch: int = 8, library=None, budget=None) -> Graph:
    """An MLP whose loss sums the squared errors over the batch instead of averaging them."""
    g = GraphBuilder(library, name="summed", budget=budget)
    y = g.op("matmul", g.input("x", [batch, 4]), g.weight("w", [4, 3]), name="y")
    err = g.op("sub", y, g.input("target", [batch, 3]), name="err")
    sq = g.op("mul", err, err, name="sq")
    g.output(g.op("reduce_sum", g.op("reduce_sum", sq, dim=1, name="rows"), dim=0, name="loss"))
    return g.build()


def test_a_loss_that_sums_over_the_batch_is_refused_under_micro_batches(monkeypatch):
    """Accumulating (1/m) x the micro-batches' gradients trains a mean, not a sum: the whole batch's loss is
    not its micro-batches' mean, which the check before the ranks start finds (on seeded data)."""
    monkeypatch.setitem(models.EXAMPLES, "summed", models.Example("summed", _summed_mlp, "summed squared errors"))
    graph = models.build_example("summed", {"batch": 4}, operator_library()).with_microbatches(2)
    assert step_batch(graph).whole is not None
    with pytest.raises(ExecutionError, match="'loss' of the whole batch is not its micro-batches' averaged"):
        micro_batches_make_the_step(graph)
    mean = models.build_example("mlp", {**MLP, "batch": 4}, operator_library()).with_microbatches(4)
    micro_batches_make_the_step(mean)   # per-sample outputs put together: the whole batch's
