"""The most z3 work (rlimit units) one query needs, per rule, over rule folders: what sets `--rlimit`'s default.

Usage (from the repository root):

    PYTHONPATH=. .venv/bin/python benchmarks/verify_rlimit.py [--jobs 2] [--rlimit N] [PATH ...]

Verifies every rule of each PATH (default: rules/ and tests/true_rules/) with
`verifier.core.verify_rule` under a generous budget (default 20x the
shipped one) and a safety valve of 600 s, and records, per rule, the largest
count any one of its z3 queries used (`prove.Solving.most`), its verdict and
its CPU seconds. Prints a Markdown block for benchmarks/RESULTS-verify.md:
the largest counts, the verdicts, and the default's margin over the largest
count. The counts are z3's own deterministic units (a rule proved in a fresh
context counts the same on any machine, under any load); the CPU seconds
depend on the machine. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

from parsat.dsl.library import load_library, rule_files, display_path
from parsat.verifier import core, prove
from parsat.verifier.limits import DEFAULT_RLIMIT

_MOST: list[int] = []


class _Recording(prove.Solving):
    """A `Solving` that reports its largest query count when the rule is done."""

    def __init__(self, rlimit: int):
        super().__init__(rlimit)
        _MOST.append(0)

    def check(self, solver, deadline, stage):
        result = super().check(solver, deadline, stage)
        _MOST[-1] = max(_MOST[-1], self.most)
        return result


def _one(args: tuple) -> tuple[str, str, str, int, float]:
    rule, ops, rlimit = args
    prove.Solving = _Recording   # each worker process records its own rules
    _MOST.clear()
    start = time.process_time()
    verdict = core.verify_rule(rule, ops, timeout=600.0, rlimit=rlimit)
    cpu = time.process_time() - start
    where = f"{verdict.file}:{verdict.line}"
    return where, rule.name, verdict.verdict, max(_MOST, default=0), cpu


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="*", default=["rules/", "tests/true_rules/"])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--rlimit", type=int, default=20 * DEFAULT_RLIMIT)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    library, errors = load_library(args.paths, strict=False)
    if errors:
        print("\n".join(d.render() for d in errors), file=sys.stderr)
        return 1
    named = {display_path(p) for p in rule_files(args.paths)}
    rules = [r for r in library.rules if r.span is None or r.span.file in named]
    work = [(rule, library.ops, args.rlimit) for rule in rules]
    load = os.getloadavg()[0]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(_one, work, chunksize=4))
    print("```")
    print(f"$ PYTHONPATH=. .venv/bin/python benchmarks/verify_rlimit.py --jobs {args.jobs} --rlimit {args.rlimit} "
          + " ".join(args.paths))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs; Python {platform.python_version()}; "
          f"load average {load:.1f} at the start")
    print(f"{len(rows)} rules: " + ", ".join(f"{n} {v.lower()}" for v, n in sorted(Counter(r[2] for r in rows).items())))
    print(f"CPU seconds in verify_rule, all rules: {sum(r[4] for r in rows):.1f}")
    for folder in args.paths:
        mine = [r for r in rows if r[0].startswith(folder.rstrip("/"))]
        if mine:
            print(f"{folder}: largest query {max(r[3] for r in mine):,} units over {len(mine)} rules")
    print(f"largest {args.top} (units, rule, verdict, CPU s):")
    for where, name, verdict, most, cpu in sorted(rows, key=lambda r: -r[3])[:args.top]:
        print(f"  {most:>12,}  {where} {name}  {verdict}  {cpu:.2f}")
    top = max(r[3] for r in rows)
    print(f"default --rlimit {DEFAULT_RLIMIT:,}: {DEFAULT_RLIMIT / max(1, top):.0f}x the largest query")
    print("```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
