"""`parsat run`: a plan file trained on 2 ranks (one axis) and on 4 (a 2x2 mesh) with --check --json, and the
refusals (another plan version or schema, a job that is not the plan's mesh, placements that do not lay out)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import mesh_plans  # noqa: E402

from parsat.backend.executor import operator_library  # noqa: E402
from parsat.cli import main  # noqa: E402

SIZES = dict(batch=8, d_in=6, d_hidden=4, d_out=2)
LIBRARY = operator_library()


def plan_file(tmp_path, devices=2, **changes):
    """The data-parallel MLP as a plan JSON, with the communication the ring formulas predict as its totals."""
    plan = mesh_plans.data_parallel_mlp(LIBRARY, devices, **SIZES)
    data = mesh_plans.plan_dict(plan.graph, plan.pcg, plan.sent, plan.grad_sync)
    data.update(changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


@pytest.mark.slow   # test_backend_plans' fast test_mlp_figures_through_the_cli runs the same path: `parsat run --check
# --json` of a data-parallel MLP on 2 ranks, its JSON's check, comm_elements_measured = the gradients' all-reduce
# plus the output's gather (813,056 + 128 x 10), comm_matches, and the JSON's keys
def test_run_check_json(tmp_path, capsys):
    path = plan_file(tmp_path)
    code = main(["run", str(path), "--nproc", "2", "--backend", "gloo", "--steps", "2", "--check", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert code == 0
    assert result["check"] == "passed" and result["max_abs_diff"] < 1e-12
    k, h, o, b = SIZES["d_in"], SIZES["d_hidden"], SIZES["d_out"], SIZES["batch"]
    # gradient all-reduce of both weights + the output gather
    assert result["comm_elements_measured"] == result["comm_elements_predicted"] == 2 * (k * h + h * o) + (2 - 1) * b * o
    assert set(result) >= {"check", "max_abs_diff", "comm_elements_measured", "comm_elements_predicted",
                           "step_time_s", "peak_memory_bytes"}


@pytest.mark.parametrize("change,nproc,message", [
    ({}, 3, "is a plan for 2 device"),
    ({"version": 99}, 2, "plan version 99 is not supported"),
    ({"schema": "other"}, 2, "is not a parsat plan"),
    ({"nodes": [{"id": 0}]}, 2, "does not follow the plan schema"),
])
def test_bad_plans_are_refused_without_a_trace(tmp_path, capsys, change, nproc, message):
    path = plan_file(tmp_path, **change)
    code = main(["run", str(path), "--nproc", str(nproc), "--backend", "gloo"])
    err = capsys.readouterr().err
    assert code == 1 and message in err and "Traceback" not in err


def test_missing_file(tmp_path, capsys):
    assert main(["run", str(tmp_path / "none.json"), "--nproc", "2"]) == 1
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.slow
def test_under_torchrun_the_same_entry_point_joins_the_group(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    path = plan_file(tmp_path)
    torchrun = Path(sys.executable).with_name("torchrun")
    parsat = Path(sys.executable).with_name("parsat")
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(parsat), "run", str(path),
                           "--check", "--json", "--backend", "gloo"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["check"] == "passed" and result["comm_elements_measured"] == result["comm_elements_predicted"]


def test_a_plan_whose_placements_do_not_lay_out_is_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """A plan whose stated placement is not the one its operators give: one line naming the node, no rank run."""
    from parsat.backend import executor

    def no_launch(*_args, **_kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(executor, "launch", no_launch)
    data = json.loads(plan_file(tmp_path).read_text())
    relu = next(n for n in data["nodes"] if n["op"] == "relu")
    relu["placement"] = ["Replicate()"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert main(["run", str(path), "--nproc", "2", "--backend", "gloo"]) == 1
    err = capsys.readouterr().err
    assert f"at node #{relu['id']}, relu: the plan states placement [-], but it lays out as [S0]" in err
    assert "Traceback" not in err


def test_a_plan_whose_mesh_is_not_the_job_is_refused(tmp_path, capsys):
    """`devices` says 2 but the mesh has 4 ranks: --nproc 2 is refused naming the mesh."""
    plan = mesh_plans.dp_tp_mlp(LIBRARY)
    data = mesh_plans.plan_dict(plan.graph, plan.pcg, plan.sent)
    data["devices"] = 2
    path = tmp_path / "mesh.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert main(["run", str(path), "--nproc", "2", "--backend", "gloo"]) == 1
    err = capsys.readouterr().err
    assert "the plan runs on a mesh of 4 ranks (dp 2 x tp 2), but --nproc is 2" in err and "Traceback" not in err


def test_run_check_on_a_2x2_mesh(tmp_path, capsys):
    """`parsat run --check` of Megatron sequence parallelism x data parallelism on 4 ranks: passed, and the
    communication measured per step equals the ring formulas' count, per axis too."""
    plan = mesh_plans.tp_sp_block(LIBRARY)
    path = tmp_path / "tp_sp.json"
    mesh_plans.save_plan(plan, path)
    code = main(["run", str(path), "--nproc", "4", "--backend", "gloo", "--steps", "2", "--check", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert code == 0 and result["check"] == "passed", out
    assert result["comm_elements_measured"] == result["comm_elements_predicted"] == plan.sent
    assert result["comm_matches"] is True
    assert result["comm_elements_by_axis"] == plan.sent_by_axis()
    assert result["grad_sync_elements_measured"] == result["grad_sync_elements_predicted"] == plan.grad_sync
    assert any(line.startswith("    by mesh axis") and "dp 704, tp 1,184" in line for line in out)
