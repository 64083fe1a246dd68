"""What a tighter floor of a simulated step could save the independent grid, measured before building one.

    PYTHONPATH=TREE .venv/bin/python benchmarks/grid_floor_ceiling.py bert-large:64

Runs `parsat.optimize(NAME, machine="h100x8", devices=N)` with `process_time` wrappers and prints:

* every simulation's CPU seconds, and of them the event loop's (`StepBuilder.simulate`): the rest is building
  the tasks (`pcg_tasks.simulate_pcg` before its last line). A floor read from the task list can save at most
  the event loop of a point it prunes, since the point's tasks must be built to read it;
* per `step.independent_points` call, its grid points' simulations and the CPU seconds of those slower than the
  grid's fastest: what a floor equal to the simulated step (the best any floor can do) would leave out, visited
  fastest first;
* per grid point (its floors worked out after the call's figures): the simulated step, the busiest stream's busy seconds (a floor of the step: each stream runs
  its tasks one at a time), the point's step floor (`CandidateSteps.floor`, compute only) and its layout's
  (`plan=False`), its tp (sp: sequence parallelism), ZeRO stage and
  recomputation.

Why measured and not built: where building is most of a simulation and the busiest stream is the compute stream
the floor already sums, a task-list floor cannot pay (benchmarks/search_results.md, 2026-12-03 07:00).
"""

from __future__ import annotations

import sys
import time

import parsat
import parsat.cost.step_report as step_report
import parsat.search.mesh as mesh
import parsat.search.step as step
from parsat.cost.simulator import StepBuilder


class Meter:
    """The wrappers' figures for one optimize call: CPU seconds of simulations and their event loops, each
    independent grid call's simulated points, and the busiest stream of the last simulated step."""

    def __init__(self) -> None:
        self.simulations = self.loops = 0.0
        self.count = 0
        self.last_busy: tuple[float, str] = (0.0, "")
        self.grids: list[tuple[int, float, list[tuple]]] = []
        self.open: list | None = None

    def install(self) -> None:
        """Wrap the simulator's event loop, the simulation, the grid's call and a candidate's simulation."""
        loop, simulate, points, call = (StepBuilder.simulate, step_report.simulate_pcg, step.independent_points,
                                        mesh.CandidateSteps.__call__)
        meter = self

        def timed_loop(builder, *args, **kwargs):
            start = time.process_time()
            result = loop(builder, *args, **kwargs)
            meter.loops += time.process_time() - start
            meter.last_busy = max((seconds, label) for label, seconds in result.busy_s.items())
            return result

        def timed_simulation(*args, **kwargs):
            start = time.process_time()
            try:
                return simulate(*args, **kwargs)
            finally:
                meter.simulations += time.process_time() - start
                meter.count += 1

        def grid(context, steps):
            outer, meter.open = meter.open, []
            start = time.process_time()
            try:
                return points(context, steps)
            finally:
                meter.grids.append((context.graph.microbatches, time.process_time() - start, meter.open))
                meter.open = outer

        def candidate(steps, found):
            start = time.process_time()
            result = call(steps, found)
            if meter.open is not None and result is not None and result.totals.simulation is not None \
                    and found.totals.simulation is None:
                config = found.config or {}
                meter.open.append((time.process_time() - start, result.totals.time_s, *meter.last_busy, steps,
                                   found.pcg, config.get("tp"), config.get("sp"), config.get("zero"), found.pcg.recompute))
            return result

        StepBuilder.simulate, step_report.simulate_pcg = timed_loop, timed_simulation
        step.independent_points, mesh.CandidateSteps.__call__ = grid, candidate


def report(meter: Meter, total: float) -> None:
    """The figures, as the module docstring lists them."""
    print(f"optimize {total:.2f} CPU s; {meter.count} simulations {meter.simulations:.2f} CPU s, of them the event "
          f"loop {meter.loops:.2f} ({meter.loops / max(meter.simulations, 1e-9):.0%})")
    simulated = slower = 0.0
    for microbatches, seconds, rows in meter.grids:
        fastest = min((row[1] for row in rows), default=None)
        cpu = sum(row[0] for row in rows)
        beaten = sum(row[0] for row in rows if row[1] > fastest) if rows else 0.0
        simulated, slower = simulated + cpu, slower + beaten
        print(f"grid at {microbatches} micro-batches: {seconds:.2f} CPU s, {len(rows)} simulated ({cpu:.2f} CPU s), "
              f"slower than its fastest {beaten:.2f} CPU s")
        for cpu, step_s, busy, stream, steps, pcg, tp, sp, zero, recompute in rows:   # floors after the call's figures
            print(f"    {cpu:.3f} CPU s: step {step_s:.4f} s, busiest stream {busy:.4f} ({stream}), floor {steps.floor(pcg):.4f}, "
                  f"layout floor {steps.floor(pcg, plan=False):.4f}, tp {tp}{' sp' if sp else ''} zero {zero} "
                  f"{recompute}")
    print(f"grid simulations {simulated:.2f} CPU s; of them slower than their grid's fastest (what a floor equal "
          f"to the step would leave out) {slower:.2f}")


def main(argv: list[str]) -> int:
    name, devices = argv[0].split(":")
    meter = Meter()
    meter.install()
    start = time.process_time()
    parsat.optimize(name, machine="h100x8", devices=int(devices))
    report(meter, time.process_time() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
