"""Saturation under adversarial rules and large graphs: it ends, says which limit ended it, memory stays bounded.

Rule sets written to be hostile (all are sound, so they would pass the
verifier: the danger is size, not truth):

* `add_comm`: a rule that loops (a + b => b + a => a + b ...);
* `add_comm` + `add_assoc`: the classic AC blow-up, exponential in the chain;
* `relu_double`: relu(x) = relu(3x)/4 + relu(x')/4 creates two new relu terms
  per relu term, so the e-graph doubles every iteration;
* thousands of generated rules;
* graphs of thousands of operators.

Limits are checked between chunks of rules (parsat/egraph/runner.py), and
`seconds` counts compilation too, so the overshoot is one chunk's egglog run;
the tests allow that slack and measure it. Memory: the RSS growth of this
process across the call (VmRSS).
A graph of ~2,100 operators with the shipped library once took ~56 s past a
10 s limit inside one egglog run (add_partial_matmuls's join); rules now match
their pattern before their lookups (`rule_text.RuleBody`), and the test
guards that it stays within the limit.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest

from parsat.cli import main
from parsat.dsl.library import Library, load_library
from parsat.ir.graph import Graph, GraphBuilder
from parsat.egraph import program
from parsat.egraph.runner import (STOP_ENODES, STOP_GENERATIONS, STOP_ITERATIONS, STOP_MATCHES, STOP_SATURATED,
                                  STOP_SECONDS, Limits)
from parsat.egraph.saturate import saturate

ADVERSARIAL = """\
import "ops.rule"

rule add_comm:
  forall x: [*s], y: [*s]
  add(x, y) => add(y, x)

rule add_assoc:
  forall x: [*s], y: [*s], z: [*s]
  add(add(x, y), z) => add(x, add(y, z))

rule relu_double:
  forall x: [*s]
  relu(x) => add(scale(relu(scale(x, 3.0)), 0.25), scale(relu(scale(x, 1.0)), 0.25))
"""
MIB = 2 ** 20
RSS_BOUND_MIB = 1024


def rss_mib() -> float:
    """This process's resident set now (MiB), from /proc (Linux)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        pytest.skip("no /proc/self/status")
    return int(text.split("VmRSS:")[1].split()[0]) / 1024


@pytest.fixture(scope="module")
def adversarial(tmp_path_factory) -> tuple[Library, Path]:
    path = tmp_path_factory.mktemp("rules") / "adversarial.rule"
    path.write_text(ADVERSARIAL, encoding="utf-8")
    return load_library([path])[0], path


def add_chain(library: Library, length: int) -> Graph:
    """x + w0 + w1 + ... then relu: food for add_comm/add_assoc and relu_double."""
    g = GraphBuilder(library, name=f"chain{length}")
    acc = g.input("x", [8, 8])
    for i in range(length):
        acc = g.op("add", acc, g.weight(f"w{i}", [8, 8]))
    g.output(g.op("relu", acc))
    return g.build()


def timed(graph: Graph, library: Library, names: tuple[str, ...], limits: Limits):
    rules = [r for r in library.rules if r.name in names]
    before, start = rss_mib(), time.perf_counter()
    result = saturate(graph, library, rules, 2, limits)
    return result, time.perf_counter() - start, rss_mib() - before


def test_a_looping_rule_saturates(adversarial):
    library, _ = adversarial
    result, wall, grew = timed(add_chain(library, 10), library, ("add_comm",), Limits(iterations=1000, seconds=20))
    assert result.stop == STOP_SATURATED and result.iterations <= 5
    assert wall < 10 and grew < RSS_BOUND_MIB


def test_associativity_blow_up_is_stopped_by_the_enode_limit(adversarial):
    library, _ = adversarial
    limits = Limits(iterations=1000, enodes=5_000, seconds=30, generations=1000)
    result, wall, grew = timed(add_chain(library, 10), library, ("add_comm", "add_assoc"), limits)
    assert result.stop == STOP_ENODES
    # the limit is checked between iterations: the last one may overshoot, by a bounded factor
    assert limits.enodes <= result.enodes < 20 * limits.enodes
    assert wall < limits.seconds and grew < RSS_BOUND_MIB


def test_generations_bound_the_associativity_blow_up_by_construction(adversarial):
    """The rules that make new values (add_assoc) run once per generation, the rules that only rearrange
    (add_comm) until nothing changes: two generations of the 10-add chain end on their own, far below the
    e-graph the unbounded schedule reaches, and the same twice."""
    library, _ = adversarial
    first, _wall, _ = timed(add_chain(library, 10), library, ("add_comm", "add_assoc"), Limits(generations=2))
    again, _wall, _ = timed(add_chain(library, 10), library, ("add_comm", "add_assoc"), Limits(generations=2))
    unbounded, _wall, _ = timed(add_chain(library, 10), library, ("add_comm", "add_assoc"),
                                Limits(iterations=1000, enodes=20_000, seconds=60, generations=1000,
                                       matches=10 ** 8))
    assert first.stop == STOP_GENERATIONS and unbounded.stop == STOP_ENODES
    assert first.enodes * 10 < unbounded.enodes
    assert (first.enodes, first.iterations) == (again.enodes, again.iterations)


def test_a_rule_matching_past_the_budget_is_held_back_before_it_applies_any(adversarial):
    """The third generation of the 10-add chain's associativity matches its pattern 2,422 times: with
    --limit matches=2000 it is held back before applying one, so the e-graph is the second generation's, the
    run ends `matches` (not `saturated`) and names the rule; under the default budget it applies."""
    library, _ = adversarial
    two, _wall, _ = timed(add_chain(library, 10), library, ("add_comm", "add_assoc"), Limits(generations=2))
    held, _wall, _ = timed(add_chain(library, 10), library, ("add_comm", "add_assoc"),
                           Limits(generations=3, matches=2_000))
    free, _wall, _ = timed(add_chain(library, 10), library, ("add_comm", "add_assoc"), Limits(generations=3))
    assert held.stop == STOP_MATCHES and dict(held.held_back) == {"add_assoc": 2_422}
    assert held.enodes == two.enodes < free.enodes and not free.held_back
    assert "held back past 2,000 matches in a round (--limit matches): add_assoc (2,422 matches in one round)" \
        in held.note
    assert held.to_dict()["rules_held_back"] == [{"rule": "add_assoc", "matches": 2_422}]


def test_a_doubling_rule_is_stopped_by_each_limit_and_says_which(adversarial):
    library, _ = adversarial
    graph = add_chain(library, 1)
    unbounded = 10 ** 6   # generations: the doubling rule makes new values in every one
    result, _wall, _ = timed(graph, library, ("relu_double",), Limits(iterations=6, enodes=10 ** 7, seconds=60,
                                                                      generations=unbounded))
    assert result.stop == STOP_ITERATIONS and result.iterations == 6
    result, wall, grew = timed(graph, library, ("relu_double",), Limits(iterations=10 ** 6, enodes=3_000, seconds=60,
                                                                        generations=unbounded))
    assert result.stop == STOP_ENODES and 3_000 <= result.enodes < 3 * 3_000  # at most one doubling past it
    result, wall, grew = timed(graph, library, ("relu_double",), Limits(iterations=10 ** 6, enodes=10 ** 8, seconds=0.5,
                                                                        generations=unbounded))
    assert result.stop == STOP_SECONDS
    # The loop stops at the first check past 0.5 s; the iteration that crossed it at most doubled the work, so
    # the loop itself ends by ~1 s. Reading the e-graph back (the snapshot, ~45 us per e-node in Python) is not
    # counted against `seconds`: ~1.3 s more at ~28k e-nodes (2.7 s at ~57k with seconds=1).
    assert result.seconds < 2, f"the loop ran {result.seconds:.1f} s with seconds=0.5"
    assert wall < 15, f"seconds=0.5 took {wall:.1f} s in all"
    assert grew < RSS_BOUND_MIB


def test_chunked_rulesets_saturate_alike_and_stop_between_chunks(adversarial, monkeypatch):
    library, _ = adversarial
    graph = add_chain(library, 3)
    saturating = Limits(iterations=1000, seconds=20, generations=1000)
    whole, _wall, _ = timed(graph, library, ("add_comm", "add_assoc"), saturating)
    monkeypatch.setattr(program, "CHUNK_RULES", 1)
    chunked, _wall, _ = timed(graph, library, ("add_comm", "add_assoc"), saturating)
    assert len(chunked.program.chunks("alg")) == chunked.program.count("alg") > 1
    assert chunked.stop == whole.stop == STOP_SATURATED
    assert chunked.enodes == whole.enodes and chunked.matches and chunked.note == ""
    limits = Limits(iterations=1000, enodes=3_000, seconds=30, generations=1000)
    result, _wall, _ = timed(add_chain(library, 10), library, ("add_comm", "add_assoc"), limits)
    assert result.stop == STOP_ENODES and limits.enodes <= result.enodes < 20 * limits.enodes


def test_optimize_reports_the_limit_that_stopped_it(adversarial, tmp_path, capsys):
    library, rules = adversarial
    graph = tmp_path / "g.json"
    graph.write_text(add_chain(library, 2).to_json())
    plan = tmp_path / "plan.json"
    code = main(["optimize", str(graph), "--rules", str(rules), "--allow-unverified", "--devices", "1", "-q",
                 "--no-baselines", "--limit", "enodes=2000", "--limit", "seconds=20", "--limit", "generations=1000",
                 "-o", str(plan)])
    out = capsys.readouterr().out
    assert code == 0
    assert "saturation: stopped by enodes" in out
    assert json.loads(plan.read_text())["saturation"]["stop"] == STOP_ENODES


def many_rules(count: int) -> str:
    """`count` distinct (sound) rules: add commutes past relu for each constant scale."""
    parts = ['import "ops.rule"\n']
    for i in range(count):
        parts.append(f"rule many_{i}:\n  forall x: [*s], y: [*s]\n"
                     f"  add(relu(x), scale(y, {i}.5)) => add(scale(y, {i}.5), relu(x))\n")
    return "\n".join(parts)


def _many_rules_case(tmp_path: Path, count: int, seconds: float) -> tuple[str, float, float, float]:
    path = tmp_path / "many.rule"
    path.write_text(many_rules(count), encoding="utf-8")
    library = load_library([path])[0]
    assert len(library.rules) == count
    g = GraphBuilder(library, name="small")
    x, y = g.input("x", [8, 8]), g.weight("y", [8, 8])
    g.output(g.op("add", g.op("relu", x), g.op("scale", y, c=3.5)))
    before, start = rss_mib(), time.perf_counter()
    result = saturate(g.build(), library, library.rules, 2, Limits(iterations=50, seconds=seconds))
    return result.stop, time.perf_counter() - start, result.compile_seconds, rss_mib() - before


def test_hundreds_of_rules_finish(tmp_path):
    stop, wall, _compile, grew = _many_rules_case(tmp_path, 200, seconds=10)
    assert stop in (STOP_SATURATED, STOP_ITERATIONS, STOP_SECONDS)
    assert wall < 30 and grew < RSS_BOUND_MIB


@pytest.mark.slow
def test_thousands_of_rules_finish_within_the_seconds_limit(tmp_path):
    stop, wall, compile_s, grew = _many_rules_case(tmp_path, 2000, seconds=5)
    assert grew < RSS_BOUND_MIB
    assert wall < 5 + 3, f"stop {stop}, {wall:.1f} s of which {compile_s:.1f} s compiling"


def deep_graph(library: Library, blocks: int) -> Graph:
    """matmul + residual add + relu, `blocks` times: 3 operators per block."""
    g = GraphBuilder(library, name=f"deep{blocks}")
    acc = g.input("x", [64, 32])
    for i in range(blocks):
        acc = g.op("relu", g.op("add", g.op("matmul", acc, g.weight(f"w{i}", [32, 32])), acc))
    g.output(acc)
    return g.build()


def test_a_graph_of_a_thousand_operators_stays_within_limits():
    library = load_library([Path(__file__).parent / "rules_for_saturate" / "mlp.rule"])[0]
    graph = deep_graph(library, 340)
    assert len(graph.nodes) >= 1000
    before, start = rss_mib(), time.perf_counter()
    result = saturate(graph, library, library.rules, 4, Limits(iterations=30, enodes=50_000, seconds=5))
    wall = time.perf_counter() - start
    assert result.stop in (STOP_SATURATED, STOP_ENODES, STOP_SECONDS, STOP_ITERATIONS)
    assert wall < 5 + result.compile_seconds + 10, f"{result.stop}: {wall:.1f} s"
    assert rss_mib() - before < RSS_BOUND_MIB


def test_a_graph_of_two_thousand_operators_with_the_shipped_rules_stays_within_limits():
    library = load_library()[0]
    graph = deep_graph(library, 700)
    before, start = rss_mib(), time.perf_counter()
    result = saturate(graph, library, library.rules, 4, Limits(iterations=30, enodes=200_000, seconds=10))
    wall = time.perf_counter() - start
    assert wall < 10 + result.compile_seconds + 15, f"{result.stop} after {result.iterations}: {wall:.1f} s"
    assert rss_mib() - before < RSS_BOUND_MIB
