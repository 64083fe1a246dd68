"""The corpora: every wrong rule REFUTED with a counterexample that replays; every true rule PROVED.

`tests/wrong_rules/` holds rules parsat must refute (at least 80, of them at
least 15 on rank-4 convolution and pooling tensors and 10 on lifted spreads:
two degrees nested on one tensor, a 2-D mesh in the degree model);
`tests/true_rules/` holds rules outside the shipped library it must prove
(at least 40). None may end UNKNOWN.
"""

from pathlib import Path

import pytest

from parsat.cli import main
from parsat.dsl import ast
from parsat.dsl.library import load_library
from parsat.dsl.typecheck import type_rule
from parsat.verifier.api import verify_library
from parsat.verifier.concrete import replay, replay_counterexample
from parsat.verifier.core import instances

WRONG = Path(__file__).parent / "wrong_rules"
TRUE = Path(__file__).parent / "true_rules"
RANK4_OPS = {"conv2d", "avgpool2d", "global_avgpool"}


def _verified(folder):
    library, errors = load_library([folder])
    assert not errors
    files = {r.span.file for r in library.rules}
    # 60 s per rule: true rules prove in a few seconds alone, but a loaded machine (CI beside other jobs) can
    # stretch one past 20 s, and a timeout is UNKNOWN, never PROVED
    return library, verify_library(library, timeout=60, only_files=files, jobs=2)


@pytest.fixture(scope="module")
def report():
    return _verified(WRONG)


@pytest.fixture(scope="module")
def true_report():
    return _verified(TRUE)


def _is_rank4(rule: ast.RuleDecl) -> bool:
    ops = {n.func for side in (rule.lhs, rule.rhs) for n in ast.walk(side) if isinstance(n, ast.Call)}
    ranks = [len(b.type.dims) for b in rule.binders if isinstance(b.type, ast.ShapeType)]
    return bool(ops & RANK4_OPS) and 4 in ranks


def _is_lifted(rule: ast.RuleDecl) -> bool:
    """Some tensor spread over two different degree symbols at once (nested parallel operators)."""
    degrees = {b.name for b in rule.binders if isinstance(b.type, ast.ScalarType) and b.type.kind == "degree"}

    def symbols_below(node) -> set[str]:
        if not isinstance(node, ast.Call) or node.func not in ("partition", "replicate"):
            return set()
        mine = {n.id for n in ast.walk(node.args[-1]) if isinstance(n, ast.Name)} & degrees
        return mine | symbols_below(node.args[0])

    return any(len(symbols_below(n)) >= 2 for side in (rule.lhs, rule.rhs) for n in ast.walk(side))


def test_corpus_is_large_enough(report):
    library, result = report
    assert len(result.verdicts) >= 80 and not result.errors
    rules = [library.rule(v.name) for v in result.verdicts]
    assert sum(_is_rank4(r) for r in rules) >= 15
    assert sum(_is_lifted(r) for r in rules) >= 10


def test_every_wrong_rule_is_refuted_with_a_counterexample(report):
    library, result = report
    for verdict in result.verdicts:
        assert verdict.verdict == "REFUTED", verdict.render()
        cex = verdict.counterexample
        assert cex is not None and cex.sizes is not None and cex.lhs_text and cex.rhs_text
        rule = library.rule(verdict.name)
        if cex.rhs == "does not type":
            continue  # the right side does not type at these ranks: nothing to replay
        # replay: the recorded counterexample (its sizes, inputs, reals) fails again, on its own
        inst = type_rule(rule, library.ops, cex.groups)
        assert replay_counterexample(inst, cex) is not None, verdict.name
        assert replay(inst, cex.sizes) is not None, verdict.name


def test_every_true_rule_is_proved(true_report):
    library, result = true_report
    assert len(result.verdicts) >= 40 and not result.errors
    for verdict in result.verdicts:
        assert verdict.verdict == "PROVED", verdict.render()
    rules = [library.rule(v.name) for v in result.verdicts]
    assert sum(_is_rank4(r) for r in rules) >= 5 and sum(_is_lifted(r) for r in rules) >= 10


NAMED = ["relu_commuted_with_reduce", "softmax_partitioned_along_its_dim", "combine_on_the_wrong_dim",
         "combine_degree_mismatch", "transpose_swaps_wrong_dims", "layernorm_partitioned_along_normalized_dim",
         "split_concat_wrong_boundary", "matmul_contraction_without_reduce",
         # the audit's kinds (issue 19): each its own wrong rule here
         "avgpool_rows_windows_cross_blocks", "ksplit_operands_split_on_different_dims",
         "add_degree_mismatch_between_inputs", "flatten_inner_dim_split", "conv_rows_split_without_halo",
         "scale_by_a_tiny_number_is_not_zero", "transpose_dims_0_5_is_not_identity",
         "relu_is_not_softmax_and_not_everywhere_defined", "mesh_bmm_operand_missing_an_axis",
         "true_up_to_rank_5_false_at_6",
         # fused causal attention: sequence blocks are not causal attention (ring attention's point)
         "attention_causal_sequence_blocks", "attention_causal_is_not_full_attention"]


def test_the_named_kinds_are_in_the_corpus(report):
    _, result = report
    names = {v.name for v in result.verdicts}
    assert set(NAMED) <= names


def test_device_counterexamples_name_the_device(report):
    """A window that crosses a block boundary: the devices compute something else, and the device is named."""
    _, result = report
    verdict = next(v for v in result.verdicts if v.name == "avgpool_rows_windows_cross_blocks")
    cex = verdict.counterexample
    assert "left side computes something else than its semantics" in cex.reason
    assert "held by device (p=" in cex.device and "local index" in cex.device
    assert cex.groups == {} and cex.sizes["p"] >= 2


@pytest.mark.parametrize("name", NAMED[:4])
def test_cli_exits_1_on_a_wrong_rule(name, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PARSAT_CACHE_DIR", str(tmp_path))
    code = main(["verify", str(WRONG), "--match", name])
    out = capsys.readouterr().out
    assert code == 1
    assert "REFUTED" in out and out.strip().splitlines()[-1] == "0 proved, 1 refuted, 0 unknown"


@pytest.mark.slow
def test_prover_alone_never_proves_a_wrong_rule(report):
    """Soundness check of the lemmas: without the concrete search, z3 still doubts every legal wrong rule."""
    from parsat.dsl.checker import compare_sides
    from parsat.verifier.prove import prove_instance

    library, result = report
    for verdict in result.verdicts:
        try:
            typed = instances(library.rule(verdict.name), library.ops)
        except Exception:
            continue
        if not typed or any((p := compare_sides(i)) is not None and p.kind == "illegal-spread" for i in typed):
            continue  # illegal spreads are never sent to the prover
        statuses = [prove_instance(i, 10).status for i in typed]
        assert any(s != "proved" for s in statuses), verdict.name
