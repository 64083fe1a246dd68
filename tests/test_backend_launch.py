"""The launcher: results by rank, and every fault ends the job naming the rank, with no process left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from parsat.backend.launch import LaunchConfig, LaunchError, RankContext, launch  # noqa: E402

# collectives time out in 2 s; the job's timeout is a ceiling that catches a hang: ranks that import torch at
# load 8 on 2 cores took 30 s to start, and a rank's fault must be named whatever the load (the message says
# "still running after the job timeout" where the launcher waited for the ceiling instead)
FAST = dict(backend="gloo", timeout_s=300, collective_timeout_s=2)
# a job that must succeed gets the launcher's default collective timeout: gloo's connection of the ranks
# (`init_process_group`, within one collective timeout) once took over 2 s on the 2-core box at load 9, and
# the cores test failed with "connectFullMesh ... Connection closed by peer" where nothing was wrong
SURE = dict(backend="gloo", timeout_s=300)


def _note_pid(folder: str, ctx: RankContext) -> None:
    Path(folder, f"rank{ctx.rank}.pid").write_text(str(os.getpid()))


def worker_sum(ctx: RankContext, folder: str) -> dict:
    _note_pid(folder, ctx)
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return {"rank": ctx.rank, "total": float(t)}


def worker_fault(ctx: RankContext, folder: str, fault: str) -> None:
    """Rank 1 misbehaves after one good collective; the others carry on with the step."""
    _note_pid(folder, ctx)
    t = torch.ones(4)
    dist.all_reduce(t)
    if ctx.rank == 1:
        if fault == "raise":
            raise ValueError("boom in the forward pass")
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "hang_in_collective":  # a collective its peers never join
            dist.all_reduce(t)
        if fault == "hang":
            time.sleep(600)
    if fault == "hang_all":
        time.sleep(600)
    if fault != "hang_in_collective":
        dist.all_reduce(t)


def _pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in folder.glob("rank*.pid")]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/status").exists() and "zombie" in Path(f"/proc/{pid}/status").read_text()


@pytest.mark.slow
def test_results_come_back_by_rank(tmp_path):
    results = launch(worker_sum, (str(tmp_path),), LaunchConfig(nproc=3, **SURE))
    assert results == [{"rank": r, "total": 6.0} for r in range(3)]
    assert all(_gone(pid) for pid in _pids(tmp_path))


@pytest.mark.parametrize("fault,expect", [
    # slow: test_reliability_faults' fast [raise] case drives the same supervision (`launch._spawn`: a rank's
    # exception ends the job as "rank 1 failed: <its error>", no rank left), through `parsat run`; the [kill]
    # case here keeps LaunchError.ranks checked fast
    pytest.param("raise", r"rank 1 failed: ValueError: boom in the forward pass", marks=pytest.mark.slow),
    ("kill", r"rank 1 died \(killed by signal SIGKILL\)"),
    ("hang_in_collective", r"rank 1 failed: .*"),
    pytest.param("hang", r"failed: rank 1 still running \(hanging: its peers timed out waiting for it\); "
                         r"rank 0 failed", marks=pytest.mark.slow),
])
def test_fault_ends_the_job_naming_the_rank(tmp_path, fault, expect):
    start = time.monotonic()
    with pytest.raises(LaunchError, match=expect) as info:
        launch(worker_fault, (str(tmp_path), fault), LaunchConfig(nproc=2, **FAST))
    elapsed = time.monotonic() - start
    assert info.value.ranks[0] == 1
    assert elapsed < 200, f"took {elapsed:.1f} s to end"
    pids = _pids(tmp_path)
    assert len(pids) == 2 and all(_gone(pid) for pid in pids), "a rank outlived the job"


@pytest.mark.slow
def test_job_timeout_names_every_running_rank(tmp_path):
    config = LaunchConfig(nproc=2, backend="gloo", timeout_s=4, collective_timeout_s=30)
    with pytest.raises(LaunchError, match=r"ranks 0, 1 still running after the job timeout of 4 s"):
        launch(worker_fault, (str(tmp_path), "hang_all"), config)
    assert all(_gone(pid) for pid in _pids(tmp_path))


def test_bad_configuration_is_refused():
    with pytest.raises(LaunchError, match="--nproc must be a whole number from 1 to 1,048,576, got 0"):
        launch(worker_sum, ("x",), LaunchConfig(nproc=0, backend="gloo"))
    with pytest.raises(LaunchError, match="--collective-timeout must be a positive number of seconds, at most"):
        launch(worker_sum, ("x",), LaunchConfig(nproc=1, backend="gloo", collective_timeout_s=float("inf")))
    with pytest.raises(LaunchError, match="parsat starts at most 256 local ranks"):
        launch(worker_sum, ("x",), LaunchConfig(nproc=257, backend="gloo"))
    with pytest.raises(LaunchError, match="unknown backend"):
        launch(worker_sum, ("x",), LaunchConfig(nproc=1, backend="mpi"))
    if not torch.cuda.is_available():
        with pytest.raises(LaunchError, match="nccl needs CUDA"):
            launch(worker_sum, ("x",), LaunchConfig(nproc=1, backend="nccl"))


def worker_cores(ctx: RankContext) -> dict:
    tasks = [(Path(f"/proc/self/task/{tid}/comm").read_text().strip(), sorted(os.sched_getaffinity(int(tid))))
             for tid in os.listdir("/proc/self/task")]
    return {"cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
            "gloo": [cpus for name, cpus in tasks if "gloo" in name]}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or "OMP_NUM_THREADS" in os.environ, reason="needs 2 cores and no OMP_NUM_THREADS")
def test_spawned_ranks_run_on_their_own_cores():
    """Before: both ranks could run on every core, and Linux woke the rank that a loopback message (gloo) made
    runnable on its sender's core, behind the sender's compute: the demo's two ranks computed one after the
    other between collectives (benchmarks/demo_collective.py: their products overlapped 0.00 of the time)."""
    results = launch(worker_cores, (), LaunchConfig(nproc=2, **SURE))
    allowed = sorted(os.sched_getaffinity(0))
    share = len(allowed) // 2
    for rank, result in enumerate(results):
        assert result["cpus"] == allowed[rank * share:(rank + 1) * share]
        assert result["threads"] == share
        # gloo's threads (its transport loop, the process group's workers), started after the pinning, too
        assert result["gloo"] and all(cpus == result["cpus"] for cpus in result["gloo"]), result
    assert not set(results[0]["cpus"]) & set(results[1]["cpus"])


def test_share_cores_pins_each_rank_to_its_share(monkeypatch):
    """Rank r of `world` gets the r-th share of the cores this process may use; none when the ranks outnumber
    the cores (they must share) or when the user set OMP_NUM_THREADS (the user's placement and count win)."""
    from parsat.backend import launch as launch_module

    pinned, threads = [], []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {2, 3, 5, 7, 8, 9}, raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: pinned.append((pid, list(cpus))), raising=False)
    monkeypatch.setattr(launch_module.torch, "set_num_threads", threads.append)
    launch_module.share_cores(3, 1)
    assert pinned == [(0, [5, 7])] and threads == [2]
    pinned.clear(), threads.clear()
    launch_module.share_cores(8, 7)                 # 8 ranks on 6 cores: one thread each, nobody pinned
    assert pinned == [] and threads == [1]
    threads.clear()
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    launch_module.share_cores(2, 0)                 # the user's count, set again (a forked rank's OpenMP read
    assert pinned == [] and threads == [4]          # its fork server's environment), and nobody pinned


UNGUARDED_SCRIPT = '''
from parsat.backend.launch import LaunchConfig, LaunchError, launch

def work(ctx):
    return ctx.rank

try:
    launch(work, (), LaunchConfig(nproc=2, backend="gloo", timeout_s=300))
except LaunchError as err:
    print("LAUNCH ERROR:", err)
else:
    print("RAN")
'''


def _run_script(tmp_path, text: str, *args: str, **environ: str):
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(text)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), **environ}
    return script, subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                                  timeout=240)


PROBE_SCRIPT = '''
import os
import sys
from parsat.backend.launch import LaunchConfig, launch

def probe(ctx, launcher):
    return [os.environ.get("PARSAT_PROBE", ""), "spawned" if os.getppid() == launcher else "forked"]

if __name__ == "__main__":
    for value in sys.argv[1:]:
        os.environ["PARSAT_PROBE"] = value
        print(value.upper(), launch(probe, (os.getpid(),), LaunchConfig(nproc=1, backend="gloo", timeout_s=300)))
'''


def test_each_job_s_ranks_read_the_environment_the_launcher_has_as_it_starts(tmp_path):
    """Ranks are forked from the launcher's fork server (`launch._start_method`), which started with the
    environment of the launcher's first job and keeps it: a rank of a later job still sees the launcher's
    environment as that job starts (`rank_guard.start`), e.g. a setting changed between two `launch` calls."""
    _, done = _run_script(tmp_path, PROBE_SCRIPT, "first", "second")
    assert "FIRST [['first', 'forked']]" in done.stdout, done.stdout + done.stderr
    assert "SECOND [['second', 'forked']]" in done.stdout, done.stdout + done.stderr


def test_where_the_fork_server_cannot_start_ranks_are_spawned(tmp_path):
    """The fork server listens on a Unix socket in the temporary folder; under a TMPDIR too deep for a socket's
    path (108 bytes on Linux) it cannot start, and the ranks are spawned instead: the job runs as before."""
    deep = tmp_path / ("d" * 60) / ("d" * 60)
    deep.mkdir(parents=True)
    _, done = _run_script(tmp_path, PROBE_SCRIPT, "deep", TMPDIR=str(deep))
    assert "DEEP [['deep', 'spawned']]" in done.stdout, done.stdout + done.stderr


def test_a_script_that_launches_without_a_main_guard_is_told_so_before_any_rank_starts(tmp_path):
    """Spawned ranks run the launching script's top level first; one that launches there would start the job
    again in each rank (after redoing whatever comes before it: an optimize of minutes). `launch` reads the
    script and refuses at once, naming the line (`main_guard`), before spawning a rank."""
    script, done = _run_script(tmp_path, UNGUARDED_SCRIPT)
    assert f"LAUNCH ERROR: {script}:8: " in done.stdout, done.stdout + done.stderr
    assert 'if __name__ == "__main__":' in done.stdout and "no rank was started" in done.stdout
    assert "parsat-rank" not in done.stderr and "Traceback" not in done.stderr


def test_a_script_whose_source_cannot_tell_is_stopped_by_its_ranks(tmp_path):
    """Where the script's source does not show the call (its code `exec`-ed), the ranks' own check ends the job
    with the same advice (`REIMPORTED_EXIT`), not "died (exit code 1)"."""
    hidden = "exec(compile(" + repr(UNGUARDED_SCRIPT) + ", '<hidden>', 'exec'))\n"
    _, done = _run_script(tmp_path, hidden)
    assert "LAUNCH ERROR:" in done.stdout and "no rank was started" not in done.stdout, done.stdout + done.stderr
    assert 'if __name__ == "__main__":' in done.stdout
    assert "exit code" not in done.stdout
    assert "Traceback" not in done.stderr


def test_the_main_guard_is_read_from_the_script_as_spawn_re_runs_it(tmp_path, monkeypatch):
    """`unguarded_call_site`: a call under `if __name__ == "__main__":` (either operand order, nested in a try)
    is guarded, one beside it is not; a package's `__main__` (`python -m parsat`) and a main module without a
    file (the REPL) are not re-run by spawn, so never refused."""
    import sys
    import types

    from parsat.backend.main_guard import unguarded_call_site

    source = (
        "import sys\n"
        "def site():\n"
        "    return CHECK(sys._getframe(1))\n"
        "unguarded = site()\n"
        "if '__main__' == __name__:\n"
        "    try:\n"
        "        guarded = site()\n"
        "    finally:\n"
        "        pass\n")
    path = tmp_path / "script.py"
    path.write_text(source)
    main = types.ModuleType("__main__")
    main.__file__, main.__spec__ = str(path), None
    main.CHECK = unguarded_call_site
    monkeypatch.setitem(sys.modules, "__main__", main)
    exec(compile(source, str(path), "exec"), vars(main))
    assert vars(main)["unguarded"] == (str(path), 4) and vars(main)["guarded"] is None
    main.__spec__ = types.SimpleNamespace(name="parsat.__main__")
    exec(compile(source, str(path), "exec"), vars(main))
    assert vars(main)["unguarded"] is None
    main.__spec__ = None
    del main.__file__
    exec(compile(source, str(path), "exec"), vars(main))
    assert vars(main)["unguarded"] is None
