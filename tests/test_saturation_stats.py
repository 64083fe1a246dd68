"""What saturation reports about its rules: matches per rule, rules that never fired, seconds per ruleset.

Optimization and the rule generator run the same runner (`egraph.runner`),
so both stop by the same limits; the plan keeps every loaded rule's matches
(`saturation.rule_matches`) and `parsat optimize --stats` names the rules
that never fired.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from parsat.cli import main
from parsat.dsl.library import load_library
from parsat.generate import derivation
from parsat.ir.models import build_example
from parsat.report.explain import saturation_stats
from parsat.egraph import runner
from parsat.search.optimize import optimize
from parsat.egraph.encoding import graph_program
from parsat.egraph.program import compile_rules
from parsat.egraph.saturate import saturate
from parsat.egraph.session import Session

TEST_RULES = Path(__file__).parent / "rules_for_saturate"


@pytest.fixture(scope="module")
def small_rules():
    return load_library([TEST_RULES / "mlp.rule"])[0]


def test_every_loaded_rule_has_its_matches_and_the_fired_ones_built_the_plan(small_rules):
    graph = build_example("mlp", library=small_rules)
    result = saturate(graph, small_rules, small_rules.rules, 2)
    assert list(result.rule_matches) == [r.name for r in small_rules.rules]   # library order, every rule
    assert result.rule_matches["dp_matmul"] > 0
    assert all(isinstance(n, int) and n >= 0 for n in result.rule_matches.values())
    assert result.matches == {n: c for n, c in result.rule_matches.items() if c}
    data = result.to_dict()
    assert data["rule_matches"] == dict(result.rule_matches)
    assert set(data["ruleset_seconds"]) == {"algebraic", "parallel"}
    assert all(s >= 0 for s in data["ruleset_seconds"].values())


def test_a_rule_that_cannot_match_is_listed_as_never_fired(write_rules):
    path = write_rules("""
        import "ops.rule"
        rule relu_twice:
          forall x: [n, m]
          relu(relu(x)) => relu(x)
        rule split_relu:
          forall x: [n, m], p: degree
          where n % p == 0
          relu(x) => combine(relu(partition(x, 0, p)), 0, p)
    """)
    library = load_library([path])[0]
    plan = optimize("mlp", machine="cpu", devices=2, rules=library, baselines=False)   # every rule, unproved
    matches = plan.saturation["rule_matches"]
    assert matches["relu_twice"] == 0 and matches["split_relu"] > 0
    text = saturation_stats(plan.saturation)
    assert "never fired (1): relu_twice" in text and "split_relu" in text.split("never fired")[0]


def test_cli_stats_lists_the_rules_that_never_fired(capsys):
    code = main(["optimize", "mlp", "--devices", "2", "--machine", "cpu", "--allow-unverified", "-q", "--stats",
                 "--rules", str(TEST_RULES / "mlp.rule"), "--set", "batch=64"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("plan for 'mlp'")
    stats = out[out.index("saturation statistics:"):]
    fired = stats[:stats.index("never fired")]
    assert "dp_matmul" in fired and "never fired (" in stats


def test_the_runner_stops_a_derivation_by_the_same_limits(small_rules):
    """The generator's derivations go through the optimizer's runner: an e-node limit stops them the same way."""
    graph = build_example("mlp", library=small_rules)
    program = compile_rules(small_rules, small_rules.rules, graph.ranks(), 2, typing_cache={})
    text, _names = graph_program(graph, small_rules.ops)
    session = Session(program, text)
    steps = [chunk for ruleset in ("alg", "par") for chunk in program.chunks(ruleset)]
    tight = runner.Limits(iterations=5, enodes=session.size() + 1, seconds=30)
    done = runner.run(session, steps, tight, time.perf_counter() + 30)
    assert done.stop == runner.STOP_ENODES and done.enodes >= tight.enodes
    assert derivation.DERIVE_LIMITS == runner.Limits(iterations=6, enodes=20_000, seconds=3.0)
    assert derivation.run is runner.run
