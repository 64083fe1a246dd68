"""Activation recomputation run for real: the same plan with and without it, measured beside the prediction.

    .venv/bin/python benchmarks/recompute_run.py [--steps 2]

For a small `gpt`, `parsat.optimize(..., recompute="blocks")` on 1, 2 and
4 devices (the machine of benchmarks/mesh_optimizer_run.py: two nodes of
two devices, compute slow, links nearly free inside a node) and one
pipelined plan (PP 2 x TP 2, 1F1B, 4 micro-batches). Each plan's
PCG runs twice on gloo CPU ranks with `--check` (float64, SGD): as
optimized (`recompute="blocks"`, predicted by the plan's own totals) and
with `dataclasses.replace(pcg, recompute="none")`, re-priced by the same
cost model (`search.solve.price_pcg`; the pipeline is cut from the
stage plan so re-priced, and predicted by `ir.pipeline`'s stage figures,
as `parsat run` predicts one). Communication is elements
per step summed over ranks; memory is the measured peak of live tensors
per rank (`executor.TensorMemory`: float64 pieces, SGD) beside the plan's
bound (the machine's bf16 compute with fp32 master weights and Adam
state), so the two columns differ in units of account and only their
ratios with and without recomputation compare. Results:
benchmarks/backend_results.md, "Activation recomputation".
"""

from __future__ import annotations

import argparse
import resource
from dataclasses import replace

from parsat.api import optimize
from parsat.backend.executor import Prediction, TrainConfig, operator_library, run_plan
from parsat.backend.pipeline_run import run_pipelined_plan
from parsat.ir.costs import totals
from parsat.ir.machine import Machine
from parsat.ir.parallelism import describe
from parsat.cost.pipeline import pipelined
from parsat.search.solve import price_pcg

TWO_BY_TWO = Machine("two-nodes-of-two", 2, 2, peak_flops=1e8, memory_bandwidth=1e12, memory_capacity=2 ** 30,
                     intra_bandwidth=1e12, intra_latency=1e-9, inter_bandwidth=1e9, inter_latency=1e-6)
SIZES = {"blocks": 3, "hidden": 32, "heads": 2, "seq": 8, "vocab": 64, "batch": 8}   # tests/test_backend_recompute.py
STAGE_SIZES = {"blocks": 4, "hidden": 32, "heads": 2, "seq": 16, "vocab": 64, "batch": 8}   # test_backend_pipeline.py
CASES = (("1 device", 1, None, 1), ("TP 2", 2, {"tp": 2}, 1), ("DP 2, 2 micro-batches", 2, {"dp": 2}, 2),
         ("DP 2 x TP 2, 2 micro-batches", 4, {"dp": 2, "tp": 2}, 2))


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _row(label: str, policy: str, mesh: str, result, predicted: Prediction) -> dict:
    return {"case": label, "recompute": policy, "mesh": mesh, "check": result.check,
            "rel": result.max_rel_diff, "comm": result.comm_elements_measured, "comm_predicted": predicted.comm_elements,
            "memory": result.peak_memory_bytes, "memory_predicted": predicted.peak_memory_bytes}


def repriced(plan, policy: str):
    """`plan` with its PCG's recomputation policy set to `policy`, every node priced again by the cost model."""
    pcg = replace(plan.pcg, recompute=policy)
    costs = price_pcg(pcg, operator_library(), plan.machine, microbatches=plan.graph.microbatches)
    figures = totals(costs, plan.machine)
    if policy == plan.pcg.recompute:   # the plan's own figures are the re-priced ones
        assert figures.comm_elements == plan.totals.comm_elements
    return replace(plan, pcg=pcg, costs=costs, totals=figures)


def unstaged(label: str, devices: int, degrees, m: int, config: TrainConfig) -> list[dict]:
    plan = optimize("gpt", machine=TWO_BY_TWO, devices=devices, sizes=SIZES, degrees=degrees, microbatches=m,
                    baselines=False, recompute="blocks")
    rows = []
    for policy in ("none", "blocks"):
        variant = repriced(plan, policy)
        figures = variant.totals
        predicted = Prediction(figures.comm_elements, figures.grad_sync_elements, figures.peak_memory_bytes)
        result = run_plan(variant.pcg, devices, config, plan.graph, predicted, backend="gloo")
        rows.append(_row(label, policy, f"{variant.pcg.mesh or 'one device'} ({describe(variant.pcg)})", result,
                         predicted))
    return rows


def staged(config: TrainConfig) -> list[dict]:
    """PP 2 x TP 2, 1F1B: the stage plan (TP 2, 4 micro-batches) optimized to recompute, cut after layer 1."""
    stage = optimize("gpt", TWO_BY_TWO, devices=2, sizes=STAGE_SIZES, microbatches=4, degrees={"tp": 2},
                     baselines=False, recompute="blocks")
    rows = []
    for policy in ("none", "blocks"):
        plan = pipelined(repriced(stage, policy), 2, "1f1b", TWO_BY_TWO.with_devices(4), starts=[-1, 2])
        predicted = Prediction.from_totals(plan.totals.to_dict())
        result = run_pipelined_plan(plan.pcg, plan.pipeline, plan.costs, 4, config, plan.graph, predicted,
                                    backend="gloo")
        rows.append(_row("PP 2 x TP 2 (1F1B, 4 micro-batches; layers -1,0,1 / 2,3)", policy,
                         f"2 stages x {plan.pcg.mesh}", result,
                         replace(predicted, comm_elements=result.comm_elements_predicted)))
        rows[-1]["stage_memory"] = [s["peak_memory_bytes"] for s in result.pipeline["stages"]]
        rows[-1]["comm_matches"] = result.pipeline["matches"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    config = TrainConfig(steps=args.steps, check=True)
    start = cpu_seconds()
    rows = [r for case in CASES for r in unstaged(*case, config)] + staged(config)
    print("| case | recompute | mesh | check (max rel diff) | comm measured | comm predicted | tensor peak/rank "
          "measured | plan's memory bound |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        memory = f"{r['memory']:,}" + (f" (stages {', '.join(f'{x:,}' for x in r['stage_memory'])})"
                                       if "stage_memory" in r else "")
        bound = "n/a" if r["memory_predicted"] is None else f"{int(r['memory_predicted']):,}"
        print(f"| {r['case']} | {r['recompute']} | {r['mesh']} | {r['check']} ({r['rel']:.1e}) | {r['comm']:,.0f} | "
              f"{r['comm_predicted']:,.0f} | {memory} | {bound} |")
    print(f"\nCPU seconds (this process and its ranks): {cpu_seconds() - start:.0f}")


if __name__ == "__main__":
    main()
