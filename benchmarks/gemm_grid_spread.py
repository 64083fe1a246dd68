"""How far apart calibrations price the same products, and how far from measured: the fit alone against the grid.

Reads `parsat calibrate --json` outputs (the last line of each: the machine and every timed call) and prints, for
each calibration, the products the demo's plan runs (`parsat optimize mlp --devices 2`: per rank [128, 784] @
[784, 256] and [128, 256] @ [256, 10], forward and autograd's two backward products) priced two ways:

* fit: the Hockney fit (`calibrate.fit_gemm`, `fit_layouts`) on the products timed before the grid existed (the
  squares and the skinny ones), as a machine without `gemm_grids` prices them;
* grid: the calibration's own machine (its `gemm_grids` inside the grid's box, the fit beyond).

Each price is a call's (the kernel and the machine's `dispatch_s`, as `OpTiming.predicted`). Then the spread of
each price over the calibrations (max / min), the prices against `--measured` (the demo's products timed as the
calibration times its grid: `GemmPasses`, a JSON whose "rows" are [op, shape, seconds, ...]), and every mid-size
product each calibration measured priced by every other calibration's machine of each way (a machine prices
products minutes to hours after it was measured), by the sizes' class: all powers of two, all three times one
(a calibration whose grid was on 96, 192, 384), or mixed.

    .venv/bin/python benchmarks/gemm_grid_spread.py CAL.json... [--measured PROBE.json...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parsat.backend.calibrate import OpTiming, fit_gemm, fit_layouts  # noqa: E402
from parsat.ir.machine import Machine  # noqa: E402

DEMO = (("matmul", (128, 256, 784)), ("matmul_nt", (128, 784, 256)), ("matmul_tn", (784, 256, 128)),
        ("matmul", (128, 10, 256)), ("matmul_nt", (128, 256, 10)), ("matmul_tn", (256, 10, 128)))
"""The demo's products on one rank, each in its own (m, n, k) (`cost.op_time.BACKWARD_PRODUCTS`)."""
PRODUCTS = ("matmul", "matmul_nt", "matmul_tn")


def load(path: str) -> tuple[Machine, list[OpTiming]]:
    last = [line for line in Path(path).read_text().splitlines() if line.startswith("{")][-1]
    data = json.loads(last)
    ops = [OpTiming(o["op"], tuple(o["shape"]), o["seconds"], o["flops"], o["bytes"]) for o in data["ops"]
           if o["op"] in PRODUCTS]
    return Machine.from_dict(data["machine"]), ops


def fit_alone(machine: Machine, ops: list[OpTiming]) -> Machine:
    """`machine` as a calibration without the grid prices products: the fit on the pre-grid shapes only."""
    nodes = grid_nodes(machine)
    old = [t for t in ops if not set(t.shape) <= nodes]
    peak, halves = fit_gemm([t for t in old if t.op == "matmul"])
    eff = replace(machine.efficiency, gemm_grids=(), gemm_half_m=halves[0], gemm_half_n=halves[1],
                  gemm_half_k=halves[2], **fit_layouts(old, peak))
    return replace(machine, peak_flops=peak, efficiency=eff)


def grid_nodes(machine: Machine) -> set[int]:
    """The sizes of the machine's grid (empty without one): its products are left out of the fit alone."""
    grids = machine.efficiency.gemm_grids
    return {int(x) for x in grids[0].ms} if grids else set()


def priced(machine: Machine, op: str, shape: tuple[int, ...]) -> float:
    m, n, k = shape
    return OpTiming(op, shape, 0.0, 2.0 * m * n * k, 0.0).predicted(machine)


def spread(values: list[float]) -> str:
    return f"{min(values) * 1e3:.3f}-{max(values) * 1e3:.3f} ms ({max(values) / min(values):.3f}x)"


def size_class(shape: tuple[int, ...]) -> str:
    """"pow2" where every size is a power of two, "3x2^k" where every one is three times one, else "mixed"."""
    if all(x & (x - 1) == 0 for x in shape):
        return "pow2"
    if all(x % 3 == 0 and (x // 3) & (x // 3 - 1) == 0 for x in shape):
        return "3x2^k"
    return "mixed"


def way_of(machine: Machine) -> str:
    """'grid 128-512' (its grid's sizes) for a machine with a grid, else 'fit'."""
    grids = machine.efficiency.gemm_grids
    return f"grid {grids[0].ms[0]:g}-{grids[0].ms[-1]:g}" if grids else "fit"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("calibrations", nargs="+")
    parser.add_argument("--measured", nargs="*", default=[])
    args = parser.parse_args()
    cals = [(Path(p).name, *load(p)) for p in args.calibrations]
    machines = [(name, "fit", fit_alone(m, ops)) for name, m, ops in cals]
    machines += [(name, way_of(m), m) for name, m, _ops in cals if m.efficiency.gemm_grids]
    ways = sorted({way for _n, way, _m in machines}, key=lambda w: (w != "fit", w))
    truth: dict[tuple, list[float]] = {}
    for path in args.measured:
        for op, shape, seconds, *_rest in json.loads(Path(path).read_text())["rows"]:
            truth.setdefault((op, tuple(shape)), []).append(seconds)
    labels = [f"{op[7:] or 'nn'} {'x'.join(map(str, s))}" for op, s in DEMO]
    print(f"{'calibration':<24} {'way':<13} {'peak':>6}  " + "  ".join(labels))
    for name, way, machine in sorted(machines, key=lambda r: (r[0], r[1] != "fit")):
        row = "  ".join(f"{priced(machine, op, s) * 1e3:>{len(label)}.4f}" for (op, s), label in zip(DEMO, labels))
        print(f"{name:<24} {way:<13} {machine.peak_flops / 1e9:6.1f}  {row}")
    print("\nthe demo's products over the calibrations (a call: kernel + dispatch), and against measured:")
    for (op, shape), label in zip(DEMO, labels):
        line = []
        for way in ways:
            prices = [priced(m, op, shape) for _n, w, m in machines if w == way]
            line.append(f"{way} {spread(prices)}")
            if (op, shape) in truth:
                measured = statistics.median(truth[op, shape])
                line[-1] += f" = {min(prices) / measured:.2f}-{max(prices) / measured:.2f} x measured"
        if (op, shape) in truth:
            line.append("measured " + ", ".join(f"{t * 1e3:.3f}" for t in truth[op, shape]) + " ms")
        print(f"  {label:<16} " + "; ".join(line))
    print("\nmid-size products (every size 96-512) measured in one calibration, priced by each other calibration's "
          "machine: |priced / measured - 1| median, signed median, worst (count)")
    for way in ways:
        errors: dict[tuple[str, str], list[float]] = {}
        for name, _m, ops in cals:
            for t in ops:
                if min(t.shape) < 96 or max(t.shape) > 512:
                    continue
                for other, w, machine in machines:
                    if w == way and other != name:
                        errors.setdefault((t.op, size_class(t.shape)), []).append(t.predicted(machine) / t.seconds - 1)
        for (op, cls), e in sorted(errors.items()):
            print(f"  {way:<13} {op:<10} {cls:<6} {statistics.median(map(abs, e)):.3f} {statistics.median(e):+.3f} "
                  f"{max(map(abs, e)):.3f} ({len(e)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
