"""Why the demo step's collective runs slower than `parsat calibrate` timed it: the same collective timed several ways.

Spawns `--nproc` ranks as `parsat run` does (`backend.launch`: one intra-op thread each on a 2-core box) and, in
rounds that interleave the ways (so that the box's load moves them alike), times one collective of the demo's
size (`--kind`, `--elements`, float64, default group). Every rank stamps each call's arrival and return on the
machine's monotonic clock (shared by the processes), so a call's time splits into the wait for the last rank to
arrive (skew) and the collective itself once every rank is in it. The ways:

* back to back: the collective again and again (how `parsat calibrate` times collectives);
* alone: the cycle starts at a barrier (as a step does), then the collective;
* after compute: a barrier, the rank's first product of the demo (x [128, 784] @ w [784, 128] by default), then
  the collective, as in a step;
* after idle: a barrier, a sleep as long as the product took, then the collective (a pause without compute);
* calibrate, back to back: `parsat calibrate`'s figure of the collective before 2026-12-06 (session 65), and still
  where ranks share cores: `calibrate._timed`, each call stamped (its warm-ups and its probe call included);
* calibrate, after a product: its figure now (`calibrate._timed_after` right after `_step_product`, one call a
  round, as `calibrate.StepCollectives` times it, in one pass), each call stamped.

The two calibrate ways also print the figure calibration would record (ms, the median over the rounds here of
the figure each round gave), beside the step's own collective in the ways above.

`launch` pins each rank to its own core (`share_cores`); with OMP_NUM_THREADS=1 in the environment it does not,
which shows the ranks unpinned; `--pin` then keeps only each rank's main thread on one core (gloo's threads,
started before, stay free). `--mesh-group` times the collective on a DeviceMesh's group, the one `parsat run`'s
collectives use. Also printed: how much of the two ranks' products ran at the same time (1: fully in parallel;
0: one after the other), and each rank's torch.get_num_threads(). A measurement, not a test.

    PYTHONPATH=. .venv/bin/python benchmarks/demo_collective.py --kind all_reduce --elements 1280
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from dataclasses import replace

from parsat.backend.calibrate import (STEP_ROUNDS_FACTOR, Budget, _step_product, _timed, _timed_after,
                                      collective_cases)
from parsat.backend.launch import LaunchConfig, RankContext, launch

WAYS = ("back to back", "alone", "after compute", "after idle")
CALIBRATE_WAYS = ("calibrate, back to back", "calibrate, after a product")
BACK_TO_BACK = 10


def _stamp(fn) -> tuple[float, float]:
    start = time.monotonic()
    fn()
    return start, time.monotonic()


def _mesh_group(ctx: RankContext):
    """The group `parsat run`'s collectives use: a DeviceMesh's over all ranks (`collectives.MeshGroups`)."""
    from parsat.backend.collectives import MeshGroups
    from parsat.ir.mesh import Mesh

    return MeshGroups(Mesh.of([ctx.world], names=["gpu"]), ctx.rank, ctx.device).group(0)


def _rank(ctx: RankContext, kind: str, elements: int, rounds: int, shape: list[int], pin: bool,
          mesh: bool = False) -> dict:
    """Per way, per round, this rank's (arrival, return) stamps of each call; the products' stamps."""
    if pin:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[ctx.rank % len(cpus)]})
    m, k, n = shape
    x, w = torch.randn(m, k, dtype=torch.float64), torch.randn(k, n, dtype=torch.float64)
    group = _mesh_group(ctx) if mesh else None
    collective = dict(collective_cases(ctx, torch.float64, elements, ctx.world, group))[kind]
    compute = lambda: x @ w   # noqa: E731
    stamps: dict[str, list] = {way: [] for way in (*WAYS, *CALIBRATE_WAYS, "compute")}
    figures: dict[str, list] = {way: [] for way in CALIBRATE_WAYS}
    budget = Budget()
    product = _step_product(ctx, torch.float64, 512)
    one_a_round = replace(budget, repeats=STEP_ROUNDS_FACTOR * budget.repeats, window_s=0.0)

    def stamped(way: str):
        def call():
            stamps[way][-1].append(_stamp(collective))
        return call
    for _ in range(3):
        collective()
        compute()
    for _ in range(rounds):
        dist.barrier()
        stamps["back to back"].append([_stamp(collective) for _ in range(BACK_TO_BACK)])
        dist.barrier()
        stamps["alone"].append([_stamp(collective)])
        dist.barrier()
        stamps["compute"].append([_stamp(compute)])
        stamps["after compute"].append([_stamp(collective)])
        dist.barrier()
        time.sleep(statistics.median(b - a for (a, b), in stamps["compute"]))
        stamps["after idle"].append([_stamp(collective)])
        for way in CALIBRATE_WAYS:
            stamps[way].append([])
        figures[CALIBRATE_WAYS[0]].append(_timed(ctx, stamped(CALIBRATE_WAYS[0]), budget, lambda: None))
        figures[CALIBRATE_WAYS[1]].append(_timed_after(ctx, product, stamped(CALIBRATE_WAYS[1]), one_a_round,
                                                       lambda: None))
    return {"rank": ctx.rank, "threads": torch.get_num_threads(), "stamps": stamps, "figures": figures,
            "cpus": sorted(os.sched_getaffinity(0))}


def _split(results: list[dict], way: str) -> tuple[list[float], list[float], list[float]]:
    """(each rank's call time, its wait for the last arrival, the call once all arrived), in ms, every call.
    The first rank in waits for the others, the last does not: the waits' mean, not their median, says how long."""
    seen, waits, inside = [], [], []
    for rnd in range(len(results[0]["stamps"][way])):
        for call in range(len(results[0]["stamps"][way][rnd])):
            pairs = [r["stamps"][way][rnd][call] for r in results]
            last = max(a for a, _b in pairs)
            for a, b in pairs:
                seen.append((b - a) * 1e3)
                waits.append((last - a) * 1e3)
                inside.append((b - last) * 1e3)
    return seen, waits, inside


def _overlap(results: list[dict]) -> float:
    """Median over rounds of the time all ranks' products ran together over one product's time."""
    fractions = []
    for rnd in range(len(results[0]["stamps"]["compute"])):
        spans = [r["stamps"]["compute"][rnd][0] for r in results]
        together = min(b for _a, b in spans) - max(a for a, _b in spans)
        fractions.append(max(0.0, together) / statistics.fmean(b - a for a, b in spans))
    return statistics.median(fractions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("all_reduce", "all_gather"), default="all_reduce")
    parser.add_argument("--elements", type=int, default=1280)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--shape", type=int, nargs=3, default=[128, 784, 128], metavar=("M", "K", "N"))
    parser.add_argument("--pin", action="store_true", help="rank r runs on the r-th cpu it may use only")
    parser.add_argument("--mesh-group", action="store_true", help="on a DeviceMesh's group, as `parsat run`")
    args = parser.parse_args()
    results = launch(_rank, (args.kind, args.elements, args.rounds, args.shape, args.pin, args.mesh_group),
                     LaunchConfig(nproc=args.nproc, timeout_s=600))
    compute = [(b - a) * 1e3 for r in results for rnd in r["stamps"]["compute"] for a, b in rnd]
    print(f"{args.kind} of {args.elements} float64 elements, {args.nproc} ranks, threads "
          + "/".join(str(r["threads"]) for r in results) + f"; product {statistics.median(compute):.3f} ms, ranks' "
          f"products overlapping {_overlap(results):.2f}; may run on cpus "
          + " / ".join(",".join(map(str, r["cpus"])) for r in results))
    print(f"  {'way':26s} {'call':>8s} {'all in':>8s} {'wait':>8s} {'call p90':>8s} {'mean':>8s}   (call, all in: "
          f"medians; wait: mean; call's 90th percentile and mean; ms)")
    for way in (*WAYS, *CALIBRATE_WAYS):
        seen, waits, inside = _split(results, way)
        figure = (f"   figure {statistics.median(results[0]['figures'][way]) * 1e3:.3f} ms"
                  if way in CALIBRATE_WAYS else "")
        p90 = statistics.quantiles(seen, n=10, method="inclusive")[-1] if len(seen) > 1 else seen[0]
        print(f"  {way:26s} " + " ".join(f"{statistics.median(v):8.3f}" for v in (seen, inside))
              + f" {statistics.fmean(waits):8.3f} {p90:8.3f} {statistics.fmean(seen):8.3f}" + figure)
    calls = [len(r) for r in results[0]["stamps"][CALIBRATE_WAYS[0]]]
    print(f"  calibrate, back to back: {statistics.median(calls):.0f} calls a figure (the median; 3 of them warm-ups "
          f"and the probe that sets how many a round)")


if __name__ == "__main__":
    main()
