"""The step simulator's profile of the torch-native runtime (`TORCH_NATIVE`): FSDP2's parameter groups (one
all-gather / reduce-scatter / all-reduce per group, not per weight), torch's tensor-parallel styles (one
all-reduce of a replicated activation's gradient per module reading it, DTensor dispatch on the operators
reading a weight), and the loss each rank's own."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from parsat.cost.fsdp_groups import group_elements, param_groups, tensor_axes
from parsat.cost.pcg_tasks import PARSAT_RUN, TORCH_NATIVE, OpTimes, needs_gradient, simulate_pcg, step_floor
from parsat.dsl.library import load_library, shipped_rules_dir
from parsat.ir.blocks import OUTSIDE
from parsat.ir.data_parallel import data_parallel_pcg
from parsat.ir.errors import MachineError
from parsat.ir.machine import Machine
from parsat.ir.machine_profile import FSDP_COLLECTIVE_FIELDS, REDISTRIBUTE_FIELDS, OpEfficiency
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import gpt, llama
from parsat.ir.module_calls import ModuleCalls

LIB = load_library([shipped_rules_dir() / "ops.rule"])[0]
CPU = Machine.preset("cpu").with_devices(2)
SIZES = dict(blocks=2, batch=4, seq=16, hidden=32, heads=2, vocab=64)


@pytest.fixture(scope="module")
def graph():
    return gpt(library=LIB, **SIZES)


def _collectives(pcg, machine=CPU, profile=TORCH_NATIVE) -> dict[str, int]:
    step = simulate_pcg(pcg, LIB, machine, profile).result
    out: dict[str, int] = {}
    for span in step.spans:
        for kind in ("all-gather", "reduce-scatter", "all-reduce"):
            if span.name.endswith(kind) and "waiting" not in span.name:
                out[kind] = out.get(kind, 0) + 1
    return out


def test_zero3_is_one_gather_and_one_reduce_scatter_per_fsdp_group(graph):
    """ZeRO-3 as `fully_shard` on each block and the root: a group per block and one for the rest; each gathered
    once in forward, the blocks again in backward (the root is kept), each reduce-scattered once."""
    pcg = data_parallel_pcg(graph, LIB, 2, zero3=True)
    groups = {g.key: g for g in param_groups(pcg).values()}
    assert sorted(groups) == [OUTSIDE, 0, 1]
    assert all(g.sharded for g in groups.values()) and not groups[OUTSIDE].reshard and groups[0].reshard
    assert _collectives(pcg) == {"all-gather": 3 + 2, "reduce-scatter": 3}
    per_weight = _collectives(pcg, profile=PARSAT_RUN)
    weights = sum(1 for n in pcg.nodes if n.kind == "leaf" and n.role == "weight")
    assert per_weight["all-gather"] == per_weight["reduce-scatter"] == weights


def test_data_parallelism_is_one_all_reduce_of_every_gradient_and_no_loss_reduce(graph):
    """`replicate` on the root: one group, one all-reduce of the flattened gradients; the loss is each rank's
    own (the interpreter all-reduces it, and each weight's gradient alone)."""
    pcg = data_parallel_pcg(graph, LIB, 2)
    assert len({g.key for g in param_groups(pcg).values()}) == 1
    assert _collectives(pcg) == {"all-reduce": 1}
    weights = sum(1 for n in pcg.nodes if n.kind == "leaf" and n.role == "weight")
    assert _collectives(pcg, profile=PARSAT_RUN)["all-reduce"] == weights + 1   # + the loss


def test_tensor_parallel_styles_all_reduce_an_input_gradient_per_module_and_pay_dtensor_dispatch(graph):
    """Megatron tp 2: styles converting each column-parallel module's input on its own (`style_collectives`)
    all-reduce a replicated normed activation several modules read (LLaMA's q, k and v, its MLP's gate and up
    projections; the built-in gpt reads each through one fused product) once per reader in backward; the
    torch-native runtime converts it once at the parent (`lowering.gathered_inputs`), so its profile prices one;
    the operators reading a weight run on DTensors: a measured cost per call, forward and backward, which a
    data-parallel plan (FSDP2 hands modules plain tensors) does not pay."""
    pcg = megatron_pcg(llama(library=LIB, ffn=64, **SIZES), LIB, (1, 2))
    assert tensor_axes(pcg) == {0} and param_groups(pcg) == {}
    styled = simulate_pcg(pcg, LIB, CPU, replace(TORCH_NATIVE, style_collectives=True)).result
    plain = simulate_pcg(pcg, LIB, CPU, TORCH_NATIVE).result
    backward = lambda step: sum(1 for s in step.spans if s.phase == "backward_comm" and s.name.endswith("all-reduce"))
    assert backward(styled) > backward(plain) >= 1
    assert not TORCH_NATIVE.style_collectives
    dtensor = replace(CPU, efficiency=replace(CPU.efficiency, dtensor_dispatch_s=1e-3,
                                              dtensor_backward_dispatch_s=1e-3))
    extra = simulate_pcg(pcg, LIB, dtensor, TORCH_NATIVE).step_s - plain.step_s
    assert extra > 0 and extra == pytest.approx(round(extra / 1e-3) * 1e-3, rel=1e-6)   # whole calls
    dp = data_parallel_pcg(graph, LIB, 2)
    assert simulate_pcg(dp, LIB, dtensor, TORCH_NATIVE).step_s == simulate_pcg(dp, LIB, CPU, TORCH_NATIVE).step_s


def test_a_tensor_axis_collective_pays_dtensors_redistribute_once_and_fsdp2_and_other_profiles_none(graph):
    """Each collective on a tensor axis is a DTensor `redistribute` in the torch-native runtime: it first takes
    the calibrated host time of its kind (`OpEfficiency.redistribute_time`) on the compute stream, in its own
    direction's phase, so the step grows by exactly those calls' figures. FSDP2's group collectives (data
    parallelism, ZeRO-3), the interpreter's profile and a machine calibrated without them pay nothing."""
    tp = megatron_pcg(llama(library=LIB, ffn=64, **SIZES), LIB, (1, 2))
    figures = {"dtensor_all_reduce_s": 1e-3, "dtensor_all_gather_s": 2e-3, "dtensor_reduce_scatter_s": 4e-3}
    dtensor = replace(CPU, efficiency=replace(CPU.efficiency, **figures))
    plain = simulate_pcg(tp, LIB, CPU, TORCH_NATIVE).result
    priced = simulate_pcg(tp, LIB, dtensor, TORCH_NATIVE).result
    hosts = [s for s in priced.spans if s.name.endswith("DTensor's redistribute")]
    collectives = [s for s in plain.spans if s.phase.endswith("comm") and "waiting" not in s.name]
    assert len(hosts) == len(collectives) >= 2
    assert {s.phase for s in hosts} == {"forward", "backward"}
    kinds = {"all-reduce": 1e-3, "all-gather": 2e-3, "reduce-scatter": 4e-3}
    expected = sum(kinds[next(k for k in kinds if s.name.endswith(k))] for s in collectives)
    assert sum(s.end - s.start for s in hosts) == pytest.approx(expected, rel=1e-9)
    assert priced.step_s - plain.step_s == pytest.approx(expected, rel=1e-6)
    assert simulate_pcg(tp, LIB, dtensor, PARSAT_RUN).step_s == simulate_pcg(tp, LIB, CPU, PARSAT_RUN).step_s
    for pcg in (data_parallel_pcg(graph, LIB, 2), data_parallel_pcg(graph, LIB, 2, zero3=True)):
        assert simulate_pcg(pcg, LIB, dtensor, TORCH_NATIVE).step_s == simulate_pcg(pcg, LIB, CPU, TORCH_NATIVE).step_s
    assert CPU.efficiency.redistribute_time("all_reduce") == 0.0
    assert dtensor.efficiency.redistribute_time("all_to_all") == 0.0


def test_an_fsdp2_group_collective_pays_fsdp2s_host_work_of_its_kind_and_a_tensor_axis_none(graph):
    """Each of FSDP2's group collectives (ZeRO-3's gathers, forward and again in backward, and reduce-scatters;
    data parallelism's one all-reduce) first takes its kind's calibrated host time over the ranks
    (`OpEfficiency.fsdp_collective_time`), the step exactly that much longer; a tp plan (no groups) none."""
    figures = {"fsdp_all_gather_s": 1e-3, "fsdp_reduce_scatter_s": 2e-3, "fsdp_all_reduce_s": 4e-3}
    fsdp = replace(CPU, efficiency=replace(CPU.efficiency, **figures))
    for pcg, expected in ((data_parallel_pcg(graph, LIB, 2, zero3=True), (3 + 2) * 1e-3 + 3 * 2e-3),
                          (data_parallel_pcg(graph, LIB, 2), 4e-3)):
        priced = simulate_pcg(pcg, LIB, fsdp, TORCH_NATIVE).result
        hosts = [s for s in priced.spans if s.name.endswith("FSDP2's host work")]
        assert sum(s.end - s.start for s in hosts) == pytest.approx(expected, rel=1e-9)
        assert priced.step_s - simulate_pcg(pcg, LIB, CPU, TORCH_NATIVE).step_s == pytest.approx(expected, rel=1e-6)
        assert simulate_pcg(pcg, LIB, fsdp, PARSAT_RUN).step_s == simulate_pcg(pcg, LIB, CPU, PARSAT_RUN).step_s
    tp = megatron_pcg(llama(library=LIB, ffn=64, **SIZES), LIB, (1, 2))
    assert simulate_pcg(tp, LIB, fsdp, TORCH_NATIVE).step_s == simulate_pcg(tp, LIB, CPU, TORCH_NATIVE).step_s
    assert CPU.efficiency.fsdp_collective_time("all_gather") == 0.0


def test_the_host_work_figures_round_trip_in_a_machine_file_and_older_files_read_them_as_0():
    """A calibrated file keeps DTensor's and FSDP2's figures; a preset's or an older file's efficiency has none written and
    reads them as 0; a negative one is refused."""
    eff = replace(CPU.efficiency, dtensor_all_reduce_s=5e-4, dtensor_all_gather_s=4e-4, fsdp_all_gather_s=3e-4)
    data = json.loads(json.dumps(replace(CPU, efficiency=eff).to_dict()))
    assert Machine.from_dict(data).efficiency == eff and "dtensor_reduce_scatter_s" not in data["efficiency"]
    older = CPU.to_dict()["efficiency"]
    assert not {*REDISTRIBUTE_FIELDS, *FSDP_COLLECTIVE_FIELDS} & set(older)
    assert all(OpEfficiency.from_dict(older).redistribute_time(k) == OpEfficiency.from_dict(older).fsdp_collective_time(k)
               == 0.0 for k in ("all_reduce", "all_gather", "reduce_scatter"))
    with pytest.raises(MachineError):
        OpEfficiency.from_dict({**data["efficiency"], "dtensor_all_gather_s": -1e-4})


def test_a_counted_module_pays_dtensor_dispatch_per_call_it_makes_on_dtensors_and_a_dp_plan_none(graph):
    """With the module's calls counted (`importer.call_count`), DTensor's dispatch is priced per call the
    modules holding parameters make, forward and in their backward (`ModuleCalls.dtensor_forward` /
    `dtensor_backward`: what a tensor axis runs on DTensors, several per graph node), not once per graph node
    reading a weight; each micro-batch pays them; a data-parallel plan, whose modules get plain tensors, none."""
    tp = megatron_pcg(llama(library=LIB, ffn=64, **SIZES), LIB, (1, 2))
    dtensor = replace(CPU, efficiency=replace(CPU.efficiency, dtensor_dispatch_s=1e-3,
                                              dtensor_backward_dispatch_s=2e-3))

    def extra(pcg, calls, microbatches=1):
        profile = TORCH_NATIVE.running(calls)
        return (simulate_pcg(pcg, LIB, dtensor, profile, microbatches=microbatches).step_s
                - simulate_pcg(pcg, LIB, CPU, profile, microbatches=microbatches).step_s)

    ops = sum(1 for n in tp.nodes if n.kind == "op")
    counted = ModuleCalls(ops, 0, ops, dtensor_forward=50, dtensor_backward=120)
    for microbatches in (1, 2):
        assert extra(tp, counted, microbatches) == pytest.approx(microbatches * (50 * 1e-3 + 120 * 2e-3), rel=1e-6)
    per_node = extra(tp, ModuleCalls(ops, 0, ops))   # uncounted: one call per node reading a weight
    assert 0 < per_node < extra(tp, counted)
    dp = data_parallel_pcg(graph, LIB, 2)
    dp_ops = sum(1 for n in dp.nodes if n.kind == "op")
    assert extra(dp, ModuleCalls(dp_ops, 0, dp_ops, dtensor_forward=50, dtensor_backward=120)) == 0.0
    assert ModuleCalls(2 * ops, 0, 2 * ops, 50, 120).dtensor_calls(ops, backward=True) == pytest.approx(60)   # a stage
    with pytest.raises(ValueError):
        ModuleCalls(1, 0, 1, dtensor_backward=-1)


def test_the_step_floor_stays_below_the_torch_native_step(graph):
    """The profile only groups what the floor leaves out (the weights' chains) and adds DTensor time, so the
    search's floor is still a floor under it."""
    for pcg in (data_parallel_pcg(graph, LIB, 2), data_parallel_pcg(graph, LIB, 2, zero3=True),
                megatron_pcg(graph, LIB, (1, 2))):
        times = OpTimes(LIB, CPU)
        floor = step_floor(pcg, CPU, times, profile=TORCH_NATIVE)
        assert 0 < floor <= simulate_pcg(pcg, LIB, CPU, TORCH_NATIVE, times=times).step_s


def test_gradients_live_from_backward_to_the_update_and_resharded_blocks_leave_forward_freed(graph):
    """`zero_grad(set_to_none=True)`: at the end of forward no gradient exists (the interpreter holds them all
    step), at the end of backward every weight's does; FSDP2 frees a block's gathered weights after its forward,
    so a ZeRO-3 step's forward ends holding the root group's gathered weights only."""
    pcg = data_parallel_pcg(graph, LIB, 2)
    held = replace(TORCH_NATIVE, transient_gradients=False)
    now, before = (simulate_pcg(pcg, LIB, CPU, p) for p in (TORCH_NATIVE, held))
    weights = sum(n.piece_size for n in pcg.nodes if n.kind == "leaf" and n.role == "weight")
    grads = weights * CPU.precision_spec.gradient_bytes
    forward = lambda s: s.result.memory_after(s.end_of_forward, s.resident_bytes)
    backward = lambda s: s.result.memory_after(s.end_of_backward, s.resident_bytes)
    assert forward(before) - forward(now) == grads
    assert backward(now) == backward(before)
    zero = data_parallel_pcg(graph, LIB, 2, zero3=True)
    step = simulate_pcg(zero, LIB, CPU, TORCH_NATIVE)
    groups = {g.key: g for g in param_groups(zero).values()}
    by_id = {n.id: n for n in zero.nodes}
    root = group_elements(groups[OUTSIDE], by_id)[1] * CPU.dtype_bytes
    kept = replace(TORCH_NATIVE, fsdp_groups=False)   # per weight: every gathered weight kept to its backward
    assert forward(simulate_pcg(zero, LIB, CPU, kept)) > forward(step) > root


def test_fsdp2_hooks_cost_host_time_per_parameter_of_each_group(graph):
    """`parsat calibrate --dtensor` measures FSDP2's hooks per parameter (before a group's forward, after its
    backward): the step pays them once per parameter of each group, forward and backward, on the one host
    thread; a plan without FSDP2 groups (Megatron tp) pays nothing, and an uncalibrated machine (0) nothing."""
    hooked = replace(CPU, efficiency=replace(CPU.efficiency, fsdp_forward_param_s=1e-3, fsdp_backward_param_s=2e-3,
                                             fsdp_forward_group_s=5e-3, fsdp_backward_group_s=7e-3))
    for pcg in (data_parallel_pcg(graph, LIB, 2), data_parallel_pcg(graph, LIB, 2, zero3=True)):
        groups = list({g.key: g for g in param_groups(pcg).values()}.values())
        assert sum(len(g.members) for g in groups) == sum(1 for n in pcg.nodes if n.kind == "leaf" and n.role == "weight")
        assert len(groups) == 1 or all(g.sharded for g in groups)   # replicate: one group on the root
        # every group: gathered (its forward hooks) before forward and, resharded, again before backward; its
        # backward hooks once
        expected = sum((1 + g.reshard) * (5e-3 + len(g.members) * 1e-3) + 7e-3 + len(g.members) * 2e-3
                       for g in groups)
        extra = simulate_pcg(pcg, LIB, hooked, TORCH_NATIVE).step_s - simulate_pcg(pcg, LIB, CPU, TORCH_NATIVE).step_s
        assert extra == pytest.approx(expected, rel=1e-6)
    assert any(g.reshard for g in param_groups(data_parallel_pcg(graph, LIB, 2, zero3=True)).values())
    tp = megatron_pcg(graph, LIB, (1, 2))
    assert simulate_pcg(tp, LIB, hooked, TORCH_NATIVE).step_s == simulate_pcg(tp, LIB, CPU, TORCH_NATIVE).step_s
    assert "fsdp_forward_param_s" not in CPU.efficiency.to_dict()
    assert Machine.from_dict(hooked.to_dict()).efficiency == hooked.efficiency


def test_the_user_s_module_pays_a_dispatch_per_call_its_graph_folded_away(graph):
    """The torch-native runtime runs the user's module, whose views and casts the imported graph folds away
    (`ir.module_calls`): each extra forward call costs one forward dispatch, each extra autograd node one
    backward dispatch, every micro-batch; a pipeline stage's PCG holding part of the graph pays that part."""
    pcg = data_parallel_pcg(graph, LIB, 2)
    ops = sum(1 for n in pcg.nodes if n.kind == "op")
    dispatching = replace(CPU, efficiency=replace(CPU.efficiency, dispatch_s=1e-3, backward_dispatch_s=2e-3))
    calls = ModuleCalls(forward_calls=ops + 10, backward_nodes=ops + 30, graph_nodes=ops)
    gradient_nodes = sum(needs_gradient(pcg, LIB)[n.id] for n in pcg.nodes if n.kind == "op")
    extra_backward = ops + 30 - gradient_nodes
    for microbatches in (1, 3):
        plain = simulate_pcg(pcg, LIB, dispatching, TORCH_NATIVE, microbatches=microbatches).step_s
        module = simulate_pcg(pcg, LIB, dispatching, TORCH_NATIVE.running(calls), microbatches=microbatches).step_s
        assert module - plain == pytest.approx(microbatches * (10 * 1e-3 + extra_backward * 2e-3), rel=1e-6)
    assert TORCH_NATIVE.running(None) == TORCH_NATIVE
    half = ModuleCalls(forward_calls=2 * (ops + 10), backward_nodes=0, graph_nodes=2 * ops)   # pcg: half the graph
    assert half.extra_forward(ops) == pytest.approx(10) and half.extra_backward(ops, gradient_nodes) == 0.0
    with pytest.raises(ValueError):
        ModuleCalls(forward_calls=-1, backward_nodes=0, graph_nodes=1)


def test_the_user_s_module_pays_its_own_python_per_bytecode_instruction(graph):
    """The module's own Python between its ATen calls (`ModuleCalls.python_forward` instructions) costs
    `OpEfficiency.python_instruction_s` each, once per micro-batch's forward; nothing where the machine did not
    measure it (a preset) or the module was not counted; a stage pays its share."""
    pcg = data_parallel_pcg(graph, LIB, 2)
    ops = sum(1 for n in pcg.nodes if n.kind == "op")
    calls = ModuleCalls(forward_calls=ops, backward_nodes=0, graph_nodes=ops, python_forward=20_000)
    python = replace(CPU, efficiency=replace(CPU.efficiency, python_instruction_s=50e-9))
    for microbatches in (1, 2):
        plain = simulate_pcg(pcg, LIB, python, TORCH_NATIVE.running(replace(calls, python_forward=0)),
                             microbatches=microbatches).step_s
        module = simulate_pcg(pcg, LIB, python, TORCH_NATIVE.running(calls), microbatches=microbatches).step_s
        assert module - plain == pytest.approx(microbatches * 20_000 * 50e-9, rel=1e-6)
    unmeasured = simulate_pcg(pcg, LIB, CPU, TORCH_NATIVE.running(calls)).step_s
    assert unmeasured == simulate_pcg(pcg, LIB, CPU, TORCH_NATIVE.running(replace(calls, python_forward=0))).step_s
    assert simulate_pcg(pcg, LIB, python, TORCH_NATIVE).step_s == simulate_pcg(pcg, LIB, CPU, TORCH_NATIVE).step_s
    assert replace(calls, graph_nodes=2 * ops).python_instructions(ops) == pytest.approx(10_000)   # half the graph
    assert "python_instruction_s" not in CPU.efficiency.to_dict()
    assert Machine.from_dict(python.to_dict()).efficiency == python.efficiency
    with pytest.raises(ValueError):
        ModuleCalls(1, 0, 1, python_forward=-1)


def test_a_step_s_operators_pay_the_calibrated_sequence_factor_and_its_collectives_do_not(graph):
    """`OpEfficiency.sequence_factor` (an operator among a step's other calls over the same call timed alone)
    multiplies every operator call's time, a DTensor call's extra and the module's own calls beyond its graph,
    and nothing else: the collectives keep their measured times, a Python instruction its own figure; 1 (a preset,
    an older file) prices as before and stays out of the file."""
    pcg = data_parallel_pcg(graph, LIB, 2)
    ops = sum(1 for n in pcg.nodes if n.kind == "op")
    calls = ModuleCalls(forward_calls=ops + 40, backward_nodes=30, graph_nodes=ops, python_forward=1000)
    base = replace(CPU, efficiency=replace(CPU.efficiency, python_instruction_s=50e-9, dtensor_dispatch_s=7e-6))
    slower = replace(base, efficiency=replace(base.efficiency, sequence_factor=1.5))
    assert slower.efficiency.op_time(2e-6) == pytest.approx(1.5 * base.efficiency.op_time(2e-6))
    assert slower.efficiency.dtensor_time() == pytest.approx(1.5 * 7e-6)

    def busy(machine) -> dict[str, float]:
        result = simulate_pcg(pcg, LIB, machine, TORCH_NATIVE.running(calls)).result
        names, phases = result._columns[0].names, result._columns[0].phases
        out: dict[str, float] = {}
        for name, phase, start, end in zip(names, phases, result._columns[1], result._columns[2]):
            key = "python" if "own Python" in name else phase
            out[key] = out.get(key, 0.0) + end - start
        return out

    before, after = busy(base), busy(slower)
    assert after["grad_sync"] == pytest.approx(before["grad_sync"])   # collectives as measured
    assert after["python"] == pytest.approx(before["python"]) == pytest.approx(1000 * 50e-9)
    assert after["forward"] == pytest.approx(1.5 * before["forward"])   # graph's, module's own calls (no Python)
    assert after["backward"] == pytest.approx(1.5 * before["backward"], rel=0.05)   # updates' measured points aside
    assert "sequence_factor" not in base.efficiency.to_dict()
    assert Machine.from_dict(slower.to_dict()).efficiency == slower.efficiency
    with pytest.raises(MachineError, match="sequence_factor"):
        Machine.from_dict(replace(slower, efficiency=replace(slower.efficiency, sequence_factor=0.5)).to_dict())
