"""The optimizer's own mesh plans run for real: `parsat run --check` on 2x2 meshes of CPU ranks.

    .venv/bin/python benchmarks/mesh_optimizer_run.py [--steps 2]

For small `mlp`, `transformer` and `gpt`, `parsat.optimize` on 4 devices
of a machine of two nodes of two devices (compute slow, links inside a
node nearly free, between nodes slower: the sizes are tiny, and on an
H100 preset nothing would be worth splitting), once free and once pinned
to `--degrees dp=2,tp=2`. Each plan is saved and run through the CLI as a
user runs it (gloo, 4 ranks, `--check` against one process); the table
gives the kinds of parallelism the plan uses (`ir.parallelism.describe`),
the check, and communication measured vs predicted by the cost model,
per step, in elements summed over ranks. Results: benchmarks/mesh_results.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import resource
import sys
import tempfile
from pathlib import Path

from parsat.api import optimize
from parsat.cli import main as parsat
from parsat.ir.machine import Machine
from parsat.ir.parallelism import describe

TWO_BY_TWO = Machine("two-nodes-of-two", 2, 2, peak_flops=1e8, memory_bandwidth=1e12, memory_capacity=2 ** 30,
                     intra_bandwidth=1e12, intra_latency=1e-9, inter_bandwidth=1e9, inter_latency=1e-6)
CASES = {
    "mlp": {"batch": 8},
    "transformer": {"batch": 4, "seq": 8, "hidden": 16, "heads": 2, "ffn": 32},
    "gpt": {"blocks": 2, "hidden": 64, "heads": 4, "seq": 16, "vocab": 128, "batch": 8},
}


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_case(name: str, sizes: dict, degrees: dict | None, folder: Path, steps: int) -> dict:
    start = cpu_seconds()
    plan = optimize(name, machine=TWO_BY_TWO, devices=4, sizes=sizes, degrees=degrees, baselines=False)
    path = folder / f"{name}-{'pinned' if degrees else 'free'}.json"
    plan.save(path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = parsat(["run", str(path), "--nproc", "4", "--backend", "gloo", "--steps", str(steps), "--check",
                       "--json"])
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    return {"model": name, "degrees": degrees or "searched", "mesh": str(plan.pcg.mesh), "kinds": describe(plan.pcg),
            "exit": code, "check": result["check"], "max_rel_diff": result.get("max_rel_diff"),
            "comm_measured": result["comm_elements_measured"], "comm_predicted": result["comm_elements_predicted"],
            "by_axis": result.get("comm_elements_by_axis"),
            "grad_sync_measured": result["grad_sync_elements_measured"],
            "grad_sync_predicted": result["grad_sync_elements_predicted"],
            "cpu_s": round(cpu_seconds() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, sizes in CASES.items():
            for degrees in (None, {"dp": 2, "tp": 2}):
                row = run_case(name, sizes, degrees, Path(folder), args.steps)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("| model | degrees | mesh | plan | --check | comm measured / predicted | grad sync measured / predicted |"
          " CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        degrees = r["degrees"] if isinstance(r["degrees"], str) else ",".join(f"{k}={v}" for k, v in r["degrees"].items())
        print(f"| {r['model']} | {degrees} | {r['mesh']} | {r['kinds']} | {r['check']} | "
              f"{r['comm_measured']:,.0f} / {r['comm_predicted']:,.0f} | "
              f"{r['grad_sync_measured']:,.0f} / {r['grad_sync_predicted']:,.0f} | {r['cpu_s']} |")


if __name__ == "__main__":
    sys.exit(main())
