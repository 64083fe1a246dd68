"""Verdicts are a function of the rule and the work budgets, never of the wall clock (`verifier.limits`).

A tiny `--rlimit` gives an UNKNOWN that names the budget, the same on every
run, serial or in workers, and it is cached under that budget only; each
rule's z3 work is counted in a context of its own, so the counts do not
depend on what was proved before; a machine that looks a million times
slower gets the same verdicts (counterexamples included) as long as the
wall-clock valve does not close, and when it closes the UNKNOWN says so and
is never cached.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from parsat.cli import main
from parsat.dsl.library import load_library
from parsat.verifier import core, limits, prove
from parsat.verifier.api import verify_library
from parsat.verifier.cache import VerdictCache, rule_key

TRUE = Path(__file__).parent / "true_rules" / "more_true.rule"
WRONG = Path(__file__).parent / "wrong_rules" / "parallel_wrong.rule"
RULE = "unflatten_of_flatten"   # about eight z3 queries, the largest 16,208 units: 2,000 is far too few
TINY = 2_000


@pytest.fixture(scope="module")
def library():
    lib, errors = load_library([TRUE, WRONG])
    assert not errors
    return lib


def _seen(verdict) -> str:
    """Everything a verdict says but how long it took and whether it came from the cache."""
    record = verdict.to_json()
    record.pop("seconds"), record.pop("cached")
    return json.dumps(record, sort_keys=True)


def test_a_tiny_budget_is_unknown_naming_it_the_same_on_every_run(library):
    runs = [verify_library(library, match=[RULE], rlimit=TINY, timeout=600, jobs=jobs).verdicts
            for jobs in (1, 1, 2)]
    assert all(len(run) == 1 for run in runs)
    first = runs[0][0]
    assert first.verdict == "UNKNOWN", first.render()
    assert "work budget" in first.reason and f"--rlimit {TINY:,}" in first.reason, first.reason
    assert "wall clock" not in first.reason
    assert {_seen(run[0]) for run in runs} == {_seen(first)}
    assert verify_library(library, match=[RULE], timeout=600).verdicts[0].verdict == "PROVED"  # the budget decided


def test_the_cli_takes_rlimit_and_bounds_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PARSAT_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["verify", str(TRUE), "--match", RULE, "--rlimit", str(TINY)]) == 1
    out = capsys.readouterr().out
    assert f"--rlimit {TINY:,}" in out and "1 unknown" in out
    assert main(["verify", str(TRUE), "--match", RULE, "--rlimit", "0"]) == 2
    assert "--rlimit" in capsys.readouterr().err


def test_the_cache_keys_on_the_budget(library, tmp_path):
    cache = VerdictCache(tmp_path)
    rule = library.rule(RULE)
    assert rule_key(rule, library.ops, core.VERSION, TINY) != rule_key(rule, library.ops, core.VERSION)
    short = verify_library(library, match=[RULE], rlimit=TINY, cache=cache)
    assert short.verdicts[0].verdict == "UNKNOWN"
    again = verify_library(library, match=[RULE], rlimit=TINY, cache=cache)
    assert again.verdicts[0].cached and _seen(again.verdicts[0]) == _seen(short.verdicts[0])
    full = verify_library(library, match=[RULE], cache=cache)     # the default budget: never the tiny one's entry
    assert not full.verdicts[0].cached and full.verdicts[0].verdict == "PROVED"


class _Counting(prove.Solving):
    """Records every query's count (`Solving.last`) of the rules verified while it is installed."""

    counts: list[list[int]] = []

    def __init__(self, rlimit: int):
        super().__init__(rlimit)
        _Counting.counts.append([])

    def check(self, solver, deadline, stage):
        result = super().check(solver, deadline, stage)
        _Counting.counts[-1].append(self.last)
        return result


def test_a_rules_z3_work_does_not_depend_on_the_rules_before_it(library, monkeypatch):
    """In z3's shared default context the same rule cost 16k units first and 26k after 30 other rules."""
    monkeypatch.setattr(prove, "Solving", _Counting)
    _Counting.counts = []
    rule = library.rule(RULE)
    assert core.verify_rule(rule, library.ops).verdict == "PROVED"
    alone = _Counting.counts[-1]
    for other in library.rules[:12]:
        core.verify_rule(other, library.ops)
    assert core.verify_rule(rule, library.ops).verdict == "PROVED"
    assert len(alone) >= 4 and _Counting.counts[-1] == alone


def test_a_slow_machine_gets_the_same_verdicts(library, monkeypatch):
    """Every reading of the clock 1000 s later than the last, the valve just wide enough for the readings the
    rule takes (the same count: nothing depends on the time read): nothing is cut short (not the search, not
    the cross-checks, not the shrinking of a counterexample, not z3) while the valve stays open. A search
    given a share of the valve, as it once was, would stop early here."""
    names = [RULE, "combine_on_the_wrong_dim", "matmul_contraction_without_reduce"]
    rules = [library.rule(n) for n in names]
    real, readings, now = time.monotonic, [0], [time.monotonic()]

    def counted() -> float:
        readings[0] += 1
        return real()

    def slow() -> float:
        now[0] += 1000.0
        return now[0]

    fast, valves = [], []
    for rule in rules:
        readings[0] = 0
        monkeypatch.setattr(time, "monotonic", counted)
        fast.append(_seen(core.verify_rule(rule, library.ops, timeout=600)))
        valves.append(1000.0 * (readings[0] + 0.5))
    assert [json.loads(v)["verdict"] for v in fast] == ["PROVED", "REFUTED", "REFUTED"]
    monkeypatch.setattr(time, "monotonic", slow)
    assert [_seen(core.verify_rule(r, library.ops, timeout=t)) for r, t in zip(rules, valves)] == fast


def test_the_wall_clock_valve_says_so_and_is_never_cached(library, tmp_path, monkeypatch):
    now = [time.monotonic()]

    def slow() -> float:
        now[0] += 1000.0
        return now[0]

    monkeypatch.setattr(time, "monotonic", slow)
    cache = VerdictCache(tmp_path)
    (verdict,) = verify_library(library, match=[RULE], timeout=600, cache=cache).verdicts
    assert verdict.verdict == "UNKNOWN" and limits.is_wall_clock(verdict)
    assert "--timeout 600 s" in verdict.reason and "work budget" not in verdict.reason
    assert not list(tmp_path.rglob("*.json"))
