"""HF GPT-2's fused q, k, v projection (`c_attn`, one Conv1D [h, 3h]) under a pinned tensor axis.

The import computes `c_attn` on [batch x seq, hidden] rows, views the product as [batch, seq, 3h] and cuts
q, k, v out of the view with `split`. `split_of_unflatten_later_dim` (parsat/rules/algebraic.rule, proved
for every rank) moves the cut before the view, where `split_linear_features` reads it as a product of the
weight's column slices. A pinned `tp` splits every contraction's weight, GPT-2's position table `wpe` too,
whose lookup reads a constant one-hot (no batch dim): it is split along its vocabulary with the table
(`strategies._constant_lookups`); before, the pinned search had no joint plan at all and answered with the
grid's point. The joint plan still does not keep each rank's heads (a strided block of the fused weight); the
grid lays the fused projection out head by head, storing the weight through a view
(tests/test_heads_ordered_projection.py, docs/TORCH_NATIVE.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import parsat
from parsat.dsl.library import load_library
from parsat.egraph.runner import Limits
from parsat.egraph.saturate import saturate
from parsat.ir.graph import GraphBuilder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


@pytest.mark.parametrize("without,reached", [("", True), ("split_of_unflatten_later_dim", False)])
def test_a_cut_of_a_viewed_product_is_the_product_of_the_weight_s_column_slices(without, reached):
    """linear [6, 12] viewed as [2, 3, 12], its columns 4..7 cut: after saturation with the algebraic rules alone
    on one device the cut's e-class holds the view of `linear(x, split(w, 1, 4, 4), split(b, 0, 4, 4))`; without
    `split_of_unflatten_later_dim` it does not (the cut stays on the view)."""
    library = load_library()[0]
    g = GraphBuilder(library, name="fused")
    x, w, b = g.input("x", [6, 4]), g.weight("w", [4, 12]), g.weight("b", [12])
    view = g.op("unflatten", g.op("linear", x, w, b), dim=0, k=3)
    g.output(g.op("split", view, dim=2, start=4, size=4, name="q"))
    graph = g.build()
    algebraic = [r for r in library.rules if Path(str(r.span.file)).name == "algebraic.rule" and r.name != without]
    result = saturate(graph, library, algebraic, 1, Limits(iterations=8))
    snap, cls = result.snapshot, result.classes

    def made_by(cid: int, op: str) -> list:
        return [n for n in snap.classes[cid] if n.op == op]

    def slice_of(cid: int, leaf: str, dim: int) -> bool:
        return any(n.children == (cls[leaf],) and tuple(n.attrs[:3]) == (dim, 4, 4) for n in made_by(cid, "split"))

    found = [lin for view in made_by(cls["q"], "unflatten") for lin in made_by(view.children[0], "linear")
             if lin.children[0] == cls["x"] and slice_of(lin.children[1], "w", 1) and slice_of(lin.children[2], "b", 0)]
    assert bool(found) == reached, [n.op for n in snap.classes[cls["q"]]]


@pytest.fixture(scope="module")
def gpt2_graph():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
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
    onehot = next(n for n in data["nodes"]   # the position one-hot: no batch dim, 32 of 64 positions
                  if n["kind"] == "leaf" and n["role"] == "input" and n["shape"] == [1, 32, 64])
    readers = [n for n in data["nodes"] if onehot["id"] in n["inputs"]]
    assert [(n["op"], n["attrs"]["dim"], n["attrs"]["axis"]) for n in readers] == [("partition", 2, "tp")]


def test_the_pinned_plan_is_never_worse_than_the_grid_point(gpt2_graph):
    data = parsat.optimize(gpt2_graph, machine="cpu", devices=2, degrees={"tp": 2}).to_dict()
    assert data["totals"]["time_s"] <= data["baselines"]["best_grid"]["time_s"] + 1e-12
    assert data["extraction"]["candidates"], data["extraction"]   # the joint plan was extracted and compared
