"""`parsat generate`: enumeration, exact fingerprints, proof, pruning by saturation (issue 7).

Tiny operator sets and at most 2 operators per side, so these run in seconds.
"""

from __future__ import annotations

import pytest

from parsat.dsl.library import load_library
from parsat.dsl.parser import parse
from parsat.dsl.printer import format_expr
from parsat.generate import enumerate as enum
from parsat.generate.candidates import make_rule
from parsat.generate.derivation import Deriver, typed as _typed
from parsat.generate.generate import Settings, generate, verify_all


@pytest.fixture(scope="module")
def library():
    return load_library(None)[0]


def _texts(result):
    return {format_expr(r.lhs) + " => " + format_expr(r.rhs) for r in result.rules}


# what each vocabulary must find: relu commuting with a split (lifted to any rank) and with a copy, a split undone
KNOWN = {
    ("relu", "partition", "combine"): ("relu(partition(x, len(a), p)) => partition(relu(x), len(a), p)",
                                       "combine(partition(x, len(a), p), len(a), p) => x",
                                       "relu(relu(x)) => relu(x)"),
    ("relu", "replicate"): ("relu(replicate(x, p)) => replicate(relu(x), p)", "relu(relu(x)) => relu(x)"),
}
JOINT = ("relu", "partition", "combine", "replicate")   # both at once: ~3x the CPU of the two apart


@pytest.fixture(scope="module", params=[*KNOWN, pytest.param(JOINT, marks=pytest.mark.slow)], ids="-".join)
def relu_parallel(request, library):
    """(the operators, what `generate` found over them). Work budgets only (degrees, operators, max_ops):
    `seconds` is a safety valve that never cuts these runs, so what is found does not depend on the box."""
    return request.param, generate(library, Settings(request.param, max_ops=2, degrees=(2,), seconds=1800))


def test_finds_known_true_rules(relu_parallel):
    ops, found = relu_parallel
    texts = _texts(found)
    expected = {rule for vocabulary, rules in KNOWN.items() if set(vocabulary) <= set(ops) for rule in rules}
    assert expected and expected <= texts, expected - texts
    s = found.summary
    assert s.kept == len(found.rules) and s.proved >= s.kept and s.terms_built > 0


def test_written_rules_parse_check_and_carry_a_comment(relu_parallel, library, tmp_path):
    from parsat.dsl.checker import check_paths

    path = tmp_path / "gen.rule"
    _ops, relu_parallel = relu_parallel
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
    rule = make_rule(library.ops, vocab.binders(), lhs, rhs, "intro")
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

    def coarse(self, term, requires):
        return repr((len(term.shape), str(term.spread))), []

    monkeypatch.setattr(enum.Evaluator, "fingerprint", coarse)
    result = generate(library, Settings(("relu",), max_ops=2, degrees=(2,), seconds=1800))
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


@pytest.mark.slow
def test_generate_prunes_with_library(library):
    settings = Settings(("relu", "partition", "combine"), max_ops=2, degrees=(2,), seconds=1800,
                        prune_with_library=True)
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
    from parsat.generate.generalise import widen_sizes

    vocab = enum.vocabulary(["concat", "split", "add"], library.ops)
    lhs = parse("rule r: forall x: [m, k], y: [m, k] split(concat(x, y, 0), 0, m, m) => y").items[0].lhs
    rhs = parse("rule r: forall y: [m, k] y => y").items[0].lhs
    rule = make_rule(library.ops, vocab.binders(), lhs, rhs, "second")
    assert verify_all([rule], library.ops, 10.0, 1)[0][0] == "PROVED"
    general = widen_sizes(rule, library.ops)
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


# ------------------------------------------------------------------ widening, keys, per-operator vocabularies


def _one(text):
    return parse(text).items[0]


@pytest.mark.parametrize("text,expected", [
    ("""rule r: forall x: [m, k], w: [k, n], c: [n], p: degree
  where m % p == 0
  linear(partition(x, 0, p), replicate(w, p), replicate(c, p)) => partition(linear(x, w, c), 0, p)""",
     "linear(partition(x, len(a), p), replicate(w, p), replicate(c, p)) => partition(linear(x, w, c), len(a), p)"),
    ("""rule r: forall x: [h, m, k], y: [h, k, n], p: degree
  where h % p == 0
  bmm(partition(x, 0, p), partition(y, 0, p)) => partition(bmm(x, y), 0, p)""",
     "bmm(partition(x, len(a), p), partition(y, len(a), p)) => partition(bmm(x, y), len(a), p)"),
    ("""rule r: forall x: [m, n], p: degree
  where m % p == 0
  softmax(partition(x, 0, p), 1) => partition(softmax(x, 1), 0, p)""",
     "softmax(partition(x, len(a), p), len(a) + len(b) + 1) => partition(softmax(x, len(a) + len(b) + 1), len(a), p)"),
])
def test_lift_ranks_shifts_dim_attributes_by_the_groups_before_them(library, text, expected):
    from parsat.generate.generalise import lift_ranks

    lifted = lift_ranks(_one(text), library.ops)
    assert lifted, "no lifting found"
    assert format_expr(lifted[0].lhs) + " => " + format_expr(lifted[0].rhs) == expected
    assert verify_all([lifted[0]], library.ops, 20.0, 1)[0][0] == "PROVED"


def test_a_dim_an_attribute_points_at_is_never_folded_away(library):
    """Folding `[*a, m, *b, k, *c]` to `[*a, k, *c]` is a generalisation only when no attribute names m."""
    from parsat.generate.generalise import lift_ranks

    rule = _one("""rule r: forall x: [m, k], p: degree
  where m % p == 0, k % p == 0
  combine(partition(partition(x, 1, p), 0, p), 0, p) => partition(x, 1, p)""")
    lifted = lift_ranks(rule, library.ops)[0]
    text = format_expr(lifted.lhs)
    assert "len(a) + len(b) + 1" in text and "partition(x, len(a), p)" not in format_expr(lifted.rhs)


def test_rule_key_ignores_names_and_the_order_of_degrees(library):
    from parsat.generate.candidates import rule_identity as rule_key

    a, b, c, d = parse("""
rule a: forall x: [*a, m, *b], p: degree
  combine(partition(x, len(a), p), len(a), p) => x
rule b: forall y: [*g, k, *h], q: degree
  combine(partition(y, len(g), q), len(g), q) => y
rule c: forall x: [*s], p: degree, q: degree
  replicate(replicate(x, p), q) => replicate(x, p * q)
rule d: forall x: [*s], p: degree, q: degree
  replicate(replicate(x, q), p) => replicate(x, p * q)
""").items
    assert rule_key(a) == rule_key(b)
    assert rule_key(c) == rule_key(d)
    assert rule_key(a) != rule_key(c)


def test_rule_key_sees_that_a_product_of_degrees_commutes():
    """Names are numbered by first appearance: `p * q` read as `q * p` must not make a second identity."""
    from parsat.generate.candidates import rule_identity as rule_key

    outer_p, outer_q, mixed = parse("""
rule a: forall x: [*a, m, *b, k, *c], p: degree, q: degree
  combine(partition(partition(x, len(a), p * q), len(a) + len(b) + 1, p), len(a) + len(b) + 1, p) => partition(x, len(a), p * q)
rule b: forall x: [*a, m, *b, k, *c], p: degree, q: degree
  combine(partition(partition(x, len(a), p * q), len(a) + len(b) + 1, q), len(a) + len(b) + 1, q) => partition(x, len(a), p * q)
rule c: forall x: [*a, m, *b, k, *c], p: degree, q: degree
  combine(partition(partition(x, len(a), p * q), len(a) + len(b) + 1, q), len(a) + len(b) + 1, p) => partition(x, len(a), p * q)
""").items
    assert rule_key(outer_p) == rule_key(outer_q)
    assert rule_key(outer_p) != rule_key(mixed)


def test_operator_vocabularies_type_what_the_joint_pool_cannot(library):
    vocabs = enum.operator_vocabularies(["linear", "bmm", "layernorm", "partition", "replicate"], library.ops)
    shapes = {v.label: [i.dims for i in v.inputs] for v in vocabs}
    assert any(len(s) == 3 and len(s[2]) == 1 for label, s in shapes.items() if label.startswith("linear"))
    assert any(len(s[0]) == 3 for label, s in shapes.items() if label.startswith("bmm"))   # a batch dim
    assert all("partition" in v.names and "relu" not in v.names for v in vocabs)


def test_candidate_graph_drops_what_kept_rules_derive(library):
    from parsat.generate.derivation import CandidateGraph

    general, narrow, other = parse("""
rule g: forall x: [*a, m, *b], p: degree
  where m % p == 0
  relu(partition(x, len(a), p)) => partition(relu(x), len(a), p)
rule n: forall x: [m, k], p: degree
  where k % p == 0
  relu(partition(x, 1, p)) => partition(relu(x), 1, p)
rule o: forall x: [m, k], p: degree
  relu(replicate(x, p)) => replicate(relu(x), p)
""").items
    graph = CandidateGraph(library, [_typed(narrow, library), _typed(other, library)])
    assert graph.derived([0, 1]) == [False, False]
    graph.add_rules([general])
    graph.saturate()
    assert graph.derived([0, 1]) == [True, False]


def test_widening_stops_at_the_deadline(library):
    """Past the run's deadline a worker tries no wider form: the proved rule is kept as it is."""
    import time

    from parsat.generate.generalise import widen

    rule = _one("""rule r: forall x: [m, k], p: degree
  where m % p == 0
  relu(partition(x, 0, p)) => partition(relu(x), 0, p)""")
    proofs = []
    kept = widen(rule, library.ops, lambda r: proofs.append(r) or True, deadline=time.perf_counter())
    assert kept is rule and proofs == []
    wide = widen(rule, library.ops, lambda r: proofs.append(r) or True)
    assert wide is not rule and "len(a)" in format_expr(wide.lhs)


def test_a_plausibility_check_does_not_shrink_its_counterexample(library, monkeypatch):
    """The generator only asks whether a variant fails; shrinking a counterexample nobody reads cost minutes."""
    from parsat.verifier import concrete
    from parsat.verifier.core import refuted_concretely

    def no_shrink(*_args, **_kwargs):
        raise AssertionError("shrink called")

    monkeypatch.setattr(concrete, "shrink", no_shrink)
    wrong = _one("""rule r: forall x: [m, k], p: degree
  where m % p == 0
  relu(partition(x, 0, p)) => partition(x, 0, p)""")
    assert refuted_concretely(wrong, library.ops)


def test_the_algebraic_vocabulary_leaves_the_parallel_operators_out(library):
    vocab = enum.algebraic_vocabulary(["matmul", "add", "partition", "reduce"], library.ops)
    assert vocab is not None and vocab.names == ("matmul", "add") and not vocab.spread_leaves
    assert enum.algebraic_vocabulary(["matmul", "add"], library.ops) is None       # the joint one is that
    assert enum.algebraic_vocabulary(["partition", "reduce"], library.ops) is None


def test_a_fusion_between_terms_of_equal_size_is_a_candidate_both_ways(library):
    """`add(matmul(x, w), matmul(y, v))` and `matmul(concat(x, y, 1), concat(w, v, 0))` apply three operators
    each: neither is the smaller, so fusing is as much a candidate as unfusing."""
    from parsat.generate.candidates import Canon, commutative_ops, pairs

    vocab = enum.algebraic_vocabulary(["matmul", "add", "concat", "partition"], library.ops)
    result = enum.enumerate_terms(vocab, 3, enum.environments(vocab, [2, 3], 2), 27)
    found = {format_expr(lhs) + " => " + format_expr(rhs)
             for lhs, rhs, _key in pairs(result, Canon.of(vocab, commutative_ops(result)))}
    fused, unfused = "matmul(concat(x, y, 1), concat(w, v, 0))", "add(matmul(x, w), matmul(y, v))"
    assert f"{unfused} => {fused}" in found and f"{fused} => {unfused}" in found


MLP_OPS = ("matmul", "add", "relu", "concat", "split", "partition", "combine", "replicate", "reduce")


def test_the_recorded_generated_set_derives_nine_tenths_of_the_shipped_rules(library):
    """Issue 7's bar, on the file `parsat generate` wrote (benchmarks/generate_rules.rule): alone, by
    saturation, it derives at least 90% of the hand-written rules over its operators."""
    from pathlib import Path

    from parsat.generate.generate import derive_library

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "generate_rules.rule"
    generated = load_library([str(path)])[0]
    assert all(r.name.startswith("gen_") for r in generated.rules)
    results = derive_library(generated, library, MLP_OPS)
    considered = [r for r in results if r.instances]
    derived = [r.rule for r in considered if r.ok]
    assert len(considered) >= 70
    assert len(derived) >= 0.9 * len(considered), sorted({r.rule for r in considered} - set(derived))


def test_a_prefix_keeps_two_generated_files_apart(library):
    from parsat.generate.generate import GenerateError

    result = generate(library, Settings(("relu", "partition", "combine"), max_ops=1, degrees=(2,), seconds=30,
                                        prefix="relu_run"))
    assert result.rules and all(r.name.startswith("relu_run_") for r in result.rules)
    with pytest.raises(GenerateError, match="--prefix must be a name"):
        generate(library, Settings(("relu",), seconds=30, prefix="2 bad"))
