"""A layer map's structural facts (`ir.pipeline.LayerStructure`) are worked out once per PCG structure and shared
by the PCG's restated and reshaped forms: each form's map gives what a map of a PCG of its own gives, the pieces
that cross a cut stay each form's own, and a stage plan's chunk bytes read off the shared facts are those worked
out per pricer from its own layers' free values."""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

import pytest

from parsat.cost.pipeline import StagePricer
from parsat.ir.machine import Machine
from parsat.ir.pcg import restated
from parsat.ir.pipeline import LayerMap, layer_structure
from parsat.search.optimize import optimize

SIZES = {"blocks": 4, "batch": 8, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}


@pytest.fixture(scope="module")
def stage_plan():
    """A small gpt's plan on 2 devices with 4 micro-batches (a tied embedding: a free value two layers read)."""
    return optimize("gpt", "cpu", devices=2, sizes=SIZES, microbatches=4, pipeline=False, baselines=False)


def _cuts(layers):
    """Every cut of `layers` into 2 or 3 chunks, with the stage counts that divide them."""
    for chunks in (2, 3):
        for rest in combinations(layers[1:], chunks - 1):
            for degree in {chunks, 1}:
                yield (layers[0],) + rest, degree


def _fresh(pcg) -> LayerMap:
    """A map of a copy of `pcg` that shares no worked-out facts with it (its own `PCG.structural`)."""
    copy = replace(pcg)
    assert layer_structure(copy) is not layer_structure(pcg)
    return LayerMap(copy)


def test_a_restated_form_shares_the_structure_and_lays_out_as_a_fresh_map(stage_plan):
    pcg = stage_plan.pcg
    form = restated(pcg, 1, "blocks")
    assert layer_structure(form) is layer_structure(pcg)   # one structure for both forms
    shared, fresh = LayerMap(form), _fresh(pcg)
    assert shared.structure is layer_structure(pcg)
    assert shared.layers == fresh.layers and shared.free == fresh.free and shared.needs == fresh.needs
    assert shared.reader_layers == fresh.reader_layers and shared.blocked == fresh.blocked
    assert shared.layer_members == fresh.layer_members
    laid = 0
    for starts, degree in _cuts(shared.layers):
        if all(s in shared.cuttable for s in starts[1:]):
            assert shared.lay_out(starts, degree) == fresh.lay_out(starts, degree)
            laid += 1
    assert laid > 0


def test_a_reshaped_form_shares_the_structure_but_keeps_its_own_pieces(stage_plan):
    """Twice the sizes: the same structure, so the same layers and members, but the pieces that cross a cut are
    the reshaped form's (a structure that kept the first form's pieces would fail here)."""
    pcg = stage_plan.pcg
    bigger = pcg.reshaped(tuple(replace(n, shape=tuple(2 * d for d in n.shape)) for n in pcg.nodes))
    assert layer_structure(bigger) is layer_structure(pcg)
    shared, fresh, original = LayerMap(bigger), _fresh(bigger), LayerMap(pcg)
    assert shared.reader_layers == fresh.reader_layers
    assert shared.reader_layers != original.reader_layers   # the pieces grew
    assert [r[:3] for r in shared.reader_layers] == [r[:3] for r in original.reader_layers]
    starts = (shared.layers[0], shared.layers[len(shared.layers) // 2])
    assert shared.lay_out(starts, 2) == fresh.lay_out(starts, 2)


def _layer_runs_per_pricer(pricer: StagePricer):
    """`StagePricer._layer_runs` as it was worked out per pricer before the structure kept which free values each
    layer alone reads: each layer's free values from its members, their readers counted, the bytes summed."""
    layer_map, shares = pricer.layer_map, pricer.shares
    own = pricer._per_layer(lambda mine: (sum(c.activation_bytes for c in mine), sum(c.state_bytes for c in mine),
                                          max((c.transient_bytes for c in mine), default=0)), layer_map.free)
    needed = {layer: layer_map.layer_members[layer] & layer_map.free for layer in own}
    free_bytes = {i: (shares[i].activation_bytes, shares[i].state_bytes, shares[i].transient_bytes)
                  for i in layer_map.free if i in shares}
    readers: dict[int, int] = {}
    for layer in layer_map.layers:
        for i in needed[layer]:
            readers[i] = readers.get(i, 0) + 1
    acts, states, transients, shared = [0], [0], [], []
    for layer in layer_map.layers:
        act, state, transient = own[layer]
        mine = []
        for i in needed[layer]:
            figures = free_bytes.get(i)
            if figures is None:
                continue
            if readers[i] > 1:
                mine.append(i)
            else:
                act, state, transient = act + figures[0], state + figures[1], max(transient, figures[2])
        acts.append(acts[-1] + act)
        states.append(states[-1] + state)
        transients.append(transient)
        shared.append(frozenset(mine))
    return acts, states, transients, shared, {i: free_bytes[i] for i in readers if readers[i] > 1
                                              and i in free_bytes}


def test_chunk_bytes_read_off_the_structure_are_the_per_pricer_figures(stage_plan):
    """The tied embedding is a free value the first and last layers read: it is charged stage by stage, every
    other free value with its one layer, as the per-pricer computation charged them; every cut's chunk bytes
    agree with the node-by-node sums of the laid-out chunks (`_chunk_costs`)."""
    machine = Machine.resolve("cpu").with_devices(4)
    for form in (stage_plan, replace(stage_plan, pcg=restated(stage_plan.pcg, 1, "none"))):
        pricer = StagePricer(form, machine)
        assert pricer._layer_runs == _layer_runs_per_pricer(pricer)
        assert any(pricer._layer_runs[3])   # some layer shares a free value with another (the tied embedding)
        for starts, degree in _cuts(pricer.layer_map.layers):
            if not all(s in pricer.layer_map.cuttable for s in starts[1:]):
                continue
            costs = pricer._chunk_costs(pricer.memo.lay_out(pricer.layer_map, starts, degree))
            assert pricer._chunk_bytes(starts, degree) == [(c.activation_bytes, c.state_bytes, c.transient_bytes)
                                                           for c in costs]
