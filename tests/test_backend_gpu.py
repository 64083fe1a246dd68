"""nccl on CUDA: MLP plans and the 2x2 mesh plans trained and checked against one process (skipped without CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from parsat.backend.executor import TrainConfig, operator_library, run_plan  # noqa: E402
from parsat.ir import models  # noqa: E402
from parsat.ir.data_parallel import data_parallel_pcg  # noqa: E402
from parsat.ir.graph import Graph  # noqa: E402
from parsat.ir.pcg import PCG, Degrees, PNode  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = dict(batch=128, d_in=784, d_hidden=512, d_out=10)


def whole_pcg(graph: Graph) -> PCG:
    """The graph as a PCG without parallel operators (every tensor whole)."""
    nodes, ids = [], {}
    for leaf in graph.leaves:
        ids[leaf.name] = len(nodes)
        nodes.append(PNode(len(nodes), "leaf", leaf.name, (), (), leaf.shape, Degrees.whole(len(leaf.shape)),
                           leaf.role, leaf.name))
    for node in graph.nodes:
        ids[node.name] = len(nodes)
        nodes.append(PNode(len(nodes), "op", node.op, tuple(ids[i] for i in node.inputs), node.attrs, node.shape,
                           Degrees.whole(len(node.shape)), "", node.name))
    return PCG(tuple(nodes), tuple(ids[o] for o in graph.outputs), graph.outputs)


def test_nccl_one_rank_whole_plan_matches_single_process():
    graph = models.mlp(**SIZES, library=operator_library())
    result = run_plan(whole_pcg(graph), 1, TrainConfig(steps=3, check=True), graph=graph, backend="nccl")
    assert result.check == "passed" and result.comm_elements_measured == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl needs one GPU per rank")
def test_nccl_data_parallel_mlp_matches_single_process():
    n = min(4, torch.cuda.device_count())
    lib = operator_library()
    graph = models.mlp(**SIZES, library=lib)
    result = run_plan(data_parallel_pcg(graph, lib, n), n, TrainConfig(steps=3, check=True), graph=graph,
                      backend="nccl")
    assert result.check == "passed"
    assert result.comm_elements_measured == 2 * (n - 1) * (784 * 512 + 512 * 10) + (n - 1) * 128 * 10


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="a 2x2 mesh needs 4 GPUs")
@pytest.mark.parametrize("name", ["dp_tp_mlp", "tp_sp_block", "zero3_tp_mlp"])
def test_nccl_2x2_mesh_plans_match_single_process(name):
    """The DeviceMesh groups with NCCL options, reduce_scatter and all_gather on CUDA tensors."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import mesh_plans

    plan = mesh_plans.PLANS_2X2[name](operator_library())
    result = run_plan(plan.pcg, 4, TrainConfig(steps=3, check=True), graph=plan.graph, backend="nccl")
    assert result.check == "passed", result
    assert result.comm_elements_measured == plan.sent and result.comm_by_axis == plan.sent_by_axis()
