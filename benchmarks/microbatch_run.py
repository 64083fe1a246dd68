"""Plans of m micro-batches run for real: `parsat run --check` at m = 1, 2, 4 of one global batch.

    .venv/bin/python benchmarks/microbatch_run.py [--steps 3] [--no-mesh]

For small `mlp` and `gpt`, `parsat.optimize(..., microbatches=m)` writes a
plan file per m (the example built at batch / m, `graph.microbatches` m);
each PCG named below is run through the CLI as a user runs it (gloo,
`--check --json`): on 2 ranks, and with the mesh rows on 4 ranks as a 2x2
mesh pinned to `dp=2,tp=2`. The table gives the check (against the whole
batch's graph in one process), communication measured vs predicted per
step (elements, summed over ranks), the gradient-synchronisation part, the
first step's loss (the same global batch whatever m), the tensor peak per
rank and the CPU seconds of the run command (every rank, start-up and the
reference included). Results: benchmarks/backend_results.md.
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
from mesh_optimizer_run import TWO_BY_TWO  # noqa: E402

from parsat.api import optimize  # noqa: E402
from parsat.backend.cli import load_plan  # noqa: E402
from parsat.cli import main as parsat  # noqa: E402
from parsat.ir.parallelism import describe  # noqa: E402

MLP = {"batch": 16, "d_in": 32, "d_hidden": 16, "d_out": 8}
GPT = {"blocks": 1, "hidden": 32, "heads": 2, "seq": 8, "vocab": 64, "batch": 8}
GPT_MESH = {"blocks": 2, "hidden": 64, "heads": 4, "seq": 16, "vocab": 128, "batch": 8}
# (label, example, sizes, machine, devices, degrees, PCGs to run, micro-batch counts)
CASES = [
    ("mlp", "mlp", MLP, "cpu", 2, None, ("data_parallel", "megatron"), (1, 2, 4)),
    ("gpt", "gpt", GPT, TWO_BY_TWO, 2, None, ("parsat", "data_parallel", "sequential"), (1, 2, 4)),
]
MESH_CASES = [
    ("mlp 2x2", "mlp", {"batch": 8}, TWO_BY_TWO, 4, {"dp": 2, "tp": 2}, ("parsat",), (1, 2, 4)),
    ("gpt 2x2", "gpt", GPT_MESH, TWO_BY_TWO, 4, {"dp": 2, "tp": 2}, ("parsat",), (1, 4)),
]


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run(path: Path, devices: int, plan_of: str, steps: int) -> dict:
    out = io.StringIO()
    start = cpu_seconds()
    with contextlib.redirect_stdout(out):
        code = parsat(["run", str(path), "--nproc", str(devices), "--backend", "gloo", "--steps", str(steps),
                       "--check", "--json", "--plan-of", plan_of])
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    return {**result, "exit": code, "cpu_s": round(cpu_seconds() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-mesh", action="store_true", help="skip the 4-rank 2x2 rows")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for label, name, sizes, machine, devices, degrees, plans, counts in \
                CASES + ([] if args.no_mesh else MESH_CASES):
            for m in counts:
                plan = optimize(name, machine=machine, devices=devices, sizes=sizes, degrees=degrees,
                                microbatches=m)
                path = Path(folder) / f"{name}-{devices}-{m}.json"
                plan.save(path)
                for plan_of in plans:
                    result = run(path, devices, plan_of, args.steps)
                    pcg = load_plan(str(path), devices, plan_of)[0]
                    row = {"case": label, "m": m, "plan": plan_of, "kinds": describe(pcg), **{k: result[k] for k in (
                        "exit", "check", "max_rel_diff", "comm_elements_measured", "comm_elements_predicted",
                        "grad_sync_elements_measured", "grad_sync_elements_predicted", "peak_memory_bytes",
                        "step_time_s", "losses", "microbatches", "cpu_s")}}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    print()
    print("| case | plan | m | --check (max rel diff) | comm measured / predicted | grad sync measured / predicted "
          "| loss, step 1 | tensor peak/rank | step (ms, wall) | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['plan']}: {r['kinds']} | {r['m']} | {r['check']} ({r['max_rel_diff']:.1e}) "
              f"| {r['comm_elements_measured']:,.0f} / {r['comm_elements_predicted']:,.0f} "
              f"| {r['grad_sync_elements_measured']:,.0f} / {r['grad_sync_elements_predicted']:,.0f} "
              f"| {r['losses'][0]:.6f} | {r['peak_memory_bytes'] / 2**20:.2f} MiB | {r['step_time_s'] * 1e3:.1f} "
              f"| {r['cpu_s']} |")


if __name__ == "__main__":
    main()
