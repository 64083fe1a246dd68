"""Verdicts that mean what they say (issue 19): bounds, vacuity, exact numbers, limits that hold, a cache
that cannot lie."""

from __future__ import annotations

import json
import time
from fractions import Fraction
from pathlib import Path

import pytest

from parsat.cli import main
from parsat.dsl import ast
from parsat.dsl.checker import check_paths
from parsat.dsl.library import load_library
from parsat.dsl.parser import parse
from parsat.dsl.printer import format_expr
from parsat.dsl.typecheck import rank_bounded
from parsat.verifier import concrete, core, ranks
from parsat.verifier.api import verify_library, verify_paths
from parsat.verifier.cache import VerdictCache, rule_key
from parsat.verifier.verdict import Verdict

RULES = '''import "ops.rule"

# the rank is a value here: the collapse argument does not hold
op times_rank(x: [*s]) -> [*s]
  out[*i] = x[*i] * len(s)

rule rank_as_a_value:
  forall x: [*s], y: [*s]
  times_rank(add(x, y)) => add(times_rank(x), times_rank(y))

rule bounded_sums_over_a_group_dim:
  forall x: [*s, n]
  reduce_sum(add(x, x), 0) => add(reduce_sum(x, 0), reduce_sum(x, 0))

rule every_rank_relu:
  forall x: [*a, n, *b], p: degree
  where n % p == 0
  relu(partition(x, len(a), p)) => partition(relu(x), len(a), p)

rule vacuous_reduce_of_copies:
  forall x: [m, n], p: degree
  reduce(replicate(x, p), p) => x

rule vacuous_combine_of_other_dim:
  forall x: [m, n], p: degree
  where m % p == 0
  combine(partition(x, 0, p), 1, p) => x

rule never_applies:
  forall x: [m, n], p: degree
  where m % p == 0, m < 1
  partition(x, 0, p) => partition(x, 0, p)

rule right_side_needs_a_dim:
  forall x: [*s]
  relu(relu(x)) => softmax(relu(x), 0)

rule tiny_is_not_zero:
  forall x: [m, n]
  scale(x, 1e-400) => scale(x, 0.0)

rule exact_tenth:
  forall x: [m, n]
  scale(scale(x, 0.1), 10.0) => x
'''


@pytest.fixture(scope="module")
def rules(tmp_path_factory):
    path = tmp_path_factory.mktemp("honesty") / "h.rule"
    path.write_text(RULES, encoding="utf-8")
    library, errors = load_library([path])
    assert not errors
    return path, library


@pytest.fixture(scope="module")
def verdicts(rules):
    path, library = rules
    report = verify_library(library, only_files={str(path)})
    assert not report.errors
    return {v.name: v for v in report.verdicts}


# ------------------------------------------------------------------ bounded and every rank


def test_a_rule_proved_only_up_to_a_rank_is_bounded_with_the_bound_in_its_line(verdicts, rules, capsys, tmp_path,
                                                                              monkeypatch):
    verdict = verdicts["bounded_sums_over_a_group_dim"]
    assert verdict.verdict == "BOUNDED" and verdict.max_rank == ranks.MAX_RANK and not verdict.proved
    assert verdict.headline().endswith(f"BOUNDED (ranks up to {ranks.MAX_RANK})")
    monkeypatch.setenv("PARSAT_CACHE_DIR", str(tmp_path))
    path, _ = rules
    assert main(["verify", str(path), "--match", "bounded_*"]) == 1  # not PROVED: exit 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(f"BOUNDED (ranks up to {ranks.MAX_RANK})") and out[-1] == \
        "0 proved, 1 bounded, 0 refuted, 0 unknown"


def test_an_operator_that_reads_the_rank_bounds_the_proof(verdicts):
    verdict = verdicts["rank_as_a_value"]
    assert verdict.verdict == "BOUNDED" and "uses the length of a group as a value" in verdict.reason


def test_batch_like_groups_are_proved_for_every_rank(verdicts):
    verdict = verdicts["every_rank_relu"]
    assert verdict.verdict == "PROVED" and verdict.max_rank is None
    assert any("every rank" in a for a in verdict.assumptions)


def test_the_shipped_library_needs_no_rank_bound():
    library, _ = load_library(None)
    assert all(ranks.plan(rule, library.ops).max_rank is None for rule in library.rules)


def test_a_bounded_rule_never_reaches_saturation_beyond_its_ranks(rules):
    from parsat.egraph.instances import typed_instances

    _, library = rules
    rule = library.rule("bounded_sums_over_a_group_dim")
    limited = rank_bounded(rule, 3)
    assert format_expr(limited.where[-1]) == "1 + len(s) <= 3"
    assert typed_instances(limited, library.ops, {3}, {})  # rank 3: still compiled
    assert not typed_instances(limited, library.ops, {8}, {})  # rank 8: never


def test_proved_rules_keeps_bounded_rules_at_their_ranks_only(rules, monkeypatch):
    import parsat.verifier.api as verifier_api
    from parsat.api import proved_rules

    _, library = rules

    def fake(library, **_options):
        report = verifier_api.VerifyReport()
        for rule in library.rules:
            word, bound = ("BOUNDED", 2) if rule.name == "bounded_sums_over_a_group_dim" else ("VACUOUS", None)
            report.verdicts.append(Verdict(rule.name, "h.rule", 1, word, reason="x", max_rank=bound))
        return report

    monkeypatch.setattr(verifier_api, "verify_library", fake)
    kept, note = proved_rules(library, None)
    assert [r.name for r in kept] == ["bounded_sums_over_a_group_dim"]
    assert format_expr(kept[0].where[-1]) == "1 + len(s) <= 2" and "ranks up to 2" in note


# ------------------------------------------------------------------ vacuity and what check checks


@pytest.mark.parametrize("name", ["vacuous_reduce_of_copies", "vacuous_combine_of_other_dim"])
def test_a_degree_forced_to_one_is_vacuous_not_proved(verdicts, name):
    verdict = verdicts[name]
    assert verdict.verdict == "VACUOUS" and "applies only when p = 1" in verdict.reason


def test_a_rule_that_never_applies_is_vacuous(verdicts):
    assert verdicts["never_applies"].verdict == "VACUOUS"
    assert "never applies" in verdicts["never_applies"].reason


def test_a_right_side_that_does_not_type_where_the_left_does_is_refuted(verdicts):
    verdict = verdicts["right_side_needs_a_dim"]
    assert verdict.verdict == "REFUTED" and "does not type where the left does" in verdict.reason
    assert verdict.counterexample.groups == {"s": 0}


def test_verify_never_proves_what_check_rejects(rules, verdicts):
    path, _ = rules
    rejected = {d.message.split(":")[0].removeprefix("rule ") for d in check_paths([path]).diagnostics}
    assert {"vacuous_reduce_of_copies", "vacuous_combine_of_other_dim", "never_applies"} <= rejected
    for name in rejected:
        assert verdicts[name].verdict != "PROVED", name


# ------------------------------------------------------------------ exact numbers


def test_real_literals_are_exact_rationals(verdicts):
    assert verdicts["tiny_is_not_zero"].verdict == "REFUTED"
    assert "2e-400 vs 0" in verdicts["tiny_is_not_zero"].reason
    assert verdicts["exact_tenth"].verdict == "PROVED"
    literal = parse("rule r:\n  forall x: [n]\n  scale(x, 1e-400) => x\n").rules[0].lhs.args[1]
    assert literal == ast.Num(Fraction(1, 10 ** 400)) and format_expr(literal) == "1e-400"


# ------------------------------------------------------------------ limits


def test_timeout_bounds_the_whole_verdict(rules, monkeypatch):
    """A slow concrete search and a slow prover both stop at the one deadline."""
    _, library = rules
    slow_trial = concrete.trial

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return slow_trial(*args, **kwargs)

    monkeypatch.setattr(concrete, "trial", slow)
    start = time.monotonic()
    verdict = core.verify_rule(library.rule("every_rank_relu"), library.ops, timeout=0.6)
    assert time.monotonic() - start < 2.0 and verdict.verdict == "UNKNOWN" and "timeout" in verdict.reason


def test_the_shrinker_ends_and_every_step_shrinks(rules, monkeypatch):
    """An int at 0 next to others: the pairwise step may not raise it back to 1 (the old endless loop)."""
    library, _ = load_library(None)
    rule = parse('rule r:\n  forall x: [n, c, h, w], k: [o, c, r, s], pad: int\n  where h >= r, w >= s\n'
                 '  conv2d(x, k, 1, pad) => conv2d(x, k, 1, 0)\n').rules[0]
    from parsat.dsl.typecheck import type_rule

    instance = type_rule(rule, library.ops, {})
    sizes = dict(n=3, c=3, h=6, w=6, o=3, r=2, s=2, pad=2)
    failure = concrete.replay(instance, sizes)
    assert failure is not None
    seen = []
    replay = concrete.replay

    def recording(inst, at, seeds=3):
        found = replay(inst, at, seeds)
        if found is not None:
            seen.append(sum(at.values()))
        return found

    monkeypatch.setattr(concrete, "replay", recording)
    small = concrete.shrink(instance, failure)
    assert all(a > b for a, b in zip(seen, seen[1:])) and small.sizes["pad"] == 1
    assert sum(small.sizes.values()) < sum(sizes.values())


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "0"])
def test_timeout_must_be_finite_and_positive(value, rules, capsys):
    path, _ = rules
    assert main(["verify", str(path), "--timeout", value]) == 2
    assert "--timeout must be a positive number of seconds" in capsys.readouterr().err


def test_json_streams_each_verdict_as_it_is_decided(rules, capsys, tmp_path, monkeypatch):
    """Interrupted after the first rule, the first record is already out."""
    monkeypatch.setenv("PARSAT_CACHE_DIR", str(tmp_path))
    path, _ = rules
    calls = []
    real = core.verify_rule

    def one_then_stop(rule, ops, **kwargs):
        if calls:
            raise KeyboardInterrupt
        calls.append(rule.name)
        return real(rule, ops, **kwargs)

    monkeypatch.setattr("parsat.verifier.api.verify_rule", one_then_stop)
    assert main(["verify", str(path), "--json", "--no-cache"]) == 130  # interrupted
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["name"] == calls[0]


# ------------------------------------------------------------------ the cache


def _cached(rules, tmp_path, name):
    path, library = rules
    cache = VerdictCache(tmp_path / "cache")
    report = verify_library(library, match=[name], cache=cache, only_files={str(path)})
    key = rule_key(library.rule(name), library.ops, core.VERSION)
    entry = cache._path(key)
    assert entry.exists()
    return library, cache, key, entry, report.verdicts[0]


def _rewrite(entry: Path, change, recompute_checksum: bool) -> None:
    """Edit a cache entry; with `recompute_checksum`, as a careful forger would (consistent again)."""
    from parsat.verifier.cache import _checksum

    record = json.loads(entry.read_text())
    change(record["verdict"])
    if recompute_checksum:
        record["checksum"] = _checksum(record["key"], record["timeout"], record["verdict"])
    entry.write_text(json.dumps(record))


def _again(rules, cache, name):
    path, library = rules
    return verify_library(library, match=[name], cache=cache, only_files={str(path)})


@pytest.mark.parametrize("change,checksum_fixed,why", [
    (lambda v: v.update(verdict="PROVED"), False, "checksum does not match"),
    (lambda v: v.update(verdict="PROVED"), True, "PROVED verdict with a counterexample"),
    (lambda v: v.update(verdict="proved", counterexample=None), True, "unknown verdict word"),
    (lambda v: v["counterexample"].update(inputs={"x": [[0]]}), True, "does not fail when replayed"),
])
def test_a_tampered_refuted_entry_is_ignored_reported_and_recomputed(rules, tmp_path, change, checksum_fixed, why):
    _, cache, key, entry, first = _cached(rules, tmp_path, "tiny_is_not_zero")
    assert first.verdict == "REFUTED"
    _rewrite(entry, change, recompute_checksum=checksum_fixed)
    report = _again(rules, cache, "tiny_is_not_zero")
    assert report.verdicts[0].verdict == "REFUTED" and not report.verdicts[0].cached
    assert any(why in p for p in report.cache_problems), report.cache_problems


def test_a_corrupt_entry_is_reported_and_a_sound_one_reused(rules, tmp_path):
    _, cache, key, entry, _ = _cached(rules, tmp_path, "exact_tenth")
    again = _again(rules, cache, "exact_tenth")
    assert again.verdicts[0].cached and not again.cache_problems
    entry.write_text("{not json")
    report = _again(rules, cache, "exact_tenth")
    assert report.verdicts[0].verdict == "PROVED" and not report.verdicts[0].cached and report.cache_problems


def test_the_cli_warns_about_ignored_entries(rules, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PARSAT_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = rules
    _, cache, key, entry, _ = _cached(rules, tmp_path, "tiny_is_not_zero")
    _rewrite(entry, lambda v: v.update(verdict="PROVED", counterexample=None, reason=""), recompute_checksum=False)
    code = main(["verify", str(path), "--match", "tiny_is_not_zero"])
    captured = capsys.readouterr()
    assert code == 1 and "REFUTED" in captured.out and "warning: ignored the cached verdict" in captured.err


def test_the_key_covers_the_verifier_code(rules, monkeypatch):
    from parsat.verifier import cache as cache_module

    _, library = rules
    rule = library.rule("exact_tenth")
    before = rule_key(rule, library.ops, core.VERSION)
    monkeypatch.setattr(cache_module, "code_hash", lambda: "another verifier")
    assert rule_key(rule, library.ops, core.VERSION) != before
