"""How far apart calibrations price the same products, and how far from measured: the fit alone against the grid.

Reads `parsat calibrate --json` outputs (the last line of each: the machine and every timed call) and prints, for
each calibration, the products the demo's plan runs (`parsat optimize mlp --devices 2`: per rank [128, 784] @
[784, 256] and [128, 256] @ [256, 10], forward and autograd's two backward products) priced two ways:

* fit: the Hockney fit (`calibrate.fit_gemm`, `fit_layouts`) on the products timed before the grid existed (the
  squares and the skinny ones), as a machine without `gemm_grids` prices them;
* grid: the calibration's own machine (its `gemm_grids` inside the grid's box, the fit beyond).

Each price is a call's (the kernel and the machine's `dispatch_s`, as `OpTiming.predicted`). Then the spread of
each price over the calibrations (max / min), the prices against `--measured` (the demo's products timed as the
calibration times its grid: `GemmPasses`, a JSON of [op, shape, seconds, ...] rows), and every grid product of
each calibration priced by every other calibration's machine (a machine is used minutes to hours after it was
measured): median and worst |priced / measured - 1| over the pairs, both ways.

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("calibrations", nargs="+")
    parser.add_argument("--measured", nargs="*", default=[])
    args = parser.parse_args()
    cals = [(Path(p).name, *load(p)) for p in args.calibrations]
    ways = {"fit": [fit_alone(m, ops) for _n, m, ops in cals],
            "grid": [m if m.efficiency.gemm_grids else None for _n, m, _ops in cals]}
    truth: dict[tuple, list[float]] = {}
    for path in args.measured:
        for op, shape, seconds, *_rest in json.loads(Path(path).read_text())["rows"]:
            truth.setdefault((op, tuple(shape)), []).append(seconds)
    print(f"{'calibration':<26} {'way':<5} {'peak':>6}  " + "  ".join(f"{op[7:] or 'nn'} {'x'.join(map(str, s))}"
                                                                 for op, s in DEMO))
    for i, (name, _machine, _ops) in enumerate(cals):
        for way, machines in ways.items():
            if machines[i] is not None:
                row = "  ".join(f"{priced(machines[i], op, s) * 1e3:>{len(op[7:] or 'nn') + 1 + len('x'.join(map(str, s)))}.4f}"
                                for op, s in DEMO)
                print(f"{name:<26} {way:<5} {machines[i].peak_flops / 1e9:6.1f}  {row}")
    for op, shape in DEMO:
        label = f"{op} {'x'.join(map(str, shape))}"
        line = [f"{way} {spread([priced(m, op, shape) for m in ms if m is not None])}" for way, ms in ways.items()
                if any(m is not None for m in ms)]
        if (op, shape) in truth:
            measured = statistics.median(truth[op, shape])
            line.append(f"measured {', '.join(f'{t * 1e3:.3f}' for t in truth[op, shape])} ms")
            line += [f"{way} / measured {min(priced(m, op, shape) for m in ms if m is not None) / measured:.2f}-"
                     f"{max(priced(m, op, shape) for m in ms if m is not None) / measured:.2f}"
                     for way, ms in ways.items() if any(m is not None for m in ms)]
        print(f"{label:<26} " + "; ".join(line))
    for way, machines in ways.items():
        errors = {op: [] for op in PRODUCTS}
        for i, (_n, measured_on, ops) in enumerate(cals):
            nodes = grid_nodes(measured_on)
            for j, machine in enumerate(machines):
                if machine is None or (i == j and way == "grid"):
                    continue
                for t in ops:
                    if set(t.shape) <= nodes:
                        errors[t.op].append(abs(t.predicted(machine) / t.seconds - 1))
        if any(errors.values()):
            print(f"grid products priced by {'another' if way == 'grid' else 'its own or another'} calibration's "
                  f"machine ({way}): " + "; ".join(f"{op}: median {statistics.median(e):.3f}, worst {max(e):.3f} "
                                                   f"({len(e)})" for op, e in errors.items() if e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
