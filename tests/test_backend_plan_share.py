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


CASES = ("rank0-only", "same", "different", "none-on-0")


def _rank(rank: int, world: int, init: str, out: str) -> None:
    """Every case in turn in one process group (a refusal is raised on every rank after the same all_gather, so
    the group is in step for the next case): one spawn of two processes importing torch instead of one per case."""
    from parsat.backend.parallelize import _resolve_plan
    from parsat.backend.plan_share import PlanMismatch, fingerprint, shared_plan

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    one, two = _plans()
    for case in CASES:
        held = {"rank0-only": [one, None], "same": [one, one], "different": [one, two], "none-on-0": [None, one]}[case]
        try:
            pcg, graph = shared_plan(held[rank], _resolve_plan, torch.device("cpu"))
            result = {"fingerprint": fingerprint(pcg, graph).hex(), "expected": fingerprint(*_resolve_plan(one)).hex()}
        except PlanMismatch as err:
            result = {"error": str(err)}
        Path(out, f"{case}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict[str, list[dict]]:
    """case -> each rank's result (its plan's fingerprint and rank 0's, or the refusal)."""
    folder = tmp_path_factory.mktemp("plan-share")
    mp.spawn(_rank, args=(2, f"file://{folder}/store", str(folder)), nprocs=2, join=True)
    return {case: [json.loads((folder / f"{case}-{rank}.json").read_text()) for rank in range(2)] for case in CASES}


@pytest.mark.parametrize("case", ["rank0-only", "same"])
def test_every_rank_runs_rank_0_s_plan(shared, case):
    results = shared[case]
    assert all("error" not in r and r["fingerprint"] == r["expected"] for r in results), results


def test_ranks_with_different_plans_are_refused_on_every_rank(shared):
    results = shared["different"]
    assert all("rank(s) 1 hold another plan than rank 0" in r.get("error", "") for r in results), results


def test_a_plan_only_on_other_ranks_is_refused(shared):
    results = shared["none-on-0"]
    assert all("rank 0 holds no plan" in r.get("error", "") for r in results), results
