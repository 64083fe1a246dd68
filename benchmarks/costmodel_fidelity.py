"""Does the cost model predict what runs? Predicted vs measured step time and peak memory, plan by plan.

    .venv/bin/python benchmarks/costmodel_fidelity.py [--nproc 2 4] [--rounds 2] [--steps 12] [--json out.json]
        [--runtime interpreter|torch]

`--runtime torch`: the plans run through `parsat.parallelize(...,
runtime="torch")` instead of the interpreter (benchmarks/
costmodel_fidelity_torch.py: Hugging Face models under Megatron-layout
plans, predicted with the simulator's profile of that runtime).

For each rank count: `parsat calibrate` on this box (the same ranks, the
same dtype as `parsat run`), then `parsat optimize` of each graph with the
calibrated machine file (plans are the optimizer's own and its baselines',
read back as `parsat run --plan-of` reads them, identical PCGs once), then
every plan trained on gloo ranks (all plans of one rank count in one
process group, as benchmarks/backend_run.py does) and predicted by
`PREDICTORS[--predictor]`: a function (pcg, library, machine, the plan
file's totals) -> (step seconds, peak bytes). The box is shared with
other jobs and its load drifts within a minute, so runs and calibrations
alternate for `--rounds` rounds: each run is predicted with the machine
calibrated just before it and the one calibrated just after it (the
geometric mean of the two predictions), and each plan's figure is the
median over rounds (each row also records the mean step, `measured_mean_s`:
a gloo collective on a shared box is bimodal, 0.3-0.6 or 3-5 ms, and the
calibration prices its mean). Prints one JSON line per plan and round, then the
table, the median relative error, the Spearman rank correlation of step
times and the memory errors (what benchmarks/costmodel_fidelity.md records).

Besides the optimizer's plans, each rank count runs ZeRO-3 data
parallelism of some graphs (`ir.data_parallel.data_parallel_pcg(zero3=True)`:
weights stored split, all-gathered once per step, gradients
reduce-scattered) and, on 4 ranks, the optimizer's plan pinned to a 2 x 2
mesh (`degrees={"dp": 2, "tp": 2}`: a hybrid of data and tensor
parallelism on two mesh axes).

The default predictor is the step simulator on the plan's mesh PCG
(`cost.pcg_tasks.simulate_pcg`, profile PARSAT_RUN: what `parsat
optimize` puts in `totals.time_s` for a CPU machine); `plan_totals` is the
plan file's per-node sum (`totals.node_sum_s`, what extraction ranks by)
and bound on memory, for comparison; every row records that sum as
`plan_totals_s`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from parsat.api import optimize
from parsat.backend.calibrate import calibrate
from parsat.backend.cli import PLAN_OF, load_plan
from parsat.backend.executor import ExecutionError, TrainConfig, operator_library, run_many
from parsat.backend.launch import LaunchConfig, launch
from parsat.ir.costs import totals
from parsat.ir.data_parallel import data_parallel_pcg
from parsat.ir.machine import Machine
from parsat.ir.models import build_example
from parsat.search.baselines import price_pcg
from parsat.ir.errors import OptimizeError
from parsat.cost.pcg_tasks import PARSAT_RUN, TORCH_NATIVE, ExecutionProfile, simulate_pcg

GRAPHS = {
    "mlp": ("mlp", {}),
    "mlp-wide": ("mlp", dict(batch=256, d_in=256, d_hidden=1024, d_out=256)),
    "branches": ("branches", {}),
    "transformer-s": ("transformer", dict(batch=4, seq=32, hidden=64, heads=4, ffn=256)),
    "transformer-m": ("transformer", dict(batch=4, seq=64, hidden=256, heads=4, ffn=1024)),
    "gpt-s": ("gpt", dict(blocks=1, hidden=64, heads=4, seq=32, batch=4, vocab=256)),
}
LIMITS = {"seconds": 180}   # room for the baselines of every graph on this 2-core box (30 s cut gpt-s's)
ZERO3 = ("mlp", "transformer-s", "gpt-s")          # also run as ZeRO-3 data parallelism
HYBRID = ("mlp-wide", "transformer-m", "gpt-s")    # also run pinned to a 2 x 2 mesh (4 ranks)


def simulator(pcg, library, machine: Machine, prediction) -> tuple[float, float]:
    """The step simulator; memory as `parsat run` measures it on CPU (live tensors at the end of forward and
    of backward; on CUDA it reports the allocator's peak, which is `peak_memory_bytes`)."""
    result = simulate_pcg(pcg, library, machine, PARSAT_RUN)
    return result.step_s, float(result.sampled_memory_bytes)


def torch_simulator(pcg, library, machine: Machine, prediction) -> tuple[float, float]:
    """The step simulator as the torch-native runtime runs a plan (`TORCH_NATIVE`, with the module's own calls
    beyond its graph: `PlanFigures.profile`)."""
    result = simulate_pcg(pcg, library, machine, prediction.profile)
    return result.step_s, float(result.sampled_memory_bytes)


def plan_totals(pcg, library, machine: Machine, prediction) -> tuple[float, float]:
    return prediction.node_sum_s, prediction.peak_memory_bytes


PREDICTORS: dict[str, Callable] = {"simulator": simulator, "plan_totals": plan_totals,
                                   "torch_simulator": torch_simulator}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties get their average rank)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


@dataclass(frozen=True)
class PlanFigures:
    """What the plan file (or, for a PCG built here, the same cost model) predicts for one PCG."""

    time_s: float           # totals.time_s: the simulated step
    node_sum_s: float       # totals.node_sum_s: the per-node sum
    peak_memory_bytes: float
    profile: ExecutionProfile = TORCH_NATIVE   # how the torch-native runtime runs it: with the user's module's
    #                                            own calls counted (`--runtime torch`), TORCH_NATIVE.running(...)


def _figures(totals_dict: dict) -> PlanFigures:
    return PlanFigures(totals_dict["time_s"], totals_dict.get("node_sum_s", totals_dict["time_s"]),
                       totals_dict["peak_memory_bytes"])


def plans_for(n: int, machine_file: Path, folder: Path, graphs: list[str]) -> list[tuple[str, object, object, object]]:
    """(label, pcg, graph, PlanFigures) of every distinct PCG the optimizer returns for `n` ranks, the ZeRO-3
    plans of `ZERO3` and, on 4 ranks, the 2 x 2 mesh plans of `HYBRID`."""
    out, seen = [], set()
    machine = Machine.load(machine_file)
    library = operator_library()

    def keep(label: str, pcg, graph, figures: PlanFigures) -> None:
        key = (label.split("/")[0], tuple((n.id, n.kind, n.op if n.kind != "leaf" else n.role, n.inputs, n.attrs,
                                           n.shape, n.degrees) for n in pcg.nodes), pcg.outputs)
        if key not in seen:   # the same PCG under other names: once
            seen.add(key)
            out.append((label, pcg, graph, figures))

    def optimized(name: str, suffix: str = "", **options) -> None:
        example, sizes = GRAPHS[name]
        path = folder / f"{name}{suffix}-{n}.json"
        try:
            optimize(example, machine=str(machine_file), devices=n, sizes=sizes or None, limits=LIMITS,
                     **options).save(path)
        except OptimizeError as err:
            print(f"{name}{suffix} on {n} ranks: no plan ({err})", file=sys.stderr)
            return
        data = json.loads(path.read_text(encoding="utf-8"))
        for plan_of in (PLAN_OF if not suffix else ("parsat",)):
            try:
                pcg, graph, _prediction = load_plan(str(path), n, plan_of)
            except ExecutionError:
                continue
            figures = _figures(data["totals"] if plan_of == "parsat" else data["baselines"][plan_of])
            keep(f"{name}/{plan_of if not suffix else suffix.lstrip('-')}", pcg, graph, figures)

    for name in graphs:
        optimized(name)
        if name in ZERO3:
            example, sizes = GRAPHS[name]
            graph = build_example(example, sizes or None, library)
            pcg = data_parallel_pcg(graph, library, n, machine.devices_per_node, zero3=True)
            if pcg is not None:
                summed = totals(price_pcg(pcg, library, machine), machine)
                keep(f"{name}/zero3", pcg, graph, PlanFigures(simulate_pcg(pcg, library, machine).step_s,
                                                              summed.time_s, summed.peak_memory_bytes))
        if name in HYBRID and n == 4:
            optimized(name, "-hybrid2x2", degrees={"dp": 2, "tp": 2})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--graphs", nargs="+", default=list(GRAPHS), choices=list(GRAPHS))
    parser.add_argument("--predictor", default="simulator", choices=list(PREDICTORS))
    parser.add_argument("--calibrate-size", type=int, default=256)
    parser.add_argument("--window", type=float, default=0.03, help="calibration averaging window (seconds)")
    parser.add_argument("--json", default=None, help="write every row here")
    parser.add_argument("--keep", default=None, metavar="DIR", help="keep the machine and plan files here")
    parser.add_argument("--runtime", default="interpreter", choices=["interpreter", "torch"])
    parser.add_argument("--oversubscribe", action="store_true",
                        help="calibrate more ranks than cores (they share them, as the runs do)")
    parser.add_argument("--models", nargs="+", default=None, help="--runtime torch: of gpt2 llama bert")
    args = parser.parse_args()
    predict = PREDICTORS["torch_simulator" if args.runtime == "torch" and args.predictor == "simulator"
                         else args.predictor]
    library = operator_library()
    config = TrainConfig(steps=args.steps)
    rows: list[dict] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        plans: dict[int, list] = {}
        for n in args.nproc:
            def calibrated(r: int) -> Machine:
                machine_file = folder / f"machine-{n}-{r}.json"
                torch_native = args.runtime == "torch"   # it trains in float32, its styled modules on DTensors
                calibrate(f"this-box-{n}", nproc=n, size=args.calibrate_size, window_s=args.window,
                          oversubscribe=args.oversubscribe, dtype="float32" if torch_native else "float64",
                          dtensor=torch_native).machine.save(machine_file)
                return Machine.load(machine_file)

            before = calibrated(0)
            plans[n] = (plans_for(n, folder / f"machine-{n}-0.json", folder, args.graphs)  # optimized once
                        if args.runtime == "interpreter" else _torch_plans(n, before, args.models))
            for r in range(args.rounds):
                load_before = os.getloadavg()[0]
                measured = _measure(args.runtime, plans[n], n, config)
                load_after = os.getloadavg()[0]
                after = calibrated(r + 1)
                for label, pcg, graph, prediction in plans[n]:
                    (t0, m0), (t1, m1) = (predict(pcg, library, m, prediction) for m in (before, after))
                    job = measured[label]
                    times = job["step_times"][1:] or job["step_times"]
                    row = {"round": r, "nproc": n, "plan": label, "predicted_s": (t0 * t1) ** 0.5,
                           "predicted_before_s": t0, "predicted_after_s": t1,
                           "measured_s": statistics.median(times), "measured_mean_s": statistics.fmean(times),
                           "predicted_peak_bytes": m0,
                           "measured_peak_bytes": job["peak_memory_bytes"], "plan_totals_s": prediction.node_sum_s,
                           "plan_file_s": prediction.time_s, "load_1min": [load_before, load_after]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                before = after
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    summary = summarize(rows)
    print(summary)
    print(f"\n({time.perf_counter() - started:.0f} s wall)")
    return 0


def _torch_plans(n: int, machine: Machine, models: list[str] | None) -> list:
    from costmodel_fidelity_torch import MODELS, torch_plans

    return torch_plans(n, machine, list(models or MODELS))


def _measure(runtime: str, plans: list, n: int, config: TrainConfig) -> dict:
    """label -> {"step_times", "peak_memory_bytes"} (the slowest rank's per step, the largest peak), every plan of
    one rank count in one process group."""
    settings = LaunchConfig(nproc=n, backend="gloo", timeout_s=3600)
    if runtime == "interpreter":
        return launch(run_many, ([(label, pcg, graph) for label, pcg, graph, _p in plans], config), settings)[0]
    import mesh_plans
    from costmodel_fidelity_torch import slowest, torch_many

    jobs = [(label, mesh_plans.plan_dict(graph, pcg)) for label, pcg, graph, _p in plans]
    return slowest(launch(torch_many, (jobs, config.steps), settings))


def summarize(rows: list[dict]) -> str:
    """The table (medians over rounds) and the figures: median relative error, Spearman, memory errors."""
    keys = sorted({(r["nproc"], r["plan"]) for r in rows})
    table = ["| ranks | plan | predicted ms | measured ms | rel. error | old model ms | predicted MiB | measured MiB "
             "| mem. error |", "|---|---|---|---|---|---|---|---|---|"]
    predicted, measured, errors, mem_errors, olds = [], [], [], [], []
    for n, plan in keys:
        mine = [r for r in rows if r["nproc"] == n and r["plan"] == plan]
        p = statistics.median(r["predicted_s"] for r in mine)
        m = statistics.median(r["measured_s"] for r in mine)
        old = statistics.median(r["plan_totals_s"] or 0.0 for r in mine)
        pm = statistics.median(r["predicted_peak_bytes"] or 0.0 for r in mine)
        mm = statistics.median(r["measured_peak_bytes"] for r in mine)
        err, merr = abs(p - m) / m, abs(pm - mm) / mm if mm else float("nan")
        predicted.append(p)
        measured.append(m)
        olds.append(old)
        errors.append(err)
        mem_errors.append(merr)
        table.append(f"| {n} | {plan} | {p * 1e3:.2f} | {m * 1e3:.2f} | {err:.0%} | {old * 1e3:.3f} | "
                     f"{pm / 2**20:.2f} | {mm / 2**20:.2f} | {merr:.1%} |")
    lines = table + ["", f"plans: {len(keys)}; median relative error of step time {statistics.median(errors):.1%}; "
                         f"Spearman rank correlation {spearman(predicted, measured):.3f}; peak memory error: "
                         f"median {statistics.median(mem_errors):.1%}, largest {max(mem_errors):.1%}"]
    if all("measured_mean_s" in r for r in rows):   # calibration prices a collective at its mean over a window
        means = [statistics.median(r["measured_mean_s"] for r in rows if (r["nproc"], r["plan"]) == key)
                 for key in keys]
        lines.append(f"against each plan's mean step (the steps' mean per round, as `parsat calibrate` averages a "
                     f"collective over a window; the median over rounds): median relative error "
                     f"{statistics.median(abs(p - m) / m for p, m in zip(predicted, means)):.1%}, Spearman "
                     f"{spearman(predicted, means):.3f}")
    if all(olds):
        old_errors = [abs(o - m) / m for o, m in zip(olds, measured)]
        lines.append(f"the plan file's per-node sum (extraction's model, same machine files): median relative error "
                     f"{statistics.median(old_errors):.1%}, Spearman {spearman(olds, measured):.3f}")
    lines.append(noise(rows, keys))
    return "\n".join(lines)


def noise(rows: list[dict], keys) -> str:
    """How much the box itself moves, beside the figure (issue 31): the same plan's measured step across rounds;
    how far a plan's rounds stray from its median (what that movement alone costs one round's figure) and the
    rounds' rank order against each other (what it leaves of a Spearman); each round's own figures; how far the
    two calibrations around a round disagree (the prediction with the machine calibrated after it over the one
    before); measured over predicted; and the box's 1-minute load while the plans ran."""
    spreads, floor = [], []
    for n, plan in keys:
        times = [r["measured_s"] for r in rows if r["nproc"] == n and r["plan"] == plan]
        if len(times) > 1:
            spreads.append(max(times) / min(times))
            middle = statistics.median(times)
            floor.append(max(abs(t - middle) / middle for t in times))
    out = []
    if spreads:
        out.append(f"the same plan measured in different rounds: largest / smallest step time, median over plans "
                   f"{statistics.median(spreads):.2f}, worst {max(spreads):.2f}; a plan's farthest round from its "
                   f"median over rounds (what this noise alone costs a round's figure): median over plans "
                   f"{statistics.median(floor):.1%}, largest {max(floor):.1%}")
    by_round = {}
    for row in rows:
        by_round.setdefault(row["round"], {})[(row["nproc"], row["plan"])] = row["measured_s"]
    pairs = [(a, b) for a in by_round for b in by_round if a < b]
    orders = [spearman([by_round[a][k] for k in keys if k in by_round[a] and k in by_round[b]],
                       [by_round[b][k] for k in keys if k in by_round[a] and k in by_round[b]]) for a, b in pairs]
    if orders:
        out.append(f"the rounds' measured steps against each other: Spearman {min(orders):.3f}-{max(orders):.3f} "
                   f"(the rank order this noise leaves)")
    for r in sorted({row["round"] for row in rows}):
        mine = [row for row in rows if row["round"] == r]
        errors = [abs(row["predicted_s"] - row["measured_s"]) / row["measured_s"] for row in mine]
        out.append(f"round {r}: median relative error {statistics.median(errors):.1%}, Spearman "
                   f"{spearman([row['predicted_s'] for row in mine], [row['measured_s'] for row in mine]):.3f}")
    calibrations = [r["predicted_after_s"] / r["predicted_before_s"] for r in rows
                    if r.get("predicted_after_s") and r.get("predicted_before_s")]
    if calibrations:
        out.append(f"the two calibrations around a round: prediction after / before, median "
                   f"{statistics.median(calibrations):.2f}, range {min(calibrations):.2f}-{max(calibrations):.2f}")
    ratios = {}
    for row in rows:
        ratios.setdefault(row["nproc"], []).append(row["measured_s"] / row["predicted_s"])
    every = [x for xs in ratios.values() for x in xs]
    out.append(f"measured / predicted, every plan-round: median {statistics.median(every):.2f} ("
               + ", ".join(f"{n} ranks {statistics.median(xs):.2f}" for n, xs in sorted(ratios.items()))
               + f"), range {min(every):.2f}-{max(every):.2f}")
    loads = [x for row in rows for x in row.get("load_1min", ())]
    if loads:
        out.append(f"1-minute load while the plans ran: {min(loads):.1f}-{max(loads):.1f}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
