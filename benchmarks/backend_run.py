"""Run parsat's plans and the baselines' plans on N local CPU ranks, checked; measured vs predicted.

    .venv/bin/python benchmarks/backend_run.py [--nproc 2 4] [--steps 3] [--machine cpu]

For each graph, `optimize` writes a plan file (as `parsat optimize -o` does);
each PCG in it (parsat's, data_parallel, sequential, megatron) is read back
the way `parsat run --plan-of` reads it and trained with --check; all plans
of one rank count run in one process group. Prints one JSON line per plan
and a markdown table (what `benchmarks/backend_results.md` records).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from parsat.api import optimize
from parsat.backend.cli import PLAN_OF, load_plan
from parsat.backend.executor import ExecutionError, TrainConfig, check_verdict, run_many
from parsat.backend.launch import LaunchConfig, launch

GRAPHS = {
    "mlp": {},
    "branches": {},
    "transformer": dict(batch=4, seq=32, hidden=64, heads=4, ffn=256),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--machine", default="cpu")
    parser.add_argument("--graphs", nargs="+", default=list(GRAPHS))
    args = parser.parse_args()
    config = TrainConfig(steps=args.steps, check=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for n in args.nproc:
            jobs, predicted = [], {}
            for name in args.graphs:
                path = Path(folder) / f"{name}{n}.json"
                optimize(name, machine=args.machine, devices=n, sizes=GRAPHS[name] or None).save(path)
                for plan_of in PLAN_OF:
                    try:
                        pcg, graph, prediction = load_plan(str(path), n, plan_of)
                    except ExecutionError as err:
                        rows.append({"graph": name, "nproc": n, "plan": plan_of, "note": str(err)})
                        continue
                    jobs.append((f"{name}/{plan_of}", pcg, graph))
                    predicted[f"{name}/{plan_of}"] = prediction
            results = launch(run_many, (jobs, config), LaunchConfig(nproc=n, backend="gloo", timeout_s=1200))[0]
            for label, job in results.items():
                name, plan_of = label.split("/")
                want = predicted[label]
                times = job["step_times"][1:] or job["step_times"]
                rows.append({"graph": name, "nproc": n, "plan": plan_of,
                             "check": check_verdict(job, config),
                             "max_abs_diff": job["max_abs_diff"], "measured": job["sent"],
                             "predicted": want.comm_elements, "grad_sync_measured": job["grad_sync"],
                             "grad_sync_predicted": want.grad_sync_elements,
                             "step_time_s": statistics.median(times), "peak_memory_bytes": job["peak_memory_bytes"]})
                print(json.dumps(rows[-1]), flush=True)
    print("\n| graph | ranks | plan | check | max abs diff | measured | predicted | grad sync meas./pred. | "
          "tensor peak/rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "note" in r:
            print(f"| {r['graph']} | {r['nproc']} | {r['plan']} | n/a | | | | | |")
            continue
        print(f"| {r['graph']} | {r['nproc']} | {r['plan']} | {r['check']} | {r['max_abs_diff']:.1e} | "
              f"{r['measured']:,.0f} | {r['predicted']:,.0f} | {r['grad_sync_measured']:,.0f} / "
              f"{r['grad_sync_predicted']:,.0f} | {r['peak_memory_bytes'] / 2**20:.2f} MiB |")


if __name__ == "__main__":
    main()
