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
    show.add_argument("--timeout", type=float, default=DOT_TIMEOUT_S, metavar="SECONDS",
                      help=f"how long graphviz 'dot' may lay the drawing out (default {DOT_TIMEOUT_S:g}); past it "
                           "the drawing's DOT source is written instead")
    show.set_defaults(run=run_show)


DOT_TIMEOUT_S = 60.0


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
    from parsat.dsl.bounds import BoundError, check
    from parsat.dsl.files import FileProblem, refuse_overwriting, write_atomic
    from parsat.ir.pipeline import PipelinePlan
    from parsat.report.dot import plan_dot
    from parsat.report.pipeline import schedule_svg
    from parsat.ir.plan import PlanError, load_plan_dict
    from parsat.ir.validate import validate_plan_report

    out = Path(args.output)
    try:
        check("show", "--timeout", args.timeout)
        refuse_overwriting(out, [args.plan])
        data = load_plan_dict(args.plan)
        validate_plan_report(data, PlanError, f"{args.plan} does not follow the plan schema")
        dot = plan_dot(data)
    except (PlanError, FileProblem, BoundError) as err:
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
        drawing = _laid_out(dot, out, args.plan, _drawn(data), args.timeout)
        if not isinstance(drawing, bytes):
            return _error(drawing)
    try:
        write_atomic(out, drawing)
    except FileProblem as err:
        return _error(str(err))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _drawn(data) -> str:
    """What `show` draws, in words: the PCG's nodes and edges and whose it is."""
    nodes = data.get("nodes", [])
    edges = sum(len(node.get("inputs", [])) for node in nodes)
    name = (data.get("graph") or {}).get("name", "the graph")
    return f"the PCG of '{name}' ({len(nodes):,} nodes, {edges:,} edges)"


def _laid_out(dot: str, out: Path, plan: str, what: str, timeout: float) -> bytes | str:
    """The drawing graphviz `dot` makes of `dot`, or a message saying why not.

    `dot` gets `timeout` seconds: a large plan's layout can run for minutes
    (a gpt-13b plan ran past 120 s, silently). Past it, the drawing's DOT
    source is written beside the requested file (never over an existing
    one), to be rendered without a limit or viewed as it is, and the
    message says so. `dot` writes to a pipe, not the file, so the drawing
    replaces the file whole or not at all; a signal kills it with parsat
    (`dsl.lifetime`)."""
    from parsat.dsl.files import FileProblem, refuse_overwriting, write_atomic
    from parsat.dsl.lifetime import track_process, untrack_process

    binary = shutil.which("dot")
    if binary is None:
        return ("graphviz 'dot' is not installed (apt-get install graphviz); write a .dot file instead: "
                f"-o {out.with_suffix('.dot')}")
    fmt = out.suffix.lstrip(".") or "svg"
    print(f"drawing {what} with graphviz dot, as {fmt} (at most {timeout:g} s: --timeout)", file=sys.stderr,
          flush=True)
    process = subprocess.Popen([binary, f"-T{fmt}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    track_process(process)
    try:
        drawing, errors = process.communicate(dot.encode("utf-8"), timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        try:
            process.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:   # something dot started still holds its pipes: they are left to it
            pass
        source = out.with_suffix(".dot")
        late = f"dot did not lay out {what} within {timeout:g} s"
        if source.exists():
            return f"{late}; {out} was not written (raise --timeout, or write the source with -o {source})"
        try:
            refuse_overwriting(source, [plan])
            write_atomic(source, dot)
        except FileProblem as err:
            return f"{late}; {out} was not written, nor its source: {err}"
        return (f"{late}; wrote its source to {source} instead (render it without a limit: dot -T{fmt} {source} "
                f"-o {out}; or raise --timeout)")
    finally:
        untrack_process(process)
    if process.returncode:
        return f"dot failed: {errors.decode('utf-8', 'replace').strip()}"
    return drawing
