"""How long one compute operator takes on its local pieces: roofline with efficiency and dispatch cost.

The work is the operator's own (`dsl.work`: FLOPs and elements from its
index semantics), divided among devices by the degree spread inference
gives every index variable. Then, with `machine.efficiency`
(`ir.machine_profile.OpEfficiency`, measured by `parsat calibrate`):

    kernel = max(FLOPs / (peak x gemm_efficiency(m, n, k)),
                 bytes / bandwidth(bytes))

where (m, n, k) is the local shape of the operator's matrix product
(`dsl.work.contraction`; batch dims count as rows) and an operator without
one runs at peak FLOP/s (it is memory-bound anyway). Backward does two
products per product: 2 x the forward kernel. Each call adds the fixed
dispatch cost (`OpEfficiency.op_time`: in sequence on CPU, hidden behind
longer kernels on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Mapping

from parsat.dsl.instantiate import OpInstance, index_bounds
from parsat.dsl.work import contraction, work
from parsat.ir.machine import Machine

BACKWARD_FACTOR = 2.0        # backward FLOPs and bytes = 2 x forward (two products per product)


@dataclass(frozen=True)
class OpTime:
    """One operator on one device's pieces: times (seconds) and the local work they come from."""

    forward_s: float
    backward_s: float
    kernel_s: float          # the forward kernel alone (no dispatch cost)
    flops: float             # local forward FLOPs
    nbytes: float            # local forward bytes touched
    gemm: tuple[float, float, float] | None = None   # local (m, n, k) of its product, if any


def _degree(value) -> int:
    return int(value.evaluate({})) if hasattr(value, "evaluate") else int(value)


def local_gemm(instance: OpInstance, var_degrees: Mapping[str, object]) -> tuple[float, float, float] | None:
    """The local (m, n, k) of the operator's product: each index range divided by its degree; batch into m."""
    dims = contraction(instance)
    if dims is None:
        return None
    bounds = {k: int(v.evaluate({})) for k, v in index_bounds(instance).items()}

    def size(names) -> float:
        return float(prod(bounds[v] / max(1, _degree(var_degrees.get(v, 1))) for v in names))

    batch, m, n, k = dims
    return size(batch) * size(m), size(n), size(k)


def kernel_time(flops: float, nbytes: float, gemm: tuple[float, float, float] | None, machine: Machine) -> float:
    """The roofline of one kernel with the machine's GEMM and bandwidth efficiency."""
    eff = machine.efficiency
    rate = machine.peak_flops * (eff.gemm_efficiency(*gemm) if gemm is not None else 1.0)
    return max(flops / rate, nbytes / eff.bandwidth(nbytes, machine.memory_bandwidth))


def op_time(instance: OpInstance, var_degrees: Mapping[str, object], local_elements: int, machine: Machine) -> OpTime:
    """Forward and backward time of `instance` on local pieces of `local_elements` elements in all."""
    flops, _ = work(instance)
    split = prod(_degree(d) for d in var_degrees.values()) or 1
    local_flops = flops / split
    nbytes = float(local_elements * machine.dtype_bytes)
    gemm = local_gemm(instance, var_degrees)
    kernel = kernel_time(local_flops, nbytes, gemm, machine)
    eff = machine.efficiency
    return OpTime(eff.op_time(kernel), eff.op_time(BACKWARD_FACTOR * kernel, backward=True), kernel, local_flops,
                  nbytes, gemm)


def memory_op_time(nbytes: float, machine: Machine, backward: bool = False) -> float:
    """A memory-bound copy (a slice made contiguous, a concatenation, an optimizer update) of `nbytes`."""
    eff = machine.efficiency
    return eff.op_time(nbytes / eff.bandwidth(nbytes, machine.memory_bandwidth), backward)


__all__ = ["BACKWARD_FACTOR", "OpTime", "kernel_time", "local_gemm", "memory_op_time", "op_time"]
