"""The stage pricer's figures worked out once per content (`cost.pipeline.StagePricer`, `StageMemo`): a stage plan
of alike blocks has layers whose nodes share the same cost objects, chunks that reduce and gather alike weights,
and one chunk per stage in 1F1B and GPipe; each shortcut must give the figures the node-by-node pricing gives."""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

import pytest

from parsat.cost.pipeline import (StageFit, StageMemo, StagePricer, _summed, applicable_schedules)
from parsat.cost.stage_sync import bucketed_seconds, gather_buckets, weight_gathers, weight_reductions
from parsat.ir.machine import Machine
from parsat.ir.pipeline import GPIPE, INTERLEAVED, ONE_F_ONE_B, LayerMap, activation_peaks
from parsat.search.optimize import optimize
from parsat.search.recompute import recomputed_pcg_costs

SIZES = {"blocks": 8, "batch": 8, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}
LLAMA = {"blocks": 8, "hidden": 64, "heads": 8, "kv_heads": 2, "batch": 8, "seq": 16, "vocab": 128}


@pytest.fixture(scope="module")
def plans():
    """A gpt of 8 alike blocks on 2 devices with 4 micro-batches (the stage plan), with ZeRO-1 (the same nodes),
    with its blocks recomputed (transient bytes), and on 2 data-parallel ranks with ZeRO-1 (its weights' gradients
    reduce-scattered in buckets and their updated shards gathered, larger weights so that they are bandwidth's);
    and the first with bytes on its tied embedding's leaf, a free value the first and the last layer both read
    (charged once per stage that reads it); and a llama of 8 blocks with bytes on its rotary tables, free values
    every block reads (charged once per stage, not once per layer)."""
    plan = optimize("gpt", "cpu", devices=2, sizes=SIZES, microbatches=4, pipeline=False, baselines=False)
    recomputing = replace(plan.pcg, recompute="blocks")
    data_parallel = optimize("gpt", "cpu", devices=2, sizes={**SIZES, "hidden": 256, "vocab": 2048}, microbatches=4,
                             pipeline=False, baselines=False, degrees={"dp": 2, "zero": 1}, recompute="none")
    wte = next(n.id for n in plan.pcg.nodes if n.kind == "leaf" and n.op == "wte")
    tied = replace(plan, costs={**plan.costs, wte: replace(plan.costs[wte], activation_bytes=4096,
                                                                  memory_bytes=69632)})
    llama = optimize("llama", "cpu", devices=2, sizes=LLAMA, microbatches=4, pipeline=False, baselines=False)
    members = LayerMap(llama.pcg).layer_members.values()
    rope = [i for i in LayerMap(llama.pcg).free if i in llama.costs and sum(i in m for m in members) > 1]
    assert len(rope) >= 2   # its rotary tables, read by every block
    read_by_all = replace(llama, costs={**llama.costs, **{i: replace(llama.costs[i], activation_bytes=4096,
                                                                     memory_bytes=69632) for i in rope}})
    return [plan, replace(plan, pcg=replace(plan.pcg, zero=1)),
            replace(plan, pcg=recomputing, costs=recomputed_pcg_costs(recomputing, plan.costs)), data_parallel, tied,
            read_by_all]


class _Direct(StageMemo):
    """A memo that keeps nothing by content: every bucketing worked out afresh (the key's figures a pricer
    hands over, `flat`, left unread)."""

    def bucketed_seconds(self, reductions, machine, flat=None):
        return bucketed_seconds(reductions, machine)

    def gather_buckets(self, gathers, machine, flat=None):
        return gather_buckets(gathers, machine)

    def in_flight(self, schedule, degree, chunks_per_stage, microbatches):
        from parsat.ir.pipeline import in_flight_counts
        return in_flight_counts(schedule, degree, chunks_per_stage, microbatches)


class _NodeByNode(StagePricer):
    """The pricing before the shortcuts: each layer's cost summed node by node in the PCG's order, each cut's
    chunk bytes from its laid-out chunks (no running sums: `_chunk_bytes` None) and its peaks from the schedule's
    order (`activation_peaks`), start cuts worked out each time they are asked."""

    _layer_runs = None

    def layer_costs(self):
        position = self.layer_map.position.__getitem__
        return {layer: _summed([self.shares[i] for i in sorted(members, key=position) if i in self.shares])
                for layer, members in self.layer_map.layer_members.items()}

    def start_cuts(self, degree, schedule, chunks_per_stage=1):
        return self._work_out_start_cuts(degree, schedule, chunks_per_stage)


def _machine():
    return Machine.resolve("cpu").with_devices(4)


def test_alike_layers_share_one_figure_equal_to_the_node_by_node_sum(plans):
    """Each layer's cost and bytes, worked out once per sequence of share objects, equal the node-by-node sums of
    that layer alone; the 8 alike blocks share a handful of figures (the shortcut is taken)."""
    for plan in plans:
        pricer, full = StagePricer(plan, _machine()), _NodeByNode(plan, _machine())
        costs, expected = pricer.layer_costs(), full.layer_costs()
        assert costs == expected and list(costs) == list(expected)
        assert len({id(c) for c in costs.values()}) < len(costs) - 4
        own = pricer._layer_bytes
        free_of = dict(zip(pricer.layer_map.layers, pricer.layer_map.structure.layer_free))
        for layer, members in pricer.layer_map.layer_members.items():
            mine = [pricer.shares[i] for i in members if i not in pricer.layer_map.free and i in pricer.shares]
            assert own[layer] == (sum(c.activation_bytes for c in mine), sum(c.state_bytes for c in mine),
                                  max((c.transient_bytes for c in mine), default=0))
            alone, others = free_of[layer]   # the free values it reads: its alone and those shared with others
            assert frozenset(alone) | others == frozenset(i for i in members if i in pricer.layer_map.free)


def test_every_cut_s_memory_from_running_sums_is_the_laid_out_chunks(plans):
    """Every cut into 2 and 3 stages of one or two chunks each: the chunks' bytes from running sums over layers
    (a free value one layer alone reads summed into that layer) equal the laid-out chunks' node-by-node sums, and
    the busiest stage's memory, its peaks taken from the in-flight counts where a stage holds one chunk, equals
    the one from the schedule's order."""
    compared = 0
    for plan in plans:
        pricer = StagePricer(plan, _machine())
        layers = pricer.layer_map.layers
        for degree in (2, 3):
            for v in (1, 2):
                for rest in list(combinations(layers[1:], degree * v - 1))[::3]:
                    cut = (layers[0],) + rest
                    laid = pricer._chunk_costs(pricer.layer_map.lay_out(cut, degree))
                    bytes_ = [(c.activation_bytes, c.state_bytes, c.transient_bytes) for c in laid]
                    assert pricer._chunk_bytes(cut, degree) == bytes_, (cut, degree)
                    for schedule in ((ONE_F_ONE_B, GPIPE) if v == 1 else (INTERLEAVED,)):
                        try:
                            orders = pricer.memo.schedule_order(schedule, degree, v, pricer.microbatches)
                        except Exception:
                            continue
                        peaks = activation_peaks(orders, [a for a, _s, _t in bytes_])
                        stages = [[c for c in range(len(cut)) if c % degree == s] for s in range(degree)]
                        expected = max(sum(bytes_[c][1] for c in chunks) + peaks[s] +
                                       max(bytes_[c][2] for c in chunks) for s, chunks in enumerate(stages))
                        assert pricer._cut_peak_bytes(cut, degree, orders, schedule) == expected
                        compared += 1
    assert compared > 100


def test_bucketings_kept_by_content_are_the_stage_sync_ones(plans):
    """The memo's gradient buckets' seconds and parameter gathers' buckets, kept by (group, bytes) sequence, equal
    `stage_sync`'s for every run of a ZeRO-1 plan's weights, each gather bucket naming its own nodes (two runs
    of alike blocks share the key, not the nodes)."""
    zero1 = plans[3]
    machine = zero1.machine
    reductions, gathers = list(weight_reductions(zero1).values()), list(weight_gathers(zero1).values())
    assert reductions and gathers
    memo = StageMemo()
    step = max(1, len(gathers) // 8)
    for first in range(0, len(gathers), step):
        for end in range(first + 1, len(gathers) + 1, step):
            assert memo.gather_buckets(gathers[first:end], machine) == gather_buckets(gathers[first:end], machine)
    for first in range(0, len(reductions), step):
        for end in range(first + 1, len(reductions) + 1, step):
            assert memo.bucketed_seconds(reductions[first:end], machine) == bucketed_seconds(reductions[first:end],
                                                                                            machine)
    assert len(memo._gathers) < sum(1 for f in range(0, len(gathers), step) for _e in range(f + 1, len(gathers) + 1,
                                                                                             step))


@pytest.mark.parametrize("degree,gathers", [(2, True), (4, True), (2, False)])
def test_the_pricing_with_every_shortcut_is_the_node_by_node_pricing(plans, degree, gathers):
    """What the stage search and the pipeline search ask of a stage plan, with the shortcuts and without them (a
    memo keeping nothing by content, layers summed node by node, cuts laid out for their memory): the memory
    check, the floors, and the pipelined plan in every schedule (its own cut search), plan JSON for plan JSON;
    ZeRO-1's gathers overlapped with the next forward (each chunk's wait) or run after the update."""
    for plan in plans:
        machine = _machine()
        pricer = StagePricer(plan, machine, overlap_param_gather=gathers, memo=StageMemo())
        full = _NodeByNode(plan, machine, overlap_param_gather=gathers, memo=_Direct())
        schedules = applicable_schedules(None, degree, pricer.microbatches, pricer.layer_map.model_layers)
        assert pricer.least_peak_bytes(degree, schedules) == full.least_peak_bytes(degree, schedules)
        assert pricer.schedule_fitting_floors(degree, schedules) == full.schedule_fitting_floors(degree, schedules)
        for schedule, v in schedules:
            assert pricer.start_cuts(degree, schedule, v) == full.start_cuts(degree, schedule, v)
            assert pricer.pipelined(degree, schedule, v).to_json() == full.pipelined(degree, schedule, v).to_json()
        fit = StageFit(degree, machine)
        assert fit.peak_bytes(plan) == full.least_peak_bytes(degree, schedules)
