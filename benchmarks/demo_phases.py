"""Where a `parsat run` step's time goes, phase by phase, beside the cost model's simulated phases.

Runs a plan's rank program on `--nproc` spawned ranks (as `parsat run` starts them) and times each phase of
`executor.run_rank`'s step with `time.perf_counter` on every rank: forward (collectives included), loss,
backward, optimizer, and the step's memory bookkeeping (`TensorMemory`). Prints each phase's median over the
steps after `--warmup`, the slowest rank's, beside the simulator's phases of the same plan on the plan's machine
(`parsat explain` prints the same simulated phases). A measurement, not a test: the box's load moves it.

Every rank also stamps, on the machine's monotonic clock (one clock for all its processes), when it leaves the
step's starting barrier and when it enters and leaves each collective of the step, so that the collectives' time
splits into the wait for the last rank to arrive and the collective itself once all are in it, and the ranks'
start is seen apart (a rank whose wake-up from the barrier waits behind its peer's compute starts late).

    PYTHONPATH=. .venv/bin/python benchmarks/demo_phases.py out/mlp-plan.json --machine out/machine-$(hostname).json
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch.distributed as dist

from parsat.backend.cli import load_plan
from parsat.backend.executor import (RankProgram, TensorMemory, _make_optimizer, operator_library)
from parsat.backend.collectives import CommCounter
from parsat.backend.launch import LaunchConfig, RankContext, launch
from parsat.backend.training_data import TrainConfig
from parsat.cost.pcg_tasks import PARSAT_RUN, simulate_pcg
from parsat.cost.step_report import summarize
from parsat.ir.machine import Machine
from parsat.ir.microbatch import step_batch

PHASES = ("forward", "loss", "backward", "optimizer", "bookkeeping", "step")
STAMPED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all_single")


@contextmanager
def stamping(calls: list):
    """Inside: each of torch.distributed's `STAMPED` collectives appends (its name, arrival, return) to `calls`."""
    originals = {name: getattr(dist, name) for name in STAMPED}

    def stamped(name, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            calls.append((name, start, time.perf_counter()))
            return out
        return call

    for name, fn in originals.items():
        setattr(dist, name, stamped(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def rank_setup(ctx: RankContext, path: str, steps: int):
    """(the rank's program, its optimizer, a memory count, the step's batch) for the plan at `path`, as
    `executor.run_rank` makes them."""
    pcg, graph, _ = load_plan(path, ctx.world)
    library = operator_library()
    config = TrainConfig(steps=steps)
    program = RankProgram(pcg, ctx, config, library)
    optimizer = _make_optimizer(program.state.optimized(program.params), config)
    return program, optimizer, TensorMemory(), step_batch(graph, library)


def _rank(ctx: RankContext, path: str, steps: int, bookkeeping: bool, cpu: bool = False) -> dict:
    program, optimizer, memory, batch = rank_setup(ctx, path, steps)
    times = {p: [] for p in PHASES}
    starts, calls = [], []
    for step in range(steps):
        counter = CommCounter()
        data = program.step_data(batch, step).loaded()
        start = ctx.step_start()
        starts.append(start)
        calls.append([])
        with stamping(calls[-1]):
            _step(program, optimizer, memory, counter, data, step, bookkeeping, times,
                  time.thread_time() if cpu else start, time.thread_time if cpu else time.perf_counter)
    return {"rank": ctx.rank, "times": times, "starts": starts, "calls": calls}


def _step(program, optimizer, memory, counter, data, step: int, bookkeeping: bool, times: dict,
          start: float, clock=time.perf_counter) -> None:
    """One timed step, as `executor.run_rank` runs it, its phases' seconds on `clock` appended to `times`."""
    env: dict = {}
    t0 = clock()
    with memory.saving():
        program.forward(step, counter, data.inputs(0), None, env=env)
        t1 = clock()
        to_diff, _ = program.loss(env, data.targets(0))
    t2 = clock()
    if bookkeeping:
        memory.measure(env, program, optimizer, None)
    t3 = clock()
    optimizer.zero_grad()
    to_diff.backward()
    t4 = clock()
    if bookkeeping:
        memory.measure(env, program, optimizer, None)
    t5 = clock()
    program.state.reduce(counter)
    optimizer.step()
    program.state.gather(counter)
    t6 = clock()
    for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t4 - t3, t6 - t5, (t3 - t2) + (t5 - t4), t6 - start)):
        times[phase].append(seconds)


def _skew(results: list[dict], warmup: int) -> tuple[float, float, float, int, float]:
    """Means over the steps after `warmup`, in ms: how late a rank leaves the starting barrier after the first
    (over ranks), a collective's wait for the last rank to arrive and its time once all arrived (over ranks and
    collectives); the collectives a step runs; the median time once all arrived."""
    late, wait, inside = [], [], []
    for step in range(warmup, len(results[0]["starts"])):
        first = min(r["starts"][step] for r in results)
        late += [(r["starts"][step] - first) * 1e3 for r in results]
        for stamps in zip(*(r["calls"][step] for r in results)):
            last = max(a for _n, a, _b in stamps)
            wait += [(last - a) * 1e3 for _n, a, _b in stamps]
            inside += [(b - last) * 1e3 for _n, _a, b in stamps]
    return (statistics.fmean(late), statistics.fmean(wait) if wait else 0.0,
            statistics.fmean(inside) if inside else 0.0, len(results[0]["calls"][-1]),
            statistics.median(inside) if inside else 0.0)


def plan_arguments(description: str, steps: int, warmup: int) -> argparse.ArgumentParser:
    """The arguments of a script that runs a plan's steps on spawned ranks and sets them beside its prices."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("plan")
    parser.add_argument("--machine", required=True, help="the machine JSON the plan was priced on")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup, help="steps left out of the medians")
    return parser


def main() -> None:
    parser = plan_arguments(__doc__.splitlines()[0], steps=40, warmup=2)
    parser.add_argument("--no-bookkeeping", action="store_true", help="skip TensorMemory's measurements")
    parser.add_argument("--cpu", action="store_true", help="time each phase on the rank's main thread's CPU time "
                        "(what the work cost, whatever else ran; a collective's wait is left out)")
    args = parser.parse_args()
    results = launch(_rank, (args.plan, args.steps, not args.no_bookkeeping, args.cpu),
                     LaunchConfig(nproc=args.nproc, timeout_s=600))
    pcg, graph, _ = load_plan(args.plan, args.nproc)
    machine = Machine.load(args.machine)
    streams, timeline = summarize(simulate_pcg(pcg, operator_library(), machine, PARSAT_RUN), PARSAT_RUN.name)
    simulated = {p.phase: p for p in timeline.phases}
    print(f"{'phase':12s} " + " ".join(f"rank {r['rank']:>2d} ms" for r in results) + "   simulated ms")
    for phase in PHASES:
        medians = [statistics.median(r["times"][phase][args.warmup:]) * 1e3 for r in results]
        sim = simulated.get(phase)
        shown = f"{(sim.end_s - sim.start_s) * 1e3:8.3f}" if sim is not None else "       -"
        print(f"{phase:12s} " + " ".join(f"{m:10.3f}" for m in medians) + f"   {shown}")
    print(f"simulated step {streams.time_s * 1e3:.3f} ms")
    late, wait, inside, count, inside_median = _skew(results, args.warmup)
    print(f"shared clock (means, ms): a rank leaves the step's barrier {late:.3f} after the first; {count} "
          f"collective(s) a step, each waiting {wait:.3f} for the last rank, then {inside:.3f} with all in "
          f"(median {inside_median:.3f})")


if __name__ == "__main__":
    main()
