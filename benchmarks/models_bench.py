"""The language models among the built-in examples: their sizes, and what the optimizer does with them.

    .venv/bin/python benchmarks/models_bench.py sizes
    .venv/bin/python benchmarks/models_bench.py table rows.json ...
    .venv/bin/python benchmarks/models_bench.py optimize gpt-6.7b:8 gpt-6.7b:64 gpt-6.7b:8:batch=8 \
        [--limit seconds=300 --limit enodes=1000000] [--machine a100x8] [--json out.json]
    .venv/bin/python benchmarks/models_bench.py optimize gpt-175b:1024:pp=16,tp=8,dp=8,schedule=interleaved,m=64

`sizes`: for every named configuration, the CPU seconds to build its graph
(library loaded once beforehand), its nodes and weights, and its parameter
count against the published one. `optimize`: `parsat.optimize` (the facade:
PROVED rules only) on h100x8 for each NAME:DEVICES[:KEY=VALUE,...], with
the process's CPU seconds, the peak resident memory growth, each mesh's
saturation (stop reason, iterations, e-nodes, seconds) and the plan's
predicted step time and memory per device, or the error it ends with.
Results are recorded in benchmarks/models_results.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from parsat.dsl.library import load_library
from parsat.ir.models import EXAMPLES, build_example, parameter_count
from parsat.report.explain import explain_plan

NAMED = ("gpt", "gpt-1.3b", "gpt-6.7b", "gpt-13b", "gpt-175b", "llama-7b", "llama-70b", "bert", "bert-large")


def sizes() -> list[dict]:
    library = load_library()[0]
    rows = []
    for name in NAMED:
        example = EXAMPLES[name]
        start = time.process_time()
        graph = build_example(name, None, library)
        seconds = time.process_time() - start
        count = parameter_count(graph)
        rows.append({"name": name, "build_cpu_s": round(seconds, 3), "nodes": len(graph.nodes),
                     "weights": len(graph.weights), "parameters": count, "published": example.parameters,
                     "ratio": round(count / example.parameters, 4), "sizes": example.describe_sizes(),
                     "source": example.source})
    return rows


SEARCH_KEYS = ("pp", "tp", "dp", "schedule", "m")   # in a case: pinned degrees, schedule, micro-batches


def _case(spec: str) -> tuple[str, int, dict[str, int], dict]:
    """NAME:DEVICES[:KEY=VALUE,...]: sizes, and the search pins of SEARCH_KEYS (pp=16,tp=8,schedule=interleaved)."""
    name, devices, *rest = spec.split(":")
    overrides, search = {}, {}
    for item in ",".join(rest).split(","):
        if item:
            key, _, value = item.partition("=")
            if key in SEARCH_KEYS:
                search[key] = value if key == "schedule" else int(value)
            else:
                overrides[key] = int(value)
    return name, int(devices), overrides, search


def model_flops(graph) -> float:
    """Model FLOPs of a training step: 3 x the forward pass's (forward, and backward at twice it), every
    micro-batch, from the operators' own work counts (`dsl.work`), as MFU counts them (no recomputation)."""
    from parsat.dsl.library import load_library
    from parsat.dsl.work import work
    from parsat.ir.graph import instance_for

    ops = load_library()[0].ops
    shapes = graph.shapes()
    forward = sum(work(instance_for(ops[n.op], [shapes[i] for i in n.inputs], dict(n.attrs)))[0]
                  for n in graph.nodes)
    return 3.0 * forward * graph.microbatches


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def optimize_cases(specs: list[str], limits: dict, machine: str = "h100x8") -> list[dict]:
    import parsat

    rows = []
    for spec in specs:
        name, devices, overrides, search = _case(spec)
        start, rss = time.process_time(), _max_rss_mib()
        row = {"case": spec, "name": name, "devices": devices, "sizes": overrides, "limits": limits,
               "machine": machine, "pins": search}
        degrees = {k: v for k, v in search.items() if k in ("pp", "tp", "dp")}
        try:
            plan = parsat.optimize(name, machine=machine, devices=devices, sizes=overrides or None,
                                   limits=limits or None, degrees=degrees or None, schedule=search.get("schedule"),
                                   microbatches=search.get("m"),
                                   progress=lambda message: print(f"  [{spec}] {message}", file=sys.stderr,
                                                                  flush=True))
        except Exception as err:  # noqa: BLE001 - the error is the result
            row["error"] = f"{type(err).__name__}: {err}"
        else:
            row["step_time_ms"] = plan.totals.time_s * 1e3
            row["memory_gib"] = plan.totals.memory_bytes / 2 ** 30   # the figure that decides fit
            row["bound_gib"] = plan.totals.peak_memory_bytes / 2 ** 30
            row["fits"] = plan.totals.fits(plan.machine)
            row["microbatches"] = plan.graph.microbatches
            flops = model_flops(plan.graph)
            peak = devices * plan.machine.peak_flops
            row["mfu"] = flops / (plan.totals.time_s * peak)
            row["baselines_mfu"] = {k: (flops / (v.time_s * peak) if v is not None else None)
                                    for k, v in plan.baselines.items()}
            row["explain"] = explain_plan(plan).splitlines()[:9]
            row["mesh"] = plan.saturation.get("mesh")
            row["meshes"] = plan.saturation.get("meshes")
            row["chosen"] = plan.extraction.get("chosen")
            row["repeated_blocks"] = plan.saturation.get("repeated_blocks")
            row["baselines_skipped"] = plan.extraction.get("baselines_skipped", "")
            grid = plan.baseline_plans.get("best_grid")
            row["best_grid_config"] = grid.config if grid is not None else None
            row["baselines_ms"] = {k: (v.time_s * 1e3 if v is not None else None) for k, v in plan.baselines.items()}
            row["baselines_gib"] = {k: (v.memory_bytes / 2 ** 30 if v is not None else None)
                                    for k, v in plan.baselines.items()}
            row["baselines_fit"] = {k: (v.fits(plan.machine) if v is not None
                                        else None) for k, v in plan.baselines.items()}
            if plan.pipeline is not None:
                pipe = plan.pipeline
                row["pipeline"] = {"pp": pipe.degree, "stage_devices": pipe.stage_devices,
                                   "schedule": pipe.schedule, "chunks_per_stage": pipe.layout.chunks_per_stage,
                                   "microbatches": pipe.microbatches, "bubble": pipe.bubble_fraction,
                                   "stage_memory_gib": [s.memory_bytes / 2 ** 30 for s in pipe.stages],
                                   "stage_layers": [[c.layers[0], c.layers[-1]] for c in pipe.layout.chunks]}
            row["pipeline_search"] = plan.saturation.get("pipeline_search")
            row["enodes"] = plan.saturation.get("enodes")
            row["stop"] = plan.saturation.get("stop")
        row["cpu_s"] = round(time.process_time() - start, 2)
        row["max_rss_mib_after"] = round(_max_rss_mib(), 1)
        row["max_rss_mib_before"] = round(rss, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _mfu_cell(row: dict, name: str) -> str:
    mfu, fits = row.get("baselines_mfu", {}).get(name), row.get("baselines_fit", {}).get(name)
    if mfu is None:
        return "-"
    return f"{100 * mfu:.1f}%" + ("" if fits else f" (needs {row['baselines_gib'][name]:.0f} GiB)")


def table(paths: list[str]) -> str:
    """The rows of `optimize --json` files as the markdown table of benchmarks/models_results.md."""
    lines = ["| case | plan | m | step | memory | MFU | best_grid | best_grid MFU | Megatron MFU | DP MFU | "
             "sequential MFU | e-nodes | stop | CPU s |", "|" + "---|" * 14]
    for path in paths:
        with open(path, encoding="utf-8") as src:
            rows = json.load(src)
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['case']} | {r['error'][:120]} |" + " |" * 11 + f" {r['cpu_s']} |")
                continue
            plan = next((line.split(":", 1)[1].strip() for line in r["explain"]
                         if line.startswith("  mesh ") or line.startswith("  each stage: mesh ")), "")
            if r.get("pipeline"):
                pipe = r["pipeline"]
                plan = (f"PP {pipe['pp']} {pipe['schedule']}" + (f" v={pipe['chunks_per_stage']}"
                        if pipe['chunks_per_stage'] > 1 else "") + f", bubble {100 * pipe['bubble']:.0f}%; "
                        f"stage: {plan}")
            grid = r.get("best_grid_config") or {}
            spelled = ", ".join(f"{k}={v}" for k, v in grid.items()) if grid else "-"
            lines.append(f"| {r['case']} | {plan} | {r['microbatches']} | {r['step_time_ms'] / 1e3:.3f} s | "
                         f"{r['memory_gib']:.1f} GiB | {100 * r['mfu']:.1f}% | {spelled} | "
                         f"{_mfu_cell(r, 'best_grid')} | {_mfu_cell(r, 'megatron')} | "
                         f"{_mfu_cell(r, 'data_parallel')} | {_mfu_cell(r, 'sequential')} | "
                         f"{r.get('enodes', '-'):,} | {r.get('stop', '-')} | {r['cpu_s']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("sizes")
    opt = sub.add_parser("optimize")
    opt.add_argument("cases", nargs="+", metavar="NAME:DEVICES[:KEY=VALUE,...]")
    opt.add_argument("--limit", action="append", default=[], metavar="KEY=VALUE")
    opt.add_argument("--machine", default="h100x8")
    tab = sub.add_parser("table", help="the markdown table of --json files")
    tab.add_argument("files", nargs="+")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.what == "table":
        print(table(args.files))
        return 0
    if args.what == "sizes":
        rows = sizes()
        for r in rows:
            print(f"{r['name']:<11} {r['build_cpu_s']:6.3f} s  {r['nodes']:5} nodes  {r['weights']:4} weights  "
                  f"{r['parameters']:>16,}  published {r['published']:.4g}  ratio {r['ratio']:.4f}")
    else:
        limits = {}
        for item in args.limit:
            key, _, value = item.partition("=")
            limits[key] = int(value) if key in ("iterations", "enodes") else float(value)
        rows = optimize_cases(args.cases, limits, args.machine)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
