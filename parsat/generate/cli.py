"""`parsat generate`: discover, prove and prune rewrite rules (issue 7).

Errors a user can cause (unknown operators, bad degrees, an unwritable
output) end with a message and exit status 1, never a stack trace.
"""

from __future__ import annotations

import argparse
import shlex
import sys


def register(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="enumerate small terms, group by value, prove and keep new rules")
    gen.add_argument("--ops", required=True, metavar="OP,OP,...",
                     help="operators to combine (compute ops from the library and partition, combine, replicate, reduce)")
    gen.add_argument("--max-ops", type=int, default=2, metavar="N", help="operators per side, at most (default 2)")
    gen.add_argument("--degrees", default="2,3,4", metavar="D,D,...", help="concrete degrees fingerprints use")
    gen.add_argument("--seconds", type=float, default=600.0, metavar="S", help="time limit (default 600)")
    gen.add_argument("--jobs", "-j", type=int, default=1, help="verifier worker processes")
    gen.add_argument("--verify-timeout", type=float, default=10.0, help="seconds per candidate proof")
    gen.add_argument("--max-terms", type=int, default=200_000, help="stop enumerating after this many terms")
    gen.add_argument("--prune-with-library", action="store_true",
                     help="also drop candidates the shipped library derives")
    gen.add_argument("--no-lift", dest="lift", action="store_false",
                     help="keep rules at the ranks they were found (no rank-polymorphic widening)")
    gen.add_argument("--no-operator-vocabularies", dest="per_operator", action="store_false",
                     help="enumerate the joint rank-2 vocabulary only")
    gen.add_argument("--max-rank", type=int, default=3, metavar="R",
                     help="rank of the per-operator vocabularies' inputs, at most (default 3)")
    gen.add_argument("--rules", action="append", default=None, metavar="PATH",
                     help=".rule files or folders with the operators (default: the shipped library)")
    gen.add_argument("--prefix", default="gen", metavar="NAME",
                     help="start of the generated rules' names (default gen); give two runs different ones to "
                          "load their files together")
    gen.add_argument("--output", "-o", required=True, metavar="FILE.rule")
    gen.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    gen.set_defaults(run=run_generate)


def _error(message: str) -> int:
    print(f"parsat: error: {message}", file=sys.stderr)
    return 1


def run_generate(args: argparse.Namespace) -> int:
    from parsat.dsl.bounds import BoundError, check_all
    from parsat.dsl.errors import DslError
    from parsat.dsl.files import FileProblem, check_output, refuse_overwriting, write_atomic
    from parsat.dsl.checker import resolve_library
    from parsat.generate.generate import GenerateError, Settings, generate

    try:
        degrees = tuple(int(d) for d in args.degrees.split(",") if d.strip())
    except ValueError:
        return _error(f"--degrees must be a comma-separated list of integers, got '{args.degrees}'")
    try:   # before the rules load; `generate` checks the same bounds for API callers
        check_all("generate", {"--degrees": degrees, "--max-ops": args.max_ops, "--seconds": args.seconds,
                               "--jobs": args.jobs, "--verify-timeout": args.verify_timeout,
                               "--max-terms": args.max_terms, "--max-rank": args.max_rank})
    except BoundError as err:
        return _error(str(err))
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    if not ops:
        return _error("--ops names no operator")
    try:
        check_output(args.output)   # before the run, not after minutes of work
        refuse_overwriting(args.output, args.rules or [])
        library = resolve_library(args.rules)
    except FileProblem as err:
        return _error(str(err))
    except DslError as err:
        return _error("\n".join(d.render() for d in err.diagnostics))
    settings = Settings(ops, args.max_ops, degrees, args.seconds, max_terms=args.max_terms,
                        verify_timeout=args.verify_timeout, jobs=args.jobs,
                        prune_with_library=args.prune_with_library, lift=args.lift,
                        per_operator=args.per_operator, max_rank=args.max_rank, prefix=args.prefix)
    say = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        result = generate(library, settings, progress=say)
    except GenerateError as err:
        return _error(str(err))
    command = "parsat generate " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 2 else ""
    try:
        write_atomic(args.output, result.text(ops, command))
    except FileProblem as err:
        return _error(str(err))
    print(f"wrote {len(result.rules)} rules to {args.output}")
    print(result.summary.to_text())
    return 0
