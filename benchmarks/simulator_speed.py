"""How fast the step simulator is, and what it says about data parallelism at scale.

    .venv/bin/python benchmarks/simulator_speed.py

1. The engine alone on synthetic steps (a layered forward/backward on a
   compute stream, one all-reduce per layer on a communication stream,
   memory effects on every task): CPU seconds per simulation.
2. BERT-Large (24 encoder blocks, hidden 1024, seq 512) at batch 256,
   data-parallel on 8 and 64 h100x8 devices, priced as PyTorch DDP runs it
   (`cost.pcg_tasks.DDP`: 25 MiB buckets overlapping backward, NCCL
   collectives with hierarchical all-reduce across nodes, bf16): the step
   time, its critical path by phase, the overlap, and the per-node sum the
   extraction model gives (no overlap, one all-reduce per weight);
   and the time to build the tasks and simulate them.
"""

from __future__ import annotations

import statistics
import time

from parsat.dsl.library import load_library, shipped_rules_dir
from parsat.ir.costs import totals
from parsat.ir.data_parallel import data_parallel_pcg
from parsat.ir.machine import Machine
from parsat.ir.models import stack
from parsat.search.baselines import price_pcg
from parsat.cost.pcg_tasks import DDP, OpTimes, simulate_pcg
from parsat.cost.simulator import COMM, COMPUTE, StepBuilder


def synthetic(layers: int) -> StepBuilder:
    """Forward and backward of `layers` layers, 4 compute tasks each per pass, one all-reduce per layer."""
    b = StepBuilder()
    compute, comm = b.stream(0, COMPUTE), b.stream(0, COMM)
    prev = None
    for i in range(layers):
        for j in range(4):
            prev = b.add(f"f{i}.{j}", compute, 1e-4, [prev] if prev is not None else [], alloc=1 << 20)
    for i in range(layers):
        for j in range(4):
            prev = b.add(f"b{i}.{j}", compute, 2e-4, [prev], free=1 << 20)
        b.add(f"ar{i}", comm, 3e-4, [prev])
    return b


def cpu_seconds(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    print("engine alone (median CPU seconds of one simulate()):")
    for layers in (100, 333, 1000):
        builder = synthetic(layers)
        seconds = cpu_seconds(builder.simulate)
        print(f"  {len(builder):>6,} tasks: {seconds * 1e3:7.2f} ms")
    library = load_library([shipped_rules_dir() / "ops.rule"])[0]
    graph = stack(24, batch=256, seq=512, hidden=1024, heads=16, ffn=4096, library=library)
    print("\nBERT-Large, batch 256, data parallel, h100x8, bf16, as DDP runs it:")
    results = {}
    for n in (8, 64):
        machine = Machine.preset("h100x8").with_devices(n)
        pcg = data_parallel_pcg(graph, library, n, machine.devices_per_node)
        times = OpTimes(library, machine)
        first = time.process_time()
        step = simulate_pcg(pcg, library, machine, DDP, times=times)
        cold = time.process_time() - first
        warm = cpu_seconds(lambda: simulate_pcg(pcg, library, machine, DDP, times=times), 5)
        per_node = totals(price_pcg(pcg, library, machine), machine).time_s
        r = step.result
        results[n] = r.step_s
        phases = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in r.critical_breakdown().items())
        print(f"  {n:>2} devices: step {r.step_s * 1e3:7.2f} ms (per-node sum {per_node * 1e3:7.2f} ms); "
              f"compute busy {r.busy_s['0:compute'] * 1e3:.2f} ms, communication busy "
              f"{r.busy_s['0:comm'] * 1e3:.2f} ms, "
              f"overlap {r.overlap_s[0] * 1e3:.2f} ms; peak {step.peak_memory_bytes / 2**30:.1f} GiB")
        print(f"      critical path (ms): {phases}")
        print(f"      {len(r.spans):,} tasks: built and simulated in {cold:.3f} s CPU cold, {warm * 1e3:.1f} ms "
              f"with the compute times cached")
    print(f"  64 devices / 8 devices: {results[64] / results[8]:.2f}")


if __name__ == "__main__":
    main()
