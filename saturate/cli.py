"""`parsat optimize`, `parsat explain`, `parsat show`: the saturation subcommands.

Every error a user can cause (a bad graph, an unknown preset, a device
count the model cannot use, a plan that does not fit) ends with a message
and exit status 1, never a stack trace. egglog is only imported when
`optimize` runs.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path


def register(subparsers) -> None:
    opt = subparsers.add_parser("optimize", help="find the cheapest parallel plan for a model (equality saturation)")
    opt.add_argument("model", nargs="?", metavar="MODEL",
                     help="a graph JSON file, a built-in example name, or model.py:factory (a torch module)")
    opt.add_argument("--devices", "-n", type=int, default=None, help="number of devices (default: one machine node)")
    opt.add_argument("--machine", "-m", default="h100x8", help="machine preset (h100x8, a100x8, cpu) or JSON file")
    opt.add_argument("--output", "-o", default=None, metavar="PLAN", help="write the plan JSON here")
    opt.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="size of a built-in example")
    opt.add_argument("--rules", action="append", default=None, metavar="PATH",
                     help=".rule files or folders (default: the shipped rules); repeat for several")
    opt.add_argument("--limit", action="append", default=[], metavar="KEY=VALUE",
                     help="saturation limits: iterations, enodes, seconds, ilp_seconds")
    opt.add_argument("--allow-unverified", action="store_true", help="also use rules the verifier has not PROVED")
    opt.add_argument("--list-examples", action="store_true", help="list the built-in examples and their sizes")
    opt.add_argument("--no-baselines", action="store_true", help="skip the baselines (faster)")
    opt.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    opt.set_defaults(run=run_optimize)
    exp = subparsers.add_parser("explain", help="print a plan's cost breakdown, spreads and rules")
    exp.add_argument("plan", metavar="PLAN", help="a plan JSON written by parsat optimize")
    exp.add_argument("--all", action="store_true", help="list every node (default: the first 40)")
    exp.set_defaults(run=run_explain)
    show = subparsers.add_parser("show", help="draw a plan's PCG (graphviz)")
    show.add_argument("plan", metavar="PLAN")
    show.add_argument("--output", "-o", required=True, metavar="FILE", help=".svg/.png (needs graphviz 'dot') or .dot")
    show.set_defaults(run=run_show)


def _pairs(items: list[str], what: str, cast=int) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{what} must look like KEY=VALUE, got '{item}'")
        try:
            out[key.strip()] = cast(value)
        except ValueError:
            raise ValueError(f"{what} {key}: '{value}' is not a number") from None
    return out


def _error(message: str) -> int:
    print(f"parsat: error: {message}", file=sys.stderr)
    return 1


def run_optimize(args: argparse.Namespace) -> int:
    from parsat.saturate.models import EXAMPLES

    if args.list_examples:
        for name, example in EXAMPLES.items():
            sizes = " ".join(f"{k}={v}" for k, v in example.defaults().items())
            print(f"{name:<12} {example.summary}\n{'':<12} sizes: {sizes}")
        return 0
    if not args.model:
        return _error("give a MODEL (a graph JSON file or an example: " + ", ".join(EXAMPLES) + ")")
    from parsat.dsl.errors import DslError
    from parsat.saturate.api import OptimizeError, optimize
    from parsat.saturate.graph import GraphError
    from parsat.saturate.machine import MachineError

    try:
        sizes = _pairs(args.set, "--set")
        limits = _pairs(args.limit, "--limit", float)
        for key in ("iterations", "enodes"):
            if key in limits:
                limits[key] = int(limits[key])
        start = time.perf_counter()

        def progress(message: str) -> None:
            if not args.quiet:
                print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

        model = args.model
        if ".py:" in model:  # model.py:factory -> (module, example inputs): torch.export, torch loaded only here
            from parsat.backend.torch_import import load_model_file
            model = load_model_file(model)
        plan = optimize(model, machine=args.machine, rules=args.rules, limits=limits or None,
                        devices=args.devices, allow_unverified=True if args.allow_unverified else None,
                        baselines=not args.no_baselines, sizes=sizes or None, progress=progress)
    except (ValueError, OptimizeError, GraphError, MachineError) as err:
        return _error(str(err))
    except DslError as err:
        return _error(f"the rules do not load:\n{err}")
    if args.output:
        try:
            plan.save(args.output)
        except OSError as err:
            return _error(f"cannot write {args.output}: {err.strerror}")
        print(f"wrote {args.output}", file=sys.stderr)
    print(plan.explain())
    return 0


def run_explain(args: argparse.Namespace) -> int:
    from parsat.saturate.plan import PlanError, explain, load_plan_dict
    from parsat.saturate.validate import validate_plan_report

    try:
        data = load_plan_dict(args.plan)
        validate_plan_report(data, PlanError, f"{args.plan} does not follow the plan schema")
        print(explain(data, None if args.all else 40))
    except PlanError as err:
        return _error(str(err))
    except (KeyError, TypeError) as err:
        return _error(f"{args.plan}: malformed plan ({err})")
    return 0


def plan_dot(data: dict) -> str:
    """The PCG as graphviz DOT: compute nodes as boxes, parallel operators as ellipses with their collective."""
    lines = ["digraph pcg {", '  rankdir=TB; node [fontname="Helvetica", fontsize=10];']
    for node in data["nodes"]:
        spread = node["spread"]
        layout = []
        if any(d != 1 for d in spread["shard"]):
            layout.append("shard " + "x".join(str(d) for d in spread["shard"]))
        if spread.get("copy", 1) != 1:
            layout.append(f"copy {spread['copy']}")
        if spread.get("sum", 1) != 1:
            layout.append(f"sum {spread['sum']}")
        where = ", ".join(layout) or "whole"
        shape = "x".join(str(d) for d in node["shape"])
        if node["kind"] == "leaf":
            label, style = f"{node['op']}\\n[{shape}]", 'shape=note, style=filled, fillcolor="#eeeeee"'
        elif node["kind"] == "parallel":
            attrs = ", ".join(f"{k}={v}" for k, v in node["attrs"].items())
            coll = "\\n".join(c.split(" (")[0] for c in node["cost"]["collectives"])
            label = f"{node['op']}({attrs})\\n{where}" + (f"\\n{coll}" if coll else "")
            style = 'shape=ellipse, style=filled, fillcolor="#ffe9b3"'
        else:
            label = f"{node['op']} #{node['id']}\\n[{shape}] {where}"
            style = 'shape=box, style=filled, fillcolor="#d8e8ff"'
        lines.append(f'  n{node["id"]} [label="{label}", {style}];')
        for source in node["inputs"]:
            lines.append(f"  n{source} -> n{node['id']};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def run_show(args: argparse.Namespace) -> int:
    from parsat.saturate.plan import PlanError, load_plan_dict
    from parsat.saturate.validate import validate_plan_report

    try:
        data = load_plan_dict(args.plan)
        validate_plan_report(data, PlanError, f"{args.plan} does not follow the plan schema")
        dot = plan_dot(data)
    except PlanError as err:
        return _error(str(err))
    out = Path(args.output)
    if out.suffix == ".dot":
        out.write_text(dot, encoding="utf-8")
        return 0
    binary = shutil.which("dot")
    if binary is None:
        return _error("graphviz 'dot' is not installed (apt-get install graphviz); write a .dot file instead: "
                      f"-o {out.with_suffix('.dot')}")
    result = subprocess.run([binary, f"-T{out.suffix.lstrip('.') or 'svg'}", "-o", str(out)], input=dot, text=True,
                            capture_output=True)
    if result.returncode:
        return _error(f"dot failed: {result.stderr.strip()}")
    print(f"wrote {out}", file=sys.stderr)
    return 0
