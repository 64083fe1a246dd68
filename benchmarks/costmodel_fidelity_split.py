"""Issue 31: where the fidelity benchmark's under-prediction goes: work, a turn not given, or waiting.

For `costmodel_fidelity_torch`'s Megatron-layout plans on NPROC ranks, every rank times each step's phases
(forward with the loss, backward with FSDP2's gradient sync inside it, `optimizer.step()` + `zero_grad()`), each
step after a barrier as the benchmark times it, and splits each phase's wall time by the kernel's own accounting
of the rank's main thread (`/proc/thread-self/schedstat`: nanoseconds on a CPU, nanoseconds runnable but waiting
for one):

* on CPU: the main thread running (the module's Python, dispatch, kernels; with one thread a rank, as `parsat
  run` pins it, the kernels run on it too);
* runnable, not running: descheduled (a peer rank or another job holding the core);
* the rest: blocked (in a collective's wait, a barrier, a page-in): waiting, not work;
* and the process's other threads' CPU time (gloo's workers doing the collectives' copies and reductions), and
  the box's idle-state entries in the phase (`idle_entries`: on this VM each one a halted virtual CPU).

Beside it, the simulator's busy time for the same plan on MACHINE by task phase: compute (forward, loss,
backward, optimizer: everything the compute stream runs, hooks and dispatch included) and collectives
(forward_comm, backward_comm, grad_sync), and the waits it prices (stragglers). A measurement, not a test.

    PYTHONPATH=. .venv/bin/python benchmarks/costmodel_fidelity_split.py NPROC MACHINE PLANS [STEPS]

PLANS: comma-separated model/label (e.g. bert/dp,llama/dp,llama/tp,gpt2/zero3).
"""
from __future__ import annotations

import collections
import glob
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PHASES = ("forward", "backward", "optimizer")
COMPUTE_PHASES = ("forward", "loss", "backward", "optimizer")
COMM_PHASES = ("forward_comm", "backward_comm", "grad_sync")


_SCHEDSTAT: dict[int, int] = {}   # thread id -> its schedstat file, opened once (as `_IDLE_FILES`)


def _schedstat() -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable and waiting for one) of the calling thread, from the kernel."""
    tid = threading.get_native_id()
    if tid not in _SCHEDSTAT:
        _SCHEDSTAT[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
    run_ns, wait_ns, _slices = os.pread(_SCHEDSTAT[tid], 128, 0).split()
    return int(run_ns) * 1e-9, int(wait_ns) * 1e-9


IDLE_STATES = "/sys/devices/system/cpu/cpu*/cpuidle/state*/usage"
_IDLE_FILES: list[int] = []   # the idle states' counters, opened once: a glob and opens on every sample took
#                               ~0.2 ms, which fell into the phases


def idle_entries() -> int:
    """The box's CPUs' idle-state entries so far, all CPUs and states together (0 where cpuidle is not exposed):
    on this VM (haltpoll with `guest_halt_poll_ns` 0) every entry is a halt of a virtual CPU, which the host must
    wake again (a rank waiting with nothing else to run on its core)."""
    if not _IDLE_FILES:
        _IDLE_FILES.extend(os.open(f, os.O_RDONLY) for f in sorted(glob.glob(IDLE_STATES)))
    return sum(int(os.pread(fd, 32, 0)) for fd in _IDLE_FILES)


def _sample() -> tuple[float, float, float, float, int]:
    """(wall, main thread on CPU, main thread runnable waiting, process CPU over all threads, the box's idle
    entries). On CPU from `time.thread_time` (the kernel brings it up to date when read; schedstat's figure lags
    by up to a tick)."""
    return time.perf_counter(), time.thread_time(), _schedstat()[1], time.process_time(), idle_entries()


def rank_fn(ctx, jobs: list[tuple[str, dict]], steps: int) -> dict:
    """Per label: per phase, the means over steps (the first dropped; means, so that the parts add up) of wall,
    on-CPU, runnable, blocked, other threads' CPU, idle entries; and the step's."""
    import torch.distributed as dist
    from costmodel_fidelity_torch import lowered, phased_step

    out = {}
    for label, plan in jobs:
        _module, net, opt, batch = lowered(label, plan)
        rows = collections.defaultdict(list)
        for _ in range(steps):
            s0, s1, s2, _stepped, s3 = phased_step(net, opt, batch, _sample)
            for name, a, b in (("forward", s0, s1), ("backward", s1, s2), ("optimizer", s2, s3), ("step", s0, s3)):
                wall, run, wait, proc, idle = (y - x for x, y in zip(a, b))
                rows[name].append((wall, run, wait, wall - run - wait, proc - run, idle))
        out[label] = {name: [statistics.fmean(col) for col in zip(*vals[1:])] for name, vals in rows.items()}
        dist.barrier()
    return out


def simulated(nproc: int, machine_file: str, labels: list[str]) -> tuple[dict, list]:
    """(label -> (simulated step, {task phase: busy seconds}), the (label, plan dict) jobs to run)."""
    from costmodel_fidelity_torch import torch_plans
    from parsat.backend.executor import operator_library
    from parsat.cost.pcg_tasks import simulate_pcg
    from parsat.ir.machine import Machine

    import mesh_plans

    machine, library = Machine.load(machine_file), operator_library()
    out, jobs = {}, []
    for label, pcg, graph, figures in torch_plans(nproc, machine, sorted({l.split("/")[0] for l in labels})):
        if label not in labels:
            continue
        result = simulate_pcg(pcg, library, machine, figures.profile)
        _busy, starts, ends = result.result._columns
        phases = collections.defaultdict(float)
        for phase, s, e in zip(_busy.phases, starts, ends):
            phases[phase] += e - s
        out[label] = (result.step_s, dict(phases))
        jobs.append((label, mesh_plans.plan_dict(graph, pcg)))
    return out, jobs


def main() -> None:
    nproc, machine_file, labels = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 12
    from parsat.backend.launch import LaunchConfig, launch

    sim, jobs = simulated(nproc, machine_file, labels)
    load0 = os.getloadavg()[0]
    cpu0 = time.process_time()
    res = launch(rank_fn, (jobs, steps), LaunchConfig(nproc=nproc, backend="gloo", timeout_s=1200))
    print(f"# {nproc} ranks, machine {machine_file}, {steps} steps, 1-minute load {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}; ms, means over steps; per rank: wall = on CPU + runnable + blocked; "
          f"other threads' CPU and the box's idle entries (vCPU halts) beside")
    for label, (step_s, phases) in sim.items():
        comp = sum(phases.get(p, 0.0) for p in COMPUTE_PHASES)
        comm = sum(phases.get(p, 0.0) for p in COMM_PHASES)
        rest = {p: round(v * 1e3, 2) for p, v in phases.items() if p not in COMPUTE_PHASES + COMM_PHASES and v}
        measured = max(r[label]["step"][0] for r in res)
        print(f"== {label}: simulated step {step_s * 1e3:.2f}, measured (slowest rank's mean) {measured * 1e3:.2f},"
              f" ratio {measured / step_s:.2f}")
        print("   simulated busy: " + ", ".join(f"{p} {phases.get(p, 0.0) * 1e3:.2f}"
                                                for p in COMPUTE_PHASES + COMM_PHASES)
              + f"; compute {comp * 1e3:.2f}, collectives {comm * 1e3:.2f}, other {rest}")
        for rank, r in enumerate(res):
            cells = []
            for name in (*PHASES, "step"):
                *times, idle = r[label][name]
                wall, run, wait, blocked, others = (v * 1e3 for v in times)
                cells.append(f"{name} {wall:.2f} = {run:.2f} + {wait:.2f} + {blocked:.2f} (+{others:.2f}; "
                             f"{idle:.0f} halts)")
            print(f"   rank {rank}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
