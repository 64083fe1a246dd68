"""The loss as `parsat calibrate` measured it in a step's place prices the step's loss (issue 31): the demo's
loss ran 0.14-0.22 ms where six memory-bound operators priced it at 0.03 ms."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from parsat.api import optimize  # noqa: E402
from parsat.backend.calibrate import OpTiming, fit_loss  # noqa: E402
from parsat.backend.cli import load_plan  # noqa: E402
from parsat.backend.executor import operator_library  # noqa: E402
from parsat.backend.training_data import loss_terms, objective  # noqa: E402
from parsat.cost.pcg_tasks import PARSAT_RUN, simulate_pcg  # noqa: E402
from parsat.ir.machine import Machine  # noqa: E402
from parsat.ir.machine_profile import OpEfficiency  # noqa: E402


def test_fit_loss_recovers_the_fixed_cost_and_the_cost_per_element():
    rows = [OpTiming(op, (n,), fixed + n * slope, 0.0, 0.0) for op, fixed, slope in
            (("loss", 6e-5, 2e-9), ("loss_backward", 9e-5, 1e-9)) for n in (256, 4096, 65536)]
    fitted = fit_loss(rows)
    assert fitted["loss_s"] == pytest.approx(6e-5) and fitted["loss_element_s"] == pytest.approx(2e-9)
    assert fitted["loss_backward_s"] == pytest.approx(9e-5) and fitted["loss_backward_element_s"] == pytest.approx(1e-9)
    noisy = fit_loss([OpTiming("loss", (n,), s, 0.0, 0.0) for n, s in ((256, 7e-5), (4096, 6e-5), (65536, 5e-5))])
    assert noisy["loss_element_s"] == 0.0 and noisy["loss_s"] == 5e-5   # a falling line: the least time, no slope
    assert fit_loss([]) == {}


def test_the_step_runs_and_the_calibration_times_one_loss():
    out = torch.randn(4, 3, dtype=torch.float64)
    target = torch.randn(4, 3, dtype=torch.float64)
    to_diff, to_report = loss_terms([(out, target, 24, 2, 4), (out, None, 12, 1, 1)])
    assert float(to_diff) == pytest.approx(float(objective(out, target, 24)) / 2 + float(out.sum()))
    assert float(to_report) == pytest.approx(float(objective(out, target, 24)) / 4 + float(out.sum()))


def test_a_measured_loss_prices_the_steps_loss_and_a_machine_without_it_prices_as_before(tmp_path):
    path = tmp_path / "plan.json"
    optimize("mlp", machine="cpu", devices=2).save(path)
    pcg = load_plan(str(path), 2)[0]
    cpu = Machine.preset("cpu")

    def step(efficiency: OpEfficiency) -> float:
        return simulate_pcg(pcg, operator_library(), replace(cpu, efficiency=efficiency), PARSAT_RUN).step_s

    before = step(cpu.efficiency)
    assert cpu.efficiency.loss_time(1280) is None
    measured = replace(cpu.efficiency, loss_s=1.0, loss_element_s=1e-6, loss_backward_s=2.0)
    elements = pcg.node(pcg.outputs[0]).shape
    piece = elements[0] * elements[1] / pcg.node(pcg.outputs[0]).degrees.shard[0] / \
        pcg.node(pcg.outputs[0]).degrees.shard[1]
    assert step(measured) - before == pytest.approx(3.0 + piece * 1e-6, abs=2e-3)   # one loss and its backward
    saved = OpEfficiency.from_dict(measured.to_dict())
    assert saved.loss_time(100.0) == measured.loss_time(100.0) == 1.0 + 1e-4
    assert not any(k.startswith("loss") for k in cpu.efficiency.to_dict())   # unmeasured: the file as before
