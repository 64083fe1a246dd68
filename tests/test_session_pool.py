"""E-graphs that hold a program, handed from one saturation to the next (`Session(..., idle=)`, `MeshCaches.egraphs`).

Loading the rules is most of a session's start, and the meshes of one
search load the same program more than once (each micro-batch count and
pipeline stage of a mesh). A session given `idle` takes an e-graph that
holds its very program, loads its graph after egglog's `(push)`, and
`close` pops the graph and hands the e-graph back. These tests check that
this is invisible: a saturation on a handed-back e-graph reads back as a
fresh one's (the same e-class ids, e-nodes, shapes, placements, provenance,
applications, rule matches and pattern rows), a snapshot read before its
e-graph was handed on still decodes its provenance, and a closed session
leaves nothing of its graph, its matches or its held-back rules behind.
"""

from __future__ import annotations

import pytest

from parsat.dsl.checker import resolve_library
from parsat.egraph.instances import graph_signatures
from parsat.egraph.mesh_encoding import mesh_graph_program
from parsat.egraph.program import PLACE, MeshCaches, compile_mesh_rules
from parsat.egraph.runner import Limits
from parsat.egraph.saturate import saturate
from parsat.egraph.session import Session
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example


@pytest.fixture(scope="module")
def library():
    return resolve_library(None)


def _read(result) -> dict:
    """Everything a search reads of a saturation, the lazily decoded provenance included."""
    snap = result.snapshot
    return {"classes": snap.classes, "shape": snap.shape, "degrees": snap.degrees, "lets": snap.lets,
            "placement": snap.placement, "made": dict(snap.made.items()), "equated": dict(snap.equated.items()),
            "applied": {rule: snap.applied[rule] for rule in snap.applied}, "stop": result.stop,
            "iterations": result.iterations, "enodes": result.enodes, "rule_matches": result.rule_matches,
            "held_back": result.held_back, "classes_of": result.classes, "pattern_rows": result.pattern_rows}


@pytest.mark.parametrize("shape", [(2,), (2, 2)])
def test_a_saturation_on_a_handed_back_egraph_reads_as_a_fresh_one(library, shape):
    mesh = Mesh.of(shape)
    graphs = [build_example("mlp", {"batch": batch}, library=library) for batch in (128, 256, 128)]
    caches = MeshCaches()
    pooled = [saturate(graph, library, library.rules, mesh, Limits(), caches=caches, matches=True)
              for graph in graphs]
    # read only now, after the e-graph served the later graphs: the provenance is decoded lazily
    pooled = [_read(result) for result in pooled]
    fresh = [_read(saturate(graph, library, library.rules, mesh, Limits(), matches=True)) for graph in graphs]
    assert len(caches.egraphs) == 1   # one e-graph, loaded once, served all three
    assert all(read["made"] and read["applied"] and read["pattern_rows"] for read in fresh)
    for got, want in zip(pooled, fresh):
        assert got.keys() == want.keys()
        assert [key for key in want if got[key] != want[key]] == []


def _rows(egraph) -> dict[str, int]:
    return {name: len(fn.rows) for name, fn in egraph.freeze().functions.items()}


def test_a_closed_session_leaves_only_its_program_behind(library):
    mesh = Mesh.of((2,))
    graph = build_example("mlp", library=library)
    program = compile_mesh_rules(library, library.rules, graph.ranks(), mesh, {n.op for n in graph.nodes},
                                 graph_signatures(graph, library.ops, None))
    text = mesh_graph_program(graph, library.ops, mesh, None)[0]
    idle: dict = {}
    session = Session(program, text, None, mesh, idle)
    egraph = session.egraph
    for chunk in program.phase_chunks(PLACE):
        session.run(chunk, budget=0)   # every rule that matched is held back: its `Live` row deleted
    held = _rows(egraph)
    empty = _rows(Session(program, "", None, mesh).egraph)
    assert held != empty   # the graph, its matches and the deleted `Live` rows are there before `close`
    assert sum(held[name] for name in held if name.startswith("Match")) > 0
    session.close()
    assert session.egraph is None
    assert [entry[0] for entry in idle.values()] == [egraph]
    assert _rows(egraph) == empty


def test_idle_holds_the_last_egraph_and_a_session_of_another_program_drops_it(library):
    graph = build_example("mlp", library=library)
    idle: dict = {}

    def session(shape) -> Session:
        mesh = Mesh.of(shape)
        program = compile_mesh_rules(library, library.rules, graph.ranks(), mesh, {n.op for n in graph.nodes},
                                     graph_signatures(graph, library.ops, None))
        return Session(program, mesh_graph_program(graph, library.ops, mesh, None)[0], None, mesh, idle)

    first = session((2,))
    egraph = first.egraph
    first.close()
    assert [entry[0] for entry in idle.values()] == [egraph]
    other = session((4,))
    assert idle == {} and other.egraph is not egraph   # dropped before the other program was loaded
    other.close()
    again = session((2,))
    assert again.egraph is not egraph and idle == {}   # loaded afresh: the first one's was dropped
    egraph = again.egraph
    again.close()
    assert session((2,)).egraph is egraph   # the same program right after: taken


def test_a_program_the_deadline_cut_short_is_not_handed_back(library):
    mesh = Mesh.of((2,))
    graph = build_example("mlp", library=library)
    program = compile_mesh_rules(library, library.rules, graph.ranks(), mesh, {n.op for n in graph.nodes},
                                 graph_signatures(graph, library.ops, None))
    idle: dict = {}
    session = Session(program, "", 0.0, mesh, idle)   # the deadline has passed: no rule is loaded
    assert session.loaded == 0 < len(program.rules)
    session.close()
    assert idle == {}


def test_the_declarations_load_in_pieces_as_in_one_batch(library):
    from parsat.egraph.session import PIECE_CHARS, _pieces, bindings

    mesh = Mesh.of((2, 2))
    graph = build_example("mlp", library=library)
    program = compile_mesh_rules(library, library.rules, graph.ranks(), mesh, {n.op for n in graph.nodes},
                                 graph_signatures(graph, library.ops, None))
    text = program.declarations
    pieces = _pieces(text)
    assert len(pieces) > 1 and "\n".join(pieces) == text
    assert all(piece.count("(") == piece.count(")") for piece in pieces)
    assert all(len(piece) <= PIECE_CHARS or "\n(" not in piece for piece in pieces)   # only a lone form is longer
    whole = bindings.EGraph()
    whole.run_program(*whole.parse_program(text))
    split = bindings.EGraph()
    for piece in pieces:
        split.run_program(*split.parse_program(piece))
    assert _rows(split) == _rows(whole) and len(_rows(whole)) > 20


def test_a_form_over_lines_that_start_with_a_parenthesis_stays_in_one_piece():
    from parsat.egraph.session import PIECE_CHARS, _pieces

    form = "(datatype T\n" + "\n".join(f"(C{i} T)" for i in range(PIECE_CHARS // 4)) + ")"
    text = "(relation A (i64))\n" + form + "\n(relation B (i64))"
    assert _pieces(text) == ["(relation A (i64))\n" + form, "(relation B (i64))"]
