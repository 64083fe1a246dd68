"""A plan's totals read once per distinct cost object (issue 28, session 76): `ir.costs.totals` groups alike nodes'
shared cost objects (`_Alike`) and adds the float figures in the nodes' order (numpy's accumulate), and
`search.recompute.recomputed_pcg_costs` looks a block's nodes up by their costs' ids (`_Recomputing`,
`Checkpoint.kept_at`). Each must give exactly what the node-by-node computation it replaces gives: the
references are those computations as written at e2a9a68 (totals' is kept in `ir.costs` as the fallback,
`_totals_node_by_node`; recomputation's is written out below)."""

from __future__ import annotations

import pytest

import parsat.ir.costs as costs_module
from parsat.dsl.checker import resolve_library
from parsat.ir.costs import NodeCost, Totals, _Alike, totals
from parsat.ir.costs import _totals_node_by_node
from parsat.ir.machine import Machine
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import build_example
from parsat.ir.pcg import restated
from parsat.ir.recompute import checkpoints
from parsat.search.recompute import recomputed_pcg_costs
from parsat.search.solve import pcg_node_costs

SIZES = {"blocks": 3, "hidden": 256, "heads": 8, "batch": 64, "seq": 128, "vocab": 1024}
H100 = Machine.preset("h100x8").with_devices(8)


def _totals_as_written(costs, machine) -> Totals:
    """`totals` as written at e2a9a68: seven passes over the nodes' costs (`ir.costs` keeps them as the fallback
    for the sequences `_Alike` does not group)."""
    return _totals_node_by_node(list(costs.values()) if isinstance(costs, dict) else list(costs), machine)


def _recomputed_as_written(pcg, costs) -> dict:
    """`recomputed_pcg_costs` as written at e2a9a68: two look-ups per node."""
    out = dict(costs)
    again, charged = {}, {}
    for checkpoint in checkpoints(pcg):
        here = [i for i in checkpoint.runs if i in out]
        if not here:
            continue
        for ident in here:
            cost = out[ident]
            key = (id(cost), ident in checkpoint.kept)
            found = again.get(key)
            if found is None:
                found = again[key] = (cost, cost.recomputed(kept=key[1]))
            out[ident] = found[1]
        block = sum(out[i].transient_bytes for i in here)
        for ident in here:
            cost = out[ident]
            key = (id(cost), block if ident == here[0] else 0)
            found = charged.get(key)
            if found is None:
                found = charged[key] = (cost, cost.with_transient(key[1]))
            out[ident] = found[1]
    return out


def _sharing(costs: dict) -> list[int]:
    """Which node's cost object each node's is (the first node holding the same object): alike nodes' sharing."""
    first: dict[int, int] = {}
    return [first.setdefault(id(c), k) for k, c in enumerate(costs.values())]


@pytest.fixture(scope="module")
def library():
    return resolve_library(None)


@pytest.fixture(scope="module")
def forms(library):
    """Megatron layouts of gpt and llama on 8 devices priced, each as laid out and with ZeRO-1 and recomputing
    blocks: the (PCG, raw node costs) the grid's points read."""
    out = []
    for name in ("gpt", "llama"):
        graph = build_example(name, SIZES, library).with_microbatches(2)
        for shape, sequence, zero in (((4, 2), True, 0), ((2, 4), False, 3), ((8, 1), False, 0)):
            pcg = megatron_pcg(graph, library, shape, 8, zero=zero, sequence=sequence)
            if pcg is None:
                continue
            for form in (pcg, restated(pcg, max(pcg.zero, 1), pcg.recompute), restated(pcg, pcg.zero, "blocks")):
                raw = pcg_node_costs(form, library, H100, True, graph.microbatches)
                assert raw is not None
                out.append((form, raw))
    assert len(out) >= 9
    return out


@pytest.mark.parametrize("plain", [True, False])
def test_totals_are_the_node_by_node_sums(forms, plain, monkeypatch):
    """Both ways of adding the float figures in order: numpy's accumulation (where `sum` is plain, 3.11) and `sum`
    over the nodes' places (every version)."""
    if plain and not costs_module.PLAIN_FLOAT_SUM:
        pytest.skip("this interpreter's sum of floats is compensated: the accumulation is not used")
    monkeypatch.setattr(costs_module, "PLAIN_FLOAT_SUM", plain)
    for form, raw in forms:
        for costs in (raw, recomputed_pcg_costs(form, raw)):
            alike = _Alike.of(list(costs.values()))
            # the mechanism applies: far fewer objects than nodes, each figure read once per object
            assert alike is not None and len(alike.objects) == len({id(c) for c in costs.values()}) < len(costs)
            assert sum(alike.counts) == len(costs)
            got, want = totals(costs, H100), _totals_as_written(costs, H100)
            assert repr(got) == repr(want)   # every float the same double, every int the same
            assert repr(totals(list(costs.values()), H100)) == repr(want)


def test_totals_add_floats_in_the_nodes_order():
    big, one, minus = NodeCost(forward_s=1e16), NodeCost(forward_s=1.0), NodeCost(forward_s=-1e16)
    values = [big, one, one, minus, one, big, minus, one]
    got, want = totals(values, H100), _totals_as_written(values, H100)
    assert repr(got) == repr(want)
    # the order matters for these: added by object (count x figure) or exactly, the sum is 4.0
    assert 2 * 1e16 + 4 * 1.0 - 2 * 1e16 == 4.0 and want.time_s != 4.0
    assert got.compute_s == want.compute_s and got.time_s == want.time_s


def test_totals_where_grouping_does_not_apply():
    assert repr(totals({}, H100)) == repr(_totals_as_written({}, H100))   # the int 0s of an empty sum
    assert _Alike.of([]) is None
    ints = [NodeCost(forward_s=1, backward_s=2), NodeCost(comm_s=3, comm_elements=5)]   # int seconds: `sum` alike
    assert repr(totals(ints * 3, H100)) == repr(_totals_as_written(ints * 3, H100))
    halves = [NodeCost(memory_bytes=0.5), NodeCost(memory_bytes=1e16)]   # a float byte count: added node by node
    assert _Alike.of(halves) is None
    assert repr(totals(halves * 3, H100)) == repr(_totals_as_written(halves * 3, H100))
    negative = [NodeCost(forward_s=-0.0, backward_s=-0.0, optimizer_s=-0.0, comm_s=-0.0)] * 3
    assert repr(totals(negative, H100)) == repr(_totals_as_written(negative, H100))   # 0 + -0.0 is 0.0
    odd = [NodeCost(memory_bytes=7, transient_bytes=3), NodeCost(memory_bytes=9, transient_bytes=5)]
    assert repr(totals(odd * 4, H100)) == repr(_totals_as_written(odd * 4, H100))


def test_recomputed_costs_are_those_as_written(forms):
    for form, raw in forms:
        form = restated(form, form.zero, "blocks")
        got, want = recomputed_pcg_costs(form, raw), _recomputed_as_written(form, raw)
        assert list(got) == list(want)
        assert all(g == w and g.transient_bytes == w.transient_bytes and g.activation_bytes == w.activation_bytes
                   for g, w in zip(got.values(), want.values()))
        assert _sharing(got) == _sharing(want)   # alike nodes share the same objects, as before


def test_recomputed_costs_of_some_nodes(forms):
    """Costs that leave some of a block's nodes out (its first, a kept one): the block's priced nodes alone."""
    form, raw = next((f, r) for f, r in forms if checkpoints(restated(f, f.zero, "blocks")))
    form = restated(form, form.zero, "blocks")
    left_out = set()
    for checkpoint in checkpoints(form):
        assert checkpoint.kept_at == tuple(k for k, i in enumerate(checkpoint.runs) if i in checkpoint.kept)
        left_out.add(checkpoint.runs[0])
        left_out.update(list(checkpoint.kept)[:1])
    assert any(checkpoint.kept for checkpoint in checkpoints(form))
    some = {i: c for i, c in raw.items() if i not in left_out}
    got, want = recomputed_pcg_costs(form, some), _recomputed_as_written(form, some)
    assert list(got) == list(want) and _sharing(got) == _sharing(want)
    assert all(g == w and g.transient_bytes == w.transient_bytes for g, w in zip(got.values(), want.values()))
