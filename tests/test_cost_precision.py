"""Mixed precision and the machine file version 2: bytes per parameter, ZeRO, peaks, old files still read."""

from __future__ import annotations

import json

import pytest

from parsat.ir.errors import MachineError
from parsat.ir.machine import Machine
from parsat.ir.machine_profile import CollectivePoint, CommProfile, OpEfficiency, bus_factor
from parsat.ir.precision import PrecisionError, bytes_per_parameter, precision


def test_bytes_per_parameter_with_adam():
    assert bytes_per_parameter("bf16") == 16          # 2 weight + 2 grad + 4 master + 8 moments (ZeRO paper)
    assert bytes_per_parameter("fp32") == 16          # 4 + 4 + 8, no master copy
    assert precision("bf16").with_fp32_gradients().parameter_bytes("adam").total == 18   # Megatron-LM
    assert bytes_per_parameter("bf16", "sgd") == 8
    assert bytes_per_parameter("fp64", "sgd") == 16


@pytest.mark.parametrize("stage, expected", [(0, 16), (1, 2 + 2 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)])
def test_zero_stages_shard_state_then_gradients_then_weights(stage, expected):
    assert bytes_per_parameter("bf16", "adam", stage, 8) == pytest.approx(expected)


def test_zero_over_one_rank_changes_nothing_and_bad_input_is_refused():
    assert bytes_per_parameter("bf16", "adam", 3, 1) == 16
    with pytest.raises(PrecisionError):
        bytes_per_parameter("bf16", "adam", 4, 8)
    with pytest.raises(PrecisionError):
        bytes_per_parameter("int3")
    with pytest.raises(PrecisionError):
        bytes_per_parameter("bf16", "lion")


def test_adam_update_traffic_is_28_bytes_in_both_precisions():
    assert precision("fp32").optimizer_traffic_bytes() == 28
    assert precision("bf16").optimizer_traffic_bytes() == 28
    assert precision("fp32").optimizer_traffic_bytes("sgd") == 12


def test_gpu_presets_train_in_bf16_and_switch_to_tf32():
    h100 = Machine.preset("h100x8")
    assert h100.precision == "bf16" and h100.dtype_bytes == 2 and h100.peak_flops == 989e12
    tf32 = h100.with_precision("fp32")
    assert tf32.dtype_bytes == 4 and tf32.peak_flops == pytest.approx(989e12 / 2)
    assert Machine.preset("a100x8").peak_flops == 312e12
    assert h100.with_precision(None) is h100
    with pytest.raises(MachineError, match="no peak for fp64"):
        h100.with_precision("fp64")
    with pytest.raises(MachineError, match="unknown precision"):
        h100.with_precision("fp8")


def test_machine_file_round_trip_keeps_the_profile(tmp_path):
    machine = Machine.preset("h100x8")
    machine = Machine("custom", 4, 2, 1e12, 1e11, 1e9, 1e10, 1e-6, 1e9, 1e-5, precision="fp32",
                      peaks=(("fp32", 1e12), ("bf16", 2e12)),
                      efficiency=OpEfficiency(dispatch_s=1e-5, gemm_half_m=64, cache_bytes=1e6, cache_bandwidth=1e12),
                      comm=CommProfile(launch_s=2e-6, sync_skew=0.1, turn_s=2e-3,
                                       points=(CollectivePoint("all_reduce", "intra", 4, 1e-5, 1e10),)))
    path = tmp_path / "m.json"
    machine.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 2 and data["dtype_bytes"] == 4 and data["peaks"] == {"bf16": 2e12, "fp32": 1e12}
    assert Machine.load(path) == machine


def test_version_1_machine_files_still_load(tmp_path):
    old = {"schema": "parsat.machine", "version": 1, "name": "old", "devices_per_node": 2, "nodes": 1,
           "peak_flops": 1e10, "memory_bandwidth": 1e10, "memory_capacity": 1e9, "intra_bandwidth": 1e9,
           "intra_latency": 1e-5, "inter_bandwidth": 1e9, "inter_latency": 1e-5, "dtype_bytes": 8}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    machine = Machine.load(path)
    assert machine.precision == "fp64" and machine.dtype_bytes == 8
    assert machine.efficiency == OpEfficiency() and machine.comm == CommProfile()
    path.write_text(json.dumps({**old, "dtype_bytes": 3}))
    with pytest.raises(MachineError, match="dtype_bytes must be one of"):
        Machine.load(path)


@pytest.mark.parametrize("change, message", [
    ({"precision": "fp8"}, "unknown precision"),
    ({"precision": "bf16", "dtype_bytes": 4}, "contradicts"),
    ({"peaks": {"fp32": -1}}, "peaks"),
    ({"efficiency": {"dispatch_s": -1}}, "dispatch_s"),
    ({"efficiency": {"warp_speed": 1}}, "unknown field"),
    ({"efficiency": {"async_dispatch": "yes"}}, "async_dispatch"),
    ({"comm": {"tree_bandwidth_factor": 2}}, "tree_bandwidth_factor"),
    ({"comm": {"bucket_bytes": 0}}, "bucket_bytes"),
    ({"comm": {"points": [{"collective": "gossip", "link": "intra", "group": 2, "latency_s": 0,
                           "bus_bandwidth": 1}]}}, "collective"),
    ({"comm": {"points": [{"collective": "all_reduce", "link": "intra", "group": 1, "latency_s": 0,
                           "bus_bandwidth": 1}]}}, "group"),
    ({"version": 9}, "version 9"),
    # every profile number is held to parsat/ir/validate.py's ranges, as the flat fields are
    ({"comm": {"launch_s": 1e9}}, r"comm.launch_s: 1000000000.0 is outside the range"),
    ({"comm": {"sync_skew": -0.5}}, "sync_skew"),
    ({"comm": {"turn_s": -1e-3}}, r"comm.turn_s: -0.001 is outside the range"),
    ({"comm": {"bucket_bytes": 2.5}}, "bucket_bytes: must be an integer"),
    ({"efficiency": {"cache_bandwidth": 1e30}}, "cache_bandwidth"),
    ({"peaks": {"bf16": 1e30}}, r"peaks.bf16: 1e\+30 is outside the range"),
    ({"comm": {"points": [{"collective": "all_reduce", "link": "intra", "group": 2, "latency_s": 0,
                           "bus_bandwidth": 1e30}]}}, r"points\[0\].bus_bandwidth"),
    ({"comm": {"points": [{"collective": "all_reduce", "link": "intra", "group": 2, "latency_s": 0,
                           "bus_bandwidth": 1, "colour": "red"}]}}, "unknown field"),
])
def test_bad_machine_files_are_refused_with_a_message(change, message):
    data = Machine.preset("cpu").to_dict()
    data.update(change)
    with pytest.raises(MachineError, match=message):
        Machine.from_dict(data)


def test_bus_factor_is_nccl_tests_definition():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 4) == pytest.approx(3 / 4)
    assert bus_factor("send_recv", 2) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0
