"""`parsat run plan.json --runtime torch`: the plan file's graph as a module, lowered onto torch's own stack
(`backend/torch_native/run.py`), on 2 gloo ranks: trained like the unmodified module in one process (--check)
and like the interpreter (the same seeded weights, data and optimizer give the same losses), every parameter a
DTensor; what the torch path cannot lower refused with the lowering's message, exit code 1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import mesh_plans  # noqa: E402

from parsat.backend.executor import operator_library  # noqa: E402
from parsat.cli import main  # noqa: E402
from parsat.ir.megatron import megatron_pcg  # noqa: E402
from parsat.ir.models import build_example  # noqa: E402

LIBRARY = operator_library()
GPT = dict(blocks=1, batch=4, seq=4, hidden=8, heads=2, vocab=16)


def _write(tmp_path, name: str, data: dict) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _run(capsys, path: Path, *extra: str) -> tuple[int, dict | None, str]:
    code = main(["run", str(path), "--nproc", "2", "--backend", "gloo", "--steps", "2", "--json", *extra])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return code, (json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None), captured.err


@pytest.mark.slow
def test_the_data_parallel_mlp_and_a_zero3_gpt_train_on_torch_like_one_process_and_the_interpreter(tmp_path, capsys):
    """The MLP's data-parallel plan (a graph that is no built-in example: its operators run on the local batch)
    and the built-in gpt's ZeRO-3 plan (the example rebuilt at the local batch): --check passes (losses and final
    weights within 1e-9 of the unmodified module trained in one process), every parameter a DTensor, the
    lowering `replicate` / `fully_shard`, and the losses are the interpreter's on the same plan file."""
    mlp = mesh_plans.data_parallel_mlp(LIBRARY, 2, batch=8, d_in=6, d_hidden=4, d_out=2)
    gpt = build_example("gpt", GPT, LIBRARY)
    plans = {"mlp": (mesh_plans.plan_dict(mlp.graph, mlp.pcg), "replicate over dp", "sgd"),
             "gpt": (mesh_plans.plan_dict(gpt, megatron_pcg(gpt, LIBRARY, (2, 1), zero=3)), "fully_shard over dp",
                     "adam")}
    for name, (data, how, optimizer) in plans.items():
        path = _write(tmp_path, name, data)
        code, result, err = _run(capsys, path, "--runtime", "torch", "--check", "--optimizer", optimizer)
        assert code == 0, err
        assert result["runtime"] == "torch" and result["check"] == "passed", result
        assert result["max_rel_diff"] <= 1e-9 and result["not_dtensor"] == [], result
        assert how in result["lowering"], result["lowering"]
        code, interpreted, err = _run(capsys, path, "--optimizer", optimizer)
        assert code == 0, err
        for got, want in zip(result["losses"], interpreted["losses"]):
            assert abs(got - want) <= 1e-9 * abs(want), (name, result["losses"], interpreted["losses"])


def _plan_file(tmp_path, name: str, sizes: dict, mesh_shape, microbatches: int = 1, recompute: str = "none",
               zero: int = 0) -> Path:
    """The built-in gpt's Megatron-LM plan file on `mesh_shape` (dp, tp)."""
    from dataclasses import replace

    gpt = build_example("gpt", sizes, LIBRARY).with_microbatches(microbatches)
    pcg = replace(megatron_pcg(gpt, LIBRARY, mesh_shape, zero=zero), recompute=recompute)
    return _write(tmp_path, name, mesh_plans.plan_dict(gpt, pcg))


def _like_one_process_and_the_interpreter(capsys, path: Path, nproc: int, forward: str, *extra: str) -> dict:
    """`parsat run --runtime torch --check` 3 Adam steps: passed (1e-9: weights and losses of the unmodified module
    trained in one process), every parameter a DTensor, `forward` in the lowering, the interpreter's losses."""
    args = ["run", str(path), "--nproc", str(nproc), "--backend", "gloo", "--steps", "3", "--json",
            "--optimizer", "adam", *extra]
    code = main([*args, "--runtime", "torch", "--check"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["check"] == "passed" and result["max_rel_diff"] <= 1e-9, result
    assert result["not_dtensor"] == [] and forward in result["lowering"], result["lowering"]
    code = main(args)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    interpreted = json.loads(captured.out.strip().splitlines()[-1])
    for got, want in zip(result["losses"], interpreted["losses"], strict=True):
        assert abs(got - want) <= 1e-9 * abs(want), (result["losses"], interpreted["losses"])
    return result


def test_a_tensor_parallel_plan_file_trains_on_torch_through_the_plan_s_graph_on_dtensors(tmp_path, capsys):
    """The gpt's Megatron tp 2 plan splits weights the graph's module holds as plain parameters (no nn.Linear to
    style): the module's forward evaluates the plan's graph on DTensors (`rewritten`), every parallel operator on
    tp a redistribute, and trains like one process and like the interpreter."""
    path = _plan_file(tmp_path, "tp", GPT, (1, 2))
    result = _like_one_process_and_the_interpreter(capsys, path, 2, "torch's styles cannot run its tensor axis")
    assert "tensor parallelism on tp: every parameter a DTensor" in result["lowering"], result["lowering"]


@pytest.mark.slow   # ~45 s of a worker: five runs / a whole micro-batch search twice
def test_micro_batched_and_recomputing_plan_files_train_on_torch_like_one_process(tmp_path, capsys):
    """The 2-block gpt in 2 micro-batches a step on dp 2 (`replicate`, then ZeRO-3's `fully_shard`, the gradient
    sync in the last backward only) and on tp 2 (the plan's graph on DTensors), and recomputing its blocks on dp 2 and tp 2 (no submodule per block
    in the graph's module: the plan's blocks' steps checkpointed, their recomputation on DTensors in the forward's
    context): each like one process on the whole batch and like the interpreter."""
    sizes = {**GPT, "blocks": 2}
    _like_one_process_and_the_interpreter(capsys, _plan_file(tmp_path, "dp_m2", sizes, (2, 1), microbatches=2), 2,
                                          "replicate over dp")
    _like_one_process_and_the_interpreter(capsys, _plan_file(tmp_path, "tp_m2", sizes, (1, 2), microbatches=2), 2,
                                          "torch's styles cannot run its tensor axis")
    _like_one_process_and_the_interpreter(capsys, _plan_file(tmp_path, "z3_m2", sizes, (2, 1), microbatches=2,
                                                             zero=3), 2, "fully_shard over dp")
    for name, shape in (("dp_rc", (2, 1)), ("tp_rc", (1, 2))):
        _like_one_process_and_the_interpreter(capsys, _plan_file(tmp_path, name, sizes, shape, recompute="blocks"),
                                              2, "2 blocks recomputed in the backward")


@pytest.mark.slow
def test_a_dp_2_x_tp_2_plan_file_trains_on_4_ranks_like_one_process(tmp_path, capsys):
    """The 2-block gpt's Megatron dp 2 x tp 2 plan on 4 gloo ranks: `replicate` over dp, the plan's graph on
    DTensors of tp, the loss's 1 / count at each rank's local batch (`GraphImport.local_attrs`)."""
    path = _plan_file(tmp_path, "dptp", {**GPT, "blocks": 2}, (2, 2))
    result = _like_one_process_and_the_interpreter(capsys, path, 4, "torch's styles cannot run its tensor axis")
    assert "replicate over dp" in result["lowering"], result["lowering"]


def test_model_is_refused_with_the_torch_runtime(tmp_path, capsys):
    """--model (a module of the user's own) is refused with --runtime torch before any rank starts."""
    gpt = build_example("gpt", GPT, LIBRARY)
    path = _write(tmp_path, "tp", mesh_plans.plan_dict(gpt, megatron_pcg(gpt, LIBRARY, (1, 2))))
    code, _, err = _run(capsys, path, "--runtime", "torch", "--model", "x.py:make")
    assert code == 1 and "--model is not supported with --runtime torch" in err, err


def test_micro_batches_of_an_unknown_step_are_refused_before_any_rank_starts():
    """`check_runnable`: micro-batches of a graph that is no built-in example have no known whole batch (to cut
    them from and to check against). (A pipelined plan file runs: tests/test_torch_native_pipelined_plan_file.py.)"""
    from parsat.backend.executor import ExecutionError
    from parsat.backend.torch_native.run import check_runnable

    gpt = build_example("gpt", GPT, LIBRARY)
    check_runnable(gpt)
    check_runnable(gpt.with_microbatches(2))
    mlp = mesh_plans.data_parallel_mlp(LIBRARY, 2, batch=8, d_in=6, d_hidden=4, d_out=2).graph
    with pytest.raises(ExecutionError, match="micro-batches of a graph that is no built-in example"):
        check_runnable(mlp.with_microbatches(2))


# ------------------------------------------------------------------ a plan computing otherwise than its graph

BRANCHES = dict(batch=8, d_in=6, d_hidden=4, d_out=2)
PLAN_FORM = [(6, 8), (8, 2)]            # relu(x @ concat(wa, wb)) @ wo: the right operand of each matmul
GRAPH_FORM = [(6, 4), (6, 4), (8, 2)]   # concat(relu(x @ wa), relu(x @ wb)) @ wo


class MatmulShapes(torch.overrides.TorchFunctionMode):
    """The shapes of the right operands of the `torch.matmul` calls in the forwards it surrounds (parsat's torch
    operators compute `matmul` so; autograd's backward calls no torch function)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.matmul:
            self.shapes.append(tuple(args[1].shape))
        return func(*args, **(kwargs or {}))


def traced_job(ctx, paths: dict, config) -> dict:
    """`parsat run --runtime torch`'s rank (`run.torch_rank`) on each plan file, the matmuls traced."""
    from parsat.backend.torch_native.run import torch_rank

    out = {}
    for label, path in paths.items():
        trace = MatmulShapes()
        with trace:
            out[label] = {**torch_rank(ctx, path, config), "matmuls": trace.shapes}
    return out


@pytest.mark.slow   # ~12 s of a worker; test_backend_rewritten_weights trains the same rewritten plan, fast
def test_a_rewritten_plan_runs_its_own_graph_and_trains_like_one_process_under_zero_1_2_3(tmp_path):
    """The branches MLP, optimized for dp=2 with its output kept split over the data ranks: the plan computes
    `relu(x @ concat(wa, wb)) @ wo` (`matmul_fuse_shared_input`) where the graph computes two matmuls and joins
    them. On 2 gloo ranks, `parsat run --runtime torch`'s rank trains the plan's ZeRO-3 (`fully_shard`), ZeRO-2
    (`reshard_after_forward=False`) and ZeRO-1 (`zero.zero_optimizer`: the state sharded) forms 3 Adam steps:
    the module's forward is the plan's graph (its first forward's matmuls are the plan's two, where the
    unmodified reference's, traced next, are the graph's three), and the losses and final weights are the
    unmodified module's trained in one process (1e-9; 1e-4 asked)."""
    import parsat
    from parsat.backend.launch import LaunchConfig, launch
    from parsat.backend.torch_native.lowering import rewritten_nodes
    from parsat.backend.training_data import TrainConfig
    from parsat.ir.plan import pcg_from_dict

    graph = build_example("branches", BRANCHES, LIBRARY)
    paths = {}
    for zero in (3, 2, 1):
        plan = parsat.optimize(graph, machine="cpu", devices=2, degrees={"dp": 2, "zero": zero}, baselines=False,
                               output_spreads={"mm_out": {"shard": [2, 1]}}).to_dict()
        assert rewritten_nodes(pcg_from_dict(plan), graph), zero
        paths[f"zero{zero}"] = str(_write(tmp_path, f"zero{zero}", plan))
    config = TrainConfig(steps=3, optimizer="adam", lr=0.01, check=True, tolerance=1e-9)
    results = launch(traced_job, (paths, config), LaunchConfig(nproc=2, backend="gloo", timeout_s=600))
    how = {"zero3": ("fully_shard over dp", "Adam"),
           "zero2": ("reshard_after_forward=False", "Adam"),
           "zero1": ("the plan's ZeRO-1", "ZeroOneOptimizer")}
    for result in results:
        for label, (lowered, optimizer) in how.items():
            run = result[label]
            assert [tuple(s) for s in run["matmuls"][:5]] == PLAN_FORM + GRAPH_FORM, (label, run["matmuls"])
            assert "forward: the plan's graph" in run["lowering"] and lowered in run["lowering"], run["lowering"]
            assert run["optimizer"] == optimizer and run["not_dtensor"] == [], (label, run)
            assert run["check"] == "passed" and run["max_rel_diff"] <= 1e-9, (label, run)


def test_a_rewritten_example_whose_loss_is_fixed_at_the_global_batch_computes_it_at_the_local_batch():
    """The built-in gpt's dp=2 plan computes otherwise than its graph (`add_commute`, ...), and its loss scales by
    1 / the plan's batch count (`GraphModule.batch_fixed`): the rewritten forward computes that scale at each rank's
    local batch (`rewritten.local_attrs`: twice the constant on 2 data ranks), so the ranks' mean is the plan's."""
    import parsat
    from parsat.backend.executor import seeded_weights
    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.lowering import lower
    from parsat.backend.torch_native.rewritten import lowered_rewrite
    from parsat.backend.torch_native.run import GraphImport, GraphModule
    from parsat.backend.training_data import TrainConfig
    from parsat.ir.plan import pcg_from_dict

    gpt = build_example("gpt", GPT, LIBRARY)
    pcg = pcg_from_dict(parsat.optimize(gpt, machine="cpu", devices=2, degrees={"dp": 2}, baselines=False).to_dict())
    module = GraphModule(gpt, seeded_weights(gpt, TrainConfig()), LIBRARY)
    assert module.batch_fixed() == ("loss",)
    lowering, rewrite = lowered_rewrite(pcg, gpt, lower(pcg, gpt, module_info(module, module.param_names)),
                                        GraphImport.of(module))
    assert rewrite is not None and "forward: the plan's graph" in lowering.describe(), lowering.describe()
    plan_loss = next(n for n in pcg.nodes if n.origin == "loss")
    step = next(s for s in rewrite.steps if s.node == plan_loss.id)
    assert dict(step.attrs)["c"] == 2 * dict(plan_loss.attrs)["c"], (step, plan_loss)
    branches = GraphModule(build_example("branches", BRANCHES, LIBRARY), {}, LIBRARY)
    assert branches.batch_fixed() == () and GraphImport.of(branches).local_attrs(2) == {}
