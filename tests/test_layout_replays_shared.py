"""What the grid's layouts of one graph share while they are built (session 76, helper D): the block replay's name
moves and `alike` verdicts (`ir.block_replay.ReplayShared`, kept by the builder's `context`), the builders' static
values (`ir.megatron._Memo.static`), a kin pair's differing dims (`ir.megatron._differing_dims`), the live nodes
found by one backward sweep (`ir.data_parallel._needed`), and a rescaled layout's structure taken as kept. Each
must give what working it out afresh gives: the layouts equal those built alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

import parsat.ir.block_replay as block_replay
import parsat.ir.megatron as megatron
from parsat.dsl.checker import resolve_library
from parsat.ir.data_parallel import _live, _needed, _walked
from parsat.ir.megatron import megatron_pcg
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example
from parsat.ir.pcg import Degrees, PNode

SIZES = {"blocks": 5, "batch": 8, "seq": 16, "hidden": 32, "heads": 4, "vocab": 64}
MESHES = [(2, 2), (1, 4), (4, 2), (2, 4)]
FORMS = [dict(sequence=s, zero=z, reduce_at_once=r, vocabulary_loss=v)
         for s in (False, True) for z in (0, 3) for r, v in ((False, True), (True, False))]


def _counting_alike(monkeypatch) -> list:
    """Every `BlockReplay.alike` asked (its template's block and the run's first node), recorded."""
    asked: list = []
    real = block_replay.BlockReplay.alike

    def counted(self, t, run, name_of):
        asked.append((t.block, run[0].name))
        return real(self, t, run, name_of)
    monkeypatch.setattr(block_replay.BlockReplay, "alike", counted)
    return asked


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_layouts_sharing_one_graph_s_replays_equal_those_built_alone(monkeypatch, name):
    """Every layout of a graph built through one cache (the grid's: every mesh and form sharing the memo and its
    `ReplayShared`) is node for node the layout built alone, and a later layout of a context met before asks
    `alike` of no run: its verdicts are the first layout's."""
    library = resolve_library(None)
    graph = build_example(name, SIZES, library).with_microbatches(2)
    cache: dict = {}
    asked = _counting_alike(monkeypatch)
    shared = [(mesh, form, megatron_pcg(graph, library, mesh, 2, cache=cache, **form))
              for mesh in MESHES for form in FORMS]
    first = len(asked)
    again = megatron_pcg(graph, library, (2, 2), 2, cache=cache, **{**FORMS[1], "zero": 0})
    assert len(asked) == first   # the context (unsplit inputs, a data axis) met before: every verdict kept
    monkeypatch.undo()
    assert again == shared[1][2]
    for mesh, form, pcg in shared:
        assert pcg is not None and pcg == megatron_pcg(graph, library, mesh, 2, **form), (mesh, form)


def test_verdicts_are_kept_by_the_builder_s_context_and_runs():
    """A verdict is read back only for its pair of blocks, context and the two runs it compared (by identity): the
    same blocks of another graph's runs, or another context, ask again."""
    shared = block_replay.ReplayShared()

    class Replay(block_replay.BlockReplay):
        def __init__(self, context, verdict):
            super().__init__(None, shared)
            self.own, self.verdict, self.asked = context, verdict, 0

        def context(self):
            return self.own

        def alike(self, t, run, name_of):
            self.asked += 1
            return self.verdict
    runs, other = (("r1",), ("r2",)), (("s1",), ("s2",))
    t = block_replay.BlockTemplate(1, runs[0], 0)
    first = Replay(("a",), True)
    assert first.known_alike(t, 2, runs[1], str) and first.asked == 1
    assert first.known_alike(t, 2, runs[1], str) and first.asked == 1   # kept
    assert not Replay(("b",), False).known_alike(t, 2, runs[1], str)    # another context: asked
    later = Replay(("a",), False)
    assert not later.known_alike(block_replay.BlockTemplate(1, other[0], 0), 2, other[1], str)   # other runs
    assert later.asked == 1
    none = Replay(None, False)
    assert not none.known_alike(t, 2, runs[1], str) and none.asked == 1   # no context: always asked


def test_a_graph_naming_a_value_as_the_builder_names_its_own_keeps_no_verdict(monkeypatch):
    """Where a graph value is named as the builder names a value of its own (`{node}_nobias`), a builder's shapes
    may differ from the graph's: no context, each run asks `alike`, and the layout is still the one built alone."""
    library = resolve_library(None)
    graph = build_example("gpt", SIZES, library).with_microbatches(2)
    memo = megatron._Memo(graph, library)
    assert memo.own_names_apart
    node = next(n for n in graph.nodes if n.op == "linear" and n.name.startswith("b1_"))
    clash = replace(graph, leaves=(*graph.leaves, replace(graph.leaves[0], name=f"{node.name}_nobias")))
    assert not megatron._Memo(clash, library).own_names_apart
    cache: dict = {}
    asked = _counting_alike(monkeypatch)
    first = megatron_pcg(graph, library, (2, 2), 2, cache=cache)
    count = len(asked)
    assert megatron_pcg(graph, library, (2, 2), 2, cache=cache) == first and len(asked) == count
    cache["memo"].__dict__["own_names_apart"] = False   # a cached property: this graph's memo told it clashes
    assert megatron_pcg(graph, library, (2, 4), 2, cache=cache) is not None and len(asked) > count
    monkeypatch.undo()


def test_static_values_are_the_builder_s_own_made_of():
    """`_Memo.static`, `weighted` and `views` are `_made_of` / `_views_of` of the graph, kept by `unsplit`."""
    library = resolve_library(None)
    graph = build_example("llama", SIZES, library)
    memo = megatron._Memo(graph, library)
    weights = {w.name for w in graph.weights}
    inputs = frozenset(leaf.name for leaf in graph.leaves if leaf.role == "input")
    for unsplit in (frozenset(), inputs):
        assert memo.static(unsplit) == megatron._made_of(graph, weights | unsplit)
        assert memo.static(frozenset(unsplit)) is memo.static(unsplit)
    assert memo.weighted == megatron._made_of(graph, weights)
    assert memo.views == megatron._views_of(graph, weights)


def _splits_alike_per_value(like, graph, blocks) -> bool:
    """`_splits_alike` as it read the graphs before (every dim of every value, per mesh)."""
    before, after = like.shapes(), graph.shapes()
    return not any((a % k == 0) != (b % k == 0) for name, shape in before.items()
                   for a, b in zip(shape, after[name]) for k in blocks)


@pytest.mark.parametrize("batches", [(64, 32), (64, 24), (16, 48)])
def test_differing_dims_give_every_mesh_s_verdict(batches):
    library = resolve_library(None)
    like, graph = (build_example("gpt", {**SIZES, "batch": batch}, library) for batch in batches)
    dims = megatron._differing_dims(like, graph)
    assert all(a != b for a, b in dims)
    for shape in [(8, 1), (4, 2), (16, 1), (8, 2), (3, 1), (32, 2)]:
        blocks = megatron._blocks(shape)
        assert megatron._splits_alike(dims, blocks) == _splits_alike_per_value(like, graph, blocks), shape


def _chain(inputs: list[tuple[int, ...]]) -> list[PNode]:
    return [PNode(k, "op" if ins else "leaf", "neg" if ins else f"x{k}", ins, (), (4,), Degrees.whole(1),
                  origin=f"v{k}") for k, ins in enumerate(inputs)]


def test_live_nodes_by_one_sweep_are_the_walk_s():
    """`_needed` (one sweep back from the last node) marks what the walk from the outputs marks, a node read at or
    after its own position falling back to the walk; `_live` keeps every node as it is where all are live."""
    mesh = Mesh.of((2,), 1, names=("dp",))
    cases = [([(), (0,), (1,), (0,), (2, 3)], [4]),          # every node live
             ([(), (0,), (0,), (1,), (), (3,)], [5]),        # 2 and 4 dead
             ([(), (0,), (1,), (), (3,)], [2, 4]),           # two outputs
             ([(), (3,), (1,), ()], [2])]                    # node 1 reads node 3, after it: the walk
    for inputs, outputs in cases:
        nodes = _chain(inputs)
        assert _needed(nodes, outputs) == _walked(nodes, outputs)
    every = _chain(cases[0][0])
    pcg = _live(every, [4], ("y",), mesh)
    assert all(a is b for a, b in zip(pcg.nodes, every)) and pcg.outputs == (4,)
    pruned = _live(_chain(cases[1][0]), [5], ("y",), mesh)
    assert [n.origin for n in pruned.nodes] == ["v0", "v1", "v3", "v5"]
    assert [n.inputs for n in pruned.nodes] == [(), (0,), (1,), (2,)] and pruned.outputs == (3,)


def test_a_rescaled_layout_is_the_checked_reshape():
    """`_rescaled` hands `reshaped` its nodes as kept in structure: the same PCG and shared facts as the checked
    reshape, which would have refused a structure that differs."""
    library = resolve_library(None)
    like, graph = (build_example("llama", {**SIZES, "batch": batch}, library) for batch in (8, 16))
    pcg = megatron_pcg(like, library, (2, 2), 2, sequence=True)
    rescaled = megatron._rescaled(pcg, like, graph)
    assert rescaled is not None and rescaled.structural is pcg.structural
    assert rescaled == pcg.reshaped(rescaled.nodes)
    assert rescaled == megatron_pcg(graph, library, (2, 2), 2, sequence=True)
