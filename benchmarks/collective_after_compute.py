"""Issue 31's probe: is a gloo collective slower when it follows compute than back to back, as calibrate times it?

On 2 ranks: an all-gather and an all-reduce of the sizes FSDP2 and DDP issue in the fidelity benchmark's steps,
timed (a) back to back, as `parsat calibrate` times its table; (b) right after ~2 ms of matrix products on every
rank, from the issue to the end of its wait (FSDP2's pattern: compute, then a collective waited on); (c) as (b)
with a 1-element all-reduce first (helper B, session 59: it shortened llama/dp's step by 1.6 ms). Medians in ms
per rank. A measurement, not a test: the box's load moves every figure.

    PYTHONPATH=. .venv/bin/python benchmarks/collective_after_compute.py [REPEATS]
"""
from __future__ import annotations

import statistics
import sys
import time

SIZES = (65_536, 361_088)   # floats: a block's all-gather in the benchmark's ZeRO-3 plans; llama/dp's gradients


def probe(ctx, repeats: int) -> dict:
    """This rank's medians (ms) per (mode, collective, size)."""
    import torch
    import torch.distributed as dist

    a = torch.randn(256, 256)
    one = torch.zeros(1)

    def compute() -> None:   # ~2 ms of products, the result used so nothing is skipped
        x = a
        for _ in range(12):
            x = torch.tanh(x @ a)
        one.add_(x[0, 0] * 0)

    out = {}
    for size in SIZES:
        piece = torch.randn(size // ctx.world)
        gathered = torch.empty(size)
        flat = torch.randn(size)
        ops = {"all_gather": lambda: dist.all_gather_into_tensor(gathered, piece),
               "all_reduce": lambda: dist.all_reduce(flat)}
        for name, op in ops.items():
            for mode in ("back to back", "after compute", "after compute, 1-element all-reduce first"):
                times = []
                for _ in range(repeats):
                    if mode != "back to back":
                        dist.barrier()
                        compute()
                        if mode.endswith("first"):
                            dist.all_reduce(one)
                    t0 = time.perf_counter()
                    op()
                    times.append(time.perf_counter() - t0)
                out[f"{mode} | {name} | {size}"] = 1e3 * statistics.median(times[1:])
    return out


def main(argv: list[str]) -> None:
    from parsat.backend.launch import LaunchConfig, launch

    repeats = int(argv[0]) if argv else 40
    results = launch(probe, (repeats,), LaunchConfig(nproc=2, backend="gloo", timeout_s=600))
    print("| mode | collective | floats | rank 0 ms | rank 1 ms |\n|---|---|---|---|---|")
    for key in results[0]:
        mode, name, size = key.split(" | ")
        print(f"| {mode} | {name} | {int(size):,} | {results[0][key]:.3f} | {results[1][key]:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
