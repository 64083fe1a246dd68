"""Faults inside a real `parsat run`: the job ends in time, names the rank, exits 1, leaves no process behind.

tests/test_backend_launch.py injects faults into a toy worker given to
`launch`; here they are injected into the real training step, through the
CLI: `run_plan` is pointed at `faulty_run_rank`, which wraps the
executor's `run_rank` and, on rank 1, misbehaves at the Nth parallel
operator of step 1 (mid-step, with collectives already done and more to
come). The fault is chosen by the PARSAT_TEST_FAULT environment variable,
which spawned ranks inherit:

* `raise`  : an exception in the forward pass;
* `kill`   : SIGKILL (an OOM kill, a segfault);
* `hang`   : the rank stops in a point-to-point receive its peer never sends
  (a hang in communication); the job's --timeout ends it, or, when
  --collective-timeout is the shorter, its peer's collective times out and
  the hanging rank is named as such.
* `stall`  : the rank stops outside communication (a deadlock, an endless
  loop); its peer's next collective times out.

After each, the process table is checked: no child of this process that
was a spawned rank may still be alive.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from parsat.backend import executor  # noqa: E402
from parsat.cli import main  # noqa: E402

FAULT_AT = 2  # the Nth parallel operator of step 1 on rank 1


def faulty_run_rank(ctx, pcg, config, graph, library=None, batch=None):
    """The executor's run_rank, with rank 1 misbehaving mid-step as PARSAT_TEST_FAULT says."""
    fault = os.environ.get("PARSAT_TEST_FAULT", "")
    real_parallel_op = executor.parallel_op
    calls = {"n": 0}

    def parallel_op(*args, **kwargs):
        calls["n"] += 1
        if ctx.rank == 1 and calls["n"] == FAULT_AT:
            if fault == "raise":
                raise RuntimeError("injected fault in the forward pass")
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "hang":
                dist.recv(torch.zeros(1, dtype=torch.float64), src=0)  # rank 0 never sends
            if fault == "stall":
                time.sleep(3600)
        return real_parallel_op(*args, **kwargs)

    executor.parallel_op = parallel_op
    try:
        return executor.run_rank(ctx, pcg, config, graph, library, batch)
    finally:
        executor.parallel_op = real_parallel_op


def plan_path(tmp_path: Path) -> Path:
    """Data parallelism of a small MLP on 2 devices: collectives forward (gather) and backward (all-reduce)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import mesh_plans
    from parsat.backend.executor import operator_library

    plan = mesh_plans.data_parallel_mlp(operator_library(), 2, batch=8, d_in=6, d_hidden=4, d_out=2)
    path = tmp_path / "plan.json"
    mesh_plans.save_plan(plan, path)
    assert sum(1 for n in plan.pcg.nodes if n.kind == "parallel") > FAULT_AT
    return path


def _process_table() -> dict[int, tuple[str, int, str]]:
    """pid -> (state, parent pid, command line) for every process, from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        table[int(entry.name)] = (fields[0], int(fields[1]), cmdline)
    return table


def ranks_started_by(launcher: int, table: dict[int, tuple[str, int, str]]) -> list[int]:
    """The live ranks `launcher` started, in process table `table`: its children that multiprocessing spawned, and
    the children of its fork server (`launch._start_method`), which forks them."""
    servers = {pid for pid, (_, ppid, cmd) in table.items() if ppid == launcher and "forkserver" in cmd}
    return [pid for pid, (state, ppid, cmd) in table.items()
            if state != "Z" and ((ppid == launcher and "spawn_main" in cmd) or ppid in servers)]


def descendants(pid: int, table: dict[int, tuple[str, int, str]]) -> list[int]:
    """Every process below `pid` in process table `table` (its children, theirs, ...)."""
    found, frontier = [], [pid]
    while frontier:
        below = [child for child, (_, ppid, _) in table.items() if ppid in frontier]
        found += below
        frontier = below
    return found


def spawned_children() -> list[tuple[int, str]]:
    """Live ranks this process started (the process table, from /proc)."""
    table = _process_table()
    return [(pid, table[pid][2][:120]) for pid in ranks_started_by(os.getpid(), table)]


@pytest.fixture
def faulty(monkeypatch):
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to read the process table")
    monkeypatch.setattr(executor, "run_rank", faulty_run_rank)
    assert not spawned_children(), "ranks left over from an earlier test"

    def arm(fault: str) -> None:
        monkeypatch.setenv("PARSAT_TEST_FAULT", fault)

    return arm


CASES = [
    ("raise", 60, r"rank 1 failed: RuntimeError: injected fault in the forward pass"),
    # slow: test_backend_launch's fast [kill] case drives the same supervision (`launch._spawn`: a rank killed by
    # SIGKILL mid-job named "rank 1 died (killed by signal SIGKILL)", its peers ended, no rank left); the
    # [raise] case here keeps the CLI's message and the process-table check fast
    pytest.param("kill", 60, r"rank 1 died \(killed by signal SIGKILL\)", marks=pytest.mark.slow),
    pytest.param("hang", 12, r"rank(s 0, 1|s 1, 0| 1) still running", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("fault,timeout,expect", CASES)
def test_a_faulty_rank_ends_the_run_naming_it(faulty, tmp_path, capsys, fault, timeout, expect):
    run_faulty(faulty, tmp_path, capsys, fault, ["--timeout", str(timeout)], timeout, expect)


@pytest.mark.parametrize("fault,expect", [
    # a deadlock: both ranks wait and both time out, in either order
    ("hang", r"rank 1 failed: RuntimeError: Timed out waiting 4000ms for recv operation"),
    ("stall", r"rank 1 still running \(hanging: its peers timed out waiting for it\)"),
])
def test_a_hanging_rank_is_named_when_the_collective_timeout_fires_first(faulty, tmp_path, capsys, fault, expect):
    """Rank 1 hangs in a receive, or outside communication; a 4 s collective timeout ends the job, naming rank 1.

    The message says which timeout fired (the collective's 4000 ms, or peers that timed out waiting); the
    wall clock is only held to the job's own 60 s, a ceiling that catches a hang: on a busy box the
    collective timeout's job took 16 s, which says nothing about which timeout ended it."""
    run_faulty(faulty, tmp_path, capsys, fault, ["--timeout", "60", "--collective-timeout", "4"], 60, expect)


def test_a_timeout_that_is_not_positive_is_refused(tmp_path, capsys):
    code = main(["run", str(plan_path(tmp_path)), "--nproc", "2", "--backend", "gloo", "--collective-timeout", "0"])
    err = capsys.readouterr().err
    assert code == 1 and "--collective-timeout must be a positive number of seconds, at most 604,800, got 0.0" in err
    assert "Traceback" not in err, err


def run_faulty(faulty, tmp_path: Path, capsys, fault: str, timeouts: list[str], timeout: float, expect: str) -> None:
    """Run the plan with `fault` armed; assert it fails in time, naming the rank (`expect`), and leaves no rank."""
    import re

    path = plan_path(tmp_path)
    faulty(fault)
    start = time.monotonic()
    code = main(["run", str(path), "--nproc", "2", "--backend", "gloo", "--steps", "3", "--check"] + timeouts)
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    print(f"{fault} {' '.join(timeouts)}: exit {code} after {elapsed:.1f} s: {err.strip()}")  # recorded in benchmarks/RELIABILITY.md
    assert code == 1, err
    assert err.startswith("parsat run: error: distributed job failed:"), err
    assert re.search(expect, err), err
    assert "Traceback" not in err
    assert elapsed < timeout + 10, f"took {elapsed:.1f} s with --timeout {timeout}"
    deadline = time.monotonic() + 5
    while spawned_children() and time.monotonic() < deadline:  # reaped by the launcher; allow the kernel a moment
        time.sleep(0.1)
    assert not spawned_children(), f"ranks outlived the job: {spawned_children()}"


@pytest.mark.slow
def test_the_same_plan_runs_clean_without_a_fault(faulty, tmp_path, capsys):
    """The control: the wrapper itself changes nothing."""
    path = plan_path(tmp_path)
    faulty("")
    code = main(["run", str(path), "--nproc", "2", "--backend", "gloo", "--steps", "2", "--check", "--json",
                 "--timeout", "60"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and json.loads(out[-1])["check"] == "passed"
    assert not spawned_children()


# ------------------------------------------------------------------ the launcher itself killed (issue 20)


def _alive(pids) -> list[int]:
    """The pids that are still running (a zombie has ended: it only waits to be reaped)."""
    table = _process_table()
    return [pid for pid in pids if pid in table and table[pid][0] != "Z"]


@pytest.mark.parametrize("how,when", [(signal.SIGKILL, 3.0), (signal.SIGKILL, 0.0),
                                      pytest.param(signal.SIGTERM, 3.0, marks=pytest.mark.slow)],
                         ids=["SIGKILL mid-training", "SIGKILL while the ranks start", "SIGTERM"])
def test_ranks_die_with_their_launcher_and_nothing_is_left_behind(tmp_path, how, when):
    """`parsat run` killed (SIGKILL: an OOM kill, a parent's subprocess timeout) mid-training, or as soon as its
    ranks exist (while they still import torch): within 10 s no process it started is running (the process
    table), and it left no `parsat-launch-*` folder."""
    import subprocess
    import sys

    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to read the process table")
    path = plan_path(tmp_path)
    # a short temporary folder: the fork server's socket is made in it (a deep one makes `launch` spawn instead)
    scratch = Path(tempfile.mkdtemp(prefix="parsat-kill-", dir="/tmp"))
    env = {**os.environ, "TMPDIR": str(scratch)}
    env.pop("PARSAT_TEST_FAULT", None)
    launcher = subprocess.Popen([sys.executable, "-m", "parsat", "run", str(path), "--nproc", "2", "--backend",
                                 "gloo", "--steps", "10000000", "--timeout", "600"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        ranks: list[int] = []
        while time.monotonic() < deadline and launcher.poll() is None:
            ranks = ranks_started_by(launcher.pid, _process_table())
            if len(ranks) == 2:
                break
            time.sleep(0.2)
        assert len(ranks) == 2, f"the ranks did not start: {launcher.stderr.read().decode() if launcher.poll() else ''}"
        time.sleep(when)  # 3 s: well into training (each rank joined the group and runs steps)
        assert launcher.poll() is None and len(_alive(ranks)) == 2
        children = descendants(launcher.pid, _process_table())   # the ranks, the fork server, the resource tracker
        launcher.send_signal(how)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _alive(children)
        assert not left, f"processes outlived the launcher by 10 s: {[_process_table().get(p) for p in left]}"
        assert not list(scratch.glob("parsat-launch-*")), list(scratch.iterdir())
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        shutil.rmtree(scratch, ignore_errors=True)
