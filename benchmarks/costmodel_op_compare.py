"""Issue 31: a Hugging Face model's forward and backward as the CPU runs them, op by op, against what the simulator
prices for the same plan's nodes.

For each model of `costmodel_fidelity_torch` (the data-parallel plan on NPROC ranks: each rank runs the unmodified
module on its local batch), on one thread as a rank runs:

* measured: the eager module's forward (the loss included) and backward on the local batch, main-thread CPU time
  (`time.thread_time`) over STEPS passes, and torch.profiler's self CPU time per ATen operator over as many more
  (the profiler's own cost per call inflates these: its total is printed beside the unprofiled one);
* priced: `simulate_pcg` of the plan on MACHINE with the runtime's profile (`PlanFigures.profile`), each forward
  and backward task's time summed by the graph operator it prices (tasks that are not a node's, e.g. the module's
  own calls and Python, FSDP2's hooks, by their name).

A measurement, not a test:

    PYTHONPATH=. .venv/bin/python benchmarks/costmodel_op_compare.py NPROC MACHINE[,MACHINE...] [MODELS] [STEPS]

Several machine files (comma-separated): each priced against the same measurement (e.g. one calibration with and
without a field, for a pricing change's before and after).
"""
from __future__ import annotations

import collections
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

NODE = re.compile(r"#(\d+)")


def measured(name: str, nproc: int, steps: int) -> tuple[float, float, dict]:
    """(forward CPU s, backward CPU s, {aten op: (forward self s, calls, backward self s, calls)}) per pass."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from costmodel_fidelity_torch import model

    torch.set_num_threads(1)
    module, (ids, labels) = model(name)
    n = ids.shape[0] // nproc
    batch = ids[:n], labels[:n]

    def forward():
        return module(*batch)

    for _ in range(3):
        forward().backward()
    fwd = bwd = 0.0
    for _ in range(steps):
        t0 = time.thread_time()
        loss = forward()
        t1 = time.thread_time()
        loss.backward()
        t2 = time.thread_time()
        fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
        module.zero_grad(set_to_none=True)
    ops: dict = collections.defaultdict(lambda: [0.0, 0, 0.0, 0])
    for phase in (0, 1):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                loss = forward()
                if phase:
                    loss.backward()
                module.zero_grad(set_to_none=True)
        for ev in prof.key_averages():
            ops[ev.key][2 * phase] += ev.self_cpu_time_total * 1e-6 / steps
            ops[ev.key][2 * phase + 1] += ev.count / steps
    out = {}
    for key, (f, fc, fb, fbc) in ops.items():   # phase 1 profiled forward + backward: backward = the difference
        out[key] = (f, fc, fb - f, fbc - fc)
    return fwd / steps, bwd / steps, out


def priced(name: str, nproc: int, machine_file: str, label: str = "dp") -> tuple[float, dict]:
    """(simulated step, {(phase, graph operator or task name): [seconds, tasks]}) of `name`/`label`."""
    from costmodel_fidelity_torch import torch_plans
    from parsat.backend.executor import operator_library
    from parsat.cost.pcg_tasks import simulate_pcg
    from parsat.ir.machine import Machine

    machine, library = Machine.load(machine_file), operator_library()
    for plan, pcg, _graph, figures in torch_plans(nproc, machine, [name]):
        if plan != f"{name}/{label}":
            continue
        result = simulate_pcg(pcg, library, machine, figures.profile)
        ops = {n.id: n.op for n in pcg.nodes}
        rows: dict = collections.defaultdict(lambda: [0.0, 0])
        for span in result.result.spans:
            found = NODE.search(span.name)
            key = ops.get(int(found.group(1)), span.name) if found else re.sub(r"\d+", "N", span.name)
            row = rows[(span.phase, key)]
            row[0] += span.end - span.start
            row[1] += 1
        return result.step_s, dict(rows)
    raise SystemExit(f"no {name}/{label} plan on {nproc} ranks")


def main() -> None:
    nproc, machine_files = int(sys.argv[1]), sys.argv[2].split(",")
    models = sys.argv[3].split(",") if len(sys.argv) > 3 else ["gpt2", "bert", "llama"]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    for name in models:
        prices = [(f, *priced(name, nproc, f)) for f in machine_files]
        fwd, bwd, ops = measured(name, nproc, steps)
        print(f"== {name}/dp on {nproc} ranks: simulated step " +
              ", ".join(f"{step * 1e3:.2f} ms ({f})" for f, step, _rows in prices))
        for phase, cpu, col in (("forward", fwd, 0), ("backward", bwd, 2)):
            print(f"  {phase}: on CPU {cpu * 1e3:.2f} ms (unprofiled)")
            for machine_file, _step, rows in prices:
                mine = sorted(((k[1], v) for k, v in rows.items() if k[0] == phase), key=lambda kv: -kv[1][0])
                total = sum(v[0] for _k, v in mine)
                print(f"    priced on {machine_file}: {total * 1e3:.2f} ms (on CPU / priced {cpu / total:.2f}): " +
                      ", ".join(f"{k} {v[0] * 1e3:.3f}/{v[1]}" for k, v in mine))
            theirs = sorted(((k, v[col], v[col + 1]) for k, v in ops.items() if v[col] > 1e-6 and
                             not k.startswith("ProfilerStep")), key=lambda r: -r[1])
            print(f"    profiled (self, total {sum(r[1] for r in theirs) * 1e3:.2f} ms): " +
                  ", ".join(f"{k} {s * 1e3:.3f}/{c:.0f}" for k, s, c in theirs))


if __name__ == "__main__":
    main()
