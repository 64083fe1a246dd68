"""HF GPT-2's fused q, k, v projection (`c_attn`, one Conv1D [h, 3h]) under a pinned tensor axis.

The import computes `c_attn` on [batch x seq, hidden] rows, views the product as [batch, seq, 3h] and cuts
q, k, v out of the view with `split`. `split_of_unflatten_later_dim` (parsat/rules/algebraic.rule, proved
for every rank) moves the cut before the view, where `split_linear_features` reads it as a product of the
weight's column slices. A pinned `tp` splits every contraction's weight, GPT-2's position table `wpe` too,
whose lookup reads a constant one-hot (no batch dim): it is split along its vocabulary with the table
(`strategies._constant_lookups`); before, the pinned search had no joint plan at all and answered with the
grid's point. Heads-parallel attention is still not reached: each rank's heads' q, k and v columns are a
strided block of the fused weight, which no partition chain stores (docs/TORCH_NATIVE.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import parsat  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


@pytest.fixture(scope="module")
def gpt2_graph():
    import hf_models

    from parsat.importer.export import import_module

    module, inputs = hf_models.make("gpt2")
    return import_module(module, inputs, check=False).graph


def test_a_pinned_tensor_axis_gives_gpt2_a_joint_plan_that_cuts_the_fused_product_before_its_view(gpt2_graph):
    plan = parsat.optimize(gpt2_graph, machine="cpu", devices=2, degrees={"tp": 2}, baselines=False)
    data = plan.to_dict()
    assert data["extraction"]["chosen"] == "joint" and "fallback" not in data["extraction"], data["extraction"]
    assert "split_of_unflatten_later_dim" in data["rules_used"]
    nodes = {n["id"]: n for n in data["nodes"]}
    cuts = [n for n in data["nodes"] if n["op"] == "split" and nodes[n["inputs"][0]]["shape"] == [256, 384]]
    assert len(cuts) == 6   # q, k, v of both blocks, cut from the [rows, 3h] product, not from its view
    onehot = next(n for n in data["nodes"] if n["kind"] == "leaf" and n["role"] == "input" and n["shape"] == [1, 32, 64])
    readers = [n for n in data["nodes"] if onehot["id"] in n["inputs"]]
    assert [(n["op"], n["attrs"]["dim"], n["attrs"]["axis"]) for n in readers] == [("partition", 2, "tp")]


def test_the_pinned_plan_is_never_worse_than_the_grid_point(gpt2_graph):
    data = parsat.optimize(gpt2_graph, machine="cpu", devices=2, degrees={"tp": 2}).to_dict()
    assert data["totals"]["time_s"] <= data["baselines"]["best_grid"]["time_s"] + 1e-12
    assert data["extraction"]["candidates"], data["extraction"]   # the joint plan was extracted and compared
