"""A stage's synchronisation and a stage plan's layer facts worked out with less Python (session 76, helper E):
the memo's bucketing keys joined from each reduction's part (`StageMemo.parts`), the replicates' groups once per
attribute tuple and a bucket's price once per (kind, group, bytes) (`cost.stage_sync`), the layer structure's
needs, layers and places, and a layer's free values' bytes summed in C (`LayerStructure`, `StagePricer._layer_runs`).
Each must give what the loops before gave: those loops are kept here as the reference and compared figure for
figure, on the plans `tests/test_stage_pricing_loops.py` prices (a gpt with a tied embedding, a data-parallel
ZeRO-1 gpt whose weights are reduce-scattered in buckets and gathered during the next forward, a llama)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from parsat.cost import stage_sync
from parsat.cost.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, GroupTopology, price
from parsat.cost.pipeline import StageMemo, StagePricer, StageSync, applicable_schedules
from parsat.cost.schedules import Gradient, assign_buckets
from parsat.dsl.parallel_ops import REPLICATE
from parsat.ir.machine import Machine
from parsat.ir.pcg import state_shardings
from parsat.ir.pipeline import LayerStructure, free_nodes
from parsat.ir.blocks import node_blocks
from parsat.search.optimize import optimize

SIZES = {"blocks": 8, "batch": 8, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}
LLAMA = {"blocks": 8, "hidden": 64, "heads": 8, "kv_heads": 2, "batch": 8, "seq": 16, "vocab": 128}


@pytest.fixture(scope="module")
def plans():
    """A gpt of 8 alike blocks on 2 devices, the same on 2 data-parallel ranks with ZeRO-1, a llama of 8 blocks."""
    plan = optimize("gpt", "cpu", devices=2, sizes=SIZES, microbatches=4, pipeline=False, baselines=False)
    data_parallel = optimize("gpt", "cpu", devices=2, sizes={**SIZES, "hidden": 256, "vocab": 2048}, microbatches=4,
                             pipeline=False, baselines=False, degrees={"dp": 2, "zero": 1}, recompute="none")
    llama = optimize("llama", "cpu", devices=2, sizes=LLAMA, microbatches=4, pipeline=False, baselines=False)
    return [plan, data_parallel, llama]


def _machine() -> Machine:
    return Machine.resolve("cpu").with_devices(4)


# ------------------------------------------------------------------ the loops before, as the reference


class _AsBefore(StagePricer):
    """The pricer's sync and layer runs before: each chunk's reductions and gathers listed in Python and their
    memo keys made from them (`StageMemo._flat`), a layer's free values' bytes added one by one."""

    def _work_out_sync(self, layout, stage, aligned):
        seen, reduce_s, wait_s = set(), {}, {}
        after_s = gather_s = 0.0
        launched = {}
        for chunk in layout.stage_chunks(stage):
            kept = (self.chain_s.keys() - seen if seen else self.chain_s.keys()).__contains__
            nodes = list(filter(kept, chunk.nodes))
            seen.update(nodes)
            bucketed = [self.reductions[i] for i in nodes if i in self.reductions]
            reducing, after = self.memo.bucketed_seconds(bucketed, self.machine)
            rest = [i for i in nodes if i not in self.reductions]
            reduce_s[chunk.index] = reducing + sum(self.reduce_s[i] for i in rest)
            gathered = [self.gathers[i] for i in nodes if i in self.gathers]
            if gathered:
                after = 0.0
                buckets = self.memo.gather_buckets(gathered, self.machine)
                wait_s[chunk.index] = self._gather_wait(chunk, buckets, launched if aligned else {})
                for group, found in buckets.items():
                    seconds = sum(s for _nodes, s in found)
                    gather_s += seconds
                    launched[group] = launched.get(group, 0.0) + seconds
            after_s += after + sum(self.chain_s[i] - self.reduce_s[i] for i in rest if i not in self.gathers)
        return StageSync(reduce_s, after_s, gather_s, wait_s)

    @property
    def _layer_runs(self):
        own = self._layer_bytes
        if own is None:
            return None
        shares, layers = self.shares, self.layer_map.layers
        acts, states, transients, shared, free_bytes = [0], [0], [], [], {}
        for layer, (alone, others) in zip(layers, self.layer_map.structure.layer_free):
            act, state, transient = own[layer]
            for i in alone:
                c = shares.get(i)
                if c is not None:
                    act, state = act + c.activation_bytes, state + c.state_bytes
                    transient = max(transient, c.transient_bytes)
            acts.append(acts[-1] + act)
            states.append(states[-1] + state)
            transients.append(transient)
            mine = frozenset(i for i in others if i in shares)
            shared.append(mine)
            for i in mine:
                if i not in free_bytes:
                    c = shares[i]
                    free_bytes[i] = (c.activation_bytes, c.state_bytes, c.transient_bytes)
        return acts, states, transients, shared, free_bytes


def _reductions_before(plan):
    """`weight_reductions` before: each replicate's group from its own axis."""
    pcg, costs = plan.pcg, plan.costs
    if pcg.zero == 2:
        return {}
    sharded = set(state_shardings(pcg).values()) if pcg.zero == 1 else set()
    by_id = {n.id: n for n in pcg.nodes}
    out = {}
    for node in pcg.nodes:
        cost = costs.get(node.id)
        if node.kind != "parallel" or node.op != REPLICATE or cost is None or not cost.weight_chain:
            continue
        if cost.grad_reduce_s <= 0:
            continue
        group = GroupTopology.of_axis(pcg.mesh, node.axis(pcg.mesh))
        kind = REDUCE_SCATTER if node.id in sharded else ALL_REDUCE
        nbytes = by_id[node.inputs[0]].piece_size * plan.machine.dtype_bytes
        out[node.id] = stage_sync.Reduction(node.id, kind, group, nbytes, cost.comm_s)
    return out


def _gathers_before(plan):
    """`weight_gathers` before."""
    pcg, costs = plan.pcg, plan.costs
    if pcg.zero not in stage_sync.SHARDING_STAGES:
        return {}
    by_id = {n.id: n for n in pcg.nodes}
    out = {}
    for replicate in sorted(set(state_shardings(pcg).values())):
        cost = costs.get(replicate)
        if cost is None or not cost.weight_chain:
            continue
        node = by_id[replicate]
        group = GroupTopology.of_axis(pcg.mesh, node.axis(pcg.mesh))
        nbytes = by_id[node.inputs[0]].piece_size * plan.machine.dtype_bytes
        out[replicate] = stage_sync.Reduction(replicate, ALL_GATHER, group, nbytes, cost.comm_s - cost.grad_reduce_s)
    return out


def _bucketed_before(reductions, machine):
    """`bucketed_seconds` before: every bucket priced."""
    by_group = {}
    for r in reductions:
        by_group.setdefault((r.kind, r.group), []).append(r)
    reducing = after = 0.0
    for (kind, group), found in by_group.items():
        gradients = [Gradient(str(r.node), r.nbytes) for r in found]
        for bucket in assign_buckets(gradients, *machine.comm.bucket_caps(group.size, machine.dtype_bytes)):
            nbytes = sum(g.nbytes for g in bucket)
            reducing += price(kind, group, nbytes, machine).seconds
            if kind == REDUCE_SCATTER:
                after += price(ALL_GATHER, group, nbytes, machine).seconds
    return reducing, after


def _gather_buckets_before(gathers, machine):
    """`gather_buckets` before: every bucket priced."""
    by_group = {}
    for g in gathers:
        by_group.setdefault(g.group, []).append(g)
    out = {}
    for group, found in by_group.items():
        backward = [Gradient(str(g.node), g.nbytes) for g in reversed(found)]
        out[group] = [(tuple(int(g.name) for g in reversed(bucket)),
                       price(ALL_GATHER, group, sum(g.nbytes for g in bucket), machine).seconds)
                      for bucket in reversed(assign_buckets(backward, *machine.comm.bucket_caps(group.size,
                                                                                                 machine.dtype_bytes)))]
    return out


def _structure_before(pcg):
    """`LayerStructure`'s layers, places and needs before: a list of each node's free inputs made and tested."""
    blocks, free = node_blocks(pcg), free_nodes(pcg)
    layers = tuple(sorted({blocks[n.id] for n in pcg.nodes if n.id not in free}))
    position = {n.id: k for k, n in enumerate(pcg.nodes)}
    needs, none = {}, frozenset()
    for node in pcg.nodes:
        direct = [i for i in node.inputs if i in free]
        needs[node.id] = frozenset(direct).union(*(needs[i] for i in direct)) if direct else none
    return layers, position, needs


# ------------------------------------------------------------------ the checks


def test_the_groups_and_reductions_are_those_before(plans):
    """Every replicate's reduction and gather (kind, group, bytes, per-node seconds), in the same order."""
    read = 0
    for plan in plans:
        mine, theirs = stage_sync.weight_reductions(plan), _reductions_before(plan)
        assert mine == theirs and list(mine) == list(theirs)
        gathers = stage_sync.weight_gathers(plan)
        assert gathers == _gathers_before(plan) and list(gathers) == list(_gathers_before(plan))
        read += len(mine) + len(gathers)
    assert read > 0


def test_a_bucket_priced_once_per_size_is_priced_as_before(plans):
    """The bucketed seconds and gather buckets (every float) of the plans' reductions, and of random sequences
    over two groups with repeated sizes (where the buckets' prices are found again)."""
    machine = _machine()
    rng = random.Random(76)
    groups = [GroupTopology(2, 2, 1), GroupTopology(4, 2, 2)]
    sequences = []
    for plan in plans:
        sequences.append(list(stage_sync.weight_reductions(plan).values()))
        sequences.append(list(stage_sync.weight_gathers(plan).values()))
    for _ in range(40):
        sizes = [rng.choice((2 ** 20, 3 * 2 ** 22, 2 ** 26, 12345)) for _ in range(rng.randrange(1, 60))]
        sequences.append([stage_sync.Reduction(k, rng.choice((ALL_REDUCE, REDUCE_SCATTER)), rng.choice(groups), n,
                                               0.0) for k, n in enumerate(sizes)])
    for reductions in sequences:
        assert stage_sync.bucketed_seconds(reductions, machine) == _bucketed_before(reductions, machine)
        gathers = [stage_sync.Reduction(r.node, ALL_GATHER, r.group, r.nbytes, 0.0) for r in reductions]
        assert stage_sync.gather_buckets(gathers, machine) == _gather_buckets_before(gathers, machine)


def test_the_layer_structure_is_the_one_before(plans):
    """Each plan's layers, node places and needed free values (the same sets, the one empty set shared)."""
    for plan in plans:
        structure = LayerStructure(plan.pcg)
        layers, position, needs = _structure_before(plan.pcg)
        assert structure.layers == layers
        assert structure.position == position and list(structure.position) == list(position)
        assert structure.needs == needs and list(structure.needs) == list(needs)
        assert any(structure.needs.values())


def test_a_layers_free_bytes_summed_in_c_are_those_before(plans):
    """`_layer_runs` where every node carries bytes and transients of its own (random integers, each node its own
    share): the running sums, largest transients, shared free values and their bytes before."""
    rng = random.Random(28)
    for plan in plans:
        pricer = StagePricer(plan, _machine(), memo=StageMemo())
        before = _AsBefore(plan, _machine(), memo=StageMemo())
        shares = {i: replace(c, activation_bytes=rng.randrange(0, 10 ** 6), state_bytes=rng.randrange(0, 10 ** 6),
                             transient_bytes=rng.randrange(0, 10 ** 6)) for i, c in pricer.shares.items()}
        pricer.shares = before.shares = shares
        assert pricer._layer_runs == before._layer_runs
        assert any(t for t in pricer._layer_runs[2])


def test_the_memo_keys_joined_from_parts_are_the_keys_before(plans):
    """Every chunk's reductions and gathers of every cut: the key joined from the pricer's parts is `_flat` of
    them, in the same memo (the groups' numbers given in either order)."""
    machine = _machine()
    for plan in plans:
        pricer = StagePricer(plan, machine, overlap_param_gather=True, memo=StageMemo())
        layers = pricer.layer_map.layers
        for degree in (2, 4):
            for k in range(1, len(layers) - degree + 2):
                cut = (layers[0],) + tuple(layers[k:k + degree - 1])
                for chunk in pricer.layer_map.lay_out(cut, degree).chunks:
                    for found, parts, kinds in ((pricer.reductions, pricer._reduction_parts, True),
                                                (pricer.gathers, pricer._gather_parts, False)):
                        keyed = [i for i in chunk.nodes if i in found]
                        joined = tuple(x for i in keyed for x in parts[i])
                        assert joined == pricer.memo._flat([found[i] for i in keyed], kinds)


@pytest.mark.parametrize("gathers", [True, False])
def test_the_sync_and_memory_are_those_before(plans, gathers):
    """Each stage's sync (aligned or not) on every cut of 2 and 4 stages, each pricer with its own memo, and the
    memory check, floors and every schedule's pipelined plan JSON at degrees 2 and 4."""
    machine = _machine()
    for plan in plans:
        pricer = StagePricer(plan, machine, overlap_param_gather=gathers, memo=StageMemo())
        before = _AsBefore(plan, machine, overlap_param_gather=gathers, memo=StageMemo())
        assert pricer._layer_runs == before._layer_runs
        layers = pricer.layer_map.layers
        for degree in (2, 4):
            for k in range(1, len(layers) - degree + 2):
                cut = (layers[0],) + tuple(layers[k:k + degree - 1])
                layout = pricer.layer_map.lay_out(cut, degree)
                assert pricer._chunk_bytes(cut, degree) == before._chunk_bytes(cut, degree)
                for s in range(degree):
                    for aligned in (False, True):
                        assert pricer._work_out_sync(layout, s, aligned) == before._work_out_sync(layout, s, aligned)
            schedules = applicable_schedules(None, degree, pricer.microbatches, pricer.layer_map.model_layers)
            mine = [pricer.least_peak_bytes(degree, schedules), pricer.schedule_fitting_floors(degree, schedules)]
            mine += [pricer.pipelined(degree, schedule, v).to_json() for schedule, v in schedules]
            theirs = [before.least_peak_bytes(degree, schedules), before.schedule_fitting_floors(degree, schedules)]
            theirs += [before.pipelined(degree, schedule, v).to_json() for schedule, v in schedules]
            assert mine == theirs
