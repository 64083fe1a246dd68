"""Work the search shares instead of doing again gives the answers doing it again gives (issue 28): the layouts
of one graph sharing their per-axis operator options (`megatron_pcg`), pricers sharing compute operators' costs
(`extract.Pricer`'s `computed`), leaf roles and value names kept per snapshot (`Snapshot.derived`), operator
signatures kept per instance (`placement._signature`), and `_live` keeping the nodes it does not renumber."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.dsl.checker import resolve_library
from parsat.egraph.runner import Limits
from parsat.egraph.saturate import saturate
from parsat.ir.data_parallel import _live
from parsat.ir.instance import instance_for
from parsat.ir.machine import Machine
from parsat.ir.megatron import megatron_pcg
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example
from parsat.ir.pcg import Degrees, PNode
from parsat.ir.placement import _SIGNATURE, Placement, _signature, axis_compute, codes_for_rank
from parsat.search.baselines import independent_grid
from parsat.search.extract import Pricer, _leaf_roles, leaf_roles, node_costs
from parsat.search.repeat import _value_names, value_names
from parsat.search.request import resolve_request, step_context
from parsat.search.solve import price_pcg

SIZES = {"blocks": 2, "hidden": 256, "heads": 8, "batch": 64, "seq": 128, "vocab": 1024}
LAYOUTS = [((dp, tp), sequence, zero) for dp, tp in ((4, 2), (2, 4), (1, 8)) for sequence in (False, True)
           for zero in (0, 3)]


@pytest.fixture(scope="module")
def gpt():
    library = resolve_library(None)
    return library, build_example("gpt", SIZES, library).with_microbatches(2)


@pytest.fixture(scope="module")
def mlp_on_two_meshes():
    library = resolve_library(None)
    graph = build_example("mlp", library=library)
    return library, graph, [saturate(graph, library, library.rules, n, Limits()) for n in (2, 4)]


def test_layouts_sharing_their_operator_options_are_the_layouts_built_alone(gpt):
    library, graph = gpt
    alone = [megatron_pcg(graph, library, shape, 8, zero=zero, sequence=seq) for shape, seq, zero in LAYOUTS]
    assert sum(p is not None for p in alone) >= 8
    for order in (LAYOUTS, LAYOUTS[::-1]):   # whichever layout fills the shared options first
        shared: dict = {}
        together = {(shape, seq, zero): megatron_pcg(graph, library, shape, 8, zero=zero, sequence=seq, cache=shared)
                    for shape, seq, zero in order}
        assert [together[layout] for layout in LAYOUTS] == alone
    assert shared["memo"].options   # they were shared


def test_pricers_sharing_compute_costs_price_as_fresh_ones(gpt):
    library, graph = gpt
    request = resolve_request("gpt", "h100x8", None, None, 8, sizes=SIZES)
    step = step_context(request, 2)
    points = independent_grid(step.graph, library, step.machine, True, step.devices, step.memory.fits)
    assert len(points) >= 6 and len({p.pcg.zero for p in points}) > 1
    other = Machine.preset("a100x8").with_devices(8)   # another machine's costs in the same dict: never read here
    shared: dict = {}
    for point in points:
        price_pcg(point.pcg, library, other, True, step.graph.microbatches, computed=shared)
    for point in points + [replace(p, pcg=replace(p.pcg, zero=1)) for p in points]:
        fresh = price_pcg(point.pcg, library, step.machine, True, step.graph.microbatches)
        assert price_pcg(point.pcg, library, step.machine, True, step.graph.microbatches, computed=shared) == fresh
    assert shared


def test_e_node_pricers_sharing_compute_costs_across_meshes_price_as_fresh_ones(mlp_on_two_meshes):
    library, graph, results = mlp_on_two_meshes
    shared: dict = {}
    for result in results + results[::-1]:
        machine = Machine.preset("cpu").with_devices(result.snapshot.mesh.world)
        fresh = node_costs(result.snapshot, graph, library, machine)
        assert len(fresh) > 20
        assert node_costs(result.snapshot, graph, library, machine, computed=shared) == fresh


def test_leaf_roles_and_value_names_kept_per_snapshot_are_those_worked_out_afresh(mlp_on_two_meshes):
    _library, graph, results = mlp_on_two_meshes
    for result in results:
        snapshot = result.snapshot
        roles = {leaf.name: leaf.role for leaf in graph.leaves}
        handed = leaf_roles(snapshot, graph)
        assert handed == _leaf_roles(snapshot, roles) and any(r == "weight" for r in handed.values())
        handed.clear()   # a caller's copy, not the kept one
        assert leaf_roles(snapshot, graph) == _leaf_roles(snapshot, roles)
        # other leaves' roles are another key, not the kept answer
        as_inputs = replace(graph, leaves=tuple(replace(leaf, role="input") for leaf in graph.leaves))
        assert leaf_roles(snapshot, as_inputs) == _leaf_roles(snapshot, {n: "input" for n in roles})
        assert leaf_roles(snapshot, as_inputs) != leaf_roles(snapshot, graph)
        names = value_names(snapshot, result.classes)
        assert names == _value_names(snapshot, result.classes) and names
        names.clear()
        assert value_names(snapshot, result.classes) == _value_names(snapshot, result.classes)
        fewer = dict(list(result.classes.items())[:1])
        assert value_names(snapshot, fewer) == _value_names(snapshot, fewer)


def test_an_operator_signature_kept_by_identity_answers_only_for_its_instance(gpt):
    library, _graph = gpt
    instance = instance_for(library.ops["matmul"], ((4, 8), (8, 6)), {})
    cache: dict = {}
    decoy = object()
    cache[(_SIGNATURE, id(instance))] = (decoy, ("not", "this"))   # an entry left by another object of that id
    assert _signature(instance, cache) == _signature(instance)
    assert cache[(_SIGNATURE, id(instance))][0] is instance
    for codes in [(a, b) for a in codes_for_rank(2) for b in codes_for_rank(2)]:
        assert axis_compute(instance, codes, cache) == axis_compute(instance, codes)


def test_live_keeps_the_nodes_it_does_not_renumber_and_renumbers_the_rest():
    mesh = Mesh.of((2,))
    whole = Placement.whole(1)
    degrees = Degrees.of_placement(whole, mesh, 1)
    nodes = [PNode(0, "leaf", "a", (), (), (4,), degrees, "input", "a", whole),
             PNode(1, "op", "relu", (0,), (), (4,), degrees, origin="x", placement=whole),
             PNode(2, "leaf", "unused", (), (), (4,), degrees, "input", "unused", whole),
             PNode(3, "op", "relu", (1,), (), (4,), degrees, origin="y", placement=whole)]
    pcg = _live(nodes, [3], ("y",), mesh)
    expected = (nodes[0], nodes[1], replace(nodes[3], id=2, inputs=(1,)))
    assert pcg.nodes == expected and pcg.outputs == (2,)
    assert pcg.nodes[0] is nodes[0] and pcg.nodes[1] is nodes[1]   # unmoved: kept as they are


def test_a_shared_compute_cost_is_kept_apart_by_which_inputs_are_weights(gpt):
    library, _graph = gpt
    machine, mesh = Machine.preset("h100x8").with_devices(2), Mesh.of((2,))
    one = Degrees.of_placement(Placement.whole(1), mesh, 2)
    args = ("matmul", (), (64, 32), one, ((64, 128), (128, 32)), (one, one))
    shared: dict = {}
    for roles in (("", ""), ("", "weight"), ("", "")):
        fresh = Pricer(library, machine, mesh).price(*args, roles)
        assert Pricer(library, machine, mesh, computed=shared).price(*args, roles) == fresh
    priced = Pricer(library, machine, mesh)
    assert priced.price(*args, ("", "weight")) != priced.price(*args, ("", ""))   # the key must tell them apart
