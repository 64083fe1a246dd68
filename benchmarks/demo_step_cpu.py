"""The demo rank's operators inside a training step beside the same operators timed as `parsat calibrate` times them.

One process, one thread, float64 (as `parsat run`'s ranks), thread CPU time (so that other jobs on a shared box
move it less than wall time): the MLP's step on rank 0's pieces of the demo plan (x [128, 784] @ w1 [784, 256],
relu, @ w2 [256, 10], the objective, backward, `parsat run`'s SGD), no collective, phase by phase (medians of 55
steps); then the same operators timed three ways: alone and repeated on the same operands (how the calibration
timed everything before 2026-12-02), and, as the calibration times them now, right after what runs before them in
a step (`calibrate.average_after`: the backward product right after its forward, the update right after a
backward). A measurement, not a test.

    PYTHONPATH=. .venv/bin/python benchmarks/demo_step_cpu.py
"""

from __future__ import annotations

import statistics
import time

import torch

from parsat.backend.calibrate import Budget, average_after
from parsat.backend.executor import Optimizer
from parsat.backend.training_data import TrainConfig, objective
from parsat.importer.torch_ops import apply_op

DT = torch.float64
CLOCK = time.thread_time
PHASES = ("mm1", "relu", "mm2", "loss", "backward", "optimizer")


def step_phases(steps: int = 60, warmup: int = 5) -> dict[str, float]:
    """Median thread CPU ms of each phase of the rank's step."""
    w1 = torch.randn(784, 256, dtype=DT).requires_grad_()
    w2 = torch.randn(256, 10, dtype=DT).requires_grad_()
    optimizer, target = Optimizer([w1, w2], TrainConfig()), torch.randn(128, 10, dtype=DT)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    for i in range(steps):
        x = torch.randn(128, 784, dtype=DT)   # drawn before the step's clock, as `StepData.loaded`
        marks = [CLOCK()]
        h = apply_op("matmul", [x, w1], {})
        marks.append(CLOCK())
        r = apply_op("relu", [h], {})
        marks.append(CLOCK())
        out = apply_op("matmul", [r, w2], {})
        marks.append(CLOCK())
        loss = objective(out, target, 128 * 10)
        marks.append(CLOCK())
        optimizer.zero_grad()
        loss.backward()
        marks.append(CLOCK())
        optimizer.step()
        marks.append(CLOCK())
        if i >= warmup:
            for phase, a, b in zip(PHASES, marks, marks[1:]):
                times[phase].append(b - a)
    return {p: statistics.median(v) * 1e3 for p, v in times.items()}


def _repeated(fn, calls: int = 40) -> float:
    fn()
    fn()
    start = CLOCK()
    for _ in range(calls):
        fn()
    return (CLOCK() - start) / calls * 1e3


def _after(prepare, fn) -> float:
    return average_after(prepare, fn, Budget(40, 0.05), lambda: None, CLOCK) * 1e3


def operators() -> dict[str, float]:
    """Thread CPU ms of the step's main operators, repeated alone and right after what precedes them."""
    x, w1, g = torch.randn(128, 784, dtype=DT), torch.randn(784, 256, dtype=DT), torch.randn(128, 256, dtype=DT)
    wg = w1.clone().requires_grad_()
    held: dict = {}

    def forward():
        wg.grad = None
        held["y"] = x @ wg

    def update(rows: int, cols: int) -> tuple[float, float]:
        w, a = torch.randn(rows, cols, dtype=DT).requires_grad_(), torch.randn(4, rows, dtype=DT)
        opt = Optimizer([w], TrainConfig())

        def backward():
            opt.zero_grad()
            (a @ w).sum().backward()

        backward()
        alone = _repeated(lambda: w.detach().sub_(0.01 * w.grad))
        return alone, _after(backward, opt.step)

    (w1_alone, w1_after), (w2_alone, w2_after) = update(784, 256), update(256, 10)
    return {"forward x @ w1, repeated": _repeated(lambda: apply_op("matmul", [x, w1], {})),
            "x^T @ g, repeated": _repeated(lambda: torch.mm(x.t(), g)),
            "x^T @ g as autograd runs it right after the forward": _after(forward, lambda: held["y"].backward(g)),
            "SGD update of w1 and w2, repeated": w1_alone + w2_alone,
            "SGD update of w1 and w2 right after a backward": w1_after + w2_after}


def main() -> None:
    torch.set_num_threads(1)
    print("step phases (thread CPU ms):", {k: round(v, 3) for k, v in step_phases().items()})
    for name, ms in operators().items():
        print(f"  {name:55s} {ms:7.3f} ms")


if __name__ == "__main__":
    main()
