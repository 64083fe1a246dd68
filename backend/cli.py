"""`parsat run plan.json --nproc N`: train a plan for real on N ranks, optionally checked.

Every error a user can cause (a missing or malformed plan, a plan for
another device count, a rank that fails) ends with one line on stderr and
exit code 1; a failed `--check` also exits 1. With `--json` the last line
printed is one JSON object (issue 5): check, max_abs_diff,
comm_elements_measured, comm_elements_predicted, step_time_s,
peak_memory_bytes, plus comm_elements_wire and the losses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Mapping


def register(subparsers) -> None:
    run = subparsers.add_parser("run", help="train a plan on N local ranks (torch.distributed), optionally checked",
                                description="Run a plan's training steps on N ranks; under torchrun, join its group.")
    run.add_argument("plan", help="plan JSON written by `parsat optimize`")
    run.add_argument("-n", "--nproc", type=int, default=None,
                     help="number of ranks (must equal the plan's devices); under torchrun, its WORLD_SIZE")
    run.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                     help="default: nccl when CUDA has enough devices, else gloo")
    run.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    run.add_argument("--check", action="store_true", help="compare with a single-process run of the original graph")
    run.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    run.add_argument("--lr", type=float, default=0.01)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    run.add_argument("--timeout", type=float, default=600.0, help="seconds before the whole job is ended")
    run.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    run.set_defaults(run=main_run)


def _fail(message: str) -> int:
    print(f"parsat run: error: {message}", file=sys.stderr)
    return 1


def load_plan(path: str, nproc: int):
    """(pcg, graph, predicted elements per step) from a plan file, refusing what cannot run."""
    from parsat.backend.executor import ExecutionError, operator_library
    from parsat.saturate.graph import Graph
    from parsat.saturate.plan import load_plan_dict, pcg_from_dict

    data = load_plan_dict(path)
    devices = data.get("devices")
    if devices != nproc:
        raise ExecutionError(f"{path} is a plan for {devices} device(s); --nproc is {nproc}")
    try:
        graph = Graph.from_dict(data["graph"], operator_library())
        pcg = pcg_from_dict(data)
        totals = data.get("totals") or {}
        predicted = totals.get("comm_elements") if isinstance(totals, Mapping) else None
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ExecutionError(f"{path}: the plan does not follow the plan schema ({type(err).__name__}: {err})") \
            from None
    return pcg, graph, predicted


def main_run(args: argparse.Namespace) -> int:
    try:
        from parsat.backend.executor import ExecutionError, TrainConfig, check_worlds, run_plan
        from parsat.backend.launch import LaunchError
        from parsat.backend.placement import PlacementError
        from parsat.saturate.graph import GraphError
        from parsat.saturate.plan import PlanError
    except ImportError as err:  # torch missing
        return _fail(f"the backend needs torch ({err}); install it with: pip install torch==2.13.0")
    from parsat.backend.launch import under_torchrun
    if args.nproc is None:
        if not under_torchrun():
            return _fail("--nproc is required (the number of ranks to start)")
        args.nproc = int(os.environ["WORLD_SIZE"])
    try:
        pcg, graph, predicted = load_plan(args.plan, args.nproc)
        check_worlds(pcg, args.nproc)
        config = TrainConfig(steps=args.steps, optimizer=args.optimizer, lr=args.lr, seed=args.seed,
                             dtype=args.dtype, check=args.check, tolerance=1e-9 if args.dtype == "float64" else 1e-4)
        result = run_plan(pcg, args.nproc, config, graph=graph, predicted_comm=predicted, backend=args.backend,
                          timeout_s=args.timeout)
    except (PlanError, GraphError, ExecutionError, LaunchError, PlacementError) as err:
        return _fail(str(err))
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 speaks for the job
        _report(result, args)
    return 1 if result.check == "failed" else 0


def _report(result, args: argparse.Namespace) -> None:
    measured, predicted = result.comm_elements_measured, result.comm_elements_predicted
    lines = [f"ran {args.steps} step(s) on {args.nproc} rank(s)",
             f"  loss per step        {', '.join(f'{x:.6g}' for x in result.losses)}",
             f"  communication/step   measured {measured:,.0f} elements, predicted "
             + ("n/a" if predicted is None else f"{predicted:,.0f}")
             + ("" if result.comm_elements_wire == measured else
                f" (on the wire, counting redundant replicas: {result.comm_elements_wire:,.0f})"),
             f"  step time (median)   {result.step_time_s * 1e3:.3f} ms",
             f"  peak memory per rank {result.peak_memory_bytes / 2**20:.1f} MiB"]
    if result.check is not None:
        lines.append(f"  check                {result.check} (largest difference {result.max_abs_diff:.3g})")
    print("\n".join(lines))
    if args.json:
        print(json.dumps(result.to_dict()))
