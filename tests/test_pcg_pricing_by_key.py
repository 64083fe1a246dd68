"""Pricing a whole PCG node by node, by key (issue 28, session 75): `search.solve.pcg_node_costs` keeps a PCG's
node keys per `derived` table (its ZeRO and recomputation forms share them) and prices each key once;
`cost.saved.kept_reads` reads each operator once per call with a fast path where no operand is an input;
`search.recompute.recomputed_pcg_costs` writes its look-ups out; `ir.ring_attention.ring_attentions` looks
nodes up only where an attention node is; `GraphBuilder.op` keeps each operator's attribute names. Each must
give exactly what the computation it replaces gives: the references below are those computations, as written
before."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.cost.pcg_tasks import needs_gradient, profile_for
from parsat.cost.ring_time import ring_shares, rings_run
from parsat.cost.saved import INPUT, kept_reads, kept_values, regathered_values, runtime_regathers
from parsat.dsl.checker import resolve_library
from parsat.dsl.gradient import backward_reads, gradient_free, is_alias
from parsat.dsl.parallel_ops import ALL_GATHER, COMBINE, PARALLEL_OPS, REPLICATE
from parsat.ir.graph import GraphBuilder, GraphError
from parsat.ir.machine import Machine
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import build_example
from parsat.ir.pcg import PCG, pcg_roles, restated
from parsat.ir.recompute import checkpoints
from parsat.ir.ring_attention import ring_attentions
from parsat.search import solve
from parsat.search.extract import Pricer
from parsat.search.recompute import recomputed_pcg_costs
from parsat.search.solve import pcg_node_costs, restaged_node_costs

SIZES = {"blocks": 3, "hidden": 256, "heads": 8, "batch": 64, "seq": 128, "vocab": 1024}
H100 = Machine.preset("h100x8").with_devices(8)


@pytest.fixture(scope="module")
def library():
    return resolve_library(None)


@pytest.fixture(scope="module")
def layouts(library):
    """Megatron layouts of gpt and llama on 8 devices, with and without sequence parallelism (whose gathers a
    runtime that re-gathers gathers again: covers priced) and ZeRO-3 (weights' gathers)."""
    out = []
    for name in ("gpt", "llama"):
        graph = build_example(name, SIZES, library).with_microbatches(2)
        for shape, sequence, zero in (((4, 2), True, 0), ((2, 4), False, 3), ((1, 8), True, 0), ((8, 1), False, 0)):
            pcg = megatron_pcg(graph, library, shape, 8, zero=zero, sequence=sequence)
            if pcg is not None:
                out.append((graph, pcg))
    assert len(out) >= 6
    return out


def _fresh(pcg: PCG, **changes) -> PCG:
    """`pcg` (with `changes`) sharing nothing worked out: every fact worked out again."""
    return replace(PCG(pcg.nodes, pcg.outputs, pcg.output_names, pcg.mesh, pcg.recompute, pcg.zero), **changes)


def _priced_node_by_node(pcg, library, machine, microbatches, only=None) -> dict | None:
    """`pcg_node_costs` as it was written before its keys were kept (main 2a71169): the facts worked out per
    call, the keys built in the loop that prices them, the covers' readers each priced through the pricer."""
    pricer = Pricer(library, machine, pcg.mesh, True, None, microbatches=microbatches, zero=pcg.zero)
    roles = pcg_roles(pcg)
    flows, held, again = needs_gradient(pcg, library), kept_values(pcg, library), regathered_values(pcg, library)
    covers = solve._regather_covers(pcg, pricer, roles, held, again) if runtime_regathers(machine) else {}
    rings = rings_run(pcg, profile_for(machine).overlap)
    kind = solve._kinds(pcg, roles)
    priced, out = {}, {}
    for node in pcg.nodes:
        if only is not None and not only(node):
            continue
        ident, parallel = node.id, node.kind == "parallel"
        gradient = not parallel or flows[node.inputs[0]]
        cover, kept = covers.get(ident, 0.0), ident in held
        whole, ring = parallel and kept and ident not in again, ring_shares(rings, ident) if rings else ()
        key = ("leaf",) if node.kind == "leaf" else (node.kind, node.op, node.attrs, kind[ident],
                                                      tuple(kind[i] for i in node.inputs), gradient, kept, cover,
                                                      whole, ring)
        if key not in priced:
            priced[key] = solve._price_node(pricer, pcg, node, [pcg.node(i) for i in node.inputs], roles, gradient,
                                            kept, cover, whole, ring)
        if priced[key] is None:
            return None
        out[ident] = priced[key]
    return out


def test_keyed_pricing_is_the_node_by_node_pricing(library, layouts):
    """Every layout, on a machine that re-gathers (covers priced by key) and one that does not: the same costs,
    node for node and in the nodes' order, and nodes of one key share one cost object."""
    cpu = Machine.preset("cpu").with_devices(8)
    regathered = 0
    for graph, pcg in layouts:
        for machine in (H100, cpu):
            got = pcg_node_costs(_fresh(pcg), library, machine, True, graph.microbatches)
            want = _priced_node_by_node(_fresh(pcg), library, machine, graph.microbatches)
            assert list(got.items()) == list(want.items())
        regathered += bool(regathered_values(pcg, library))
    assert regathered >= 2   # sequence-parallel layouts: their gathers' covers are priced


def test_forms_share_the_keys_and_price_as_each_form_afresh(library, layouts):
    """A layout's forms (`restated`: ZeRO 1 and 2, recomputing) read the keys the first form worked out (the same
    object), and their costs, priced whole or restaged from the first form's, are those of the form priced with
    nothing shared; `only` prices the nodes it accepts, as node by node."""
    for graph, pcg in layouts:
        first = _fresh(pcg)
        mb = graph.microbatches
        base = pcg_node_costs(first, library, H100, True, mb)
        keys = [v for k, v in first.derived.items() if k[0][0] == "solve._node_keys"]
        assert len(keys) == 1
        for zero, recompute in ((1, "none"), (2, "blocks"), (0, "blocks")):
            form = restated(first, zero, recompute)
            afresh = _priced_node_by_node(_fresh(pcg, zero=zero, recompute=recompute), library, H100, mb)
            assert list(pcg_node_costs(form, library, H100, True, mb).items()) == list(afresh.items())
            assert [v for k, v in form.derived.items() if k[0][0] == "solve._node_keys"][0][1] is keys[0][1]
            restaged = restaged_node_costs(base, first, zero, library, H100, True, mb, form=form)
            assert restaged == afresh
        parallel = lambda node: node.kind == "parallel"   # noqa: E731
        assert pcg_node_costs(first, library, H100, True, mb, only=parallel) == \
            _priced_node_by_node(_fresh(pcg), library, H100, mb, only=parallel)


def test_keys_are_kept_per_micro_batch_count(library, layouts):
    """A cover is priced per step: the same PCG priced for another micro-batch count works its keys out apart,
    and gives the node-by-node figures for that count."""
    graph, pcg = next((g, p) for g, p in layouts if regathered_values(p, library))
    first = _fresh(pcg)
    for mb in (1, 4):
        assert list(pcg_node_costs(first, library, H100, True, mb).items()) == \
            list(_priced_node_by_node(_fresh(pcg), library, H100, mb).items())
    assert sum(k[0][0] == "solve._node_keys" for k in first.derived) == 2


def _kept_reads_as_written(readers, library, roles):
    """`kept_reads` as written before its operators' readings were kept (main 2a71169's loop, without the
    per-call operator tables): each node asks its operator's declaration."""
    direct, others, aliases = set(), set(), {}
    for made, op, reads in readers:
        if op in (REPLICATE, COMBINE, ALL_GATHER):
            if reads and not roles.get(reads[0], ""):
                aliases.setdefault(made, []).append(reads[0])
                continue
        decl = library.ops.get(op)
        if decl is not None and op not in PARALLEL_OPS and is_alias(decl):
            names = [p.name for p in decl.tensor_params]
            aliases.setdefault(made, []).append(reads[names.index(decl.body.tensor)])
            continue
        if decl is None or op in PARALLEL_OPS:
            continue
        names = [p.name for p in decl.tensor_params]
        free = gradient_free(decl)
        needs = frozenset(n for n, v in zip(names, reads) if roles.get(v, "") != INPUT and n not in free)
        wanted = backward_reads(decl, needs)
        (direct if op in ("matmul", "bmm", "linear", "linear_nobias", "linear_t", "linear_nobias_t") else others) \
            .update(v for n, v in zip(names, reads) if n in wanted)

    def closed(values):
        found, stack = set(values), list(values)
        while stack:
            for source in aliases.get(stack.pop(), ()):
                if source not in found:
                    found.add(source)
                    stack.append(source)
        return frozenset(found)
    return closed(direct), closed(others)


@pytest.mark.parametrize("name", ["gpt", "llama", "bert"])
def test_kept_reads_are_those_each_node_asks_anew(library, name):
    """Layouts where inputs (the slow path), weights and activations read the same operators: both parts of
    `kept_reads` as each node asking its declaration gives them; and the graph's own readers."""
    graph = build_example(name, SIZES, library)
    for shape, sequence in (((8, 1), False), ((4, 2), True), ((2, 4), False)):
        pcg = megatron_pcg(graph, library, shape, 8, sequence=sequence)
        roles = pcg_roles(pcg)
        readers = [(n.id, n.op, n.inputs) for n in pcg.nodes if n.kind != "leaf"]
        assert kept_reads(readers, library, roles) == _kept_reads_as_written(readers, library, roles)
        assert any(roles.get(i) == INPUT for _m, _o, reads in readers for i in reads)
    roles = {leaf.name: leaf.role for leaf in graph.leaves}
    readers = [(n.name, n.op, n.inputs) for n in graph.nodes]
    assert kept_reads(readers, library, roles) == _kept_reads_as_written(readers, library, roles)


def _recomputed_as_written(pcg, costs):
    """`recomputed_pcg_costs` as written before its look-ups were written out (a closure per node)."""
    out, done = dict(costs), {}

    def once(key, make):
        if key not in done:
            done[key] = make()
        return done[key]
    for checkpoint in checkpoints(pcg):
        here = [i for i in checkpoint.runs if i in out]
        for ident in here:
            cost, kept = out[ident], ident in checkpoint.kept
            out[ident] = once((id(cost), kept), lambda: (cost, cost.recomputed(kept=kept)))[1]
        if not here:
            continue
        block = sum(out[i].transient_bytes for i in here)
        for ident in here:
            cost, transient = out[ident], block if ident == here[0] else 0
            out[ident] = once((id(cost), "transient", transient), lambda: (cost, cost.with_transient(transient)))[1]
    return out


def test_recomputed_costs_are_those_as_written(library, layouts):
    for graph, pcg in layouts:
        form = restated(pcg, 0, "blocks")
        raw = pcg_node_costs(form, library, H100, True, graph.microbatches)
        got, want = recomputed_pcg_costs(form, raw), _recomputed_as_written(form, raw)
        assert list(got.items()) == list(want.items())
        # alike nodes still share one recomputed cost object
        assert len({id(c) for c in got.values()}) == len({id(c) for c in want.values()})


def test_ring_attentions_reads_no_readers_where_no_attention_rings(library, layouts):
    for _graph, pcg in layouts:
        fresh = _fresh(pcg)
        assert ring_attentions(fresh) == {}
        assert "readers_of" not in fresh.__dict__


def test_graph_builder_attributes_by_keyword_or_position(library):
    """`GraphBuilder.op` with its attribute names kept per operator: positional and keyword attributes give the
    same node, too many are refused as before."""
    g = GraphBuilder(library)
    x = g.input("x", [4, 6])
    a = g.op("softmax", x, 1, name="a")
    b = g.op("softmax", x, dim=1, name="b")
    c = g.op("transpose", x, 0, d1=1, name="c")
    g.output(a, b, c)
    graph = g.build()
    nodes = {n.name: n for n in graph.nodes}
    assert nodes["a"].attrs == nodes["b"].attrs == (("dim", 1),)
    assert nodes["c"].attrs == (("d0", 0), ("d1", 1)) and nodes["c"].shape == (6, 4)
    with pytest.raises(GraphError, match="takes 1 attribute"):
        g.op("softmax", x, 1, 2)
