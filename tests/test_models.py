"""The language models among the built-in examples (parsat/ir/models.py, docs/MODELS.md): GPT, LLaMA, BERT.

Their structure (tied embedding, grouped-query attention, rotary tables,
the scalar loss), their parameter counts (a closed form per family, and
the named configurations against the published counts), `--set`
overrides and their errors, the optimizer on tiny sizes for 4 devices on
a two-node machine whose plan the backend can lay out, and (slow) a small
GPT trained on 4 CPU ranks as a 2 x 2 mesh plan with `parsat run --check`.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from parsat.cli import main
from parsat.dsl.library import load_library
from parsat.ir.graph import GraphError
from parsat.ir.machine import Machine
from parsat.ir.models import EXAMPLES, build_example, llama_ffn, parameter_count
from parsat.ir.pcg_placement import derive_placements
from parsat.search.optimize import optimize

TINY = {"blocks": 2, "hidden": 64, "heads": 4, "seq": 16, "vocab": 128, "batch": 8}
NAMED = ("gpt-1.3b", "gpt-6.7b", "gpt-13b", "gpt-175b", "llama-7b", "llama-70b", "bert-large")

# Two nodes of two devices: compute slow, links inside a node nearly free, between nodes slower, so that the
# tiny models are worth splitting over all four devices (on h100x8 they are too small to split). The 2 x 2 mesh
# is pinned (dp 2 x tp 2): a 4-device axis over both nodes all-reduces hierarchically (inside the nodes, then
# across them), which costs about what the 2 x 2 mesh's plans do, so the search is free to pick either.
TWO_BY_TWO_DEGREES = {"dp": 2, "tp": 2}
TWO_BY_TWO = Machine("two-nodes-of-two", 2, 2, peak_flops=1e8, memory_bandwidth=1e12, memory_capacity=2 ** 30,
                     intra_bandwidth=1e12, intra_latency=1e-9, inter_bandwidth=1e9, inter_latency=1e-6)


@pytest.fixture(scope="module")
def lib():
    return load_library()[0]


def _readers(graph, name):
    return [n for n in graph.nodes if name in n.inputs]


# ----------------------------------------------------------------- structure


def test_gpt_ties_the_lm_head_to_the_token_embedding(lib):
    g = build_example("gpt", TINY, lib)
    assert g.shape(g.outputs[0]) == ()
    assert dict(next(n for n in g.nodes if n.name == "loss").attrs)["c"] == pytest.approx(1 / (8 * 16))
    readers = {n.op for n in _readers(g, "wte")}
    assert readers == {"embedding", "transpose"}           # one weight, read twice
    head = next(n for n in g.nodes if n.name == "logits")
    assert head.op == "linear_nobias" and head.inputs[1] == "wte_t"
    ops = Counter(n.op for n in g.nodes)
    assert ops["layernorm"] == 2 * 2 + 1 and ops["attention_causal"] == 2 and ops["gelu_tanh"] == 2
    assert ops["logsumexp"] == 1 and ops["nll_sum"] == 1
    # fused causal attention: no [b, heads, s, s] scores are a node, no softmax or bmm is written out
    assert ops["bmm"] == 0 and ops["softmax_causal"] == 0 and ops["softmax"] == 0
    ctx = next(n for n in g.nodes if n.name == "b0_ctx")
    assert ctx.op == "attention_causal" and dict(ctx.attrs)["c"] == pytest.approx(1 / (64 // 4) ** 0.5)
    # causal attention builds its mask from positions: no [b, heads, s, s] mask is an input
    assert {leaf.name for leaf in g.leaves if leaf.role == "input"} == {"ids", "targets"}
    assert g.leaf("targets").shape == (8 * 16, 128) and g.leaf("ids").shape == (8, 16, 128)
    # pre-LN: each block's first layernorm reads the residual stream, the block output is a residual add
    assert next(n for n in g.nodes if n.name == "b1_ln1").inputs[0] == "b0_res2"


def test_llama_grouped_query_attention_rotary_and_untied_head(lib):
    g = build_example("llama", {**TINY, "heads": 8, "kv_heads": 2, "ffn": 96}, lib)
    shapes = g.shapes()
    assert shapes["b0_wq"] == (64, 64) and shapes["b0_wk"] == (64, 16) and shapes["b0_wv"] == (64, 16)
    expand = next(n for n in g.nodes if n.name == "b0_k_expand")
    assert expand.op == "broadcast" and dict(expand.attrs) == {"dim": 2, "n": 4}
    assert shapes["b0_k_shared"] == (8, 8, 16, 8)            # 2 key/value heads serve 8 query heads
    assert shapes["rope_cos"] == (1, 16, 8) and shapes["rope_cos_table"] == (16, 8)
    assert {n.op for n in _readers(g, "rope_cos_table")} == {"mul_bcast"}
    assert {n.op for n in _readers(g, "tok_embeddings")} == {"embedding"}   # untied
    assert shapes["lm_head"] == (64, 128)
    ops = Counter(n.op for n in g.nodes)
    assert ops["rmsnorm"] == 2 * 2 + 1 and ops["silu"] == 2 and ops["layernorm"] == 0
    assert ops["attention_causal"] == 2 and ops["bmm"] == 0                # fused causal attention
    assert not any(n.op in ("linear", "bias_add") for n in g.nodes)        # no biases
    # multi-head attention (kv_heads = heads) has no broadcast at all
    assert not any(n.op == "broadcast" for n in build_example("llama", TINY, lib).nodes)


def test_bert_is_post_ln_with_a_tied_masked_lm_head(lib):
    g = build_example("bert", TINY, lib)
    assert g.shape(g.outputs[0]) == ()
    assert {n.op for n in _readers(g, "wte")} == {"embedding", "transpose"}
    assert next(n for n in g.nodes if n.name == "logits").op == "linear"    # decoder with its own bias
    loss = next(n for n in g.nodes if n.name == "loss")
    assert loss.op == "scale" and dict(loss.attrs)["c"] == pytest.approx(1 / (8 * 2))  # 15% of 16 positions
    assert dict(next(n for n in build_example("bert-large", None, lib).nodes if n.name == "loss").attrs)["c"] \
        == pytest.approx(1 / (256 * 77))                          # BERT masks 77 of 512 positions
    assert next(n for n in g.nodes if n.name == "b0_ln1").inputs[0] == "b0_res1"


# ------------------------------------------------------------ parameter counts


def _gpt_params(L, h, V, s, f):
    return V * h + s * h + L * (4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h) + 2 * h


def _llama_params(L, h, V, H, KV, f):
    dh = h // H
    return 2 * V * h + L * (h * H * dh + 2 * h * KV * dh + H * dh * h + 3 * h * f + 2 * h) + h


def _bert_params(L, h, V, s, f, types=2):
    embeddings = (V + s + types) * h + 2 * h
    block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    return embeddings + L * block + h * h + h + 2 * h + V


@pytest.mark.parametrize("sizes", [TINY, {**TINY, "blocks": 3, "hidden": 96, "heads": 6, "ffn": 200}])
def test_parameter_count_formulas(lib, sizes):
    L, h, V, s = sizes["blocks"], sizes["hidden"], sizes["vocab"], sizes["seq"]
    f = sizes.get("ffn", 4 * h)
    assert parameter_count(build_example("gpt", sizes, lib)) == _gpt_params(L, h, V, s, f)
    assert parameter_count(build_example("bert", sizes, lib)) == _bert_params(L, h, V, s, f)
    H = sizes["heads"]
    got = parameter_count(build_example("llama", {**sizes, "kv_heads": H // 2}, lib))
    assert got == _llama_params(L, h, V, H, H // 2, sizes.get("ffn", llama_ffn(h)))


def test_llama_ffn_is_metas_rule():
    assert llama_ffn(4096) == 11008                                  # LLaMA-7B
    assert llama_ffn(8192, multiplier=1.3, multiple_of=4096) == 28672  # Llama 2 70B


@pytest.mark.parametrize("name", NAMED)
def test_named_configuration_matches_its_published_size(lib, name):
    example = EXAMPLES[name]
    graph = build_example(name, None, lib)
    count = parameter_count(graph)
    assert example.parameters and abs(count / example.parameters - 1) < 0.03, (count, example.parameters)
    assert graph.name == name and example.source


def test_exact_counts_of_the_released_models(lib):
    # Counts anyone can recompute from the released checkpoints' shapes (vocabularies as the papers give them):
    # LLaMA-7B 6,738,415,616 and Llama 2 70B 68,976,648,192 (Hugging Face's counts of the released weights).
    assert parameter_count(build_example("llama-7b", None, lib)) == 6_738_415_616
    assert parameter_count(build_example("llama-70b", None, lib)) == 68_976_648_192


def test_realistic_global_batches(lib):
    for name in ("gpt-1.3b", "gpt-6.7b", "gpt-13b", "gpt-175b", "llama-7b", "llama-70b"):
        assert build_example(name, None, lib).leaf("ids").shape[:2] == (512, 2048)
    assert build_example("bert-large", None, lib).leaf("ids").shape[:2] == (256, 512)


# ------------------------------------------------------------- sizes and errors


def test_every_size_of_a_named_configuration_can_be_set(lib):
    g = build_example("gpt-6.7b", {**TINY, "ffn": 100}, lib)
    assert g.shape("b1_w1") == (64, 100) and g.shape("wte") == (128, 64)
    assert not any(n.name.startswith("b2_") for n in g.nodes)
    g = build_example("gpt-6.7b", TINY, lib)
    assert g.shape("b0_w1") == (64, 256)                         # ffn follows hidden when not set
    g = build_example("llama-70b", {**TINY, "heads": 8, "ffn": 96}, lib)
    assert g.shape("b0_wk") == (64, 64)                          # the preset's 8 key/value heads stay
    assert EXAMPLES["llama-70b"].defaults()["kv_heads"] == 8


def test_bad_sizes_are_clear_errors(lib):
    with pytest.raises(GraphError, match="no size depth.*kv_heads=heads"):
        build_example("llama-7b", {"depth": 3}, lib)
    with pytest.raises(GraphError, match="not divisible by 5 heads"):
        build_example("gpt", {**TINY, "heads": 5}, lib)
    with pytest.raises(GraphError, match="cannot share 3 key/value heads"):
        build_example("llama", {**TINY, "kv_heads": 3}, lib)
    with pytest.raises(GraphError, match="even head size"):
        build_example("llama", {**TINY, "hidden": 36, "heads": 4}, lib)
    with pytest.raises(GraphError, match="size vocab must be a whole number from 1 to"):
        build_example("bert-large", {"vocab": 0}, lib)
    with pytest.raises(GraphError, match="17 masked positions do not fit in a sequence of 16"):
        build_example("bert", {**TINY, "masked": 17}, lib)


def test_list_examples_names_every_configuration_and_its_source(capsys):
    assert main(["optimize", "--list-examples"]) == 0
    out = capsys.readouterr().out
    for name in ("mlp", "transformer", "stack", "branches", "gpt", "llama", "bert") + NAMED:
        assert f"\n{name} " in "\n" + out
    assert "Table 2.1" in out and "ffn=4*hidden" in out and "kv_heads=8" in out


# ------------------------------------------------------------- the optimizer


# gpt runs in the fast suite; llama and bert (20 s each) with the slow tests
@pytest.mark.parametrize("name", ["gpt", pytest.param("llama", marks=pytest.mark.slow),
                                  pytest.param("bert", marks=pytest.mark.slow)])
def test_optimizer_splits_tiny_models_over_a_2x2_mesh(lib, name):
    sizes = {**TINY, "kv_heads": 2} if name == "llama" else TINY
    graph = build_example(name, sizes, lib)
    plan = optimize(graph, TWO_BY_TWO, lib, devices=4, baselines=False, degrees=TWO_BY_TWO_DEGREES)
    derive_placements(plan.pcg, lib.ops)                       # the backend can place every piece
    axes = {dict(n.attrs).get("axis") for n in plan.pcg.nodes if n.kind == "parallel"}
    assert plan.pcg.mesh.shape == (2, 2) and axes == set(plan.pcg.mesh.names), (plan.pcg.mesh, axes)


@pytest.mark.slow
def test_small_gpt_trains_on_a_2x2_mesh_like_one_process(lib, tmp_path, capsys):
    plan = optimize(build_example("gpt", TINY, lib), TWO_BY_TWO, lib, devices=4, baselines=False,
                    degrees=TWO_BY_TWO_DEGREES)
    assert plan.pcg.mesh.shape == (2, 2)
    path = tmp_path / "gpt.json"
    plan.save(path)
    assert main(["run", str(path), "--nproc", "4", "--check", "--steps", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["check"] == "passed" and result["nonfinite_values"] == 0
    assert set(result["comm_elements_by_axis"]) == set(plan.pcg.mesh.names)


def test_backend_feeds_the_models_data_of_the_right_form(lib):
    torch = pytest.importorskip("torch")
    from parsat.backend.executor import ONEHOT, causal_mask, data_leaves

    g = build_example("llama", {**TINY, "kv_heads": 2}, lib)
    kinds = data_leaves([(n.name, n.op, n.inputs) for n in g.nodes])
    assert kinds == {"ids": ONEHOT, "targets": ONEHOT}   # no mask input: `attention_causal` builds it
    mask = causal_mask((2, 3, 4), torch.float64)   # 3 queries, 4 keys: aligned at the end, as torch's causal mask
    assert mask[1].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert causal_mask((4, 4), torch.float64).tolist()[0] == [1, 0, 0, 0]
