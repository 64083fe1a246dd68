"""The demo's forward, op by op: each node's priced time beside its measured CPU time as `parsat run`'s step runs it.

Issue 31 (benchmarks/demo_step.md, session 65): `make demo`'s forward with its loss is priced 1.7 ms where the rank
spent 2.2-2.6 ms of CPU on it. This says which rows: on `--nproc` spawned ranks (as `parsat run` starts them) it
runs the plan's steps as `executor.run_rank` does (`demo_phases._step`, its phases on the same clock) and times, on the rank's main thread's CPU
clock (`time.thread_time`: the work, whatever else ran; a collective's wait is not CPU), every call of
`RankProgram._compute` (one node: an operator or a parallel operator, its collective included) and the loss; the
forward's CPU less its nodes' is the interpreter's own (the loop over the plan, leaves and parameters looked up).
Beside each row, the simulator's task of that node (`simulate_pcg` on the plan's machine, the span named
`label #id`): what `parsat.cost.op_time` and the collectives' table price it at. Medians over the steps after
`--warmup`, the slowest rank's. A measurement, not a test: the box's load moves it.

    PYTHONPATH=. .venv/bin/python benchmarks/demo_forward_ops.py out/mlp-plan.json --machine out/machine-$(hostname).json
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

from parsat.backend.cli import load_plan
from parsat.backend.executor import operator_library
from parsat.backend.collectives import CommCounter
from parsat.backend.launch import LaunchConfig, RankContext, launch
from parsat.cost.pcg_tasks import PARSAT_RUN, simulate_pcg
from parsat.ir.machine import Machine

from benchmarks.demo_phases import _step, plan_arguments, rank_setup

FORWARD, LOSS, INTERPRETER = "forward", "loss", "interpreter"   # `demo_phases.PHASES`' first two, and the rest


def _rank(ctx: RankContext, path: str, steps: int) -> dict:
    program, optimizer, memory, batch = rank_setup(ctx, path, steps)
    per_node: dict[int, list[float]] = defaultdict(list)
    phases: dict[str, list[float]] = defaultdict(list)
    compute = program._compute
    clock = time.thread_time

    def timed(node, env, counter):
        start = clock()
        out = compute(node, env, counter)
        spent[node.id] = spent.get(node.id, 0.0) + clock() - start
        return out

    program._compute = timed   # this rank's program only: every node `forward` computes passes here
    for step in range(steps):
        counter = CommCounter()
        data = program.step_data(batch, step).loaded()
        ctx.step_start()
        spent: dict[int, float] = {}
        _step(program, optimizer, memory, counter, data, step, True, phases, clock(), clock)
        for ident, seconds in spent.items():
            per_node[ident].append(seconds)
        phases[INTERPRETER].append(phases[FORWARD][-1] - sum(spent.values()))
    return {"rank": ctx.rank, "nodes": dict(per_node), "phases": dict(phases)}


def priced_forward(path: str, nproc: int, machine: Machine) -> tuple[dict[int, tuple[str, float, float]],
                                                                       dict[str, float]]:
    """The simulated step's forward and loss tasks: node id -> (first task's name, seconds on the compute
    stream, seconds of its collective); phase -> seconds in all."""
    pcg, _graph, _ = load_plan(path, nproc)
    result = simulate_pcg(pcg, operator_library(), machine, PARSAT_RUN).result
    tasks: dict[int, tuple[str, float, float]] = {}
    totals: dict[str, float] = defaultdict(float)
    for span in result.spans:
        if span.phase not in ("forward", "forward_comm", "loss"):
            continue
        totals[span.phase] += span.end - span.start
        if span.phase == "loss":   # "loss of #8": the loss's own row
            continue
        for ident in (int(w[1:]) for w in span.name.replace("+", " ").split() if w[:1] == "#" and w[1:].isdigit()):
            name, compute, comm = tasks.get(ident, (span.name, 0.0, 0.0))
            seconds = span.end - span.start
            tasks[ident] = ((name, compute, comm + seconds) if span.phase == "forward_comm"
                            else (name, compute + seconds, comm))
    return tasks, dict(totals)


def main() -> None:
    args = plan_arguments(__doc__.splitlines()[0], steps=60, warmup=3).parse_args()
    results = launch(_rank, (args.plan, args.steps), LaunchConfig(nproc=args.nproc, timeout_s=600))
    tasks, totals = priced_forward(args.plan, args.nproc, Machine.load(args.machine))
    pcg, _graph, _ = load_plan(args.plan, args.nproc)

    def median_ms(samples: list[float]) -> float:
        return statistics.median(samples[args.warmup:]) * 1e3

    for r in results:   # the ranks' results come back through JSON: string keys
        r["nodes"] = {int(i): samples for i, samples in r["nodes"].items()}
    idents = sorted({i for r in results for i in r["nodes"]})
    print("priced: the node's compute-stream tasks (its collective's, if any, beside it); CPU: the main thread's")
    print(f"{'node':40s} {'priced ms':>10s} " + " ".join(f"r{r['rank']} CPU ms" for r in results)
          + "  CPU/priced  its collective priced ms")
    measured_sum, priced_sum = [0.0] * len(results), 0.0
    for ident in idents:
        node = pcg.node(ident)
        _name, priced, comm = tasks.get(ident, ("", 0.0, 0.0))
        cpu = [median_ms(r["nodes"][ident]) if ident in r["nodes"] else float("nan") for r in results]
        measured_sum = [m + c for m, c in zip(measured_sum, cpu)]
        priced_sum += priced * 1e3
        ratio = max(cpu) / (priced * 1e3) if priced > 0 else float("inf")
        print(f"{node.label[:33] + f' #{ident}':40s} {priced * 1e3:10.3f} " + " ".join(f"{c:9.3f}" for c in cpu)
              + f"  {ratio:9.2f}" + (f"  {comm * 1e3:10.3f}" if comm else ""))
    print(f"{'nodes, summed':40s} {priced_sum:10.3f} " + " ".join(f"{c:9.3f}" for c in measured_sum))
    for phase in (INTERPRETER, FORWARD, LOSS):
        priced = {FORWARD: totals.get("forward", 0.0), LOSS: totals.get("loss", 0.0)}.get(phase)
        shown = f"{priced * 1e3:10.3f}" if priced is not None else "         -"
        print(f"{phase + ' (phase)':40s} {shown} "
              + " ".join(f"{median_ms(r['phases'][phase]):9.3f}" for r in results))
    print(f"priced forward: its compute-stream tasks (above); its collectives {totals.get('forward_comm', 0.0) * 1e3:.3f} ms "
          "beside them, in wall time (a collective's main-thread CPU is in its node's row and in the forward's CPU)")


if __name__ == "__main__":
    main()
