"""A plan's step simulated and summed up for the plan JSON: per-stream totals, phases, a drawing of the lanes.

`optimize` ranks its final candidates (the joint plan of every mesh and
each baseline) by the simulated step (`simulate_step`), while extraction
ranks e-nodes by the per-node sum (`cost.model`): a node's cost must
not depend on the other nodes chosen, a step's overlap does. The
simulation runs the plan as `pcg_tasks.profile_for(machine)` says (a GPU
framework on GPUs, `parsat run` on a CPU box).

The report sorts every task into two lanes by what it does, whatever
stream it ran on: the communication lane holds the collectives and the
waits for slower ranks, the compute lane everything else. (Under
`parsat run` both run on the one host thread, so the lanes never overlap;
under DDP they are the two streams.) Busy times, the overlap of the lanes
and the exposed communication (the step less the compute lane's busy time)
follow, and each phase's extent and busy times (`ir.costs.STEP_PHASES`).
"""

from __future__ import annotations

from typing import Mapping

from parsat.dsl.library import Library
from parsat.ir.costs import LANE_LETTERS, STEP_PHASES, PhaseTimes, SimulatedStep, StepStreams, StepTimeline
from parsat.ir.machine import Machine
from parsat.ir.pcg import PCG
from parsat.cost.pcg_tasks import OpTimes, StepPrediction, profile_for, simulate_pcg
from parsat.cost.simulator import intersection, union

LANE_WIDTH = 64    # characters per lane in the plan JSON's drawing
COMM_PHASES = frozenset({"forward_comm", "backward_comm", "grad_sync", "stragglers"})
PHASE_OF = {"forward": "forward", "loss": "forward", "forward_comm": "forward", "backward": "backward",
            "backward_comm": "backward", "grad_sync": "grad_sync", "optimizer": "optimizer",
            "stragglers": "stragglers"}
"""The simulator's task phases (`pcg_tasks`) -> the reported phases."""


def simulate_step(pcg: PCG, library: Library, machine: Machine, microbatches: int = 1,
                  times: OpTimes | None = None) -> tuple[StepStreams, StepTimeline]:
    """One training step of `pcg` on `machine`, simulated as `profile_for(machine)` runs it, summed up.

    Raises `pcg_tasks.TaskBuildError` or `simulator.SimulationError` for a
    PCG the task builder cannot run.
    """
    profile = profile_for(machine)
    prediction = simulate_pcg(pcg, library, machine, profile, times=times, microbatches=microbatches)
    return summarize(prediction, profile.name, microbatches)


def simulated_step(pcg: PCG, library: Library, machine: Machine, microbatches: int = 1,
                   times: OpTimes | None = None) -> SimulatedStep:
    """`simulate_step`'s step time and peak memory now, its other figures when first read: what a search ranks
    candidates by, and judges whether they fit by (`ir.costs.Totals.fits`).

    The figures (`summarize`, a quarter to a half of a simulation) are read
    only for the plans a search keeps; the step is then simulated again
    (the same input gives the same tasks and times, so the same figures)
    rather than every simulated step's tasks held until then: a step of
    many micro-batches holds hundreds of thousands of them.
    """
    profile = profile_for(machine)
    prediction = simulate_pcg(pcg, library, machine, profile, times=times, microbatches=microbatches)
    return SimulatedStep(prediction.step_s, lambda: simulate_step(pcg, library, machine, microbatches, times),
                         prediction.peak_memory_bytes)


def summarize(prediction: StepPrediction, profile: str, microbatches: int = 1,
              width: int = LANE_WIDTH) -> tuple[StepStreams, StepTimeline]:
    """The per-stream totals and the timeline of a simulated step (see the module docstring)."""
    result = prediction.result
    step = result.step_s
    b, starts, ends = result._columns   # the task columns: no Span objects for a thousand-node plan
    intervals: dict[str, list[tuple[float, float]]] = {"compute": [], "comm": []}
    busy = {"compute": 0.0, "comm": 0.0}
    extent: dict[str, list[float]] = {}          # phase -> [start, end, compute busy, comm busy]
    cells = {lane: [dict() for _ in range(width)] for lane in intervals}   # lane -> per slice: phase -> seconds
    scale = width / step if step > 0 else 0.0
    # A simulated step of many micro-batches has hundreds of thousands of tasks: each phase's lane, its shown
    # phase and where they are kept are looked up once per phase, and min/max are written out as comparisons
    # that pick the same operand (every sum is made in the same order, so the figures are the same bits).
    kinds: dict[str, tuple] = {}
    phases, totals = b.phases, [0.0, 0.0]   # busy seconds: compute, comm
    for start, end, phase in zip(starts, ends, phases):
        kind = kinds.get(phase)
        if kind is None:
            comm = phase in COMM_PHASES
            lane = "comm" if comm else "compute"
            kind = kinds[phase] = (int(comm), PHASE_OF.get(phase, "forward"), 3 if comm else 2, intervals[lane],
                                   cells[lane])
        slot, shown, column, spans, lane_cells = kind
        found = extent.get(shown)
        if found is None:
            found = extent[shown] = [start, end, 0.0, 0.0]
        else:
            if start < found[0]:
                found[0] = start
            if end > found[1]:
                found[1] = end
        length = end - start
        if length <= 0:
            continue
        totals[slot] += length
        found[column] += length
        spans.append((start, end))
        first, last = int(start * scale), min(width - 1, int(end * scale))
        for c in range(first, last + 1):
            hi, lo = (c + 1) / scale, c / scale
            part = (hi if hi < end else end) - (lo if lo > start else start)
            if part > 0:
                cell = lane_cells[c]
                cell[shown] = cell.get(shown, 0.0) + part
    busy["compute"], busy["comm"] = totals
    both = intersection(union(intervals["compute"]), union(intervals["comm"]))
    overlap = sum(hi - lo for lo, hi in both)
    streams = StepStreams(step, busy["compute"], busy["comm"], max(0.0, step - busy["compute"]), overlap)
    slice_s = step / width if width else 0.0
    lanes = tuple((lane, "".join(_letter(lane, cell, slice_s) for cell in cells[lane])) for lane in cells)
    overlapped = [0.0] * width
    for lo, hi in both:
        for c in range(int(lo * scale), min(width - 1, int(hi * scale)) + 1):
            overlapped[c] += max(0.0, min(hi, (c + 1) / scale) - max(lo, c / scale))
    lanes += (("overlap", "".join("^" if o >= 0.25 * slice_s and o > 0 else " " for o in overlapped)),)
    phases = tuple(PhaseTimes(p, *extent[p]) for p in STEP_PHASES if p in extent)
    timeline = StepTimeline(profile, microbatches, prediction.peak_memory_bytes, phases, lanes)
    return streams, timeline


def phase_ends(prediction: StepPrediction) -> dict[str, float]:
    """Reported phase (`PHASE_OF`) -> when its last task ends: `summarize`'s timeline's `PhaseTimes.end_s` of each
    phase, without its lanes, busy sums and overlap (most of its work). What `cost.pipeline.tp_overlap` reads of a
    simulated micro-batch, twice per stage plan priced: the same tasks' ends, each phase's the largest of them,
    so the same figures (a maximum picks one of its operands, in any order)."""
    return ends_by_phase(stream_phase_ends(prediction))


def ends_by_phase(stream_ends: Mapping[tuple[str, str], float]) -> dict[str, float]:
    """Reported phase -> its end, the largest of its streams' (`stream_phase_ends`): `phase_ends` of the run those
    were read from (`cost.pipeline.tp_overlap` folds its excerpts' per-stream ends so)."""
    out: dict[str, float] = {}
    for (shown, _stream), end in stream_ends.items():
        found = out.get(shown)
        if found is None or end > found:
            out[shown] = end
    return out


def stream_phase_ends(prediction: StepPrediction) -> dict[tuple[str, str], float]:
    """(Reported phase, stream's label) -> when that stream's last task of that phase ends: `phase_ends` per
    stream (whose largest per phase it is). `cost.pipeline.tp_overlap` reads them to tell whether a few blocks'
    excerpts of a stage plan are past their first blocks' transient on every stream, not only the last one."""
    b, _starts, ends = prediction.result._columns
    latest: dict[tuple[str, int], float] = {}   # (the simulator's phase, stream) -> its tasks' latest end
    for end, phase, stream in zip(ends, b.phases, b.stream_of):
        key = (phase, stream)
        found = latest.get(key)
        if found is None or end > found:
            latest[key] = end
    out: dict[tuple[str, str], float] = {}
    for (phase, stream), end in latest.items():
        key = (PHASE_OF.get(phase, "forward"), b.streams[stream].label())
        found = out.get(key)
        if found is None or end > found:
            out[key] = end
    return out


def _letter(lane: str, cell: dict[str, float], slice_s: float) -> str:
    """The phase that kept the lane busiest in one slice; a space where it was busy under a quarter of it."""
    if not cell or sum(cell.values()) < 0.25 * slice_s:
        return " "
    return LANE_LETTERS[(lane, max(cell, key=cell.get))]


__all__ = ["COMM_PHASES", "LANE_WIDTH", "ends_by_phase", "phase_ends", "simulate_step", "simulated_step", "stream_phase_ends",
           "summarize"]
