"""Joint versus sequential: where optimizing algebraic and parallel rewrites together beats doing them in turn.

    .venv/bin/python benchmarks/joint_vs_sequential.py [NAME:DEVICES[:KEY=VALUE,...] ...] [--json out.json]

Default cases: the built-in examples `experts` (16, 32, 64 devices),
`factorized` (8, 16) and `branches` (2, its tie), on h100x8. For each,
`parsat.optimize` (the facade: PROVED rules only) with the baselines, and:

* the joint plan's predicted step time, the `sequential` baseline's
  (algebraic rules saturated and extracted on one device first, then
  parallel rules only: `search.baselines.sequential`) and their ratio;
* the process's CPU seconds for the whole search (every mesh, every
  baseline), the e-graph size of the chosen mesh and the ILP status;
* the algebraic form of each plan (its PCG without parallel operators,
  `baselines.pcg_to_graph(drop_parallel=True)`) priced on ONE device with
  no rules: the sequential baseline takes the cheaper form on one device,
  so "joint form" >= "sequential form" there says the joint plan uses a
  rewrite one device would not (equal: a tie the joint search broke);
* the compute operators (operator and output shape) in one form and not
  the other, the algebraic rules the joint plan used, and the costliest
  collectives of each plan: what the rewrite opened.

Then the ablations (`--no-ablations` skips them): the same search with
one PROVED algebraic rule left out, which says which rewrite the joint plan
needs (its time rises without it) or which one put the sequential baseline
on the worse form (its time falls to the joint plan's without it).

Results are recorded in benchmarks/joint_results.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import Counter

import parsat
from parsat.api import proved_rules
from parsat.dsl.checker import is_parallel_rule
from parsat.dsl.library import load_library
from parsat.ir.models import build_example
from parsat.search.optimize import optimize as optimize_with
from parsat.search.baselines import pcg_to_graph

from models_bench import _case   # NAME:DEVICES[:KEY=VALUE,...], as models_bench.py reads its cases

DEFAULT = ("experts:16", "experts:32", "experts:64", "factorized:8", "factorized:16", "branches:2")
ABLATIONS = (("experts:32", "matmul_fuse_shared_input"), ("experts:32", "matmul_merge_contraction"),
             ("experts:32", "concat_of_relus"), ("factorized:8", "matmul_assoc_right"))
MACHINE = "h100x8"


def one_device_time(graph, library) -> float:
    """The graph exactly as written, on one device (no rule applied): seconds per step."""
    plan = optimize_with(graph, MACHINE, library, devices=1, baselines=False,
                         choose_rules=lambda _lib: ([], "none: the form as written"))
    return plan.totals.time_s


def compute_ops(graph) -> Counter:
    return Counter(f"{n.op}{list(graph.shape(n.name))}" for n in graph.nodes)


def costliest_collectives(pcg, costs, count: int = 3) -> list[str]:
    parallel = [n for n in pcg.nodes if n.kind == "parallel" and costs[n.id].comm_s > 0]
    parallel.sort(key=lambda n: -costs[n.id].comm_s)
    out = []
    for node in parallel[:count]:
        attrs = dict(node.attrs)
        dim = f" dim {attrs['dim']}" if "dim" in attrs else ""
        out.append(f"{node.op}{dim} over {attrs['axis']} ({attrs['degree']}) of {list(node.shape)}: "
                   f"{costs[node.id].comm_s * 1e6:.1f} us")
    return out


def measure(spec: str, library) -> dict:
    name, devices, sizes = _case(spec)
    graph = build_example(name, sizes, library)
    start = time.process_time()
    plan = parsat.optimize(graph, machine=MACHINE, rules=library, devices=devices)
    cpu = time.process_time() - start
    sequential = plan.baselines.get("sequential")
    row = {"case": spec, "example": name, "sizes": sizes, "devices": devices, "machine": MACHINE,
           "joint_s": plan.totals.time_s, "sequential_s": sequential.time_s if sequential else None,
           "chosen": plan.extraction.get("chosen"), "ilp": plan.extraction.get("ilp_status"),
           "mesh": plan.saturation.get("mesh"), "enodes": plan.saturation.get("enodes"),
           "stop": plan.saturation.get("stop"), "search_cpu_s": round(cpu, 2)}
    row["ratio"] = row["sequential_s"] / row["joint_s"] if sequential else None
    rules = {r.name: r for r in library.rules}
    row["joint_algebraic_rules"] = [r for r in plan.rules_used if r in rules and not is_parallel_rule(rules[r])]
    if sequential and "sequential" in plan.baseline_plans:
        seq_plan = plan.baseline_plans["sequential"]
        joint_form = pcg_to_graph(plan.pcg, graph, library, drop_parallel=True)
        seq_form = pcg_to_graph(seq_plan.pcg, graph, library, drop_parallel=True)
        row["one_device_joint_form_s"] = one_device_time(joint_form, library)
        row["one_device_sequential_form_s"] = one_device_time(seq_form, library)
        joint_ops, seq_ops = compute_ops(joint_form), compute_ops(seq_form)
        row["only_in_joint_form"] = sorted((joint_ops - seq_ops).elements())
        row["only_in_sequential_form"] = sorted((seq_ops - joint_ops).elements())
        row["joint_collectives"] = costliest_collectives(plan.pcg, plan.costs)
        row["sequential_collectives"] = costliest_collectives(seq_plan.pcg, seq_plan.costs)
    return row


def ablate(spec: str, rule: str, library) -> dict:
    """The search of `spec` with the PROVED rules less `rule`."""
    name, devices, sizes = _case(spec)
    graph = build_example(name, sizes, library)
    if rule not in {r.name for r in library.rules}:
        raise SystemExit(f"no rule named {rule}")

    def without(lib):
        kept, note = proved_rules(lib, None)
        return [r for r in kept if r.name != rule], f"{note}; {rule} left out"
    start = time.process_time()
    plan = optimize_with(graph, MACHINE, library, devices=devices, choose_rules=without)
    sequential = plan.baselines.get("sequential")
    return {"case": spec, "without": rule, "joint_s": plan.totals.time_s,
            "sequential_s": sequential.time_s if sequential else None, "search_cpu_s": round(time.process_time() - start, 2)}


def _us(seconds: float | None) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds is not None else "none"


def table(rows: list[dict]) -> str:
    lines = ["| example | devices | mesh | joint | sequential | seq / joint | 1 device: joint's form | "
             "1 device: sequential's form | search CPU s | e-nodes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
        lines.append(f"| `{r['case']}` | {r['devices']} | {r['mesh']} | {_us(r['joint_s'])} | {_us(r['sequential_s'])} "
                     f"| {ratio} | {_us(r.get('one_device_joint_form_s'))} | {_us(r.get('one_device_sequential_form_s'))} "
                     f"| {r['search_cpu_s']} | {r['enodes']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=list(DEFAULT))
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--no-ablations", action="store_true", help="skip the searches with one rule left out")
    args = parser.parse_args(argv)
    library = load_library()[0]
    rows = []
    for spec in args.cases:
        row = measure(spec, library)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(f"machine {MACHINE}; search on {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(table(rows))
    ablations = []
    if not args.no_ablations:
        for spec, rule in ABLATIONS:
            ablations.append(ablate(spec, rule, library))
            print(json.dumps(ablations[-1]), flush=True)
        print()
        print("| example | rule left out | joint | sequential | search CPU s |\n|---|---|---|---|---|")
        for a in ablations:
            print(f"| `{a['case']}` | `{a['without']}` | {_us(a['joint_s'])} | {_us(a['sequential_s'])} | "
                  f"{a['search_cpu_s']} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"rows": rows, "ablations": ablations}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
