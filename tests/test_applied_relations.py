"""Every rule's applications recorded in one relation per column sorts, not one relation per rule.

egglog copies its map of every declared name for each rule it compiles and rebuilds, counts and freezes every
table, so a relation per rule (`Applied<i>`) made loading and running a 2-axis mesh's 641 rules grow with them
(`encoding.applied_relation`). The shared relations must change nothing but the read-back's table names: the
same e-graph id for id, the same matches per rule, and each rule's applications the rows it recorded (as a
multiset: egglog's rebuild may move a rule's rows in another order in a shared table than in a table of its
own). The program is compared with itself written the old way (each rule's rows in a relation of its own).
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from parsat.dsl.checker import resolve_library
from parsat.egraph.encoding import APPLIED_PREFIX
from parsat.egraph.program import GROW, PLACE, RuleProgram, compile_mesh_rules
from parsat.egraph.instances import graph_signatures
from parsat.egraph.mesh_encoding import mesh_graph_program
from parsat.egraph.runner import Limits, run_generations
from parsat.egraph.session import Session
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example

GPT = {"blocks": 2, "hidden": 64, "heads": 4, "batch": 8, "seq": 16, "vocab": 128}
SHARED = re.compile(rf"\(({APPLIED_PREFIX}\S+) (\d+) ")


def _one_relation_per_rule(program: RuleProgram) -> RuleProgram:
    """`program` with each rule's applications in `Applied<i>` of its own, declared with the rule (as before)."""
    sorts = dict(re.findall(rf"\(relation ({APPLIED_PREFIX}\S+) \(i64 ([^)]*)\)\)", program.declarations))
    rules = []
    for rule in program.rules:
        (name, index), = SHARED.findall(rule.text)
        assert int(index) == rule.index
        text = rule.text.replace(f"({name} {index} ", f"(Applied{index} ")
        rules.append(replace(rule, text=f"(relation Applied{index} ({sorts[name]}))\n{text}"))
    return replace(program, rules=tuple(rules))


def _saturated(program: RuleProgram, graph_text: str, mesh: Mesh):
    session = Session(program, graph_text, None, mesh)
    done = run_generations(session, program.phase_chunks(GROW), program.phase_chunks(PLACE), Limits(matches=10 ** 9),
                           float("inf"), {r.key: r.name for r in program.rules})
    return session, done


@pytest.mark.parametrize("sizes", [(2, 2), (4,)])
def test_shared_applied_relations_give_the_egraph_and_the_applications_of_one_relation_per_rule(sizes):
    library = resolve_library(None)
    graph, mesh = build_example("gpt", GPT, library), Mesh.of(sizes)
    program = compile_mesh_rules(library, library.rules, graph.ranks(), mesh, {n.op for n in graph.nodes},
                                 graph_signatures(graph, library.ops))
    relations = re.findall(rf"\(relation ({APPLIED_PREFIX}\S+) ", program.declarations)
    assert relations and len(set(relations)) == len(relations) < len(program.rules) // 4
    text, _ = mesh_graph_program(graph, library.ops, mesh)
    shared, shared_run = _saturated(program, text, mesh)
    own, own_run = _saturated(_one_relation_per_rule(program), text, mesh)
    assert shared_run.iterations == own_run.iterations and shared_run.stop == own_run.stop == "saturated"
    assert shared_run.matches == own_run.matches and sum(shared_run.matches.values()) > 100
    new, old = shared.snapshot(), own.snapshot()
    assert new.classes == old.classes and new.placement == old.placement and new.shape == old.shape
    assert shared.match_rows() == own.match_rows()
    new.made._data.load()   # the provenance, read on first use
    recorded = new.made._data.applied_rows
    eg, functions = own.egraph, own.egraph.freeze().functions
    applied = 0
    for rule in program.rules:
        fn = functions[f"Applied{rule.index}"]
        rows = [tuple(eg.value_to_string(v) if sort == "String" else eg.value_to_i64(v)
                      for v, sort in zip(row.inputs, fn.input_sorts)) for row in fn.rows]
        assert sorted(recorded.get(rule.index, [])) == sorted(rows), rule.key
        applied += len(rows)
    assert applied > 100
    assert sum(len(new.applied[name]) for name in {r.name for r in program.rules}) > 100
