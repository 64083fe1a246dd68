"""Work the search shares instead of doing again gives the answers doing it again gives (issue 28): the layouts
of one graph sharing their per-axis operator options (`megatron_pcg`), pricers sharing compute operators' costs
(`extract.Pricer`'s `computed`), leaf roles and value names kept per snapshot (`Snapshot.derived`), operator
signatures kept per instance (`placement._signature`), and `_live` keeping the nodes it does not renumber."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.cost.pcg_tasks import needs_gradient
from parsat.cost.saved import kept_values, regathered_values, runtime_regathers
from parsat.dsl.checker import resolve_library
from parsat.dsl.instantiate import InstantiationError
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.egraph.runner import Limits
from parsat.egraph.saturate import saturate
from parsat.ir.data_parallel import _live
from parsat.ir.instance import instance_for
from parsat.ir.machine import Machine
from parsat.ir.megatron import megatron_pcg
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example
from parsat.ir.pcg import PCG, WEIGHT_VALUE, Degrees, PNode, pcg_roles
from parsat.ir.placement import _SIGNATURE, Placement, _signature, axis_compute, codes_for_rank
from parsat.search.baselines import independent_grid
from parsat.search.extract import (ComputedCosts, Pricer, _compute, _leaf_roles, bottom_up, kept_classes, leaf_roles,
                                   node_costs)
from parsat.search.recompute import _kept_across_blocks, recomputed_enodes, recomputed_pcg_costs
from parsat.search.repeat import (OUTSIDE, REPEATED, Repetition, _value_names, chain_nodes, class_blocks,
                                  snapshot_blocks, value_names, weigh)
from parsat.search.request import resolve_request, step_context
from parsat.search import solve
from parsat.search.solve import price_pcg

SIZES = {"blocks": 2, "hidden": 256, "heads": 8, "batch": 64, "seq": 128, "vocab": 1024}
LAYOUTS = [((dp, tp), sequence, zero) for dp, tp in ((4, 2), (2, 4), (1, 8)) for sequence in (False, True)
           for zero in (0, 3)]


@pytest.fixture(scope="module")
def gpt():
    library = resolve_library(None)
    return library, build_example("gpt", SIZES, library).with_microbatches(2)


@pytest.fixture(scope="module")
def mlp_on_two_meshes(kept_programs):
    library = resolve_library(None)
    graph = build_example("mlp", library=library)
    return library, graph, [saturate(graph, library, library.rules, n, Limits(), caches=kept_programs) for n in (2, 4)]


@pytest.fixture(scope="module")
def layouts_alone(gpt):
    """Each of `LAYOUTS` built alone (None where it cannot be), in `LAYOUTS`' order: built once for the tests that
    read them (a PCG is a frozen value; none of them changes one)."""
    library, graph = gpt
    return [megatron_pcg(graph, library, shape, 8, zero=zero, sequence=seq) for shape, seq, zero in LAYOUTS]


def test_layouts_sharing_their_operator_options_are_the_layouts_built_alone(gpt, layouts_alone):
    library, graph = gpt
    alone = layouts_alone
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


def test_compute_costs_from_shared_instances_are_those_instantiated_afresh(mlp_on_two_meshes):
    """`Pricer` keeps the operators' instances beside the shared costs (`ComputedCosts.instances`): the
    e-nodes of two meshes priced through it cost what pricing with no memo gives, each instance is made once, and
    a refusal is kept and answered again as a refusal (None: the model cannot price it)."""
    library, graph, results = mlp_on_two_meshes
    shared = ComputedCosts()
    for result in results:
        machine = Machine.preset("cpu").with_devices(result.snapshot.mesh.world)
        mine = node_costs(result.snapshot, graph, library, machine, computed=shared)
        assert mine == node_costs(result.snapshot, graph, library, machine, computed={})
        instances, keyed = shared.instances, dict(shared)
        for reads, cost in keyed.items():
            op, attrs, shapes, inputs, out, weights, at, kept, ring = reads
            assert _compute(library, op, attrs, shapes, inputs, out, at, weights, kept, ring=ring) == cost
        assert len(mine) > 20 and 0 < len(instances) < len(keyed)   # instances shared by several spreads
    matmul, memo = library.ops["matmul"], {}
    one = Degrees.of_placement(Placement.whole(2), Mesh.of((2,)), 2)
    for _ in range(2):   # inner dims that disagree: refused, the second time from the memo
        assert _compute(library, "matmul", (), ((4, 8), (6, 3)), (one, one), one, Machine.preset("cpu"),
                        (False, True), True, memo) is None
    assert [type(v) for v in memo.values()] == [InstantiationError]


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


def _node_costs_afresh(snapshot, graph, library, machine) -> dict:
    """`node_costs` as it was before e-nodes were kept by their classes' kinds: the pricer asked for each."""
    roles, out, held = leaf_roles(snapshot, graph), {}, kept_classes(snapshot, graph, library)
    pricer = Pricer(library, machine, snapshot.mesh, microbatches=graph.microbatches)
    for cid, nodes in snapshot.classes.items():
        for index, node in enumerate(nodes):
            if cid not in snapshot.shape or any(ch not in snapshot.shape for ch in node.children):
                continue
            parallel = node.op in PARALLEL_OPS
            cost = pricer.price(node.op, node.attrs[:-1] if parallel else node.attrs, snapshot.shape[cid],
                                snapshot.degrees[cid], tuple(snapshot.shape[ch] for ch in node.children),
                                tuple(snapshot.degrees[ch] for ch in node.children),
                                tuple(roles.get(ch, "") for ch in node.children), node.attrs[-1] if parallel else None,
                                kept=cid in held)
            if cost is not None:
                out[(cid, index)] = cost
    return out


def test_e_nodes_kept_by_their_classes_kinds_are_priced_as_each_alone(mlp_on_two_meshes):
    library, graph, results = mlp_on_two_meshes
    for result in results:
        machine = Machine.preset("cpu").with_devices(result.snapshot.mesh.world)
        assert node_costs(result.snapshot, graph, library, machine) == \
            _node_costs_afresh(result.snapshot, graph, library, machine)


def _price_pcg_afresh(pcg, library, machine, microbatches) -> dict:
    """`price_pcg` as it was before nodes were kept by their kinds: the pricer asked for each node."""
    pricer, roles, flows = Pricer(library, machine, pcg.mesh, microbatches=microbatches, zero=pcg.zero), \
        pcg_roles(pcg), needs_gradient(pcg, library)
    by_id, out, held = {n.id: n for n in pcg.nodes}, {}, kept_values(pcg, library)
    again = regathered_values(pcg, library)   # the gathers only products' backward reads: the rest kept whole
    # the readers' input gradients hiding a backward re-gather: one rule, asked of the same module
    covers = solve._regather_covers(pcg, pricer, roles, held, again) if runtime_regathers(machine) else {}
    for node in pcg.nodes:
        children = [by_id[i] for i in node.inputs]
        attrs = (node.op,) if node.kind == "leaf" else tuple(v for k, v in node.attrs
                                                              if node.kind != "parallel" or k in ("dim", "to_dim"))
        out[node.id] = pricer.price(node.op if node.kind != "leaf" else "leaf", attrs, node.shape, node.degrees,
                                    tuple(c.shape for c in children), tuple(c.degrees for c in children),
                                    tuple(roles.get(c.id, "") for c in children),
                                    node.axis(pcg.mesh) if node.kind == "parallel" else None,
                                    stores=roles.get(node.id) != WEIGHT_VALUE,
                                    gradient=node.kind != "parallel" or flows[node.inputs[0]], kept=node.id in held,
                                    cover=covers.get(node.id, 0.0),
                                    kept_whole=node.kind == "parallel" and node.id in held and node.id not in again)
    return recomputed_pcg_costs(pcg, out)


def test_pcg_nodes_kept_by_their_kinds_are_priced_as_each_alone(gpt):
    library, graph = gpt
    machine = Machine.preset("h100x8").with_devices(8)
    points = independent_grid(graph, library, machine, True, 8)
    assert len(points) >= 6
    for point in points + [replace(p, pcg=replace(p.pcg, recompute="blocks")) for p in points[:3]]:
        assert price_pcg(point.pcg, library, machine, True, graph.microbatches) == \
            _price_pcg_afresh(point.pcg, library, machine, graph.microbatches)


def test_nodes_alike_but_for_a_role_or_a_gradient_are_priced_apart(gpt):
    """A replicated input and a replicated weight of one shape and spread: only the weight's copies take a summed
    gradient; a parallel operator whose source takes no gradient runs no backward (`needs_gradient`)."""
    library, _graph = gpt
    mesh = Mesh.of((2,), 8)
    machine = Machine.preset("h100x8").with_devices(2)
    whole, copied = Placement.whole(1), Placement((1,))   # FREE, then REPLICA on the one axis
    one, two = Degrees.of_placement(whole, mesh, 2), Degrees.of_placement(copied, mesh, 2)
    axis = (("axis", mesh.axes[0].name), ("degree", 2))
    nodes = (PNode(0, "leaf", "x", (), (), (64, 64), one, "input", "x", whole),
             PNode(1, "leaf", "w", (), (), (64, 64), one, "weight", "w", whole),
             PNode(2, "parallel", "replicate", (0,), axis, (64, 64), two, placement=copied),
             PNode(3, "parallel", "replicate", (1,), axis, (64, 64), two, placement=copied),
             PNode(4, "op", "matmul", (2, 3), (), (64, 64), two, origin="y", placement=copied))
    pcg = PCG(nodes, (4,), ("y",), mesh)
    kept = price_pcg(pcg, library, machine, True, 1)
    assert kept == _price_pcg_afresh(pcg, library, machine, 1)
    assert kept[2] != kept[3]


@pytest.fixture(scope="module")
def three_blocks(gpt, kept_programs):
    """A 3-block gpt saturated on 2 devices and its e-nodes priced."""
    library, _graph = gpt
    graph = build_example("gpt", {**SIZES, "blocks": 3}, library)
    result = saturate(graph, library, library.rules, 2, Limits(), caches=kept_programs)
    return graph, result, node_costs(result.snapshot, graph, library, Machine.preset("cpu").with_devices(2))


def test_weighing_with_shared_cost_objects_counts_each_e_node_as_alone(three_blocks):
    """`weigh` counts a cost object shared by many e-nodes once (by identity) and keeps the snapshot's blocks:
    the same figures as counting each e-node's cost afresh, and `costs` left as it was."""
    graph, result, costs = three_blocks
    snapshot = result.snapshot
    assert len({id(c) for c in costs.values()}) < len(costs)   # shared objects: what the memo keys on
    before = dict(costs)
    repetition = Repetition(graph, graph, 30)
    blocks = class_blocks(snapshot)
    afresh = {nid: cost.times(28) if blocks.get(nid[0]) == REPEATED else cost for nid, cost in costs.items()
              if all(blocks.get(ch, OUTSIDE) in (OUTSIDE, blocks.get(nid[0], OUTSIDE), blocks.get(nid[0], OUTSIDE) - 1)
                     for ch in snapshot.kids[nid])}
    assert any(blocks.get(nid[0]) == REPEATED for nid in afresh)
    assert len(afresh) < len(costs)   # some e-node breaks the chain: the filter is exercised
    for _ in range(2):   # the second time with the snapshot's blocks kept
        assert weigh(costs, snapshot, repetition) == afresh
    assert costs == before and snapshot_blocks(snapshot) == blocks
    # the e-nodes kept per snapshot (`chain_nodes`) filter other costs of it as they filter these: half of them
    half = dict(list(costs.items())[::2])
    assert weigh(half, snapshot, repetition) == {nid: cost for nid, cost in afresh.items() if nid in half}
    chained = chain_nodes(snapshot)
    assert frozenset(afresh) <= chained and not chained & (costs.keys() - afresh.keys())


def test_recomputing_shared_cost_objects_recomputes_each_e_node_as_alone(three_blocks):
    """`recomputed_enodes` recomputes a cost object shared by many e-nodes once per kept-or-not: the same costs
    as recomputing each e-node's afresh (the reference below is the loop as it was)."""
    graph, result, costs = three_blocks
    snapshot = result.snapshot
    roots = [result.classes[name] for name in graph.outputs]
    blocks = class_blocks(snapshot)
    across = {ch for cid, nodes in snapshot.classes.items() for node in nodes for ch in node.children
              if blocks.get(ch, OUTSIDE) != blocks[cid]}
    kept = set(roots) | across
    count = max(1, len({b for b in blocks.values() if b != OUTSIDE}))
    afresh = {}
    for (cid, index), cost in costs.items():
        node = snapshot.classes[cid][index]
        if blocks.get(cid, OUTSIDE) == OUTSIDE or node.op == "leaf" or cost.weight_chain:
            afresh[(cid, index)] = cost
            continue
        again = cost.recomputed(kept=cid in kept)
        afresh[(cid, index)] = again.with_transient(again.transient_bytes // count)
    assert afresh != costs   # recomputation changes costs here
    for _ in range(2):   # the second time with the kept classes worked out once per snapshot and roots
        assert recomputed_enodes(costs, snapshot, roots, "blocks") == afresh
    other = [cid for cid in snapshot.classes if cid not in kept][:2]   # other roots: their own kept classes
    assert other and _kept_across_blocks(snapshot, other) == (frozenset(other) | across, count)
    assert _kept_across_blocks(snapshot, roots) == (frozenset(kept), count)


def test_a_layout_s_floor_priced_without_its_parallel_nodes_is_its_floor_priced_whole(gpt, layouts_alone):
    """`step._stage_candidates` prices a grid family's first layout without its parallel nodes: what the floor
    reads of them (forward_s, backward_s) is 0 on every one, and the other nodes are priced as in the whole."""
    from parsat.search.step import _not_parallel
    from parsat.search.solve import pcg_node_costs
    library, graph = gpt
    machine = Machine.preset("h100x8").with_devices(8)
    layouts = [p for p in layouts_alone if p is not None]
    assert len(layouts) >= 8
    for pcg in layouts:
        whole = pcg_node_costs(pcg, library, machine, True, graph.microbatches)
        part = pcg_node_costs(pcg, library, machine, True, graph.microbatches, only=_not_parallel)
        parallel = [n.id for n in pcg.nodes if n.kind == "parallel"]
        assert parallel and all(whole[i].forward_s == whole[i].backward_s == 0.0 for i in parallel)
        assert part == {i: c for i, c in whole.items() if i not in parallel}
        assert sum(c.forward_s + c.backward_s for c in part.values()) == \
            sum(c.forward_s + c.backward_s for c in whole.values())


def test_a_pcg_s_rules_worked_out_once_per_set_of_makers_are_each_node_s_own(three_blocks):
    """`solve.pcg_from_extraction` names each node's rules once per set of makers: each is the library's rules
    that made that node, in library order, as looking them up node by node gives."""
    from parsat.search.extract import extract
    from parsat.search.solve import pcg_from_extraction
    graph, result, costs = three_blocks
    library = resolve_library(None)
    roots = [result.classes[n] for n in graph.outputs]
    extraction = extract(result.snapshot, costs, roots, float("inf"))
    pcg, ident = pcg_from_extraction(result, extraction, graph, library, roots, graph.outputs)
    where_is, by_id = library.rule_locations, {n.id: n for n in pcg.nodes}
    named = 0
    for cid, node_id in ident.items():
        made = result.snapshot.rules_at(cid, result.snapshot.classes[cid][extraction.choice[cid]])
        assert by_id[node_id].rules == tuple(shown for name, shown in where_is.items() if name in made)
        named += bool(made)
    assert named >= 3


def test_compute_costs_shared_across_node_counts_are_each_machine_s_own(gpt, layouts_alone):
    """`extract.Pricer` keeps compute costs by the machine less its node count: a compute node priced on a machine of
    1, 2 or 8 nodes, fresh or from costs another node count filled, costs the same."""
    from parsat.search.solve import pcg_node_costs
    from parsat.search.step import _not_parallel
    library, graph = gpt
    layouts = [p for p in layouts_alone[:6] if p is not None]   # the first six of `LAYOUTS`
    assert len(layouts) >= 4
    shared: dict = {}
    for pcg in layouts:
        fresh = [pcg_node_costs(pcg, library, Machine.preset("h100x8", nodes), True, graph.microbatches,
                                only=_not_parallel) for nodes in (1, 2, 8)]
        assert fresh[0] == fresh[1] == fresh[2]
        for nodes in (8, 1, 2):
            assert pcg_node_costs(pcg, library, Machine.preset("h100x8", nodes), True, graph.microbatches,
                                  only=_not_parallel, computed=shared) == fresh[0]
    assert len({key[-3] for key in shared}) == 1   # one machine in the keys (before `kept` and the ring's shares)


def test_extractions_sharing_compute_costs_give_the_plans_and_costs_of_fresh_ones(three_blocks):
    """`solve` prices a plan's PCG (a repeated plan's whole model) with the compute costs the call's other pricers
    worked out (`computed`): the same PCG and costs as pricing afresh, and a second extraction works out none."""
    graph, result, costs = three_blocks
    library = resolve_library(None)
    machine = Machine.preset("cpu").with_devices(2)
    roots = [result.classes[n] for n in graph.outputs]
    shared: dict = {}
    for recompute in ("none", "blocks"):   # each on an e-graph of its own: `solve` keeps what it built per e-graph
        fresh = solve.solve(_anew(result), graph, library, machine, roots, Limits(), True, recompute=recompute)
        kept = solve.solve(_anew(result), graph, library, machine, roots, Limits(), True, recompute=recompute,
                           computed=shared)
        assert kept[0] == fresh[0] and kept[1] == fresh[1]
    assert shared
    before = dict(shared)
    again = solve.solve(_anew(result), graph, library, machine, roots, Limits(), True, recompute="blocks",
                        computed=shared)
    assert again[1] == fresh[1] and shared == before


def _anew(result):
    """`result` with a snapshot of its own: the same e-graph, nothing kept with it (`Snapshot.derive`)."""
    return replace(result, snapshot=replace(result.snapshot))


def test_a_choice_built_before_is_taken_with_each_policy_s_own_costs(three_blocks):
    """`solve` keeps the choices it built last per e-graph (`solve._built`: the PCG, its stamp, the costs of each
    ZeRO stage priced): a policy extracting a kept choice gets the PCG and costs that the same e-graph with
    nothing kept gives, under its own ZeRO stage and recomputation (priced, restaged from another stage's costs,
    or recomputed from them), never another policy's, repeated into a whole model or not."""
    from parsat.ir.costs import totals
    graph, result, costs = three_blocks
    library = resolve_library(None)
    machine = Machine.preset("cpu").with_devices(2)
    roots = [result.classes[n] for n in graph.outputs]
    whole = Repetition(build_example("gpt", {**SIZES, "blocks": 6}, library), graph, 6)
    policies = [(0, "none"), (1, "none"), (2, "blocks"), (1, "blocks")]
    for repetition in (None, whole):
        figures, taken = set(), 0
        for zero, recompute in policies:
            priced = solve.price(result, graph, library, machine, True, None, repetition, roots, recompute, costs,
                                 zero=zero)
            kept = result.snapshot.derived.get(("solve._built", tuple(roots)))
            before = set(kept.keys()) if kept is not None else set()
            found = solve.solve(result, graph, library, machine, roots, Limits(), True, costs=priced,
                                repetition=repetition, recompute=recompute, zero=zero)
            fresh = solve.solve(_anew(result), graph, library, machine, roots, Limits(), True, costs=priced,
                                repetition=repetition, recompute=recompute, zero=zero)
            assert found[2].choice == fresh[2].choice
            assert found[0] == fresh[0] and found[1] == fresh[1]
            assert (found[0].zero, found[0].recompute) == (zero, recompute)
            taken += tuple(sorted(found[2].choice.items())) in before
            figures.add(totals(found[1], machine))
        assert taken >= 2   # a choice built before was taken: the kept costs were read
        assert len(figures) >= 3   # the policies' costs differ: another policy's costs would fail the comparison


def test_an_extraction_from_the_same_objects_takes_the_time_ranked_passes_kept(three_blocks, monkeypatch):
    """`extract` keeps its passes ranked by time with the snapshot (`extract._time_ranked`), held by the costs,
    exclusion and obligations they read: a grid point extracted again on a roomy machine takes them, and gets what
    the same e-graph with nothing kept gives; costs that are equal but another object are passed over."""
    from parsat.search import extract
    graph, result, costs = three_blocks
    roots = [result.classes[n] for n in graph.outputs]
    split = frozenset(nid for nid in costs if result.snapshot.classes[nid[0]][nid[1]].op == "partition")
    assert split
    passes = []
    monkeypatch.setattr(extract, "bottom_up", lambda *a, **k: passes.append(1) or bottom_up(*a, **k))
    figures = set()
    for exclude in (None, sorted(split)[::2], sorted(split)[1::2]):
        excluded = None if exclude is None else frozenset(exclude).__contains__
        for capacity, limits in ((1 << 40, Limits()), (float("inf"), replace(Limits(), ilp_seconds=0.0))):
            del passes[:]
            found = extract.extract(result.snapshot, costs, roots, capacity, limits, excluded)
            taken = not passes   # no bottom-up pass ran: neither the time-ranked one nor an ILP's
            fresh = extract.extract(_anew(result).snapshot, costs, roots, capacity, limits, excluded)
            assert (found.choice, found.time_s, found.memory_bytes, found.method, found.candidates,
                    found.ilp_status) == (fresh.choice, fresh.time_s, fresh.memory_bytes, fresh.method,
                                          fresh.candidates, fresh.ilp_status)
            assert taken == (limits.ilp_seconds == 0)   # the roomy extraction, after the first from these objects
            figures.add(found.time_s)
        del passes[:]
        extract.extract(result.snapshot, dict(costs), roots, float("inf"), replace(Limits(), ilp_seconds=0.0),
                        excluded)
        assert passes   # equal costs, another object: worked out again
    assert len(figures) >= 2   # the exclusions change the plan: another exclusion's passes would fail



def test_a_lean_extraction_again_within_less_memory_takes_the_lean_passes_kept(three_blocks, monkeypatch):
    """A lean extraction asked again from the same objects within less memory (`mesh._leaner_as_run`) takes the
    passes at memory prices made before (`lean_choices`' `known`), and gets what the same e-graph with nothing
    kept gives."""
    from parsat.search import extract
    graph, result, costs = three_blocks
    roots = [result.classes[n] for n in graph.outputs]
    priced = []   # the memory prices of the bottom-up passes run
    monkeypatch.setattr(extract, "bottom_up", lambda *a, **k: priced.append(k.get("memory_price", 0.0)) or
                        bottom_up(*a, **k))
    least = extract.extract(result.snapshot, costs, roots, float("inf"), replace(Limits(), ilp_seconds=0.0))
    taken = 0
    for first, second in ((0.8, 0.6), (0.6, 0.4), (0.5, 0.45)):
        snapshot = _anew(result).snapshot   # nothing kept from the pair before
        for share in (first, second):
            del priced[:]
            try:
                kept = extract.extract(snapshot, costs, roots, least.memory_bytes * share, Limits(), lean=True)
            except extract.ExtractionError as err:
                kept = str(err)
            kept_prices = [p for p in priced if p]
            del priced[:]
            try:
                fresh = extract.extract(_anew(result).snapshot, costs, roots, least.memory_bytes * share, Limits(),
                                        lean=True)
            except extract.ExtractionError as err:
                fresh = str(err)
            if isinstance(kept, str):
                assert kept == fresh
            else:
                assert (kept.choice, kept.time_s, kept.memory_bytes, kept.method, kept.candidates) == \
                    (fresh.choice, fresh.time_s, fresh.memory_bytes, fresh.method, fresh.candidates)
            taken += len(kept_prices) < len([p for p in priced if p])
    assert taken   # a second extraction took passes kept from the first (fewer priced passes than afresh)


def test_policies_pricing_the_same_e_nodes_share_what_the_passes_may_choose(three_blocks, monkeypatch):
    """Extractions from costs of the same e-nodes (the policies of one mesh: `extract._choosable`) take the e-nodes
    and readers the passes walk from the first, and get what the same e-graph with nothing kept gives; costs of
    other e-nodes or another exclusion work them out again."""
    from parsat.search import extract
    graph, result, costs = three_blocks
    roots = [result.classes[n] for n in graph.outputs]
    scanned = []   # a Choosable made by scanning the e-nodes (none taken from another)
    made = extract.Choosable.of
    monkeypatch.setattr(extract.Choosable, "of", staticmethod(
        lambda snapshot, costs, usable, like=None, **rest: scanned.append(like is None) or
        made(snapshot, costs, usable, like, **rest)))
    chosen = extract.extract(_anew(result).snapshot, costs, roots, 1 << 40, Limits()).choice
    unchosen = next(nid for nid in costs if chosen.get(nid[0], nid[1]) != nid[1])
    fewer = {nid: cost for nid, cost in costs.items() if nid != unchosen}
    excluded = frozenset(sorted(nid for nid in costs
                                if result.snapshot.classes[nid[0]][nid[1]].op == "partition")[::2]).__contains__
    policies = [(costs, None, False), ({nid: c.times(3) if c.comm_s else c for nid, c in costs.items()}, None, True),
                (fewer, None, False), (costs, excluded, False)]
    times, snapshot = set(), _anew(result).snapshot   # nothing kept from other tests
    for priced, exclude, shared in policies:
        del scanned[:]
        found = extract.extract(snapshot, priced, roots, 1 << 40, Limits(), exclude)
        assert scanned[0] != shared
        fresh = extract.extract(_anew(result).snapshot, priced, roots, 1 << 40, Limits(), exclude)
        assert (found.choice, found.time_s, found.memory_bytes, found.method, found.candidates) == \
            (fresh.choice, fresh.time_s, fresh.memory_bytes, fresh.method, fresh.candidates)
        times.add(found.time_s)
    assert len(times) >= 2   # the costs differ in what they choose


def test_policies_sharing_a_zero_stage_price_its_e_nodes_once(three_blocks, monkeypatch):
    """`solve.price` prices the e-nodes a ZeRO stage prices differently once per snapshot and stage
    (`solve._zero_costs`): the policies sharing a stage, keeping activations or recomputing, get the costs the same
    e-graph with nothing kept gives, and each stage its own."""
    graph, result, costs = three_blocks
    library = resolve_library(None)
    machine = Machine.preset("cpu").with_devices(2)
    roots = [result.classes[n] for n in graph.outputs]
    calls = []
    monkeypatch.setattr(solve, "node_costs", lambda *a, **k: calls.append(1) or node_costs(*a, **k))
    kept, stages = _anew(result), []
    for zero, recompute in ((1, "none"), (2, "blocks"), (1, "blocks"), (2, "none")):
        found = solve.price(kept, graph, library, machine, True, None, None, roots, recompute, costs, zero=zero)
        assert found == solve.price(_anew(result), graph, library, machine, True, None, None, roots, recompute, costs,
                                    zero=zero)
        stages.append(found)
    assert len(calls) == 2 + 4   # the kept e-graph's two stages, once each; every fresh one's
    assert stages[0] != stages[3]   # the stages differ: another stage's costs would fail the comparison


def test_policies_of_one_e_graph_recompute_and_weigh_its_raw_costs_once(three_blocks, monkeypatch):
    """`solve.price` works the raw costs out as a policy runs them once per snapshot, roots, recomputation and
    repetition (`solve._as_run_kept`), and lays a ZeRO stage's e-nodes as run over them: every policy gets the
    costs of recomputing and weighing its whole merged table (the reference below is `price` as it was), key for
    key in the same order, and the whole table is recomputed and weighed once per recomputation, not per stage."""
    graph, result, costs = three_blocks
    library = resolve_library(None)
    machine = Machine.preset("cpu").with_devices(2)
    roots = [result.classes[n] for n in graph.outputs]
    repetition = Repetition(graph, graph, 30)
    whole = []   # the sizes of the tables `weigh` was given
    weighing = solve.weigh
    monkeypatch.setattr(solve, "weigh", lambda c, *a: whole.append(len(c)) or weighing(c, *a))
    kept = _anew(result)
    policies = [(zero, recompute) for recompute in ("none", "blocks") for zero in (0, 1, 2)]
    for zero, recompute in policies + policies:   # the second round takes every policy's base again
        found = solve.price(kept, graph, library, machine, True, None, repetition, roots, recompute, costs, zero=zero)
        merged = {**costs, **solve._zero_costs(result.snapshot, graph, library, machine, True, {}, zero)} if zero \
            else costs
        reference = weighing(recomputed_enodes(merged, kept.snapshot, roots, recompute), kept.snapshot, repetition)
        assert found == reference and list(found) == list(reference)
    assert sum(size == len(costs) for size in whole) == 2   # the whole table once per recomputation
    assert len(whole) == 2 + 2 * 4   # and a ZeRO stage's few e-nodes per policy that has one
    assert max(size for size in whole if size != len(costs)) < len(costs) / 4
