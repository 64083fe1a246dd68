"""The independent grid prices a layout's PCG once and its forms with the weights' state sharded (ZeRO-1, 2) or
recomputing blocks from those costs (`baselines._Forms`, `solve.restaged_node_costs`, issue 28): each form's
costs must be exactly what pricing that form afresh (`solve.price_pcg`) gives."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.dsl.checker import resolve_library
from parsat.ir.machine import Machine
import parsat.ir.megatron as megatron_module
from parsat.ir.megatron import _alike, megatron_pcg
from parsat.ir.models import build_example
from parsat.ir.recompute import BLOCKS, checkpoints
from parsat.search.baselines import independent_grid
from parsat.search.recompute import recomputed_pcg_costs
from parsat.search.solve import pcg_node_costs, price_pcg, restaged_node_costs

SIZES = {"blocks": 2, "hidden": 256, "heads": 8, "batch": 64, "seq": 128, "vocab": 1024}
LAYOUTS = [((dp, tp), sequence, zero) for dp, tp in ((8, 1), (4, 2), (2, 4)) for sequence in (False, True)
           for zero in (0, 3) if tp > 1 or not sequence]
MACHINE = Machine.preset("h100x8").with_devices(8)


@pytest.fixture(scope="module", params=["gpt", "llama"])
def layouts(request):
    library = resolve_library(None)
    graph = build_example(request.param, SIZES, library).with_microbatches(2)
    shared: dict = {}
    pcgs = [megatron_pcg(graph, library, shape, 8, zero=zero, sequence=seq, cache=shared)
            for shape, seq, zero in LAYOUTS]
    assert sum(p is not None for p in pcgs) >= 8
    return library, graph, [p for p in pcgs if p is not None]


@pytest.fixture(scope="module")
def built_alone():
    """`megatron_pcg` of an example model at a batch of `SIZES`, built alone (no `cache`, no `kin`), each layout once
    for the module: the reference the ZeRO-3 derivation and the kin layouts are compared with, which both ask for
    at batch 64 (bert's kin test takes its 8- and 16-device ZeRO-3 layouts from the derivation's test). A layout
    depends on the graph's content alone, and the tests only compare with it, never change it."""
    built: dict = {}

    def alone(name: str, batch: int, graph, shape: tuple, seq: bool, zero: int, at: bool = False):
        key = (name, batch, shape, seq, zero, at)
        if key not in built:
            built[key] = megatron_pcg(graph, resolve_library(None), shape, 8, zero=zero, sequence=seq,
                                      reduce_at_once=at)
        return built[key]

    return alone


def test_another_zero_stage_priced_from_a_stage_s_costs_is_that_stage_priced_afresh(layouts):
    library, graph, pcgs = layouts
    changed = 0
    for pcg in pcgs:
        fresh = {z: pcg_node_costs(replace(pcg, zero=z), library, MACHINE, True, graph.microbatches)
                 for z in (0, 1, 2)}
        for base in (0, 1, 2):
            for zero in (0, 1, 2):
                derived = restaged_node_costs(fresh[base], replace(pcg, zero=base), zero, library, MACHINE, True,
                                              graph.microbatches)
                assert derived == fresh[zero] and list(derived) == list(fresh[zero])
        changed += fresh[0] != fresh[1]
    assert changed >= len(pcgs) // 2   # the stage changes some layouts' costs: the derivation is not vacuous


def test_the_recomputing_form_priced_from_the_pcg_s_node_costs_is_it_priced_afresh(layouts):
    library, graph, pcgs = layouts
    for pcg in pcgs:
        for zero in (0, 1):
            base = replace(pcg, zero=zero)
            raw = pcg_node_costs(base, library, MACHINE, True, graph.microbatches)
            again = replace(base, recompute=BLOCKS)
            afresh = price_pcg(again, library, MACHINE, True, graph.microbatches)
            assert recomputed_pcg_costs(again, raw) == afresh
            assert afresh != price_pcg(base, library, MACHINE, True, graph.microbatches)   # not vacuous


@pytest.mark.parametrize("fitting", [True, False])
def test_every_grid_point_s_costs_are_its_pcg_priced_afresh(layouts, fitting):
    """With every point fitting (ZeRO-1 twins beside the ZeRO-0 points, on a GPU) and with none fitting (every
    point then a ZeRO-1, recomputing form): each point's costs are its own PCG's, priced alone."""
    library, graph, _pcgs = layouts
    points = independent_grid(graph, library, MACHINE, True, 8, (lambda c: True) if fitting else (lambda c: False))
    forms = {(p.config["zero"], p.pcg.recompute) for p in points}
    assert forms >= ({(0, "none"), (1, "none"), (3, "none")} if fitting else {(1, BLOCKS)})
    for point in points:
        assert point.costs == price_pcg(point.pcg, library, MACHINE, True, graph.microbatches)


def _recomputed_node_by_node(pcg, costs) -> dict:
    """`recomputed_pcg_costs` as it was before nodes alike shared their recomputed cost: each node's worked out."""
    out = dict(costs)
    for checkpoint in checkpoints(pcg):
        here = [i for i in checkpoint.runs if i in out]
        for ident in here:
            out[ident] = out[ident].recomputed(kept=ident in checkpoint.kept)
        block = sum(out[i].transient_bytes for i in here)
        for ident in here:
            out[ident] = out[ident].with_transient(block if ident == here[0] else 0)
    return out


def test_nodes_alike_sharing_their_recomputed_cost_give_each_node_s_own(layouts):
    library, graph, pcgs = layouts
    for pcg in pcgs:
        again = replace(pcg, recompute=BLOCKS)
        raw = pcg_node_costs(again, library, MACHINE, True, graph.microbatches)
        shared = len({id(c) for c in raw.values()})
        assert shared < len(raw) * 0.7   # nodes alike share cost objects, the memo exercised (gpt: 65 of 104)
        assert recomputed_pcg_costs(again, raw) == _recomputed_node_by_node(again, raw)
        assert recomputed_pcg_costs(pcg, raw) == raw   # nothing recomputed: the costs as they are


@pytest.mark.parametrize("name", ["gpt", "llama", "bert"])
def test_a_zero3_layout_derived_from_the_layout_without_it_is_the_one_built_alone(name, built_alone):
    """`megatron_pcg` with a shared cache derives each ZeRO-3 layout from the same layout built without ZeRO-3
    (`_MegatronBuilder.sharded_nodes`): node for node the PCG built alone, on meshes of 8 and 16 devices."""
    library = resolve_library(None)
    graph = build_example(name, SIZES, library)
    for devices in (8, 16):
        layouts = [((devices // tp, tp), seq) for tp in (2, 4, 8) if devices > tp for seq in (False, True)]
        shared: dict = {}
        derived, without = [], []
        for shape, seq in layouts:
            without.append(megatron_pcg(graph, library, shape, 8, zero=0, sequence=seq, cache=shared))
            derived.append(megatron_pcg(graph, library, shape, 8, zero=3, sequence=seq, cache=shared))
        builds = shared["built"]
        assert len(builds) == len(layouts) and all(b.chains for b, _o, _g in builds.values())   # derived
        alone = [built_alone(name, SIZES["batch"], graph, shape, seq, 3) for shape, seq in layouts]
        assert derived == alone and all(p is not None for p in alone)
        # ZeRO-3 adds nodes to the layout without it that each was derived from (those built in the shared cache:
        # a count of nodes, which a second build of each, alone, would give again)
        assert all(len(z3.nodes) > len(z0.nodes) for z3, z0 in zip(alone, without))


@pytest.mark.parametrize("name", [pytest.param("gpt", marks=pytest.mark.slow),
                                  pytest.param("llama", marks=pytest.mark.slow), "bert"])   # bert's is the cheapest
def test_a_layout_rescaled_from_a_kin_graph_s_is_the_one_built_alone(name, built_alone):
    """`megatron_pcg` with `kin` takes a layout of the graph at another batch (a step at another micro-batch
    count) rescaled where the build cannot tell the sizes apart (`_Kin`): node for node (shapes, the loss's
    1 / tokens) the layout built alone. At a batch whose dims split otherwise on the mesh it builds anew. The
    layouts that reduce each partial sum where it is made (`reduce_at_once`: a pipeline stage's grid) share one
    `kin` with the lazy ones, each taking only its own form's (llama's differ: its residual stream is lazily a
    partial sum)."""
    library = resolve_library(None)
    # each layout built alone, once (`built_alone`): batch 64 on 16 devices is both 16-device cases' first batch
    for devices, batches, alike in ((8, (64, 32, 16), True), (16, (64, 32), True), (16, (64, 24), False)):
        kin: dict = {}
        got = []
        for batch in batches:
            graph = build_example(name, {**SIZES, "batch": batch}, library)
            shared: dict = {}
            got += [(batch, graph, shape, seq, zero, at, megatron_pcg(graph, library, shape, 8, zero=zero,
                                                                      sequence=seq, cache=shared, kin=kin,
                                                                      reduce_at_once=at))
                    for tp in (2, 4) for shape in [(devices // tp, tp)] for seq in (False, True) for zero in (0, 3)
                    for at in (False, True)]
        verdicts = {found for _a, _b, found in kin["kin"].verdicts.values()}
        assert verdicts == {alike}
        for batch, graph, shape, seq, zero, at, pcg in got:
            assert pcg == built_alone(name, batch, graph, shape, seq, zero, at)
        assert sum(p is not None for *_rest, p in got) >= len(got) - 8
        if name == "llama":
            lazy = {(id(g), shape, seq, zero): pcg for _b, g, shape, seq, zero, at, pcg in got if not at}
            assert any(pcg != lazy[id(g), shape, seq, zero] for _b, g, shape, seq, zero, at, pcg in got if at)


def test_a_graph_laid_out_again_with_kin_takes_the_same_layout(built_alone):
    library = resolve_library(None)
    graph = build_example("gpt", SIZES, library)
    kin: dict = {}
    first = [megatron_pcg(graph, library, (4, 2), 8, zero=zero, sequence=True, cache={}, kin=kin) for zero in (0, 3)]
    again = [megatron_pcg(graph, library, (4, 2), 8, zero=zero, sequence=True, cache={}, kin=kin) for zero in (0, 3)]
    assert all(a is b for a, b in zip(first, again))   # taken, not built
    assert again == [built_alone("gpt", SIZES["batch"], graph, (4, 2), True, zero) for zero in (0, 3)]


def test_a_restated_form_shares_its_layout_s_facts_and_they_are_the_form_s_own(layouts):
    """`ir.pcg.restated`: a layout's form with another ZeRO stage or recomputation shares the facts the layout
    worked out from its nodes (`LAYOUT_FACTS`), and each is what the form alone works out; so are the facts a form
    works out first and the layout then reads; and the form's price, floor and simulated step are a fresh
    form's."""
    from parsat.cost.pcg_tasks import OpTimes, needs_gradient, regathered, simulate_pcg, step_floor, unkept
    from parsat.cost.saved import kept_values
    from parsat.ir.pcg import LAYOUT_FACTS, restated

    library, graph, pcgs = layouts

    def facts(pcg):
        return (dict(pcg.readers_of), dict(pcg.storage_chains), needs_gradient(pcg, library),
                kept_values(pcg, library), regathered(pcg, library), unkept(pcg, library))

    for pcg in pcgs:
        layout = replace(pcg)                          # a copy of its own: nothing worked out yet
        first = restated(layout, 1, BLOCKS)            # a fact the form works out first, the layout reads
        kept_values(first, library)
        assert all(getattr(first, name) is getattr(layout, name) for name in LAYOUT_FACTS)
        for zero, policy in ((0, BLOCKS), (1, "none"), (2, BLOCKS)):
            form, fresh = restated(layout, zero, policy), replace(pcg, zero=zero, recompute=policy)
            assert (form.zero, form.recompute) == (zero, policy) and form == fresh
            assert facts(form) == facts(fresh)
            assert price_pcg(form, library, MACHINE, True, 2) == price_pcg(fresh, library, MACHINE, True, 2)
            times = OpTimes(library, MACHINE)
            assert step_floor(form, MACHINE, times, 2) == step_floor(fresh, MACHINE, OpTimes(library, MACHINE), 2)
            assert simulate_pcg(form, library, MACHINE, times=times, microbatches=2).step_s == \
                simulate_pcg(fresh, library, MACHINE, times=OpTimes(library, MACHINE), microbatches=2).step_s
        assert facts(layout) == facts(replace(pcg))


def test_a_form_s_shared_block_facts_are_the_ones_its_own_nodes_give(layouts):
    """`node_blocks`, `pcg_roles`, `weight_chains` and the BLOCKS checkpoints are kept with a PCG (`PCG.derive`)
    and shared by its restated forms (`ir.pcg.restated`): each form, whichever asked first, reads what a PCG
    of its own nodes worked out afresh gives; one keeping every activation has no checkpoints though its
    recomputing sibling made them."""
    from parsat.ir.blocks import node_blocks
    from parsat.ir.pcg import pcg_roles, weight_chains
    from parsat.ir.recompute import NONE
    from parsat.ir.pcg import restated
    _library, _graph, pcgs = layouts
    for pcg in pcgs:
        recomputing = restated(pcg, 1, BLOCKS)
        made = checkpoints(recomputing)   # made first by the recomputing form, into the shared table
        keeping = restated(recomputing, 0, NONE)
        assert checkpoints(keeping) == () and made
        fresh = replace(pcg, zero=1, recompute=BLOCKS)   # a new PCG object: its own, empty table
        assert "derived" not in fresh.__dict__
        assert made == checkpoints(fresh)
        for form in (keeping, recomputing):
            assert dict(node_blocks(form)) == dict(node_blocks(fresh))
            assert dict(pcg_roles(form)) == dict(pcg_roles(fresh))
            assert weight_chains(form) == weight_chains(fresh)
        assert node_blocks(keeping) is node_blocks(recomputing)   # worked out once between them


def test_a_rescaled_layout_shares_the_kin_layout_s_structural_facts_and_they_are_its_own(built_alone):
    """`ir.megatron._rescaled` (`PCG.reshaped`): a layout taken from a kin graph's at another batch shares the facts
    worked out from the nodes' structure alone (`PCG.structural`, `storage_chains`) with the layout it was rescaled
    from, and each is what the rescaled layout works out alone; its floor and price are a fresh copy's. A fact
    that read a node's shape would differ here: the batches differ, so every activation's shape does."""
    from parsat.cost.pcg_tasks import OpTimes, needs_gradient, regathered, step_floor, unkept
    from parsat.cost.saved import kept_values
    from parsat.ir.blocks import node_blocks
    from parsat.ir.pcg import pcg_roles, weight_chains
    from parsat.ir.pcg import restated

    library = resolve_library(None)
    kin: dict = {}
    small, large = (build_example("llama", {**SIZES, "batch": batch}, library) for batch in (32, 64))

    def facts(pcg):
        return (dict(pcg.storage_chains), needs_gradient(pcg, library), kept_values(pcg, library),
                regathered(pcg, library), unkept(pcg, library), dict(node_blocks(pcg)), dict(pcg_roles(pcg)),
                weight_chains(pcg), checkpoints(restated(pcg, pcg.zero, BLOCKS)))

    shared = 0
    for shape, seq, zero in LAYOUTS:
        first = megatron_pcg(small, library, shape, 8, zero=zero, sequence=seq, cache={}, kin=kin)
        if first is None or shape[1] == 1:   # data parallelism is built, not rescaled
            continue
        before = facts(first)
        second = megatron_pcg(large, library, shape, 8, zero=zero, sequence=seq, cache={}, kin=kin)
        assert second is not None and second.nodes != first.nodes   # rescaled: other shapes
        assert second.structural is first.structural and second.storage_chains is first.storage_chains
        # built alone (llama's 8-device ZeRO-3 layouts by the derivation's test too); a copy of its own, nothing worked
        # out yet, so its facts are its own work
        alone = replace(built_alone("llama", 64, large, shape, seq, zero))
        assert alone == second and facts(second) == facts(alone) == before
        assert step_floor(second, MACHINE, OpTimes(library, MACHINE), 2) == \
            step_floor(alone, MACHINE, OpTimes(library, MACHINE), 2)
        assert price_pcg(second, library, MACHINE) == price_pcg(alone, library, MACHINE)
        shared += 1
    assert shared >= 4


def test_reshaping_a_pcg_with_other_structure_is_refused():
    from parsat.ir.pcg import PCG, Degrees, PNode

    a = PNode(0, "leaf", "x", (), (), (4,), Degrees.whole(1), role="input")
    b = PNode(1, "op", "neg", (0,), (), (4,), Degrees.whole(1), origin="y")
    pcg = PCG((a, b), (1,))
    assert pcg.reshaped((a, replace(b, shape=(8,)))).structural is pcg.structural
    with pytest.raises(ValueError):
        pcg.reshaped((a, replace(b, op="exp")))


@pytest.mark.parametrize("name", ["gpt", "llama", "bert"])
def test_a_data_parallel_layout_taken_from_a_kin_graph_s_is_the_one_built_alone(name):
    """`megatron_pcg` with `kin` and tp 1: data parallelism of the graph at another batch, taken from the kin
    graph's (rescaled, or built where it cannot be), node for node the layout built alone, ZeRO 0 and 3; a graph
    naming other inputs constant is not kin."""
    library = resolve_library(None)
    for devices, batches, alike in ((8, (64, 32, 16), True), (16, (64, 24), False)):
        kin: dict = {}
        got = []
        for batch in batches:
            graph = build_example(name, {**SIZES, "batch": batch}, library)
            got += [(graph, zero, megatron_pcg(graph, library, (devices, 1), 8, zero=zero, cache={}, kin=kin))
                    for zero in (0, 3)]
        for graph, zero, pcg in got:
            assert pcg == megatron_pcg(graph, library, (devices, 1), 8, zero=zero)
        assert sum(p is not None for *_rest, p in got) >= len(got) // 2
        assert {found for _a, _b, found in kin["kin"].verdicts.values()} == {alike}   # kin: taken rescaled
    graph = build_example(name, SIZES, library)
    other = replace(graph, constants=graph.constants | {graph.leaves[0].name})
    assert not _alike(graph, other, library, {}, {}, (8,))
    assert _alike(graph, graph, library, {}, {}, (8,))


def test_kin_verdicts_on_several_meshes_work_out_their_mesh_free_parts_once(monkeypatch):
    """`_Kin.alike` asks `_alike` once per pair of graphs and mesh shape, and its parts that read no mesh (the
    structures, the signatures) once per pair of graphs: the verdicts are `_alike`'s own on each mesh, a mesh on
    which a dim splits in one graph and not in the other (batch 64 against 24 on 16 data-parallel ranks) included."""
    library = resolve_library(None)
    like, graph = (build_example("gpt", {**SIZES, "batch": batch}, library) for batch in (64, 24))
    meshes = [(8, 1), (4, 2), (2, 4), (16, 1), (8, 2)]
    expected = {shape: _alike(like, graph, library, megatron_module.batch_dims(like, library),
                              megatron_module.batch_dims(graph, library), megatron_module._blocks(shape))
                for shape in meshes}
    assert set(expected.values()) == {True, False}   # kin on 8 devices, not where 16 data ranks split 64 alone
    calls = {"structure": 0, "signatures": 0}
    for name, inner in (("structure", megatron_module._same_structure),
                        ("signatures", megatron_module._same_signatures)):
        def counted(*args, _inner=inner, _name=name):
            calls[_name] += 1
            return _inner(*args)
        monkeypatch.setattr(megatron_module, f"_same_{name}", counted)
    kin = megatron_module._Kin(library)
    for g in (like, graph):
        kin.memo(g, None)
        kin.batches[id(g)] = (g, kin.memos[id(g)].data_batch)
    got = {}
    for shape in meshes * 2:
        mesh = megatron_module.Mesh.of([s for s in shape if s > 1], 8)
        got[shape] = kin.alike(like, graph, kin.memos[id(graph)].data_batch, mesh)
    assert got == expected
    assert calls == {"structure": 1, "signatures": 1}
