"""`parsat calibrate --machine NAME -o machine.json`: measure this machine for the cost model.

The cost model (saturate/cost.py) prices a compute operator by a roofline,
max(FLOPs / peak_flops, bytes / memory_bandwidth), with FLOPs and elements
taken from the operator's index semantics (`dsl.work`), and a collective
by alpha-beta (ring all-reduce 2(p-1) alpha + 2(p-1)/p n bytes / bw). So
calibration measures exactly those parameters, through the same formulas:

* the library's main operators are timed with their torch implementations
  (`torch_ops`), and `peak_flops` / `memory_bandwidth` are the best rates
  any of them reached (the roofline's ceilings);
* all-reduces of a small and a large tensor are timed on `nproc` ranks
  (gloo on CPU, nccl on CUDA) and the two points give alpha and bw; an
  all-gather is timed too, to show how well the fitted line predicts it.

The result is a `ir.machine.Machine` written with its own `save`, so
`parsat optimize --machine machine.json` loads it. One node is measured:
the inter-node link is set to the intra-node one (there is nothing else to
measure here), which matters only for plans larger than `nproc` devices.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from parsat.backend.launch import LaunchConfig, RankContext, launch
from parsat.backend.torch_ops import apply_op
from parsat.dsl.work import work
from parsat.ir.graph import instance_for
from parsat.ir.machine import Machine

DTYPE = torch.float32  # the cost model's default training precision (dtype_bytes = 4)


@dataclass(frozen=True)
class OpTiming:
    """One operator at one size: the median time and its work by the cost model's count."""

    op: str
    shapes: tuple[tuple[int, ...], ...]
    seconds: float
    flops: int
    elements: int

    def predicted(self, machine: Machine) -> float:
        """The roofline time `machine` gives this call (as saturate/cost.py computes it)."""
        return max(self.flops / machine.peak_flops, self.elements * machine.dtype_bytes / machine.memory_bandwidth)


@dataclass(frozen=True)
class CollectiveTiming:
    """One collective over `ranks` ranks of a tensor of `elements` elements (the result, for all-gather)."""

    kind: str
    ranks: int
    elements: int
    seconds: float

    def predicted(self, machine: Machine) -> float:
        bw, alpha = machine.link(self.ranks)
        p, nbytes = self.ranks, self.elements * machine.dtype_bytes
        if self.kind == "all_reduce":
            return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / bw
        return (p - 1) * alpha + (p - 1) / p * nbytes / bw


@dataclass(frozen=True)
class Calibration:
    machine: Machine
    ops: tuple[OpTiming, ...]
    collectives: tuple[CollectiveTiming, ...]
    device: str

    def to_dict(self) -> dict:
        return {"machine": self.machine.to_dict(), "device": self.device,
                "ops": [{"op": t.op, "shapes": [list(s) for s in t.shapes], "seconds": t.seconds, "flops": t.flops,
                         "elements": t.elements, "predicted_s": t.predicted(self.machine)} for t in self.ops],
                "collectives": [{"kind": c.kind, "ranks": c.ranks, "elements": c.elements, "seconds": c.seconds,
                                 "predicted_s": c.predicted(self.machine)} for c in self.collectives]}


def op_cases(size: int) -> list[tuple[str, tuple[tuple[int, ...], ...], dict]]:
    """The operators timed, at sizes scaled by `size` (compute-bound products and memory-bound maps)."""
    n = size
    return [
        ("matmul", ((n, n), (n, n)), {}),
        ("bmm", ((8, n // 2, n // 2), (8, n // 2, n // 2)), {}),
        ("linear", ((4, n // 2, n), (n, n), (n,)), {}),
        ("conv2d", ((4, 16, n // 8, n // 8), (32, 16, 3, 3)), {"stride": 1, "pad": 1}),
        ("relu", ((4 * n, n),), {}),
        ("gelu", ((4 * n, n),), {}),
        ("add", ((4 * n, n), (4 * n, n)), {}),
        ("softmax", ((4 * n, n),), {"dim": 1}),
        ("layernorm", ((4 * n, n), (n,), (n,)), {"eps": 1e-5}),
    ]


def _median_time(fn, repeats: int, sync) -> float:
    fn()
    fn()  # warm-up: first calls allocate and pick kernels
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_ops(device: torch.device, size: int, repeats: int, library) -> list[OpTiming]:
    """Each case of `op_cases` timed on `device` (forward only: the cost model takes backward as 2x)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    out = []
    for op, shapes, attrs in op_cases(size):
        tensors = [torch.randn(*s, generator=gen, dtype=DTYPE).to(device) for s in shapes]
        seconds = _median_time(lambda: apply_op(op, tensors, attrs), repeats, sync)
        flops, elements = work(instance_for(library.ops[op], shapes, attrs))
        out.append(OpTiming(op, shapes, seconds, flops, elements))
    return out


def _collective_rank(ctx: RankContext, sizes: Sequence[int], repeats: int) -> list[list]:
    """On every rank: median times of all-reduce and all-gather per size, the slowest rank's."""
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
    rows = []
    for n in sizes:
        x = torch.ones(n, dtype=DTYPE, device=ctx.device)
        piece = torch.ones(max(1, n // ctx.world), dtype=DTYPE, device=ctx.device)
        parts = [torch.empty_like(piece) for _ in range(ctx.world)]

        def all_reduce() -> None:
            dist.all_reduce(x)

        def all_gather() -> None:
            dist.all_gather(parts, piece)

        for kind, fn, elements in (("all_reduce", all_reduce, n), ("all_gather", all_gather, piece.numel() * ctx.world)):
            dist.barrier()
            seconds = torch.tensor([_median_time(fn, repeats, sync)], dtype=torch.float64, device=ctx.device)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            rows.append([kind, ctx.world, elements, float(seconds)])
    return rows


def fit_link(small: CollectiveTiming, large: CollectiveTiming, dtype_bytes: int) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of the ring all-reduce line through two all-reduce timings."""
    p = small.ranks
    factor = 2 * (p - 1) / p * dtype_bytes
    slope = (large.seconds - small.seconds) / (factor * (large.elements - small.elements))
    bandwidth = 1.0 / slope if slope > 0 else factor * large.elements / large.seconds
    latency = max((small.seconds - factor * small.elements / bandwidth) / (2 * (p - 1)), 1e-7)
    return bandwidth, latency


def calibrate(name: str, nproc: int = 2, size: int = 512, repeats: int = 5, backend: str | None = None,
              collective_sizes: tuple[int, int] = (1024, 1 << 20), timeout_s: float = 300.0) -> Calibration:
    """Measure this machine: operators on one device, collectives on `nproc` ranks."""
    from parsat.backend.executor import operator_library

    if nproc < 2:
        raise ValueError("calibrating collectives needs --nproc 2 or more")
    config = LaunchConfig(nproc=nproc, backend=backend, timeout_s=timeout_s)
    cuda = config.resolved_backend() == "nccl"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    ops = time_ops(device, size, repeats, operator_library())
    rows = launch(_collective_rank, (list(collective_sizes), repeats), config)[0]
    collectives = tuple(CollectiveTiming(kind, ranks, elements, seconds) for kind, ranks, elements, seconds in rows)
    reduces = sorted((c for c in collectives if c.kind == "all_reduce"), key=lambda c: c.elements)
    bandwidth, latency = fit_link(reduces[0], reduces[-1], 4)
    peak = max(t.flops / t.seconds for t in ops)
    memory_bw = max(t.elements * 4 / t.seconds for t in ops)
    if cuda:
        capacity = float(torch.cuda.get_device_properties(0).total_memory)
        label = torch.cuda.get_device_name(0)
    else:
        capacity = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / nproc
        label = f"cpu ({os.cpu_count()} cores, {nproc} ranks)"
    machine = Machine(name, nproc, 1, peak_flops=peak, memory_bandwidth=memory_bw, memory_capacity=capacity,
                      intra_bandwidth=bandwidth, intra_latency=latency, inter_bandwidth=bandwidth,
                      inter_latency=latency, dtype_bytes=4)
    return Calibration(machine, tuple(ops), collectives, label)


def report(cal: Calibration) -> str:
    """The measurements next to what the calibrated machine predicts for them."""
    m = cal.machine
    lines = [f"machine '{m.name}' on {cal.device}: peak {m.peak_flops / 1e9:.1f} GFLOP/s, memory "
             f"{m.memory_bandwidth / 1e9:.1f} GB/s, link {m.intra_bandwidth / 1e9:.2f} GB/s + "
             f"{m.intra_latency * 1e6:.1f} us per step, {m.devices_per_node} devices",
             f"  {'operator':<10} {'shapes':<36} {'measured':>11} {'model':>11}"]
    for t in cal.ops:
        shapes = " ".join("x".join(str(d) for d in s) for s in t.shapes)
        lines.append(f"  {t.op:<10} {shapes:<36} {t.seconds * 1e3:>8.3f} ms {t.predicted(m) * 1e3:>8.3f} ms")
    for c in cal.collectives:
        lines.append(f"  {c.kind:<10} {f'{c.ranks} ranks, {c.elements} elements':<36} {c.seconds * 1e3:>8.3f} ms "
                     f"{c.predicted(m) * 1e3:>8.3f} ms")
    return "\n".join(lines)


__all__ = ["Calibration", "CollectiveTiming", "OpTiming", "calibrate", "fit_link", "op_cases", "report"]
