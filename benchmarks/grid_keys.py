"""The independent grid's calls for several keys in one request, as one search asks them: CPU per key.

    .venv/bin/python benchmarks/grid_keys.py llama-70b 64 16 8:32 8:64 4:32

Each KEY is `m` (the unstaged step at m micro-batches) or `p:m` (a pipeline stage step: p stages, m
micro-batches, the stage machine `pipeline_search` makes). The calls share one `SearchRequest` (its
`layouts`, `prices` and simulations), as `optimize`'s do, so what the grid shares across keys is counted
where it is shared. Prints every point (configuration, step, peak memory, whether simulated) for comparing
trees, then each key's CPU seconds (`time.process_time`) and their total. Run it on two trees alternately
(before, after, before, after) on a loaded box: the points must be the same lines, the CPU the figure.
"""

from __future__ import annotations

import sys
import time

from parsat.cost.pipeline import StageFit, StageMemo
from parsat.search import step
from parsat.search.mesh import CandidateSteps
from parsat.search.pipeline_search import _stage_machine
from parsat.search.request import resolve_request, step_context


def main(argv: list[str]) -> int:
    """Run the keys of `argv` (MODEL DEVICES KEY...) and print their points and CPU seconds."""
    model, devices = argv[0], int(argv[1])
    request = resolve_request(model, "h100x8", None, None, devices)
    total = 0.0
    for key in argv[2:]:
        p, m = (int(x) for x in key.split(":")) if ":" in key else (1, int(key))
        if p > 1:
            fit = StageFit(p, request.machine, None, memo=StageMemo(library=request.library))
            context = step_context(request, m, _stage_machine(request.machine, devices, p), devices // p, 1,
                                   stage=fit, scout=True)
        else:
            context = step_context(request, m, scout=True)
        steps = CandidateSteps(request.library, context.machine, context.graph.microbatches, request.simulations)
        start = time.process_time()
        points = step.independent_points(context, steps)
        cpu = time.process_time() - start
        total += cpu
        for point in points:
            print(key, point.config, repr(point.totals.time_s), point.totals.peak_memory_bytes,
                  point.totals.simulation is not None)
        print(f"key {key} skipped {steps.skipped} CPU {cpu:.2f}", flush=True)
    print(f"TOTAL CPU {total:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
