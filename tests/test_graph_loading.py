"""Loading a graph into the e-graph (`parsat.egraph.loading`): the e-graph the same as one command per line.

Before: every `let` and fact of the graph's text was its own egglog
command, 40-50 us each whatever it did, four per tensor on a mesh: the
100,001-tensor chain spent 20 of its 28 CPU s loading. Now a tensor's term
is one command (a tensor only the next one uses written inside that one's
term) and its facts rows of tables egglog reads in bulk. What the e-graph
holds is checked against the old way, loading the text chunk by chunk
(`Session.load`): the same e-classes made in the same order, the same
e-nodes, names, shapes, placements and provenance.
"""

from __future__ import annotations

import pytest

from parsat.dsl.checker import resolve_library
from parsat.egraph import loading
from parsat.egraph.encoding import graph_program
from parsat.egraph.instances import graph_signatures
from parsat.egraph.mesh_encoding import mesh_graph_program
from parsat.egraph.program import RuleProgram, compile_mesh_rules, compile_rules
from parsat.egraph.session import Session
from parsat.ir.errors import OptimizeError
from parsat.ir.graph import Graph
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example
from parsat.ir.placement import Placement, shard


@pytest.fixture(scope="module")
def library():
    return resolve_library(None)


def _chain(n: int, library) -> Graph:
    nodes = [{"name": f"n{i}", "op": "relu", "inputs": [f"n{i - 1}" if i else "x"]} for i in range(n)]
    return Graph.from_dict({"name": "chain", "inputs": [{"name": "x", "shape": [8, 8]}], "nodes": nodes,
                            "outputs": [f"n{n - 1}"]}, library)


def _contents(session: Session) -> tuple:
    """What the e-graph holds, its e-classes numbered in the order they were made."""
    snap = session.snapshot()
    rank = {cid: i for i, cid in enumerate(sorted(snap.classes))}

    def node(n):
        return n.op, tuple(rank[c] for c in n.children), n.attrs

    return ({rank[c]: tuple(map(node, nodes)) for c, nodes in snap.classes.items()},
            {name: rank[c] for name, c in snap.lets.items()},
            {rank[c]: shape for c, shape in snap.shape.items()},
            {rank[c]: degrees for c, degrees in snap.degrees.items()},
            {rank[c]: placement for c, placement in snap.placement.items()},
            {node(n): who for n, who in snap.made.items()})


def _loaded_both_ways(program: RuleProgram, text: str, mesh: Mesh | None = None) -> tuple[tuple, tuple]:
    bulk = Session(program, text, None, mesh)
    one_by_one = Session(program, "", None, mesh)
    for chunk in text.split("\n\n"):
        if chunk.strip():
            one_by_one.load(chunk)
    return _contents(bulk), _contents(one_by_one)


def _mesh_program(graph: Graph, library, mesh: Mesh, pins=None) -> tuple[RuleProgram, str]:
    program = compile_mesh_rules(library, [], graph.ranks(), mesh, {n.op for n in graph.nodes},
                                 graph_signatures(graph, library.ops, pins), None, None)
    return program, mesh_graph_program(graph, library.ops, mesh, pins)[0]


def test_a_graph_on_a_mesh_loads_as_it_did_one_command_per_line(library):
    """The gpt example's two blocks on a 2 x 2 mesh, an input and an output pinned (their parallel terms, and
    the input's `union`, a chunk the loader runs as text after the facts before it)."""
    graph = build_example("gpt", {"blocks": 2, "batch": 8, "seq": 64, "hidden": 64, "heads": 4, "vocab": 128},
                          library)
    mesh = Mesh.of((2, 2))
    first_input = next(leaf.name for leaf in graph.leaves if leaf.role == "input")
    pins = {first_input: Placement((shard(0), 0)), graph.outputs[0]: Placement((1, 1))}
    program, text = _mesh_program(graph, library, mesh, pins)
    assert f'(union $p0_0 (Leaf "{first_input}@pinned"))' in text
    bulk, one_by_one = _loaded_both_ways(program, text, mesh)
    assert bulk == one_by_one
    assert len(bulk[1]) == len(graph.leaves) + len(graph.nodes) + 3   # every name, the pins' 3 terms included


def test_a_chain_loads_as_it_did_in_a_command_per_nest_of_tensors(library, monkeypatch):
    graph = _chain(1000, library)
    program, text = _mesh_program(graph, library, Mesh.of((2,)))
    bulk, one_by_one = _loaded_both_ways(program, text, Mesh.of((2,)))
    assert bulk == one_by_one
    sent: list[str] = []
    run = Session._run
    monkeypatch.setattr(Session, "_run", lambda self, text: sent.append(text) or run(self, text))
    Session(program, text, None, Mesh.of((2,)))
    terms = sum(text.count(f"(set ({loading.BOUND} ") for text in sent if "(rule " not in text)
    assert terms == -(-1001 // loading.NEST)   # was 1,001 commands for the terms and 3,001 for their facts


def test_the_degree_encoding_loads_as_it_did(library):
    """The rule generator's derivations load `encoding.graph_program` text (Rank, Dim, Shard... rows)."""
    graph = build_example("mlp", library=library)
    program = compile_rules(library, [], graph.ranks(), 2, typing_cache={})
    text, _names = graph_program(graph, library.ops)
    bulk, one_by_one = _loaded_both_ways(program, text)
    assert bulk == one_by_one and bulk[2]


def test_strings_input_would_read_otherwise_stay_in_commands():
    """egglog's `input` splits rows at tabs and trims each field, with no escapes: a fact holding such a string
    (or a term holding one that would be found by a row) is sent as a command, and reads back the same."""
    program = RuleProgram("(datatype T (Leaf String) (Op_f T String))\n"
                          "(relation Made_Op_f (T String String))\n", (), ())
    names = ["plain", "tab\there", " space", "quote\\\"d", "back\\\\slash", "", "end "]
    chunks = [f'(let $l{i} (Leaf "{name}"))' for i, name in enumerate(names)]
    chunks += [f'(let $n{i} (Op_f $l{i} "{name}"))\n(Made_Op_f $l{i} "{name}" "{name}")'
               for i, name in enumerate(names)]
    bulk, one_by_one = _loaded_both_ways(program, "\n\n".join(chunks))
    assert bulk == one_by_one
    assert {who for made in bulk[5].values() for who in made} == {
        "plain", "tab\there", " space", 'quote"d', "back\\slash", "", "end "}


def test_loading_stops_at_the_deadline(library):
    graph = _chain(600, library)
    program, text = _mesh_program(graph, library, Mesh.of((2,)))
    with pytest.raises(OptimizeError, match=r"256 of 601 tensors loaded; raise the limit"):
        Session(program, text, 0.0, Mesh.of((2,)))
