"""The `parsat` command line.

Each subcommand lives with the package that does the work (`dsl`,
`verifier`, `saturate`, `generate`, `backend`) and registers itself here;
`optimize`, which joins the verifier, the search and the torch import,
lives in the facade (`optimize_cli`). Errors a user
can cause end with a message and a non-zero exit, never a stack trace;
what no command caught is said in one line too (`unexpected`: out of
memory, nesting too deep, or a bug in parsat; PARSAT_TRACEBACK=1 raises it
instead). SIGINT, SIGTERM and SIGHUP end a command within a second
(`dsl.lifetime`).
Everything printed passes `terminal.printable`: a name holding escape
codes is shown, not obeyed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from typing import Sequence

from parsat import __version__
from parsat.dsl.lifetime import Terminated, exit_status

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
    from parsat.dsl.lifetime import handling_signals
    from parsat.terminal import printable_output

    # names from users' files never drive the terminal (escape codes are shown); SIGINT, SIGTERM and SIGHUP
    # end the command and everything it started within a second (`dsl.lifetime`)
    with printable_output(), handling_signals():
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
        return exit_status(signal.SIGINT)
    except Terminated as err:
        print(f"parsat: {err}", file=sys.stderr)
        return exit_status(err.signum)
    except BrokenPipeError:
        return 1
    except Exception as err:  # noqa: BLE001 - the last guard: no stack trace is ever the message
        if os.environ.get("PARSAT_TRACEBACK"):
            raise
        print(f"parsat: error: {unexpected(err)}", file=sys.stderr)
        return 1


def unexpected(err: BaseException) -> str:
    """What an exception no command caught means to the user, in one line: memory ran out, something nested
    too deeply, or a bug in parsat (named, with how to see where)."""
    if isinstance(err, MemoryError):
        return ("out of memory: this machine (or a `ulimit -v`) gave parsat no more; give it less work (a smaller "
                "graph or fewer sizes) or more memory")
    if isinstance(err, RecursionError):
        return "the input is nested too deeply for parsat to follow (Python's recursion limit)"
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return (f"internal error: {type(err).__name__}: {first} (a bug in parsat; PARSAT_TRACEBACK=1 shows where, "
            "please report it)")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
