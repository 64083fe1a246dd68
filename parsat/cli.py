"""The `parsat` command line.

Each subcommand lives with the package that does the work (`dsl`,
`verifier`, `saturate`, `generate`, `backend`) and registers itself here;
`optimize`, which joins the verifier, the search and the torch import,
lives in the facade (`optimize_cli`). Errors a user
can cause end with a message and a non-zero exit, never a stack trace.
Everything printed passes `terminal.printable`: a name holding escape
codes is shown, not obeyed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from parsat import __version__

# subcommand -> module with `register(subparsers)`; each module's `run(args)`
# returns the exit code.
SUBCOMMANDS = {
    "check": "parsat.dsl.cli",
    "fmt": "parsat.dsl.cli",
    "verify": "parsat.verifier.cli",
    "run": "parsat.backend.cli",
    "calibrate": "parsat.backend.cli",
    "optimize": "parsat.optimize_cli",
    "explain": "parsat.report.cli",
    "show": "parsat.report.cli",
    "generate": "parsat.generate.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parsat",
        description="Proven algebraic and parallel rewrites, optimized jointly, run on torch.distributed.",
    )
    parser.add_argument("--version", action="version", version=f"parsat {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    registered = set()
    for module_name in dict.fromkeys(SUBCOMMANDS.values()):
        if module_name in registered:
            continue
        registered.add(module_name)
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from parsat.terminal import printable_output

    with printable_output():  # names from users' files never drive the terminal (escape codes are shown)
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("parsat: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
