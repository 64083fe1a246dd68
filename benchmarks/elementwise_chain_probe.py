"""Issue 31: elementwise arithmetic timed warm (one call repeated, as `parsat calibrate`'s memory-bound figures) and
as a step runs it (a chain of calls, each on the previous output, every output kept as a forward keeps activations),
ns per element, with the minor page faults a chained call makes with its outputs kept and freed at once.

A measurement, not a test (one thread, fp32, [rows, 512]; thread CPU time, the best of three):

    .venv/bin/python benchmarks/elementwise_chain_probe.py
"""
from __future__ import annotations

import resource
import time

import torch

WIDTH = 512
CHAIN = 64
KINDS = {"relu": lambda a, b, c: torch.relu(a), "add": lambda a, b, c: a + b, "add_bcast": lambda a, b, c: a + c,
         "mul_scalar": lambda a, b, c: a * 0.5, "add_scalar": lambda a, b, c: a + 1.0, "copy": lambda a, b, c: a.clone()}


def warm(fn, reps: int) -> float:
    start = time.thread_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - start) / reps


def chain(step, x, keep: bool) -> tuple[float, float]:
    """(seconds, minor faults) per call of CHAIN calls, each on the previous output, kept or freed."""
    kept, y = [], x
    faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time()
    for _ in range(CHAIN):
        y = step(y)
        if keep:
            kept.append(y)
    seconds = (time.thread_time() - start) / CHAIN
    return seconds, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / CHAIN


def main() -> None:
    torch.set_num_threads(1)
    for elements in (1 << 12, 1 << 14, 1 << 16, 1 << 18):
        x, y, bias = torch.randn(elements // WIDTH, WIDTH), torch.randn(elements // WIDTH, WIDTH), torch.randn(WIDTH)
        line = [f"{elements:7d}"]
        for name, fn in KINDS.items():
            for _ in range(3):
                fn(x, y, bias)
            alone = min(warm(lambda: fn(x, y, bias), max(20, int(2e7 / elements))) for _ in range(3))
            kept = min(chain(lambda a: fn(a, y, bias), x, True) for _ in range(3))
            freed = min(chain(lambda a: fn(a, y, bias), x, False) for _ in range(3))
            line.append(f"{name} {alone * 1e9 / elements:.2f}/{kept[0] * 1e9 / elements:.2f} "
                        f"({kept[1]:.0f}/{freed[1]:.0f} faults)")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
