"""`parsat run plan.json --nproc N`: train a plan for real on N ranks, optionally checked.

The job's ranks are the plan's device mesh: `--nproc` must be its size.
Every error a user can cause (a missing or malformed plan, a plan for
another device count, a rank that fails) ends with one line on stderr and
exit code 1; a failed `--check` also exits 1. With `--json` the last line
printed is one JSON object (issue 5): check, max_abs_diff,
comm_elements_measured, comm_elements_predicted, step_time_s,
peak_memory_bytes, plus the gradient-sync part, the distinct collectives,
the other predictions, the micro-batches per step and the losses
(`executor.RunResult.to_dict`).

A plan whose step runs m micro-batches (`Graph.microbatches`) runs as
priced: each step m forward and backward passes, the weights' gathers and
gradient synchronisation once (parsat/backend/executor.py). Before any rank
starts, the micro-batches are checked to make the step's whole batch
(`plan_check.micro_batches_make_the_step`); `--model` runs the module's
own loop, one batch a step, and refuses such a plan.

A pipelined plan (a `pipeline` object: the PCG cut into stages, docs in
parsat/ir/pipeline.py) runs on stages x stage devices ranks, each stage's
schedule as the plan says (parsat/backend/pipeline_run.py); the report adds, per
stage, its collectives and each rank's point-to-point and shared-weight
elements beside the prediction.

`--runtime torch` runs the plan through PyTorch's own stack instead of
the interpreter (`torch_native/run.py`: the plan's graph as a module,
`parallelize(runtime="torch")`, torch's optimizer; `--check` against the
unmodified module in one process; a pipelined plan's graph cut into
`torch.distributed.pipelining` stages, `torch_native/run_pipelined.py`),
refusing, with the lowering's message, what that path cannot lower.

`--plan-of NAME` runs one of the baselines the plan file carries
(`data_parallel`, `sequential`, `megatron`) instead of parsat's own PCG,
with that baseline's predicted totals, so both sides of a comparison are
measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Mapping, Sequence


PLAN_OF = ("parsat", "data_parallel", "sequential", "megatron", "expert_parallel")


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
    run.add_argument("--collective-timeout", type=float, default=30.0,
                     help="seconds one collective may wait for its peers before the job fails naming the rank "
                          "that hangs (default 30; keep it under --timeout)")
    run.add_argument("--plan-of", default="parsat", choices=PLAN_OF,
                     help="which PCG of the plan file to run: parsat's (default) or a baseline's")
    run.add_argument("--model", metavar="FILE.py:FACTORY", default=None,
                     help="train this torch module (the factory returns (module, example_inputs)) as the plan: its "
                          "own weights, inputs and loss; --check compares with the unmodified module")
    run.add_argument("--data", metavar="FILE", default=None,
                     help="with --model: a torch.save'd list of batches (each a tuple of tensors), one per step in "
                          "turn; default: the factory's example inputs every step")
    run.add_argument("--runtime", choices=("interpreter", "torch"), default="interpreter",
                     help="interpreter (default): parsat runs the plan node by node; torch: the plan's graph as a "
                          "module, lowered onto torch's own DeviceMesh / replicate / fully_shard "
                          "(parallelize(runtime='torch')), refusing what that cannot lower")
    run.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    run.set_defaults(run=main_run)
    register_calibrate(subparsers)


def _fail(message: str, command: str = "run") -> int:
    print(f"parsat {command}: error: {message}", file=sys.stderr)
    return 1


def load_plan(path: str, nproc: int, plan_of: str = "parsat"):
    """(pcg, graph, prediction) of one PCG of a plan file, refusing what cannot run.

    `plan_of` picks parsat's PCG or a baseline's. A baseline's PCG is read
    from `baselines.NAME` (`nodes` and `outputs` there, or under `pcg`, in
    the top level's node format); a plan file written before baselines
    carried their PCG can still run `data_parallel`, rebuilt from the graph
    by the optimizer's own definition (`ir.data_parallel.data_parallel_pcg`).
    """
    from parsat.backend.executor import ExecutionError, Prediction, operator_library
    from parsat.ir.data_parallel import data_parallel_pcg, data_parallel_refusal
    from parsat.ir.graph import Graph
    from parsat.ir.plan import PlanError, load_plan_dict, pcg_from_dict
    from parsat.ir.validate import validate_plan_operators

    data = load_plan_dict(path)
    devices = data.get("devices")
    if devices != nproc:
        raise ExecutionError(f"{path} is a plan for {devices} device(s); --nproc is {nproc}")
    if plan_of not in PLAN_OF:
        raise ExecutionError(f"--plan-of must be one of {', '.join(PLAN_OF)}, not '{plan_of}'")
    library = operator_library()
    # every node means something in this library, before any rank starts (the structure was checked on load)
    validate_plan_operators(data, library.ops, PlanError, f"{path} does not follow the plan schema")
    try:
        graph = Graph.from_dict(data["graph"], library)
        if plan_of == "parsat":
            return pcg_from_dict(data), graph, Prediction.from_totals(data.get("totals")).on_machine(
                data.get("machine"))
        baseline = (data.get("baselines") or {}).get(plan_of)
        if not isinstance(baseline, Mapping):
            raise ExecutionError(f"{path} has no {plan_of} baseline (it does not apply to this graph)")
        source = baseline.get("pcg") if isinstance(baseline.get("pcg"), Mapping) else baseline
        if "nodes" in source and "outputs" in source:
            pcg = pcg_from_dict(source)
        elif plan_of == "data_parallel":
            pcg = data_parallel_pcg(graph, library, nproc)
            if pcg is None:
                raise ExecutionError(f"data parallelism does not apply to {path}'s graph: "
                                     f"{data_parallel_refusal(graph, library, nproc)}")
        else:
            raise ExecutionError(f"{path} carries the {plan_of} baseline's costs but not its PCG; re-run "
                                 "`parsat optimize` with this version to record it")
        return pcg, graph, Prediction.from_totals(dict(baseline)).on_machine(data.get("machine"))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ExecutionError(f"{path}: the plan does not follow the plan schema ({type(err).__name__}: {err})") \
            from None


def pipeline_of(path: str):
    """(pipeline, node costs) of a pipelined plan file (`pipeline_run.load_pipeline`); None without one."""
    from parsat.backend.pipeline_run import load_pipeline
    from parsat.ir.plan import load_plan_dict

    return load_pipeline(load_plan_dict(path))


def main_run(args: argparse.Namespace) -> int:
    try:
        from parsat.backend.executor import ExecutionError, TrainConfig, check_mesh, run_plan
        from parsat.backend.launch import LaunchError
        from parsat.ir.placement import PlacementError
        from parsat.ir.graph import GraphError
        from parsat.ir.plan import PlanError
    except ImportError as err:  # torch missing
        return _fail(f"the backend needs torch ({err}); install it with: pip install torch==2.13.0")
    from parsat.backend.launch import under_torchrun
    from parsat.dsl.bounds import BoundError, check_all
    from parsat.dsl.files import FileProblem, check_regular_file
    if args.nproc is None:
        if not under_torchrun():
            return _fail("--nproc is required (the number of ranks to start)")
        args.nproc = int(os.environ["WORLD_SIZE"])
    try:
        check_all("run", {"--nproc": args.nproc, "--steps": args.steps, "--seed": args.seed, "--lr": args.lr,
                          "--timeout": args.timeout, "--collective-timeout": args.collective_timeout})
    except BoundError as err:
        return _fail(str(err))
    try:
        pcg, graph, predicted = load_plan(args.plan, args.nproc, args.plan_of)
        pipeline = pipeline_of(args.plan) if args.plan_of == "parsat" else None
        if pipeline is None:
            check_mesh(pcg, args.nproc)
        else:
            from parsat.backend.pipeline_run import check_pipeline, run_pipelined_plan

            check_pipeline(pcg, pipeline[0], args.nproc, graph)
        from parsat.backend.plan_check import micro_batches_make_the_step, plan_follows_graph

        plan_follows_graph(pcg, graph, args.seed)  # before any rank starts
        micro_batches_make_the_step(graph, args.seed)
        config = TrainConfig(steps=args.steps, optimizer=args.optimizer, lr=args.lr, seed=args.seed,
                             dtype=args.dtype, check=args.check, tolerance=check_tolerance(args.dtype, args.model))
        if args.runtime == "torch":
            return _run_torch(args, graph, pipeline is not None, config)
        if args.model is not None and pipeline is not None:
            raise ExecutionError(f"{args.plan} is a pipelined plan; --model trains the module in its own loop on "
                                 "one mesh: run the plan without --model")
        if args.model is not None:
            from parsat.backend.parallelize import run_module_plan

            if graph.microbatches != 1:
                raise ExecutionError(f"{args.plan} runs its step as {graph.microbatches} micro-batches; --model "
                                     "trains the module one batch per step (its own loop), so it cannot run this "
                                     "plan as priced: run it without --model, or optimize the module with "
                                     "--microbatches 1")

            if args.data is not None:  # torch.load in every rank would wait on a pipe or read a device forever
                check_regular_file(args.data, "--data")

            result = run_module_plan(pcg, graph, args.model, args.data, args.nproc, config, predicted, args.backend,
                                     args.timeout, args.collective_timeout)
        else:
            if args.data is not None:
                raise ExecutionError("--data needs --model (a plan alone trains on seeded data)")
            if pipeline is not None:
                result = run_pipelined_plan(pcg, *pipeline, args.nproc, config, graph=graph, predicted=predicted,
                                            backend=args.backend, timeout_s=args.timeout,
                                            collective_timeout_s=args.collective_timeout)
            else:
                result = run_plan(pcg, args.nproc, config, graph=graph, predicted=predicted, backend=args.backend,
                              timeout_s=args.timeout, collective_timeout_s=args.collective_timeout)
    except (PlanError, GraphError, ExecutionError, LaunchError, PlacementError, ValueError, FileProblem) as err:
        return _fail(str(err))
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 speaks for the job
        _report(result, args, config.tolerance)
    return 1 if result.check == "failed" else 0


def _run_torch(args: argparse.Namespace, graph, pipelined: bool, config) -> int:
    """`--runtime torch` (`torch_native.run`, a pipelined plan `torch_native.run_pipelined`): the plan's graph as a
    module on torch's own stack; rank 0 reports the losses, the lowering and, with --check, the comparison with
    the unmodified module in one process."""
    from parsat.backend.executor import ExecutionError
    from parsat.backend.torch_native import run, run_pipelined

    for flag, given in (("--model", args.model), ("--data", args.data),
                        ("--plan-of", args.plan_of if args.plan_of != "parsat" else None)):
        if given is not None:
            raise ExecutionError(f"{flag} is not supported with --runtime torch (it runs the plan file's own graph "
                                 "and parsat's PCG); a module of your own: parsat.parallelize(module, plan, "
                                 "example_inputs, runtime='torch')")
    (run_pipelined if pipelined else run).check_runnable(graph)   # before any rank starts
    train = run_pipelined.run_pipelined_torch_plan if pipelined else run.run_torch_plan
    result = train(args.plan, args.nproc, config, args.backend, args.timeout, args.collective_timeout)
    if int(os.environ.get("RANK", "0")) != 0:
        return 1 if result.get("check") == "failed" else 0
    lines = [f"ran {args.steps} step(s) of the plan on {args.nproc} rank(s) with torch's own stack (--runtime torch)",
             f"  loss per step        {', '.join(f'{x:.6g}' for x in result['losses'])}",
             *("  " + line for line in result["lowering"].splitlines())]
    if result["not_dtensor"]:
        lines.append(f"  not DTensors         {', '.join(result['not_dtensor'])}")
    if "check" in result:
        lines.append(check_line(result["check"], result["max_rel_diff"], None, 0, result["worst"], config.tolerance))
    print("\n".join(lines))
    if args.json:
        print(json.dumps(result))
    return 1 if result.get("check") == "failed" else 0


def check_tolerance(dtype: str, model: str | None) -> float:
    """--check's relative tolerance. A plan's own graph runs in one dtype on both sides (1e-9 in float64);
    a user's module may compute parts in float32 whatever its dtype (Hugging Face models upcast norms and
    logits with `.float()`), which the plan's graph does in the run's dtype: 1e-6 in float64 covers that."""
    if dtype == "float64":
        return 1e-6 if model else 1e-9
    return 1e-3 if model else 1e-4


def step_time_line(measured_s: float, predicted, spread=None, cpu_s: Sequence[float] = ()) -> str:
    """The measured step beside the plan's predicted one, and how far apart they are; with `spread`
    (`step_statistic.Spread`) the middle half of the steps it is the median of, and with `cpu_s` each
    rank's CPU seconds a step on a line of its own (what the step cost the ranks, whatever else ran).

    The prediction is only this box's when the plan was priced on a machine
    measured here (`parsat calibrate`); a preset's figures are another
    machine's, so the line says so instead of inviting a comparison."""
    line = f"  step time (median)   {measured_s * 1e3:.3f} ms"
    cpu = (["    CPU a step         " + ", ".join(f"rank {r} {s * 1e3:.3f} ms" for r, s in enumerate(cpu_s))
            + " (each rank's median: the rest of the step it waited)"] if cpu_s else [])
    if predicted.time_s is None or predicted.time_s <= 0:
        return "\n".join([line + " (the plan predicts none)", *cpu])
    line += f", predicted {predicted.time_s * 1e3:.3f} ms"
    if predicted.machine_kind == "preset":
        return "\n".join([line + (f" for the preset '{predicted.machine}', not this machine (`parsat calibrate` "
                                  "measures it, `parsat optimize --machine FILE` prices on it)"), *cpu])
    if predicted.machine_kind == "calibrated":
        line += f" on '{predicted.machine}' (calibrated)"
    else:
        name = f" '{predicted.machine}'" if predicted.machine else ""
        line += f" on the described machine{name}"
    line += f": measured {measured_s / predicted.time_s:.2f} x the prediction"
    if spread is not None and spread.count > 1:
        line += (f"; middle half of {spread.count} steps {spread.low_s * 1e3:.3f}-{spread.high_s * 1e3:.3f} ms "
                 f"({spread.low_s / predicted.time_s:.2f}-{spread.high_s / predicted.time_s:.2f} x)")
    return "\n".join([line, *cpu])


def _report(result, args: argparse.Namespace, tolerance: float) -> None:
    from parsat.ir import recompute

    measured, predicted = result.comm_elements_measured, result.comm_elements_predicted
    sync_predicted = result.predicted.grad_sync_elements
    memory_predicted = result.predicted.peak_memory_bytes
    micro = result.microbatches
    lines = [f"ran {args.steps} step(s) of the {args.plan_of} plan on {args.nproc} rank(s)"
             + (f", {micro} micro-batches each (gradients accumulated, synchronised once a step)" if micro > 1 else "")
             + (f", {recompute.describe(result.recompute)}" if result.recompute != recompute.NONE else ""),
             f"  loss per step        {', '.join(f'{x:.6g}' for x in result.losses)}",
             f"  communication/step   measured {measured:,.0f} elements, predicted "
             + ("n/a" if predicted is None else f"{predicted:,.0f}")
             + ("" if result.comm_matches is None else " (equal)" if result.comm_matches else " (DIFFERENT)"),
             f"    of which grad sync measured {result.grad_sync_elements_measured:,.0f}, predicted "
             + ("n/a" if sync_predicted is None else f"{sync_predicted:,.0f}"),
             *(["    by mesh axis       " + ", ".join(f"{axis} {sent:,.0f}" for axis, sent
                                                      in result.comm_by_axis.items())] if result.comm_by_axis else []),
             step_time_line(result.step_time_s, result.predicted, result.step_spread, result.step_cpu_s),
             f"  peak memory per rank {result.peak_memory_bytes / 2**20:.2f} MiB of tensors"
             + ("" if memory_predicted is None
                else f" (plan's bound {memory_predicted / 2**20:.2f} MiB, Adam state included)")
             + f"; process RSS {result.process_rss_bytes / 2**20:.0f} MiB"]
    if result.pipeline:
        lines += pipeline_lines(result.pipeline)
    if result.check is not None:
        lines.append(check_line(result.check, result.max_rel_diff, result.max_abs_diff, result.nonfinite,
                                result.worst, tolerance))
    print("\n".join(lines))
    if args.json:
        print(json.dumps(result.to_dict()))


def pipeline_lines(pipeline: Mapping) -> list[str]:
    """Per stage: its collectives (summed over its ranks), the point-to-point elements each of its ranks sent
    to each other stage, and each rank's part of the shared weights' gradient sum, measured beside predicted
    (`pipeline_run.pipeline_comparison`)."""
    def pair(measured, predicted) -> str:
        values = measured if isinstance(measured, list) else [measured]
        shown = f"{values[0]:,.0f}" if len(set(values)) == 1 else "/".join(f"{x:,.0f}" for x in values)
        equal = all(abs(x - predicted) < 0.5 for x in values)
        return f"measured {shown}, predicted {predicted:,.0f} ({'equal' if equal else 'DIFFERENT'})"

    chunks = pipeline["chunks_per_stage"]
    lines = [f"  pipeline             {pipeline['degree']} stages of {pipeline['stage_devices']} rank(s), "
             f"{pipeline['schedule']}" + (f" with {chunks} chunks per stage" if chunks > 1 else "")
             + f", {pipeline['microbatches']} micro-batches: "
             + ("measured = predicted" if pipeline["matches"] else "measured differs from predicted")]
    for stage in pipeline["stages"]:
        ranks = stage["ranks"]
        parts = [f"collectives {pair(stage['collectives_measured'], stage['collectives_predicted'])}"]
        parts += [f"p2p to stage {t} per rank {pair(xs, stage['p2p_sent_predicted'][t])}"
                  for t, xs in stage["p2p_sent_measured"].items()]
        if stage["shared_sum_predicted"] or any(stage["shared_sum_measured"]):
            parts.append("shared weights' gradient sum per rank "
                         + pair(stage["shared_sum_measured"], stage["shared_sum_predicted"]))
        lines.append(f"    stage {stage['stage']} (ranks {ranks[0]}-{ranks[-1]}) " + "; ".join(parts))
    return lines


def check_line(verdict: str, rel, diff, nonfinite: int, worst: str, tolerance: float) -> str:
    """The `--check` line: the verdict, the largest relative and absolute differences and the tolerance."""
    if nonfinite:
        return (f"  check                failed: {nonfinite} non-finite value(s) in the loss, outputs, gradients or "
                f"weights; NaN or infinity is not finite and fails whatever the differences (relative tolerance "
                f"{tolerance:g})")
    rel_text = "n/a" if rel is None else f"{rel:.3g}"
    abs_text = "n/a" if diff is None else f"{diff:.3g}"
    where = f" in {worst}" if worst else ""
    return (f"  check                {verdict} (largest relative difference {rel_text}{where}, absolute {abs_text}; "
            f"tolerance {tolerance:g} relative)")


# ------------------------------------------------------------------ calibrate


def register_calibrate(subparsers) -> None:
    cal = subparsers.add_parser("calibrate", help="time operators and collectives here; write a machine file",
                                description="Measure this machine's compute rates and collective link for the cost "
                                            "model, and write a machine JSON `parsat optimize --machine` loads.")
    from parsat.ir.machine_profile import COMM_ELEMENTS   # no torch: the parser stays light

    cal.add_argument("--machine", "-m", required=True, metavar="NAME", help="the name to give the machine")
    cal.add_argument("--output", "-o", required=True, metavar="FILE", help="machine JSON to write")
    cal.add_argument("-n", "--nproc", type=int, default=None,
                     help="ranks for the collectives (default: the CUDA device count, or 2 on CPU)")
    cal.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    cal.add_argument("--size", type=int, default=512, help="largest GEMM dimension (default 512)")
    cal.add_argument("--repeats", type=int, default=5, help="timed repetitions per measurement (median)")
    cal.add_argument("--comm-elements", type=int, nargs="+", default=COMM_ELEMENTS,
                     metavar="N", help="buffer sizes (elements) of the collectives timed (at least two, increasing): "
                                       "a buffer is priced between its two neighbours, beyond them on the fitted line")
    cal.add_argument("--window", type=float, default=0.03, metavar="SECONDS",
                     help="each figure averages at least this much wall time (default 0.03)")
    cal.add_argument("--dtype", choices=("float64", "float32", "bfloat16"), default="float64",
                     help="the dtype to measure: the one `parsat run` trains in (default float64, as `parsat run`); "
                          "bfloat16 for a GPU's mixed-precision training")
    cal.add_argument("--oversubscribe", action="store_true",
                     help="allow more ranks than this machine has cores (or GPUs); the figures then measure "
                          "ranks that wait for each other's cores, and the report says so")
    cal.add_argument("--dtensor", action="store_true",
                     help="also measure what an operator on a DTensor costs beyond a plain one (the torch-native "
                          "runtime's tensor-parallel modules, `parallelize(runtime='torch')`)")
    cal.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                     help="seconds before the measuring ranks are ended (default 600; a loaded machine may need more)")
    cal.add_argument("--json", action="store_true", help="print the measurements as one JSON object last")
    cal.set_defaults(run=main_calibrate)


def main_calibrate(args: argparse.Namespace) -> int:
    try:
        import torch

        from parsat.backend.calibrate import calibrate, report
        from parsat.backend.launch import LaunchError
        from parsat.dsl.bounds import check_all
        from parsat.dsl.files import FileProblem, check_output
        from parsat.ir.errors import MachineError
    except ImportError as err:
        return _fail(f"calibration needs torch ({err}); install it with: pip install torch==2.13.0", "calibrate")
    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.device_count() >= 2 else 2)
    sizes = list(args.comm_elements)
    try:
        check_all("calibrate", {"--nproc": nproc, "--size": args.size, "--repeats": args.repeats,
                                "--comm-elements": sizes, "--window": args.window, "--timeout": args.timeout})
        if len(sizes) < 2 or sizes != sorted(set(sizes)):
            raise ValueError(f"--comm-elements must be at least two increasing sizes, got {sizes}")
        check_output(args.output)   # before the measurements, not after them
        result = calibrate(args.machine, nproc, args.size, args.repeats, args.backend, tuple(sizes), args.dtype,
                           timeout_s=args.timeout, window_s=args.window, oversubscribe=args.oversubscribe,
                           dtensor=args.dtensor)
        result.machine.save(args.output)
    except (ValueError, LaunchError, FileProblem, MachineError) as err:
        return _fail(str(err), "calibrate")
    if result.oversubscribed:
        print(f"parsat calibrate: warning: {result.oversubscribed}", file=sys.stderr)
    print(report(result))
    print(f"wrote {args.output}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict()))
    return 0
