"""Each mesh's joint extraction (`search.mesh._extract_joint`) of one `parsat.optimize` call, policy by policy.

    PYTHONPATH=. .venv/bin/python benchmarks/joint_extraction_parts.py llama-70b:64 [--machine h100x8] [--all]

For every `_extract_joint` call (the two-axis meshes', ` x ` in the mesh's name, unless `--all`): each policy's
`solve` in the order tried (its ZeRO stage and recomputation, the memory it was extracted within, whether it
was asked lean, the extraction's method, or `none fits`), its CPU seconds, the memory checks, the extractions
again leaner (`_leaner_as_run`), and the stage ranking's schedule floors and pipelined prices (`mesh.first_ranked`:
`MemoryFit.pipelined_floor_s`, `pipelined_s`); then the CPU seconds of the extraction's parts inside it (the
passes, the ILPs, the PCG's build and pricing, `solve.price`), each with its call count. CPU seconds are
`time.process_time`, one wrapper per wrapped call (no profiler distortion); a part called from inside another
is counted in both. Written for session 71's helper X (benchmarks/search_results.md).
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import parsat
import parsat.egraph.session as session
import parsat.search.extract as extract
import parsat.search.fit as fit
import parsat.search.mesh as mesh
import parsat.search.solve as solve

PARTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
CALLS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
EVENTS: dict[str, list[str]] = collections.defaultdict(list)
CURRENT: list[str] = []   # the mesh whose `_extract_joint` runs, if one does


def _timed(owner, name: str, label: str, event=None) -> None:
    """`owner.name` wrapped: its CPU seconds added to `label` of the running extraction; `event(args, kwargs,
    result)`, when given, a line for its event list."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not CURRENT:
            return original(*args, **kwargs)
        key, start, result = CURRENT[-1], time.process_time(), None
        try:
            result = original(*args, **kwargs)
            return result
        finally:
            seconds = time.process_time() - start
            PARTS[key][label] += seconds
            CALLS[key][label] += 1
            if event is not None:
                EVENTS[key].append(f"{label:22s} {seconds:6.3f} CPU s  {event(args, kwargs, result)}")
    setattr(owner, name, wrapper)


def _solved(args, kwargs, result) -> str:
    """A `_solve_policy` call in words: the policy, the memory it was extracted within, lean asked, the method."""
    policy, machine = args[3], args[6]
    method = "none fits (ExtractionError)" if result is None else result[2].method
    return (f"{policy.describe() or 'keeping every activation'}; within {machine.memory_capacity / 2 ** 30:.1f} GiB, "
            f"lean {kwargs.get('lean')}: {method}")


def _install() -> None:
    """The wrappers, where the search looks each function up."""
    _timed(mesh, "_solve_policy", "policy solved", _solved)
    _timed(mesh, "_leaner_as_run", "again leaner", lambda a, k, r: "fits as run" if r else "none")
    _timed(fit.MemoryFit, "fits", "memory checked", lambda a, k, r: f"fits {r}")
    _timed(fit.MemoryFit, "pipelined_floor_s", "schedule floor", lambda a, k, r: f"{r:.3f} s")
    _timed(fit.MemoryFit, "pipelined_s", "pipelined price", lambda a, k, r: f"{r:.3f} s")
    for owner, name, label in ((mesh, "price", "solve.price (policy's costs)"), (solve, "extract", "extract"),
                               (extract, "_time_ranked", "  passes ranked by time"),
                               (extract, "lean_choices", "  lean passes"), (extract, "ilp", "  ILP"),
                               (extract, "bottom_up", "  a bottom-up pass (any)"),
                               (solve, "_built", "PCG built (and stamped)"),
                               (session.Provenance, "_load", "  provenance rows read"),
                               (solve._Built, "priced", "PCG priced"), (mesh, "first_ranked", "stage ranking")):
        _timed(owner, name, label)
    original = mesh._extract_joint

    def extract_joint(step, sat, config, clock, started):
        key = f"{sat.mesh} ({sat.result.enodes:,} e-nodes, {step.graph.microbatches} micro-batches)"
        CURRENT.append(key)
        start = time.process_time()
        try:
            return original(step, sat, config, clock, started)
        finally:
            CURRENT.pop()
            PARTS[key]["_extract_joint"] += time.process_time() - start
            CALLS[key]["_extract_joint"] += 1
    mesh._extract_joint = extract_joint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("case", help="NAME:DEVICES, e.g. llama-70b:64")
    parser.add_argument("--machine", default="h100x8")
    parser.add_argument("--all", action="store_true", help="every mesh's extraction, not only two-axis meshes'")
    args = parser.parse_args()
    name, devices = args.case.split(":")
    _install()
    start = time.process_time()
    parsat.optimize(name, machine=args.machine, devices=int(devices))
    total = time.process_time() - start
    every = collections.Counter()
    for key, parts in PARTS.items():
        every.update(parts)
        if not args.all and " x " not in key:
            continue
        print(f"== {key}: {parts['_extract_joint']:.2f} CPU s")
        print("\n".join(f"   {line}" for line in EVENTS[key]))
        for label, seconds in sorted(parts.items(), key=lambda item: -item[1]):
            print(f"   part {label:32s} {seconds:6.3f} CPU s  {CALLS[key][label]} calls")
    print(f"every mesh's _extract_joint: {every['_extract_joint']:.2f} CPU s; the call {total:.2f} CPU s")


if __name__ == "__main__":
    main()
