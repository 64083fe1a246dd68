"""`parsat run`: a plan file trained on 2 ranks with --check --json, and the refusals."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from parsat.backend.executor import operator_library  # noqa: E402
from parsat.cli import main  # noqa: E402
from parsat.ir import models  # noqa: E402
from parsat.ir.costs import totals  # noqa: E402
from parsat.ir.data_parallel import data_parallel_pcg  # noqa: E402
from parsat.ir.machine import Machine  # noqa: E402
from parsat.ir.plan import PLAN_SCHEMA, PLAN_VERSION  # noqa: E402
from parsat.saturate.baselines import price_pcg  # noqa: E402

SIZES = dict(batch=8, d_in=6, d_hidden=4, d_out=2)


def plan_file(tmp_path, devices=2, **changes):
    """A plan JSON with the fields the backend reads, as `Plan.to_dict` writes them."""
    lib = operator_library()
    graph = models.mlp(**SIZES, library=lib)
    pcg = data_parallel_pcg(graph, lib, devices)
    machine = Machine.preset("h100x8").with_devices(devices)
    data = {
        "schema": PLAN_SCHEMA, "version": PLAN_VERSION, "devices": devices, "graph": graph.to_dict(),
        "nodes": [{"id": n.id, "kind": n.kind, "op": n.op, "attrs": dict(n.attrs), "inputs": list(n.inputs),
                   "shape": list(n.shape), "spread": n.degrees.to_dict(), "role": n.role, "origin": n.origin}
                  for n in pcg.nodes],
        "outputs": [{"name": name, "node": i} for name, i in zip(pcg.output_names, pcg.outputs)],
        "totals": {"comm_elements": totals(price_pcg(pcg, lib, machine), machine).comm_elements},
    }
    data.update(changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


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


def test_a_plan_whose_pieces_do_not_line_up_is_refused_before_any_rank_starts(monkeypatch, data_parallel_matmul):
    """Spreads that type (data parallelism) but pieces on other ranks: refused naming the node, no rank run."""
    from parsat.backend import executor

    def no_launch(*_args, **_kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(executor, "launch", no_launch)
    with pytest.raises(executor.ExecutionError, match=r"cannot run on 4 ranks: at node #6, matmul: inputs are "
                                                      r"spread over different ranks"):
        executor.check_worlds(data_parallel_matmul(aligned=False), 4)
    executor.check_worlds(data_parallel_matmul(aligned=True), 4)
