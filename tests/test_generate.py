"""`parsat generate`: enumeration, exact fingerprints, proof, pruning by saturation (issue 7).

Tiny operator sets and at most 2 operators per side, so these run in seconds.
"""

from __future__ import annotations

import pytest

from parsat.dsl.library import load_library
from parsat.dsl.printer import format_expr
from parsat.saturate import enumerate as enum
from parsat.saturate.generate import Deriver, Settings, generate, make_rule, verify_all, _typed
from parsat.dsl.parser import parse


@pytest.fixture(scope="module")
def library():
    return load_library(None)[0]


def _texts(result):
    return {format_expr(r.lhs) + " => " + format_expr(r.rhs) for r in result.rules}


@pytest.fixture(scope="module")
def relu_parallel(library):
    settings = Settings(("relu", "partition", "combine", "replicate"), max_ops=2, degrees=(2, 3), seconds=60)
    return generate(library, settings)


def test_finds_known_true_rules(relu_parallel):
    texts = _texts(relu_parallel)
    assert "relu(partition(x, 0, p)) => partition(relu(x), 0, p)" in texts
    assert "relu(replicate(x, p)) => replicate(relu(x), p)" in texts
    assert "combine(partition(x, 1, p), 1, p) => x" in texts
    assert "relu(relu(x)) => relu(x)" in texts
    s = relu_parallel.summary
    assert s.kept == len(relu_parallel.rules) and s.proved >= s.kept and s.terms_built > 0


def test_written_rules_parse_check_and_carry_a_comment(relu_parallel, library, tmp_path):
    from parsat.dsl.checker import check_paths

    path = tmp_path / "gen.rule"
    path.write_text(relu_parallel.text(["relu"]))
    report = check_paths([str(path)])
    assert report.ok, [d.render() for d in report.diagnostics]
    rules = [r for r in report.library.rules if r.name.startswith("gen_")]
    assert len(rules) == len(relu_parallel.rules)
    assert all(r.doc and r.doc[0].startswith("Generated:") for r in rules)


def test_introduction_rule_gets_a_where(library):
    vocab = enum.vocabulary(["relu", "partition", "combine"], library.ops)
    lhs = parse("rule r: forall x: [m, k] relu(x) => x").items[0].lhs
    rhs = parse("rule r: forall x: [m, k], p: degree x => combine(relu(partition(x, 0, p)), 0, p)").items[0].rhs
    rule = make_rule(vocab, lhs, rhs, "intro")
    assert rule is not None and [format_expr(w) for w in rule.where] == ["m % p == 0"]
    assert verify_all([rule], library.ops, 10.0, 1)[0][0] == "PROVED"


def test_fingerprints_are_exact_and_separate_unequal_terms(library):
    vocab = enum.vocabulary(["add", "relu"], library.ops)
    envs = enum.environments(vocab, [2], 2)
    result = enum.enumerate_terms(vocab, 2, envs, 4)
    by_text = {t.text: key for key, terms in result.groups.items() for t in terms}
    assert by_text["add(x, y)"] == by_text["add(y, x)"]
    assert by_text["add(x, relu(y))"] != by_text["add(relu(x), y)"]
    assert by_text["relu(x)"] != by_text["x"]


def test_a_false_pair_is_never_written(library, monkeypatch):
    """Fingerprints that ignore values put false pairs in one group: the verifier must reject them."""

    def coarse(self, instance):
        return repr((len(instance.lhs.shape), str(instance.lhs.spread))), []

    monkeypatch.setattr(enum.Evaluator, "fingerprint", coarse)
    result = generate(library, Settings(("relu",), max_ops=2, degrees=(2,), seconds=60))
    texts = _texts(result)
    assert "relu(x) => x" not in texts
    assert result.summary.refuted >= 1
    assert all(v == "PROVED" for v, _ in verify_all(list(result.rules), library.ops, 10.0, 1))


def test_pruning_drops_a_derivable_rule(library):
    vocab = enum.vocabulary(["relu", "partition"], library.ops)
    text = """
rule a: forall x: [m, k], p: degree
  relu(partition(x, 0, p)) => partition(relu(x), 0, p)
rule b: forall x: [m, k]
  relu(relu(x)) => relu(x)
rule c: forall x: [m, k], p: degree
  relu(relu(partition(x, 0, p))) => partition(relu(x), 0, p)
"""
    a, b, c = parse(text).items
    target = _typed(c, library)
    assert not Deriver(library, [a]).derives(target)
    assert Deriver(library, [a, b]).derives(target)


def test_generate_prunes_with_library(library):
    settings = Settings(("relu", "partition", "combine"), max_ops=2, degrees=(2,), seconds=60, prune_with_library=True)
    result = generate(library, settings)
    assert "relu(partition(x, 0, p)) => partition(relu(x), 0, p)" not in _texts(result)
    assert result.summary.pruned > 0


def test_cli_reports_unknown_operator(capsys, tmp_path):
    from parsat.cli import main

    assert main(["generate", "--ops", "relu,nope", "-o", str(tmp_path / "x.rule")]) == 1
    assert "unknown operator" in capsys.readouterr().err


def test_spread_inputs_are_leaves_and_split_reaches_the_extent(library):
    vocab = enum.vocabulary(["relu", "concat", "split", "partition"], library.ops)
    envs = enum.environments(vocab, [2, 3], 2)
    result = enum.enumerate_terms(vocab, 1, envs, 27)
    ops: dict[str, int] = {}
    for terms in result.groups.values():
        for t in terms:
            ops[t.text] = min(t.ops, ops.get(t.text, t.ops))
    assert ops["partition(x, 0, p)"] == 0 and ops["partition(x, 1, p * q)"] == 0
    assert ops["relu(partition(x, 0, p))"] == 1
    assert "split(x, 0, s, m - s)" in ops          # the rest of the dim after a start
    by_text = {t.text: key for key, terms in result.groups.items() for t in terms}
    assert by_text["split(x, 0, 0, m)"] == by_text["x"]   # a whole-dim split is its argument


def test_generalise_renames_a_dim_with_the_attribute_it_feeds(library):
    from parsat.saturate.generate import Candidate, generalise

    vocab = enum.vocabulary(["concat", "split", "add"], library.ops)
    lhs = parse("rule r: forall x: [m, k], y: [m, k] split(concat(x, y, 0), 0, m, m) => y").items[0].lhs
    rhs = parse("rule r: forall y: [m, k] y => y").items[0].lhs
    rule = make_rule(vocab, lhs, rhs, "second")
    assert verify_all([rule], library.ops, 10.0, 1)[0][0] == "PROVED"
    general = generalise(Candidate(rule, 2, (0, 0, 2), ""), vocab, library, Settings(("concat", "split"))).rule
    dims = {b.name: [format_expr(d) for d in b.type.dims] for b in general.binders if b.is_tensor}
    assert dims["x"][0] != dims["y"][0]                      # independent row counts
    assert format_expr(general.lhs) == f"split(concat(x, y, 0), 0, {dims['x'][0]}, {dims['y'][0]})"
    assert verify_all([general], library.ops, 10.0, 1)[0][0] == "PROVED"


def test_batch_derivation_agrees_with_one_at_a_time(library):
    text = """
rule a: forall x: [m, k], p: degree
  relu(partition(x, 0, p)) => partition(relu(x), 0, p)
rule b: forall x: [m, k]
  relu(relu(x)) => relu(x)
rule c: forall x: [m, k], p: degree
  relu(relu(partition(x, 0, p))) => partition(relu(x), 0, p)
rule d: forall x: [m, k], p: degree
  relu(partition(x, 1, p)) => partition(relu(x), 1, p)
"""
    a, b, c, d = parse(text).items
    deriver = Deriver(library, [a, b])
    targets = [_typed(r, library) for r in (c, d)]
    assert deriver.derives_many(targets) == [deriver.derives(t) for t in targets] == [True, False]


def test_the_seconds_limit_ends_the_run_with_what_was_proved(library):
    """A run cut short keeps its smaller proved rules, says which limit stopped it and how much was left."""
    import time

    settings = Settings(("relu", "partition", "combine", "replicate"), max_ops=2, degrees=(2, 3), seconds=3)
    start = time.perf_counter()
    result = generate(library, settings)
    elapsed = time.perf_counter() - start
    assert "seconds" in result.summary.stopped, result.summary.to_text()
    assert result.summary.not_reached > 0
    assert elapsed < settings.seconds + 20, f"{elapsed:.1f} s"  # one chunk of proofs or one pruning batch past it
    assert "not reached" in result.summary.to_text()
