"""Pipelined plans of a small gpt run through `parsat run --check --json`: measured vs predicted, per stage.

    .venv/bin/python benchmarks/pipeline_run.py [--steps 3]

Each plan comes from the pipeline search (`parsat.optimize` with `pp=2`
pinned, dp or tp of the stage pinned, 4 micro-batches, the schedule pinned):
the cut points are the search's, and the plan is written to a file, which
`parsat run` then trains on gloo ranks, as a user would. Prints
the command per plan and a markdown table (benchmarks/backend_results.md,
section "Pipelined plans").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parsat.api import optimize
from parsat.ir.machine import Machine

SIZES = {"blocks": 4, "batch": 8, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}
MICROBATCHES = 4
# Compute slow and links nearly free: at these tiny sizes a stage plan splits (on "cpu" nothing would).
MACHINE = Machine("two-nodes-of-two", 2, 2, peak_flops=1e8, memory_bandwidth=1e12, memory_capacity=2 ** 30,
                  intra_bandwidth=1e12, intra_latency=1e-9, inter_bandwidth=1e9, inter_latency=1e-6)
# label -> (stage devices, pinned degrees, schedule, chunk starts)
PLANS = {
    "PP 2, 1F1B": (None, "1f1b"),
    "PP 2, GPipe": (None, "gpipe"),
    "PP 2, interleaved v=2": (None, "interleaved"),
    "PP 2 x DP 2, 1F1B": ({"dp": 2}, "1f1b"),
    "PP 2 x TP 2, 1F1B": ({"tp": 2}, "1f1b"),
    "PP 2 x TP 2, interleaved v=2": ({"tp": 2}, "interleaved"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for index, (label, (degrees, schedule)) in enumerate(PLANS.items()):
            devices = 2 * (2 if degrees else 1)
            plan = optimize("gpt", MACHINE, devices=devices, sizes=SIZES, microbatches=MICROBATCHES,
                            degrees={"pp": 2, **(degrees or {})}, schedule=schedule)
            cuts = " | ".join(",".join(map(str, c.layers)) for c in plan.pipeline.layout.chunks)
            print(f"{label}: chunks (layers) {cuts}", flush=True)
            path = Path(folder) / f"plan{index}.json"
            plan.save(path)
            command = [sys.executable, "-m", "parsat", "run", str(path), "--nproc", str(plan.devices), "--check",
                       "--steps", str(args.steps), "--json"]
            print(f"{label}: parsat run plan.json --nproc {plan.devices} --check --steps {args.steps} --json",
                  flush=True)
            start = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, timeout=900)
            wall = time.perf_counter() - start
            if done.returncode not in (0, 1) or not done.stdout.strip():
                print(done.stderr, file=sys.stderr)
                rows.append((label, None, wall))
                continue
            print(done.stdout)
            rows.append((label, json.loads(done.stdout.strip().splitlines()[-1]), wall))
    print(table(rows))


def table(rows) -> str:
    lines = ["| plan | ranks | stage | collectives meas. / pred. | p2p per rank meas. / pred. | "
             "tied-weight sum per rank meas. / pred. | check (largest rel. diff) | step (median) |",
             "|---|---|---|---|---|---|---|---|"]
    for label, result, wall in rows:
        if result is None:
            lines.append(f"| {label} | | | failed to run ({wall:.0f} s) | | | | |")
            continue
        pipeline = result["pipeline"]
        for stage in pipeline["stages"]:
            p2p = "; ".join(f"to {t}: {'/'.join(f'{x:,.0f}' for x in sorted(set(xs)))} / "
                            f"{stage['p2p_sent_predicted'][t]:,}" for t, xs in stage["p2p_sent_measured"].items())
            shared = f"{'/'.join(f'{x:,.0f}' for x in sorted(set(stage['shared_sum_measured'])))} / " \
                     f"{stage['shared_sum_predicted']:,.0f}"
            first = stage["stage"] == 0
            check = f"{result['check']} ({result['max_rel_diff']:.1e})" if first else ""
            step = f"{result['step_time_s'] * 1e3:.0f} ms" if first else ""
            ranks = len(stage["ranks"]) * pipeline["degree"] if first else ""
            lines.append(f"| {label if first else ''} | {ranks} | {stage['stage']} | "
                         f"{stage['collectives_measured']:,.0f} / {stage['collectives_predicted']:,} | {p2p} | "
                         f"{shared} | {check} | {step} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
