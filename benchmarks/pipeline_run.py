"""Pipelined plans of a small gpt run through `parsat run --check --json`: measured vs predicted, per stage.

    .venv/bin/python benchmarks/pipeline_run.py [--steps 3]

Each plan is a stage plan from `optimize` (1 device, TP 2 or DP 2, 4
micro-batches) cut into 2 stages by `ir.pipeline.lay_out_stages` (until the
search of cut points lands, the cuts are given here: after block 0, or
4 chunks of one layer run for interleaved 1F1B) and written to a plan
file, which `parsat run` then trains on gloo ranks, as a user would. Prints
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
from dataclasses import replace
from pathlib import Path

from parsat.api import optimize
from parsat.ir.machine import Machine
from parsat.ir.pipeline import PipelinePlan, lay_out_stages

SIZES = {"blocks": 4, "batch": 8, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}
MICROBATCHES = 4
# Compute slow and links nearly free: at these tiny sizes a stage plan splits (on "cpu" nothing would).
MACHINE = Machine("two-nodes-of-two", 2, 2, peak_flops=1e8, memory_bandwidth=1e12, memory_capacity=2 ** 30,
                  intra_bandwidth=1e12, intra_latency=1e-9, inter_bandwidth=1e9, inter_latency=1e-6)
# label -> (stage devices, pinned degrees, schedule, chunk starts)
PLANS = {
    "PP 2, 1F1B": (1, None, "1f1b", [-1, 1]),
    "PP 2, GPipe": (1, None, "gpipe", [-1, 1]),
    "PP 2, interleaved v=2": (1, None, "interleaved", [-1, 1, 2, 3]),
    "PP 2 x DP 2, 1F1B": (2, {"dp": 2}, "1f1b", [-1, 1]),
    "PP 2 x TP 2, 1F1B": (2, {"tp": 2}, "1f1b", [-1, 1]),
    "PP 2 x TP 2, interleaved v=2": (2, {"tp": 2}, "interleaved", [-1, 1, 2, 3]),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    stage_plans: dict = {}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for index, (label, (devices, degrees, schedule, starts)) in enumerate(PLANS.items()):
            key = (devices, json.dumps(degrees))
            if key not in stage_plans:
                stage_plans[key] = optimize("gpt", MACHINE, devices=devices, sizes=SIZES, microbatches=MICROBATCHES,
                                            degrees=degrees)
            stage = stage_plans[key]
            layout = lay_out_stages(stage.pcg, starts, 2)
            plan = replace(stage, devices=2 * devices, pipeline=PipelinePlan(schedule, MICROBATCHES, devices, layout))
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
