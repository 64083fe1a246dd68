"""The independent grid alone (`baselines.independent_grid`: every layout built and priced, no floors, no
simulations) for a model's unstaged steps at 1, 2 and 4 micro-batches, in CPU seconds, with a digest of every
point's configuration, predicted step and peak memory (the same digest before and after a change: the same
points).

    PYTHONPATH=TREE .venv/bin/python benchmarks/grid_alone.py gpt-6.7b 64

The calls share one `kin` dict, as one `optimize` call's grids share `SearchRequest.layouts` (where the tree
has it)."""

from __future__ import annotations

import collections
import hashlib
import inspect
import sys
import time

import parsat.search.baselines as baselines
from parsat.search.request import resolve_request, step_context

CPU: collections.Counter = collections.Counter()


def wrap(name: str) -> None:
    """`baselines.name` counting its CPU seconds (where the tree has it)."""
    inner = getattr(baselines, name, None)
    if inner is None:
        return

    def counted(*args, **kwargs):
        start = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            CPU[name] += time.process_time() - start
    setattr(baselines, name, counted)


def main(argv: list[str]) -> int:
    name, devices = argv[0], int(argv[1])
    for part in ("megatron_pcg", "price_pcg", "pcg_node_costs", "restaged_node_costs", "recomputed_pcg_costs"):
        wrap(part)
    request = resolve_request(name, "h100x8", None, None, devices)
    kin = {"kin": request.layouts} if "kin" in inspect.signature(baselines.grid_families).parameters else {}
    total, found = 0.0, []
    for microbatches in (1, 2, 4):
        step = step_context(request, microbatches)
        start = time.process_time()
        points = [point for family in baselines.grid_families(step.graph, request.library, step.machine, True,
                                                              devices, step.memory.fits, **kin)
                  for _place, point in family]
        total += time.process_time() - start
        found.append([(p.config, round(p.totals.time_s, 9), p.totals.peak_memory_bytes) for p in points])
    digest = hashlib.sha256(repr(found).encode()).hexdigest()[:16]
    print(f"grid alone {total:.2f} CPU s, {sum(map(len, found))} points, digest {digest}; "
          + ", ".join(f"{k} {v:.2f}" for k, v in CPU.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
