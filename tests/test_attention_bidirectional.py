"""Fused bidirectional attention (issue 31, build 1): BERT's and ViT's attention as FlashAttention runs it.

`attention(q, k, v, c)` (rules/ops.rule) is softmax(c q k^T) v over every key, keys possibly other in number than
queries (cross-attention). `fuse_attention` (rules/algebraic.rule) proves it equal to the written-out bmm / scale /
softmax / bmm form; its heads-parallel rules and the Ulysses context-parallel rule (rules/parallel_layers.rule,
section attention) are proved, and the wrong variants (tests/wrong_rules/attention_bidirectional_wrong.rule)
refused. The cost model prices it as FlashAttention runs it: every score (twice the causal operator's FLOPs at
the same shapes), O(b s h) memory. The built-in bert builds it; the importer maps an unmasked, dropout-free SDPA
onto it (tests/test_backend_hf.py: Hugging Face ViT's `sdpa` attention, the loss the module's; tests/test_backend_fx.py
and below: SDPA without a mask, square or not). Hugging Face BERT's all-ones mask is not recognised (it stays
`softmax_masked`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parsat.cost.model import compute_cost
from parsat.dsl.library import load_library
from parsat.ir.graph import instance_for
from parsat.ir.machine import Machine
from parsat.ir.models import build_example
from parsat.ir.pcg import Degrees
from parsat.verifier.api import verify

ROOT = Path(__file__).resolve().parents[1]
PROVED = {"algebraic.rule": ["fuse_attention"],
          "parallel_layers.rule": ["attention_partition", "partition_of_attention", "attention_replicate",
                                   "introduce_attention_parallel", "attention_context_parallel"]}
OPS = load_library()[0].ops


def test_the_fused_attention_rules_are_proved_and_the_wrong_ones_refused():
    for file, names in PROVED.items():
        verdicts = {v.name: v for v in verify([ROOT / "rules" / file], match=names)}
        assert sorted(verdicts) == sorted(names)
        for name in names:
            assert verdicts[name].verdict == "PROVED", verdicts[name]
    wrong = {v.name: v for v in verify([ROOT / "tests" / "wrong_rules" / "attention_bidirectional_wrong.rule"])}
    for name in ("attention_is_not_causal_attention", "attention_softmax_over_queries",
                 "attention_context_parallel_without_combine"):
        assert wrong[name].verdict == "REFUTED" and wrong[name].counterexample is not None, wrong[name]
    # q, k and v split alike on the sequence: each block's queries would miss the other blocks' keys
    assert wrong["attention_sequence_blocks"].verdict == "ILLEGAL", wrong["attention_sequence_blocks"]


def _instance(op: str, b: int, h: int, s: int, d: int, n: int | None = None):
    n = s if n is None else n
    return instance_for(OPS[op], ((b, h, s, d), (b, h, n, d), (b, h, n, d)), {"c": d ** -0.5})


def _cost(instance, machine, degrees=None):
    degrees = degrees or Degrees.whole(4)
    return compute_cost(instance, [degrees] * 3, degrees, machine, [False] * 3)


def test_bidirectional_attention_is_priced_at_every_score_and_keeps_only_its_output():
    """Twice the causal operator's FLOPs at equal shapes (every score, no causal half), the same kept bytes (its
    output and a logsumexp per query row), the same rate and backward; cross-attention counts s x n scores."""
    machine = Machine.preset("h100x8")
    full, causal = (_cost(_instance(op, 2, 4, 512, 64), machine) for op in ("attention", "attention_causal"))
    assert full.flops == 2 * causal.flops == 2 * 2 * 4 * 512 * 512 * (64 + 64)
    assert full.activation_bytes == causal.activation_bytes
    assert full.backward_s / full.forward_s == pytest.approx(causal.backward_s / causal.forward_s)
    cross = _cost(_instance("attention", 2, 4, 512, 64, n=128), machine)
    assert cross.flops == full.flops / 4 and cross.activation_bytes == full.activation_bytes
    heads = Degrees((1, 4, 1, 1))
    split = _cost(_instance("attention", 2, 4, 512, 64), machine, heads)
    assert split.flops == full.flops / 4 and split.activation_bytes == full.activation_bytes / 4


def test_bert_builds_fused_attention_whose_memory_is_linear_in_the_sequence():
    """The built-in bert's attention is `attention` (written out with `unfused_attention` 1); what the cost model
    keeps for its backward per token is the same at sequence 1024 and 8192 (no [b, n, s, s] scores)."""
    sizes = {"blocks": 1, "batch": 1, "hidden": 256, "heads": 4, "vocab": 512}
    per_token = []
    for seq in (1024, 8192):
        graph = build_example("bert", {**sizes, "seq": seq})
        ops = [n.op for n in graph.nodes]
        assert ops.count("attention") == 1 and "softmax" not in ops and "bmm" not in ops
        node = next(n for n in graph.nodes if n.op == "attention")
        shapes = graph.shapes()
        instance = instance_for(OPS["attention"], [shapes[i] for i in node.inputs], dict(node.attrs))
        per_token.append(_cost(instance, Machine.preset("h100x8")).activation_bytes / seq)
    assert per_token[0] == per_token[1]
    written = {n.op for n in build_example("bert", {**sizes, "seq": 1024, "unfused_attention": 1}).nodes}
    assert "softmax" in written and "attention" not in written
