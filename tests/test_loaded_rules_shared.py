"""One loaded rule program for the meshes of one shape (`session.take_loaded`), the axes' sizes read from the
e-graph (`AxisSize`, written per mesh; the rules bind them with `lifted_text`'s lookups).

What each saturation gives must be what a fresh e-graph, loaded with the rules as they were written before (the
sizes as numbers), gives: the same classes with the same ids, the same placements and shapes, the same matches.
It rests on two things egglog does (tested here, so an egglog that changes them fails): `pop` brings the
e-class counter back, and a string interned before a `pop` still decodes after it.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from parsat.dsl.checker import resolve_library
from parsat.egraph import saturate as saturate_module
from parsat.egraph.instances import graph_signatures
from parsat.egraph.mesh_encoding import AXIS_SIZE, at_sizes, mesh_graph_program
from parsat.egraph.program import MeshCaches, compile_mesh_rules
from parsat.egraph.resize import Unreadable, _Guard
from parsat.egraph.session import CompileError, Session, bindings
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example

GPT = {"blocks": 1, "hidden": 64, "heads": 4, "batch": 8, "seq": 16, "vocab": 128}
_LOOKUP = re.compile(rf"\(= z\d+ \({AXIS_SIZE} \d+\)\) ")


@pytest.fixture(scope="module")
def library():
    return resolve_library(None)


@pytest.fixture(scope="module")
def graph(library):
    return build_example("gpt", GPT, library)


def _program(library, graph, mesh):
    return compile_mesh_rules(library, library.rules, graph.ranks(), mesh, {n.op for n in graph.nodes},
                              graph_signatures(graph, library.ops))


def _written_out(program, mesh):
    """`program` with every rule's size lookups left out and its size variables written as `mesh`'s sizes: the
    rules as they were compiled before the sizes were read from the e-graph."""
    rules = tuple(replace(rule, text=at_sizes(_LOOKUP.sub("", rule.text), mesh.shape)) for rule in program.rules)
    return replace(program, rules=rules)


def test_meshes_of_one_shape_compile_to_one_program_that_reads_the_sizes(library, graph):
    programs = [_program(library, graph, Mesh.of(shape)) for shape in ((4, 2), (2, 4))]
    assert programs[0].text() == programs[1].text()
    reading = [rule for rule in programs[0].rules if AXIS_SIZE in rule.text]
    assert reading and all(re.search(r"\((?:%|/) [^()\s]+ z[01]\)", rule.text) for rule in reading)
    written = _written_out(programs[1], Mesh.of((2, 4)))
    assert AXIS_SIZE not in "".join(rule.text for rule in written.rules)
    assert "(% s_n 4)" in written.text() and "(% s_n 2)" in written.text()


def test_a_shared_program_saturates_as_the_rules_written_with_numbers(library, graph, monkeypatch):
    """A (4, 2) mesh loads the program; a (2, 4) mesh then takes it loaded (pushed, its sizes and graph written,
    popped after): the e-graph is the one a fresh load of the number-written rules gives, ids included."""
    caches = MeshCaches()
    first = saturate_module.saturate(graph, library, library.rules, Mesh.of((4, 2)), caches=caches)
    assert len(caches.loaded) == 1
    mesh = Mesh.of((2, 4))
    shared = saturate_module.saturate(graph, library, library.rules, mesh, caches=caches)
    assert len(caches.loaded) == 1 and not next(iter(caches.loaded.values())).in_use
    written = _written_out(_program(library, graph, mesh), mesh)
    monkeypatch.setattr(saturate_module, "cached_mesh_rules", lambda *args, **kwargs: written)
    fresh = saturate_module.saturate(graph, library, library.rules, mesh)
    assert shared.stop == fresh.stop == "saturated" and shared.iterations == fresh.iterations
    assert shared.snapshot.classes == fresh.snapshot.classes and shared.snapshot.lets == fresh.snapshot.lets
    assert shared.snapshot.placement == fresh.snapshot.placement and shared.snapshot.shape == fresh.snapshot.shape
    assert shared.rule_matches == fresh.rule_matches and shared.classes == fresh.classes
    assert dict(shared.snapshot.made) == dict(fresh.snapshot.made)   # decoded after the shared e-graph's pop
    assert first.snapshot.classes != shared.snapshot.classes   # another mesh: the pop left nothing of the first


def test_a_session_not_given_back_leaves_the_next_one_a_fresh_load(library, graph):
    mesh = Mesh.of((2, 4))
    program, (text, _) = _program(library, graph, mesh), mesh_graph_program(graph, library.ops, mesh)
    shared: dict = {}
    held = Session(program, text, None, mesh, shared)
    other = Session(program, text, None, mesh, shared)   # `held` not closed: its e-graph holds its graph
    assert other.egraph is not held.egraph and len(shared) == 1
    other.close()
    held.close()
    again = Session(program, text, None, mesh, shared)
    assert again.egraph is held.egraph and again.size() == held.size()
    with pytest.raises(CompileError):
        again.extend(program.rules[:1], "more_", len(program.rules))   # the base is the search's, not the session's
    again.close()


def test_egglog_pop_brings_class_ids_back_and_keeps_interned_strings():
    egraph = bindings.EGraph()

    def run(text):
        return egraph.run_program(*egraph.parse_program(text))

    def ids():
        functions = egraph.freeze().functions
        return sorted(egraph.value_to_i64(row.output) for name in ("Leaf", "F") for row in functions[name].rows)

    run("(datatype T (Leaf String) (F T))\n(relation R (String i64))")
    run("(push)")
    run('(union (F (Leaf "a")) (F (F (Leaf "b"))))')
    run("\n".join(f'(R "before-{i}" {i})' for i in range(40)))
    before, rows = ids(), egraph.freeze().functions["R"].rows
    run("(pop)")
    run("(push)")
    run('(union (F (Leaf "c")) (F (F (Leaf "d"))))')
    run("\n".join(f'(R "after-{i}" {i})' for i in range(40)))
    assert ids() == before
    assert [egraph.value_to_string(row.inputs[0]) for row in rows] == [f"before-{i}" for i in range(40)]
    run("(pop)")


def test_resize_reads_an_axis_size_lookup_as_egglog_does():
    guard = _Guard(["(= z0 (AxisSize 0))", "(At1 m_x s_n 0)", "(= (% s_n z0) 0)"], [("root", "T"), ("m_x", "T")],
                   "(let t0 (P_partition m_x 0 0)) (At1 t0 (/ s_n z0) 3) (union root t0)", sizes=(4,))
    assert guard.bound((1, 7), {7: (8,)}.get) == {"root": 1, "m_x": 7, "z0": 4, "s_n": 8}
    assert guard.bound((1, 7), {7: (6,)}.get) is None   # 6 % 4 != 0
    with pytest.raises(Unreadable):
        _Guard(["(= z1 (AxisSize 1))"], [("root", "T")], "", sizes=(4,))
