"""The optimizer's plans and the baselines' plans run for real: --check passes and measured == predicted.

Issue 5's "Must show": for the MLP, a transformer block and the branching
MLP, on 2 and 4 CPU ranks (gloo), parsat's PCG and each baseline's PCG read
back from the plan JSON train for 3 steps matching a single process, and
the elements their collectives send per step equal the plan's prediction.
All plans of one rank count run in one launch (one process group) to keep
the test fast; the 4-rank ones are marked slow.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from parsat.api import optimize  # noqa: E402
from parsat.backend.cli import PLAN_OF, load_plan  # noqa: E402
from parsat.backend.executor import ExecutionError, TrainConfig, run_many  # noqa: E402
from parsat.backend.launch import LaunchConfig, launch  # noqa: E402
from parsat.cli import main  # noqa: E402

GRAPHS = {
    "mlp": {},
    "branches": {},
    "transformer": dict(batch=4, seq=32, hidden=64, heads=4, ffn=256),
}
STEPS = 3


def plans_for(tmp_path, nproc: int) -> tuple[list, dict, list]:
    """(jobs, predictions, missing): every PCG of the three graphs' plan files that can be read back."""
    jobs, predicted, missing = [], {}, []
    for name, sizes in GRAPHS.items():
        path = tmp_path / f"{name}{nproc}.json"
        optimize(name, machine="cpu", devices=nproc, sizes=sizes or None).save(path)
        baselines = json.loads(path.read_text())["baselines"]
        for plan_of in PLAN_OF:
            if plan_of == "expert_parallel" and baselines.get(plan_of) is None:   # no experts in these graphs
                continue
            try:
                pcg, graph, prediction = load_plan(str(path), nproc, plan_of)
            except ExecutionError as err:
                missing.append(f"{name}/{plan_of}: {err}")
                continue
            label = f"{name}/{plan_of}"
            jobs.append((label, pcg, graph))
            predicted[label] = prediction
    return jobs, predicted, missing


def run_all(tmp_path, nproc: int) -> tuple[dict, dict, list]:
    """(label -> its job summary, label -> its prediction, missing) of every plan of `plans_for`, in one launch."""
    jobs, predicted, missing = plans_for(tmp_path, nproc)
    config = TrainConfig(steps=STEPS, check=True)
    results = launch(run_many, (jobs, config), LaunchConfig(nproc=nproc, backend="gloo", timeout_s=600))[0]
    return results, predicted, missing


def check_all(results: dict, predicted: dict, missing: list) -> None:
    config = TrainConfig(steps=STEPS, check=True)
    rows = {label: (job["max_abs_diff"], job["sent"], predicted[label].comm_elements,
                    job["grad_sync"], predicted[label].grad_sync_elements) for label, job in results.items()}
    for label, (diff, sent, want, sync, want_sync) in rows.items():
        assert diff is not None and diff <= config.tolerance, (label, rows[label])
        assert sent == want, (label, rows[label])
        assert sync == want_sync, (label, rows[label])
    # parsat's plan is really parallel for every graph (not a single-device run in disguise)
    assert all(rows[f"{name}/parsat"][1] > 0 for name in GRAPHS), rows
    assert all(f"{name}/data_parallel" in rows for name in GRAPHS), missing
    if missing:  # baselines whose PCG the plan file does not carry yet: say so instead of passing silently
        pytest.skip("ran and matched every other plan; not in the plan files: " + "; ".join(missing))


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> tuple[dict, dict, list]:
    """`run_all` on 2 ranks, once for the module: the plans' checks and the mlp's own plan's figures beside the CLI's
    data-parallel run (a launch is two fresh processes importing torch, most of a small run)."""
    return run_all(tmp_path_factory.mktemp("plans"), 2)


def test_optimizer_and_baseline_plans_two_ranks(two_rank_runs):
    check_all(*two_rank_runs)


@pytest.mark.slow
def test_optimizer_and_baseline_plans_four_ranks(tmp_path):
    check_all(*run_all(tmp_path, 4))


def test_mlp_figures_through_the_cli(tmp_path, capsys, two_rank_runs):
    """`parsat optimize mlp ... -o p.json && parsat run p.json --check --json --plan-of data_parallel`; beside it
    parsat's own plan of the same search (`optimize("mlp", machine="cpu", devices=2)`, what `parsat optimize` here
    runs) as trained in `two_rank_runs`: `run_many` with the CLI's defaults (3 steps, SGD, float64, --check), what
    `parsat run` runs on its ranks. (Its own `parsat run` was a second 2-rank launch; the CLI's run of a plan's
    own PCG, --check --json, is test_backend_cli's test_run_check_on_a_2x2_mesh.)"""
    path = tmp_path / "p.json"
    assert main(["optimize", "mlp", "--devices", "2", "--machine", "cpu", "-q", "-o", str(path)]) == 0
    capsys.readouterr()
    code = main(["run", str(path), "--nproc", "2", "--check", "--json", "--plan-of", "data_parallel"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert result["check"] == "passed" and result["comm_matches"] is True
    assert set(result) >= {"check", "max_abs_diff", "comm_elements_measured", "comm_elements_predicted",
                           "step_time_s", "peak_memory_bytes"}   # what test_backend_cli's run_check_json read
    results, predicted, _ = two_rank_runs
    parsat = results["mlp/parsat"]
    assert parsat["max_abs_diff"] is not None and parsat["max_abs_diff"] <= TrainConfig().tolerance
    assert parsat["sent"] == predicted["mlp/parsat"].comm_elements
    assert 0 < parsat["sent"] <= 131_072
    # data parallelism: 2 * (784*512 + 512*10) gradient elements, plus gathering the 128x10 output
    assert result["grad_sync_elements_measured"] == 813_056
    assert result["comm_elements_measured"] == 813_056 + 128 * 10
    assert parsat["peak_memory_bytes"] < result["peak_memory_bytes"]


def test_plan_of_a_missing_baseline_is_refused(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert main(["optimize", "mlp", "--devices", "2", "--machine", "cpu", "-q", "--no-baselines",
                 "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["run", str(path), "--nproc", "2", "--plan-of", "megatron"]) == 1
    assert "megatron" in capsys.readouterr().err
