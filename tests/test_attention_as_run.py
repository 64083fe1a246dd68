"""Attention as a 2021 runtime ran it: `gpt`'s `unfused_attention` writes the scores out, and a search that leaves
out `fuse_causal_attention` (`without_rules`) keeps them so; without that pin the search fuses them back."""

from __future__ import annotations

import pytest

from parsat.ir.errors import GraphError, OptimizeError
from parsat.ir.models import build_example
from parsat.search.optimize import optimize

SIZES = {"blocks": 2, "batch": 4, "seq": 2048, "hidden": 512, "heads": 4, "vocab": 512}


def _ops(plan) -> set[str]:
    return {n.op for n in plan.pcg.nodes if n.kind == "op"}


def test_the_written_out_form_is_the_fused_one_unless_its_fusion_is_pinned_off():
    """Written out, causal attention is bmm, scale, softmax_causal, bmm; the search rewrites it into
    `attention_causal` (cheaper at sequence 2048), unless the rule is left out, when the scores stay and the
    step and memory are the written-out form's (more of both)."""
    graph = build_example("gpt", {**SIZES, "unfused_attention": 1})
    ops = {n.op for n in graph.nodes}
    assert "softmax_causal" in ops and "attention_causal" not in ops
    assert "attention_causal" in {n.op for n in build_example("gpt", SIZES).nodes}
    machine = "a100x8"
    fused = optimize("gpt", machine, devices=1, sizes=SIZES, pipeline=False)
    rewritten = optimize("gpt", machine, devices=1, sizes={**SIZES, "unfused_attention": 1}, pipeline=False)
    pinned = optimize("gpt", machine, devices=1, sizes={**SIZES, "unfused_attention": 1}, pipeline=False,
                      without_rules=("fuse_causal_attention",))
    assert "attention_causal" in _ops(fused) and "attention_causal" in _ops(rewritten)
    assert "attention_causal" not in _ops(pinned) and "softmax_causal" in _ops(pinned)
    assert pinned.totals.time_s > fused.totals.time_s
    assert pinned.totals.peak_memory_bytes > fused.totals.peak_memory_bytes


def test_a_bad_pin_is_refused():
    with pytest.raises(GraphError, match="unfused_attention"):
        build_example("gpt", {**SIZES, "unfused_attention": 2})
    with pytest.raises(OptimizeError, match="no rule named"):
        optimize("gpt", "a100x8", devices=1, sizes=SIZES, pipeline=False, without_rules=("no_such_rule",))
