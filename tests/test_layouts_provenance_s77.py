"""Session 77 (helper D): provenance rows decoded a column at a time, makers kept as strings until asked, and the
applications grouped when asked (the same rows, makers and applications as decoding row by row, kept here as it was
at 3308009); a node's fields set by its own `__init__` (the dataclass's fields, in order, with their defaults); a
block's checkpoints from the nodes other blocks read (as from the reader blocks per value); the values kept through
aliases walked from the aliasing ones (as from every kept value)."""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields, replace

import pytest

from parsat.cost import saved
from parsat.cost.saved import kept_values, through_aliases
from parsat.dsl.checker import resolve_library
from parsat.egraph.encoding import APPLIED_PREFIX, EQUATED, MADE_PREFIX
from parsat.egraph.instances import graph_signatures
from parsat.egraph.mesh_encoding import mesh_graph_program
from parsat.egraph.program import GROW, PLACE, compile_mesh_rules
from parsat.egraph.runner import Limits, run_generations
from parsat.egraph.session import Session
from parsat.ir.blocks import OUTSIDE, node_blocks
from parsat.ir.megatron import megatron_pcg
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example
from parsat.ir.pcg import PNode, pcg_roles, weight_chains
from parsat.ir.recompute import BLOCKS, Checkpoint, _block_checkpoints

GPT = {"blocks": 2, "hidden": 64, "heads": 4, "batch": 8, "seq": 16, "vocab": 128}


def _row_by_row(eg, frozen) -> tuple[dict, dict, dict]:
    """The provenance as `_ProvenanceRows.load` decoded it at 3308009: each row decoded alone (rows, equated,
    applications by rule index in their table's order)."""
    made, equated, applied = {}, {}, {}
    for name, fn in frozen.functions.items():
        def values(row):
            return tuple(eg.value_to_string(v) if sort == "String" else eg.value_to_i64(v)
                         for v, sort in zip(row.inputs, fn.input_sorts))
        if name.startswith(APPLIED_PREFIX):
            for row in fn.rows:
                decoded = values(row)
                applied.setdefault(decoded[0], []).append(decoded[1:])
        if name == EQUATED:
            for row in fn.rows:
                equated.setdefault(eg.value_to_i64(row.inputs[0]), set()).add(eg.value_to_string(row.inputs[1]))
        if not name.startswith(MADE_PREFIX):
            continue
        op = name[len(MADE_PREFIX):].split("_", 1)[1]
        for row in fn.rows:
            decoded = values(row)
            made.setdefault((op, decoded[:-1]), set()).add(decoded[-1])
    return ({key: frozenset(who) for key, who in made.items()}, {c: frozenset(w) for c, w in equated.items()},
            applied)


@pytest.fixture(scope="module", params=[(2, 2), (4,)])
def saturated(request):
    library = resolve_library(None)
    graph, mesh = build_example("gpt", GPT, library), Mesh.of(request.param)
    program = compile_mesh_rules(library, library.rules, graph.ranks(), mesh, {n.op for n in graph.nodes},
                                 graph_signatures(graph, library.ops))
    text, _ = mesh_graph_program(graph, library.ops, mesh)
    session = Session(program, text, None, mesh)
    run_generations(session, program.phase_chunks(GROW), program.phase_chunks(PLACE), Limits(matches=10 ** 9),
                    float("inf"), {r.key: r.name for r in program.rules})
    snapshot = session.snapshot()
    return snapshot, _row_by_row(session.egraph, session.egraph.freeze())


def test_provenance_gives_the_row_by_row_makers_equations_and_applications(saturated):
    snapshot, (rows, equated, applied) = saturated
    provenance = snapshot.made
    assert len(provenance) == len(rows) > 100
    keys = {provenance._key(node) for node in provenance}   # iterating makes each row's e-node
    assert keys == set(rows)
    assert sum(len(who) > 1 for who in rows.values()) > 10   # keys of several makers are met
    for node in provenance:
        assert provenance[node] == rows[provenance._key(node)]
        assert type(provenance[node]) is frozenset
    assert dict(snapshot.equated) == equated
    recorded = provenance._data.applied_rows
    assert recorded == applied and sum(map(len, applied.values())) > 100   # the same matches, in the same order


def test_makers_are_frozen_when_asked_and_applications_grouped_when_asked(saturated):
    snapshot, (rows, _equated, _applied) = saturated
    data = type(snapshot.made._data)(None, None, (), {})
    data.rows, data._applied = {("op", (1,)): "r1", ("op", (2,)): {"r1", "r2"}}, [([3, 4, 3], [(7,), (8,), (9,)])]
    assert "applied_rows" not in data.__dict__   # not grouped by loading
    assert data.makers(("op", (1,))) == frozenset({"r1"}) and data.rows[("op", (1,))] == frozenset({"r1"})
    assert data.makers(("op", (2,))) is data.makers(("op", (2,)))   # frozen once per key
    with pytest.raises(KeyError):
        data.makers(("op", (5,)))
    assert data.applied_rows == {3: [(7,), (9,)], 4: [(8,)]}
    node = next(iter(snapshot.made))
    assert snapshot.made.get(node) == rows[snapshot.made._key(node)]
    assert snapshot.made.get(type(node)("no such operator", (), ())) is None


LLAMA = {"blocks": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "batch": 8, "seq": 16, "vocab": 128, "ffn": 96}


def test_a_nodes_init_takes_its_fields_in_order_with_their_defaults():
    params = list(inspect.signature(PNode.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in fields(PNode)]
    assert [p.default for p in params] == [inspect.Parameter.empty if f.default is MISSING else f.default
                                          for f in fields(PNode)]
    node = PNode(3, "op", "add", (1, 2), (("k", 1),), (4, 4), None, "", "b0_x", rules=("r",))
    assert [getattr(node, f.name) for f in fields(PNode)] == [3, "op", "add", (1, 2), (("k", 1),), (4, 4), None, "",
                                                              "b0_x", fields(PNode)[9].default, ("r",)]
    assert replace(node, shape=(2, 2)) == PNode(3, "op", "add", (1, 2), (("k", 1),), (2, 2), None, "", "b0_x",
                                                rules=("r",))
    with pytest.raises(AttributeError):
        node.shape = (1,)   # still frozen


def _checkpoints_as_they_were(pcg) -> tuple[Checkpoint, ...]:
    """`_block_checkpoints` at 3308009: a set of reader blocks per value."""
    blocks, chains = node_blocks(pcg), weight_chains(pcg)
    readers: dict[int, set[int]] = {}
    for node in pcg.nodes:
        for i in node.inputs:
            readers.setdefault(i, set()).add(blocks[node.id])
    outputs = set(pcg.outputs)
    runs: dict[int, list[int]] = {}
    kept: dict[int, set[int]] = {}
    for node in pcg.nodes:
        block = blocks[node.id]
        if block == OUTSIDE or node.kind == "leaf" or node.id in chains:
            continue
        runs.setdefault(block, []).append(node.id)
        if node.id in outputs or not readers.get(node.id, set()) <= {block}:
            kept.setdefault(block, set()).add(node.id)
    return tuple(Checkpoint(b, tuple(ids), frozenset(kept.get(b, ()))) for b, ids in sorted(runs.items()))


def _layouts():
    library = resolve_library(None)
    for model, sizes in (("gpt", {**GPT, "blocks": 4}), ("llama", LLAMA)):
        graph = build_example(model, sizes, library)
        for mesh, options in (((2, 2), {}), ((1, 4), {"sequence": True}), ((2, 2), {"zero": 3}), ((4, 1), {})):
            pcg = megatron_pcg(graph, library, mesh, **options)
            if pcg is not None:
                yield library, replace(pcg, recompute=BLOCKS)


def test_block_checkpoints_are_those_of_reader_blocks_per_value():
    met = 0
    for _library, pcg in _layouts():
        found = _block_checkpoints(pcg)
        assert found == _checkpoints_as_they_were(pcg)
        assert len(found) == 4 and all(c.kept and len(c.kept) < len(c.runs) for c in found)
        met += 1
    assert met >= 6


def _through_aliases_as_it_was(direct, aliases) -> frozenset:
    """What every kept value aliases, followed to a fixed point (the walk at 3308009 started from every value)."""
    found = set(direct)
    while True:
        more = {source for value in found for source in aliases.get(value, ())} - found
        if not more:
            return frozenset(found)
        found |= more


def test_through_aliases_walks_from_the_aliasing_values_alone(monkeypatch):
    aliases = {"v": ["t"], "t": ["x"], "g": ["s"], "u": ["v"], "w": ["w2"]}
    for direct in ({"v"}, {"u", "y"}, {"x"}, set(), {"g", "w", "v", "q"}):
        assert through_aliases(direct, aliases) == _through_aliases_as_it_was(direct, aliases)
    assert through_aliases({"u"}, aliases) == frozenset({"u", "v", "t", "x"})
    for library, pcg in _layouts():   # whole layouts: the kept values, views and gathers followed
        readers = [(n.id, n.op, n.inputs) for n in pcg.nodes if n.kind != "leaf"]
        found = saved.kept_reads(readers, library, pcg_roles(pcg))
        with monkeypatch.context() as patched:
            patched.setattr(saved, "through_aliases", _through_aliases_as_it_was)
            assert saved.kept_reads(readers, library, pcg_roles(pcg)) == found
        assert found[0] and found[1] and found[0] | found[1] == kept_values(pcg, library)
