"""A plan's step as simulator tasks: `parsat run`'s execution (inline collectives, seeded data, every activation
kept) and a DDP framework's (buckets overlapping backward); memory figures the backend measures."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.dsl.library import load_library, shipped_rules_dir
from parsat.ir.data_parallel import data_parallel_pcg
from parsat.ir.machine import Machine
from parsat.ir.models import mlp, stack
from parsat.ir.pcg import PCG, Degrees, PNode
from parsat.saturate.collectives import GroupTopology
from parsat.saturate.pcg_tasks import DDP, PARSAT_RUN, OpTimes, TaskBuildError, simulate_pcg

LIB = load_library([shipped_rules_dir() / "ops.rule"])[0]
CPU64 = Machine.preset("cpu").with_precision("fp64")     # `parsat run` trains in float64


def _node(ident, kind, op, inputs, shape, shard, copy=1, total=1, attrs=(), role=""):
    return PNode(ident, kind, op, tuple(inputs), tuple(attrs), tuple(shape), Degrees(tuple(shard), copy, total), role)


def megatron_mlp() -> PCG:
    """relu(x @ w1) @ w2 with w1 split by columns and w2 by rows over 2 devices: one forward all-reduce."""
    return PCG((
        _node(0, "leaf", "x", (), (128, 784), (1, 1), role="input"),
        _node(1, "leaf", "w1", (), (784, 512), (1, 1), role="weight"),
        _node(2, "leaf", "w2", (), (512, 10), (1, 1), role="weight"),
        _node(3, "parallel", "partition", (1,), (784, 512), (1, 2), attrs=(("dim", 1), ("degree", 2))),
        _node(4, "parallel", "partition", (2,), (512, 10), (2, 1), attrs=(("dim", 0), ("degree", 2))),
        _node(5, "parallel", "replicate", (0,), (128, 784), (1, 1), copy=2, attrs=(("degree", 2),)),
        _node(6, "op", "matmul", (5, 3), (128, 512), (1, 2)),
        _node(7, "op", "relu", (6,), (128, 512), (1, 2)),
        _node(8, "op", "matmul", (7, 4), (128, 10), (1, 1), total=2),
        _node(9, "parallel", "reduce", (8,), (128, 10), (1, 1), attrs=(("degree", 2),)),
    ), (9,), ("out",))


def test_parsat_run_memory_is_every_tensor_the_executor_keeps():
    step = simulate_pcg(megatron_mlp(), LIB, CPU64, PARSAT_RUN)
    weights = (784 * 256 + 256 * 10) * 8 * 2                       # stored pieces and their gradients
    activations = (128 * 784 + 2 * 128 * 256 + 3 * 128 * 10) * 8  # x (whole: seeded), mm1, relu, mm2, reduce, loss
    assert step.resident_bytes == weights
    assert step.peak_memory_bytes == weights + activations         # 4.40 MiB: what `parsat run` measures


def test_data_parallel_memory_counts_views_once():
    pcg = data_parallel_pcg(mlp(library=LIB), LIB, 2)
    step = simulate_pcg(pcg, LIB, CPU64, PARSAT_RUN)
    weights = (784 * 512 + 512 * 10) * 8 * 2
    # x whole (its row slice is a view), mm1 and relu on 64 rows, mm2, the gathered output, the loss
    activations = (128 * 784 + 2 * 64 * 512 + 64 * 10 + 128 * 10 + 128 * 10) * 8
    assert step.peak_memory_bytes == weights + activations         # 7.49 MiB measured


def test_parsat_run_syncs_gradients_inline_at_the_end_of_backward():
    pcg = data_parallel_pcg(mlp(library=LIB), LIB, 2)
    result = simulate_pcg(pcg, LIB, CPU64, PARSAT_RUN).result
    syncs = [s for s in result.spans if s.phase == "grad_sync"]
    backward = [s for s in result.spans if s.phase == "backward" and "all-reduce" not in s.name]
    assert len(syncs) == 2                                        # one all-reduce per replicated weight
    assert min(s.start for s in syncs) >= max(b.end for b in backward if "matmul" in b.name)
    assert all(v == 0 for v in result.overlap_s.values())         # nothing overlaps: one host thread
    assert result.step_s == pytest.approx(sum(s.end - s.start for s in result.spans))


def test_megatron_mlp_moves_less_and_runs_faster_than_data_parallel_in_both_profiles():
    dp = data_parallel_pcg(mlp(library=LIB), LIB, 2)
    for profile in (PARSAT_RUN, DDP):
        assert simulate_pcg(megatron_mlp(), LIB, CPU64, profile).step_s < simulate_pcg(dp, LIB, CPU64, profile).step_s


def test_ddp_buckets_overlap_the_backward_pass():
    graph = stack(4, batch=64, seq=128, hidden=256, heads=4, ffn=1024, library=LIB)
    pcg = data_parallel_pcg(graph, LIB, 8)
    machine = Machine.preset("h100x8")
    step = simulate_pcg(pcg, LIB, machine, DDP).result
    buckets = [s for s in step.spans if s.name.startswith("all-reduce bucket")]
    last_backward = max(s.end for s in step.spans if s.phase == "backward")
    assert len(buckets) >= 2
    assert buckets[0].start < last_backward                      # the first bucket goes while backward runs
    assert step.overlap_s[0] > 0
    assert step.step_s < step.busy_s["0:compute"] + step.busy_s["0:comm"] - step.overlap_s[0] + 1e-12


def test_data_parallelism_scales_when_priced_as_ddp():
    graph = stack(4, batch=256, seq=512, hidden=1024, heads=16, ffn=4096, library=LIB)   # 4 BERT-Large blocks
    machine = Machine.preset("h100x8")
    times = {n: simulate_pcg(data_parallel_pcg(graph, LIB, n), LIB, machine.with_devices(n), DDP).step_s
             for n in (8, 64)}
    assert times[64] < times[8] / 2


def test_stragglers_make_collectives_wait():
    pcg = megatron_mlp()
    calm = simulate_pcg(pcg, LIB, CPU64, PARSAT_RUN)
    noisy = simulate_pcg(pcg, LIB, replace(CPU64, comm=replace(CPU64.comm, sync_skew=0.5)), PARSAT_RUN)
    waits = [s for s in noisy.result.spans if s.phase == "stragglers"]
    assert len(waits) == 2 and noisy.step_s > calm.step_s       # before the all-reduce, and at the step's end


def test_groups_across_nodes_cost_more():
    pcg = data_parallel_pcg(mlp(library=LIB), LIB, 2)
    machine = Machine.preset("cpu")
    inside = simulate_pcg(pcg, LIB, machine, PARSAT_RUN).step_s
    across = simulate_pcg(pcg, LIB, machine, PARSAT_RUN, topology=lambda node: GroupTopology(2, 1, 2)).step_s
    assert across > inside


def test_the_compute_time_cache_is_shared_and_tied_to_its_machine():
    times = OpTimes(LIB, CPU64)
    first = simulate_pcg(megatron_mlp(), LIB, CPU64, PARSAT_RUN, times=times)
    assert simulate_pcg(megatron_mlp(), LIB, CPU64, PARSAT_RUN, times=times).step_s == first.step_s
    with pytest.raises(TaskBuildError):
        simulate_pcg(megatron_mlp(), LIB, Machine.preset("cpu"), PARSAT_RUN, times=times)


def test_parsat_run_memory_sampled_between_calls_misses_gather_buffers():
    """An all-gather's pieces live only until their concatenation: an allocator's peak sees them, the
    executor's measurement between calls (on CPU) does not."""
    pcg = PCG((
        _node(0, "leaf", "x", (), (128, 784), (1, 1), role="input"),
        _node(1, "leaf", "w1", (), (784, 512), (1, 1), role="weight"),
        _node(2, "leaf", "w2", (), (512, 10), (1, 1), role="weight"),
        _node(3, "parallel", "partition", (1,), (784, 512), (1, 4), attrs=(("dim", 1), ("degree", 4))),
        _node(4, "parallel", "replicate", (0,), (128, 784), (1, 1), copy=4, attrs=(("degree", 4),)),
        _node(5, "op", "matmul", (4, 3), (128, 512), (1, 4)),
        _node(6, "op", "relu", (5,), (128, 512), (1, 4)),
        _node(7, "parallel", "combine", (6,), (128, 512), (1, 1), attrs=(("dim", 1), ("degree", 4))),
        _node(8, "op", "matmul", (7, 2), (128, 10), (1, 1)),
    ), (8,), ("out",))
    step = simulate_pcg(pcg, LIB, CPU64, PARSAT_RUN)
    # at the concatenation: the gathered pieces and the result; at the end of forward: the result, mm2, loss
    assert step.peak_memory_bytes - step.sampled_memory_bytes == (128 * 512 - 2 * 128 * 10) * 8
