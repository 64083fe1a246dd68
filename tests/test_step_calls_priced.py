"""Issue 31's demo: the calls of `parsat run`'s step that `parsat calibrate` times as the step makes them
(`calibrate.StepCalls`), priced where the step makes them: a forward operator's and a backward node's fixed cost
(`OpEfficiency.op_time`), a parallel node's host path (`parallel_path_time`, a task of its own before the node's
body in `parsat run`'s profile) and the optimizer's fixed cost per parameter tensor (`update_time`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.cost.pcg_tasks import PARSAT_RUN, TORCH_NATIVE, simulate_pcg
from parsat.ir.machine import Machine
from parsat.ir.machine_profile import OpEfficiency

from tests.test_cost_pcg_tasks import LIB, megatron_mlp

CPU64 = Machine.preset("cpu").with_precision("fp64")
POINTS = (("sgd", ((1024.0, 10e-6), (1 << 20, 1e-3))),)


def test_backward_nodes_parallel_paths_and_updates_are_priced_as_a_step_makes_them():
    eff = OpEfficiency(dispatch_s=5e-6, backward_dispatch_s=4e-6, step_dispatch_s=30e-6,
                       step_backward_dispatch_s=12e-6, step_parallel_s=80e-6, step_update_sgd_s=40e-6,
                       update_points=POINTS)
    assert eff.op_time(1e-4, backward=True) == pytest.approx(1.12e-4)   # the node as a step's backward runs it
    assert OpEfficiency(backward_dispatch_s=20e-6, step_backward_dispatch_s=12e-6).op_time(0.0, True) == 20e-6
    assert eff.parallel_path_time() == pytest.approx(50e-6)   # beyond the one call its body is priced as
    assert OpEfficiency(dispatch_s=5e-6, step_parallel_s=3e-6).parallel_path_time() == 0.0
    # the update's fixed part (its smallest measured point, 10 us) paid as a step pays it (40 us), per tensor
    assert eff.update_time("sgd", 1024) == pytest.approx(40e-6)
    assert eff.update_time("sgd", 1 << 20) == pytest.approx(1e-3 + 30e-6)
    assert eff.update_time("adam", 1024) is None   # not measured: still not
    assert replace(eff, step_update_sgd_s=5e-6).update_time("sgd", 1024) == pytest.approx(10e-6)   # never less
    # a `sequence_factor` measured with --dtensor holds a step's cold calls: the backward's not added twice
    assert replace(eff, sequence_factor=2.0).op_time(0.0, True) == pytest.approx(8e-6)
    assert OpEfficiency.from_dict(eff.to_dict()) == eff
    older = OpEfficiency(dispatch_s=5e-6, backward_dispatch_s=4e-6, step_dispatch_s=30e-6, update_points=POINTS)
    written = older.to_dict()   # older files read, and are written, as before
    assert not any(k in written for k in ("step_backward_dispatch_s", "step_parallel_s", "step_update_sgd_s",
                                          "step_update_adam_s", "step_node_s", "step_loss_path_s"))
    assert OpEfficiency.from_dict(written) == older
    assert older.parallel_path_time() == 0.0 and older.update_time("sgd", 1024) == pytest.approx(10e-6)


def _tasks(run, text: str) -> list[float]:
    return [s.end - s.start for s in run.result.spans if text in s.name]


def test_parsat_run_prices_each_parallel_node_s_path_and_each_update_s_fixed_cost_in_a_step():
    """megatron_mlp: the replicate of x and the reduce of the partial sums run `parallel_op` (their weights'
    partitions are stored sharded: no call); two weight pieces updated."""
    pcg = megatron_mlp()
    base = replace(CPU64, efficiency=replace(CPU64.efficiency, update_points=POINTS))
    measured = replace(base, efficiency=replace(base.efficiency, step_parallel_s=80e-6, step_update_sgd_s=40e-6))
    before, after = simulate_pcg(pcg, LIB, base, PARSAT_RUN), simulate_pcg(pcg, LIB, measured, PARSAT_RUN)
    path = measured.efficiency.parallel_path_time()
    assert path > 0
    paths = _tasks(after, "parsat run's parallel path")
    assert paths == [pytest.approx(path)] * 2 and not _tasks(before, "parsat run's parallel path")
    names = [s.name for s in after.result.spans]
    for node, body in (("replicate(axis=tp, degree=2) #5", ""), ("reduce(axis=tp, degree=2) #9", " copy")):
        assert names.index(f"{node} (parsat run's parallel path)") + 1 == names.index(node + body)   # just before

    def optimizer(run):
        return sum(s.end - s.start for s in run.result.spans if s.phase == "optimizer")

    assert optimizer(after) - optimizer(before) == pytest.approx(2 * (40e-6 - 10e-6))
    assert after.step_s >= before.step_s + 2 * path + 2 * 30e-6 - 1e-12
    # a runtime that does not run `parallel_op` (the torch-native one) pays no such path
    assert not _tasks(simulate_pcg(pcg, LIB, measured, replace(PARSAT_RUN, interpreted=False)),
                      "parallel path")
    assert not TORCH_NATIVE.interpreted


def test_parsat_run_prices_its_interpreter_s_loop_on_every_node_it_runs():
    """megatron_mlp's forward runs 6 nodes through the interpreter: the data x, the replicate, the two products, the
    relu and the reduce (its weights' partitions are stored sharded: looked up, not run)."""
    pcg = megatron_mlp()
    measured = replace(CPU64, efficiency=replace(CPU64.efficiency, step_node_s=7e-6))

    def forward(run):
        return sum(s.end - s.start for s in run.result.spans if s.phase == "forward")

    before, after = simulate_pcg(pcg, LIB, CPU64, PARSAT_RUN), simulate_pcg(pcg, LIB, measured, PARSAT_RUN)
    assert forward(after) - forward(before) == pytest.approx(6 * 7e-6)
    assert _tasks(after, "parsat run's parallel path") == [pytest.approx(7e-6)] * 2
    assert simulate_pcg(pcg, LIB, measured, replace(PARSAT_RUN, interpreted=False)).step_s == before.step_s


def test_parsat_run_prices_its_interpreter_s_work_around_each_output_s_loss():
    pcg = megatron_mlp()
    measured = replace(CPU64, efficiency=replace(CPU64.efficiency, step_loss_path_s=60e-6))

    def loss(run):
        return sum(s.end - s.start for s in run.result.spans if s.name.startswith("loss of"))

    before, after = simulate_pcg(pcg, LIB, CPU64, PARSAT_RUN), simulate_pcg(pcg, LIB, measured, PARSAT_RUN)
    assert loss(after) - loss(before) == pytest.approx(60e-6)   # one output
    assert loss(simulate_pcg(pcg, LIB, measured, replace(PARSAT_RUN, interpreted=False))) == loss(before)
