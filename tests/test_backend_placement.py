"""Where pieces live on a device mesh, and the plans the backend refuses before any rank starts (no ranks here).

Pieces: which slices of a tensor each rank holds (`ir.placement.piece_index`),
with one dim sharded on two axes (nested in mesh order, the earlier axis
major), held redundantly on free and replica axes. The parallel-operator
table against the placement algebra. Refusals: a job of another size than
the mesh, placements that do not lay out, fused operators on the wrong
placement, partial outputs; each with the message a user reads.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import mesh_plans  # noqa: E402

from parsat.backend.collectives import PARALLEL_TABLE, MeshGroups  # noqa: E402
from parsat.backend.executor import (ExecutionError, gradient_reductions, check_mesh, operator_library,  # noqa: E402
                                     output_holders)
from parsat.dsl.parallel_ops import PARALLEL_OPS  # noqa: E402
from parsat.ir.mesh import Mesh  # noqa: E402
from parsat.ir.pcg import PCG  # noqa: E402
from parsat.ir.placement import (FREE, PARTIAL, REPLICA, Placement, PlacementError,  # noqa: E402
                                 apply_parallel, piece_index, shard)

LIBRARY = operator_library()


def _coverage(placement: Placement, shape, mesh: Mesh) -> torch.Tensor:
    """How many ranks hold each element."""
    count = torch.zeros(shape, dtype=torch.int64)
    for rank in range(mesh.world):
        count[piece_index(placement, shape, mesh, rank)] += 1
    return count


def test_one_dim_on_two_axes_is_cut_in_mesh_order():
    """Shard(0) on dp 2 and on tp 3: block = 3 * dp coordinate + tp coordinate (DTensor's order)."""
    mesh = Mesh.of((2, 3), names=("dp", "tp"))
    placement = Placement((shard(0), shard(0)))
    shape = (12, 5)
    for rank in range(6):
        rows, cols = piece_index(placement, shape, mesh, rank)
        block = 3 * mesh.coord(rank, 0) + mesh.coord(rank, 1)
        assert (rows.start, rows.stop) == (2 * block, 2 * block + 2) and (cols.start, cols.stop) == (0, 5)
    assert bool((_coverage(placement, shape, mesh) == 1).all())


def test_two_dims_on_two_axes_and_redundant_holders():
    mesh = Mesh.of((2, 2, 3), names=("dp", "fsdp", "tp"))
    placement = Placement((shard(1), FREE, shard(0)))  # dim 1 on dp, dim 0 on tp, held twice (fsdp is free)
    shape = (6, 4)
    assert bool((_coverage(placement, shape, mesh) == 2).all())
    rank = mesh.world - 1  # coordinates (1, 1, 2)
    assert piece_index(placement, shape, mesh, rank) == (slice(4, 6), slice(2, 4))
    # a weight's piece on ranks that differ on fsdp only is the same piece
    assert piece_index(placement, shape, mesh, 0) == piece_index(placement, shape, mesh, mesh.stride(1))
    assert output_holders(Placement((shard(1), REPLICA, shard(0))), mesh, "y") == (2, 2)
    assert output_holders(placement, mesh, "y") == (1, 2)


def test_a_partial_output_is_refused():
    mesh = Mesh.of((2, 2), names=("dp", "tp"))
    with pytest.raises(ExecutionError, match="output 'y' is a partial sum on mesh axis tp; the plan must reduce it"):
        output_holders(Placement((shard(0), PARTIAL)), mesh, "y")


def test_every_table_row_is_a_parallel_operator_of_the_placement_algebra():
    """The backend's table and ir.placement name the same operators: the four of the DSL and the fused ones."""
    assert set(PARALLEL_TABLE) == set(PARALLEL_OPS)
    for row in PARALLEL_TABLE.values():  # each row changes a placement as its name says, on one axis
        before = {"partition": FREE, "replicate": FREE, "combine": shard(1), "all_gather": shard(1),
                  "reduce": PARTIAL, "reduce_scatter": PARTIAL, "all_to_all": shard(1)}[row.name]
        to_dim = 2 if row.name == "all_to_all" else None   # its shard moves from dim 1 to dim 2
        after = apply_parallel(Placement((shard(0), before)), row.name, 1, 1, to_dim)
        assert after.codes[0] == shard(0)
        assert after.codes[1] == {"partition": shard(1), "replicate": REPLICA, "combine": FREE, "all_gather": REPLICA,
                                  "reduce": FREE, "reduce_scatter": shard(1), "all_to_all": shard(2)}[row.name]


@pytest.mark.parametrize("op,codes,axis,dim,message", [
    ("reduce_scatter", (shard(0), shard(1)), 1, 1,
     r"reduce_scatter \(reduce then partition\): reduce on mesh axis 1 needs the tensor Partial\(\) there, it is "
     r"Shard\(1\)"),
    ("all_gather", (shard(1), shard(1)), 0, 1,
     r"all_gather \(combine then replicate\): combine of dim 1 on mesh axis 0: axis 1 shards that dim too and "
     r"comes later in the mesh"),
    ("partition", (FREE, shard(0)), 0, 0, r"partition of dim 0 on mesh axis 0: axis 1 shards that dim too"),
    ("all_gather", (FREE, FREE), 1, 0,
     r"combine on mesh axis 1 needs the tensor Shard\(0\) there, it is Replicate\(\)"),
])
def test_parallel_operators_that_do_not_apply_say_why(op, codes, axis, dim, message):
    with pytest.raises(PlacementError, match=message):
        apply_parallel(Placement(codes), op, axis, dim)


def test_a_job_of_another_size_than_the_mesh_is_refused():
    plan = mesh_plans.dp_tp_mlp(LIBRARY)
    with pytest.raises(ExecutionError, match=r"the plan runs on a mesh of 4 ranks \(dp 2 x tp 2\), but --nproc is 2: "
                                             r"start as many ranks as the mesh has devices"):
        check_mesh(plan.pcg, 2, LIBRARY)
    assert len(check_mesh(plan.pcg, 4, LIBRARY)) == len(plan.pcg.nodes)


def test_a_plan_whose_stated_placement_is_not_its_layout_is_refused_naming_the_node():
    plan = mesh_plans.dp_tp_mlp(LIBRARY)
    nodes = list(plan.pcg.nodes)
    wrong = next(n for n in nodes if n.op == "relu")
    nodes[wrong.id] = replace(wrong, placement=Placement((shard(0), FREE)))
    pcg = PCG(tuple(nodes), plan.pcg.outputs, plan.pcg.output_names, plan.pcg.mesh)
    with pytest.raises(ExecutionError, match=rf"cannot run on its mesh \(dp 2 x tp 2\): at node #{wrong.id}, relu: "
                                             r"the plan states placement \[S0 -\], but it lays out as \[S0 S1\]"):
        check_mesh(pcg, 4, LIBRARY)


def test_a_parallel_operator_on_an_axis_the_mesh_lacks_is_refused():
    plan = mesh_plans.dp_tp_mlp(LIBRARY)
    nodes = list(plan.pcg.nodes)
    node = next(n for n in nodes if n.op == "reduce")
    nodes[node.id] = replace(node, attrs=(("axis", "pp"), ("degree", 2)))
    pcg = PCG(tuple(nodes), plan.pcg.outputs, plan.pcg.output_names, plan.pcg.mesh)
    with pytest.raises(ExecutionError, match=r"at node #\d+, reduce\(axis=pp, degree=2\): the mesh has no axis 'pp'"):
        check_mesh(pcg, 4, LIBRARY)


def testgradient_reductions_are_the_replicates_and_gathers_of_weights():
    plan = mesh_plans.zero3_tp_mlp(LIBRARY)
    found = {plan.pcg.node(i).label for i in gradient_reductions(plan.pcg)}
    assert found == {"all_gather(dim=0, axis=dp, degree=2)", "all_gather(dim=1, axis=dp, degree=2)"}
    plan = mesh_plans.dp_tp_mlp(LIBRARY)
    assert sorted(plan.pcg.node(i).op for i in gradient_reductions(plan.pcg)) == ["replicate", "replicate"]


def test_a_mesh_of_one_rank_needs_no_process_group():
    assert MeshGroups(Mesh(()), 0, torch.device("cpu")).device_mesh is None
