"""The step simulator's peak memory beside the per-node figure that decides fitting, and the simulated step, for
a small GPT laid out as Megatron-LM lays it out on one h100x8 node (tp 8, with and without sequence
parallelism), as the GPU profile (`DDP`) runs one micro-batch. Step times are predictions of the cost model.

    PYTHONPATH=TREE .venv/bin/python benchmarks/simulated_memory.py

Run with TREE at two commits to compare them (benchmarks/published_runs.md, 2026-12-03, helper h-k)."""

from __future__ import annotations

from parsat.cost.pcg_tasks import DDP, simulate_pcg
from parsat.dsl.library import load_library
from parsat.ir.costs import totals
from parsat.ir.machine import Machine
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import build_example
from parsat.search.solve import price_pcg

SIZES = {"blocks": 4, "hidden": 2048, "heads": 16, "batch": 8, "seq": 2048, "vocab": 32000}


def main() -> None:
    """Print, per layout, the simulated step and peak and the per-node peak."""
    library = load_library()[0]
    machine = Machine.preset("h100x8")
    graph = build_example("gpt", SIZES, library)
    for sequence in (True, False):
        pcg = megatron_pcg(graph, library, (1, 8), 8, sequence=sequence)
        step = simulate_pcg(pcg, library, machine, DDP)
        figure = totals(price_pcg(pcg, library, machine), machine).peak_memory_bytes
        print(f"sequence={sequence}: simulated step {step.step_s * 1e3:.3f} ms, simulated peak "
              f"{step.peak_memory_bytes / 2**30:.3f} GiB, per-node {figure / 2**30:.3f} GiB")


if __name__ == "__main__":
    main()
