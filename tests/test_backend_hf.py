"""Hugging Face models imported with no change to their code (slow: transformers, torch.export, 2 ranks).

The models are those of benchmarks/hf_models.py (small configs, random
weights, a wrapper returning the model's own loss). Each imported graph,
evaluated with the library's operators on the module's weights and data,
gives the module's loss; GPT-2, LLaMA and ResNet (batch norm with
synchronized statistics, max pooling) are trained data-parallel on 2 ranks
with `--check` against the unmodified module, and LLaMA with a
tensor-parallel plan (heads, projections and vocabulary split).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import hf_models  # noqa: E402

from parsat.backend.executor import evaluate_graph  # noqa: E402
from parsat.importer.export import import_module  # noqa: E402
from parsat.cli import main  # noqa: E402


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit", "resnet"])
def test_imported_graph_gives_the_models_loss(name):
    module, inputs = hf_models.make(name)
    module = module.double().eval()
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    imported = import_module(module, inputs)
    if name in ("bert", "vit"):   # their `sdpa` attention in eval (no dropout, no padding mask): fused `attention`
        ops = [n.op for n in imported.graph.nodes]
        assert ops.count("attention") == 2 and not {"bmm", "softmax", "softmax_masked"} & set(ops), ops
    leaves = {w: module.get_parameter(p).detach() for w, p in imported.weights.items()}
    leaves.update(imported.constant_values(torch.float64))
    leaves.update(imported.data_values(inputs, torch.float64))
    mask_ones = {leaf.name: torch.full(leaf.shape, 1.0 - leaf.rate, dtype=torch.float64)
                 for leaf in imported.data.values() if leaf.encoding == "dropout"}
    leaves.update(mask_ones)  # evaluation: dropout keeps everything
    got = evaluate_graph(imported.graph, leaves)[imported.graph.outputs[0]]
    with torch.no_grad():
        want = module(*inputs)
    assert abs(float(got) - float(want)) <= 1e-6 * abs(float(want))  # the models cast parts to float32


def test_resnet_in_training_mode_gives_the_models_loss_with_batch_statistics():
    module, inputs = hf_models.make("resnet")
    module = module.double().train()
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    imported = import_module(module, inputs)
    ops = {n.op for n in imported.graph.nodes}
    assert {"maxpool2d_padded", "bn_mean", "bn_var", "bn_normalize"} <= ops and len(imported.running_stats) == 7
    leaves = {w: module.get_parameter(p).detach() for w, p in imported.weights.items()}
    leaves.update(imported.constant_values(torch.float64))
    leaves.update(imported.data_values(inputs, torch.float64))
    got = evaluate_graph(imported.graph, leaves)[imported.graph.outputs[0]]
    with torch.no_grad():
        want = module(*inputs)
    assert abs(float(got) - float(want)) <= 1e-9 * abs(float(want))


MODEL_FILE = """
import sys
sys.path.insert(0, {bench!r})
import hf_models


def gpt2():
    return hf_models.make("gpt2")


def llama():
    return hf_models.make("llama")


def resnet():
    return hf_models.make("resnet")
"""


@pytest.mark.parametrize("name", ["gpt2", "llama", "resnet"])
def test_trained_data_parallel_on_two_ranks_like_the_module(name, tmp_path, capsys):
    model = tmp_path / "model.py"
    model.write_text(MODEL_FILE.format(bench=str(Path(hf_models.__file__).parent)), encoding="utf-8")
    plan = tmp_path / "plan.json"
    assert main(["optimize", f"{model}:{name}", "--devices", "2", "--machine", "h100x8", "-q", "-o", str(plan)]) == 0
    capsys.readouterr()
    code = main(["run", str(plan), "--nproc", "2", "--check", "--model", f"{model}:{name}",
                 "--plan-of", "data_parallel"])
    out = capsys.readouterr().out
    assert code == 0 and "check                passed" in out, out


def test_llama_trained_tensor_parallel_on_two_ranks_like_the_module(tmp_path, capsys):
    """A tensor-parallel plan (benchmarks/hf_models.py `tensor-parallel`): inputs pinned as copies on each device,
    a machine where splitting pays; every projection weight stored split, attention heads split."""
    import parsat

    module, inputs = hf_models.make("llama")
    graph = import_module(module, inputs).graph
    pins = {leaf.name: {"shard": [1] * len(leaf.shape), "copy": 2} for leaf in graph.leaves if leaf.role == "input"}
    plan = parsat.optimize(graph, machine=hf_models.tensor_parallel_machine("h100x8"), devices=2,
                           input_spreads=pins, baselines=False)
    path = tmp_path / "tp.json"
    plan.save(path)
    summary = hf_models.split_summary(plan.to_dict())
    # HF's sdpa attention passes the causal mask made from positions: imported as fused attention, split by heads
    assert "attention_causal" in summary["ops_on_sharded_dims"]
    assert sum(n for how, n in summary["matrices"].items() if how.startswith("partition")) >= 14
    model = tmp_path / "model.py"
    model.write_text(MODEL_FILE.format(bench=str(Path(hf_models.__file__).parent)), encoding="utf-8")
    capsys.readouterr()
    code = main(["run", str(path), "--nproc", "2", "--check", "--model", f"{model}:llama"])
    out = capsys.readouterr().out
    assert code == 0 and "check                passed" in out, out
