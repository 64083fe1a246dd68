"""ZeRO-1/2's all-gathers of the updated shards overlapped with the next step's forward, bucket by bucket, as
Megatron-Core's `overlap_param_gather` runs them: in the step simulator (`schedules.ParamGathers`,
`pcg_tasks`) and in a pipelined stage's price (`schedules.prefetch_delay`, `cost.pipeline`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.cost.collectives import ALL_GATHER, GroupTopology, price
from parsat.cost.pcg_tasks import DDP, PARSAT_RUN, simulate_pcg
from parsat.cost.pipeline import StagePricer
from parsat.cost.schedules import ParamGathers, prefetch_delay
from parsat.cost.simulator import COMPUTE, SimulationError, StepBuilder
from parsat.cost.stage_sync import gather_buckets, weight_gathers
from parsat.dsl.library import load_library, shipped_rules_dir
from parsat.ir.machine import Machine
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import build_example
from parsat.ir.pipeline import INTERLEAVED, ONE_F_ONE_B, LayerMap, PipelinePlan
from parsat.search.optimize import optimize
from parsat.cost.pipeline import equal_starts

LIB = load_library([shipped_rules_dir() / "ops.rule"])[0]
GPT = dict(blocks=4, batch=16, seq=64, hidden=256, heads=4, vocab=2048)


# ------------------------------------------------------------------ the chain as a number


def test_a_forward_that_reads_its_first_bucket_at_once_waits_for_that_bucket_and_no_more_if_it_hides_the_rest():
    assert prefetch_delay([2.0, 1.0, 1.0], [0.0, 5.0, 6.0]) == pytest.approx(2.0)
    # the second bucket is read 1 s in, but is there 2 + 3 = 5 s after the start: 4 s of waiting in all
    assert prefetch_delay([2.0, 3.0], [0.0, 1.0]) == pytest.approx(4.0)


def test_the_wait_is_between_the_first_bucket_and_all_of_them():
    gathers = [0.5, 0.25, 1.0, 0.75]
    assert prefetch_delay(gathers, [0.0] * 4) == pytest.approx(sum(gathers))     # everything read at the start
    for offsets in ([0.0, 0.1, 0.2, 0.3], [0.0, 1.0, 1.5, 3.0], [0.0, 10.0, 20.0, 30.0]):
        assert gathers[0] <= prefetch_delay(gathers, offsets) <= sum(gathers)
    assert prefetch_delay([1.0], [3.0]) == 0.0          # read after it has arrived: no wait
    assert prefetch_delay([], []) == 0.0
    with pytest.raises(SimulationError):
        prefetch_delay([1.0], [])


def test_the_simulated_gathers_give_the_wait_the_chain_says():
    """Forward compute in pieces reading three buckets, the gathers launched as `ParamGathers` does: the forward
    ends `prefetch_delay` later than its compute alone."""
    gathers, pieces = [0.3, 0.2, 0.4], [0.1, 0.25, 0.05, 0.3]   # piece i reads bucket min(i, 2)
    steps = StepBuilder()
    compute = steps.stream(0, COMPUTE)
    seconds = {30: 0.3, 20: 0.2, 40: 0.4}
    pg = ParamGathers(steps, 0, [["a"], ["b"], ["c"]], [30, 20, 40], seconds.__getitem__, stream_name="inter")
    last = None
    for i, piece in enumerate(pieces):
        deps = pg.needed(["abc"[min(i, 2)]]) + ([last] if last is not None else [])
        last = steps.add(f"forward {i}", compute, piece, deps)
    assert pg.finish() == pg.tasks and len(pg.tasks) == 3
    offsets = [0.0, pieces[0], pieces[0] + pieces[1]]
    assert steps.simulate().step_s == pytest.approx(sum(pieces) + prefetch_delay(gathers, offsets))


def test_a_bucket_is_launched_one_ahead_of_the_forward_that_reads_it():
    steps = StepBuilder()
    pg = ParamGathers(steps, 0, [["a"], ["b"], ["c"], ["d"]], [1, 1, 1, 1], lambda n: 1.0)
    assert len(pg.needed(["a"])) == 1 and len(pg.tasks) == 2          # a, and b ahead
    assert pg.needed(["x"]) == [] and len(pg.tasks) == 2               # a name in no bucket waits for nothing
    assert len(pg.needed(["c"])) == 1 and len(pg.tasks) == 4
    with pytest.raises(SimulationError):
        ParamGathers(steps, 0, [["a"]], [], lambda n: 1.0)


# ------------------------------------------------------------------ the step simulator


@pytest.fixture(scope="module")
def data_parallel():
    """A small gpt laid out as Megatron's data parallelism over 16 H100s (two nodes: the data-parallel group
    crosses the network), and its machine."""
    machine = Machine.resolve("h100x8").with_devices(16)
    graph = build_example("gpt", GPT, LIB)
    pcg = megatron_pcg(graph, LIB, (16, 1), machine.devices_per_node)
    assert pcg is not None
    return pcg, machine


@pytest.mark.parametrize("zero", [1, 2])
def test_overlapped_gathers_shorten_a_zero_step_but_never_below_its_compute(data_parallel, zero):
    pcg, machine = data_parallel
    sharded = replace(pcg, zero=zero)
    overlapped = simulate_pcg(sharded, LIB, machine, DDP).result
    after = simulate_pcg(sharded, LIB, machine, replace(DDP, overlap_param_gather=False)).result
    assert overlapped.step_s < after.step_s
    assert overlapped.step_s >= overlapped.busy_s["0:compute"]
    # the gathers moved from after the update to the forward: none is after the optimizer any more
    update = next(s for s in overlapped.spans if s.phase == "optimizer")
    gathers = [s for s in overlapped.spans if "updated parameters" in s.name]
    assert gathers and all(s.end <= update.start for s in gathers)
    assert not any("updated weight" in s.name for s in overlapped.spans)   # neither per weight nor per bucket
    # what is saved is at most the gathers' time; the first bucket holds the first weight's reader back
    saved = after.step_s - overlapped.step_s
    assert saved <= sum(s.end - s.start for s in gathers) + 1e-9
    first = min(gathers, key=lambda s: s.start)
    assert first.start == 0.0 and first.end > 0.0
    embedding = next(s for s in overlapped.spans if s.name.startswith("embedding"))   # the first weight read
    assert embedding.start >= first.end - 1e-12


def test_without_zero_or_on_parsat_run_nothing_changes(data_parallel):
    pcg, machine = data_parallel
    plain = simulate_pcg(pcg, LIB, machine, DDP).result.step_s
    assert plain == pytest.approx(simulate_pcg(pcg, LIB, machine, replace(DDP, overlap_param_gather=False))
                                  .result.step_s)
    run = simulate_pcg(replace(pcg, zero=1), LIB, machine, PARSAT_RUN).result   # parsat run gathers after the update
    assert any("updated weight" in s.name for s in run.spans)
    assert not any("updated parameters" in s.name for s in run.spans)


# ------------------------------------------------------------------ a pipelined stage


@pytest.fixture(scope="module")
def zero_stage_plan():
    """A gpt stage plan with ZeRO-1 over 2 data-parallel ranks, its weights large enough that their gathers are
    bandwidth's, not latency's (hidden 256, vocabulary 2048)."""
    return optimize("gpt", "cpu", devices=2, sizes={"blocks": 4, "batch": 8, "seq": 16, "hidden": 256, "heads": 2,
                                                    "vocab": 2048}, microbatches=4, pipeline=False, baselines=False,
                    degrees={"dp": 2, "zero": 1}, recompute="none")


def test_a_stage_gathers_its_updated_shards_during_its_first_forward(zero_stage_plan):
    plan, machine = zero_stage_plan, Machine.resolve("cpu").with_devices(4)
    starts = equal_starts(LayerMap(plan.pcg).layers, 2)
    gathers = weight_gathers(plan)
    assert gathers and all(g.kind == ALL_GATHER for g in gathers.values())
    for g in gathers.values():   # the per-node cost charged one gather of the weight's bytes
        assert g.per_node_s == pytest.approx(price(ALL_GATHER, g.group, g.nbytes, plan.machine).seconds)
    after = StagePricer(plan, machine, overlap_param_gather=False).pipelined(2, ONE_F_ONE_B, starts=starts)
    overlapped = StagePricer(plan, machine, overlap_param_gather=True).pipelined(2, ONE_F_ONE_B, starts=starts)
    waits = overlapped.pipeline.chunk_first_forward_wait_s
    assert len(waits) == 2 and waits[0] > 0 and not after.pipeline.chunk_first_forward_wait_s
    # shorter than gathering after the update, no shorter than with no synchronisation at all
    free = replace(plan, costs={i: replace(c, grad_reduce_s=0.0, comm_s=0.0) if c.weight_chain else c
                                for i, c in plan.costs.items()})
    unsynced = StagePricer(free, machine, overlap_param_gather=False).pipelined(2, ONE_F_ONE_B, starts=starts)
    assert unsynced.totals.time_s - 1e-12 <= overlapped.totals.time_s < after.totals.time_s
    # each chunk waits at least for its first bucket where the bucket is read at once, at most for all of them
    pricer = StagePricer(plan, machine, overlap_param_gather=True)
    layout = pricer.layer_map.lay_out(starts, 2)
    for chunk in layout.chunks:
        mine = [gathers[i] for i in chunk.nodes if i in gathers]
        buckets = gather_buckets(mine, machine)
        total = sum(seconds for group in buckets.values() for _n, seconds in group)
        assert 0.0 <= waits[chunk.index] <= total + 1e-12
    first = next(iter(gather_buckets([gathers[i] for i in layout.chunks[0].nodes if i in gathers],
                                     machine).values()))
    assert waits[0] >= first[0][1] - 1e-12   # the embedding is read first: bucket 0 exposed
    # the wait is kept in the plan JSON and the schedule drawn from it is the one priced
    again = PipelinePlan.from_dict(overlapped.pipeline.to_dict())
    assert again.chunk_first_forward_wait_s == waits
    assert again.simulate().time_s == pytest.approx(overlapped.pipeline.simulate().time_s)


def test_groups_are_bucketed_apart_in_forward_order(zero_stage_plan):
    gathers = list(weight_gathers(zero_stage_plan).values())
    machine = Machine.resolve("cpu")
    tiny = replace(machine, comm=replace(machine.comm, bucket_bytes=1, first_bucket_bytes=1))
    buckets = gather_buckets(gathers, tiny)   # one weight a bucket
    assert [n for group in buckets.values() for nodes, _s in group for n in nodes] == [g.node for g in gathers]
    other = GroupTopology(2, 1, 2)
    moved = [replace(g, group=other) if k % 2 else g for k, g in enumerate(gathers)]
    assert len(gather_buckets(moved, tiny)) == 2


def test_interleaved_stages_launch_their_gathers_at_the_step_s_start(zero_stage_plan):
    """Interleaved (Megatron's align_param_gather): every stage's gathers start with the step, so a later stage's
    first forward, which waits for the earlier stages anyway, is held back only from the step's start; the
    wait is then an earliest start, and it is no later than each stage launching at its first forward."""
    plan, machine = zero_stage_plan, Machine.resolve("cpu").with_devices(4)
    pricer = StagePricer(plan, machine, overlap_param_gather=True)
    starts = equal_starts(pricer.layer_map.layers, 4)
    aligned = pricer.pipelined(2, INTERLEAVED, 2, starts=starts)
    ready = aligned.pipeline.chunk_first_forward_ready_s
    assert len(ready) == 4 and ready[0] > 0 and not aligned.pipeline.chunk_first_forward_wait_s
    layout = pricer.layer_map.lay_out(starts, 2)
    separate = [pricer._stage_sync(layout, s, aligned=False).wait_s for s in range(2)]
    together = [pricer._stage_sync(layout, s, aligned=True).wait_s for s in range(2)]
    assert together[0][0] == pytest.approx(separate[0][0])   # the first chunk: the same chain from the same start
    assert together[0][2] >= separate[0][2]                  # the second chunk of a stage queues behind the first's
    after = StagePricer(plan, machine, overlap_param_gather=False).pipelined(2, INTERLEAVED, 2, starts=starts)
    assert aligned.totals.time_s < after.totals.time_s
    assert PipelinePlan.from_dict(aligned.pipeline.to_dict()).simulate().time_s == pytest.approx(
        aligned.pipeline.simulate().time_s)
