"""The step simulations of one optimize call, captured and replayed: the simulator and its task builder timed alone.

    PYTHONPATH=. .venv/bin/python benchmarks/simulator_replay.py capture llama-70b:64 /tmp/sims.pkl [--machine M]
    PYTHONPATH=. .venv/bin/python benchmarks/simulator_replay.py replay /tmp/sims.pkl [--repeat 2]

`capture` runs `parsat.optimize` on the case with `pcg_tasks.simulate_pcg` wrapped (in its module and in every
module that imported it by name) and pickles each call's arguments (the PCG without its kept facts, the
library, machine, profile, topology, micro-batches) with a digest of what it gave: every task's name, stream,
duration, dependencies, bytes and phase, every start and end, the step time and the peak memory per device.
`replay` runs every captured call again, in order, with one cache of compute times per machine shared by the
calls as a search shares it (each PCG fresh, so the facts kept with a PCG are worked out again, as they were the
first time; those of its structure, `PCG.structural`, shared by the captured PCGs that shared them, so worked
out once per structure as in the search), and prints its CPU seconds (process time) and whether every digest is the one captured: a change to
the simulator or the task builder that keeps every figure bit for bit prints `digests equal`. A capture made with
one version of the code replays on another (the pickled objects are the IR's and the machine's, not the
builder's).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import pickle
import struct
import sys
import time


def digest(prediction) -> str:
    """A hash of every task column and every start and end of a simulated step, its step time and peak memory."""
    result = prediction.result
    b, start, end = result._columns
    h = hashlib.sha256()
    h.update(repr((b.names, b.stream_of, b.allocs, b.frees, b.phases, b.deps, [str(s) for s in b.streams])).encode())
    for column in (b.durations, start, end):
        h.update(struct.pack(f"{len(column)}d", *column))
    h.update(repr((result.step_s.hex(), sorted((str(k), v) for k, v in result.peak_memory_bytes.items()),
                   result.critical_path)).encode())
    return h.hexdigest()


def capture(case: str, out: str, machine: str) -> None:
    import parsat
    from parsat.cost import pcg_tasks
    sys.path.insert(0, "benchmarks")
    from models_bench import _case

    original = pcg_tasks.simulate_pcg
    calls = []
    shared: dict[int, tuple[dict, dict]] = {}   # a PCG's structural facts' table -> (it, the copies' empty one)

    def wrapped(pcg, library, machine, profile=pcg_tasks.PARSAT_RUN, topology=None, times=None, microbatches=1,
                repeat=True):
        prediction = original(pcg, library, machine, profile, topology, times, microbatches, repeat)
        copy = dataclasses.replace(pcg)   # none of the facts kept with the PCG; those of its structure shared
        copy.__dict__["structural"] = shared.setdefault(id(pcg.structural), (pcg.structural, {}))[1]
        calls.append((copy, machine, profile, topology, microbatches, repeat, digest(prediction)))
        return prediction

    for module in list(sys.modules.values()):
        if getattr(module, "simulate_pcg", None) is original:
            module.simulate_pcg = wrapped
    name, devices, overrides, search = _case(case)
    degrees = {k: v for k, v in search.items() if k in ("pp", "tp", "dp")}
    plan = parsat.optimize(name, machine=machine, devices=devices, sizes=overrides or None,
                           degrees=degrees or None, schedule=search.get("schedule"), microbatches=search.get("m"))
    with open(out, "wb") as f:
        pickle.dump(calls, f, protocol=pickle.HIGHEST_PROTOCOL)
    print(f"{len(calls)} simulations captured, step {plan.totals.time_s * 1e3:.3f} ms")


def replay(path: str, repeat: int) -> None:
    from parsat.cost.pcg_tasks import OpTimes, simulate_pcg
    from parsat.dsl.library import load_library
    from parsat.search.collector import fewer_collections

    library = load_library()[0]
    with open(path, "rb") as f:
        blob = f.read()
    for round_ in range(repeat):
        calls = pickle.loads(blob)   # fresh PCGs each round: nothing kept with them from the round before
        caches: dict = {}
        gc.collect()
        equal, tasks = 0, 0
        with fewer_collections():   # the collector's thresholds as the search sets them
            start = time.process_time()
            for pcg, machine, profile, topology, microbatches, again, want in calls:
                times = caches.setdefault(machine, OpTimes(library, machine))
                prediction = simulate_pcg(pcg, library, machine, profile, topology, times, microbatches, again)
                seconds = time.process_time() - start
                equal += digest(prediction) == want
                tasks += len(prediction.result._columns[0].names)
                del prediction
                start = time.process_time() - seconds   # the digest is not timed
        print(f"round {round_ + 1}: {len(calls)} simulations, {tasks} tasks, {time.process_time() - start:.2f} CPU s, "
              f"digests {'equal' if equal == len(calls) else f'DIFFER ({len(calls) - equal} of {len(calls)})'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("capture", "replay"))
    parser.add_argument("where", nargs="+", help="capture: CASE FILE; replay: FILE")
    parser.add_argument("--machine", default="h100x8", help="capture: the machine, as `parsat optimize` names it")
    parser.add_argument("--repeat", type=int, default=2, help="replay: how many rounds")
    args = parser.parse_args()
    if args.command == "capture":
        capture(*args.where, args.machine)
    else:
        replay(*args.where, args.repeat)


if __name__ == "__main__":
    main()
