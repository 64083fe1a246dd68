"""A plan's step as simulator tasks on its device mesh: `parsat run`'s execution (inline collectives, seeded data,
every activation kept) and a DDP framework's (buckets overlapping backward); each parallel operator on its mesh
axis's group; fused collectives and ZeRO-3 as the backend runs them; memory figures the backend measures."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.dsl.library import load_library, shipped_rules_dir
from parsat.ir.data_parallel import data_parallel_pcg
from parsat.ir.graph import instance_for
from parsat.ir.machine import Machine
from parsat.ir.machine_profile import Oversubscribed
from parsat.ir.mesh import Mesh
from parsat.ir.models import mlp, stack
from parsat.ir.pcg import PCG, Degrees, PNode
from parsat.ir.placement import Placement, apply_parallel, compute_placement
from parsat.cost.collectives import ALL_GATHER, ALL_REDUCE, SEND_RECV, GroupTopology, price
from parsat.cost.pcg_tasks import (DDP, PARSAT_RUN, OpTimes, TaskBuildError, _needs_gradient, needs_gradient,
                                   profile_for, simulate_pcg, step_floor)
import parsat.cost.pcg_tasks as pcg_tasks

LIB = load_library([shipped_rules_dir() / "ops.rule"])[0]
CPU64 = Machine.preset("cpu").with_precision("fp64")     # `parsat run` trains in float64
H100 = Machine.preset("h100x8")
SERIAL_DDP = replace(DDP, tp_comm_overlap=False)         # a GPU framework without tensor-parallel overlap


def mesh_pcg(mesh: Mesh, specs, outputs=None) -> PCG:
    """A PCG from (kind, op, inputs, shape, attrs, role) rows, each placement derived as `pcg_placement` derives it;
    a parallel row's attrs name its axis, and get the axis's size as its degree."""
    nodes: list[PNode] = []
    for ident, (kind, op, inputs, shape, attrs, role) in enumerate(specs):
        attrs = dict(attrs)
        if kind == "leaf":
            placement = Placement.whole(len(mesh))
        elif kind == "parallel":
            axis = mesh.index(attrs["axis"])
            attrs["degree"] = mesh.size(axis)
            placement = apply_parallel(nodes[inputs[0]].placement, op, axis, attrs.get("dim"))
        else:
            instance = instance_for(LIB.ops[op], [nodes[i].shape for i in inputs], attrs)
            placement = compute_placement(instance, [nodes[i].placement for i in inputs])
        nodes.append(PNode(ident, kind, op, tuple(inputs), tuple(attrs.items()), tuple(shape),
                           Degrees.of_placement(placement, mesh, len(shape)), role, "", placement))
    outputs = outputs or (len(nodes) - 1,)
    return PCG(tuple(nodes), tuple(outputs), tuple(f"out{i}" for i in range(len(outputs))), mesh)


def megatron_mlp(mesh: Mesh | None = None, axis: str = "tp") -> PCG:
    """relu(x @ w1) @ w2 with w1 split by columns and w2 by rows on the `axis` axis: one forward all-reduce."""
    mesh = mesh or Mesh.of((2,), 4, names=("tp",))
    return mesh_pcg(mesh, (
        ("leaf", "x", (), (128, 784), {}, "input"),
        ("leaf", "w1", (), (784, 512), {}, "weight"),
        ("leaf", "w2", (), (512, 10), {}, "weight"),
        ("parallel", "partition", (1,), (784, 512), {"dim": 1, "axis": axis}, ""),
        ("parallel", "partition", (2,), (512, 10), {"dim": 0, "axis": axis}, ""),
        ("parallel", "replicate", (0,), (128, 784), {"axis": axis}, ""),
        ("op", "matmul", (5, 3), (128, 512), {}, ""),
        ("op", "relu", (6,), (128, 512), {}, ""),
        ("op", "matmul", (7, 4), (128, 10), {}, ""),
        ("parallel", "reduce", (8,), (128, 10), {"axis": axis}, ""),
    ))


def zero3_mlp(devices: int = 2) -> PCG:
    """Data parallelism with ZeRO-3: each weight stored as a shard on the dp axis and all-gathered for use."""
    mesh = Mesh.of((devices,), 8, names=("dp",))
    return mesh_pcg(mesh, (
        ("leaf", "x", (), (128, 784), {}, "input"),
        ("leaf", "w1", (), (784, 512), {}, "weight"),
        ("leaf", "w2", (), (512, 10), {}, "weight"),
        ("parallel", "partition", (0,), (128, 784), {"dim": 0, "axis": "dp"}, ""),
        ("parallel", "partition", (1,), (784, 512), {"dim": 0, "axis": "dp"}, ""),
        ("parallel", "all_gather", (4,), (784, 512), {"dim": 0, "axis": "dp"}, ""),
        ("parallel", "partition", (2,), (512, 10), {"dim": 0, "axis": "dp"}, ""),
        ("parallel", "all_gather", (6,), (512, 10), {"dim": 0, "axis": "dp"}, ""),
        ("op", "matmul", (3, 5), (128, 512), {}, ""),
        ("op", "relu", (8,), (128, 512), {}, ""),
        ("op", "matmul", (9, 7), (128, 10), {}, ""),
        ("parallel", "combine", (10,), (128, 10), {"dim": 0, "axis": "dp"}, ""),
    ))


def hybrid_mlp() -> PCG:
    """A 2 x 2 mesh (dp across 2 nodes, tp inside each): Megatron's MLP on tp, the batch split on dp."""
    mesh = Mesh.of((2, 2), 2, names=("dp", "tp"))
    return mesh_pcg(mesh, (
        ("leaf", "x", (), (128, 784), {}, "input"),
        ("leaf", "w1", (), (784, 512), {}, "weight"),
        ("leaf", "w2", (), (512, 10), {}, "weight"),
        ("parallel", "partition", (0,), (128, 784), {"dim": 0, "axis": "dp"}, ""),
        ("parallel", "replicate", (3,), (128, 784), {"axis": "tp"}, ""),
        ("parallel", "partition", (1,), (784, 512), {"dim": 1, "axis": "tp"}, ""),
        ("parallel", "replicate", (5,), (784, 512), {"axis": "dp"}, ""),
        ("parallel", "partition", (2,), (512, 10), {"dim": 0, "axis": "tp"}, ""),
        ("parallel", "replicate", (7,), (512, 10), {"axis": "dp"}, ""),
        ("op", "matmul", (4, 6), (128, 512), {}, ""),
        ("op", "relu", (9,), (128, 512), {}, ""),
        ("op", "matmul", (10, 8), (128, 10), {}, ""),
        ("parallel", "reduce_scatter", (11,), (128, 10), {"dim": 0, "axis": "tp"}, ""),
        ("parallel", "combine", (12,), (128, 10), {"dim": 0, "axis": "tp"}, ""),
        ("parallel", "combine", (13,), (128, 10), {"dim": 0, "axis": "dp"}, ""),
    ))


def sequence_parallel_mlp(rows: int = 4096, hidden: int = 4096) -> PCG:
    """Megatron's sequence-parallel MLP on a tp axis of 8 (one node of h100x8): the rows split, all-gathered into a
    column-parallel matmul (#9), relu, a row-parallel matmul (#12) reduce-scattered back onto the rows (#13). A
    first matmul (#6) makes the gathered rows an activation with a gradient, so backward has both collectives."""
    mesh = Mesh.of((8,), 8, names=("tp",))
    return mesh_pcg(mesh, (
        ("leaf", "x", (), (rows, hidden), {}, "input"),
        ("leaf", "w0", (), (hidden, hidden), {}, "weight"),
        ("leaf", "w1", (), (hidden, 4 * hidden), {}, "weight"),
        ("leaf", "w2", (), (4 * hidden, hidden), {}, "weight"),
        ("parallel", "partition", (0,), (rows, hidden), {"dim": 0, "axis": "tp"}, ""),
        ("parallel", "replicate", (1,), (hidden, hidden), {"axis": "tp"}, ""),
        ("op", "matmul", (4, 5), (rows, hidden), {}, ""),
        ("parallel", "all_gather", (6,), (rows, hidden), {"dim": 0, "axis": "tp"}, ""),
        ("parallel", "partition", (2,), (hidden, 4 * hidden), {"dim": 1, "axis": "tp"}, ""),
        ("op", "matmul", (7, 8), (rows, 4 * hidden), {}, ""),
        ("op", "relu", (9,), (rows, 4 * hidden), {}, ""),
        ("parallel", "partition", (3,), (4 * hidden, hidden), {"dim": 0, "axis": "tp"}, ""),
        ("op", "matmul", (10, 11), (rows, hidden), {}, ""),
        ("parallel", "reduce_scatter", (12,), (rows, hidden), {"dim": 0, "axis": "tp"}, ""),
    ))


def _chunks(spans, prefix: str):
    """The chunk tasks (`name [i/k]`) of the task named `prefix`, in order."""
    return [s for s in spans if s.name.startswith(prefix + " [")]


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
    pcg = data_parallel_pcg(graph, LIB, 8, 8)
    # PyTorch DDP's 25 MiB buckets: the preset's Megatron-Core buckets (>= 40M elements) hold this whole model
    preset = Machine.preset("h100x8")
    assert len([s for s in simulate_pcg(pcg, LIB, preset, DDP).result.spans if s.name.startswith("all-reduce bucket")
                ]) == 1
    machine = replace(preset, comm=replace(preset.comm, bucket_elements=0, bucket_elements_per_rank=0))
    step = simulate_pcg(pcg, LIB, machine, DDP).result
    buckets = [s for s in step.spans if s.name.startswith("all-reduce bucket")]
    last_backward = max(s.end for s in step.spans if s.phase == "backward")
    assert len(buckets) >= 2
    assert buckets[0].start < last_backward                      # the first bucket goes while backward runs
    assert step.overlap_s[0] > 0
    comm = sum(v for k, v in step.busy_s.items() if k != "0:compute")   # one communication stream per link
    assert step.step_s < step.busy_s["0:compute"] + comm - step.overlap_s[0] + 1e-12


def test_gradient_reduction_after_backward_exposes_the_buckets():
    """`CommProfile.overlap_grad_reduce` off (Megatron-LM of 2021): `profile_for` gives DDP with the buckets after
    backward, and the step grows by what the overlapped buckets had hidden: the buckets' all-reduce runs alone,
    after the backward's end, and nothing overlaps it."""
    graph = stack(4, batch=64, seq=128, hidden=256, heads=4, ffn=1024, library=LIB)
    pcg = data_parallel_pcg(graph, LIB, 8, 8)
    preset = Machine.preset("h100x8")
    small = replace(preset.comm, bucket_elements=0, bucket_elements_per_rank=0)   # several buckets
    overlapped = replace(preset, comm=small)
    after = replace(preset, comm=replace(small, overlap_grad_reduce=False))
    assert profile_for(overlapped) is DDP and profile_for(after) == replace(DDP, overlap_grad_reduce=False)
    on, off = (simulate_pcg(pcg, LIB, m, profile_for(m)).result for m in (overlapped, after))
    buckets = [s for s in off.spans if s.name.startswith("all-reduce bucket")]
    last_backward = max(s.end for s in off.spans if s.phase == "backward")
    assert len(buckets) >= 2 and min(s.start for s in buckets) >= last_backward - 1e-12
    reduce_s = sum(s.end - s.start for s in buckets)
    assert max(s.end for s in buckets) == pytest.approx(last_backward + reduce_s)   # back to back, from its end
    on_backward = max(s.end for s in on.spans if s.phase == "backward")
    on_buckets = [s for s in on.spans if s.name.startswith("all-reduce bucket")]
    assert sum(s.end - s.start for s in on_buckets) == pytest.approx(reduce_s)      # the same buckets
    exposed = max(s.end for s in on_buckets) - on_backward       # what the overlapped step left after backward
    assert 0 < exposed < reduce_s
    assert off.step_s - on.step_s == pytest.approx(reduce_s - exposed)   # the step grows by what was hidden


def test_data_parallelism_scales_when_priced_as_ddp():
    graph = stack(4, batch=256, seq=512, hidden=1024, heads=16, ffn=4096, library=LIB)   # 4 BERT-Large blocks
    machine = Machine.preset("h100x8")
    times = {n: simulate_pcg(data_parallel_pcg(graph, LIB, n, 8), LIB, machine.with_devices(n), DDP).step_s
             for n in (8, 64)}
    assert times[64] < times[8] / 2


def test_stragglers_make_collectives_wait():
    pcg = megatron_mlp()
    calm = simulate_pcg(pcg, LIB, CPU64, PARSAT_RUN)
    noisy = simulate_pcg(pcg, LIB, replace(CPU64, comm=replace(CPU64.comm, sync_skew=0.5)), PARSAT_RUN)
    waits = [s for s in noisy.result.spans if s.phase == "stragglers"]
    assert len(waits) == 2 and noisy.step_s > calm.step_s       # before the all-reduce, and at the step's end


def test_a_collective_on_ranks_sharing_cores_waits_for_a_peers_turn():
    """`comm.turn_s` is priced only where the machine was calibrated with ranks sharing cores: each collective
    then waits min(turn_s, the compute since the previous collective) before it runs; on ranks with their own
    cores the same figure changes nothing."""
    pcg = megatron_mlp()
    base = simulate_pcg(pcg, LIB, CPU64, PARSAT_RUN)

    def machine(turn: float, shared: bool) -> Machine:
        return replace(CPU64, comm=replace(CPU64.comm, turn_s=turn),
                       oversubscribed=Oversubscribed(4, 2) if shared else None)

    assert simulate_pcg(pcg, LIB, machine(1e-3, False), PARSAT_RUN).step_s == base.step_s
    turn = 1e-7   # shorter than the compute before any collective here: each collective waits all of it
    short = simulate_pcg(pcg, LIB, machine(turn, True), PARSAT_RUN)
    waits = [s for s in short.result.spans if s.phase == "stragglers"]
    assert waits and all(s.end - s.start == pytest.approx(turn) for s in waits)
    assert short.step_s == pytest.approx(base.step_s + turn * len(waits))
    long = simulate_pcg(pcg, LIB, machine(10.0, True), PARSAT_RUN)   # a slice longer than the compute: the compute
    first = min((s for s in long.result.spans if s.phase == "stragglers"), key=lambda s: s.start)
    assert first.end - first.start == pytest.approx(first.start) and first.start > 0
    assert long.step_s < base.step_s * 2 + 1e-9


def test_a_runtime_that_reduce_scatters_by_all_reducing_is_priced_as_the_all_reduce():
    """gloo's `reduce_scatter_tensor` (FSDP2's) all-reduces the whole buffer: under such a profile a
    reduce-scatter costs what the measured all-reduce of its input costs, whatever the reduce-scatter's own
    (list) measurement says; elsewhere the reduce-scatter's own measurement prices it."""
    from parsat.ir.machine_profile import CollectivePoint

    def machine(rs_latency: float, ar_latency: float) -> Machine:
        points = (CollectivePoint("all_reduce", "intra", 2, ar_latency, 1e9),
                  CollectivePoint("reduce_scatter", "intra", 2, rs_latency, 1e9),
                  CollectivePoint("all_gather", "intra", 2, 1e-4, 1e9))
        return replace(CPU64, comm=replace(CPU64.comm, points=points))

    pcg = zero3_mlp()
    profiles = {"own": PARSAT_RUN, "gloo": replace(PARSAT_RUN, reduce_scatter_as_all_reduce=True)}
    step = {(name, rs, ar): simulate_pcg(pcg, LIB, machine(rs, ar), p).step_s
            for name, p in profiles.items() for rs in (1e-4, 1.0) for ar in (1e-4, 1e-2)}
    assert step[("gloo", 1e-4, 1e-4)] == step[("gloo", 1.0, 1e-4)]
    assert step[("gloo", 1.0, 1e-2)] > step[("gloo", 1.0, 1e-4)]
    assert step[("own", 1.0, 1e-4)] > step[("own", 1e-4, 1e-4)] + 0.9


def test_a_slower_measured_backward_product_prices_a_slower_step():
    """The demo's plan (`megatron_mlp`) on a machine whose products on transposed operands are measured
    (`parsat calibrate`: autograd's x^T @ g and g @ w^T): at the forward's rate it prices as the same machine
    unmeasured; with x^T @ g at half that rate the weights' gradients, and the step, take longer."""
    eff = CPU64.efficiency

    def layouts(tn_rate: float) -> Machine:
        halves = {f"gemm_{lay}_half_{d}": getattr(eff, f"gemm_half_{d}") for lay in ("nt", "tn") for d in "mnk"}
        return replace(CPU64, efficiency=replace(eff, gemm_nt_rate=eff.gemm_peak_fraction, gemm_tn_rate=tn_rate,
                                                 **halves))

    pcg = megatron_mlp()
    plain, same, slow = (simulate_pcg(pcg, LIB, m, PARSAT_RUN) for m in (CPU64, layouts(1.0), layouts(0.5)))
    assert same.step_s == pytest.approx(plain.step_s)
    assert slow.step_s > same.step_s

    def phase(run, name):
        return sum(s.end - s.start for s in run.result.spans if s.phase == name)

    assert phase(slow, "backward") > phase(same, "backward") and phase(slow, "forward") == phase(same, "forward")


def test_the_optimizer_phase_is_the_measured_update_where_the_machine_has_it():
    """`parsat calibrate` times `parsat run`'s optimizer as a step runs it (`OpEfficiency.update_points`): the
    simulated optimizer phase is then each stored weight piece's update read off those points; a machine file
    without them prices the memory-bound operators, as before."""
    pcg = megatron_mlp()
    before = simulate_pcg(pcg, LIB, CPU64, PARSAT_RUN)
    points = (("sgd", ((1024.0, 1e-4), (1 << 20, 1e-2))),)
    measured = simulate_pcg(pcg, LIB, replace(CPU64, efficiency=replace(CPU64.efficiency, update_points=points)),
                            PARSAT_RUN)

    def optimizer(run):
        return sum(s.end - s.start for s in run.result.spans if s.phase == "optimizer")

    pieces = (784 * 512 // 2, 512 * 10 // 2)   # w1 and w2, each split over the 2 devices
    expected = sum(1e-4 + (1e-2 - 1e-4) * (e - 1024) / ((1 << 20) - 1024) for e in pieces)
    assert optimizer(measured) == pytest.approx(expected)
    assert optimizer(before) != pytest.approx(expected) and measured.step_s > before.step_s


def test_a_mesh_axis_across_nodes_costs_more_than_one_inside_a_node():
    machine = Machine.preset("cpu")
    inside = data_parallel_pcg(mlp(library=LIB), LIB, 2, devices_per_node=4)   # the dp axis inside one node
    across = data_parallel_pcg(mlp(library=LIB), LIB, 2, devices_per_node=1)   # two nodes of one device
    assert simulate_pcg(across, LIB, machine, PARSAT_RUN).step_s > simulate_pcg(inside, LIB, machine, PARSAT_RUN).step_s
    forced = simulate_pcg(inside, LIB, machine, PARSAT_RUN, topology=lambda node: GroupTopology(2, 1, 2)).step_s
    assert forced == simulate_pcg(across, LIB, machine, PARSAT_RUN).step_s


def test_the_compute_time_cache_is_shared_and_tied_to_its_machine():
    times = OpTimes(LIB, CPU64)
    first = simulate_pcg(megatron_mlp(), LIB, CPU64, PARSAT_RUN, times=times)
    assert simulate_pcg(megatron_mlp(), LIB, CPU64, PARSAT_RUN, times=times).step_s == first.step_s
    with pytest.raises(TaskBuildError):
        simulate_pcg(megatron_mlp(), LIB, Machine.preset("cpu"), PARSAT_RUN, times=times)


def test_parsat_run_memory_sampled_between_calls_misses_gather_buffers():
    """An all-gather's pieces live only until their concatenation: an allocator's peak sees them, the
    executor's measurement between calls (on CPU) does not."""
    pcg = mesh_pcg(Mesh.of((4,), 4, names=("tp",)), (
        ("leaf", "x", (), (128, 784), {}, "input"),
        ("leaf", "w1", (), (784, 512), {}, "weight"),
        ("leaf", "w2", (), (512, 10), {}, "weight"),
        ("parallel", "partition", (1,), (784, 512), {"dim": 1, "axis": "tp"}, ""),
        ("parallel", "replicate", (0,), (128, 784), {"axis": "tp"}, ""),
        ("op", "matmul", (4, 3), (128, 512), {}, ""),
        ("op", "relu", (5,), (128, 512), {}, ""),
        ("parallel", "combine", (6,), (128, 512), {"dim": 1, "axis": "tp"}, ""),
        ("op", "matmul", (7, 2), (128, 10), {}, ""),
    ))
    step = simulate_pcg(pcg, LIB, CPU64, PARSAT_RUN)
    # at the concatenation: the gathered pieces and the result; at the end of forward: the result, mm2, loss
    assert step.peak_memory_bytes - step.sampled_memory_bytes == (128 * 512 - 2 * 128 * 10) * 8


@pytest.mark.parametrize("profile", [PARSAT_RUN, DDP])
def test_zero3_weights_are_gathered_once_per_step_and_their_gradients_reduce_scattered(profile):
    """As parsat/backend/executor.py runs ZeRO-3: one all-gather per weight in forward, the copy kept for backward (no
    second gather), the gradient reduce-scattered onto the stored shard: that is the gradient sync."""
    machine = CPU64 if profile is PARSAT_RUN else Machine.preset("h100x8")
    step = simulate_pcg(zero3_mlp(), LIB, machine, profile)
    spans = step.result.spans
    gathers = [s for s in spans if "all_gather" in s.name and s.name.endswith("all-gather")]
    assert len(gathers) == 2 and all(s.phase == "forward_comm" for s in gathers)
    assert not [s for s in spans if s.phase.startswith("backward") and "all_gather" in s.name and "all-gather" in s.name]
    syncs = [s for s in spans if s.phase == "grad_sync"]
    assert len(syncs) == 2 and all(s.name.endswith("reduce-scatter") for s in syncs)
    shards = (784 * 512 + 512 * 10) // 2
    assert step.resident_bytes == shards * machine.precision_spec.parameter_bytes(profile.optimizer).total
    gathered = (784 * 512 + 512 * 10) * machine.dtype_bytes
    assert step.peak_memory_bytes >= step.resident_bytes + gathered     # both gathered weights alive at once
    optimizer = [s for s in spans if s.phase == "optimizer"]
    assert min(s.start for s in optimizer) >= max(s.end for s in syncs)


def test_each_collective_is_priced_on_its_mesh_axis_group():
    """The hybrid 2 x 2 mesh on nodes of 2: dp spans two nodes (one device each), tp stays inside a node."""
    pcg = hybrid_mlp()
    machine = Machine.preset("h100x8")
    step = simulate_pcg(pcg, LIB, machine, SERIAL_DDP).result   # whole collectives (pipelined: the tests below)
    bucket = next(s for s in step.spans if s.name.startswith("all-reduce bucket"))
    grads = (784 * 256 + 256 * 10) * machine.precision_spec.gradient_bytes      # the tp pieces of w1 and w2
    assert bucket.end - bucket.start == pytest.approx(price(ALL_REDUCE, GroupTopology(2, 1, 2), grads, machine).seconds)
    scatter = next(s for s in step.spans if s.name.endswith("reduce-scatter") and s.phase == "forward_comm")
    expected = price("reduce_scatter", GroupTopology(2, 2, 1), 64 * 10 * machine.dtype_bytes, machine).seconds
    assert scatter.end - scatter.start == pytest.approx(expected)
    # the fused reduce_scatter is one collective forward and one backward, not a reduce and a partition
    fused = [s for s in step.spans if "reduce_scatter" in s.name and s.stream.kind == "comm"]
    assert [s.phase for s in fused] == ["forward_comm", "backward_comm"]


def test_zero3_data_parallelism_moves_what_data_parallelism_does_and_syncs_by_reduce_scatter():
    """`data_parallel_pcg(zero3=True)`: every weight stored split and all-gathered; the backend lays it out, the
    per-node model sends as many elements as data parallelism's all-reduces (all-gather + reduce-scatter =
    all-reduce), and the step syncs every weight's gradient by a reduce-scatter."""
    from parsat.ir.models import transformer
    from parsat.ir.pcg_placement import derive_placements
    from parsat.ir.costs import totals
    from parsat.search.baselines import price_pcg

    graph = transformer(batch=4, seq=32, hidden=64, heads=4, ffn=256, library=LIB)
    dp, zero = (data_parallel_pcg(graph, LIB, 4, 4, zero3=z) for z in (False, True))
    derive_placements(zero, LIB.ops)
    weights = [n for n in zero.nodes if n.kind == "leaf" and n.role == "weight"]
    gathers = [n for n in zero.nodes if n.op == "all_gather"]
    assert len(gathers) == len(weights) == 16
    machine = Machine.preset("h100x8").with_devices(4)
    dp_totals, zero_totals = (totals(price_pcg(p, LIB, machine), machine) for p in (dp, zero))
    assert zero_totals.comm_elements == dp_totals.comm_elements
    assert zero_totals.grad_sync_elements * 2 == dp_totals.grad_sync_elements     # the reduce-scatter half
    step = simulate_pcg(zero, LIB, CPU64, PARSAT_RUN).result
    syncs = [s for s in step.spans if s.phase == "grad_sync"]
    assert len(syncs) == len(weights) and all(s.name.endswith("reduce-scatter") for s in syncs)


# ---------------------------------------------------------------- tensor-parallel communication overlap


def test_an_all_gather_feeding_a_gemm_is_pipelined_with_it():
    """DDP (a GPU framework, as Megatron-Core's --tp-comm-overlap and PyTorch's async TP run it): the all-gather
    and the matmul it feeds run as 8 chunks each, chunk i of the matmul as soon as chunk i has arrived. The pair
    takes less than the gather and the matmul one after the other, never less than the longer of them."""
    pcg = sequence_parallel_mlp()
    serial = simulate_pcg(pcg, LIB, H100, SERIAL_DDP)
    piped = simulate_pcg(pcg, LIB, H100, DDP)
    spans = piped.result.spans
    gather = _chunks(spans, "all_gather(dim=0, axis=tp, degree=8) #7 all-gather")
    gemm = _chunks(spans, "matmul #9")
    assert len(gather) == len(gemm) == 8
    assert all(m.start >= g.end for g, m in zip(gather, gemm))
    assert any(m.end > g.start for g, m in zip(gather[1:], gemm))       # a chunk computes while the next arrives
    pair = gemm[-1].end - gather[0].start
    comm, compute = (sum(s.end - s.start for s in spans) for spans in (gather, gemm))
    assert max(comm, compute) <= pair + 1e-15 < comm + compute
    whole = [s for s in serial.result.spans if "#7 all-gather" in s.name or s.name in ("matmul #9",)
             or "#7 concat" in s.name]
    assert pair < max(s.end for s in whole) - min(s.start for s in whole)
    assert piped.step_s < serial.step_s


def test_a_gemm_feeding_a_reduce_scatter_and_the_backward_collectives_are_pipelined_too():
    """Chunk i of the reduce-scatter goes once chunk i of the matmul it drains is computed; in backward the
    all-gather of the gradient feeds the row-parallel matmul's backward chunk by chunk, and the column-parallel
    matmul's backward feeds the reduce-scatter of the gathered value's gradient."""
    spans = simulate_pcg(sequence_parallel_mlp(), LIB, H100, DDP).result.spans
    pairs = [("matmul #12", "reduce_scatter(dim=0, axis=tp, degree=8) #13 reduce-scatter"),          # forward
             ("reduce_scatter(dim=0, axis=tp, degree=8) #13 backward all-gather", "matmul #12 backward"),
             ("matmul #9 backward (input gradient)", "all_gather(dim=0, axis=tp, degree=8) #7 backward reduce-scatter")]
    for first, second in pairs:
        before, after = _chunks(spans, first), _chunks(spans, second)
        assert len(before) == len(after) == 8, (first, second)
        assert all(b.start >= a.end for a, b in zip(before, after)), (first, second)
    assert not [s for s in spans if s.name.endswith(("concat", "slices"))]   # in place: nothing concatenated


def test_a_gathered_activation_is_gathered_again_in_backward_beside_the_input_gradient():
    """The gathered rows (#7) are read by the column-parallel matmul's backward (#9's weight gradient), so the
    shard is kept, the gathered value freed after forward and gathered again in backward (`cost.saved`), as
    Megatron-LM's sequence-parallel linear does: one all-gather on the tensor-parallel link, launched when #9's
    backward may start, after which the weight gradient runs; the input gradient (which reads the weight) runs
    beside it and hides it. Without tensor-parallel overlap the all-gather is still launched asynchronously
    before the input gradient (Megatron-LM does so whether or not it pipelines collectives with GEMMs), so the
    reference run of `cost.pipeline.TpOverlap` hides it alike; without a communication stream the whole
    backward of #9 waits for it; `parsat run` (which keeps every value) runs none."""
    pcg = sequence_parallel_mlp()
    spans = simulate_pcg(pcg, LIB, H100, DDP).result.spans
    name = "all_gather(dim=0, axis=tp, degree=8) #7 all-gather again for backward"
    again = [s for s in spans if s.name == name]
    assert len(again) == 1 and again[0].phase == "backward_comm" and again[0].stream.name == "intra"
    again = again[0]
    nbytes = 4096 * 4096 * H100.dtype_bytes
    seconds = price(ALL_GATHER, GroupTopology.of_axis(pcg.mesh, 0), nbytes, H100).seconds
    assert again.end - again.start == pytest.approx(seconds) and again.alloc == nbytes
    freed = [s for s in spans if s.name.startswith("freed after forward: all_gather(dim=0, axis=tp, degree=8) #7 ")]
    assert len(freed) == 1 and freed[0].free == nbytes and freed[0].phase == "forward"
    dgrad = _chunks(spans, "matmul #9 backward (input gradient)")
    wgrad = [s for s in spans if s.name == "matmul #9 backward (weight gradient)"]
    assert len(dgrad) == 8 and len(wgrad) == 1
    assert again.start <= dgrad[0].start and wgrad[0].start >= again.end        # before its reader's weight gradient
    assert dgrad[0].start < again.end and again.start < dgrad[-1].end          # hidden beside the input gradient
    assert wgrad[0].start - again.start < (again.end - again.start) + sum(s.end - s.start for s in dgrad)
    serial = simulate_pcg(pcg, LIB, H100, SERIAL_DDP).result.spans
    beside = next(s for s in serial if s.name == name)
    dgrad = next(s for s in serial if s.name == "matmul #9 backward (input gradient)")
    assert dgrad.start < beside.end and next(s for s in serial if s.name == "matmul #9 backward (weight gradient)"
                                            ).start >= beside.end
    inline = simulate_pcg(pcg, LIB, H100, replace(SERIAL_DDP, overlap=False)).result.spans
    exposed = next(s for s in inline if s.name == name)
    assert next(s for s in inline if s.name == "matmul #9 backward").start >= exposed.end
    assert not [s for s in simulate_pcg(pcg, LIB, CPU64, PARSAT_RUN).result.spans if "again" in s.name]
    assert step_floor(pcg, H100, OpTimes(LIB, H100), profile=DDP) <= simulate_pcg(pcg, LIB, H100, DDP).step_s


def test_pipelined_chunks_move_the_same_bytes_one_ring_step_each_and_allocate_once():
    """Each chunk that moves data is one step of a ring exchange: a send/recv of 1/8 of the tensor on the group's
    link (`collectives.price`), 7 of them: the all-gather's first chunk is the rank's own piece, the
    reduce-scatter's last the rank's own block. A value is allocated once and freed once, as unpipelined; no
    concatenation buffer is held beside it."""
    pcg = sequence_parallel_mlp()
    piped = simulate_pcg(pcg, LIB, H100, DDP)
    serial = simulate_pcg(pcg, LIB, H100, SERIAL_DDP)
    spans = piped.result.spans
    group, nbytes = GroupTopology(8, 8, 1), 4096 * 4096 * H100.dtype_bytes
    step = price(SEND_RECV, group, nbytes / 8, H100).seconds
    gather = _chunks(spans, "all_gather(dim=0, axis=tp, degree=8) #7 all-gather")
    scatter = _chunks(spans, "reduce_scatter(dim=0, axis=tp, degree=8) #13 reduce-scatter")
    assert [s.end - s.start for s in gather] == pytest.approx([0.0] + [step] * 7)
    assert [s.end - s.start for s in scatter] == pytest.approx([step] * 7 + [0.0])
    assert [s.alloc for s in gather] == [nbytes] + [0] * 7
    assert [s.alloc for s in scatter] == [nbytes // 8] + [0] * 7
    net = [sum(s.alloc - s.free for s in p.result.spans) for p in (piped, serial)]
    assert net[0] == net[1]
    assert piped.peak_memory_bytes < serial.peak_memory_bytes


def test_parsat_run_and_collectives_across_nodes_are_not_pipelined():
    """`parsat run` (CPU, one host thread, blocking gloo collectives) pipelines nothing: the step is every task one
    after the other, and asking for the overlap without a communication stream changes nothing. Under DDP a
    collective across nodes (the network, which userbuffers and symmetric memory do not reach) stays whole."""
    pcg = sequence_parallel_mlp(rows=256, hidden=64)
    run = simulate_pcg(pcg, LIB, CPU64, PARSAT_RUN)
    assert not PARSAT_RUN.tp_comm_overlap and DDP.tp_comm_overlap
    assert not [s for s in run.result.spans if s.name.endswith("/8]")]
    assert run.step_s == pytest.approx(sum(s.end - s.start for s in run.result.spans))
    forced = simulate_pcg(pcg, LIB, CPU64, replace(PARSAT_RUN, tp_comm_overlap=True))
    assert forced.step_s == run.step_s and forced.peak_memory_bytes == run.peak_memory_bytes
    across = simulate_pcg(pcg, LIB, H100, DDP, topology=lambda node: GroupTopology(8, 1, 8))
    assert not [s for s in across.result.spans if s.name.endswith("/8]")]


def test_an_all_gather_feeds_all_its_gemms_as_one():
    """Two products read one gathered value (parsat's gpt computes q, k and v as three linears of one input):
    the gather feeds them chunk by chunk as one product, as Megatron-Core's fused QKV GEMM and the several B of
    PyTorch's fused_all_gather_matmul take it, the second's weight issued before it in the first micro-batch
    too. Backward: the first product's runs in chunks, pipelined with the reduce-scatter of the gathered value's
    gradient; the second's runs whole, before it."""
    mesh = Mesh.of((8,), 8, names=("tp",))
    pcg = mesh_pcg(mesh, (
        ("leaf", "x", (), (4096, 1024), {}, "input"),
        ("leaf", "w0", (), (1024, 1024), {}, "weight"),
        ("leaf", "wa", (), (1024, 1024), {}, "weight"),
        ("leaf", "wb", (), (1024, 1024), {}, "weight"),
        ("parallel", "partition", (0,), (4096, 1024), {"dim": 0, "axis": "tp"}, ""),
        ("parallel", "replicate", (1,), (1024, 1024), {"axis": "tp"}, ""),
        ("op", "matmul", (4, 5), (4096, 1024), {}, ""),
        ("parallel", "all_gather", (6,), (4096, 1024), {"dim": 0, "axis": "tp"}, ""),
        ("parallel", "partition", (2,), (1024, 1024), {"dim": 1, "axis": "tp"}, ""),
        ("op", "matmul", (7, 8), (4096, 1024), {}, ""),
        ("parallel", "partition", (3,), (1024, 1024), {"dim": 1, "axis": "tp"}, ""),
        ("op", "matmul", (7, 10), (4096, 1024), {}, ""),
        ("op", "add", (9, 11), (4096, 1024), {}, ""),
    ))
    for microbatches in (1, 2):
        spans = simulate_pcg(pcg, LIB, H100, DDP, microbatches=microbatches).result.spans
        gather = _chunks(spans, "all_gather(dim=0, axis=tp, degree=8) #7 all-gather")
        fused = _chunks(spans, "matmul #9 + #11")
        assert len(gather) == len(fused) == 8 * microbatches
        assert all(m.start >= g.end for g, m in zip(gather, fused))
        assert not [s for s in spans if s.name.startswith(("matmul #9 [", "matmul #11 [", "matmul #11 "))
                    and s.phase == "forward"]
        second = [s for s in spans if s.name == "matmul #11 backward (input gradient)"]   # #7 is gathered again
        first = _chunks(spans, "matmul #9 backward (input gradient)")
        scatter = _chunks(spans, "all_gather(dim=0, axis=tp, degree=8) #7 backward reduce-scatter")
        assert len(second) == microbatches and len(first) == len(scatter) == 8 * microbatches
        assert second[0].end <= first[0].start and all(b.start >= a.end for a, b in zip(first, scatter))


@pytest.fixture(scope="module")
def gpt_layouts():
    """`_gpt_layouts()` made once for the module's six tests that read it (each built the graph and its 16
    layouts again, ~0.6 CPU s a time, the parametrized one twice). The PCGs are frozen; what a test works out
    from one is kept in the PCG's own tables (`PCG.derive`), each entry keyed by the object it reads (the
    library, an `OpTimes`) and equal to working it out afresh, which the tests of those tables check against
    tables of fresh objects (`OpTimes(...)` made in the test, `replace(pcg, ...)`), never against another test's."""
    return _gpt_layouts()


def _gpt_layouts():
    """A 3-block GPT laid out as the independent grid lays it out on 4 devices (data, tensor and both, ZeRO-3,
    sequence parallelism), with ZeRO stages 1 and 2 and recomputation beside: plans of every kind of task."""
    from parsat.dsl.library import load_library as load
    from parsat.ir.megatron import megatron_pcg
    from parsat.ir.models import build_example
    from parsat.ir.recompute import BLOCKS

    library = load()[0]
    graph = build_example("gpt", {"blocks": 3, "hidden": 64, "heads": 4, "batch": 8, "seq": 32, "vocab": 256}, library)
    found = []
    for shape, zero, sequence in (((4, 1), 0, False), ((4, 1), 3, False), ((2, 2), 0, True), ((2, 2), 3, False),
                                  ((1, 4), 0, False)):
        pcg = megatron_pcg(graph, library, shape, 2, zero=zero, sequence=sequence)
        found += [pcg, replace(pcg, recompute=BLOCKS)]
        if zero == 0 and shape[0] > 1:
            found += [replace(pcg, zero=1), replace(pcg, zero=2, recompute=BLOCKS)]
    return library, found


@pytest.mark.parametrize("skew", [0.0, 0.3])
def test_repeated_micro_batches_are_the_tasks_built_anew(skew, gpt_layouts):
    """The middle micro-batches copied from one known to repeat (`_Builder.template`) are, task for task, what
    building each anew gives: names, streams, durations, dependencies, memory, and so every start and end; with
    stragglers (`sync_skew`: the lag a micro-batch carries sets its first wait) and without."""
    library, layouts = gpt_layouts
    for name, profile in (("h100x8", DDP), ("cpu", PARSAT_RUN)):
        machine = Machine.preset(name).with_devices(4)
        machine = replace(machine, comm=replace(machine.comm, sync_skew=skew))
        for pcg in layouts:
            for m in (3, 4, 6):
                copied, built = (simulate_pcg(pcg, library, machine, profile, microbatches=m, repeat=r)
                                 for r in (True, False))
                (a, a_start, a_end), (b, b_start, b_end) = copied.result._columns, built.result._columns
                assert (a.names, a.stream_of, a.durations, a.deps, a.allocs, a.frees, a.phases) == \
                    (b.names, b.stream_of, b.durations, b.deps, b.allocs, b.frees, b.phases)
                assert (a_start, a_end, copied.result.peak_memory_bytes) == \
                    (b_start, b_end, built.result.peak_memory_bytes)
                assert (copied.end_of_forward, copied.end_of_backward) == (built.end_of_forward, built.end_of_backward)


def test_a_compute_time_cache_shared_by_many_layouts_gives_the_tasks_a_fresh_one_does(gpt_layouts):
    """`OpTimes` keeps collectives' prices and pipelined products' chunks by their inputs for every PCG it prices
    (a grid's layouts, a step's micro-batches): each kept figure is what pricing it afresh gives, and a step
    simulated with a cache warmed by the other layouts and their floors is, task for task, the one a fresh
    cache gives; the floors too."""
    library, layouts = gpt_layouts
    machine = Machine.preset("h100x8").with_devices(4)
    shared = OpTimes(library, machine)
    for pcg in layouts + layouts[::-1]:
        for m in (1, 4):
            warm = simulate_pcg(pcg, library, machine, DDP, times=shared, microbatches=m)
            cold = simulate_pcg(pcg, library, machine, DDP, times=OpTimes(library, machine), microbatches=m)
            (a, a_start, a_end), (b, b_start, b_end) = warm.result._columns, cold.result._columns
            assert (a.names, a.stream_of, a.durations, a.deps, a.allocs, a.frees, a.phases, a_start, a_end) == \
                (b.names, b.stream_of, b.durations, b.deps, b.allocs, b.frees, b.phases, b_start, b_end)
            assert warm.result.peak_memory_bytes == cold.result.peak_memory_bytes
            assert step_floor(pcg, machine, shared, m) == step_floor(pcg, machine, OpTimes(library, machine), m)
    group = GroupTopology(8, 4, 2)
    for nbytes in (0, 1, 3 * 2**20, 3.5 * 2**20, 2**20):
        assert shared.collective(ALL_REDUCE, group, nbytes) == price(ALL_REDUCE, group, nbytes, machine).seconds
    assert shared.collective(SEND_RECV, group, 2**20) == price(SEND_RECV, group, 2**20, machine).seconds


def test_which_nodes_need_a_gradient_is_kept_per_pcg_and_library(gpt_layouts):
    """`needs_gradient` is worked out once per PCG and library (`PCG.derived`) and asked again by the pricer, each
    floor and the simulation: the kept answer is the one worked out afresh, for each library it was asked with."""
    library, layouts = gpt_layouts
    for pcg in layouts:
        kept = needs_gradient(pcg, library)
        assert needs_gradient(pcg, library) is kept and kept == _needs_gradient(pcg, library)
        assert needs_gradient(pcg) == _needs_gradient(pcg, None) and needs_gradient(pcg, library) is kept
        fresh = replace(pcg, recompute=pcg.recompute)     # an equal PCG: its own table
        assert needs_gradient(fresh, library) == kept and needs_gradient(fresh, library) is not kept


def test_the_step_floor_is_below_every_simulated_step(gpt_layouts):
    """`step_floor` is a lower bound of the simulated step (what lets the search skip simulating a candidate):
    every layout, ZeRO stage and recomputation, one micro-batch or several, a GPU's profile and `parsat run`'s."""
    from parsat.cost.pcg_tasks import step_floor

    library, layouts = gpt_layouts
    for name, profile in (("h100x8", DDP), ("cpu", PARSAT_RUN)):
        machine = Machine.preset(name).with_devices(4)
        times = OpTimes(library, machine)
        for pcg in layouts:
            for m in (1, 3):
                floor = step_floor(pcg, machine, times, m)
                step = simulate_pcg(pcg, library, machine, profile, times=times, microbatches=m)
                assert 0 < step_floor(pcg, machine, times, m, plan=False) <= floor <= step.step_s
                compute = sum(v for k, v in step.result.busy_s.items() if k.endswith("compute"))
                assert floor <= compute     # it sums compute tasks, no more


@pytest.mark.parametrize("network", [1.0, 100.0])
def test_the_step_floor_holds_where_collectives_are_pipelined_with_their_products(network):
    """Under DDP an in-node all-gather or reduce-scatter pipelined with its product (`Pipeline`) issues no
    concatenation or slices, and its product runs as chunks fused with its siblings: a floor that counted
    the unpipelined copies was above the compute stream's busy time here, and above the simulated step where
    NVLink is fast enough (`network` x its bandwidth, no latency) that the step is about its compute."""
    from parsat.cost.pcg_tasks import step_floor
    from parsat.ir.megatron import megatron_pcg
    from parsat.ir.models import build_example
    from parsat.ir.recompute import BLOCKS

    library = load_library()[0]
    graph = build_example("gpt", {"blocks": 2, "hidden": 1024, "heads": 8, "batch": 16, "seq": 1024, "vocab": 2048},
                          library)
    machine = Machine.preset("h100x8").with_devices(8)
    machine = replace(machine, intra_bandwidth=machine.intra_bandwidth * network,
                      intra_latency=machine.intra_latency / network,
                      comm=replace(machine.comm, launch_s=machine.comm.launch_s / network, points=()))
    times = OpTimes(library, machine)
    for shape in ((1, 8), (2, 4)):
        pcg = megatron_pcg(graph, library, shape, 8, zero=0, sequence=True)
        for plan, microbatches in ((pcg, 1), (pcg, 2), (replace(pcg, recompute=BLOCKS), 2)):
            step = simulate_pcg(plan, library, machine, DDP, times=times, microbatches=microbatches)
            assert any(s.name.endswith(f"[1/{shape[1]}]") for s in step.result.spans)   # pipelined
            floor = step_floor(plan, machine, times, microbatches)
            compute = sum(v for k, v in step.result.busy_s.items() if k.endswith("compute"))
            assert step_floor(plan, machine, times, microbatches, plan=False) <= floor <= compute <= step.step_s


def test_a_weight_replicated_on_two_axes_holds_neither_backward_compute_nor_the_tensor_axis_link():
    """Megatron's layout with sequence-parallel norms replicates a norm's weight over tp, then over dp: its
    gradient is all-reduced over dp, then bucketed over tp. Backward's kernels and tensor-parallel collectives
    wait for neither (the hand-on waits on the dp stream, the tp bucket is launched after backward, as
    Megatron's finalize_model_grads); before, every such weight held the compute stream until its dp
    all-reduce, queued behind the data-parallel buckets, ended."""
    from parsat.ir.megatron import megatron_pcg
    from parsat.ir.models import build_example
    from parsat.ir.pcg import weight_chains
    library = load_library(sorted(shipped_rules_dir().glob("*.rule")))[0]
    graph = build_example("gpt", {"blocks": 2, "batch": 4, "seq": 256, "hidden": 512, "heads": 8, "vocab": 1024},
                          library)
    pcg = megatron_pcg(graph, library, (2, 8), 8, sequence=True)
    by, chains = {n.id: n for n in pcg.nodes}, weight_chains(pcg)
    assert any(n.op == "replicate" and n.inputs[0] in chains and by[n.inputs[0]].op == "replicate"
               for n in pcg.nodes if n.kind == "parallel" and by[n.inputs[0]].kind == "parallel")
    b = simulate_pcg(pcg, library, Machine.preset("h100x8").with_devices(16), DDP, microbatches=2).result._columns[0]
    kind = [b.streams[b.stream_of[i]].kind for i in range(len(b.names))]
    assert not [b.names[i] for i in range(len(b.names)) if kind[i] == "compute" and "optimizer" not in b.names[i]
                and any(kind[d] != "compute" and b.phases[d] == "grad_sync" for d in b.deps[i])]
    intra = [i for i in range(len(b.names)) if b.streams[b.stream_of[i]].name == "intra"]
    buckets = [i for i in intra if b.names[i].startswith("all-reduce bucket")]
    assert buckets and min(buckets) > max(i for i in intra if b.phases[i] == "backward_comm")


def test_product_axes_of_a_torch_layout_weight():
    """torch's `linear_t`/`linear_nobias_t` read the weight [n, k]: its dim 0 is the product's n, dim 1 its k (a
    [k, n] weight's are the other way round); the activation's and the output's dims are the same for both."""
    from parsat.cost.pcg_tasks import product_axis
    assert product_axis(1, 2, 0) == 2 and product_axis(1, 2, 1) == 1                      # [k, n]
    assert product_axis(1, 2, 0, transposed_b=True) == 1 and product_axis(1, 2, 1, transposed_b=True) == 2
    assert product_axis(0, 3, 2, transposed_b=True) == 2 and product_axis(None, 3, 2, transposed_b=True) == 1


def test_the_simulated_activations_are_what_the_per_node_model_keeps():
    """Under DDP (backward frees what forward kept) a value no backward reads (the row-parallel matmul's partial
    sum, #12) is freed once forward has read it, and a regathered one (#7) too: at the end of forward the
    simulated memory is the weights' state, the activations the per-node model keeps (`cost.saved`, the figure
    that decides what fits) and the output with its loss, nothing more."""
    from parsat.search.solve import price_pcg

    pcg = sequence_parallel_mlp()
    step = simulate_pcg(pcg, LIB, H100, DDP)
    kept = sum(c.activation_bytes for c in price_pcg(pcg, LIB, H100).values())
    output = 4096 // 8 * 4096 * H100.dtype_bytes                  # #13's piece, and its loss's
    held = step.result.memory_after(step.end_of_forward, step.resident_bytes) - step.resident_bytes
    assert held == kept + 2 * output
    freed = [s for s in step.result.spans if s.name == "freed after forward: matmul #12 (no backward reads it)"]
    assert len(freed) == 1 and freed[0].free == 4096 * 4096 * H100.dtype_bytes


class _Forgetful(dict):
    """A memo that keeps nothing: every look-up misses, so each fact is worked out afresh."""

    def __setitem__(self, key, value) -> None:
        pass


def test_node_facts_kept_across_micro_batches_give_the_tasks_worked_out_afresh(monkeypatch, gpt_layouts):
    """A compute node's forward and backward facts (`_Builder.forward_known`, `backward_known`, the backward's name)
    are worked out once per step and read again by every later micro-batch and recomputation, and the compute
    times are kept with the PCG for the cache (`PCG.derive`, shared by a layout's forms): task for task, the step
    is the one a builder that keeps none of them (and times every node itself) gives, over layouts with ZeRO,
    sequence parallelism (re-gathers, pipelined products) and recomputation, in both profiles."""
    library, layouts = gpt_layouts

    def columns(prediction):
        b, start, end = prediction.result._columns
        return (b.names, b.stream_of, b.durations, b.deps, b.allocs, b.frees, b.phases, start, end,
                prediction.result.peak_memory_bytes, prediction.end_of_forward, prediction.end_of_backward)

    runs = [(name, profile, pcg, m) for name, profile in (("h100x8", DDP), ("cpu", PARSAT_RUN))
            for pcg in layouts for m in (1, 4)]
    kept = {}
    for name, profile, pcg, m in runs:
        machine = Machine.preset(name).with_devices(4)
        times = OpTimes(library, machine)
        step_floor(pcg, machine, times, m)   # the floor fills the PCG's table first, as a grid's does
        kept[(name, id(pcg), m)] = columns(simulate_pcg(pcg, library, machine, profile, times=times, microbatches=m))
        assert pcg.derive(("compute times",), times, dict)   # filled, and read by the simulation
    original = pcg_tasks._Builder.__init__

    def forgetting(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.forward_known, self.backward_known, self.backward_labels = _Forgetful(), _Forgetful(), _Forgetful()
        self.timed = {}
    monkeypatch.setattr(pcg_tasks._Builder, "__init__", forgetting)
    for name, profile, pcg, m in runs:
        machine = Machine.preset(name).with_devices(4)
        afresh = simulate_pcg(pcg, library, machine, profile, times=OpTimes(library, machine), microbatches=m)
        assert columns(afresh) == kept[(name, id(pcg), m)]


def test_a_simulated_step_s_builder_is_freed_when_the_step_ends(monkeypatch, gpt_layouts):
    """The builder (and its tasks, 10^5-10^6 for a step of many micro-batches) is in no reference cycle: it is freed
    as the simulation returns, not held until the cyclic collector runs (which a search pauses:
    `search.collector`). ZeRO-1 gathers and DDP's buckets hold lambdas, backward a recursive `visit`."""
    import gc
    import weakref
    library, layouts = gpt_layouts
    machine = Machine.preset("h100x8").with_devices(4)
    made = []
    original = pcg_tasks._Builder.__init__

    def kept(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append((weakref.ref(self), weakref.ref(self.steps)))
    monkeypatch.setattr(pcg_tasks._Builder, "__init__", kept)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for pcg in layouts:
            simulate_pcg(pcg, library, machine, DDP, microbatches=4)
            step_floor(pcg, machine, OpTimes(library, machine), 4)
            assert all(builder() is None and steps() is None for builder, steps in made), pcg.zero
    finally:
        if enabled:
            gc.enable()
