"""The demo behind `make demo`: what parsat can do today, end to end.

It checks the shipped rule library and prints its summary; later stages
(verify, optimize, run) join here as they land.
"""

from __future__ import annotations

import sys

import parsat


def main() -> int:
    report = parsat.check()
    for diagnostic in report.diagnostics:
        print(diagnostic.render(), file=sys.stderr)
    counts = report.counts()
    print(f"parsat {parsat.__version__}: checked the shipped library: {counts['operators']} operators, "
          f"{counts['rules']} rules ({counts['algebraic']} algebraic, {counts['parallel']} parallel), "
          f"{counts['errors']} errors")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
