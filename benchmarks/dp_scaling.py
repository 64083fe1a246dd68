"""Does data parallelism scale under the cost model? BERT-Large, batch 256, on 8 and on 64 h100x8 devices.

    .venv/bin/python benchmarks/dp_scaling.py [--devices 8 64] [--seconds 300] [--keep DIR]

Runs `parsat.optimize("bert-large", machine="h100x8", devices=N)` (the
facade, as `parsat optimize bert-large --devices N --machine h100x8` does)
and prints, for each N, the data_parallel baseline's simulated step time
(`totals.time_s`: DDP buckets overlapping backward, the hierarchical
all-reduce across nodes), its per-node sum (`node_sum_s`, no overlap), the
per-stream figures, the plan's own time, and the CPU seconds the search
took; then the ratio of 64 to 8 devices (issue 17: at most 1/2).
`--seconds` is the search's limit: the default 30 s leaves no time for the
baselines on a 2-core box. Results: benchmarks/dp_scaling.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from parsat.api import optimize


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--keep", default=None, metavar="DIR", help="write each plan file here")
    args = parser.parse_args()
    dp_times = {}
    for n in args.devices:
        cpu, wall = time.process_time(), time.perf_counter()
        plan = optimize("bert-large", machine="h100x8", devices=n, limits={"seconds": args.seconds})
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        data = plan.to_dict()
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            plan.save(Path(args.keep) / f"bert-large-{n}.json")
        dp = data["baselines"]["data_parallel"]
        if dp is None:
            print(f"{n} devices: no data_parallel baseline ({data['extraction'].get('baselines_skipped', '')})")
            continue
        dp_times[n] = dp["time_s"]
        print(json.dumps({"devices": n, "dp_time_s": dp["time_s"], "dp_node_sum_s": dp["node_sum_s"],
                          "dp_compute_busy_s": dp["compute_busy_s"], "dp_comm_busy_s": dp["comm_busy_s"],
                          "dp_exposed_comm_s": dp["exposed_comm_s"], "dp_overlap_s": dp["overlap_s"],
                          "plan_time_s": data["totals"]["time_s"], "cpu_s": round(cpu, 1), "wall_s": round(wall, 1)}))
    if 8 in dp_times and 64 in dp_times:
        print(f"data parallelism, 64 / 8 devices: {dp_times[64] / dp_times[8]:.3f} (issue 17: at most 0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
