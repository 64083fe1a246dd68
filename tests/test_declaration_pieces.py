"""A program's declarations loaded in pieces of whole forms (`session._pieces`), as in one command batch.

egglog-python copies the whole text of a batch into every parsed node's
span, so a 2-axis mesh's declarations (42,658 characters of bert-large:64,
mostly lift-table rows) took 0.66 CPU s and 550 MB in one batch; pieces of
~1,000 characters take 0.07 s. These tests check that the pieces are the
text, cut only between whole forms, and load the same tables and rows.
"""

from __future__ import annotations

import pytest

from parsat.dsl.checker import resolve_library
from parsat.egraph.instances import graph_signatures
from parsat.egraph.program import compile_mesh_rules
from parsat.egraph.session import PIECE_CHARS, _pieces, bindings
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example


@pytest.fixture(scope="module")
def library():
    return resolve_library(None)


def _rows(egraph) -> dict[str, int]:
    return {name: len(fn.rows) for name, fn in egraph.freeze().functions.items()}


def test_the_declarations_load_in_pieces_as_in_one_batch(library):
    mesh = Mesh.of((2, 2))
    graph = build_example("mlp", library=library)
    program = compile_mesh_rules(library, library.rules, graph.ranks(), mesh, {n.op for n in graph.nodes},
                                 graph_signatures(graph, library.ops, None))
    text = program.declarations
    pieces = _pieces(text)
    assert len(pieces) > 1 and "\n".join(pieces) == text
    assert all(piece.count("(") == piece.count(")") for piece in pieces)
    whole = bindings.EGraph()
    whole.run_program(*whole.parse_program(text))
    split = bindings.EGraph()
    for piece in pieces:
        split.run_program(*split.parse_program(piece))
    assert _rows(split) == _rows(whole) and len(_rows(whole)) > 20


def test_a_form_over_lines_that_start_with_a_parenthesis_stays_in_one_piece():
    form = "(datatype T\n" + "\n".join(f"(C{i} T)" for i in range(PIECE_CHARS // 4)) + ")"
    text = "(relation A (i64))\n" + form + "\n(relation B (i64))"
    assert _pieces(text) == ["(relation A (i64))\n" + form, "(relation B (i64))"]
