"""`parsat verify PATH...`: prove every rule, refute wrong ones, Alive2 style.

Exit status 0 only when every rule is PROVED (for every rank); the last
line is always `N proved, N refuted, N unknown` (with `N bounded`, `N
vacuous` and `N illegal` between when there are any). Malformed rules are reported as
`file:line:col: error: ...` messages (exit 1), never as stack traces.
With `--json` each rule's record is printed (and flushed) as soon as it is
decided, so an interrupted run keeps what it has.
"""

from __future__ import annotations

import argparse
import json
import sys

from parsat.verifier.limits import DEFAULT_RLIMIT, DEFAULT_TIMEOUT


def register(subparsers) -> None:
    verify = subparsers.add_parser("verify", help="prove rules for all shapes and degrees, or refute them")
    verify.add_argument("paths", nargs="*", metavar="PATH", help=".rule files or folders (default: the shipped library)")
    verify.add_argument("--match", action="append", metavar="NAME", help="only rules with this name (glob; repeatable)")
    verify.add_argument("--rlimit", type=int, default=DEFAULT_RLIMIT, metavar="N",
                        help=f"z3's work budget per query, in its deterministic resource units (default "
                             f"{DEFAULT_RLIMIT:,}): verdicts depend on it, never on the machine's speed")
    verify.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"wall-clock safety valve per rule (default {DEFAULT_TIMEOUT:g} s): a rule it cuts "
                             "is UNKNOWN, saying so")
    verify.add_argument("--jobs", type=int, default=1, metavar="N", help="worker processes")
    verify.add_argument("--json", action="store_true", help="one JSON record per rule on stdout")
    verify.add_argument("--no-cache", action="store_true", help="neither read nor write the verdict cache")
    verify.add_argument("--coverage", action="store_true",
                        help="list legal one-step parallelizations of the operators that no rule covers")
    verify.add_argument("--verbose", "-v", action="store_true", help="print the assumptions of every proof")
    verify.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from parsat.verifier.api import verify_paths
    from parsat.verifier.cache import VerdictCache
    from parsat.verifier.verdict import PROVED

    from parsat.dsl.bounds import BoundError, check_all

    try:
        check_all("verify", {"--timeout": args.timeout, "--jobs": args.jobs, "--rlimit": args.rlimit})   # NaN, inf
    except BoundError as err:
        print(f"parsat verify: {err}", file=sys.stderr)
        return 2
    cache = None if args.no_cache else VerdictCache()

    def stream(verdict) -> None:
        print(json.dumps(verdict.to_json()), flush=True)

    report = verify_paths(args.paths or None, match=args.match, timeout=args.timeout, jobs=args.jobs, cache=cache,
                          on_verdict=stream if args.json else None, rlimit=args.rlimit)
    for problem in report.cache_problems:
        print(f"parsat verify: warning: {problem}", file=sys.stderr)
    for error in report.errors:
        print(error, file=sys.stderr)
    if not args.json:
        for verdict in report.verdicts:
            if verdict.verdict == PROVED and not args.verbose and not verdict.notes:
                print(verdict.headline())
            elif verdict.verdict == "BOUNDED" and not args.verbose:
                print(verdict.headline())
            else:
                print(verdict.render())
    if args.match and not report.verdicts and not report.errors:
        print(f"parsat verify: no rule matches {', '.join(args.match)}", file=sys.stderr)
    if args.coverage:
        _print_coverage(args.paths or None)
    summary = report.summary()
    if args.json:
        print(summary, file=sys.stderr)
    else:
        print(summary)
    return 0 if report.ok and report.verdicts else 1


def _print_coverage(paths) -> None:
    """Notes (not failures): parallelizations the semantics allows that no rule uses."""
    from parsat.dsl.errors import DslError
    from parsat.dsl.library import load_library
    from parsat.dsl.typecheck import TypeCheckError, group_assignments, type_rule
    from parsat.verifier.coverage import uncovered

    try:
        library, _ = load_library(paths, strict=False)
    except DslError:
        return
    typed = []
    for rule in library.rules:
        for groups in group_assignments(rule, 4, 1):
            try:
                typed.append(type_rule(rule, library.ops, groups))
            except TypeCheckError:
                continue
    for item in uncovered(library.ops, typed):
        print(f"note: no rule covers {item.describe()}")
