"""The corpus of wrong rules: every one REFUTED with a replayed counterexample."""

from pathlib import Path

import pytest

from parsat.cli import main
from parsat.dsl.library import load_library
from parsat.verifier.api import verify_library
from parsat.verifier.concrete import _fails
from parsat.verifier.core import instances

WRONG = Path(__file__).parent / "wrong_rules"


@pytest.fixture(scope="module")
def report():
    library, errors = load_library([WRONG])
    assert not errors
    files = {r.span.file for r in library.rules}
    return library, verify_library(library, timeout=20, only_files=files)


def test_corpus_is_large_enough(report):
    _, result = report
    assert len(result.verdicts) >= 30 and not result.errors


def test_every_wrong_rule_is_refuted_with_a_counterexample(report):
    library, result = report
    for verdict in result.verdicts:
        assert verdict.verdict == "REFUTED", verdict.render()
        cex = verdict.counterexample
        assert cex is not None and cex.sizes is not None and cex.lhs_text and cex.rhs_text
        # replay: the counterexample's sizes fail again, independently of the search
        rule = library.rule(verdict.name)
        inst = next(i for i in instances(rule, library.ops) if dict(i.groups) == cex.groups)
        assert _fails(inst, cex.sizes) is not None, verdict.name


NAMED = ["relu_commuted_with_reduce", "softmax_partitioned_along_its_dim", "combine_on_the_wrong_dim",
         "combine_degree_mismatch", "transpose_swaps_wrong_dims", "layernorm_partitioned_along_normalized_dim",
         "split_concat_wrong_boundary", "matmul_contraction_without_reduce"]


def test_the_issue_names_are_in_the_corpus(report):
    _, result = report
    names = {v.name for v in result.verdicts}
    assert set(NAMED) <= names


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
        typed = instances(library.rule(verdict.name), library.ops)
        if any((p := compare_sides(i)) is not None and p.kind == "illegal-spread" for i in typed):
            continue  # illegal spreads are never sent to the prover
        statuses = [prove_instance(i, 10).status for i in typed]
        assert any(s != "proved" for s in statuses), verdict.name
