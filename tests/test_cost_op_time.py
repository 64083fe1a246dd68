"""Per-operator time: the product inside an operator, GEMM and bandwidth efficiency, dispatch cost."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.dsl.library import load_library, shipped_rules_dir
from parsat.dsl.work import contraction
from parsat.ir.graph import instance_for
from parsat.ir.machine import Machine
from parsat.ir.machine_profile import OpEfficiency
from parsat.ir.pcg import Degrees
from parsat.cost.model import compute_cost
from parsat.cost.op_time import kernel_time, local_gemm, memory_op_time

OPS = load_library([shipped_rules_dir() / "ops.rule"])[0].ops


def _instance(op, shapes, **attrs):
    return instance_for(OPS[op], shapes, attrs)


@pytest.mark.parametrize("op, shapes, attrs, dims", [
    ("matmul", ((4, 5), (5, 6)), {}, ((), ("i",), ("j",), ("l",))),
    ("bmm", ((2, 3, 4, 5), (2, 3, 5, 6)), {}, (("i#0", "i#1"), ("r",), ("j",), ("l",))),
    ("linear", ((2, 7, 5), (5, 6), (6,)), {}, ((), ("i#0", "i#1"), ("j",), ("l",))),
    ("conv2d", ((4, 16, 8, 8), (32, 16, 3, 3)), {"stride": 1, "pad": 1},
     ((), ("b", "y", "z"), ("f",), ("ci", "dy", "dx"))),
    ("softmax", ((3, 4),), {"dim": 1}, None),
    ("layernorm", ((3, 4), (4,), (4,)), {"eps": 1e-5}, None),
    ("relu", ((3, 4),), {}, None),
])
def test_the_product_inside_an_operator(op, shapes, attrs, dims):
    assert contraction(_instance(op, shapes, **attrs)) == dims


def test_local_gemm_divides_each_index_by_its_degree_and_folds_batch_into_rows():
    inst = _instance("bmm", ((2, 3, 4, 5), (2, 3, 5, 6)))
    assert local_gemm(inst, {}) == (24.0, 6.0, 5.0)
    assert local_gemm(inst, {"i#0": 2, "l": 5}) == (12.0, 6.0, 1.0)
    assert local_gemm(_instance("relu", ((3, 4),)), {}) is None


def test_small_gemms_do_not_reach_peak():
    machine = replace(Machine.preset("cpu"), efficiency=OpEfficiency(gemm_half_m=64, gemm_half_n=64, gemm_half_k=64))
    big = kernel_time(2 * 1024 ** 3, 0, (1024, 1024, 1024), machine) / (2 * 1024 ** 3)
    small = kernel_time(2 * 16 ** 3, 0, (16, 16, 16), machine) / (2 * 16 ** 3)
    skinny = kernel_time(2 * 1024 * 1024 * 8, 0, (1024, 1024, 8), machine) / (2 * 1024 * 1024 * 8)
    assert small / big == pytest.approx(125 / (1 + 64 / 1024) ** 3)    # (1 + 64/16)^3 = 125
    assert big < skinny < small
    plain = kernel_time(2 * 16 ** 3, 0, (16, 16, 16), Machine.preset("cpu"))
    assert plain == pytest.approx(2 * 16 ** 3 / 100e9)                  # no efficiency: the roofline


def test_dispatch_cost_adds_on_cpu_and_hides_behind_kernels_on_gpu():
    eff = OpEfficiency(dispatch_s=5e-6, backward_dispatch_s=7e-6)
    assert eff.op_time(1e-6) == pytest.approx(6e-6)
    assert eff.op_time(1e-6, backward=True) == pytest.approx(8e-6)
    gpu = replace(eff, async_dispatch=True)
    assert gpu.op_time(1e-6) == 5e-6 and gpu.op_time(1e-3) == 1e-3


def test_cache_tier_and_small_transfer_efficiency():
    eff = OpEfficiency(memory_half_bytes=1000, cache_bytes=1 << 20, cache_bandwidth=100e9)
    machine = replace(Machine.preset("cpu"), efficiency=eff)
    in_cache = memory_op_time(1 << 20, machine)
    in_memory = memory_op_time(1 << 21, machine)
    assert in_cache == pytest.approx((1 << 20) / 100e9 * (1 + 1000 / (1 << 20)))
    assert in_memory == pytest.approx((1 << 21) / 20e9 * (1 + 1000 / (1 << 21)))
    assert eff.memory_efficiency(1000) == 0.5


def test_compute_cost_keeps_its_conventions_with_efficiency():
    inst = _instance("matmul", ((128, 784), (784, 512)))
    whole = Degrees((1, 1))
    machine = Machine.preset("cpu")
    cost = compute_cost(inst, [whole, whole], whole, machine, [False, True])
    assert cost.backward_s == pytest.approx(2 * cost.forward_s)
    assert cost.flops == 2 * 128 * 784 * 512
    assert cost.memory_bytes == 128 * 512 * 4 + 784 * 512 * 16           # activation + 16 bytes per weight element
    slow = replace(machine, efficiency=OpEfficiency(dispatch_s=1e-3))
    assert compute_cost(inst, [whole, whole], whole, slow, [False, True]).forward_s == pytest.approx(
        cost.forward_s + 1e-3)
