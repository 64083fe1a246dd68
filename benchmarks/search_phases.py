"""Where one `parsat.optimize` call's CPU goes, phase by phase, without a profiler's distortion.

    .venv/bin/python benchmarks/search_phases.py gpt-1.3b:64 [--plan FILE] [--machine a100x8] [--meshes] [--grids]

Runs `parsat.optimize(NAME, machine="h100x8", devices=N)` (or `--machine`) (what
`models_bench.py optimize NAME:N` runs) with the search's main functions
wrapped where they are looked up, and prints the CPU seconds
(`time.process_time`) spent inside each, and each saturation's mesh,
e-nodes, iterations and egglog CPU seconds. cProfile multiplies the cost
of the many small Python calls (extraction, decoding) several times over
and not egglog's, so its shares mislead; these wrappers add one call per
wrapped call. A phase called from inside another is counted in both
(`pcg_from_extraction` inside `solve`, the provenance decode inside it).
The plan JSON is always made (timed apart: the simulated figures of the
plan and its baselines are worked out when it reads them,
`ir.costs.SimulatedStep`); `--plan` also writes it, to compare plans
across trees; `--meshes` also lists each mesh search (saturation, pricing,
extraction) by part, per mesh; `--grids` each independent grid, grid scan
and stage candidate scan by part (`GRID_PARTS`), and how many of each
part's PCGs it met again, the same by content: work a memo could share.
"""

from __future__ import annotations

import argparse
import collections
import resource
import signal
import sys
import time
from typing import Callable

import parsat
import parsat.api as api
import parsat.egraph.saturate as saturate
import parsat.egraph.session as session
import parsat.cost.pipeline as pipeline
import parsat.ir.pipeline as ir_pipeline
import parsat.cost.step_report as step_report
import parsat.search.baselines as baselines
import parsat.search.mesh as mesh
import parsat.search.optimize as optimize
import parsat.search.solve as solve
import parsat.search.step as step

CPU: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()
SATURATIONS: list[tuple] = []
# each mesh search's CPU seconds by part, in call order: [mesh, {label: seconds}]; a search inside another (none
# today) is counted in the outer one's
MESH_SEARCHES: list[tuple[str, collections.Counter]] = []
CURRENT: list[collections.Counter] = []   # the innermost mesh search running, if any
# the parts of one mesh's search (`mesh.search_mesh`) that `--meshes` lists per mesh, in the order they run
MESH_PARTS = ("load it and the graph into egglog", "egglog: saturate", "read the e-graph back",
              "read the rules' matches back", "take an e-graph saturated at other sizes", "price every e-node",
              "extract: joint plan and every policy", "extract: Megatron and the restricted grid")
PHASES = [(saturate, "compile_mesh_rules", "compile the rule program"),
          (saturate, "Session", "load it and the graph into egglog"),
          (saturate, "run_generations", "egglog: saturate"),
          (session.Session, "snapshot", "read the e-graph back"),
          (session.Session, "match_rows", "read the rules' matches back"),
          (mesh, "_resized", "take an e-graph saturated at other sizes"),
          (session.Provenance, "_load", "decode provenance rows"),
          (mesh, "node_costs", "price every e-node"),
          (mesh, "solve", "extract: joint plan and Megatron"),
          (baselines, "solve", "extract: restricted grid, sequential"),
          (solve, "pcg_from_extraction", "PCG of an extraction (with its rules)"),
          (step, "independent_points", "independent grid"),
          (step, "a_grid_point_fits", "a grid point fits? (scanned, not simulated)"),
          (mesh, "_extract_joint", "extract: joint plan and every policy"),
          (mesh, "_restricted_baselines", "extract: Megatron and the restricted grid"),
          (mesh, "simulated_step", "simulate candidates' steps"),
          (step_report, "simulate_step", "the kept steps' figures (simulated again)"),
          (step, "plan_rules", "rules_used of a step's plan"),
          (step, "stop_where_cannot_win", "a stage step's floor check (CannotWin)"),
          (step, "built_once", "data and expert parallelism built"),
          (step, "_unplaceable", "candidates' placement checked"),
          (step, "compare_baselines", "the step's baselines (all of them)"),
          (api, "proved_rules", "proved rules (verdict cache)"),
          (optimize, "search_pipelines", "pipeline search (all of it)"),
          (pipeline.StageFit, "peak_bytes", "stage candidates' memory (StageFit)"),
          (pipeline.StagePricer, "pipelined", "cut and price a stage plan per schedule"),
          (pipeline.StagePricer, "price", "price one cut (simulated schedule)"),
          (pipeline, "tp_overlap", "a stage plan's tensor-parallel overlap (simulated)"),
          (pipeline.StagePricer, "_work_out_schedule_floors", "a stage plan's schedule floors"),
          (pipeline.StageFit, "fastest_s", "rank a stage candidate (StageFit.fastest_s)"),
          (ir_pipeline.LayerMap, "lay_out", "lay out one cut's chunks (LayerMap)")]


# `--grids`: each independent grid (`step.independent_points`, with its scan `_unfitting_grid` inside), grid scan
# (`a_grid_point_fits`) and stage step's candidate scan (`stop_where_cannot_win`, whose grid families are built by
# `_stage_candidates`), by part, in call order; each part's PCG (how it is found in the call's arguments or result)
GRID_CALLS = [(step, "independent_points", "independent grid"), (step, "a_grid_point_fits", "grid scan"),
              (step, "stop_where_cannot_win", "stage candidate scan")]
GRID_PARTS = [(baselines, "megatron_pcg", "lay out", lambda args, found: found),
              (baselines._GridPricer, "priced", "price a point (its forms, fit judged)",
               lambda args, found: (args[1], args[3])),
              (step, "_stage_layout_floor", "a stage layout's floor", lambda args, found: args[1]),
              (mesh.PipelinedSteps, "timed", "price a stage point pipelined", lambda args, found: args[1].pcg),
              (mesh.CandidateSteps, "refusal", "refuse by peak floor", lambda args, found: args[1].pcg)]
GRIDS: list[tuple[str, collections.Counter]] = []   # (the call, its parts' CPU s and calls), in call order
GRID_NOW: list[collections.Counter] = []            # the innermost grid call running, if any
MET: dict[str, collections.Counter] = {}            # part -> how many times each content hash was met


def wrap_grids() -> None:
    """`--grids`: the grid calls (`GRID_CALLS`) and their parts (`GRID_PARTS`) wrapped where they are looked up."""
    for owner, name, label in GRID_CALLS:
        inner = getattr(owner, name)

        def logged(step_context, *args, _inner=inner, _label=label, **kwargs):
            fit = step_context.stage
            where = (f"{_label}: {step_context.graph.microbatches} micro-batches, {step_context.devices} devices"
                     + (f", pp {fit.degree}" if fit is not None else ""))
            parts: collections.Counter = collections.Counter()
            GRIDS.append((where, parts))
            GRID_NOW.append(parts)
            start = time.process_time()
            try:
                return _inner(step_context, *args, **kwargs)
            finally:
                GRID_NOW.pop()
                parts["whole"] += time.process_time() - start
        setattr(owner, name, logged)
    for owner, name, label, pcg_of in GRID_PARTS:
        inner = getattr(owner, name)
        MET[label] = collections.Counter()

        def counted(*args, _inner=inner, _label=label, _pcg_of=pcg_of, **kwargs):
            start = time.process_time()
            found = _inner(*args, **kwargs)
            if GRID_NOW:
                GRID_NOW[-1][_label] += time.process_time() - start
                GRID_NOW[-1][f"{_label} calls"] += 1
            MET[_label][hash(_pcg_of(args, found))] += 1
            return found
        setattr(owner, name, counted)


def report_grids() -> None:
    """Each grid call's CPU seconds, whole and by part, and each part's PCGs met more than once (`--grids`)."""
    for where, parts in GRIDS:
        split = ", ".join(f"{label} {parts[label]:.2f} ({parts[label + ' calls']})"
                          for _o, _n, label, _p in GRID_PARTS if parts[label + " calls"])
        print(f"grid: {where:58s} {parts['whole']:6.2f} CPU s ({split})")
    for label, met in MET.items():
        print(f"grid part {label!r}: {sum(met.values())} calls, {len(met)} distinct by content, "
              f"{sum(n - 1 for n in met.values())} met again")


def wrap(owner, name: str, label: str) -> None:
    """`owner.name` counting its CPU seconds under `label` (the outermost call only, when it recurses)."""
    inner: Callable = getattr(owner, name)
    depth = [0]

    def counted(*args, **kwargs):
        start = time.process_time()
        depth[0] += 1
        try:
            return inner(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                CPU[label] += time.process_time() - start
                if CURRENT and label in MESH_PARTS:
                    CURRENT[-1][label] += time.process_time() - start
            CALLS[label] += 1
    setattr(owner, name, counted)


def wrap_mesh_searches() -> None:
    """Each mesh search's CPU seconds (`search_mesh` as the step calls it, whole) and its `MESH_PARTS`, per mesh
    in call order: where a two-axis stage mesh's search goes (saturation against extraction) without a
    profiler's distortion (cProfile inflates extraction's many small calls several times over and not egglog's)."""
    inner = step.search_mesh   # what the step calls (imported by name there)

    def logged(step_context, on, *args, **kwargs):
        parts: collections.Counter = collections.Counter()
        MESH_SEARCHES.append((str(on) or "1 device", parts))
        CURRENT.append(parts)
        start = time.process_time()
        try:
            return inner(step_context, on, *args, **kwargs)
        finally:
            CURRENT.pop()
            parts["the whole search"] += time.process_time() - start
    step.search_mesh = logged


def wrap_saturations() -> None:
    """Each saturation's mesh, e-nodes, iterations and egglog CPU seconds, in call order."""
    inner = saturate.run_generations

    def logged(sess, *args, **kwargs):
        start = time.process_time()
        done = inner(sess, *args, **kwargs)
        SATURATIONS.append((str(sess.mesh) or "1 device", sess.size(), done.iterations, done.stop,
                            time.process_time() - start))
        return done
    saturate.run_generations = logged


def report() -> None:
    """The phases' CPU seconds so far."""
    for label, seconds in CPU.most_common():
        print(f"{label:42s} {seconds:7.2f} CPU s  {CALLS[label]:6d} calls")
    for where, enodes, iterations, stop, seconds in SATURATIONS:
        print(f"saturation: mesh {where:20s} {enodes:7,} e-nodes {iterations:3d} iterations {stop:10s} "
              f"{seconds:6.2f} CPU s")


def report_meshes() -> None:
    """Each mesh search's CPU seconds, whole and by part (`--meshes`)."""
    for where, parts in MESH_SEARCHES:
        split = ", ".join(f"{label} {parts[label]:.2f}" for label in MESH_PARTS if parts[label])
        print(f"mesh search: {where:20s} {parts['the whole search']:6.2f} CPU s ({split})")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", help="NAME:DEVICES, as models_bench.py names it")
    parser.add_argument("--plan", default=None, help="also write the plan JSON here")
    parser.add_argument("--machine", default="h100x8", help="the machine, as `parsat optimize --machine` names it")
    parser.add_argument("--meshes", action="store_true", help="also each mesh search's CPU seconds by part")
    parser.add_argument("--grids", action="store_true",
                        help="also each independent grid and stage candidate scan's CPU seconds by part")
    args = parser.parse_args(argv)
    wrap_saturations()   # first: the phase wrapper around it then counts it whole
    if args.meshes:
        wrap_mesh_searches()
    if args.grids:
        wrap_grids()
    for owner, name, label in PHASES:
        if hasattr(owner, name):
            wrap(owner, name, label)
    name, devices = args.case.split(":")
    # `kill -USR1 PID`: the phases so far, for a run too long to wait for on a loaded box
    signal.signal(signal.SIGUSR1, lambda _s, _f: (print(f"--- at {time.process_time():.1f} CPU s"), report(),
                                                  sys.stdout.flush()))
    start = time.process_time()
    plan = parsat.optimize(name, machine=args.machine, devices=int(devices))
    total = time.process_time() - start
    text = plan.to_json()   # what `parsat optimize` writes: the kept steps' figures are worked out here
    written = time.process_time() - start - total
    report()
    if args.meshes:
        report_meshes()
    if args.grids:
        report_grids()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"total {total:.1f} CPU s (the optimize call), {written:.1f} CPU s its plan JSON, peak RSS {peak:.0f} "
          f"MiB, step {plan.totals.time_s * 1e3:.3f} ms (predicted by the cost model)")
    if args.plan:
        with open(args.plan, "w", encoding="utf-8") as out:
            out.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
