"""Process groups, parallel operators and whole training steps on meshes of CPU ranks (gloo).

One job per mesh runs every case (process start-up dominates the time).
On 4 ranks as dp 2 x tp 2: the process group of every axis holds the ranks
`Mesh.group` names; every row of the parallel-operator table on either
axis, with the input already placed on the other axis in every legal way
(free, replica, sharded on another dim, sharded on the same dim: nested),
forward and backward against the logical tensors each rank computes from
the same seeds, with the collectives it counted; then the hand-built 2x2
plans of benchmarks/mesh_plans.py (DP x TP, TP x SP with reduce_scatter /
all_gather, ZeRO-3 x TP) trained for 3 steps with `--check` against the
original graph in one process, and their measured communication equal to
the ring formulas, in all, per axis and for the gradient synchronisation.
On 3 ranks (one axis of size 3): data parallelism, the Megatron MLP, and a
plan that mixes a split branch with a whole one (free values: redundant
compute, no gradient sync). On 8 ranks (2x2x2, slow): hybrid sharding x TP.
"""

from __future__ import annotations

import sys
from fractions import Fraction
from math import prod
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import mesh_plans  # noqa: E402
from mesh_plans import MeshPlanBuilder  # noqa: E402

from parsat.backend.collectives import PARALLEL_TABLE, CommCounter, MeshGroups, parallel_op  # noqa: E402
from parsat.backend.executor import TrainConfig, operator_library, run_many, run_plan  # noqa: E402
from parsat.backend.launch import LaunchConfig, RankContext, launch  # noqa: E402
from parsat.ir import models  # noqa: E402
from parsat.ir.data_parallel import data_parallel_pcg  # noqa: E402
from parsat.ir.mesh import Mesh  # noqa: E402
from parsat.ir.placement import (FREE, PARTIAL, REPLICA, Placement, PlacementError, apply_parallel,  # noqa: E402
                                 piece_index, shard)

LIBRARY = operator_library()
MESH = Mesh.of((2, 2), names=("dp", "tp"))
SHAPE = (8, 12)
STEPS = 3


# ------------------------------------------------------------------ one parallel operator, every placement


def _full(seed: int, shape=SHAPE) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _input_code(op: str, dim: int | tuple | None) -> int:
    """What the operator needs on its own axis (all_to_all's `dim`: its (dim, to_dim))."""
    first = dim[0] if isinstance(dim, tuple) else (dim or 0)
    return {"partition": FREE, "replicate": FREE, "combine": shard(first), "all_gather": shard(first),
            "reduce": PARTIAL, "reduce_scatter": PARTIAL, "all_to_all": shard(first)}[op]


def _dims(dim: int | tuple | None) -> tuple[int | None, int | None]:
    """A case's (dim, to_dim): all_to_all's pair, or the one dim and None."""
    return dim if isinstance(dim, tuple) else (dim, None)


def op_cases() -> dict[str, tuple[str, int, int | None, int]]:
    """name -> (op, axis, dim, the input's code on the other axis): every legal combination on MESH."""
    others = {"free": FREE, "replica": REPLICA, "S0": shard(0), "S1": shard(1)}
    cases = {}
    for op in PARALLEL_TABLE:
        dims = ((0, 1) if op in ("partition", "combine", "reduce_scatter", "all_gather") else
                ((0, 1), (1, 0)) if op == "all_to_all" else (None,))
        for axis in (0, 1):
            for dim in dims:
                for label, other in others.items():
                    codes = [FREE, FREE]
                    codes[axis], codes[1 - axis] = _input_code(op, dim), other
                    try:
                        apply_parallel(Placement(tuple(codes)), op, axis, *_dims(dim))
                    except PlacementError:
                        continue  # e.g. a partition on dp of a dim tp already shards: refused, tested elsewhere
                    cases[f"{op}-{MESH.names[axis]}-dim{dim}-other_{label}"] = (op, axis, dim, other)
    return cases


CASES = op_cases()


def run_op_case(ctx: RankContext, groups: MeshGroups, op: str, axis: int, dim: int | None, other: int) -> dict:
    """The operator on this rank's piece, against the logical tensors: forward, backward, counted collectives.

    The logical input X (for a partial input: the sum of one summand per
    coordinate of the axis); the output must be X's piece where the output
    placement says. Backward: a replica output is used differently by each
    coordinate of the axis (gradient G_k), any other output with one G; the
    input's gradient must be the piece of the sum of the G_k (of G).
    """
    codes = [FREE, FREE]
    codes[axis], codes[1 - axis] = _input_code(op, dim), other
    before = Placement(tuple(codes))
    here = MESH.coord(ctx.rank, axis)
    size = MESH.size(axis)
    where_in = piece_index(before, SHAPE, MESH, ctx.rank)
    if before.codes[axis] == PARTIAL:
        summands = [_full(100 + k) for k in range(size)]
        logical, piece = sum(summands), summands[here][where_in]
    else:
        logical = _full(100)
        piece = logical[where_in]
    piece = piece.clone().requires_grad_()
    counter = CommCounter()
    out, after = parallel_op(op, piece, before, axis, _dims(dim)[0], groups, counter, to_dim=_dims(dim)[1])
    where_out = piece_index(after, SHAPE, MESH, ctx.rank)
    replica_out = after.codes[axis] == REPLICA
    grads = [_full(200 + k) for k in range(size if replica_out else 1)]
    (out * grads[here if replica_out else 0][where_out]).sum().backward()
    want_grad = sum(grads)[where_in]
    return {"forward": float((out - logical[where_out]).abs().max()),
            "backward": float((piece.grad - want_grad).abs().max()),
            "after": list(after.codes), "want_after": list(apply_parallel(before, op, axis, *_dims(dim)).codes),
            "in_local": prod(before.local_shape(SHAPE, MESH.shape)),
            "out_local": prod(after.local_shape(SHAPE, MESH.shape)),
            "events": counter.to_json(), "sent": str(counter.sent())}


def expected_events(op: str, axis: int, other: int, in_local: int, out_local: int) -> list[tuple]:
    """(phase, kind, axis, elements, replicas) per collective, by the table in docs (not read from the code)."""
    name = MESH.names[axis]
    replicas = 2 if other == FREE else 1  # the ranks of the other axis run the same collective when it is free
    rows = {"partition": [("backward", "all_gather", in_local)],
            "combine": [("forward", "all_gather", out_local)],
            "replicate": [("backward", "all_reduce", in_local)],
            "reduce": [("forward", "all_reduce", in_local)],
            "reduce_scatter": [("forward", "reduce_scatter", in_local), ("backward", "all_gather", in_local)],
            "all_gather": [("forward", "all_gather", out_local), ("backward", "reduce_scatter", out_local)],
            "all_to_all": [("forward", "all_to_all", in_local), ("backward", "all_to_all", out_local)]}[op]
    return [(phase, kind, name, n, replicas) for phase, kind, n in rows]


# ------------------------------------------------------------------ process groups


GROUP_MESHES = {"2x2": ((2, 2), ("dp", "tp")), "4x1": ((4, 1), ("a", "b")), "1x2x2": ((1, 2, 2), ("x", "y", "z"))}


def run_groups(ctx: RankContext) -> dict:
    """For each mesh: per axis, this rank's group members and the sum of the members' ranks over the group."""
    out = {}
    for label, (sizes, names) in GROUP_MESHES.items():
        mesh = Mesh.of(sizes, names=names)
        groups = MeshGroups(mesh, ctx.rank, ctx.device, ctx.collective_timeout_s)
        rows = []
        for axis in range(len(mesh)):
            value = torch.tensor([float(ctx.rank)])
            dist.all_reduce(value, group=groups.group(axis))
            rows.append({"members": list(dist.get_process_group_ranks(groups.group(axis))), "sum": float(value)})
        out[label] = rows
    return out


# ------------------------------------------------------------------ the 4-rank job


def run_mesh_job(ctx: RankContext) -> dict:
    groups = MeshGroups(MESH, ctx.rank, ctx.device, ctx.collective_timeout_s)
    ops = {name: run_op_case(ctx, groups, *case) for name, case in CASES.items()}
    plans = [make(LIBRARY) for make in mesh_plans.PLANS_2X2.values()]
    config = TrainConfig(steps=STEPS, optimizer="adam", lr=0.05, check=True)
    trained = run_many(ctx, [(p.name, p.pcg, p.graph) for p in plans], config)
    return {"groups": run_groups(ctx), "ops": ops, "plans": trained}


@pytest.fixture(scope="module")
def mesh_job():
    return launch(run_mesh_job, (), LaunchConfig(nproc=4, backend="gloo", timeout_s=300))


@pytest.mark.parametrize("label", list(GROUP_MESHES))
def test_every_axis_has_one_group_per_rank_holding_the_mesh_group(mesh_job, label):
    sizes, names = GROUP_MESHES[label]
    mesh = Mesh.of(sizes, names=names)
    for rank, report in enumerate(mesh_job):
        for axis, row in enumerate(report["groups"][label]):
            assert tuple(row["members"]) == mesh.group(axis, rank)
            assert row["sum"] == sum(mesh.group(axis, rank))


def test_every_case_is_tried():
    ops = {case[0] for case in CASES.values()}
    assert ops == set(PARALLEL_TABLE)
    assert "partition-tp-dim0-other_S0" in CASES          # nested: dp shards dim 0 first, tp cuts its blocks
    assert "partition-dp-dim0-other_S0" not in CASES      # would put tp's blocks before dp's
    assert len(CASES) > 50


@pytest.mark.parametrize("op", list(PARALLEL_TABLE))
def test_parallel_operator_matches_the_logical_tensors(mesh_job, op):
    for name, (case_op, *_rest) in CASES.items():
        if case_op != op:
            continue
        for rank, report in enumerate(mesh_job):
            found = report["ops"][name]
            assert found["after"] == found["want_after"], (name, rank)
            assert found["forward"] < 1e-12 and found["backward"] < 1e-12, (name, rank, found)


@pytest.mark.parametrize("op", list(PARALLEL_TABLE))
def test_parallel_operator_sends_what_the_ring_formulas_say(mesh_job, op):
    for name, (case_op, axis, dim, other) in CASES.items():
        if case_op != op:
            continue
        for report in mesh_job:
            found = report["ops"][name]
            expected = expected_events(op, axis, other, found["in_local"], found["out_local"])
            got = [(e["phase"], e["kind"], e["axis"], e["elements"], e["replicas"]) for e in found["events"]]
            assert sorted(got) == sorted(expected), name
            assert all(e["group_size"] == 2 and e["op"] == op for e in found["events"])
            # per rank: all-gather, reduce-scatter and all-to-all (p-1)/p * n, all-reduce 2(p-1)/p * n
            formula = sum(Fraction((2 if kind == "all_reduce" else 1) * n, 2) for _, kind, _, n, _ in expected)
            assert Fraction(found["sent"]) == formula, name


@pytest.mark.parametrize("name", list(mesh_plans.PLANS_2X2))
def test_2x2_plan_trains_like_one_process(mesh_job, name):
    job = mesh_job[0]["plans"][name]
    assert job["nonfinite"] == 0
    assert job["max_rel_diff"] is not None and job["max_rel_diff"] < 1e-9, (name, job["worst"], job["max_rel_diff"])


@pytest.mark.parametrize("name", list(mesh_plans.PLANS_2X2))
def test_2x2_plan_moves_what_the_formulas_predict(mesh_job, name):
    plan = mesh_plans.PLANS_2X2[name](LIBRARY)
    job = mesh_job[0]["plans"][name]
    assert job["sent"] == plan.sent
    assert job["sent_by_axis"] == plan.sent_by_axis()
    assert job["grad_sync"] == plan.grad_sync


def test_the_2x2_figures():
    """The predictions themselves, written out (mesh_plans' default sizes), so a change to a plan shows here."""
    b, k, h, o = (mesh_plans.MLP[key] for key in ("batch", "d_in", "d_hidden", "d_out"))
    bb, s, d, f = (mesh_plans.BLOCK[key] for key in ("batch", "seq", "hidden", "ffn"))
    dp_tp, tp_sp, zero3 = (make(LIBRARY) for make in mesh_plans.PLANS_2X2.values())
    assert dp_tp.sent_by_axis() == {"dp": 2 * k * h + 2 * h * o, "tp": 2 * b * o} == {"dp": 128, "tp": 64}
    assert tp_sp.sent_by_axis() == {"dp": 20 * d + 4 * d * f + 2 * f, "tp": 20 * d + 4 * bb * s * d} \
        == {"dp": 704, "tp": 1184}
    assert zero3.sent_by_axis() == {"dp": 2 * k * h + 2 * h * o + 2 * b * o, "tp": 2 * b * o} == {"dp": 192, "tp": 64}
    assert zero3.grad_sync == k * h + h * o  # the reduce-scatters: half of DP's all-reduce volume


# ------------------------------------------------------------------ one axis of size 3


def mlp_dp(n: int, batch: int, d_in: int, d_hidden: int, d_out: int):
    """Data parallelism with the output left sharded (no gather): the textbook's gradient all-reduce only."""
    p = MeshPlanBuilder(Mesh.of((n,), names=("dp",)), LIBRARY)
    x = p.par("partition", p.leaf("x", (batch, d_in), "input"), "dp", 0)
    w1 = p.par("replicate", p.leaf("w1", (d_in, d_hidden), "weight"), "dp")
    w2 = p.par("replicate", p.leaf("w2", (d_hidden, d_out), "weight"), "dp")
    h = p.op("relu", p.op("matmul", x, w1, origin="mm1"), origin="act")
    return p.pcg((p.op("matmul", h, w2, origin="mm2"),), ("mm2",))


def mlp_megatron(n: int, batch: int, d_in: int, d_hidden: int, d_out: int):
    p = MeshPlanBuilder(Mesh.of((n,), names=("tp",)), LIBRARY)
    x = p.par("replicate", p.leaf("x", (batch, d_in), "input"), "tp")
    w1 = p.par("partition", p.leaf("w1", (d_in, d_hidden), "weight"), "tp", 1)
    w2 = p.par("partition", p.leaf("w2", (d_hidden, d_out), "weight"), "tp", 0)
    h = p.op("relu", p.op("matmul", x, w1, origin="mm1"), origin="act")
    return p.pcg((p.par("reduce", p.op("matmul", h, w2, origin="mm2"), "tp"),), ("mm2",))


def branches_split(n: int, batch: int, d_in: int, d_hidden: int, d_out: int):
    """Branch a split on rows, branch b whole (free: every rank computes it, no gradient sync), joined whole."""
    p = MeshPlanBuilder(Mesh.of((n,), names=("dp",)), LIBRARY)
    x = p.leaf("x", (batch, d_in), "input")
    wa, wb, wo = (p.leaf(k, s, "weight") for k, s in
                  (("wa", (d_in, d_hidden)), ("wb", (d_in, d_hidden)), ("wo", (2 * d_hidden, d_out))))
    a = p.op("relu", p.op("matmul", p.par("partition", x, "dp", 0), p.par("replicate", wa, "dp")))
    a = p.par("combine", a, "dp", 0)
    b = p.op("relu", p.op("matmul", x, wb))
    return p.pcg((p.op("matmul", p.op("concat", a, b, dim=1), wo),), ("mm_out",))


SMALL = dict(batch=12, d_in=8, d_hidden=12, d_out=6)
LINE_PLANS = {"mlp_dp": (mlp_dp, models.mlp), "mlp_megatron": (mlp_megatron, models.mlp),
              "branches": (branches_split, models.branches)}


def run_line_job(ctx: RankContext) -> dict:
    config = TrainConfig(steps=STEPS, optimizer="adam", lr=0.05, check=True)
    jobs = [(name, plan(ctx.world, **SMALL), graph(**SMALL, library=LIBRARY)) for name, (plan, graph)
            in LINE_PLANS.items()]
    lib = LIBRARY
    jobs.append(("data_parallel_pcg", data_parallel_pcg(models.mlp(**SMALL, library=lib), lib, ctx.world),
                 models.mlp(**SMALL, library=lib)))
    return run_many(ctx, jobs, config)


@pytest.fixture(scope="module")
def line_job():
    return launch(run_line_job, (), LaunchConfig(nproc=3, backend="gloo", timeout_s=300))[0]


def test_one_axis_of_three_trains_like_one_process_and_moves_the_formulas(line_job):
    n, (b, k, h, o) = 3, (SMALL[key] for key in ("batch", "d_in", "d_hidden", "d_out"))
    want = {"mlp_dp": 2 * (n - 1) * (k * h + h * o),            # the gradient all-reduces
            "mlp_megatron": 2 * (n - 1) * b * o,                 # one forward all-reduce
            "branches": 2 * (n - 1) * k * h + (n - 1) * b * h,   # wa's all-reduce, branch a gathered
            "data_parallel_pcg": 2 * (n - 1) * (k * h + h * o) + (n - 1) * b * o}  # + the output gathered
    for name, job in line_job.items():
        assert job["max_rel_diff"] < 1e-9 and job["nonfinite"] == 0, (name, job["worst"])
        assert job["sent"] == want[name], name
    assert line_job["branches"]["grad_sync"] == 2 * (n - 1) * k * h  # wb and wo are free: no sync


# ------------------------------------------------------------------ slow: design figures, 8 ranks


@pytest.mark.slow
@pytest.mark.parametrize("plan,expected", [(mlp_dp, 813_056), (mlp_megatron, 2 * 128 * 10)])
def test_design_mlp_figures_on_two_ranks(plan, expected):
    """docs/ARCHITECTURE.md: data parallelism 813,056 elements per step; the column/row split far less."""
    sizes = dict(batch=128, d_in=784, d_hidden=512, d_out=10)
    result = run_plan(plan(2, **sizes), 2, TrainConfig(steps=2, check=True, dtype="float64"),
                      graph=models.mlp(**sizes), backend="gloo")
    assert result.check == "passed"
    assert result.comm_elements_measured == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", list(mesh_plans.PLANS_2X2X2))
def test_2x2x2_plan_on_eight_ranks(name):
    plan = mesh_plans.PLANS_2X2X2[name](LIBRARY)
    result = run_plan(plan.pcg, 8, TrainConfig(steps=STEPS, optimizer="adam", lr=0.05, check=True), graph=plan.graph,
                      backend="gloo", timeout_s=600)
    assert result.check == "passed", result
    assert result.comm_elements_measured == plan.sent
    assert result.comm_by_axis == plan.sent_by_axis()
    assert result.grad_sync_elements_measured == plan.grad_sync
