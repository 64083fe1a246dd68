"""`parsat calibrate`: a machine file the cost model loads, measured with tiny sizes."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from parsat.backend.calibrate import CollectiveTiming, fit_link  # noqa: E402
from parsat.cli import main  # noqa: E402
from parsat.ir.machine import Machine  # noqa: E402


def test_fit_link_recovers_alpha_and_bandwidth():
    machine = Machine.preset("cpu")
    small, large = (CollectiveTiming("all_reduce", 4, n, 0.0) for n in (1000, 1_000_000))
    small = CollectiveTiming("all_reduce", 4, 1000, small.predicted(machine))
    large = CollectiveTiming("all_reduce", 4, 1_000_000, large.predicted(machine))
    bandwidth, latency = fit_link(small, large, machine.dtype_bytes)
    assert bandwidth == pytest.approx(machine.intra_bandwidth)
    assert latency == pytest.approx(machine.intra_latency)


def test_calibrate_writes_a_machine_the_optimizer_loads(tmp_path, capsys):
    out = tmp_path / "machine.json"
    code = main(["calibrate", "--machine", "here", "-o", str(out), "--nproc", "2", "--size", "32", "--repeats", "1",
                 "--comm-elements", "16", "4096", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {o["op"] for o in report["ops"]} >= {"matmul", "linear", "softmax", "layernorm", "conv2d"}
    assert {c["kind"] for c in report["collectives"]} == {"all_reduce", "all_gather"}
    machine = Machine.load(out)
    assert machine.name == "here" and machine.devices_per_node == 2
    assert machine.peak_flops > 0 and machine.intra_bandwidth > 0
    assert main(["optimize", "mlp", "--devices", "2", "--machine", str(out), "-q", "--no-baselines",
                 "--set", "batch=8", "--set", "d_in=8", "--set", "d_hidden=8", "--set", "d_out=2"]) == 0


def test_calibrate_refuses_bad_sizes(capsys):
    assert main(["calibrate", "--machine", "x", "-o", "/nonexistent/m.json", "--size", "4"]) == 1
    assert "--size" in capsys.readouterr().err
