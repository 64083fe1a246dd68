"""Collectives as NCCL runs them: algorithms, the tuner's choice, topology, measured points, bytes sent."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest

from parsat.ir.machine import Machine
from parsat.ir.machine_profile import CollectivePoint, CommProfile
from parsat.cost.collectives import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, REDUCE_SCATTER, SEND_RECV,
                                         CollectiveError, GroupTopology, price, sent_bytes)

H100 = Machine.preset("h100x8")
PLAIN = replace(H100, comm=CommProfile())     # no launch cost, tree as fast as ring: the textbook formulas
BW = H100.intra_bandwidth                     # the in-node bus bandwidth


def test_group_topology_follows_nodes():
    assert GroupTopology.consecutive(4, 8) == GroupTopology(4, 4, 1)
    assert GroupTopology.consecutive(64, 8) == GroupTopology(64, 8, 8)
    assert GroupTopology(16, 1, 16).link == "inter" and GroupTopology(8, 8, 1).link == "intra"
    for bad in ((4, 8, 1), (8, 2, 2), (0, 1, 1)):
        with pytest.raises(CollectiveError):
            GroupTopology(*bad)


def test_ring_all_reduce_is_the_alpha_beta_formula_inside_a_node():
    n = 1 << 30
    cost = price(ALL_REDUCE, GroupTopology(8, 8, 1), n, replace(PLAIN, comm=CommProfile(tree_bandwidth_factor=0.5)))
    assert cost.algorithm == "ring"
    assert cost.seconds == pytest.approx(14 * 2e-6 + 2 * 7 / 8 * n / BW)


def test_tree_wins_small_messages_on_large_groups_and_its_latency_grows_with_log_p():
    tiny = 1024
    group = GroupTopology(64, 1, 64)
    cost = price(ALL_REDUCE, group, tiny, PLAIN)
    assert cost.algorithm == "tree"
    assert cost.seconds == pytest.approx(2 * 6 * 5e-6 + 2 * 63 / 64 * tiny / 50e9)
    bigger = price(ALL_REDUCE, GroupTopology(128, 1, 128), tiny, PLAIN)
    assert bigger.seconds - cost.seconds == pytest.approx(2 * 5e-6, rel=0.01)   # one more level


def test_hierarchical_all_reduce_across_nodes_uses_every_nic():
    n = 1 << 30
    flat_group = GroupTopology(64, 8, 8)
    cost = price(ALL_REDUCE, flat_group, n, PLAIN)
    assert cost.algorithm.startswith("hierarchical")
    inside = 2 * (7 * 2e-6 + 7 / 8 * n / BW)
    across_tree = 2 * 3 * 5e-6 + 2 * 7 / 8 * (n / 8) / 50e9   # tree as fast as ring here: its log latency wins
    assert cost.algorithm == "hierarchical/tree"
    assert cost.seconds == pytest.approx(inside + across_tree, rel=1e-6)
    flat_ring = 2 * 63 * 5e-6 + 2 * 63 / 64 * n / 50e9
    assert cost.seconds < flat_ring / 3


def test_the_tuner_takes_the_faster_of_ring_and_tree():
    import math

    f = H100.comm.tree_bandwidth_factor
    for p in (2, 4, 8):
        for n in (8, 1 << 16, 1 << 26, 1 << 32):
            ring = 2 * (p - 1) * 2e-6 + 2 * (p - 1) / p * n / BW
            tree = 2 * math.ceil(math.log2(p)) * 2e-6 + 2 * (p - 1) / p * n / (BW * f)
            cost = price(ALL_REDUCE, GroupTopology(p, p, 1), n, H100)
            assert cost.seconds == pytest.approx(H100.comm.launch_s + min(ring, tree))
            assert cost.algorithm == ("ring" if ring <= tree else "tree")


def test_gather_scatter_all_to_all_send_recv_broadcast():
    n = 1 << 24
    node = GroupTopology(8, 8, 1)
    ring = 7 * 2e-6 + 7 / 8 * n / BW
    assert price(ALL_GATHER, node, n, PLAIN).seconds == pytest.approx(ring)
    assert price(REDUCE_SCATTER, node, n, PLAIN).seconds == pytest.approx(ring)
    assert price(ALL_TO_ALL, node, n, PLAIN).seconds == pytest.approx(ring)
    two_nodes = GroupTopology(16, 8, 2)
    a2a = price(ALL_TO_ALL, two_nodes, n, PLAIN).seconds
    assert a2a == pytest.approx(15 * 5e-6 + 8 / 16 * n / 50e9)        # half of the data leaves the node
    assert price(SEND_RECV, GroupTopology(2, 2, 1), n, PLAIN).seconds == pytest.approx(2e-6 + n / BW)
    assert price(SEND_RECV, GroupTopology(2, 1, 2), n, PLAIN).seconds == pytest.approx(5e-6 + n / 50e9)
    assert price(BROADCAST, node, n, PLAIN).seconds <= 7 * 2e-6 + n / BW + 1e-12


def test_launch_cost_is_paid_once_and_one_device_moves_nothing():
    group = GroupTopology(8, 8, 1)
    launched = replace(PLAIN, comm=CommProfile(launch_s=7e-6))
    assert price(ALL_REDUCE, group, 100, launched).seconds == pytest.approx(price(ALL_REDUCE, group, 100, PLAIN).seconds
                                                                           + 7e-6)
    alone = price(ALL_REDUCE, GroupTopology(1, 1, 1), 1 << 20, launched)
    assert alone.seconds == 0 and alone.sent_bytes == 0


def test_measured_points_replace_the_model_where_they_exist():
    point = CollectivePoint(ALL_REDUCE, "intra", 4, 1e-3, 1e9)
    machine = replace(Machine.preset("cpu"), comm=CommProfile(points=(point,)))
    n = 1e6
    cost = price(ALL_REDUCE, GroupTopology.consecutive(4, machine.devices_per_node), n, machine)
    assert cost.algorithm == "measured" and cost.seconds == pytest.approx(1e-3 + 1.5 * n / 1e9)
    assert price(ALL_REDUCE, GroupTopology.consecutive(2, machine.devices_per_node), n, machine).algorithm != "measured"   # no point for 2 ranks


def test_measured_samples_price_between_neighbours_and_round_trip_through_the_file():
    """2 gloo ranks' all-reduce as timed (ms: 0.58 at 1 KB, 1.85 at 256 KB, 6.2 at 4 MB) is no line: a buffer
    between two samples is priced on their segment, not on the line fitted through all of them."""
    samples = ((1024.0, 0.58e-3), (262144.0, 1.85e-3), (4194304.0, 6.22e-3))
    point = CollectivePoint(ALL_REDUCE, "intra", 2, 0.73e-3, 0.694e9, samples)
    machine = replace(Machine.preset("cpu"), comm=CommProfile(points=(point,)))
    group = GroupTopology.consecutive(2, machine.devices_per_node)
    n = 1444352.0   # FSDP2's gradient all-reduce of llama/dp: 361,088 floats
    between = 1.85e-3 + (6.22e-3 - 1.85e-3) * (n - 262144) / (4194304 - 262144)
    assert price(ALL_REDUCE, group, n, machine).seconds == pytest.approx(between)
    assert between > CollectivePoint(ALL_REDUCE, "intra", 2, 0.73e-3, 0.694e9).seconds(n)   # the line: 2.81 ms
    assert point.seconds(262144.0) == pytest.approx(1.85e-3) and point.seconds(10.0) == pytest.approx(0.58e-3)
    assert point.seconds(8388608.0) == pytest.approx(6.22e-3 + 4194304 / 0.694e9)   # beyond: the line's rate
    assert Machine.from_dict(machine.to_dict()).comm.points == (point,)
    line_only = replace(machine, comm=CommProfile(points=(replace(point, samples=()),)))
    assert "samples" not in line_only.to_dict()["comm"]["points"][0]   # older files read and write as before
    bad = machine.to_dict()
    bad["comm"]["points"][0]["samples"] = [[1024.0, 2e-3], [512.0, 3e-3]]
    with pytest.raises(Exception, match="samples"):
        Machine.from_dict(bad)


def test_time_grows_with_bytes():
    for kind in (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, SEND_RECV, BROADCAST):
        times = [price(kind, GroupTopology(16, 8, 2), n, H100).seconds for n in (1, 1 << 10, 1 << 20, 1 << 30)]
        assert times == sorted(times) and times[-1] > times[0]


def test_unknown_collective_and_negative_bytes_are_refused():
    with pytest.raises(CollectiveError):
        price("gossip", GroupTopology(2, 2, 1), 10, H100)
    with pytest.raises(CollectiveError):
        price(ALL_REDUCE, GroupTopology(2, 2, 1), -1, H100)
    with pytest.raises(CollectiveError):
        sent_bytes("gossip", 2, 1)


def test_bytes_sent_follow_the_ring_convention_of_the_mlp_figure():
    # Data parallelism of the 784-512-10 MLP on 2 devices: 2 (784*512 + 512*10) = 813,056 gradient elements,
    # summed over both devices.
    per_device = sum(sent_bytes(ALL_REDUCE, 2, n) for n in (784 * 512, 512 * 10))
    assert 2 * per_device == 813_056
    assert sent_bytes(ALL_GATHER, 4, 400) == 300
    assert sent_bytes(SEND_RECV, 2, 123) == 123


def test_bytes_sent_agree_with_what_the_backend_counts():
    pytest.importorskip("torch")
    from parsat.backend.collectives import CommEvent

    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        for p in (2, 3, 4, 8):
            event = CommEvent("op", "forward", kind, "dp", p, 1000 * p, 4)
            assert event.sent_bytes == Fraction(sent_bytes(kind, p, 1000 * p * 4)).limit_denominator(1000)


def test_h100_in_node_collectives_run_at_nccl_s_effective_nvlink_rate():
    # NVLink 4 is 450 GB/s each way; NCCL reaches ~370 GB/s of bus bandwidth on an 8-GPU all-gather or
    # reduce-scatter (its protocol's ~20%, NVIDIA/nccl-tests#212); the preset once said 267 GB/s, NVLS all-reduce's
    # algorithm bandwidth. Bus bandwidth as nccl-tests computes it from a large collective's time:
    n = 8 << 30
    for collective in (ALL_GATHER, REDUCE_SCATTER):
        seconds = price(collective, GroupTopology(8, 8, 1), n, H100).seconds
        assert 7 / 8 * n / seconds == pytest.approx(370e9, rel=0.01)
    ring = price(ALL_REDUCE, GroupTopology(8, 8, 1), n, H100).seconds
    assert 2 * 7 / 8 * n / ring == pytest.approx(370e9, rel=0.01)


def test_a_machine_file_says_whether_the_gradient_reduction_overlaps_backward():
    """`comm.overlap_grad_reduce`: written only where off (files of before read and write as they were), read
    back, and anything but true or false refused."""
    from parsat.ir.errors import MachineError
    after = replace(H100, comm=replace(H100.comm, overlap_grad_reduce=False))
    assert "overlap_grad_reduce" not in H100.to_dict()["comm"]
    assert after.to_dict()["comm"]["overlap_grad_reduce"] is False
    assert Machine.from_dict(after.to_dict()) == after and Machine.from_dict(H100.to_dict()) == H100
    bad = after.to_dict()
    bad["comm"]["overlap_grad_reduce"] = 0
    with pytest.raises(MachineError, match="overlap_grad_reduce"):
        Machine.from_dict(bad)
