"""A search's tensor-parallel overlaps (`cost.pipeline.tp_overlap`) captured, then re-run alone: their CPU and figures.

    PYTHONPATH=. .venv/bin/python benchmarks/tp_overlap_calls.py capture llama-70b:64 /tmp/calls.pkl [--machine M]
    PYTHONPATH=. .venv/bin/python benchmarks/tp_overlap_calls.py replay /tmp/calls.pkl [--whole]

`capture` runs `parsat.optimize(NAME, machine=M, devices=N)` (M h100x8 unless given) with `tp_overlap` wrapped and pickles each
call's stage PCG (a fresh copy, without the facts kept with it), stage machine, profile, collectives' seconds and
the `TpOverlap` it gave. `replay` runs every captured call again in one process, as a search's `StageMemo` runs them
(one cache of compute times per stage machine), each stage PCG first simulated once with a cache of its own so
that the facts a search has worked out before its overlap (readers, roles, saved values) are there, as in the
search; it prints the CPU seconds (`time.process_time`) of the timed calls and how many gave another figure than
the captured one. Why: a search's 29 overlaps are ~8 CPU s of llama-70b:64's ~50, too little to see in the
whole call's run-to-run spread; run alone, trees can be compared on the same calls (benchmarks/search_results.md,
session 68 helper D).

Since session 71 (helper O) `tp_overlap` reads a stage plan of many alike blocks off excerpts of a few blocks
(`counts`): the warming call simulates the whole plan (`counts=()`), so that the excerpts and their facts are made
in the timed call, as a search makes them; `replay --whole` times the whole simulations instead, and each call's
figures are compared with the captured ones by their largest relative difference (float rounding of the line).
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


def capture(case: str, path: str, machine: str = "h100x8") -> None:
    """Every `tp_overlap` call of the optimize call `case` (NAME:DEVICES) on `machine`, pickled to `path`."""
    name, devices = case.split(":")
    calls = []
    original = pipeline.tp_overlap

    def recorded(plan, library, profile, comm_s, times=None, counts=pipeline.EXCERPT_COUNTS):
        found = original(plan, library, profile, comm_s, times, counts)
        calls.append((dataclasses.replace(plan.pcg), plan.machine, profile, comm_s, found))
        return found
    pipeline.tp_overlap = recorded
    try:
        plan = parsat.optimize(name, machine=machine, devices=int(devices))
    finally:
        pipeline.tp_overlap = original
    with open(path, "wb") as f:
        pickle.dump(calls, f)
    print(f"{case}: step {plan.totals.time_s * 1e3:.3f} ms, {len(calls)} overlaps captured to {path}")


def replay(path: str, whole: bool = False) -> tuple[float, int, float]:
    """(CPU seconds of the captured calls run again, how many calls, the largest relative difference of a figure of
    a `TpOverlap` from the captured one). `whole`: every stage plan simulated whole, as before session 71."""
    library = load_library()[0]
    with open(path, "rb") as f:
        calls = pickle.load(f)
    caches: dict = {}
    seconds, worst = 0.0, 0.0
    counts = () if whole else pipeline.EXCERPT_COUNTS
    for pcg, machine, profile, comm_s, expected in calls:
        stage = _Stage(dataclasses.replace(pcg), machine)
        pipeline.tp_overlap(stage, library, profile, comm_s, OpTimes(library, machine), counts=())   # its facts
        times = caches.setdefault(machine, OpTimes(library, machine))
        start = time.process_time()
        found = pipeline.tp_overlap(stage, library, profile, comm_s, times, counts=counts)
        seconds += time.process_time() - start
        for name in ("forward", "backward", "saved_forward_s", "saved_backward_s"):
            want, got = getattr(expected, name), getattr(found, name)
            worst = max(worst, abs(got - want) / abs(want) if want else abs(got))
    return seconds, len(calls), worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("capture")
    one.add_argument("case")
    one.add_argument("path")
    one.add_argument("--machine", default="h100x8")
    two = sub.add_parser("replay")
    two.add_argument("path")
    two.add_argument("--whole", action="store_true", help="simulate every stage plan whole (no excerpts)")
    args = parser.parse_args()
    if args.command == "capture":
        capture(args.case, args.path, args.machine)
    else:
        seconds, count, worst = replay(args.path, args.whole)
        print(f"{count} overlaps: {seconds:.2f} CPU s, largest relative difference from the captured figures "
              f"{worst:.2e}")


if __name__ == "__main__":
    main()
