"""Issue 31's map: a torch-runtime plan's measured step phases beside the simulator's task phases, same plan and machine.

Runs `costmodel_fidelity_torch`'s Megatron-layout plans (`parallelize(..., runtime="torch")`, SGD, each step at a
barrier) and times forward (the loss included: the module returns it), backward (FSDP2's gradient sync inside it),
`optimizer.step()` and `zero_grad()` on every rank (medians after the first step); then, untimed, the same flat
all-reduce as the plan's gradient sync alone, and on rank 0 five steps under torch.profiler (per operator per step;
forward's span against its operators' self time: what runs between ATen calls). Beside them, the simulator's busy
time per task phase and its largest tasks for the same plan on `MACHINE` (a `parsat calibrate --dtype float32
--dtensor` JSON of `NPROC` ranks). A measurement, not a test: the box's load moves every figure; calibrate just
before, at the same load, to compare phases (see benchmarks/costmodel_fidelity.md, 2026-12-04 helper F).

    PYTHONPATH=. .venv/bin/python benchmarks/costmodel_fidelity_phases.py NPROC MACHINE llama,bert dp,zero3 [STEPS]
"""
from __future__ import annotations

import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

def rank_fn(ctx, jobs: list[tuple[str, dict]], steps: int, profile_steps: int) -> dict:
    """On every rank, per (label, plan dict): the phases' medians in seconds; on rank 0 the profile too."""
    import torch, torch.distributed as dist
    from costmodel_fidelity_torch import lowered, phased_step
    out = {}
    for label, plan in jobs:
        module, net, opt, batch = lowered(label, plan)
        ph = collections.defaultdict(list)
        for _ in range(steps):
            t0, t1, t2, t3, t4 = phased_step(net, opt, batch)
            for k, v in zip(("forward", "backward", "optimizer", "zero_grad", "step"), (t1-t0, t2-t1, t3-t2, t4-t3, t4-t0)):
                ph[k].append(v)
        prof = None
        if profile_steps and ctx.rank == 0:
            from torch.profiler import profile, ProfilerActivity
            with profile(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(profile_steps):
                    dist.barrier() if dist.get_world_size() > 1 else None
                    with torch.profiler.record_function("PHASE_FWD"):
                        loss = net(*batch)
                    loss.backward(); opt.step(); opt.zero_grad()
            evs = p.events()
            spans = [(e.time_range.start, e.time_range.end) for e in evs if e.name == "PHASE_FWD"]
            fwd = collections.defaultdict(lambda: [0, 0.0])
            inside = lambda e: any(a <= e.time_range.start and e.time_range.end <= b for a, b in spans)
            for e in evs:
                if e.name != "PHASE_FWD" and inside(e):
                    fwd[e.name][0] += 1; fwd[e.name][1] += e.self_cpu_time_total
            span_us = sum(b - a for a, b in spans)
            top_level = sum(e.cpu_time_total for e in evs if e.name != "PHASE_FWD" and inside(e) and (e.cpu_parent is None or e.cpu_parent.name == "PHASE_FWD"))
            fwd_rows = sorted(((k, c / profile_steps, s / profile_steps) for k, (c, s) in fwd.items()), key=lambda x: -x[2])[:30]
            selfsum = sum(s for c, s in fwd.values())
            ka = p.key_averages()
            prof = sorted([(e.key, e.count / profile_steps, e.self_cpu_time_total / profile_steps, e.cpu_time_total / profile_steps) for e in ka], key=lambda x: -x[2])[:45]
        elif profile_steps:
            for _ in range(profile_steps):
                dist.barrier(); loss = net(*batch); loss.backward(); opt.step(); opt.zero_grad()
        iso = []
        if dist.get_world_size() > 1:
            numel = sum(p.numel() for p in module.parameters())
            buf = torch.randn(numel // dist.get_world_size() if "zero3" in label else numel)
            for _ in range(12):
                dist.barrier(); t = time.perf_counter()
                dist.all_reduce(buf); iso.append(time.perf_counter() - t)
        ph["isolated_all_reduce"] = iso or [0.0, 0.0]
        out[label] = {"phases": {k: statistics.median(v[1:]) for k, v in ph.items()}, "prof": prof,
                      "fwd": (span_us / profile_steps, top_level / profile_steps, selfsum / profile_steps, fwd_rows) if prof else None}
        dist.barrier()
    return out

def main() -> None:
    n = int(sys.argv[1]); mfile = sys.argv[2]; models = sys.argv[3].split(","); labels = sys.argv[4].split(",")
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 12
    from parsat.ir.machine import Machine
    from parsat.backend.executor import operator_library
    from parsat.backend.launch import LaunchConfig, launch
    from parsat.cost.pcg_tasks import simulate_pcg, TORCH_NATIVE
    from parsat.importer.call_count import count_module_calls
    from parsat.importer.export import import_module
    from parsat.backend.torch_native.apply import module_info
    from parsat.ir.megatron import megatron_pcg
    from costmodel_fidelity_torch import model, SHAPES
    import mesh_plans
    machine = Machine.load(mfile); library = operator_library()
    shapes = SHAPES[n]
    plans = []
    for name in models:
        module, inputs = model(name)
        imp = import_module(module, inputs, check=False)
        graph = imp.graph
        profile = TORCH_NATIVE.running(count_module_calls(module, inputs, graph))
        for lab in labels:
            shape, zero = shapes[lab]
            pcg = megatron_pcg(graph, library, shape, machine.devices_per_node, zero=zero)
            pred = simulate_pcg(pcg, library, machine, profile)
            b, st, en = pred.result._columns
            byphase = collections.defaultdict(float); byname = collections.defaultdict(lambda: [0, 0.0])
            for name_, phase, s, e in zip(b.names, b.phases, st, en):
                byphase[phase] += e - s
                key = (phase, name_.split("#")[0].split("@")[0])
                byname[key][0] += 1; byname[key][1] += e - s
            plans.append((f"{name}/{lab}", pcg, graph, pred.step_s, dict(byphase), byname))
    jobs = [(l, mesh_plans.plan_dict(g, p)) for l, p, g, *_ in plans]
    res = launch(rank_fn, (jobs, steps, 5), LaunchConfig(nproc=n, backend="gloo", timeout_s=1200))
    for l, p, g, step_s, byphase, byname in plans:
        print(f"=== {l} on {n} ranks; simulated step {step_s*1e3:.2f} ms")
        print("  simulated busy by task phase (ms):", {k: round(v*1e3, 3) for k, v in sorted(byphase.items())})
        for rank, r in enumerate(res):
            print(f"  rank {rank} measured (ms):", {k: round(v*1e3, 3) for k, v in r[l]["phases"].items()})
        top = sorted(byname.items(), key=lambda kv: -kv[1][1])[:40]
        print("  simulated top tasks (phase, name, count, ms):")
        for (phase, nm), (c, s) in top:
            print(f"    {phase:14s} {nm[:60]:60s} {c:4d} {s*1e3:8.3f}")
        if res[0][l]["prof"]:
            print("  profiler rank0 per step (key, calls, self ms, total ms):")
            for k, c, s, t in res[0][l]["prof"][:25]:
                print(f"    {k[:60]:60s} {c:6.1f} {s/1e3:8.3f} {t/1e3:8.3f}")
            span, top, selfsum, rows = res[0][l]["fwd"]
            print(f"  forward under profiler per step: span {span/1e3:.3f} ms, top-level ops {top/1e3:.3f} ms, self sum {selfsum/1e3:.3f} ms")
            for k, c, s in rows:
                print(f"    FWD {k[:60]:60s} {c:6.1f} {s/1e3:8.3f}")
if __name__ == "__main__":
    main()
