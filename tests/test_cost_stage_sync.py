"""A pipeline stage's gradient reductions priced in buckets (`cost.stage_sync`), not one collective per weight."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.cost.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, GroupTopology, price
from parsat.cost.stage_sync import Reduction, bucketed_seconds, weight_reductions
from parsat.ir.machine import Machine
from parsat.search.optimize import optimize

PRESET = Machine.preset("h100x8").with_devices(384)
H100 = replace(PRESET, comm=replace(PRESET.comm, bucket_elements=0, bucket_elements_per_rank=0))   # DDP's buckets
ACROSS = GroupTopology(48, 1, 48)   # one rank a node, as a data-parallel group beside tensor parallelism 8


def _reductions(kind: str, sizes: list[int], machine: Machine = H100) -> list[Reduction]:
    return [Reduction(i, kind, ACROSS, n, price(kind, ACROSS, n, machine).seconds) for i, n in enumerate(sizes)]


def test_small_gradients_share_a_bucket_and_pay_one_latency():
    found = _reductions(ALL_REDUCE, [1 << 20] * 20)    # 20 MiB in all: one 25 MiB bucket after the 1 MiB first
    reducing, after = bucketed_seconds(found, H100)
    assert after == 0.0
    assert reducing == pytest.approx(price(ALL_REDUCE, ACROSS, 1 << 20, H100).seconds
                                     + price(ALL_REDUCE, ACROSS, 19 << 20, H100).seconds)
    assert reducing < 0.5 * sum(r.per_node_s for r in found)   # per weight, each paid the 48-rank latency


def test_zero_1_reduce_scatters_in_buckets_and_all_gathers_them_after_the_update():
    found = _reductions(REDUCE_SCATTER, [30 << 20, 30 << 20])
    reducing, after = bucketed_seconds(found, H100)
    assert reducing == pytest.approx(2 * price(REDUCE_SCATTER, ACROSS, 30 << 20, H100).seconds)
    assert after == pytest.approx(2 * price(ALL_GATHER, ACROSS, 30 << 20, H100).seconds)


def test_the_gpu_presets_bucket_as_megatron_core_does_by_elements_per_data_parallel_rank():
    # Megatron-Core: max(40M, 1M x dp) elements a bucket, no smaller first bucket; PyTorch DDP: 25 MiB, first 1 MiB
    assert PRESET.comm.bucket_caps(48, 2) == (96_000_000, 96_000_000)
    assert PRESET.comm.bucket_caps(8, 2) == (80_000_000, 80_000_000)
    assert PRESET.comm.bucket_caps(48, 4) == (192_000_000, 192_000_000)
    assert Machine.preset("cpu").comm.bucket_caps(48, 4) == (25 << 20, 1 << 20)
    found = _reductions(REDUCE_SCATTER, [30 << 20, 30 << 20, 30 << 20, 30 << 20], PRESET)   # 4 x 15.7M elements
    reducing, after = bucketed_seconds(found, PRESET)
    assert reducing == pytest.approx(price(REDUCE_SCATTER, ACROSS, 120 << 20, PRESET).seconds)   # one bucket
    ddp, _ = bucketed_seconds(_reductions(REDUCE_SCATTER, [30 << 20] * 4), H100)
    assert reducing < ddp - 3 * 47 * PRESET.inter_latency   # four buckets paid the 48-rank ring's latency four times


def test_a_stage_plan_s_reductions_are_its_weights_replicates_with_the_bytes_the_node_costs_price():
    sizes = {"blocks": 2, "batch": 8, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}
    plan = optimize("gpt", "cpu", devices=2, sizes=sizes, microbatches=2, pipeline=False, baselines=False,
                    degrees={"dp": 2, "zero": 0}, recompute="none")
    found = weight_reductions(plan)
    replicates = [n for n in plan.pcg.nodes if n.kind == "parallel" and n.op == "replicate"
                  and plan.costs[n.id].weight_chain and plan.costs[n.id].grad_reduce_s > 0]
    assert replicates and set(found) == {n.id for n in replicates}
    for r in found.values():   # one collective of its bytes is what the per-node cost charged
        assert r.kind == ALL_REDUCE and price(ALL_REDUCE, r.group, r.nbytes, plan.machine).seconds == pytest.approx(
            r.per_node_s)
