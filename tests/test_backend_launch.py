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
    results = launch(worker_sum, (str(tmp_path),), LaunchConfig(nproc=3, **FAST))
    assert results == [{"rank": r, "total": 6.0} for r in range(3)]
    assert all(_gone(pid) for pid in _pids(tmp_path))


@pytest.mark.parametrize("fault,expect", [
    ("raise", r"rank 1 failed: ValueError: boom in the forward pass"),
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
