"""Sequential sums: associativity left out where every sum is a residual stream (`egraph.sums`, docs/MESH.md).

The cut must fire on GPT and LLaMA (their residual streams are chains,
each term computed from the sum before it), must not fire where a sum's
terms are independent (GPT-J's parallel block, a sum of weights) or where
a rule makes a sum the graph does not show (a product of a sum, multiplied
out, that feeds a sum), must never touch a matrix product's associativity,
and must leave the plan alone.
"""

from __future__ import annotations

import json

import pytest

import parsat
from parsat.dsl.checker import load_checked
from parsat.egraph.runner import Limits
from parsat.egraph.saturate import saturate
from parsat.egraph.sums import associativity_op, sequential_cut
from parsat.ir.graph import GraphBuilder
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example

GPT = {"blocks": 2, "hidden": 64, "heads": 4, "batch": 8, "seq": 16, "vocab": 128}


@pytest.fixture(scope="module")
def library():
    return load_checked(None)


@pytest.fixture(scope="module")
def gpt(library):
    return build_example("gpt", GPT, library)


@pytest.fixture(scope="module")
def gpt_saturated(gpt, library, kept_programs):
    """The GPT saturated without the cut on a two-axis mesh: its program is the one whose rules the cut is checked against, and its
    e-graph the one the cut's is compared with."""
    return saturate(gpt, library, library.rules, Mesh.of((2, 2)), caches=kept_programs)


def _rule(library, name):
    return next(rule for rule in library.rules if rule.name == name)


def _program_rules(result, library):
    """The library rules `result`'s mesh program compiled (what `saturate` checks the cut against)."""
    names = {r.name for r in result.program.rules}
    return [rule for rule in library.rules if rule.name in names]


def _compiled(graph, library, caches, mesh=Mesh.of((2, 2))):
    """The library rules a mesh program for `graph` compiles (the program does not depend on the limits)."""
    return _program_rules(saturate(graph, library, library.rules, mesh, Limits(iterations=1, generations=1),
                                   caches=caches), library)


def test_only_an_elementwise_associativity_is_recognised(library):
    assert associativity_op(_rule(library, "add_assoc")) == "add"
    assert associativity_op(_rule(library, "mul_assoc")) == "mul"
    # a chain of matrix products is cheaper in one order than another: never cut
    assert associativity_op(_rule(library, "matmul_assoc_right")) is None
    assert associativity_op(_rule(library, "add_commute")) is None
    assert associativity_op(_rule(library, "mul_distribute_add")) is None


def test_a_gpt_s_residual_stream_is_cut(library, gpt, gpt_saturated):
    assert set(sequential_cut(gpt, _program_rules(gpt_saturated, library))) == {"add_assoc"}


def test_a_parallel_block_s_sum_is_not_cut(library, kept_programs):
    """GPT-J's block: x + attn(x) + mlp(x), the two branches computed from x alone, so their partial sums may
    share one reduction: the grouping can pay off."""
    g = GraphBuilder(library, "parallel_block")
    x = g.input("x", (8, 16))
    w1, w2 = g.weight("w1", (16, 16)), g.weight("w2", (16, 16))
    a = g.op("matmul", x, w1)
    m = g.op("matmul", g.op("relu", x), w2)
    g.output(g.op("add", g.op("add", x, a), m))
    graph = g.build()
    assert sequential_cut(graph, _compiled(graph, library, kept_programs, Mesh.of((2,)))) == {}


def test_a_sum_of_independent_terms_is_not_cut(library, kept_programs):
    g = GraphBuilder(library, "chain")
    total = g.input("x", (8, 16))
    for i in range(4):
        total = g.op("add", total, g.weight(f"w{i}", (8, 16)))
    g.output(g.op("relu", total))
    graph = g.build()
    assert sequential_cut(graph, _compiled(graph, library, kept_programs, Mesh.of((2,)))) == {}


def test_llama_is_cut_no_rule_makes_a_sum_there(library, kept_programs):
    """LLaMA's rope sums (`q cos + rot(q) sin`) have no sum as a term, and no product is ever taken of a sum
    (its norm is `rmsnorm`), so `mul_distribute_add`, compiled for it, never matches: its residual stream is
    cut like GPT's."""
    graph = build_example("llama", {"blocks": 2, "hidden": 64, "heads": 4, "batch": 4, "seq": 16, "vocab": 128},
                          library)
    compiled = _compiled(graph, library, kept_programs)
    assert any(rule.name == "mul_distribute_add" for rule in compiled)
    assert "add_assoc" in sequential_cut(graph, compiled)


def test_a_product_of_a_sum_that_feeds_a_sum_is_not_cut(library, kept_programs):
    """`t = w * (x + relu(x))` feeding `t + relu(t)`: `mul_distribute_add` writes `t` as a sum of products,
    which then chains into the outer sum: a sum the graph does not show, so associativity stays."""
    g = GraphBuilder(library, "distributed")
    x, w = g.input("x", (8, 16)), g.weight("w", (8, 16))
    t = g.op("mul", w, g.op("add", x, g.op("relu", x)))
    u = g.op("add", t, g.op("relu", t))
    g.output(g.op("add", u, g.op("relu", u)))   # a chain: relu(u) is computed from u
    graph = g.build()
    compiled = _compiled(graph, library, kept_programs, Mesh.of((2,)))
    assert any(rule.name == "mul_distribute_add" for rule in compiled)
    assert "add_assoc" not in sequential_cut(graph, compiled)


def test_the_cut_removes_only_sums_not_any_compute_choice(library, gpt, gpt_saturated, kept_programs):
    """With and without the cut, on a two-axis mesh: every operator application other than a sum (its op,
    attributes, its own and its inputs' local shapes and placements) is in both e-graphs, so extraction has
    the same compute choices; only sub-sums of the residual stream (and their parallel moves) are gone."""
    full = gpt_saturated
    cut = saturate(gpt, library, library.rules, Mesh.of((2, 2)), caches=kept_programs, cut_sums=True)
    assert [s.name for s in cut.program.skipped if "sequential" in s.reason] == ["add_assoc"]
    assert full.stop == cut.stop == "saturated"
    assert cut.enodes < 0.7 * full.enodes   # 6,470 against 10,938: two blocks' sum of 5 terms

    def compute(result):
        snap = result.snapshot

        def at(cid):
            return snap.shape[cid], snap.placement[cid].codes
        return {(node.op, node.attrs, at(cid), tuple(at(c) for c in node.children))
                for cid, nodes in snap.classes.items() for node in nodes
                if node.op not in ("add", "leaf") and node.op not in ("partition", "combine", "replicate", "reduce",
                                                                     "all_gather", "reduce_scatter", "all_to_all")}
    assert compute(cut) == compute(full)


def _plan(**options) -> dict:
    """The plan's JSON less its saturation statistics and how extraction went (what the cut changes)."""
    plan = parsat.optimize("gpt", machine="h100x8", devices=4, sizes=GPT, pipeline=False, **options)
    data = json.loads(plan.to_json())
    data.pop("saturation")
    return {k: v for k, v in data.items() if k != "extraction"} | {"chosen": data["extraction"]["chosen"]}


def _without_rule(value, rule: str):
    """`value` with every per-node provenance entry naming `rule` taken out."""
    if isinstance(value, dict):
        return {k: ([r for r in v if not r.startswith(rule + " ")] if k == "rules" and isinstance(v, list)
                    else _without_rule(v, rule)) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_rule(v, rule) for v in value]
    return value


def test_the_whole_call_gives_the_same_plan_with_and_without_the_cut():
    """The same plan, node for node, time for time, every baseline alike; the one difference is provenance:
    without the cut `add_assoc` also equated the residual sums' classes, and the plan's nodes name it among
    the rules that touched them (`Snapshot.rules_at`), though the plan uses none of its groupings."""
    cut, full = _plan(cut_sums=True), _plan(cut_sums=False)
    assert cut["chosen"] == full["chosen"] == "joint"
    assert "add_assoc" not in cut["rules_used"] and cut["rules_used"] == full["rules_used"]
    assert cut == _without_rule(full, "add_assoc")
