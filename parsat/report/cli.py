"""`parsat explain`, `parsat show`: reading a plan the optimizer wrote.

(`parsat optimize` is the facade's, `parsat/optimize_cli.py`: it joins the
verifier's proofs, the torch import of a model and this package's search.)
A plan file that cannot be read ends with a message and exit status 1,
never a stack trace. Neither command imports egglog.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path


def register(subparsers) -> None:
    exp = subparsers.add_parser("explain", help="print a plan's cost breakdown, spreads and rules")
    exp.add_argument("plan", metavar="PLAN", help="a plan JSON written by parsat optimize")
    exp.add_argument("--all", action="store_true", help="list every node (default: the first 40)")
    exp.set_defaults(run=run_explain)
    show = subparsers.add_parser("show", help="draw a plan's PCG (graphviz)")
    show.add_argument("plan", metavar="PLAN")
    show.add_argument("--output", "-o", required=True, metavar="FILE", help=".svg/.png (needs graphviz 'dot') or .dot")
    show.add_argument("--schedule", action="store_true",
                      help="draw a pipelined plan's schedule per stage instead (.svg, no graphviz needed)")
    show.set_defaults(run=run_show)


def _error(message: str) -> int:
    print(f"parsat: error: {message}", file=sys.stderr)
    return 1


def run_explain(args: argparse.Namespace) -> int:
    from parsat.ir.plan import PlanError, load_plan_dict
    from parsat.report.explain import explain
    from parsat.ir.validate import validate_plan_report

    try:
        data = load_plan_dict(args.plan)
        validate_plan_report(data, PlanError, f"{args.plan} does not follow the plan schema")
        print(explain(data, None if args.all else 40))
    except PlanError as err:
        return _error(str(err))
    except (KeyError, TypeError) as err:
        return _error(f"{args.plan}: malformed plan ({err})")
    return 0


def run_show(args: argparse.Namespace) -> int:
    from parsat.dsl.files import FileProblem, refuse_overwriting, write_atomic
    from parsat.ir.pipeline import PipelinePlan
    from parsat.report.dot import plan_dot
    from parsat.report.pipeline import schedule_svg
    from parsat.ir.plan import PlanError, load_plan_dict
    from parsat.ir.validate import validate_plan_report

    out = Path(args.output)
    try:
        refuse_overwriting(out, [args.plan])
        data = load_plan_dict(args.plan)
        validate_plan_report(data, PlanError, f"{args.plan} does not follow the plan schema")
        dot = plan_dot(data)
    except (PlanError, FileProblem) as err:
        return _error(str(err))
    if args.schedule:
        if not data.get("pipeline"):
            return _error(f"{args.plan} is not pipelined: it has no schedule to draw (draw its PCG without --schedule)")
        if out.suffix != ".svg":
            return _error(f"--schedule draws SVG: name the output .svg, not {out.suffix or 'no suffix'}")
        drawing: str | bytes = schedule_svg(PipelinePlan.from_dict(data["pipeline"]))
    elif out.suffix == ".dot":
        drawing = dot
    else:
        binary = shutil.which("dot")
        if binary is None:
            return _error("graphviz 'dot' is not installed (apt-get install graphviz); write a .dot file instead: "
                          f"-o {out.with_suffix('.dot')}")
        fmt = out.suffix.lstrip(".") or "svg"
        # dot writes to a pipe, not the file: the drawing then replaces the file whole or not at all
        result = subprocess.run([binary, f"-T{fmt}"], input=dot.encode("utf-8"), capture_output=True)
        if result.returncode:
            return _error(f"dot failed: {result.stderr.decode('utf-8', 'replace').strip()}")
        drawing = result.stdout
    try:
        write_atomic(out, drawing)
    except FileProblem as err:
        return _error(str(err))
    print(f"wrote {out}", file=sys.stderr)
    return 0
