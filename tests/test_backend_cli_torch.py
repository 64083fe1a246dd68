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


def test_what_the_torch_path_cannot_lower_is_refused_with_the_lowering_message(tmp_path, capsys):
    """The gpt's Megatron tensor-parallel plan splits weights the graph's module holds as plain parameters (no
    nn.Linear / nn.Embedding to style): every rank refuses it, naming the node, and the job exits 1 without a
    trace; --model (a module of the user's own) is refused with --runtime torch before any rank starts."""
    gpt = build_example("gpt", GPT, LIBRARY)
    path = _write(tmp_path, "tp", mesh_plans.plan_dict(gpt, megatron_pcg(gpt, LIBRARY, (1, 2))))
    code, result, err = _run(capsys, path, "--runtime", "torch")
    assert code == 1 and result is None and "Traceback" not in err
    assert "the torch runtime cannot run this plan: weight '" in err and "tensor axis tp" in err, err
    assert "node #" in err and "run the plan with the interpreter" in err, err
    code, _, err = _run(capsys, path, "--runtime", "torch", "--model", "x.py:make")
    assert code == 1 and "--model is not supported with --runtime torch" in err, err


def test_a_pipelined_plan_or_a_micro_batched_step_is_refused_before_any_rank_starts():
    """`check_runnable`: the graph's module has no stages to cut, and the torch path trains one batch a step."""
    from parsat.backend.executor import ExecutionError
    from parsat.backend.torch_native.run import check_runnable

    gpt = build_example("gpt", GPT, LIBRARY)
    check_runnable(gpt, pipelined=False)
    with pytest.raises(ExecutionError, match="does not run a pipelined plan file"):
        check_runnable(gpt, pipelined=True)
    with pytest.raises(ExecutionError, match="runs its step as 2 micro-batches"):
        check_runnable(gpt.with_microbatches(2), pipelined=False)
