"""CPU seconds of the work the independent grid repeats per point, outside egglog: lay a point out, price it, bound
its step and simulate it.

    .venv/bin/python benchmarks/grid_point_speed.py [MODEL] [--devices N] [--microbatches M] [--tp T]
    PYTHONPATH=OTHER_CHECKOUT .venv/bin/python benchmarks/grid_point_speed.py ...   # the same at another commit

MODEL (default llama-70b, whose grid took 281 of the first 684 CPU s of `llama-70b:64`) laid out as the
independent grid's dp x tp point with sequence parallelism (`ir.megatron.megatron_pcg`, its `zero`=0 and 3
layouts) on N h100x8 devices, each priced (`search.solve.price_pcg`), bounded (`cost.pcg_tasks.step_floor`,
the layout's floor and the plan's: what `search.step.independent_points` asks) and simulated (`cost.step_report
.simulate_step`) at M micro-batches, with one compute-time cache as a search shares it. Prints the CPU seconds
(`time.process_time`) of each part and every figure they give (floors, simulated steps, summed node times),
which must be the same at every commit that only makes this work faster.
"""

from __future__ import annotations

import argparse
import time

from parsat.cost.pcg_tasks import OpTimes, step_floor
from parsat.cost.step_report import simulate_step
from parsat.dsl.library import load_library
from parsat.ir.machine import Machine
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import build_example
from parsat.search.solve import price_pcg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="llama-70b")
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--tp", type=int, default=8)
    args = parser.parse_args()
    library = load_library()[0]
    machine = Machine.resolve("h100x8").with_devices(args.devices)
    graph = build_example(args.model, {}, library).with_microbatches(args.microbatches)
    times, cpu, shared = OpTimes(library, machine), {}, {}

    def timed(part: str, work):
        start = time.process_time()
        found = work()
        cpu[part] = cpu.get(part, 0.0) + time.process_time() - start
        return found

    for zero in (0, 3):
        pcg = timed("lay out (megatron_pcg)", lambda: megatron_pcg(
            graph, library, (args.devices // args.tp, args.tp), 8, zero=zero, sequence=True, cache=shared))
        costs = timed("price (price_pcg)", lambda: price_pcg(pcg, library, machine, True, graph.microbatches))
        layout = timed("bound (step_floor x2)", lambda: step_floor(pcg, machine, times, args.microbatches, plan=False))
        floor = timed("bound (step_floor x2)", lambda: step_floor(pcg, machine, times, args.microbatches))
        streams, _ = timed("simulate (simulate_step)", lambda: simulate_step(pcg, library, machine,
                                                                              args.microbatches, times))
        print(f"zero {zero}: {len(pcg.nodes)} nodes, summed node time {sum(c.time_s for c in costs.values())!r} s, "
              f"floors {layout!r} / {floor!r} s, simulated step {streams.time_s!r} s")
    for part, seconds in cpu.items():
        print(f"{part:28s} {seconds:7.2f} CPU s")
    print(f"total {sum(cpu.values()):.2f} CPU s")


if __name__ == "__main__":
    main()
