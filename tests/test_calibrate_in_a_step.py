"""Issue 31's demo: figures `parsat calibrate` measures as a step meets them, robust to the moment they are taken.

The products are timed in passes spread over the calibration (`GemmPasses`), each figure the median of its passes,
so a few seconds of half-speed compute move none of them, and so are the collectives as a step issues them
(`StepCollectives`); the fixed costs of a step's calls (`StepCalls`)
are timed as the first calls after a product, its backward and a barrier, and priced per forward operator beside
`dispatch_s` (`OpEfficiency.op_time`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from parsat.backend import calibrate  # noqa: E402
from parsat.backend.launch import RankContext  # noqa: E402
from parsat.ir.machine_profile import OpEfficiency  # noqa: E402


@pytest.fixture
def one_rank():
    """A one-rank gloo group in this process: what `calibrate`'s timing needs to run (barriers, the max)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield RankContext(0, 1, "gloo", torch.device("cpu"))
    dist.destroy_process_group()


class _Clock:
    """A clock that advances by `step` at each call to `tick` and is read by the timing code."""

    def __init__(self) -> None:
        self.now, self.step = 0.0, 0.001

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.step


def test_products_are_timed_in_passes_and_a_slow_pass_does_not_move_their_figure(one_rank):
    clock = _Clock()
    events = []
    budget = calibrate.Budget(repeats=5, window_s=0.0, clock=clock)
    products = calibrate.GemmPasses(one_rank, budget, lambda: None)

    def call(name):
        def run():
            events.append(name)
            clock.tick()
        return run

    products.add(["matmul", [2, 2, 2], 16.0, 96.0], call("forward"))
    products.add(["matmul_nt", [2, 2, 2], 16.0, 96.0], call("backward"), prepare=lambda: events.append("prepare"))
    assert events == ["forward"] * 3 + ["prepare", "backward"] * 3   # two warm-ups and the call sizing a round
    events.clear()
    for slow in (False, True, False, False, False):   # the second pass meets a moment at a third of the speed
        clock.step = 0.003 if slow else 0.001
        products.run_pass()
        clock.step = 0.001
        events.append("something else measured")
    # one call a round (window 0), each product once a pass, the calibration's other measurements between passes
    assert events == ["forward", "prepare", "backward", "something else measured"] * 5
    assert products.passes == 5
    products.run_pass(spread=True)   # a pass placed in the calibration after `repeats` have run: none
    assert products.passes == 5 and len(events) == 4 * 5
    rows = products.rows()
    assert [row[0] for row in rows] == ["matmul", "matmul_nt"]
    assert [row[2] for row in rows] == [pytest.approx(0.001)] * 2   # the median of 1, 3, 1, 1, 1 ms
    assert rows[0][1] == [2, 2, 2] and rows[0][3:] == [16.0, 96.0]
    assert products.passes_of("matmul", [2, 2, 2]) == pytest.approx([0.001, 0.003, 0.001, 0.001, 0.001])


def test_a_step_s_calls_are_timed_after_a_product_its_backward_and_a_barrier(one_rank, monkeypatch):
    events = []
    monkeypatch.setattr(calibrate, "apply_op", lambda op, args, attrs: events.append(op) or args[0] * 1.0)
    barrier = dist.barrier
    monkeypatch.setattr(calibrate.dist, "barrier", lambda *a, **k: events.append("barrier") or barrier(*a, **k))
    replicate = calibrate.parallel_op
    monkeypatch.setattr(calibrate, "parallel_op", lambda *a, **k: events.append("parallel") or replicate(*a, **k))
    from parsat.backend import executor
    run_op = executor.apply_op
    monkeypatch.setattr(executor, "apply_op",
                        lambda op, args, attrs: events.append(f"run {op}") or run_op(op, args, attrs))
    steps = []
    monkeypatch.setattr(calibrate.Optimizer, "step", lambda self: steps.append((self.kind, len(self.params))))
    budget = calibrate.Budget(repeats=2, window_s=0.0)
    calls = calibrate.StepCalls(one_rank, torch.float64, 8, budget, lambda: None)
    calls.run_pass()
    figures = calls.figures()
    assert set(figures) == {"dispatch", "node", "backward", "parallel", "loss_path", "update_sgd", "update_adam"}
    assert all(seconds >= 0 for seconds in figures.values())
    chain = ["scale", "relu"] * (calibrate.STEP_CALL_CHAIN // 2)
    rounds = budget.repeats   # a pass (`_rank_measure` runs `STEP_ROUNDS_FACTOR`, spread over the calibration)
    made = 2 + rounds   # two warm-ups, then one a round
    forward = (["barrier"] + chain) * 2 + (["barrier", "barrier"] + chain) * rounds
    # the same chain as a plan `parsat run`'s interpreter runs, node by node
    interpreted = (["barrier"] + [f"run {op}" for op in chain]) * 2 \
        + (["barrier", "barrier"] + [f"run {op}" for op in chain]) * rounds
    # each round: its barrier, the product and backward, the barrier before the timed call; the backward's chain
    # recorded before the product (its backward is not an `apply_op`)
    backward = (chain + ["barrier"]) * 2 + (["barrier"] + chain + ["barrier"]) * rounds
    parallel = ["barrier", "parallel"] * 2 + ["barrier", "barrier", "parallel"] * rounds   # one node a round
    # the interpreter's loss, then `loss_terms` alone, each after the plan's forward, the product and the barrier
    runs = [f"run {op}" for op in chain]
    loss = ((runs + ["barrier"]) * 2 + (["barrier"] + runs + ["barrier"]) * rounds) * 2
    updates = (["barrier"] * 2 + ["barrier", "barrier"] * rounds) * 2
    assert events == forward + interpreted + backward + parallel + loss + updates
    assert steps == [("sgd", calibrate.STEP_UPDATE_TENSORS)] * made + [("adam", calibrate.STEP_UPDATE_TENSORS)] * made
    calls.passes.append({**figures, "parallel": 3 * figures["parallel"]})   # a slow pass ...
    calls.passes.append(figures)
    assert calls.figures() == figures   # ... leaves each figure at the median of its passes


def test_the_call_in_a_step_is_priced_per_forward_operator_beside_dispatch():
    eff = OpEfficiency(dispatch_s=5e-6, backward_dispatch_s=4e-6, step_dispatch_s=30e-6)
    assert eff.op_time(1e-4) == pytest.approx(1.3e-4)              # the call as a step makes it
    assert eff.op_time(1e-4, backward=True) == pytest.approx(1.04e-4)   # autograd's nodes: backward's own
    assert OpEfficiency(dispatch_s=5e-6).op_time(1e-4) == pytest.approx(1.05e-4)   # not measured: dispatch alone
    assert OpEfficiency(dispatch_s=40e-6, step_dispatch_s=30e-6).op_time(0.0) == pytest.approx(40e-6)
    # a measured `sequence_factor` (--dtensor) already holds what a step adds: the cold call is not added twice
    scaled = OpEfficiency(dispatch_s=5e-6, step_dispatch_s=30e-6, sequence_factor=1.5)
    assert scaled.op_time(1e-4) == pytest.approx(1.05e-4 * 1.5)
    assert OpEfficiency.from_dict(eff.to_dict()) == eff
    assert "step_dispatch_s" not in OpEfficiency(dispatch_s=5e-6).to_dict()   # older files read as before


def test_a_timing_compared_with_its_prediction_is_priced_warm_as_it_was_timed():
    from parsat.ir.machine import Machine
    eff = OpEfficiency(dispatch_s=5e-6, step_dispatch_s=30e-6)
    machine = Machine("box", 2, 1, peak_flops=1e9, memory_bandwidth=1e9, memory_capacity=1e9, intra_bandwidth=1e9,
                      intra_latency=1e-6, inter_bandwidth=1e9, inter_latency=1e-6, efficiency=eff)
    timing = calibrate.OpTiming("copy", (1000,), 1e-5, 0.0, 16000.0)
    assert timing.predicted(machine) == pytest.approx(5e-6 + 16000.0 / 1e9)


def test_collectives_are_timed_in_passes_and_a_slow_pass_does_not_move_their_figure(one_rank, monkeypatch):
    clock = _Clock()
    events = []
    monkeypatch.setattr(calibrate, "_groups", lambda ctx: {2: None})
    monkeypatch.setattr(calibrate, "_step_product", lambda ctx, dtype, size: lambda: events.append("product"))

    def cases(ctx, dtype, n, g, group):
        def run(kind):
            return lambda: events.append(kind) or clock.tick()
        return [("all_reduce", run("all_reduce")), ("send_recv", run("send_recv"))]

    monkeypatch.setattr(calibrate, "collective_cases", cases)
    budget = calibrate.Budget(repeats=3, window_s=0.0, clock=clock)
    collectives = calibrate.StepCollectives(one_rank, torch.float64, budget, [256, 4096], lambda: None)
    for slow in (False, True, False):   # the second pass falls in a stretch at a third of the speed
        clock.step = 0.003 if slow else 0.001
        collectives.run_pass()
        events.append("something else measured")
    a_pass = (["product", "all_reduce"] * (2 + 3) + ["product", "send_recv"] * (2 + 3)) * 2   # two sizes
    assert events == (a_pass + ["something else measured"]) * 3
    # each figure the median of its passes: the other passes' 1 ms (a send/recv round trip is two messages)
    assert collectives.rows() == [["all_reduce", 2, 2048.0, pytest.approx(0.001)],
                                  ["send_recv", 2, 2048.0, pytest.approx(0.0005)],
                                  ["all_reduce", 2, 32768.0, pytest.approx(0.001)],
                                  ["send_recv", 2, 32768.0, pytest.approx(0.0005)]]
    assert collectives.passes_of("all_reduce", 2) == pytest.approx([0.001, 0.003, 0.001])   # the 2 KB one's


def test_a_collective_a_backend_lacks_is_left_out_of_the_passes_that_lacked_it():
    passes = [{"a": 1.0, "b": 5.0}, {"a": 3.0}, {"a": 2.0, "b": 7.0}]
    assert calibrate.median_of_passes(passes) == {"a": 2.0, "b": 6.0}
