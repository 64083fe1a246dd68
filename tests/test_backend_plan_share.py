"""One plan for every rank (`backend.plan_share`): rank 0's plan reaches the ranks that hold none, and ranks
that hold different plans are refused on every rank, naming them; two gloo processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _plans():
    """Two different one-device-per-rank plans of the same graph (data parallel, and the graph redundant)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import mesh_plans  # noqa: E402

    from parsat.backend.executor import operator_library
    from parsat.ir.models import build_example

    graph = build_example("mlp", {"batch": 8, "d_in": 8, "d_hidden": 8, "d_out": 4})
    library = operator_library()
    one = mesh_plans.plan_dict(graph, mesh_plans.redundant_pcg(graph, library, 2))
    from parsat.ir.data_parallel import data_parallel_pcg

    two = mesh_plans.plan_dict(graph, data_parallel_pcg(graph, library, 2))
    return one, two


def _rank(rank: int, world: int, init: str, case: str, out: str) -> None:
    from parsat.backend.parallelize import _resolve_plan
    from parsat.backend.plan_share import PlanMismatch, fingerprint, shared_plan

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    one, two = _plans()
    held = {"rank0-only": [one, None], "same": [one, one], "different": [one, two], "none-on-0": [None, one]}[case]
    try:
        pcg, graph = shared_plan(held[rank], _resolve_plan, torch.device("cpu"))
        result = {"fingerprint": fingerprint(pcg, graph).hex(), "expected": fingerprint(*_resolve_plan(one)).hex()}
    except PlanMismatch as err:
        result = {"error": str(err)}
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _run(tmp_path: Path, case: str) -> list[dict]:
    init = f"file://{tmp_path}/store"
    mp.spawn(_rank, args=(2, init, case, str(tmp_path)), nprocs=2, join=True)
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("case", ["rank0-only", "same"])
def test_every_rank_runs_rank_0_s_plan(tmp_path, case):
    results = _run(tmp_path, case)
    assert all("error" not in r and r["fingerprint"] == r["expected"] for r in results), results


def test_ranks_with_different_plans_are_refused_on_every_rank(tmp_path):
    results = _run(tmp_path, "different")
    assert all("rank(s) 1 hold another plan than rank 0" in r.get("error", "") for r in results), results


def test_a_plan_only_on_other_ranks_is_refused(tmp_path):
    results = _run(tmp_path, "none-on-0")
    assert all("rank 0 holds no plan" in r.get("error", "") for r in results), results
