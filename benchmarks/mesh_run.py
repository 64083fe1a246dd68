"""`parsat run --check` of the hand-built mesh plans (benchmarks/mesh_plans.py): measured vs predicted communication.

    .venv/bin/python benchmarks/mesh_run.py [--eight] [--steps 3]

Each plan is written as a plan file (its totals: the ring formulas' count)
and run through the CLI exactly as a user runs it, on 4 gloo ranks (2x2
meshes), and with --eight also the 2x2x2 plan on 8 ranks. Prints one JSON
line per plan and a markdown table (what benchmarks/mesh_results.md
records). CPU seconds are those of the whole command (every rank, start-up
and the single-process reference of --check included).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mesh_plans  # noqa: E402

from parsat.backend.executor import operator_library  # noqa: E402
from parsat.cli import main as parsat  # noqa: E402


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run(plan: mesh_plans.MeshPlan, folder: Path, steps: int) -> dict:
    path = folder / f"{plan.name}.json"
    mesh_plans.save_plan(plan, path)
    out = io.StringIO()
    start = cpu_seconds()
    with contextlib.redirect_stdout(out):
        code = parsat(["run", str(path), "--nproc", str(plan.world), "--backend", "gloo", "--steps", str(steps),
                       "--check", "--json", "--optimizer", "adam"])
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    return {"plan": plan.name, "mesh": str(plan.pcg.mesh), "exit": code, "cpu_s": round(cpu_seconds() - start, 1),
            **{k: result[k] for k in ("check", "max_rel_diff", "comm_elements_measured", "comm_elements_predicted",
                                      "comm_elements_by_axis", "grad_sync_elements_measured",
                                      "grad_sync_elements_predicted", "step_time_s")},
            "predicted_by_axis": plan.sent_by_axis()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--eight", action="store_true", help="also the 2x2x2 plan on 8 ranks")
    args = parser.parse_args()
    library = operator_library()
    makers = dict(mesh_plans.PLANS_2X2, **(mesh_plans.PLANS_2X2X2 if args.eight else {}))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for make in makers.values():
            row = run(make(library), Path(folder), args.steps)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print()
    print("| plan | mesh | --check | max rel diff | comm measured (per axis) | predicted (per axis) | grad sync "
          "measured / predicted | step (ms, wall) | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        axes = ", ".join(f"{k} {v:,.0f}" for k, v in r["comm_elements_by_axis"].items())
        want = ", ".join(f"{k} {v:,}" for k, v in r["predicted_by_axis"].items())
        print(f"| {r['plan']} | {r['mesh']} | {r['check']} | {r['max_rel_diff']:.1e} | "
              f"{r['comm_elements_measured']:,.0f} ({axes}) | {r['comm_elements_predicted']:,} ({want}) | "
              f"{r['grad_sync_elements_measured']:,.0f} / {r['grad_sync_elements_predicted']:,} | "
              f"{r['step_time_s'] * 1e3:.1f} | {r['cpu_s']} |")


if __name__ == "__main__":
    main()
