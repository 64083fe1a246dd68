"""How many collectives a step of `parsat.parallelize(..., runtime="torch")` issues, against the step simulator.

    PYTHONPATH=. .venv/bin/python benchmarks/torch_native_collectives.py [--nproc 2] [--models llama gpt2 bert]

For each Megatron-layout plan of benchmarks/costmodel_fidelity_torch.py
on `--nproc` gloo ranks: the c10d collectives torch's profiler records in
one training step (after one warm-up step), by kind, beside the collective
tasks the step simulator issues for the same plan under `TORCH_NATIVE`
(the runtime's profile) and under `PARSAT_RUN` (the interpreter's). What
it checks is the profile's structure, not a timing: FSDP2 gathers and
reduces per parameter group, torch's styles all-reduce each
column-parallel module's input gradient, each rank's loss is its own.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

C10D = {"c10d::allreduce_": "all-reduce", "c10d::_allgather_base_": "all-gather",
        "c10d::allgather_into_tensor_coalesced_": "all-gather", "c10d::_reduce_scatter_base_": "reduce-scatter",
        "c10d::reduce_scatter_tensor_coalesced_": "reduce-scatter"}


def profiled(ctx, jobs: list[tuple[str, dict]]) -> dict:
    """On every rank, per (label, plan dict): the collectives of one profiled step, by kind."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import costmodel_fidelity_torch as cft
    import parsat
    from parsat.backend.torch_native.apply import local_batch

    out = {}
    for label, plan in jobs:
        module, example = cft.model(label.split("/")[0])
        net = parsat.parallelize(module, plan, example, runtime="torch")
        optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
        batch = local_batch(net, *example)

        def step():
            net(*batch).backward()
            optimizer.step()
            optimizer.zero_grad()

        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        counts: Counter = Counter()
        for event in prof.key_averages():
            if event.key in C10D:
                counts[C10D[event.key]] += event.count
        out[label] = dict(counts)
    return out


def simulated(pcg, library, machine, profile) -> dict:
    """The collective tasks of the simulated step, by kind (stragglers' waits left out)."""
    from parsat.cost.pcg_tasks import simulate_pcg

    counts: Counter = Counter()
    for span in simulate_pcg(pcg, library, machine, profile).result.spans:
        for kind in ("all-reduce", "all-gather", "reduce-scatter"):
            if span.name.endswith(kind):
                counts[kind] += 1
    return dict(counts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2", "bert"])
    args = parser.parse_args()
    import mesh_plans
    from costmodel_fidelity_torch import torch_plans
    from parsat.backend.executor import operator_library
    from parsat.backend.launch import LaunchConfig, launch
    from parsat.cost.pcg_tasks import PARSAT_RUN, TORCH_NATIVE
    from parsat.ir.machine import Machine

    machine, library = Machine.preset("cpu").with_devices(args.nproc), operator_library()
    plans = torch_plans(args.nproc, machine, args.models)
    jobs = [(label, mesh_plans.plan_dict(graph, pcg)) for label, pcg, graph, _f in plans]
    ran = launch(profiled, (jobs,), LaunchConfig(nproc=args.nproc, backend="gloo", timeout_s=1200))[0]
    print("| plan | torch profiler, one step | TORCH_NATIVE | PARSAT_RUN (interpreter) |\n|---|---|---|---|")
    for label, pcg, _graph, _f in plans:
        cells = [ran[label], simulated(pcg, library, machine, TORCH_NATIVE),
                 simulated(pcg, library, machine, PARSAT_RUN)]
        print(f"| {label} | " + " | ".join(", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none"
                                           for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
