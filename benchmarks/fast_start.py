"""CPU seconds of a short `parsat` command, trees run in turn: what a start costs, before and after a change.

    .venv/bin/python benchmarks/fast_start.py TREE [TREE ...] [--runs 5] [--pyc] [-- ARGS...]

Each tree (a checkout: its folder goes first on PYTHONPATH) runs `python -m parsat ARGS` (default
`optimize mlp --devices 2 --machine cpu -q -o FILE`) `--runs` times, the trees in turn so that a change in
the box's load falls on each alike; the first run of each tree fills the caches (parse, check, verdicts) and
is not counted. A run's cost is its process's user + system CPU seconds (`os.wait4`), never wall seconds;
the report gives each tree's median, min and max, its peak RSS, and the 1-minute load average at the start
and the end. An `optimize` writes its plan (`-o`, unless the arguments name one), and the plans are compared
(`parsat.ir.plan.without_timing`): a tree whose plan differs from the first tree's is said.

`PYTHONDONTWRITEBYTECODE` is passed on as it is set (this box sets it: each run then compiles parsat's
sources, ~0.3 CPU s); `--pyc` unsets it, so the warm-up run writes `__pycache__` and the counted runs read
it, as an installed parsat does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from parsat.ir.plan import without_timing

DEFAULT_ARGS = ["optimize", "mlp", "--devices", "2", "--machine", "cpu", "-q"]


def run_once(tree: Path, args: list[str], env: dict[str, str]) -> tuple[float, int, int]:
    """(user + system CPU s, peak RSS in KiB, exit status) of one `python -m parsat ARGS` in `tree`."""
    child = subprocess.Popen([sys.executable, "-m", "parsat", *args], cwd=tree,
                             env={**env, "PYTHONPATH": str(tree)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss, child.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path)
    parser.add_argument("--runs", type=int, default=5, help="counted runs per tree (after one warm-up)")
    parser.add_argument("--pyc", action="store_true", help="let Python write and read __pycache__")
    ours, rest = (sys.argv[1:sys.argv.index("--")], sys.argv[sys.argv.index("--") + 1:]) if "--" in sys.argv \
        else (sys.argv[1:], [])
    options = parser.parse_args(ours)
    args = rest or DEFAULT_ARGS
    env = dict(os.environ)
    if options.pyc:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    trees = [t.resolve() for t in options.trees]
    folder = Path(tempfile.mkdtemp(prefix="fast_start_"))
    plans = {t: folder / f"plan{i}.json" for i, t in enumerate(trees)}
    writes = args[:1] == ["optimize"] and not {"-o", "--output"} & set(args)
    argv = {t: args + (["-o", str(plans[t])] if writes else []) for t in trees}
    for tree in trees:
        run_once(tree, argv[tree], env)
    load_start = os.getloadavg()[0]
    seconds: dict[Path, list[float]] = {t: [] for t in trees}
    peak: dict[Path, int] = {t: 0 for t in trees}
    statuses: dict[Path, set[int]] = {t: set() for t in trees}
    for _ in range(options.runs):
        for tree in trees:
            cpu, rss, status = run_once(tree, argv[tree], env)
            seconds[tree].append(cpu)
            peak[tree] = max(peak[tree], rss)
            statuses[tree].add(status)
    print(f"parsat {' '.join(args)}; {options.runs} runs per tree after a warm-up; bytecode cache "
          f"{'on' if options.pyc else 'as set'}; load {load_start:.2f} -> {os.getloadavg()[0]:.2f}")
    first = None
    for tree in trees:
        cpu = seconds[tree]
        plan = ""
        if writes and plans[tree].exists():
            here = without_timing(json.loads(plans[tree].read_text()))
            first = here if first is None else first
            plan = "; plan as the first tree's" if here == first else "; plan DIFFERS from the first tree's"
        print(f"  {tree}: median {statistics.median(cpu):.2f} CPU s (min {min(cpu):.2f}, max {max(cpu):.2f}), "
              f"peak RSS {peak[tree] / 1024:.0f} MiB, exit {sorted(statuses[tree])}{plan}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
