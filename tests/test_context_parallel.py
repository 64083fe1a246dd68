"""Context parallelism of fused causal attention (issue 31, build 1): DeepSpeed-Ulysses as a proven rule.

`attention_causal_context_parallel` (rules/parallel_layers.rule) splits
attention's output on the sequence by all-to-all'ing q, k and v from a
sequence split to a head split, running attention heads-parallel, and
all-to-all'ing its output back. The verifier proves it and refuses the two
ways of getting it wrong (a sequence split with no exchange: each rank's
queries would see only its own keys, at local positions; and the head split
read as a sequence split, the all-to-all back left out). The search takes it
for a long sequence (LLaMA-7B, 16,384 tokens) at batch 1 on 8 devices, where it beats Megatron's
tensor + sequence parallelism (a prediction of the cost model: no GPU); a
small one trains on 2 gloo ranks as one process does (the interpreter; the
torch-native runtime refuses an all-to-all by name).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parsat.dsl.library import load_library
from parsat.ir.models import build_example
from parsat.ir.placement import shard
from parsat.search.optimize import optimize
from parsat.verifier.api import verify

ROOT = Path(__file__).resolve().parents[1]
RULE = "attention_causal_context_parallel"


def test_the_ulysses_rule_is_proved_and_its_wrong_variants_refused():
    shipped = {v.name: v for v in verify([ROOT / "rules" / "parallel_layers.rule"], match=[RULE])}
    assert shipped[RULE].verdict == "PROVED", shipped[RULE]
    wrong = {v.name: v for v in verify([ROOT / "tests" / "wrong_rules" / "attention_context_parallel_wrong.rule"])}
    no_exchange = wrong["attention_causal_sequence_split_without_exchange"]
    assert no_exchange.verdict == "ILLEGAL" and "local instead of global positions" in no_exchange.reason, no_exchange
    no_combine = wrong["attention_causal_context_parallel_without_combine"]
    assert no_combine.verdict == "REFUTED" and no_combine.counterexample is not None, no_combine


@pytest.mark.slow
def test_the_search_splits_long_sequence_attention_by_ulysses_all_to_alls():
    library = load_library()[0]
    graph = build_example("llama", {"batch": 1, "seq": 16384}, library)
    plan = optimize(graph, machine="h100x8", devices=8, rules=library)
    attentions = [n for n in plan.pcg.nodes if n.op == "attention_causal"]
    moves = _moves(plan)
    heads, seq = 1, 2   # attention's operands: [batch, heads, seq, head size]
    assert attentions
    # q, k and v each all-to-all'd from the sequence split to the head split (before or after the rotary
    # embedding, which runs on either), attention on a split of the heads, its output all-to-all'd back
    assert moves.count((seq, heads)) >= 3 * len(attentions), moves
    for attention in attentions:
        assert attention.placement.codes == (shard(heads),), attention.placement
        readers = [n for n in plan.pcg.nodes if attention.id in n.inputs]
        assert [(n.op, dict(n.attrs)["dim"], dict(n.attrs)["to_dim"]) for n in readers] == [("all_to_all", heads, seq)]
        assert any(r.startswith(RULE) for r in readers[0].rules), readers[0].rules
    assert plan.totals.time_s < plan.baselines["best_grid"].time_s
    from parsat.ir.parallelism import describe
    assert "context-parallel attention (Ulysses all-to-all)" in describe(plan.pcg), describe(plan.pcg)
    # the torch-native runtime does not lower an all-to-all: it refuses the plan by name, pointing at the
    # interpreter (which runs all_to_all: tests/test_expert_parallel.py)
    pytest.importorskip("torch")
    from parsat.backend.torch_native.lowering import LoweringError, lower
    with pytest.raises(LoweringError, match="all_to_all.*interpreter"):
        lower(plan.pcg, graph, module=None)
    # Without the rule the search still all-to-alls q, k and attention's output where a class holds a combine
    # (the mesh encoding's fold, `partition(combine(x, d), e)` = `all_to_all(x, d, e)`), but not v, whose
    # projection has no sequence split made by a combine: v arrives by a row-parallel projection, a slower step.
    without = optimize(graph, machine="h100x8", devices=8, rules=library, without_rules=[RULE], baselines=False)
    assert _moves(without).count((seq, heads)) < 3 * len(attentions)
    assert plan.totals.time_s < without.totals.time_s


def _moves(plan) -> list[tuple[int, int]]:
    """Each all-to-all of the plan as (from dim, to dim)."""
    return [(dict(n.attrs)["dim"], dict(n.attrs)["to_dim"]) for n in plan.pcg.nodes if n.op == "all_to_all"]


@pytest.mark.slow
def test_a_ulysses_plan_trains_on_two_gloo_ranks_as_one_process():
    """A small LLaMA (2 blocks, hidden 64, 4 heads, 2,048 tokens, batch 1) priced on the `cpu` preset, where
    attention's s^2 work dominates: the plan all-to-alls attention's output back to the sequence split, and
    the interpreter (`run_plan`, node by node) trains it on 2 gloo ranks as one process does."""
    pytest.importorskip("torch")
    from parsat.backend.executor import TrainConfig, run_plan
    library = load_library()[0]
    sizes = {"blocks": 2, "batch": 1, "seq": 2048, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 256}
    graph = build_example("llama", sizes, library)
    plan = optimize(graph, machine="cpu", devices=2, rules=library, baselines=False)
    back = [n for n in plan.pcg.nodes if n.op == "all_to_all" and plan.pcg.node(n.inputs[0]).op == "attention_causal"]
    assert back and all(any(r.startswith(RULE) for r in n.rules) for n in back), back
    result = run_plan(plan.pcg, 2, TrainConfig(steps=2, optimizer="adam", lr=0.01, check=True, tolerance=1e-4),
                      graph=graph, backend="gloo")
    assert result.check == "passed", result
