"""Issue 29, unit by unit: PROVED is a theorem.

* every place a group's length can hide makes a rule not uniform, and the
  shipped rules stay uniform (`verifier.uniform`);
* partial operations are undefined where the semantics says, in the
  evaluator, the normal form and z3 alike; a range with a negative bound is
  empty;
* z3's models are replayed at their own values; the search draws boundary
  sizes and non-integer reals;
* a node the spread analysis cannot place makes the rule ILLEGAL, in the
  verdict, the cache, the JSON output and the optimizer's rule chooser;
  strided windows no wider than their stride are placed;
* `optimize` warns when a cached verdict failed its checks.

The corpora of the issue (tests/wrong_rules/lengths_wrong.rule, ...) are
verified in tests/test_verifier_wrong_rules.py.
"""

from __future__ import annotations

import json
import random
import warnings
from fractions import Fraction

import numpy as np
import pytest

from parsat.dsl.library import load_library
from parsat.dsl.parallel_ops import expand_fused_rule
from parsat.dsl.parser import parse
from parsat.dsl.typecheck import rule_groups
from parsat.verifier import concrete, normal, ranks
from parsat.verifier.uniform import why_not_uniform

OPS = load_library(None, strict=False)[0].ops


def _rule(text: str):
    return parse("rule r:\n" + text).rules[0]


# ------------------------------------------------------------------ 1. lengths


def test_every_shipped_rank_polymorphic_rule_is_uniform():
    library, _ = load_library(None, strict=False)
    checked = 0
    for rule in library.rules:
        rule = expand_fused_rule(rule)
        if rule_groups(rule):
            checked += 1
            assert why_not_uniform(rule, library.ops) is None, rule.name
    assert checked > 250


PLACES = [  # (where the length hides, the rule, words the reason must say)
    ("an attribute", "forall x: [*a, n]\n  softmax(x, len(a)) => softmax(x, len(a) % 5)", "not linear"),
    ("a split size", "forall x: [*a, n]\n  split(x, len(a), 0, 1) => split(x, len(a), 0, len(a) / 3 + 1)",
     "split's 'size' is len(a) / 3 + 1"),
    ("a replicate degree", "forall x: [*a, n]\n  replicate(x, 2) => replicate(x, len(a) + 2)", "replicate's degree"),
    ("a partition dim inside the group", "forall x: [*a, n], p: degree\n  where n % p == 0\n"
                                         "  partition(x, len(a), p) => partition(x, len(a) - 1, p)", "lands inside"),
    ("a transpose dim", "forall x: [*a, m, n]\n  transpose(x, len(a), len(a) + 1) => transpose(x, len(a) - len(a) / 3, "
                        "len(a) + 1)", "transpose's 'd0'"),
    ("a reduce_sum dim moving at 4", "forall x: [*a, n]\n  reduce_sum(x, len(a)) => reduce_sum(x, len(a) - len(a) / 4)",
     "reduce_sum's 'dim'"),
    ("a constant dim reaching into a group", "forall x: [*a, n, m, k, l]\n  softmax(x, 3) => softmax(x, 3)",
     "softmax's groups fit its arguments in no way"),
    ("a dim taken for a group's last dim", "forall x: [*a]\n  reduce_sum(x, len(a) - 1) => reduce_sum(x, len(a) - 1)",
     "reduce_sum's groups fit"),
    ("the where", "forall x: [*a, n]\n  where len(a) >= 2\n  relu(x) => x", "'where'"),
    ("a shape", "forall y: [n], x: [*a, n * len(a)]\n  relu(x) => x", "shape of 'x'"),
]


@pytest.mark.parametrize("place, text, words", PLACES, ids=[p[0] for p in PLACES])
def test_a_length_in_each_place_is_not_uniform(place, text, words):
    why = why_not_uniform(_rule(text), OPS)
    assert why is not None and words in why, (place, why)


def test_a_length_in_an_operator_is_not_uniform():
    ops = dict(OPS)
    ops.update({op.name: op for op in parse("op roll(x: [*a, n], s: int) -> [*a, n]\n  out[*i, j] = x[*i, (j + s) % n]\n"
                                            "op by_rank(x: [*a, n]) -> [*a, n]\n  out[*i, j] = len(a) * x[*i, j]\n").ops})
    assert "roll's 's' is len(a)" in why_not_uniform(_rule("forall x: [*a, n]\n  roll(x, 0) => roll(x, len(a))"), ops)
    assert "by_rank's semantics" in why_not_uniform(_rule("forall x: [*a, n]\n  by_rank(x) => x"), ops)


def test_positions_written_with_lengths_are_uniform():
    for text in ("forall x: [*a, n, *b]\n  softmax(x, len(a) + len(b) - len(b)) => softmax(x, len(a))",
                 "forall x: [*a, m, *b, n, *c]\n  transpose(transpose(x, len(a), len(a) + len(b) + 1), len(a), "
                 "len(a) + len(b) + 1) => x",
                 "forall x: [m, *a, n], p: degree\n  where n % p == 0\n"
                 "  relu(partition(x, len(a) + 1, p)) => partition(relu(x), len(a) + 1, p)"):
        assert why_not_uniform(_rule(text), OPS) is None, text


def test_a_rule_that_is_not_uniform_is_proved_up_to_a_bound_only():
    plan = ranks.plan(_rule("forall x: [*a, n]\n  softmax(x, len(a)) => softmax(x, len(a) % 5)"), OPS)
    assert plan.max_rank == ranks.MAX_RANK and "not uniform" in plan.why_bounded
    assert max(i.groups["a"] for i in plan.search) >= 5  # the length where it breaks is searched


# ------------------------------------------------------------------ 2. partial operations and bounds


def _evaluate(op_text: str, inputs: dict, sizes: dict):
    from parsat.dsl.instantiate import instantiate
    from parsat.dsl.evaluate import evaluate
    from parsat.dsl.symbolic import Poly

    op = parse(op_text).ops[0]
    shapes = [[Poly.const(n) for n in np.shape(inputs[p.name])] for p in op.tensor_params]
    attrs = {k: Poly.const(v) for k, v in sizes.items()}
    return evaluate(instantiate(op, shapes, attrs), {}, inputs)


def test_the_evaluator_says_undefined_as_nan_and_empty_ranges_are_zero():
    x = np.array([0.0, 0.5, 2.0])
    out = _evaluate("op f(x: [n]) -> [n]\n  out[i] = 0 * (1 / (x[i] - 0.5))\n", {"x": x}, {})
    assert out[0] == 0 and np.isnan(out[1]) and out[2] == 0  # 0 * undefined stays undefined
    out = _evaluate("op f(x: [n]) -> [n]\n  out[i] = log(x[i])\n", {"x": x}, {})
    assert np.isnan(out[0]) and not np.isinf(out[0])  # log(0) is undefined, not -inf
    out = _evaluate("op f(x: [n]) -> [n]\n  out[i] = if i > 0 then log(x[i]) else 1\n", {"x": x}, {})
    assert out[0] == 1  # the branch not taken (log(0)) leaves no trace
    out = _evaluate("op f(x: [n], k: int) -> [n]\n  out[i] = sum(l < n - k) x[i]\n", {"x": x}, {"k": 5})
    assert list(out) == [0, 0, 0]  # n - k = -2: an empty range
    out = _evaluate("op f(x: [n], k: int) -> [n]\n  out[i] = max(l < n - k) x[i]\n", {"x": x}, {"k": 5})
    assert list(out) == [0, 0, 0]


def test_the_normal_form_multiplies_by_a_bound_only_where_it_is_not_negative():
    from parsat.dsl.symbolic import Poly

    body = normal.factor(("in", "x", (Poly.sym("@i0"),)))
    guarded = normal.sum_over("l", Poly.sym("n") - Poly.sym("k"), body)
    assert any(f[0] == "ind" for f in guarded[0][2])  # [n - k >= 0] * (n - k)
    plain = normal.sum_over("l", Poly.sym("n") + Poly.sym("k"), body)
    assert not any(f[0] == "ind" for f in plain[0][2])
    assert normal.sum_over("l", Poly.const(-3), body) == ()  # an empty sum


def test_refinement_where_the_left_side_is_undefined_anything_goes():
    left, right = np.array([np.nan, 1.0]), np.array([5.0, 1.0])
    assert concrete.first_difference(left, right) is None
    assert concrete.first_difference(right, left) == (0,)  # the right side undefined where the left is not


# ------------------------------------------------------------------ 3. z3's models, boundary sizes


def test_a_z3_model_is_replayed_at_its_own_values():
    from parsat.verifier.core import instances
    from parsat.verifier.prove import prove_instance

    rule = _rule("forall x: [*s]\n  scale(x, 0.0) => scale(reciprocal(add_scalar(x, -0.25)), 0.0)")
    (scalar, *_rest) = instances(rule, OPS, max_rank=1)
    result = prove_instance(scalar, 10)
    assert result.status == "candidate" and result.inputs == {"x": Fraction(1, 4)}
    failure = concrete.replay_model(scalar, result.model, result.inputs, result.reals)
    assert failure is not None and failure.kind == "undefined"


def test_the_search_draws_boundary_sizes_and_non_integer_reals():
    from parsat.verifier.core import instances

    rule = _rule("forall x: [n, m], p: degree, k: int\n  where n % p == 0\n"
                 "  partition(x, 0, p) => partition(x, 0, p)")
    (instance,) = instances(rule, OPS)
    drawn = list(concrete.candidate_sizes(instance, random.Random(0), 12))
    for degree in (2, 3):
        for dim in (degree - 1, degree, degree + 1):
            assert {"n": dim, "m": dim, "p": degree, "k": 0} in drawn or {"n": dim, "m": dim, "p": degree, "k": 1} \
                in drawn, (dim, degree)
    assert any(v != int(v) for v in concrete.REAL_VALUES)


# ------------------------------------------------------------------ 4. ILLEGAL


ILLEGAL_RULES = '''import "ops.rule"

rule conv_3x3_width_split_no_halo:
  forall x: [n, c, h, w], k: [o, c, 3, 3], p: degree
  where w % p == 0, h >= 3, w >= 3
  conv2d(partition(x, 3, p), replicate(k, p), 1, 0) => partition(conv2d(x, k, 1, 0), 3, p)

rule conv_1x1_padded_width_split:
  forall x: [n, c, h, w], k: [o, c, 1, 1], p: degree
  where w % p == 0
  conv2d(partition(x, 3, p), replicate(k, p), 1, 1) => partition(conv2d(x, k, 1, 1), 3, p)

rule mean_of_local_means_p2:
  forall x: [m, n]
  where m % 2 == 0
  mean(x, 0) => scale(reduce(mean(partition(x, 0, 2), 0), 2), 0.5)

rule conv_1x1_stride1_width:
  forall x: [n, c, h, w], k: [o, c, 1, 1], p: degree
  where w % p == 0
  conv2d(partition(x, 3, p), replicate(k, p), 1, 0) => partition(conv2d(x, k, 1, 0), 3, p)

rule maxpool_stride3_kernel2_rows:
  forall x: [n, c, h, w], p: degree
  where h % 3 == 0, (h / 3) % p == 0, w >= 2
  maxpool2d(partition(x, 2, p), 2, 3) => partition(maxpool2d(x, 2, 3), 2, p)

rule maxpool_1x1_stride2_rows:
  forall x: [n, c, h, w], p: degree
  where h % 2 == 0, (h / 2) % p == 0
  maxpool2d(partition(x, 2, p), 1, 2) => partition(maxpool2d(x, 1, 2), 2, p)
'''


@pytest.fixture(scope="module")
def illegal_report(tmp_path_factory):
    from parsat.verifier.api import verify_paths

    path = tmp_path_factory.mktemp("illegal") / "illegal.rule"
    path.write_text(ILLEGAL_RULES)
    return path, verify_paths([path])


def test_a_refusal_is_illegal_not_a_counterexample(illegal_report):
    _, report = illegal_report
    verdicts = {v.name: v for v in report.verdicts}
    halo = verdicts["conv_3x3_width_split_no_halo"]
    assert halo.verdict == "ILLEGAL" and halo.counterexample is None and not halo.usable
    assert "cannot place conv2d(partition(x, 3, p), replicate(k, p), 1, 0)" in halo.reason
    assert "the windows of 'z' (3 positions of 'dx') must be no wider than their stride 1" in halo.reason
    padded = verdicts["conv_1x1_padded_width_split"]
    assert padded.verdict == "ILLEGAL" and "read at z * stride + dx - pad" in padded.reason  # the read, and why
    mean = verdicts["mean_of_local_means_p2"]
    assert mean.verdict == "ILLEGAL" and "size 'n' belongs to a sharded dim" in mean.reason
    assert report.summary() == "3 proved, 3 illegal, 0 refuted, 0 unknown"


def test_strided_windows_that_tile_a_block_are_proved(illegal_report):
    """The issue's true rules that were refused: strided max pooling (stride 3 over 2 rows, 1x1 at stride 2)
    and a 1x1 stride-1 convolution split along the width (its guards `z + dx >= 0`, `z + dx < w` hold on
    every block)."""
    _, report = illegal_report
    verdicts = {v.name: v.verdict for v in report.verdicts}
    assert verdicts["maxpool_stride3_kernel2_rows"] == verdicts["maxpool_1x1_stride2_rows"] == "PROVED"
    assert verdicts["conv_1x1_stride1_width"] == "PROVED"


def test_illegal_is_one_verdict_word_everywhere(illegal_report, tmp_path, monkeypatch, capsys):
    from dataclasses import replace

    from parsat.cli import main
    from parsat.verifier.cache import validate
    from parsat.verifier.verdict import VERDICTS, Counterexample, Verdict

    path, report = illegal_report
    illegal = next(v for v in report.verdicts if v.verdict == "ILLEGAL")
    assert "ILLEGAL" in VERDICTS and validate(illegal) == ""
    assert validate(replace(illegal, counterexample=Counterexample("x"))) != ""  # no values on ILLEGAL
    assert Verdict.from_json(json.loads(json.dumps(illegal.to_json()))) == illegal
    monkeypatch.setenv("PARSAT_CACHE_DIR", str(tmp_path))
    assert main(["verify", str(path), "--json", "--match", "mean_of_local_means_p2"]) == 1
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["verdict"] == "ILLEGAL" and record["counterexample"] is None
    assert main(["verify", str(path), "--match", "mean_of_local_means_p2"]) == 1  # from the cache now
    out = capsys.readouterr().out
    assert "ILLEGAL" in out and out.strip().endswith("0 proved, 1 illegal, 0 refuted, 0 unknown")


def test_the_optimizer_never_uses_an_illegal_rule(illegal_report, tmp_path, monkeypatch):
    from parsat.api import proved_rules

    path, _ = illegal_report
    monkeypatch.setenv("PARSAT_CACHE_DIR", str(tmp_path))
    library, _ = load_library([path], strict=False)
    kept, note = proved_rules(library, allow_unverified=False)
    names = {r.name for r in kept}
    assert "conv_3x3_width_split_no_halo" not in names and "mean_of_local_means_p2" not in names
    assert "conv_1x1_stride1_width" in names
    assert "conv_3x3_width_split_no_halo (ILLEGAL)" in note


# ------------------------------------------------------------------ 5. provenance of a recomputed cache entry


def test_optimize_warns_when_it_recomputes_a_cache_entry_that_failed_its_checks(tmp_path, monkeypatch):
    from parsat.api import CacheWarning, proved_rules

    monkeypatch.setenv("PARSAT_CACHE_DIR", str(tmp_path))
    path = tmp_path / "one.rule"
    path.write_text('import "ops.rule"\nrule relu_twice:\n  forall x: [*s]\n  relu(relu(x)) => relu(x)\n')
    library, _ = load_library([path], strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        proved_rules(library, allow_unverified=False)  # cold: no warning
    entries = list((tmp_path / "verify").rglob("*.json"))
    assert entries
    for entry in entries:  # an edit without the checksum recomputed
        record = json.loads(entry.read_text())
        record["verdict"]["seconds"] = 123.0
        entry.write_text(json.dumps(record))
    with pytest.warns(CacheWarning, match="checksum does not match"):
        kept, note = proved_rules(library, allow_unverified=False)
    assert "failed their checks and were recomputed" in note
    assert "relu_twice" in {r.name for r in kept}
