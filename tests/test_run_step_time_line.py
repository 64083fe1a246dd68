"""`parsat run` prints the measured step beside the plan's predicted one, and says whose machine that is.

Issue 31: the demo printed a predicted step of the `cpu` preset and then
measured another machine's. A plan priced on a machine measured with
`parsat calibrate` is compared (measured / predicted); a preset's is named
as not this machine's; a plan without a prediction says so.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("torch")

from parsat.api import optimize  # noqa: E402
from parsat.backend.cli import load_plan, step_time_line  # noqa: E402
from parsat.backend.executor import Prediction  # noqa: E402
from parsat.ir.machine import Machine  # noqa: E402
from parsat.ir.machine_profile import CollectivePoint  # noqa: E402


def _plan(tmp_path, machine) -> str:
    path = tmp_path / "plan.json"
    optimize("mlp", machine=machine, devices=2).save(path)
    return str(path)


def test_a_preset_plan_is_named_as_not_this_machine(tmp_path):
    prediction = load_plan(_plan(tmp_path, "cpu"), 2)[2]
    assert (prediction.machine, prediction.machine_kind) == ("cpu", "preset")
    line = step_time_line(0.008, prediction)
    assert "8.000 ms" in line and "for the preset 'cpu', not this machine" in line
    assert "x the prediction" not in line


def test_a_calibrated_plan_is_compared_with_what_ran(tmp_path):
    cpu = Machine.preset("cpu")
    measured = replace(cpu, name="this-box",
                       comm=replace(cpu.comm, points=(CollectivePoint("all_reduce", "intra", 2, 2e-4, 3e8),)))
    machine_file = tmp_path / "machine.json"
    measured.save(machine_file)
    prediction = load_plan(_plan(tmp_path, str(machine_file)), 2)[2]
    assert (prediction.machine, prediction.machine_kind) == ("this-box", "calibrated")
    line = step_time_line(2 * prediction.time_s, prediction)
    assert "on 'this-box' (calibrated): measured 2.00 x the prediction" in line


def test_a_described_machine_and_a_missing_prediction():
    described = Prediction(time_s=0.004).on_machine({"name": "my-box", "comm": {"points": []}})
    assert described.machine_kind == "described"
    assert "described machine 'my-box': measured 0.50 x" in step_time_line(0.002, described)
    assert step_time_line(0.002, Prediction()).endswith("(the plan predicts none)")
    assert Prediction(time_s=1.0).on_machine(None).machine is None
