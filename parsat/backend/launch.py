"""Run a function on N ranks: started on this machine, or joined under torchrun.

`launch(fn, args, config)` starts `config.nproc` processes, each forked
from multiprocessing's fork server (`_start_method`): a fresh interpreter
started once per launcher, which imports torch and the parsat modules a
rank reads (`PRELOADED`) before it forks any rank, so no state is
inherited from a launcher that may already run threads (as with spawn),
and a rank does not import torch again (each spawned rank paid ~2 CPU s
for it: the test suite's ~90 ranks, and every rank of a job). Each rank
gets the launcher's environment as the job starts (`rank_guard.start`),
not the server's: the device and process group settings are read as a
rank sets them up, and the thread count torch's OpenMP read as it was
imported is set again from it (`share_cores`). Each joins one process
group (gloo on CPU, nccl on CUDA) through a TCP store the launcher serves
on the loopback interface (nothing on disk, so a killed launcher leaves no
folder behind), runs `fn(ctx, *args)` and sends back its JSON-able
result. Under `torchrun` (RANK / WORLD_SIZE in the environment) the same
call joins the existing group and runs `fn` once, in this process.

Failure is the parent's business, not the ranks': it watches every child's
exit and a message queue, and as soon as one rank raises or dies, or the
job runs past `config.timeout_s`, it ends every other rank (SIGTERM, then
SIGKILL), reaps them all, and raises `LaunchError` naming the rank(s) and
why. Collectives carry the process-group timeout `collective_timeout_s`,
so a rank stuck in a collective its peers never join raises by itself;
joining the group waits for every rank within the job's timeout instead
(ranks start seconds apart on a loaded box: `_all_arrived`).

Ranks die with their launcher, however it ends (SIGKILL, an OOM kill, a
parent's `subprocess.run(..., timeout=...)`), from their first moment:
`rank_guard` binds each to the launcher (a watchdog on its sentinel, a
parent-death signal) before the job is unpickled.

A spawned process first re-imports the launching script (multiprocessing's
spawn, as `__mp_main__`); a script that calls `launch` (or `parallelize`,
`parsat.run`) at its top level without an `if __name__ == "__main__":`
guard would start the job again inside every rank. `launch` refuses such a
call before spawning, naming the script's line (`main_guard`); where the
source cannot tell, `launch` called in a rank's re-import ends that rank at
once with `REIMPORTED_EXIT`, and the launcher says what to change instead of
"died (exit code 1)".
"""

from __future__ import annotations

import json
import multiprocessing.forkserver as forkserver
import re
import os
import queue as queue_module
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parsat.backend import rank_guard
from parsat.backend.main_guard import unguarded_call_site
from parsat.dsl.bounds import BoundError, check_all
from parsat.ir.units import fmt_bytes

GRACE_S = 0.5        # after a first failure: how long to collect the others' reports
TERMINATE_S = 3.0    # SIGTERM to SIGKILL
STORE_HOST = "127.0.0.1"
MAX_LOCAL_RANKS = 256  # processes one launcher spawns (each imports torch: ~0.3 GB); torchrun spreads more
REIMPORTED_EXIT = 87   # a spawned rank whose re-import of the launching script called `launch` again
UNGUARDED = ("a spawned rank runs the launching script's top level first, and that started the job again: put the "
             "code that starts the job under `if __name__ == \"__main__\":`")
BEFORE_SPAWN = ("this line of the launching script starts the job outside `if __name__ == \"__main__\":`, and each "
                "spawned rank runs the script's top level first, so every rank would start it again: put the code "
                "that starts the job under that guard (no rank was started)")


class LaunchError(Exception):
    """A distributed job that did not finish: which ranks failed and how."""

    def __init__(self, message: str, ranks: Sequence[int]):
        super().__init__(message)
        self.ranks = tuple(ranks)


@dataclass(frozen=True)
class LaunchConfig:
    """How to run a job: rank count, backend, and the two timeouts."""

    nproc: int
    backend: str | None = None          # None: nccl when CUDA has enough devices, else gloo
    timeout_s: float = 120.0            # the whole job, enforced by the parent
    collective_timeout_s: float = 30.0  # one collective, enforced by the process group

    def resolved_backend(self) -> str:
        if self.backend is not None:
            if self.backend not in ("gloo", "nccl"):
                raise LaunchError(f"unknown backend '{self.backend}' (gloo or nccl)", ())
            if self.backend == "nccl" and not torch.cuda.is_available():
                raise LaunchError("backend nccl needs CUDA, which this machine does not have", ())
            return self.backend
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= self.nproc else "gloo"


@dataclass(frozen=True)
class RankContext:
    """What a rank's function knows about its place in the job."""

    rank: int
    world: int
    backend: str
    device: torch.device
    collective_timeout_s: float = 30.0   # what a subgroup's collectives get too (torch's default for them is 30 min)

    def step_start(self) -> float:
        """The clock at which a timed training step starts, every rank having arrived.

        A rank that spent longer between steps (comparing with `--check`'s
        reference, or simply descheduled) would otherwise make its peers'
        first collective of the step wait for it, and that wait would be
        counted as the step's: 4-5x the step on the demo's MLP with `--check`.
        The barrier is outside the timed span, as the step it precedes is."""
        if self.world > 1:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dist.barrier()
        return time.perf_counter()


def under_torchrun() -> bool:
    """True when launched by torchrun (or any launcher that sets the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def launch(fn: Callable[..., Any], args: tuple = (), config: LaunchConfig | None = None) -> list[Any]:
    """Run `fn(ctx, *args)` on every rank; the list of the ranks' results, by rank.

    `fn` must be a module-level function (it is sent to spawned processes
    by reference) and return something `json.dumps` accepts. Under torchrun
    the list holds this rank's result only.
    """
    if _reimporting_the_script():
        sys.stderr.write(f"parsat: {UNGUARDED}\n")
        sys.stderr.flush()
        os._exit(REIMPORTED_EXIT)
    config = config or LaunchConfig(nproc=1)
    try:   # the CLI's bounds (a timeout of inf was an OverflowError in timedelta), for API callers too
        check_all("run", {"--nproc": config.nproc, "--timeout": config.timeout_s,
                          "--collective-timeout": config.collective_timeout_s})
    except BoundError as err:
        raise LaunchError(str(err), ()) from None
    backend = config.resolved_backend()
    if under_torchrun():
        return [_run_joined(fn, args, backend, config)]
    if config.nproc > MAX_LOCAL_RANKS:
        raise LaunchError(f"{config.nproc:,} ranks cannot be started on this machine: parsat starts at most "
                          f"{MAX_LOCAL_RANKS} local ranks (one process each); run it under torchrun across "
                          "machines", ())
    site = unguarded_call_site()
    if site is not None:   # told before any rank re-runs the script's top level (minutes, if it optimizes first)
        raise LaunchError(f"{site[0]}:{site[1]}: {BEFORE_SPAWN}", ())
    return _spawn(fn, args, backend, config)


def _reimporting_the_script() -> bool:
    """Whether this process is a spawned child still importing its parent's script (spawn runs it as
    `__mp_main__` before the child's target): `launch` called then is the script's top level, unguarded."""
    return bool(getattr(mp.current_process(), "_inheriting", False))  # multiprocessing's own test of this


def _run_joined(fn, args, backend: str, config: LaunchConfig) -> Any:
    world = int(os.environ["WORLD_SIZE"])
    if world != config.nproc:
        raise LaunchError(f"torchrun started {world} ranks but the job asks for {config.nproc}", ())
    rank = int(os.environ["RANK"])
    device = _device(backend, int(os.environ.get("LOCAL_RANK", rank)))
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=config.collective_timeout_s))
    try:
        return fn(RankContext(rank, world, backend, device, config.collective_timeout_s), *args)
    finally:
        if owned:
            dist.destroy_process_group()


def share_cores(world: int, rank: int) -> None:
    """Give each of `world` local ranks its share of the cores, as torchrun does (it sets OMP_NUM_THREADS=1), and
    keep rank `rank` on its own share (CPU affinity; ranks are spawned one per share of the cores or fewer).

    Left alone, every rank starts one thread per core: 2 ranks on 2 cores
    then run 4 spinning threads, and an operator large enough to go
    parallel waits for the OS scheduler (a 128x784x512 product: milliseconds
    instead of a fraction of one; steps 8x slower and far noisier). A user's
    OMP_NUM_THREADS wins, and then no rank is pinned.

    Pinned, because unpinned the demo's two ranks computed one after the
    other between collectives (their products overlapped 0.00 of the time):
    the rank woken by gloo's last message of a barrier or collective queued
    behind its peer's compute (likely Linux placing a task woken through a
    loopback socket on its waker's core), so the next collective waited a
    whole product for it, which no calibrated figure prices
    (benchmarks/demo_step.md, benchmarks/demo_collective.py). Each rank's
    threads (its own, gloo's) inherit the affinity set here, before the
    process group starts them. The price: on a box busy with other jobs a
    pinned rank cannot leave a core another job holds.
    """
    if "OMP_NUM_THREADS" in os.environ:   # set again: a forked rank's OpenMP read its fork server's environment
        threads = os.environ["OMP_NUM_THREADS"]
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        return
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = max(1, (len(cpus) or os.cpu_count() or 1) // max(1, world))
    torch.set_num_threads(share)
    if cpus and world <= len(cpus):
        os.sched_setaffinity(0, cpus[rank * share:(rank + 1) * share])


def rank_main(rank: int, world: int, backend: str, store_port: int, timeouts: tuple[float, float],
              fn: Callable[..., Any], args: tuple, messages) -> None:
    """A spawned rank (started by `rank_guard.start`): join the group, run, report; any exception becomes a
    message and exit 1. `timeouts` are the job's and one collective's (`LaunchConfig`)."""
    job_timeout_s, collective_timeout_s = timeouts
    try:
        share_cores(world, rank)
        device = _device(backend, rank)
        store = dist.TCPStore(STORE_HOST, store_port, None, is_master=False, timeout=timedelta(seconds=job_timeout_s))
        _all_arrived(store, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=collective_timeout_s))
        result = fn(RankContext(rank, world, backend, device, collective_timeout_s), *args)
        messages.put((rank, "ok", json.dumps(result)))
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - every failure must reach the parent
        detail = "".join(traceback.format_exception(err)[-6:])
        summary = _summary(err)
        messages.put((rank, "error", json.dumps({"summary": summary, "traceback": detail})))
        messages.close()
        messages.join_thread()
        os._exit(1)


def _all_arrived(store, world: int) -> None:
    """Wait, within the job's timeout (the store's), until every rank has started and reached the store.

    Ranks start seconds apart on a loaded box (each spawns a Python and
    imports torch), and the process group's connection is bounded by the
    collective timeout, which a user sets to seconds to catch a hung
    collective fast: the first rank then timed out waiting for a peer that
    was still importing, and the job failed blaming the wrong rank. Once all
    have arrived, joining the group takes milliseconds."""
    if store.add("parsat/arrived", 1) == world:
        store.set("parsat/all_arrived", "1")
    store.wait(["parsat/all_arrived"])


_SOURCE_PREFIX = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


_ASKED = re.compile(r"(?:tried to allocate|allocate) (\d+) bytes|Tried to allocate ([\d.]+ [KMGT]?i?B)")


def _summary(err: BaseException) -> str:
    """One line for the user: the exception's type and first line, without the C++ source position that
    gloo and NCCL put in front ("[/.../unbound_buffer.cc:78] Timed out ..."); running out of memory is said
    as such (torch's CPU allocator says "DefaultCPUAllocator: can't allocate memory", CUDA's raises
    OutOfMemoryError), with what the rank asked for."""
    text = f"{err}".strip()
    if out_of_memory(err):
        asked = _ASKED.search(text)
        size = "" if asked is None else (f" (an allocation of {fmt_bytes(int(asked.group(1)))} failed)"
                                         if asked.group(1) else f" (an allocation of {asked.group(2)} failed)")
        return (f"ran out of memory{size}: give it less work (a smaller model, batch or --size) or more memory "
                "(fewer ranks on this machine)")
    first = text.splitlines()[0] if text else ""
    return f"{type(err).__name__}: {_SOURCE_PREFIX.sub('', first)}"[:500]


def out_of_memory(err: BaseException) -> bool:
    """Whether `err` is an allocation that failed: MemoryError, CUDA's OutOfMemoryError, or the CPU
    allocator's RuntimeError."""
    oom = getattr(torch, "OutOfMemoryError", ())
    return isinstance(err, (MemoryError, *((oom,) if oom else ()))) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "did not finish"
    if code < 0:
        try:
            return f"died (killed by signal {signal.Signals(-code).name})"
        except ValueError:
            return f"died (signal {-code})"
    return f"died (exit code {code})"


# what the fork server imports for every rank: torch, and what a rank's job reads beside it (`parsat run`'s ranks
# run `executor.run_rank`; a script's ranks re-import it, and it imports parsat: 0.3 and 0.6 CPU s a rank each)
PRELOADED = ("torch", "torch.distributed", "parsat.backend.launch", "parsat.backend.executor", "parsat.api")


def _start_method():
    """The multiprocessing context ranks start in: the fork server where the platform has one (Linux, macOS) and
    it starts, with `PRELOADED` imported in it once; spawn elsewhere (Windows), or where its socket cannot be made
    (a temporary folder whose path is too long for a Unix socket's: a deep TMPDIR), every rank importing torch
    itself. The server is multiprocessing's own, one per launcher process, shared by its jobs (a test suite's or
    a script's successive `launch` calls), and it ends when the launcher and its ranks have (its `alive` pipe):
    like the resource tracker that spawn starts, it holds no job's state, and it never runs a job's code."""
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOADED))
        try:
            forkserver.ensure_running()
            return context
        except OSError:
            pass
    return mp.get_context("spawn")


def _spawn(fn, args, backend: str, config: LaunchConfig) -> list[Any]:
    context = _start_method()
    messages = context.Queue()
    # the rendezvous: served by this process for as long as the job runs, gone with it
    store = dist.TCPStore(STORE_HOST, 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=config.timeout_s))
    # the job is pickled here and unpickled by the rank only after it is bound to this process's life
    # (`rank_guard`): unpickling imports `fn`'s module (and torch, where ranks are spawned), seconds a killed
    # launcher must not leave it
    timeouts = (config.timeout_s, config.collective_timeout_s)
    procs = [context.Process(target=rank_guard.start, name=f"parsat-rank-{rank}", daemon=True,
                             args=(os.getpid(), dict(os.environ),
                                   pickle.dumps((rank_main, (rank, config.nproc, backend, store.port, timeouts, fn,
                                                             args))),
                                   messages))
             for rank in range(config.nproc)]
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + config.timeout_s
        first_failure: float | None = None
        while len(results) < config.nproc:
            _drain(messages, results, errors, wait=0.05)
            now = time.monotonic()
            for rank, proc in enumerate(procs):
                if rank not in results and rank not in errors and proc.exitcode is not None:
                    _drain(messages, results, errors, wait=0.2)  # its last words may still be in the pipe
                    if rank not in results and rank not in errors:
                        errors[rank] = (_exit_reason(proc.exitcode) if proc.exitcode != 0
                                        else "exited without reporting a result")
            if errors and first_failure is None:
                first_failure = now
            if first_failure is not None and now - first_failure >= GRACE_S:
                break
            if now > deadline:
                break
        if len(results) == config.nproc:
            return [results[r] for r in range(config.nproc)]
        running = [r for r in range(config.nproc) if r not in results and r not in errors]
        unguarded = [r for r, proc in enumerate(procs) if proc.exitcode == REIMPORTED_EXIT]
        if unguarded:
            raise LaunchError(f"distributed job failed: {UNGUARDED}", unguarded)
        message, blame = _failure_message(errors, running, config, timed_out=not errors)
        raise LaunchError(message, blame)
    finally:
        _end_all(procs)
        messages.close()


def _drain(messages, results: dict, errors: dict, wait: float) -> None:
    try:
        item = messages.get(timeout=wait)
    except queue_module.Empty:
        return
    while True:
        rank, status, payload = item
        if status == "ok":
            results[rank] = json.loads(payload)
        else:
            errors[rank] = "failed: " + json.loads(payload)["summary"]
        try:
            item = messages.get_nowait()
        except queue_module.Empty:
            return


def _failure_message(errors: dict[int, str], running: list[int], config: LaunchConfig,
                     timed_out: bool) -> tuple[str, list[int]]:
    """The error text and the ranks to blame, likeliest cause first.

    A rank that died without a word is the likeliest cause (the others'
    errors are often its echo); when the errors are collective timeouts and
    some rank is still running, that rank is hanging and is named first.
    """
    died = [r for r in errors if errors[r].startswith("died")]  # in order of arrival
    failed = [r for r in errors if r not in died]
    waiting = bool(failed) and all("timed out" in errors[r].lower() or "timeout" in errors[r].lower()
                                   for r in failed)
    parts = [f"rank {r} {errors[r]}" for r in died]
    blame = list(died)
    if running:
        names = ", ".join(str(r) for r in running)
        plural = "s" if len(running) > 1 else ""
        if timed_out:
            note = f" after the job timeout of {config.timeout_s:g} s"
        elif waiting:
            note = " (hanging: its peers timed out waiting for it)"
        else:
            note = " (ended by the launcher)"
        running_part = f"rank{plural} {names} still running{note}"
        if timed_out or waiting:
            parts.append(running_part)
            blame += running
    parts += [f"rank {r} {errors[r]}" for r in failed]
    blame += failed
    if running and not (timed_out or waiting):
        parts.append(running_part)
    return "distributed job failed: " + "; ".join(parts), blame


def _end_all(procs) -> None:
    """Terminate, then kill, then reap every child: no process outlives the job."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + TERMINATE_S
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=TERMINATE_S)
