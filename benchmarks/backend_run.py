"""Run baseline and optimized plans on N local CPU ranks, checked; print measured vs predicted communication.

    .venv/bin/python benchmarks/backend_run.py [--nproc 2 4] [--steps 3]

Records what `benchmarks/backend_results.md` reports. Plans: data parallelism
(saturate.api.data_parallel_pcg) and the optimizer's plan (saturate.api.optimize)
for the MLP (Unity's sizes), the branching MLP and a small transformer block.
"""

from __future__ import annotations

import argparse
import json

from parsat.backend.executor import TrainConfig, operator_library, run_plan
from parsat.saturate import models
from parsat.saturate.api import data_parallel_pcg, optimize, price_pcg
from parsat.saturate.cost import totals
from parsat.saturate.machine import Machine

GRAPHS = {
    "mlp": lambda lib: models.mlp(library=lib),
    "branches": lambda lib: models.branches(batch=64, d_in=256, d_hidden=128, d_out=16, library=lib),
    "transformer": lambda lib: models.transformer(batch=4, seq=16, hidden=32, heads=4, ffn=64, library=lib),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--graphs", nargs="+", default=list(GRAPHS))
    parser.add_argument("--optimized", action="store_true", help="also run the optimizer's plan")
    args = parser.parse_args()
    lib = operator_library()
    rows = []
    for name in args.graphs:
        graph = GRAPHS[name](lib)
        for n in args.nproc:
            machine = Machine.preset("h100x8").with_devices(n)
            plans = {"data_parallel": data_parallel_pcg(graph, lib, n)}
            if args.optimized:
                plans["parsat"] = optimize(graph, devices=n, allow_unverified=True, baselines=False).pcg
            for label, pcg in plans.items():
                if pcg is None:
                    rows.append({"graph": name, "nproc": n, "plan": label, "note": "not applicable"})
                    continue
                costs = price_pcg(pcg, lib, machine)
                predicted = totals(costs, machine).comm_elements if costs else None
                result = run_plan(pcg, n, TrainConfig(steps=args.steps, check=True), graph=graph,
                                  predicted_comm=predicted, backend="gloo")
                rows.append({"graph": name, "nproc": n, "plan": label, **result.to_dict()})
                print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
