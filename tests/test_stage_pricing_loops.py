"""The stage pricer's inner loops made cheaper (`cost.pipeline.StagePricer`, `ir.pipeline.simulate_schedule`): the
schedule run stage by stage until an input is missing, the shares and sums handed over in C, a chunk's gather waits
read off running sums, the in-node collectives found once per attribute tuple, the shared weights looked for among
those two layers hold. Each must give the figures the loops before gave: those loops are kept here as the reference
(`_round_robin`, `_AsBefore`) and compared figure for figure."""

from __future__ import annotations

import random
import pytest

import parsat.cost.pipeline as cost_pipeline
from parsat.cost.pcg_tasks import mesh_groups
from parsat.cost.pipeline import (LayerCost, StageMemo, StagePricer, _in_node_collectives, _summed,
                                  applicable_schedules, node_share)
from parsat.ir.machine import Machine
from parsat.ir.pipeline import (BACKWARD, FORWARD, GPIPE, INTERLEAVED, ONE_F_ONE_B, Chunk, Crossing, LayerMap,
                                PipelineError, ScheduleRun, StageLayout, activation_peaks, nodes_elements,
                                schedule_order, simulate_schedule)
from parsat.search.optimize import optimize

SIZES = {"blocks": 8, "batch": 8, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}
LLAMA = {"blocks": 8, "hidden": 64, "heads": 8, "kv_heads": 2, "batch": 8, "seq": 16, "vocab": 128}


# ------------------------------------------------------------------ the schedule, as it was run before


def _round_robin(layout, schedule, microbatches, forward_s, backward_s, transfer_s, activation_bytes,
                 first_forward_wait_s=(), first_forward_ready_s=()):
    """`simulate_schedule` before: every stage tried in turn, one action a pass, each action's inputs listed and
    looked up by (phase, micro-batch, chunk)."""
    p = layout.degree
    orders = schedule_order(schedule, p, layout.chunks_per_stage, microbatches)
    sources, targets = {}, {}
    for crossing in layout.crossings:
        sources.setdefault(crossing.target, set()).add(crossing.source)
        targets.setdefault(crossing.source, set()).add(crossing.target)
    done, free_at, position = {}, [0.0] * p, [0] * p
    busy = [[] for _ in range(p)]
    total = sum(len(o) for o in orders)
    while sum(position) < total:
        progressed = False
        for s in range(p):
            if position[s] == len(orders[s]):
                continue
            action = orders[s][position[s]]
            k, c = action.microbatch, action.chunk
            if action.phase == FORWARD:
                needs = [(FORWARD, k, src, transfer_s.get((src, c), 0.0)) for src in sources.get(c, ())]
            else:
                needs = [(FORWARD, k, c, 0.0)] + [(BACKWARD, k, t, transfer_s.get((c, t), 0.0))
                                                  for t in targets.get(c, ())]
            if any((phase, mb, chunk) not in done for phase, mb, chunk, _d in needs):
                continue
            ready = 0.0
            for phase, mb, chunk, delay in needs:
                ready = max(ready, done[(phase, mb, chunk)] + delay)
            if first_forward_ready_s and action.phase == FORWARD and k == 0:
                ready = max(ready, first_forward_ready_s[c])
            start = max(free_at[s], ready)
            seconds = (forward_s if action.phase == FORWARD else backward_s)[c]
            if first_forward_wait_s and action.phase == FORWARD and k == 0:
                seconds += first_forward_wait_s[c]
            end = start + seconds
            done[(action.phase, k, c)] = end
            busy[s].append((action, start, end))
            free_at[s], position[s], progressed = end, position[s] + 1, True
        if not progressed:
            raise PipelineError(f"the {schedule} schedule deadlocks on this layout")
    return ScheduleRun(max(free_at), tuple(tuple(b) for b in busy), activation_peaks(orders, [1] * len(layout.chunks)),
                       activation_peaks(orders, activation_bytes))


def _layout(p: int, v: int, crossings) -> StageLayout:
    chunks = tuple(Chunk(c, c % p, (c,), (c,)) for c in range(p * v))
    return StageLayout(p, v, chunks, tuple(Crossing(100 + k, a, b, 1) for k, (a, b) in enumerate(crossings)), ())


def test_the_stage_runner_is_the_round_robin_simulation():
    """Random layouts (each chunk read by the next one and by a few later ones: several stages waiting for one
    action), every schedule, random seconds, transfers, gather waits and earliest starts: the same run, float for
    float, with the in-flight counts handed in or not."""
    rng = random.Random(28)
    compared = 0
    for _case in range(120):
        p, v = rng.choice([2, 3, 4]), rng.choice([1, 1, 2])
        n = p * v
        crossings = {(c, c + 1) for c in range(n - 1)} | {(a, b) for a in range(n) for b in range(a + 2, n)
                                                          if rng.random() < 0.3}
        layout = _layout(p, v, sorted(crossings))
        schedule = INTERLEAVED if v > 1 else rng.choice([ONE_F_ONE_B, GPIPE])
        m = p * rng.choice([1, 2, 3])
        forward = [rng.uniform(0.1, 2.0) for _ in range(n)]
        backward = [rng.uniform(0.1, 4.0) for _ in range(n)]
        transfers = {pair: rng.uniform(0.0, 0.3) for pair in crossings if rng.random() < 0.7}
        acts = [rng.randrange(0, 1000) for _ in range(n)]
        waits = [rng.uniform(0.0, 1.0) for _ in range(n)] if rng.random() < 0.5 else []
        ready = [rng.uniform(0.0, 1.0) for _ in range(n)] if rng.random() < 0.5 else []
        expected = _round_robin(layout, schedule, m, forward, backward, transfers, acts, waits, ready)
        orders = schedule_order(schedule, p, v, m)
        assert simulate_schedule(layout, schedule, m, forward, backward, transfers, acts, waits, ready) == expected
        assert simulate_schedule(layout, schedule, m, forward, backward, transfers, acts, waits, ready, orders,
                                 activation_peaks(orders, [1] * n)) == expected
        compared += 1
    assert compared == 120


def test_a_deadlock_is_found_as_before():
    """Two chunks reading each other: neither runs, as the passes found."""
    layout = _layout(2, 1, [(0, 1), (1, 0)])
    for run in (_round_robin, simulate_schedule):
        with pytest.raises(PipelineError, match="deadlocks"):
            run(layout, ONE_F_ONE_B, 2, [1.0, 1.0], [1.0, 1.0], {}, [1, 1])


# ------------------------------------------------------------------ the pricer, as it was before


class _AsBefore(StagePricer):
    """The pricer's loops before: shares keyed per node, layers' and chunks' shares listed in Python, stage sums
    over generators, each chunk's gather waits walked node by node, shared weights looked for among every weight,
    in-node collectives found per node; the schedule run by `_round_robin` (`price`, through the module)."""

    def __init__(self, plan, machine, overlap_param_gather=None, memo=None, tp_comm_overlap=None):
        super().__init__(plan, machine, overlap_param_gather, memo, tp_comm_overlap)
        in_node = _in_node_as_before(plan)
        made, self.shares = {}, {}
        for ident, cost in plan.costs.items():
            key = (id(cost), ident in in_node)
            if key not in made:
                made[key] = node_share(cost, self.microbatches, key[1])
            self.shares[ident] = made[key]

    def _per_layer(self, figure, left_out=()):
        shares, made, out = self.shares, {}, {}
        for layer, ordered in self._layer_orders:
            mine = [shares[i] for i in ordered if i in shares and i not in left_out]
            key = tuple(map(id, mine))
            if key not in made:
                made[key] = figure(mine)
            out[layer] = made[key]
        return out

    def _chunk_costs(self, layout):
        out = []
        for chunk in layout.chunks:
            charged = {i for c in layout.stage_chunks(chunk.stage) if c.index < chunk.index for i in c.nodes}
            mine = [self.shares[i] for i in chunk.nodes if i not in charged and i in self.shares]
            out.append(LayerCost(sum(c.forward_s for c in mine), sum(c.backward_s for c in mine),
                                 sum(c.activation_bytes for c in mine), sum(c.state_bytes for c in mine),
                                 sum(c.step_s for c in mine), max((c.transient_bytes for c in mine), default=0),
                                 sum(c.tp_comm_s for c in mine)))
        return out

    def _stage_sums(self, layout, stage):
        nodes = layout.stage_nodes(stage)
        costs = self.plan.costs
        return (sum(self.optimizer_s.get(i, 0.0) for i in nodes),
                sum(costs[n].comm_elements for n in nodes if n in costs),
                sum(costs[n].grad_sync_elements for n in nodes if n in costs))

    def _gather_wait(self, chunk, buckets, queued):
        first, at = {}, 0.0
        for i in chunk.nodes:
            if i in self.chain_s:
                continue
            for r in self.layer_map.needs.get(i, ()):
                first.setdefault(r, at)
            share = self.shares.get(i)
            if share is not None:
                at += self.overlap.applied(share).forward_s
        waits = [cost_pipeline.prefetch_delay([seconds for _nodes, seconds in found],
                                              [min((first.get(n, at) for n in nodes), default=at)
                                               for nodes, _s in found], queued.get(group, 0.0))
                 for group, found in buckets.items()]
        return max(waits, default=0.0)


def _in_node_as_before(plan):
    groups = mesh_groups(plan.pcg)
    return {node.id for node in plan.pcg.nodes if node.kind == "parallel" and groups(node).nodes_spanned == 1}


def _shared_as_before(layer_map: LayerMap, layout: StageLayout) -> tuple:
    """`lay_out`'s shared weights looked for among every weight."""
    members = [frozenset().union(*(layer_map.layer_members[layer] for layer in c.layers)) for c in layout.chunks]
    out = []
    for weight in layer_map.weights:
        stages = tuple(sorted({c % layout.degree for c in range(len(layout.chunks)) if weight in members[c]}))
        if len(stages) > 1:
            out.append((weight, stages))
    return tuple(out)


@pytest.fixture(scope="module")
def plans():
    """A gpt of 8 alike blocks on 2 devices (its tied embedding read by the first and the last layer: a weight two
    stages hold), the same on 2 data-parallel ranks with ZeRO-1 (weights' gradients reduce-scattered in buckets and
    their updated shards gathered during the next forward), and a llama of 8 blocks."""
    plan = optimize("gpt", "cpu", devices=2, sizes=SIZES, microbatches=4, pipeline=False, baselines=False)
    data_parallel = optimize("gpt", "cpu", devices=2, sizes={**SIZES, "hidden": 256, "vocab": 2048}, microbatches=4,
                             pipeline=False, baselines=False, degrees={"dp": 2, "zero": 1}, recompute="none")
    llama = optimize("llama", "cpu", devices=2, sizes=LLAMA, microbatches=4, pipeline=False, baselines=False)
    return [plan, data_parallel, llama]


def _machine():
    return Machine.resolve("cpu").with_devices(4)


@pytest.mark.parametrize("degree,gathers", [(2, True), (4, True), (2, False)])
def test_the_pricing_is_the_pricing_before(plans, degree, gathers, monkeypatch):
    """The memory check, the floors, the start cuts and the pipelined plan in every schedule (its own cut search):
    plan JSON for plan JSON against the loops before, the schedule run the old way too; ZeRO-1's gathers
    overlapped with the next forward (each chunk's wait) or after the update."""
    for plan in plans:
        machine = _machine()
        pricer = StagePricer(plan, machine, overlap_param_gather=gathers, memo=StageMemo())
        schedules = applicable_schedules(None, degree, pricer.microbatches, pricer.layer_map.model_layers)
        mine = [pricer.least_peak_bytes(degree, schedules), pricer.schedule_fitting_floors(degree, schedules)]
        mine += [pricer.pipelined(degree, schedule, v).to_json() for schedule, v in schedules]
        with monkeypatch.context() as patched:
            patched.setattr(cost_pipeline, "simulate_schedule", lambda *a, **k: _round_robin(*a[:9]))
            before = _AsBefore(plan, machine, overlap_param_gather=gathers, memo=StageMemo())
            theirs = [before.least_peak_bytes(degree, schedules), before.schedule_fitting_floors(degree, schedules)]
            theirs += [before.pipelined(degree, schedule, v).to_json() for schedule, v in schedules]
        assert mine == theirs
        if gathers and plan is plans[1]:   # the gathers' waits were read
            assert pricer.gathers and pricer._sync_memo


def test_each_loop_gives_the_figures_before(plans):
    """Loop by loop on every cut of 2 and 4 stages: the shares (the same values, nodes alike sharing one object
    exactly where they did), each layer's and chunk's sums, each stage's sums, each chunk's gather wait, the
    in-node collectives and the shared weights (the tied embedding found on two stages)."""
    machine, tied = _machine(), 0
    for plan in plans:
        pricer = StagePricer(plan, machine, overlap_param_gather=True, memo=StageMemo())
        before = _AsBefore(plan, machine, overlap_param_gather=True, memo=StageMemo())
        assert _in_node_collectives(plan) == _in_node_as_before(plan)
        assert pricer.shares == before.shares and list(pricer.shares) == list(before.shares)
        first, first_before = {}, {}   # each share object -> the first node holding it
        assert [first.setdefault(id(pricer.shares[i]), i) for i in pricer.shares] == \
            [first_before.setdefault(id(before.shares[i]), i) for i in before.shares]
        assert pricer.layer_costs() == before.layer_costs() and pricer._layer_bytes == before._layer_bytes
        layers = pricer.layer_map.layers
        for degree in (2, 4):
            for k in range(1, len(layers) - degree + 2):
                cut = (layers[0],) + tuple(layers[k:k + degree - 1])
                layout = pricer.layer_map.lay_out(cut, degree)
                assert layout.shared_weights == _shared_as_before(pricer.layer_map, layout)
                tied += bool(layout.shared_weights)
                assert pricer._chunk_costs(layout) == before._chunk_costs(layout)
                for s in range(degree):
                    assert pricer._stage_sums(layout, s) == before._stage_sums(layout, s)
                    assert pricer._stage_sums(layout, s)[1:] == (nodes_elements(layout.stage_nodes(s), plan.costs),
                                                                 nodes_elements(layout.stage_nodes(s), plan.costs,
                                                                                "grad_sync_elements"))
                    assert pricer._work_out_sync(layout, s, False) == before._work_out_sync(layout, s, False)
                    assert pricer._work_out_sync(layout, s, True) == before._work_out_sync(layout, s, True)
    assert tied > 0


def test_summed_hands_the_figures_over_in_order():
    """`_summed` on shares whose sums depend on their order (floats of many magnitudes): the
    generators' sums, in the order given."""
    rng = random.Random(7)
    shares = [LayerCost(rng.uniform(0, 1) * 10 ** rng.randrange(-9, 3), rng.uniform(0, 1) * 10 ** rng.randrange(-9, 3),
                        rng.randrange(0, 10 ** 9), rng.randrange(0, 10 ** 9), rng.uniform(0, 1e-3),
                        rng.randrange(0, 10 ** 6), rng.uniform(0, 1e-6)) for _ in range(500)]
    expected = LayerCost(sum(c.forward_s for c in shares), sum(c.backward_s for c in shares),
                         sum(c.activation_bytes for c in shares), sum(c.state_bytes for c in shares),
                         sum(c.step_s for c in shares), max((c.transient_bytes for c in shares), default=0),
                         sum(c.tp_comm_s for c in shares))
    assert _summed(shares) == expected and _summed([]) == LayerCost()
    assert repr(_summed(shares)) == repr(expected)
