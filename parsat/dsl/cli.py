"""`parsat check` and `parsat fmt`: the language's own subcommands."""

from __future__ import annotations

import argparse
import sys
import time

from parsat.dsl.checker import check_paths
from parsat.dsl.errors import DslError


def register(subparsers) -> None:
    check = subparsers.add_parser("check", help="parse and check .rule files or folders (default: the shipped library)")
    check.add_argument("paths", nargs="*", metavar="PATH", help=".rule files or folders")
    check.set_defaults(run=run_check)
    fmt = subparsers.add_parser("fmt", help="print .rule files in canonical form")
    fmt.add_argument("paths", nargs="+", metavar="PATH")
    fmt.add_argument("--write", action="store_true", help="rewrite the files in place")
    fmt.set_defaults(run=run_fmt)


def run_check(args: argparse.Namespace) -> int:
    report = check_paths(args.paths or None, _Progress())
    for diagnostic in report.diagnostics:
        print(diagnostic.render(), file=sys.stderr)
    counts = report.counts()
    print(f"{counts['files']} files, {counts['operators']} operators, {counts['rules']} rules "
          f"({counts['algebraic']} algebraic, {counts['parallel']} parallel), {counts['errors']} errors")
    return 0 if report.ok else 1


class _Progress:
    """A line on stderr every few seconds while a large library is checked (the rule text is capped, not
    the patience it takes: ~25 s per MB)."""

    EVERY_S = 3.0

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.EVERY_S:
            self.last = now
            print(f"checked {done:,} of {total:,} rules ({now - self.start:.0f} s)", file=sys.stderr, flush=True)


def run_fmt(args: argparse.Namespace) -> int:
    from parsat.dsl.files import FileProblem, write_atomic
    from parsat.dsl.library import rule_files
    from parsat.dsl.parser import parse_file
    from parsat.dsl.printer import format_module

    try:
        files = rule_files(args.paths)
        for path in files:
            text = format_module(parse_file(str(path)))
            if args.write:
                write_atomic(path, text)
            else:
                sys.stdout.write(text)
    except DslError as err:
        print(err, file=sys.stderr)
        return 1
    except FileProblem as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
