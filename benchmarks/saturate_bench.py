"""Benchmark parsat optimize on the built-in examples: plan cost vs baselines, communication, times, e-graph size.

    .venv/bin/python benchmarks/saturate_bench.py [--devices 2 8 16 64] [--examples mlp branches transformer stack]
        [--machine h100x8] [--rules PATH ...] [--out benchmarks/saturate_results.md]

Writes a markdown table (and a JSON file next to it) with, per example and
device count: parsat's predicted step time and communication, each
baseline's step time, saturation and extraction time, e-graph size, and
what stopped saturation. Shipped rules by default, `--allow-unverified`
semantics (the verifier's verdicts are not needed to time the search).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from parsat.api import optimize
from parsat.dsl.library import load_library
from parsat.ir.errors import OptimizeError


def fmt_ms(seconds):
    return "n/a" if seconds is None else f"{seconds * 1e3:.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 8, 16, 64])
    parser.add_argument("--examples", nargs="+", default=["mlp", "branches", "transformer", "stack"])
    parser.add_argument("--machine", default="h100x8")
    parser.add_argument("--rules", nargs="+", default=None)
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--out", default="benchmarks/saturate_results.md")
    args = parser.parse_args(argv)
    library = load_library(args.rules)[0]
    rows = []
    load_before = os.getloadavg()
    for name in args.examples:
        for devices in args.devices:
            start, cpu = time.perf_counter(), time.process_time()
            try:
                plan = optimize(name, machine=args.machine, devices=devices, rules=library, allow_unverified=True,
                                baselines=not args.no_baselines)
            except OptimizeError as err:
                rows.append({"example": name, "devices": devices, "error": str(err)})
                print(name, devices, "error:", err, file=sys.stderr)
                continue
            total, cpu = time.perf_counter() - start, time.process_time() - cpu
            data = plan.to_dict()
            base = data["baselines"]
            row = {
                "example": name, "devices": devices, "time_s": data["totals"]["time_s"],
                "comm_elements": data["totals"]["comm_elements"],
                "grad_sync_elements": data["totals"]["grad_sync_elements"],
                "baselines": {k: (v["time_s"] if v else None) for k, v in base.items()},
                "baseline_comm": {k: (v["comm_elements"] if v else None) for k, v in base.items()},
                "saturation_s": data["saturation"]["seconds"], "compile_s": data["saturation"]["compile_seconds"],
                "extraction_s": data["extraction"]["seconds"], "enodes": data["saturation"]["enodes"],
                "eclasses": data["saturation"]["eclasses"], "stop": data["saturation"]["stop"],
                "method": data["extraction"]["method"], "chosen": data["extraction"].get("chosen", "joint"),
                "total_s": total, "cpu_s": cpu,
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        f"# parsat optimize benchmark ({args.machine})", "",
        "Command: `" + " ".join(["python", "benchmarks/saturate_bench.py"] + (argv if argv is not None else sys.argv[1:]))
        + "`", "",
        f"Machine running the search: {platform.machine()}, Python {platform.python_version()}. "
        "Times in ms are predicted per-iteration training times (cost model); "
        "search times are wall-clock seconds (compile = rules to egglog, sat = saturation, ext = extraction "
        "incl. ILP; total = wall-clock of the whole `optimize` call, baselines included; cpu = its CPU time: "
        "the machine is shared, so wall-clock depends on the load). "
        f"Load average (1, 5, 15 min) before the run: {', '.join(f'{x:.2f}' for x in load_before)}; "
        f"after: {', '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores. "
        "`plan` says where parsat's plan came from: `joint` = extracted from the joint e-graph (by `method`), "
        "else the name of a baseline that was strictly cheaper.", "",
        "| example | devices | parsat ms | data-parallel ms | sequential ms | megatron ms | parsat comm el | DP comm el "
        "| e-nodes | stop | compile s | sat s | ext s | total s | cpu s | method | plan |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['example']} | {r['devices']} | error: {r['error']} |||||||||||||||")
            continue
        b = r["baselines"]
        lines.append(
            f"| {r['example']} | {r['devices']} | {fmt_ms(r['time_s'])} | {fmt_ms(b['data_parallel'])} | "
            f"{fmt_ms(b['sequential'])} | {fmt_ms(b['megatron'])} | {r['comm_elements']:,} | "
            f"{'n/a' if r['baseline_comm']['data_parallel'] is None else format(r['baseline_comm']['data_parallel'], ',')} | "
            f"{r['enodes']} | {r['stop']} | {r['compile_s']:.2f} | {r['saturation_s']:.2f} | {r['extraction_s']:.2f} | "
            f"{r['total_s']:.1f} | {r['cpu_s']:.1f} | {r['method']} | {r['chosen']} |")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
