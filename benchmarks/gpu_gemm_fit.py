"""Fits the GPU presets' GEMM efficiency curve to the GEMMs measured on an H200 (benchmarks/gpu/gpu_kernels.json).

    python3 benchmarks/gpu_gemm_fit.py [--kernels benchmarks/gpu/gpu_kernels.json]

The cost model prices a GEMM of local shape m x k by k x n at

    rate = peak x gemm_peak_fraction / ((1 + gemm_half_m/m)(1 + gemm_half_n/n)(1 + gemm_half_k/k))

(`ir.machine_profile.OpEfficiency.gemm_efficiency`). This script finds the four parameters by least squares in
log rate over a grid of half lengths (the fraction, for given half lengths, is the geometric mean of the
residual), on the measured GEMMs that take at least `--min-seconds` (50 us): below that a call is launch-bound
(512 x 1024 x 1024 took 27 us, longer than 512 x 2048 x 2048), which the cost model charges as dispatch, not as a
GEMM rate. It prints the fit, the measured / predicted rate of every row (fitted and left out), and the same for
the curve the presets assumed before (fraction 1, halves 128/128/64). No parameter is fitted to a published run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics

H200_PEAK = 989e12   # dense bf16, the same as the H100 SXM the h100x8 preset describes
GRID = (0, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768)


def efficiency(fraction: float, halves: tuple[float, float, float], m: float, k: float, n: float) -> float:
    """The cost model's GEMM efficiency curve (m rows, k contraction, n columns)."""
    hm, hn, hk = halves
    return fraction / ((1 + hm / m) * (1 + hn / n) * (1 + hk / k))


def fit(rows: list[dict]) -> tuple[float, tuple[float, float, float], float]:
    """(fraction, (half_m, half_n, half_k), rms error in log rate) minimising the squared log error over `rows`."""
    best = None
    for halves in itertools.product(GRID, GRID, GRID):
        logs = [math.log(r["tflops"] * 1e12 / H200_PEAK) - math.log(efficiency(1.0, halves, r["m"], r["k"], r["n"]))
                for r in rows]
        centre = statistics.fmean(logs)
        err = math.sqrt(statistics.fmean([(x - centre) ** 2 for x in logs]))
        if best is None or err < best[2]:
            best = (math.exp(centre), halves, err)
    return best


def main() -> None:
    """Fit, then print every row's measured over predicted rate under the fit and under the old assumption."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="benchmarks/gpu/gpu_kernels.json")
    parser.add_argument("--min-seconds", type=float, default=50e-6)
    args = parser.parse_args()
    with open(args.kernels) as f:
        rows = json.load(f)["gemm"]
    used = [r for r in rows if r["seconds"] >= args.min_seconds]
    fraction, halves, err = fit(used)
    print(f"fitted on {len(used)} of {len(rows)} GEMMs (>= {args.min_seconds * 1e6:g} us): gemm_peak_fraction "
          f"{fraction:.3f}, gemm_half_m {halves[0]}, gemm_half_n {halves[1]}, gemm_half_k {halves[2]}; "
          f"rms log error {err:.3f}")
    print("| m | k | n | us | measured TFLOP/s | measured / predicted (fit) | measured / predicted (before) | fitted |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        measured = r["tflops"] * 1e12 / H200_PEAK
        now = measured / efficiency(fraction, halves, r["m"], r["k"], r["n"])
        before = measured / efficiency(1.0, (128, 128, 64), r["m"], r["k"], r["n"])
        print(f"| {r['m']} | {r['k']} | {r['n']} | {r['seconds'] * 1e6:.0f} | {r['tflops']:.0f} | {now:.2f} | "
              f"{before:.2f} | {'yes' if r in used else 'no'} |")
    for name, sel in (("fitted", used), ("left out", [r for r in rows if r not in used])):
        q = [r["tflops"] * 1e12 / H200_PEAK / efficiency(fraction, halves, r["m"], r["k"], r["n"]) for r in sel]
        if q:
            print(f"{name}: {len(q)} rows, measured / predicted {min(q):.2f}-{max(q):.2f}, median "
                  f"{statistics.median(q):.2f}")


if __name__ == "__main__":
    main()
