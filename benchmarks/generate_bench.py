"""Issue 7 "must show": do generated rules alone derive the shipped rules, and plan as well?

    .venv/bin/python benchmarks/generate_bench.py --generated benchmarks/generate_rules.rule \
        [--also benchmarks/generate_rules_transformer.rule] \
        [--ops matmul,add,relu,concat,split,partition,combine,replicate,reduce] [--devices 2 4] \
        [--out benchmarks/generate_tables.md]

1. Derivation: for every shipped rule that uses only `--ops`, at every
   rank-2 instance, its left side is instantiated at concrete sizes
   (degrees 2), saturated with the `--generated` rules only (saturate's
   egglog compilation, 4 devices), and the rule counts as derived when its
   right side lands in the left side's e-class.
2. Planning: `optimize` on each example with generated rules only (the
   `--generated` files and the `--also` files, rules generated over other
   operators, e.g. the transformer block's) and with the shipped library,
   same machine and device count; the plans' predicted step times are
   compared.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from parsat.api import optimize
from parsat.dsl.checker import load_checked
from parsat.generate.generate import derive_library, rules_over
from parsat.ir.errors import OptimizeError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--generated", nargs="+", default=["benchmarks/generate_rules.rule"],
                        help="generated .rule files over --ops; together they are the generated set")
    parser.add_argument("--also", nargs="*", default=[],
                        help="more generated .rule files (other operators), added for the plans only")
    parser.add_argument("--ops", default="matmul,add,relu,concat,split,partition,combine,replicate,reduce")
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--examples", nargs="+", default=["mlp", "transformer"])
    parser.add_argument("--machine", default="h100x8")
    parser.add_argument("--out", default="benchmarks/generate_tables.md")
    parser.add_argument("--no-derive", dest="derive", action="store_false", help="plans only")
    args = parser.parse_args(argv)
    shipped = load_checked(None)
    generated = load_checked(args.generated)
    gen_rules = list(generated.rules)
    planning = load_checked(args.generated + args.also) if args.also else generated   # e.g. names used twice
    target = rules_over(shipped, args.ops.split(","))
    start = time.perf_counter()
    results = derive_library(generated, shipped, args.ops.split(","),
                             progress=lambda m: print(m, file=sys.stderr, flush=True)) if args.derive else []
    derive_s = time.perf_counter() - start
    considered = [r for r in results if r.instances]
    derived = [r for r in considered if r.ok]
    plans = []
    for name in args.examples:
        for devices in args.devices:
            row = {"example": name, "devices": devices}
            for label, rules in (("generated", planning), ("shipped", shipped)):
                t = time.perf_counter()
                try:
                    plan = optimize(name, devices=devices, machine=args.machine, rules=rules,
                                    allow_unverified=True, baselines=False,
                                    limits={"seconds": 60.0, "iterations": 20})
                    row[label] = plan.to_dict()["totals"]["time_s"]
                except OptimizeError as err:
                    row[label] = None
                    row[label + "_error"] = str(err)
                row[label + "_s"] = round(time.perf_counter() - t, 2)
            plans.append(row)
            print(row, file=sys.stderr, flush=True)
    data = {"generated_files": args.generated, "also_files": args.also, "planning_rules": len(planning.rules),
            "machine": args.machine, "generated_rules": len(gen_rules), "ops": args.ops,
            "target_rules": len(target), "rank2_rules": len(considered), "derived": len(derived),
            "derive_seconds": round(derive_s, 1),
            "per_rule": [r.__dict__ for r in results], "plans": plans}
    Path(args.out).with_suffix(".json").write_text(json.dumps(data, indent=1))
    lines = ["# parsat generate: derivation of the shipped rules and plans with generated rules only", "",
             f"Generated set: {', '.join(f'`{g}`' for g in args.generated)} ({len(gen_rules)} rules). "
             f"Operators of the derivation: {args.ops}.", "",
             f"Shipped rules over these operators: {len(target)}; with a rank-2 instance: {len(considered)}; "
             f"derived at every rank-2 instance by the generated rules alone: **{len(derived)} / {len(considered)} "
             f"({100.0 * len(derived) / max(1, len(considered)):.1f}%)**, {derive_s:.1f} s.", "",
             "| rule | instances | derived |", "|---|---|---|"]
    lines += [f"| {r.rule} | {r.instances} | {r.derived}{' (' + r.note + ')' if r.note else ''} |" for r in results]
    also = f" and {', '.join(f'`{a}`' for a in args.also)}" if args.also else ""
    lines += ["", f"## Plans (predicted step time on {args.machine}, s; joint search, no baselines)", "",
              f"Generated only: {', '.join(f'`{g}`' for g in args.generated)}{also} ({len(planning.rules)} rules); "
              f"shipped: the library in `rules/` ({len(shipped.rules)} rules).", "",
              "| example | devices | generated only | shipped library |", "|---|---|---|---|"]
    for row in plans:
        fmt = lambda v, e: f"{v:.6g}" if v is not None else f"none ({e})"
        lines.append(f"| {row['example']} | {row['devices']} | {fmt(row['generated'], row.get('generated_error', ''))} | "
                     f"{fmt(row['shipped'], row.get('shipped_error', ''))} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"derived {len(derived)}/{len(considered)}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
