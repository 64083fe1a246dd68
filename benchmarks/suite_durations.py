"""Where the suite's time goes, from a `pytest --durations=0` listing: the sum, each file's total, and the two
workers' loads as pytest-xdist's `--dist loadfile` hands the files out.

With `--dist loadfile` a file's tests run on one worker, so one heavy file can be the critical path. xdist
(3.x, `LoadScopeScheduling`) orders the files by their number of tests (most first: `--loadscope-reorder`, the
default), gives each worker one file, and gives a worker the next file when at most 2 of its tests are left
to run. `loads` replays that with each test's measured duration (setup + call + teardown), which says how far
apart the two workers end (the suite's wall time is the later one, plus start-up).

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=0 > out.txt
    .venv/bin/python -m pytest -q --collect-only > collected.txt
    python benchmarks/suite_durations.py out.txt collected.txt [--top 40] [--heavy 20]

Since session 69 the suite hands the files out in `tests/conftest.py`'s `file_order` (its `HEAVY_FILES` first,
longest first): both orders are replayed, and `--heavy S` prints the files of at least S seconds as that table.
(benchmarks/suite_time.md, session 68 helper C; session 69 helper D.)
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from collections import OrderedDict
from pathlib import Path

LINE = re.compile(r"\s*([\d.]+)s (call|setup|teardown)\s+(\S.*?)\s*$")


def durations(path: str) -> dict[str, float]:
    """Each test's setup + call + teardown seconds, as `--durations=0` lists them."""
    found: dict[str, float] = {}
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            match = LINE.match(line)
            if match:
                found[match.group(3)] = found.get(match.group(3), 0.0) + float(match.group(1))
    return found


def files_in_order(collected: str, times: dict[str, float]) -> OrderedDict[str, list[float]]:
    """Each file's tests' seconds, in the order pytest collected them (a test not listed took under 5 ms)."""
    files: OrderedDict[str, list[float]] = OrderedDict()
    with open(collected, encoding="utf-8") as lines:
        for line in lines:
            node = line.strip()
            if "::" in node:
                files.setdefault(node.split("::")[0], []).append(times.get(node, 0.0))
    return files


def loads(files: OrderedDict[str, list[float]], workers: int = 2, order: list[str] | None = None) -> list[float]:
    """The seconds each worker is busy, its files handed out as xdist's loadfile scheduling does: by number of
    tests (xdist's own order), or in `order` (file names)."""
    if order is None:
        queue = sorted(files.values(), key=len, reverse=True)   # stable: collection order among equal counts
    else:
        queue = [files[name] for name in order]
    nodes = [{"t": 0.0, "pending": []} for _ in range(workers)]
    for node in nodes:
        if queue:
            node["pending"] += queue.pop(0)
    while any(node["pending"] for node in nodes):
        node = min((n for n in nodes if n["pending"]), key=lambda n: n["t"] + n["pending"][0])
        node["t"] += node["pending"].pop(0)
        if queue and len(node["pending"]) <= 2:
            node["pending"] += queue.pop(0)
        for other in nodes:   # a worker left with nothing takes the next file at once
            if not other["pending"] and queue:
                other["t"] = max(other["t"], node["t"])
                other["pending"] += queue.pop(0)
    return [node["t"] for node in nodes]


def conftest_order(files: OrderedDict[str, list[float]], heavy: dict[str, float] | None = None) -> list[str]:
    """The files in the order tests/conftest.py's `file_order` hands them out (with its `HEAVY_FILES`, or `heavy`)."""
    path = Path(__file__).resolve().parent.parent / "tests" / "conftest.py"
    spec = importlib.util.spec_from_file_location("suite_conftest", path)
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    counts = {name: len(seconds) for name, seconds in files.items()}
    return conftest.file_order(counts) if heavy is None else conftest.file_order(counts, heavy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("durations", help="pytest output with --durations=0")
    parser.add_argument("collected", help="pytest --collect-only -q output (the collection order)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--heavy", type=float, default=None, help="print the files of at least this many seconds")
    args = parser.parse_args()
    times = durations(args.durations)
    files = files_in_order(args.collected, times)
    print(f"sum of durations: {sum(times.values()):.1f} s over {len(times)} tests")
    print("loads of the 2 workers (xdist loadfile by number of tests, replayed): "
          + ", ".join(f"{t:.1f} s" for t in loads(files)))
    print("loads of the 2 workers (tests/conftest.py's file_order, replayed): "
          + ", ".join(f"{t:.1f} s" for t in loads(files, order=conftest_order(files))))
    measured = {name.rpartition("tests/")[2]: round(sum(seconds)) for name, seconds in files.items()}
    print("loads of the 2 workers (file_order with these durations as its table, replayed): "
          + ", ".join(f"{t:.1f} s" for t in loads(files, order=conftest_order(files, measured))))
    if args.heavy is not None:
        print({name: seconds for name, seconds in sorted(measured.items(), key=lambda item: -item[1])
               if seconds >= args.heavy})
    for name, seconds in sorted(files.items(), key=lambda item: -sum(item[1]))[:args.top]:
        print(f"{sum(seconds):8.1f} s {len(seconds):4d} tests  {name}")


if __name__ == "__main__":
    main()
