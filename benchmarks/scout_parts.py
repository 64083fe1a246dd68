"""Where the unstaged scouts of one `parsat.optimize` call spend their CPU, and what each grid point they scan costs.

    PYTHONPATH=. .venv/bin/python benchmarks/scout_parts.py llama-70b:64 [--machine h100x8] [--points]
        [--form-floors] [--sequential]

Runs `parsat.optimize(NAME, machine=..., devices=N)` (what `models_bench.py optimize NAME:N` runs) only as far as
its unstaged search (`microbatches.search_unstaged`: the scouts of each micro-batch count, and where one is
chosen the search of every mesh at it), then stops. Prints each step's CPU seconds (`step._search_step`), the
phases of `search_phases.py` inside them (its wrappers: one call each, no profiler), each mesh search and grid
call by part, and (`--points`) for every point of each scout's grid scan (`step._unfitting_grid`: a scout
whose joint plans do not fit), its configuration, per-node bound, whether that bound fits, its peak floor where
the scan asks for one (`CandidateSteps.refusal`), and the CPU seconds of laying out and pricing its family and of
its floor. The scan's points are worked out there a second time, by the same functions, from caches the first
filled: the per-point seconds are those of a warm scan (the scan's own are in `grid:`), and the steps' and the
total's CPU seconds then include that second pass (`listing`, printed: subtract it).

`--form-floors`: before each scan, every grid layout laid out and the peak floor of every form its point could end
as (ZeRO as laid out or 1, keeping or recomputing blocks: `baselines._fitting_point` and its ZeRO-1 twin), timed,
then the scan itself timed: what a scan that settled "no point may fit" by floors before pricing would cost against
the scan (the steps' CPU seconds then include it). `--sequential`: the sequential baseline's progress lines (why it
is none) and the weights' state of the graph it searches, against the whole model's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import search_phases as phases   # noqa: E402  (the wrappers, installed below)

import parsat   # noqa: E402
import parsat.search.optimize as optimize   # noqa: E402
import parsat.search.step as step   # noqa: E402
import math   # noqa: E402

import parsat.search.baselines as baselines   # noqa: E402
from parsat.cost.model import weight_bytes   # noqa: E402
from parsat.ir.megatron import megatron_pcg   # noqa: E402
from parsat.ir.pcg import restated   # noqa: E402
from parsat.ir.recompute import BLOCKS   # noqa: E402
from parsat.ir.units import fmt_bytes   # noqa: E402
from parsat.search.repeat import repetition_for   # noqa: E402

POINTS: list[str] = []
LISTING = [0.0]   # CPU seconds spent listing the scans' points again (`--points`)


class _Stop(Exception):
    """Raised once the unstaged search returns or raises: the pipeline search is not this script's."""


def wrap_steps() -> None:
    """Each step's CPU seconds and outcome, in call order."""
    inner = step._search_step

    def timed(context, clock, choices, left_out=()):
        start, outcome = time.process_time(), "plan"
        try:
            return inner(context, clock, choices, left_out)
        except Exception as err:
            outcome = type(err).__name__
            raise
        finally:
            print(f"step: {context.graph.microbatches} micro-batch(es), scout {context.scout}, meshes "
                  f"{', '.join(str(c.mesh) for c in choices)}: {time.process_time() - start:.2f} CPU s ({outcome})")
    step._search_step = timed


def wrap_scan() -> None:
    """Every point of each grid scan, worked out again after the scan (see the module docstring)."""
    inner = step._unfitting_grid

    def listed(context, steps):
        found = inner(context, steps)
        began = time.process_time()
        try:
            return _list_points(context, steps, found)
        finally:
            LISTING[0] += time.process_time() - began
    step._unfitting_grid = listed


def _list_points(context, steps, found):
    """`found` (the scan's answer), each point of the scan worked out again and listed in `POINTS`."""
    families = step._grid_families(context, lean_first=True)
    while True:
        start = time.process_time()
        family = next(families, None)
        built = time.process_time() - start
        if family is None:
            return found
        for _place, point in family:
            fits = context.memory.fits(point)
            start = time.process_time()
            floor = steps.peak_floor(point.pcg) if fits else None
            POINTS.append(f"point: m {context.graph.microbatches} {point.config} bound "
                          f"{fmt_bytes(point.totals.peak_memory_bytes)} fits {fits} floor "
                          f"{fmt_bytes(floor) if floor is not None else '-'}; lay out and price "
                          f"{built:.2f}, floor {time.process_time() - start:.2f} CPU s")


def wrap_form_floors() -> None:
    """`--form-floors` (see the module docstring)."""
    inner = step._unfitting_grid

    def floored(context, steps):
        request, graph, machine = context.request, context.graph, context.machine
        shared: dict = {}
        start = time.process_time()
        pcgs = [(layout, megatron_pcg(graph, request.library, (layout.dp, layout.tp), machine.devices_per_node,
                                      zero=zero, sequence=layout.sequence, cache=shared, kin=request.layouts,
                                      vocabulary_loss=True, heads_ordered=True))
                for layout in baselines._grid_layouts(context.devices, machine.devices_per_node)
                for zero in layout.zeros]
        laid = time.process_time()
        floors = [steps.peak_floor(restated(pcg, zero, recompute)) for layout, pcg in pcgs if pcg is not None
                  for zero in {pcg.zero} | ({1} if pcg.zero == 0 and layout.dp > 1 else set())
                  for recompute in {pcg.recompute, BLOCKS}]
        floored_at = time.process_time()
        found = inner(context, steps)
        under = sum(f is None or f <= machine.memory_capacity for f in floors)
        scanned = time.process_time() - floored_at
        print(f"form floors: {graph.microbatches} micro-batch(es): lay out {laid - start:.2f}, {len(floors)} floors "
              f"{floored_at - laid:.2f} ({under} not over the device), then the scan {scanned:.2f} CPU s")
        return found
    step._unfitting_grid = floored


def sequential_said(line: str) -> None:
    """`--sequential`: the sequential baseline's progress lines."""
    if "sequential baseline" in line:
        print(line)


def report_weights(request) -> None:
    """`--sequential`: the weights' state on one device of the graph the sequential baseline searches (the
    searched blocks where blocks repeat) and of the whole model."""
    def state(graph) -> str:
        return fmt_bytes(sum(math.prod(w.shape) for w in graph.weights) * weight_bytes(request.machine))
    repetition = repetition_for(request.whole) if request.repeat_blocks else None
    searched = repetition.searched if repetition else request.whole
    print(f"weights' state on one device: the searched graph's {state(searched)}, the whole model's "
          f"{state(request.whole)}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", help="NAME:DEVICES, as models_bench.py names it")
    parser.add_argument("--machine", default="h100x8")
    parser.add_argument("--points", action="store_true", help="also every point of each scout's grid scan")
    parser.add_argument("--form-floors", action="store_true", help="also every grid form's peak floor, timed")
    parser.add_argument("--sequential", action="store_true", help="also why the sequential baseline is none")
    args = parser.parse_args(argv)
    phases.wrap_saturations()
    phases.wrap_mesh_searches()
    phases.wrap_grids()
    for owner, name, label in phases.PHASES:
        if hasattr(owner, name):
            phases.wrap(owner, name, label)
    wrap_steps()
    if args.points:
        wrap_scan()
    if args.form_floors:
        wrap_form_floors()
    unstaged = optimize.search_unstaged

    def stopped(request, *a, **k):
        if args.sequential:
            report_weights(request)
        try:
            return unstaged(request, *a, **k)
        finally:
            raise _Stop
    optimize.search_unstaged = stopped
    name, devices = args.case.split(":")
    start = time.process_time()
    try:
        parsat.optimize(name, machine=args.machine, devices=int(devices),
                        **({"progress": sequential_said} if args.sequential else {}))
    except _Stop:
        pass
    total = time.process_time() - start
    phases.report()
    phases.report_meshes()
    phases.report_grids()
    print("\n".join(POINTS))
    with open("/proc/loadavg", encoding="utf-8") as load:
        print(f"total {total:.2f} CPU s to the end of the unstaged search ({LISTING[0]:.2f} of them listing the "
              f"scans' points again); 1-minute load {load.read().split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
