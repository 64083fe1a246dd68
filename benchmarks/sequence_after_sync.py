"""Issue 31: does calibrate's sequence factor change when each in-order run follows a synchronisation, as a step's
compute does?

`parsat calibrate` measures `OpEfficiency.sequence_factor` as its reference's calls (`calibrate.sequence_calls`, two
transformer blocks' forward and backward ATen calls) run in order again and again, back to back, over each call
timed alone (thread CPU time). A step's compute never runs back to back: it follows a barrier or a collective, where
the rank waited (on this VM, with haltpoll's `guest_halt_poll_ns` 0, a wait with nothing else to run halts the
virtual CPU). This times the in-order side four ways on every rank at once, interleaved over ROUNDS rounds: back to
back (calibrate's way), each run right after a barrier, right after a 2 ms sleep and a barrier (the rank idle, as
a rank waiting for a slow peer), right after a 2 ms spin and a barrier (the same time, busy); the alone side as
calibrate times it; the factor per variant at calibrate's two sizes and their geometric mean (the slowest rank's,
as calibrate keeps it), and the box's idle-state entries over each variant. A measurement, not a test.

    PYTHONPATH=. .venv/bin/python benchmarks/sequence_after_sync.py NPROC [ROUNDS] [SIZE]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from costmodel_fidelity_split import idle_entries  # noqa: E402  (the box's idle entries, one reader)

RUNS = 20   # in-order runs timed per variant and size (a fixed count: every rank makes the same barriers)
PAUSE_S = 0.002


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def rank_fn(ctx, rounds: int, size: int) -> list:
    import torch
    import torch.distributed as dist
    from parsat.backend import calibrate as C

    clock = time.thread_time
    variants = {"back to back": lambda: None, "after a barrier": dist.barrier,
                "after a 2 ms sleep, barrier": lambda: (time.sleep(PAUSE_S), dist.barrier()),
                "after a 2 ms spin, barrier": lambda: (_spin(PAUSE_S), dist.barrier())}
    references = []
    for tokens in (size // 2, size):
        features = max(C.SEQUENCE_HEADS, tokens // (2 * C.SEQUENCE_HEADS) * C.SEQUENCE_HEADS)
        references.append(C.sequence_calls(tokens, features, torch.float32, ctx.device))

    def in_order(calls) -> None:
        for op, args, kwargs in calls:
            op(*args, **kwargs)

    def alone(calls) -> float:
        total = 0.0
        for op, args, kwargs in calls:
            op(*args, **kwargs)
            start = clock()
            for _ in range(C.SEQUENCE_REPEATS):
                op(*args, **kwargs)
            total += (clock() - start) / C.SEQUENCE_REPEATS
        return total

    out = []
    with torch.no_grad():
        for _ in range(rounds):
            alone_s = [C._slowest(ctx, statistics.median(alone(calls) for _ in range(3))) for calls in references]
            for name, prepare in variants.items():
                dist.barrier()
                idle0, seconds = idle_entries(), []
                for calls in references:
                    in_order(calls)
                    in_order(calls)
                    total = 0.0
                    for _ in range(RUNS):
                        prepare()
                        start = clock()
                        in_order(calls)
                        total += clock() - start
                    seconds.append(C._slowest(ctx, total / RUNS))
                out.append((name, seconds, alone_s, (idle_entries() - idle0) / (RUNS * len(references))))
    return out


def main() -> None:
    import os

    from parsat.backend.launch import LaunchConfig, launch

    nproc = int(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    size = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    load = os.getloadavg()[0]
    res = launch(rank_fn, (rounds, size), LaunchConfig(nproc=nproc, backend="gloo", timeout_s=900))
    print(f"# {nproc} ranks, calibrate's reference at {size // 2} and {size} tokens, {RUNS} runs per variant; "
          f"1-minute load {load:.1f} -> {os.getloadavg()[0]:.1f}; thread CPU ms (slowest rank's)")
    factors: dict[str, list[float]] = {}
    for name, seconds, alone_s, idle in res[0]:
        ratios = [s / a for s, a in zip(seconds, alone_s)]
        factors.setdefault(name, []).append(statistics.geometric_mean(ratios))
        print(f"{name:28s} in order {' / '.join(f'{s * 1e3:.2f}' for s in seconds)}, alone "
              f"{' / '.join(f'{a * 1e3:.2f}' for a in alone_s)}: factor {' / '.join(f'{r:.3f}' for r in ratios)}, "
              f"geometric mean {factors[name][-1]:.3f}; {idle:.1f} idle entries a run")
    for name, values in factors.items():
        print(f"median over rounds, {name}: {statistics.median(values):.3f}")


if __name__ == "__main__":
    main()
