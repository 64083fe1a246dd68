"""Extraction alone, two versions of `parsat/search/extract.py` on the same calls: whether a change to it is cheaper.

    PYTHONPATH=BASE_TREE .venv/bin/python benchmarks/extraction_replay.py NEW_TREE/parsat/search/extract.py [rounds]
        [--profile old|new]

Runs `parsat.optimize("llama-70b", machine="h100x8", devices=64)` with BASE_TREE's code, capturing every
`extract` call `search.solve` makes with its arguments; then replays them all, BASE_TREE's `extract` and the file
given alternately, `rounds` times, each round with what either kept per snapshot (`Snapshot.derived`'s
`extract._time_ranked` and `extract._choosable` entries) dropped first, and prints each replay's CPU seconds
(`time.process_time`) and whether every call's choice, time, memory, method, candidates and ILP status (or error)
equal the first replay's. `--profile` prints a cProfile of one replay instead. The calls' arguments are those of
one search, so the replays see the same objects a search passes (a grid point's exclusion again for its roomy
extraction, one policy's costs again for a leaner one).
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import time

import parsat
import parsat.search.extract as old
import parsat.search.solve as solve

KEPT = ("extract._time_ranked", "extract._choosable", "extract.numbering", "extract.node_times")


def captured() -> list:
    """Every `extract` call of one llama-70b:64 search, as (args, kwargs)."""
    calls, extract = [], solve.extract

    def capture(*args, **kwargs):
        calls.append((args, kwargs))
        return extract(*args, **kwargs)

    solve.extract = capture
    start = time.process_time()
    parsat.optimize("llama-70b", machine="h100x8", devices=64)
    print(f"optimize {time.process_time() - start:.2f} CPU s, {len(calls)} extract calls", flush=True)
    solve.extract = extract
    return calls


def replay(module, calls: list) -> tuple[float, list]:
    """CPU seconds of `module.extract` on every call, and what each gave."""
    for args, _kwargs in calls:
        derived = args[0].derived
        for key in [k for k in derived if k in KEPT or (isinstance(k, tuple) and k and k[0] in KEPT)]:
            del derived[key]
    gc.collect()
    out = []
    start = time.process_time()
    for args, kwargs in calls:
        try:
            e = module.extract(*args, **kwargs)
            out.append((dict(e.choice), e.time_s, e.memory_bytes, e.method, dict(e.candidates), e.ilp_status))
        except Exception as err:   # an extraction that finds no plan: its error is what it gives
            out.append((type(err).__name__, str(err)))
    return time.process_time() - start, out


def main(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("parsat.search.extract_new", argv[0])
    new = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = new
    calls = captured()
    spec.loader.exec_module(new)
    if "--profile" in argv:
        import cProfile
        import pstats
        profile = cProfile.Profile()
        profile.enable()
        replay(new if argv[-1] == "new" else old, calls)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        return 0
    rounds = int(argv[1]) if len(argv) > 1 and argv[1].isdigit() else 2
    first = None
    for r in range(rounds):
        for name, module in (("old", old), ("new", new)):
            seconds, out = replay(module, calls)
            first = out if first is None else first
            print(f"round {r} {name}: {seconds:.3f} CPU s, same={out == first}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
