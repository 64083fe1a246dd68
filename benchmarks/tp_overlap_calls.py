"""A search's tensor-parallel overlaps (`cost.pipeline.tp_overlap`) captured, then re-run alone: their CPU and figures.

    PYTHONPATH=. .venv/bin/python benchmarks/tp_overlap_calls.py capture llama-70b:64 /tmp/calls.pkl
    PYTHONPATH=. .venv/bin/python benchmarks/tp_overlap_calls.py replay /tmp/calls.pkl

`capture` runs `parsat.optimize(NAME, machine="h100x8", devices=N)` with `tp_overlap` wrapped and pickles each
call's stage PCG (a fresh copy, without the facts kept with it), stage machine, profile, collectives' seconds and
the `TpOverlap` it gave. `replay` runs every captured call again in one process, as a search's `StageMemo` runs them
(one cache of compute times per stage machine), each stage PCG first simulated once with a cache of its own so
that the facts a search has worked out before its overlap (readers, roles, saved values) are there, as in the
search; it prints the CPU seconds (`time.process_time`) of the timed calls and how many gave another figure than
the captured one. Why: a search's 29 overlaps are ~8 CPU s of llama-70b:64's ~50, too little to see in the
whole call's run-to-run spread; run alone, trees can be compared on the same calls (benchmarks/search_results.md,
session 68 helper D).
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import time

import parsat
import parsat.cost.pipeline as pipeline
from parsat.cost.pcg_tasks import OpTimes
from parsat.dsl.library import load_library


@dataclasses.dataclass
class _Stage:
    """What `tp_overlap` reads of a stage plan: its PCG and stage machine."""

    pcg: object
    machine: object


def capture(case: str, path: str) -> None:
    """Every `tp_overlap` call of the optimize call `case` (NAME:DEVICES), pickled to `path`."""
    name, devices = case.split(":")
    calls = []
    original = pipeline.tp_overlap

    def recorded(plan, library, profile, comm_s, times=None):
        found = original(plan, library, profile, comm_s, times)
        calls.append((dataclasses.replace(plan.pcg), plan.machine, profile, comm_s, found))
        return found
    pipeline.tp_overlap = recorded
    try:
        plan = parsat.optimize(name, machine="h100x8", devices=int(devices))
    finally:
        pipeline.tp_overlap = original
    with open(path, "wb") as f:
        pickle.dump(calls, f)
    print(f"{case}: step {plan.totals.time_s * 1e3:.3f} ms, {len(calls)} overlaps captured to {path}")


def replay(path: str) -> tuple[float, int, int]:
    """(CPU seconds of the captured calls run again, how many calls, how many gave another `TpOverlap`)."""
    library = load_library()[0]
    with open(path, "rb") as f:
        calls = pickle.load(f)
    caches: dict = {}
    seconds, differing = 0.0, 0
    for pcg, machine, profile, comm_s, expected in calls:
        stage = _Stage(dataclasses.replace(pcg), machine)
        pipeline.tp_overlap(stage, library, profile, comm_s, OpTimes(library, machine))   # the PCG's facts
        times = caches.setdefault(machine, OpTimes(library, machine))
        start = time.process_time()
        found = pipeline.tp_overlap(stage, library, profile, comm_s, times)
        seconds += time.process_time() - start
        differing += found != expected
    return seconds, len(calls), differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("capture")
    one.add_argument("case")
    one.add_argument("path")
    two = sub.add_parser("replay")
    two.add_argument("path")
    args = parser.parse_args()
    if args.command == "capture":
        capture(args.case, args.path)
    else:
        seconds, count, differing = replay(args.path)
        print(f"{count} overlaps: {seconds:.2f} CPU s, {differing} differing from the captured figures")


if __name__ == "__main__":
    main()
