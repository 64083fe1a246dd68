"""What training keeps for backward (`cost.saved`): each value some backward reads, once.

Held against Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4 (per layer, 16-bit): s b h (34 + 5 a s / h)
without parallelism; s b h (10 + 24 / t + 5 a s / (h t)) with tensor
parallelism t; s b h (34 + 5 a s / h) / t with sequence parallelism too. With the
attention core recomputed (FlashAttention does the same: `attention_causal`
keeps q, k, v, its output and a logsumexp per row, no [s, s] matrix) the
5 a s / h terms go. Their 34 counts two dropout masks of s b h bytes (after
attention's projection and after the MLP), which parsat's `gpt` block does not
have (no dropout, as GPT-3's paper states): its figure is 32, 8 + 24 / t, 32 / t.
"""

from __future__ import annotations

from parsat.dsl.gradient import backward_reads, is_alias
from parsat.dsl.library import load_library
from parsat.ir.blocks import node_blocks
from parsat.ir.machine import PRESETS
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import gpt
from parsat.cost.saved import kept_values
from parsat.search.solve import price_pcg

LIB = load_library()[0]
S, H, A = 1024, 512, 8


def _block_bytes(t: int, sequence: bool) -> float:
    """A middle block's activation bytes per device (batch 1 per data-parallel rank), in units of s b h."""
    graph = gpt(blocks=3, batch=2, seq=S, hidden=H, heads=A, vocab=512, library=LIB)
    pcg = megatron_pcg(graph, LIB, (2, t), 8, sequence=sequence)
    costs = price_pcg(pcg, LIB, PRESETS["h100x8"].with_devices(2 * t))
    blocks = node_blocks(pcg)
    return sum(costs[n.id].activation_bytes for n in pcg.nodes if blocks.get(n.id) == 1) / (S * H)


def test_a_gpt_block_keeps_what_korthikanti_et_al_count_without_dropout():
    # the paper's terms less the two dropout masks the block does not have; lse adds 4 a / h s b h
    lse = 4 * A / H
    for t, sequence, paper in ((1, False, 32.0), (8, False, 8 + 24 / 8), (8, True, 32 / 8)):
        got = _block_bytes(t, sequence)
        assert abs(got - paper - lse / t) < 1e-6, (t, sequence, got, paper)
        assert 0.9 * paper <= got <= 1.1 * paper
    # and the paper's own formulas, masks included, within 15%
    assert abs(_block_bytes(1, False) / 34 - 1) < 0.10
    assert abs(_block_bytes(8, True) / (34 / 8) - 1) < 0.10


def test_backward_reads_follow_from_the_semantics():
    reads = {name: backward_reads(LIB.ops[name]) for name in
             ("linear", "add", "bias_add", "scale", "gelu_tanh", "layernorm", "attention_causal", "transpose")}
    assert reads["linear"] == {"x", "w"}                        # each factor for the other's gradient
    assert reads["add"] == reads["bias_add"] == reads["scale"] == reads["transpose"] == frozenset()
    assert reads["gelu_tanh"] == {"x"} and "x" in reads["layernorm"]
    assert reads["attention_causal"] == {"q", "k", "v"}
    # an operand taking no gradient is never differentiated: the loss reads the one-hot targets, not the logits
    assert backward_reads(LIB.ops["nll_sum"], frozenset({"x", "lse"})) == {"y"}
    assert is_alias(LIB.ops["transpose"]) and is_alias(LIB.ops["flatten"]) and not is_alias(LIB.ops["add"])


def test_partial_sums_and_gathered_values_are_not_kept_the_shards_are():
    graph = gpt(blocks=1, batch=2, seq=64, hidden=64, heads=4, vocab=64, library=LIB)
    pcg = megatron_pcg(graph, LIB, (2, 2), 8, sequence=True)
    held = kept_values(pcg, LIB)
    by_id = {n.id: n for n in pcg.nodes}
    sums = [n for n in pcg.nodes if n.op == "linear_nobias" and n.origin.endswith("_nobias")]
    gathers = [n for n in pcg.nodes if n.op in ("all_gather", "combine") and by_id[n.inputs[0]].op == "layernorm"]
    assert sums and not any(n.id in held for n in sums)           # read by their reduce-scatter only
    assert gathers and all(n.id in held and n.inputs[0] in held for n in gathers)
    costs = price_pcg(pcg, LIB, PRESETS["h100x8"].with_devices(4))
    for n in gathers:   # the gather keeps nothing and gathers again in backward; its shard is kept
        assert costs[n.id].activation_bytes == 0
        assert any(line.startswith("bwd all-gather") for line in costs[n.id].collectives)
        assert costs[n.inputs[0]].activation_bytes == by_id[n.inputs[0]].degrees.piece_elements(n.shape) * 2
