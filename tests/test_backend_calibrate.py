"""`parsat calibrate`: the fits recover what generated the timings, and the machine file it writes loads."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from parsat.backend.calibrate import (ELEMENTWISE, FUNCTIONS, CollectiveTiming, OpTiming,  # noqa: E402
                                      fit_attention, fit_elementwise, fit_functions, fit_gemm, fit_layouts, fit_line, fit_link, fit_memory,
                                      fit_skew, fit_turn, fit_updates, gemm_shapes)
from parsat.ir.machine_profile import OpEfficiency  # noqa: E402
from parsat.cli import main  # noqa: E402
from parsat.ir.machine import Machine  # noqa: E402


def test_fit_line_recovers_intercept_and_slope():
    xs = [1.0, 10.0, 100.0, 1000.0]
    a, b = fit_line(xs, [2e-6 + 3e-9 * x for x in xs])
    assert a == pytest.approx(2e-6) and b == pytest.approx(3e-9)


def test_fit_link_recovers_latency_and_bus_bandwidth():
    timings = [CollectiveTiming("all_reduce", 4, n, 50e-6 + 1.5 * n / 2e9) for n in (1e3, 1e5, 1e7)]
    bandwidth, latency = fit_link(timings)
    assert bandwidth == pytest.approx(2e9) and latency == pytest.approx(50e-6)


def test_fit_gemm_recovers_peak_and_half_lengths():
    peak, halves = 80e9, (16.0, 0.0, 64.0)

    def seconds(m, n, k):
        return 3e-6 + 2 * m * n * k * (1 + halves[0] / m) * (1 + halves[1] / n) * (1 + halves[2] / k) / peak

    timings = [OpTiming("matmul", s, seconds(*s), 2.0 * s[0] * s[1] * s[2], 0.0) for s in gemm_shapes(512)]
    got_peak, got_halves = fit_gemm(timings)
    assert got_halves == halves and got_peak == pytest.approx(peak)


def test_fit_layouts_gives_each_transposed_layout_its_rate_against_the_forward_peak():
    """A layout timed 1.5x slower than the forward products at every shape fits a rate of 1 / 1.5 of the forward
    peak and the same half lengths; a layout not timed (an older calibration) gives no field."""
    peak, halves = 80e9, (16.0, 0.0, 64.0)

    def seconds(m, n, k, slower=1.0):
        return slower * 2 * m * n * k * (1 + halves[0] / m) * (1 + halves[1] / n) * (1 + halves[2] / k) / peak

    timings = [OpTiming(op, s, seconds(*s, slower), 2.0 * s[0] * s[1] * s[2], 0.0) for s in gemm_shapes(512)
               for op, slower in (("matmul", 1.0), ("matmul_tn", 1.5))]
    fields = fit_layouts(timings, fit_gemm([t for t in timings if t.op == "matmul"])[0])
    assert fields["gemm_tn_rate"] == pytest.approx(1 / 1.5)
    assert (fields["gemm_tn_half_m"], fields["gemm_tn_half_n"], fields["gemm_tn_half_k"]) == halves
    assert not any(k.startswith("gemm_nt") for k in fields)


def test_fit_memory_finds_the_cache_and_both_bandwidths():
    def seconds(nbytes):
        return 2e-6 + nbytes / (80e9 if nbytes <= 1 << 20 else 10e9)

    timings = [OpTiming("copy", (n,), seconds(n), 0.0, float(n)) for n in (1 << p for p in range(10, 27, 2))]
    bandwidth, _half, cache_bytes, cache_bandwidth = fit_memory(timings)
    assert bandwidth == pytest.approx(10e9, rel=0.01)
    assert cache_bandwidth == pytest.approx(80e9, rel=0.05) and cache_bytes == 1 << 20


def test_fit_skew_is_the_slope_of_wait_against_compute():
    assert fit_skew([[[0.0, 1e-4], [1e-3, 3e-4], [4e-3, 9e-4]]]) == pytest.approx(0.2)
    assert fit_skew([[[0.0, 1e-4], [0.0, 1e-4]]]) == 0.0


def test_fit_turn_is_the_plateau_of_the_excess_over_the_control():
    """wait = min(q, compute): short bursts wait their whole compute, longer ones one q; the excess measured on
    ranks with a core each (the method's own bias under load) is taken off first; never below 0."""
    q = 1.5e-3
    rows = [[c, min(q, c) + 2e-4, 2e-4] for c in (0.5e-3, 1e-3, 2e-3, 4e-3, 8e-3)]
    assert fit_turn(rows) == pytest.approx(q)
    assert fit_turn([[c, min(q, c)] for c in (0.5e-3, 4e-3, 8e-3)]) == pytest.approx(q)   # no control column
    assert fit_turn([[1e-3, -5e-4, 0.0], [4e-3, -1e-3, 0.0]]) == 0.0
    assert fit_turn([]) == 0.0


def test_fit_skew_leaves_the_turn_to_its_own_term():
    """Where ranks share cores the turn (`fit_turn`) is priced on its own: the slope is fitted to what is left."""
    rows = [[[1e-3, 0.2e-3 + 1e-3], [4e-3, 0.8e-3 + 1e-3], [8e-3, 1.6e-3 + 1e-3]]]
    assert fit_skew(rows, turn_s=1e-3) == pytest.approx(0.2)
    assert fit_skew(rows) == pytest.approx(0.2)   # a constant shift leaves the slope: only the 0-burst row differs
    assert fit_skew([[[0.0, 0.0], [2e-3, 1e-3], [4e-3, 1e-3]]], turn_s=1e-3) == pytest.approx(0.0)


def test_calibrate_writes_a_machine_the_optimizer_loads(tmp_path, capsys):
    out = tmp_path / "machine.json"
    code = main(["calibrate", "--machine", "here", "-o", str(out), "--nproc", "2", "--size", "128", "--repeats", "1",
                 "--window", "0.002", "--comm-elements", "16", "4096", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {o["op"] for o in report["ops"]} >= {"matmul", "matmul_nt", "matmul_tn", "relu", "add", "copy", "randn",
                                                "update_sgd", "update_adam"}
    assert {c["kind"] for c in report["collectives"]} >= {"all_reduce", "all_gather", "send_recv"}
    machine = Machine.load(out)
    assert machine.name == "here" and machine.devices_per_node == 2 and machine.precision == "fp64"
    assert machine.peak_flops > 0 and machine.intra_bandwidth > 0 and machine.efficiency.dispatch_s > 0
    assert machine.comm.point("all_reduce", "intra", 2) is not None
    for layout in ("nt", "tn"):   # the backward products' layouts, measured, and written to the file
        assert getattr(machine.efficiency, f"gemm_{layout}_rate") > 0
        assert machine.efficiency.layout_efficiency(layout, 64, 64, 64) > 0
    assert {kind for kind, _points in machine.efficiency.update_points} == {"sgd", "adam"}   # the optimizer's
    assert machine.efficiency.update_time("sgd", 5000) > 0
    assert {name for name, _f, _b in machine.efficiency.function_times} == set(FUNCTIONS)   # each function's rate
    assert machine.efficiency.function_time({"tanh": 1 << 16}) > 0
    assert {f"elementwise_{kind}" for kind in ELEMENTWISE} <= {o["op"] for o in report["ops"]}
    assert machine.efficiency.elementwise_time("binary", 1 << 16) > 0   # arithmetic as a step runs it, measured
    assert 0 < machine.efficiency.attention_efficiency <= 1 and {"attention_causal", "attention_causal_backward"} \
        <= {o["op"] for o in report["ops"]}   # fused attention's rate measured, not the GEMMs' peak
    assert Machine.from_dict(json.loads(out.read_text())).efficiency == machine.efficiency
    assert dict(machine.peaks).keys() == {"fp64", "fp32"}
    assert json.loads(out.read_text())["version"] == 2
    assert main(["optimize", "mlp", "--devices", "2", "--machine", str(out), "-q", "--no-baselines",
                 "--set", "batch=8", "--set", "d_in=8", "--set", "d_hidden=8", "--set", "d_out=2"]) == 0


@pytest.mark.slow
def test_calibrate_dtensor_measures_what_an_operator_on_a_dtensor_adds(tmp_path, capsys):
    """`--dtensor`: a chain of tiny layers (a linear product and an RMS norm each) on Replicate() DTensors over the
    ranks (the torch-native runtime's styled modules) against the same chain plain, the extra per ATen call
    written to the machine file; without it the fields stay 0."""
    out = tmp_path / "machine.json"
    code = main(["calibrate", "--machine", "here", "-o", str(out), "--nproc", "2", "--size", "128", "--repeats", "1",
                 "--window", "0.002", "--comm-elements", "16", "4096", "--dtype", "float32", "--dtensor"])
    assert code == 0
    efficiency = Machine.load(out).efficiency
    # differences of two timings (on a DTensor less plain; a group per layer less one group), each clamped at 0:
    # on a loaded box a difference can read 0 (helper M's suite run), so the test asserts they were measured and
    # reported, not how large they came out
    assert efficiency.dtensor_dispatch_s >= 0 and efficiency.dtensor_backward_dispatch_s >= 0
    assert efficiency.fsdp_forward_group_s >= 0 and efficiency.fsdp_hooks_time(16, backward=True) >= 0
    printed = capsys.readouterr().out
    assert "on a DTensor" in printed and "FSDP2's hooks" in printed
    assert efficiency.python_instruction_s > 0 and "per bytecode instruction" in printed   # a time over a count
    assert efficiency.sequence_factor >= 1.0 and "the same call timed alone" in printed   # measured, at least 1
    # DTensor's redistribute: host work 4-7x the plain all-reduce's on the main thread (0.35-0.6 ms a call on 2
    # gloo ranks), so its difference does not read 0 as the dispatch figures can
    assert efficiency.dtensor_all_reduce_s > 0 and "DTensor's redistribute" in printed
    assert efficiency.dtensor_all_gather_s >= 0 and efficiency.dtensor_reduce_scatter_s >= 0
    # FSDP2's gather over the ranks: 0.3-0.5 ms of host work a group beyond a one-rank axis's and the plain one's
    assert efficiency.fsdp_all_gather_s > 0 and "FSDP2's collectives over the ranks" in printed
    assert efficiency.fsdp_reduce_scatter_s >= 0 and efficiency.fsdp_all_reduce_s >= 0
    assert Machine.load(out).efficiency.sequence_factor == efficiency.sequence_factor
    assert Machine.preset("cpu").efficiency.dtensor_time() == 0.0
    assert Machine.preset("cpu").efficiency.fsdp_hooks_time(10) == 0.0


def test_calibrate_refuses_bad_sizes(capsys):
    assert main(["calibrate", "--machine", "x", "-o", "/nonexistent/m.json", "--size", "4"]) == 1
    assert "--size" in capsys.readouterr().err
    assert main(["calibrate", "--machine", "x", "-o", "/nonexistent/m.json", "--comm-elements", "64", "8"]) == 1


def test_calibrate_s_timeout_reaches_the_ranks_and_is_bounded(tmp_path, capsys, monkeypatch):
    """`--timeout` (a loaded box may need more than the default 600 s) is the launch's timeout; one out of its
    bounds is refused before any rank starts."""
    import parsat.backend.calibrate as calibrate_module

    asked = {}

    def refusing(*args, **kwargs):
        asked.update(kwargs)
        raise ValueError("stopped here")
    monkeypatch.setattr(calibrate_module, "calibrate", refusing)
    out = str(tmp_path / "m.json")
    assert main(["calibrate", "--machine", "x", "-o", out, "--timeout", "1800"]) == 1
    assert asked["timeout_s"] == 1800.0 and "stopped here" in capsys.readouterr().err
    asked.clear()
    assert main(["calibrate", "--machine", "x", "-o", out, "--timeout", "-5"]) == 1
    assert not asked and "--timeout" in capsys.readouterr().err


def test_fit_updates_keeps_each_optimizers_measured_points_never_shrinking():
    """The optimizer's timed updates become `OpEfficiency.update_points` as measured, in growing size; a larger
    update measured faster than a smaller one (noise) is read as the smaller one's time; the machine prices an
    update between two sizes on the line between them."""
    timings = [OpTiming("update_sgd", (e,), s, 0.0, 0.0) for e, s in ((4096, 2e-5), (1024, 1e-5), (65536, 1.5e-5))]
    fields = fit_updates(timings)
    assert fields == {"update_points": (("sgd", ((1024.0, 1e-5), (4096.0, 2e-5), (65536.0, 2e-5))),)}
    eff = OpEfficiency(**fields)
    assert eff.update_time("sgd", 2560) == pytest.approx(1.5e-5) and eff.update_time("adam", 2560) is None
    assert fit_updates([]) == {}


def test_fit_attention_recovers_the_rate_and_half_length_the_cost_model_prices_attention_at():
    """Timings made by the cost model's own FlashAttention pricing (forward F / (peak e / (1 + h / F)), backward
    2.5 x that, a dispatch each) give back e and h; a rate above peak is read as peak; nothing timed, no field."""
    peak, e, h, dispatch = 1e11, 0.3, 2e6, (1e-5, 2e-5)
    timings = []
    for flops in (1e6, 4e6, 3.2e7):
        kernel = flops * (1 + h / flops) / (peak * e)
        timings += [OpTiming("attention_causal", (int(flops),), dispatch[0] + kernel, flops, 0.0),
                    OpTiming("attention_causal_backward", (int(flops),), dispatch[1] + 2.5 * kernel, flops, 0.0)]
    fields = fit_attention(timings, peak, dispatch)
    assert fields["attention_efficiency"] == pytest.approx(e) and fields["attention_half_flops"] == pytest.approx(h)
    assert fit_attention(timings, peak / 10, dispatch)["attention_efficiency"] == 1.0
    assert fit_attention([], peak, dispatch) == {}


def test_fit_functions_takes_each_functions_slope_between_sizes_forward_and_backward():
    """A function's per-element time is the slope between its smallest and largest size (the dispatch is the
    intercept, left out), forward and backward apart; a noisy pair whose larger size ran faster reads 0."""
    timings = [OpTiming("function_tanh", (1024,), 12e-6, 0.0, 0.0), OpTiming("function_tanh", (5120,), 22e-6, 0.0, 0.0),
               OpTiming("function_tanh_backward", (1024,), 20e-6, 0.0, 0.0),
               OpTiming("function_tanh_backward", (5120,), 18e-6, 0.0, 0.0)]
    (name, forward, backward), = fit_functions(timings)["function_times"]
    assert name == "tanh" and forward == pytest.approx(10e-6 / 4096) and backward == 0.0
    assert fit_functions([OpTiming("relu", (1024,), 1e-6, 0.0, 1.0)]) == {}


def test_fit_elementwise_takes_each_kinds_slope_over_its_sizes():
    """Each kind's per-element time is the slope of the line through its sizes (the intercept, the dispatch, left
    out); a kind whose larger sizes ran faster (noise) reads 0, not measured; a kind timed at one size, or none,
    gives no field."""
    def rows(op, per_element, dispatch=5e-6):
        return [OpTiming(op, (n,), dispatch + n * per_element, 0.0, 0.0) for n in (4096, 16384, 65536)]

    timings = rows("elementwise_binary", 0.25e-9) + rows("elementwise_unary", 0.2e-9, 8e-6) + \
        [OpTiming("elementwise_broadcast", (n,), s, 0.0, 0.0) for n, s in ((4096, 9e-6), (65536, 7e-6))]
    fitted = fit_elementwise(timings)
    assert fitted["elementwise_binary_s"] == pytest.approx(0.25e-9)
    assert fitted["elementwise_unary_s"] == pytest.approx(0.2e-9)
    assert fitted["elementwise_broadcast_s"] == 0.0
    assert fit_elementwise(rows("elementwise_binary", 1e-9)[:1]) == {}
    assert fit_elementwise([OpTiming("add", (1024,), 1e-6, 0.0, 1.0)]) == {}
    machine = replace(Machine.preset("cpu"), efficiency=OpEfficiency(**fitted))   # the calibration's own report
    assert OpTiming("elementwise_binary", (65536,), 0.0, 0.0, 3 * 65536 * 4.0).predicted(machine) == \
        pytest.approx(max(65536 * 0.25e-9, 3 * 65536 * 4.0 / machine.efficiency.bandwidth(3 * 65536 * 4.0,
                                                                                          machine.memory_bandwidth)))


def test_sequence_calls_record_a_transformer_blocks_forward_then_its_backward():
    """`_sequence_factor`'s reference: the same calls every time (a deterministic count), products, a softmax and
    norms among them, the backward's calls after the forward's (more calls than the forward alone makes), and
    every call replays on its recorded operands (as the calibration runs them, below autograd)."""
    import torch

    from parsat.backend.calibrate import sequence_calls

    calls = sequence_calls(8, 4, torch.float32, torch.device("cpu"))
    names = [str(op) for op, _a, _k in calls]
    assert len(sequence_calls(8, 4, torch.float32, torch.device("cpu"))) == len(calls)
    assert {"aten.mm.default", "aten._softmax.default", "aten.tanh.default"} <= set(names)
    first_backward = next(i for i, name in enumerate(names) if "backward" in name)
    assert first_backward > max(i for i, name in enumerate(names) if name == "aten.tanh.default")
    assert names.count("aten.mm.default") > 2 * names[:first_backward].count("aten.mm.default")   # two per product
    with torch.no_grad():
        for op, args, kwargs in calls:
            op(*args, **kwargs)
