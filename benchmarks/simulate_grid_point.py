"""CPU seconds of one step simulation of a large grid point, the work the search repeats for every candidate.

    .venv/bin/python benchmarks/simulate_grid_point.py
    PYTHONPATH=OTHER_CHECKOUT .venv/bin/python benchmarks/simulate_grid_point.py   # the same at another commit

gpt-1.3b (24 blocks) at 32 micro-batches, laid out as the independent grid's dp 8 x tp 8 point with sequence
parallelism (`ir.megatron.megatron_pcg`) on 64 h100x8 devices, simulated three times (`cost.step_report
.simulate_step`, a fresh compute-time cache each time). Prints the CPU seconds of the three and the simulated
step, which must be the same at every commit that only makes the simulator faster.
"""

from __future__ import annotations

import time

from parsat.cost.pcg_tasks import OpTimes
from parsat.cost.step_report import simulate_step
from parsat.dsl.library import load_library
from parsat.ir.machine import Machine
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import build_example

MICROBATCHES = 32


def main() -> None:
    library = load_library()[0]
    machine = Machine.resolve("h100x8").with_devices(64)
    graph = build_example("gpt-1.3b", {"batch": 512}, library).with_microbatches(MICROBATCHES)
    pcg = megatron_pcg(graph, library, (8, 8), 8, zero=0, sequence=True)
    start = time.process_time()
    for _ in range(3):
        streams, _timeline = simulate_step(pcg, library, machine, MICROBATCHES, OpTimes(library, machine))
    print(f"3 simulations: {time.process_time() - start:.2f} CPU s; simulated step {streams.time_s!r} s")


if __name__ == "__main__":
    main()
