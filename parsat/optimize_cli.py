"""`parsat optimize`: find the cheapest parallel plan for a model.

The command joins three packages, so it lives in the facade: a model given
as `model.py:factory` is imported by the torch backend
(`importer.model_file`), the rules are the ones the verifier PROVED
(`parsat.api.optimize`), and the search is `parsat.search`'s. Every error a user
can cause (a bad graph, an unknown preset, a device count the model cannot
use, a plan that does not fit) ends with a message and exit status 1, never
a stack trace. egglog is only imported when `optimize` runs.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings


VALVE_S = 10.0
"""After a first Ctrl-C, how long the search may take to return the plan it has (extraction of the e-graph as
it stands, the baselines already priced) before the command is ended anyway; SIGTERM ends it within a second."""


def register(subparsers) -> None:
    opt = subparsers.add_parser("optimize", help="find the cheapest parallel plan for a model (equality saturation)")
    opt.add_argument("model", nargs="?", metavar="MODEL",
                     help="a graph JSON file, a built-in example name, or model.py:factory (a torch module)")
    opt.add_argument("--devices", "-n", type=int, default=None, help="number of devices (default: one machine node)")
    opt.add_argument("--machine", "-m", default="h100x8", help="machine preset (h100x8, a100x8, cpu) or JSON file")
    opt.add_argument("--precision", default=None, choices=("bf16", "fp16", "fp32", "fp64"),
                     help="training precision (default: the machine's own: bf16 with fp32 master weights and Adam "
                          "state on the GPU presets; fp32 means TF32 there)")
    opt.add_argument("--output", "-o", default=None, metavar="PLAN", help="write the plan JSON here")
    opt.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="size of a built-in example")
    opt.add_argument("--rules", action="append", default=None, metavar="PATH",
                     help=".rule files or folders (default: the shipped rules); repeat for several")
    opt.add_argument("--limit", action="append", default=[], metavar="KEY=VALUE",
                     help="search budgets, counted in work so the same inputs give the same plan: generations "
                          "(rounds of the rules that make new values, default 8), matches (one such rule's "
                          "pattern matches in a round, by default the enodes limit; past it the rule is held back), "
                          "iterations and enodes (each saturation's), ilp_nodes (each extraction's ILP); and "
                          "seconds, a wall-clock safety "
                          "valve (off by default) that returns the best plan found so far, ilp_seconds likewise "
                          "for one ILP (0: greedy extraction only)")
    opt.add_argument("--allow-unverified", action="store_true", help="also use rules the verifier has not PROVED")
    opt.add_argument("--list-examples", action="store_true", help="list the built-in examples and their sizes")
    opt.add_argument("--degrees", default=None, metavar="KIND=N,...",
                     help="pin degrees of parallelism (dp, tp, pp; sp=N with tp=N: Megatron-LM's sequence-parallel "
                          "norms on the tensor-parallel ranks, sp=1 none) and the ZeRO stage (zero: 0-3; 1 shards the "
                          "optimizer state over each weight's replicas, Megatron-LM's distributed optimizer; 2 the "
                          "gradients too; 3 stores weights split, FSDP), e.g. tp=8,pp=4,zero=1; the rest is "
                          "searched (dp x tp are one pipeline stage's devices; unpinned, ZeRO 1 or 2 is used "
                          "where a plan would not fit without)")
    opt.add_argument("--schedule", default=None, choices=("gpipe", "1f1b", "interleaved"),
                     help="pin the pipeline schedule (default: searched)")
    opt.add_argument("--chunks-per-stage", type=int, default=None, metavar="V",
                     help="pin the interleaved schedule's chunks per stage (Megatron's virtual pipeline size; "
                          "2 or more implies --schedule interleaved; each stage's layers must split evenly)")
    opt.add_argument("--pipeline", dest="pipeline", action="store_true", default=None,
                     help="also search pipelined plans (default: when the devices span several nodes, or when "
                          "no unstaged plan fits)")
    opt.add_argument("--no-pipeline", dest="pipeline", action="store_false", help="never pipeline")
    opt.add_argument("--recompute", default="auto", choices=("auto", "none", "blocks"),
                     help="activation recomputation: blocks (each block's forward run again before its backward, "
                          "only values crossing blocks kept), none, or auto (default: blocks only where keeping "
                          "every activation does not fit)")
    opt.add_argument("--microbatches", type=int, default=None, metavar="M",
                     help="run the step as M micro-batches (default: split a built-in example's batch only when "
                          "a whole batch does not fit in memory)")
    opt.add_argument("--all-blocks", action="store_true",
                     help="search every block of a built-in example (default: a model of more than 3 identical "
                          "blocks is searched as 3, the middle one's plan repeated)")
    opt.add_argument("--no-baselines", action="store_true", help="skip the baselines (faster)")
    opt.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    opt.add_argument("--stats", action="store_true",
                     help="after the plan, list each rule's matches in saturation and the rules that never fired")
    opt.set_defaults(run=run_optimize)


def _pairs(items: list[str], what: str, cast=int) -> dict:
    """KEY=VALUE items as a dict, each value cast; a key given twice is refused, not the last one kept
    (`--degrees tp=2,tp=4` is a typo, not a choice)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what} must look like KEY=VALUE, got '{item}'")
        if key.strip() in out:
            raise ValueError(f"{what} {key.strip()} is given twice")
        kind = cast(key.strip()) if cast is _limit_type else cast
        try:
            out[key.strip()] = kind(value)
        except (ValueError, OverflowError):
            word = "a whole number" if kind is int else "a number"
            raise ValueError(f"{what} {key}: '{value}' is not {word}") from None
    return out


def _limit_type(key: str) -> type:
    """iterations, generations, enodes, matches and ilp_nodes are counts; the others seconds."""
    return int if key in ("iterations", "generations", "enodes", "matches", "ilp_nodes") else float


def _say_warnings(caught) -> None:
    """A cache entry recomputed is said as `parsat optimize: warning: ...` (a user's message, no source line);
    other warnings go on as Python shows them."""
    from parsat.api import CacheWarning

    for item in caught:
        if issubclass(item.category, CacheWarning):
            print(f"parsat optimize: warning: {item.message}", file=sys.stderr)
        else:
            warnings.showwarning(item.message, item.category, item.filename, item.lineno)


def _warn_oversubscribed(spec: str, machine) -> None:
    """One line on stderr when the machine file's figures were measured with more ranks than cores or GPUs
    (`calibrate --oversubscribe`): a plan priced with them is priced for ranks taking turns, not this machine."""
    if machine.oversubscribed is not None:
        print(f"parsat optimize: warning: {spec}: {machine.oversubscribed.describe()}; its figures are of ranks "
              "taking turns, not of the machine (calibrate again with at most one rank per core or GPU)",
              file=sys.stderr)


def _error(message: str) -> int:
    print(f"parsat: error: {message}", file=sys.stderr)
    return 1


def run_optimize(args: argparse.Namespace) -> int:
    from parsat.ir.models import EXAMPLES

    if args.list_examples:
        for name, example in EXAMPLES.items():
            print(f"{name:<12} {example.summary}\n{'':<12} sizes: {example.describe_sizes()}")
            if example.source:
                published = f" (published: {example.parameters:.3g} parameters)" if example.parameters else ""
                print(f"{'':<12} source: {example.source}{published}")
        return 0
    if not args.model:
        return _error("give a MODEL (a graph JSON file or an example: " + ", ".join(EXAMPLES) + ")")
    from parsat.dsl.errors import DslError
    from parsat.dsl.files import FileProblem, check_output, refuse_overwriting
    from parsat.ir.errors import GraphError, MachineError
    from parsat.ir.machine import Machine
    from parsat.ir.plan import save_plan_dict
    from parsat.ir.errors import OptimizeError
    from parsat.egraph.runner import Limits
    from parsat.dsl.lifetime import valve

    try:
        if args.output:  # before any work: a plan written over the model or machine file would destroy it
            check_output(args.output)
            refuse_overwriting(args.output, [args.model.split(".py:")[0] + ".py" if ".py:" in args.model
                                             else args.model, args.machine, *(args.rules or [])])
        sizes = _pairs(args.set, "--set")
        degrees = _pairs(args.degrees.split(","), "--degrees") if args.degrees else {}
        limits = _pairs(args.limit, "--limit", _limit_type)
        Limits.from_mapping(limits)          # bad limits and machine files are refused before any work
        machine = Machine.resolve(args.machine)
        _warn_oversubscribed(args.machine, machine)
        start = time.perf_counter()

        def progress(message: str) -> None:
            if not args.quiet:
                print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

        model = args.model
        if ".py:" in model:  # model.py:factory -> (module, example inputs): torch.export import, torch loaded only here
            from parsat.search.request import check_arguments

            if sizes:
                raise GraphError("--set sizes only apply to built-in examples")
            check_arguments(machine, args.devices, degrees, args.recompute)   # before torch and the export
            from parsat.importer.model_file import load_model_file
            model = load_model_file(model)
        # the optimizer (the search, the cost model, numpy) loads only once the arguments above are good
        from parsat.api import CacheWarning, optimize
        # a first Ctrl-C returns the plan found so far (docs/MESH.md), within VALVE_S
        with warnings.catch_warnings(record=True) as caught, valve(VALVE_S):
            warnings.simplefilter("always", CacheWarning)
            plan = optimize(model, machine=machine, rules=args.rules, limits=limits or None,
                            devices=args.devices, allow_unverified=True if args.allow_unverified else None,
                            precision=args.precision,
                            baselines=not args.no_baselines, sizes=sizes or None, degrees=degrees or None,
                            microbatches=args.microbatches, repeat_blocks=not args.all_blocks,
                            pipeline=args.pipeline, schedule=args.schedule, chunks_per_stage=args.chunks_per_stage,
                            recompute=args.recompute, progress=progress)
        _say_warnings(caught)
    except (ValueError, OptimizeError, GraphError, MachineError, FileProblem) as err:
        return _error(str(err))
    except DslError as err:
        return _error(f"the rules do not load:\n{err}")
    data = plan.to_dict()   # once, for the file and for the explanation
    if args.output:
        try:
            save_plan_dict(args.output, data)
        except FileProblem as err:
            return _error(str(err))
        print(f"wrote {args.output}", file=sys.stderr)
    from parsat.report.explain import explain

    print(explain(data))
    if args.stats:
        from parsat.report.explain import saturation_stats

        print()
        print(saturation_stats(plan.saturation))
    return 0
