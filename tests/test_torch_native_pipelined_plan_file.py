"""`parsat run plan.json --runtime torch` on a pipelined plan file (`torch_native/run_pipelined.py`): the plan's graph
as a module of one submodule a block (`staged_graph.StagedGraphModule`), cut into `torch.distributed.pipelining`
stages where the plan's chunks begin and trained with the plan's schedule and micro-batches.

Fast, without processes: the staged module computes the interpreter's objective of the graph (the flat
`GraphModule`'s, the same gradients), holds block L's weights in `blocks.L`, and the plan's lowering cuts it
before the block each chunk begins with, the tied table on the first and the last stage; what a pipelined plan
file is refused for before any rank starts; `pipeline()` traces it into the plan's stages, each holding its
chunk's parameters, which compute its loss. Slow, on gloo ranks: the built-in gpt's pp 2 plan file (1F1B, 4
micro-batches) trained 3 Adam steps through the CLI with --check on 2 ranks (losses and final weights within 1e-9
of the unmodified module trained in one process, every parameter a DTensor) and the interpreter's losses on the
same file; GPipe and interleaved (2 chunks a stage) on 2 ranks, pp 2 x dp 2 and pp 2 x tp 2 on 4. (A pipelined
step whose ranks pass batches of different shapes: tests/test_torch_native_pipeline_shapes.py, fast.)
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from test_torch_native_pipeline import pipelined_plan  # noqa: E402

from parsat.backend.executor import ExecutionError, operator_library, seeded_weights, step_data  # noqa: E402
from parsat.backend.training_data import TrainConfig  # noqa: E402
from parsat.ir.microbatch import step_batch  # noqa: E402

LIBRARY = operator_library()


@pytest.fixture(scope="module")
def pp2():
    return pipelined_plan(2)


def _staged(plan):
    from parsat.backend.torch_native.staged_graph import StagedGraphModule

    graph = plan.graph
    return StagedGraphModule(graph, seeded_weights(graph, TrainConfig()), LIBRARY)


def test_the_staged_module_computes_the_graph_s_objective_block_after_block(pp2):
    """The staged module's objective and gradients on the step's whole batch are the flat module's (`run.GraphModule`
    with `graph_objective`, what the unpipelined plan files train); block L's weights are `blocks.L`'s, those
    outside every block the module's own."""
    from parsat.backend.torch_native.run import GraphModule, graph_objective

    graph = pp2.graph
    staged, flat = _staged(pp2), GraphModule(graph, seeded_weights(graph, TrainConfig()), LIBRARY)
    data = step_data(graph, step_batch(graph, LIBRARY), TrainConfig(), 0)
    inputs = data.whole_inputs()
    assert staged.tensor_names == ("ids", "targets")
    got = staged(*(inputs[n] for n in staged.tensor_names))
    want = graph_objective(flat, graph, flat(inputs), data.whole_targets())
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-12 * abs(float(want.detach()))
    got.backward()
    want.backward()
    for name, param in staged.param_names.items():
        ours, theirs = staged.get_parameter(param).grad, flat.get_parameter(flat.param_names[name]).grad
        assert torch.allclose(ours, theirs, rtol=1e-10, atol=1e-13), name
    assert staged.param_names["b2_wqkv"] == "blocks.2.b2_wqkv" and staged.param_names["wte"] == "wte"
    assert {n for n, _ in staged.blocks["0"].named_parameters()} == {
        n for n in (p.rpartition(".")[2] for p in staged.param_names.values() if p.startswith("blocks.0."))}


def test_the_plan_cuts_the_staged_module_before_each_chunk_s_first_block(pp2):
    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.pipeline_lowering import lower_pipeline

    module = _staged(pp2)
    lowering = lower_pipeline(pp2.pcg, pp2.graph, pp2.pipeline, module_info(module, module.param_names))
    starts = [c.layers[0] for c in pp2.pipeline.layout.chunks]
    assert lowering.split_points() == tuple(f"blocks.{layer}" for layer in starts[1:])
    assert lowering.shared == ((("wte",), (0, 1)),)
    first, last = lowering.chunks
    assert {"wte", "wpe", "blocks.0.b0_wqkv"} <= set(first.params) and "lnf_g" not in first.params
    assert {"wte", "lnf_g", "blocks.3.b3_w2"} <= set(last.params)


def test_the_staged_module_traces_into_the_plan_s_stages_which_compute_its_loss(pp2):
    """The fast sibling of the 2-rank run: `pipeline()` traces the staged module at one micro-batch and cuts it as
    the plan's lowering says; each traced stage holds exactly its chunk's parameters (`_check_stage_params`, the
    tied table on both ends), and the stages run in turn compute the module's loss on that micro-batch."""
    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.pipeline_lowering import lower_pipeline
    from parsat.backend.torch_native.pipelined import _check_stage_params, _first_microbatch, _traced_pipe

    module = _staged(pp2)
    lowering = lower_pipeline(pp2.pcg, pp2.graph, pp2.pipeline, module_info(module, module.param_names))
    inputs = step_data(pp2.graph, step_batch(pp2.graph, LIBRARY), TrainConfig(), 0).whole_inputs()
    micro = _first_microbatch(tuple(inputs[n] for n in module.tensor_names), lowering.microbatches)
    pipe = _traced_pipe(module, lowering, micro, torch.device("cpu"))
    assert pipe.num_stages == len(lowering.chunks) == 2
    for chunk in lowering.chunks:
        _check_stage_params(pipe.get_stage_module(chunk.index), chunk)
    (got,) = pipe(*micro)
    want = module(*micro)
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-12 * abs(float(want.detach()))


def test_what_a_pipelined_plan_file_is_refused_for_before_any_rank_starts(pp2):
    """A graph that is no built-in example (its stages' graphs at one micro-batch are not known), and an input
    whose batch is not its dim 0 (llama's position tables carry none: the schedule cuts every tensor along dim 0)."""
    import sys
    from pathlib import Path

    from parsat.backend.torch_native.run_pipelined import check_runnable
    from parsat.ir.models import build_example

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import mesh_plans

    check_runnable(pp2.graph)
    mlp = mesh_plans.data_parallel_mlp(LIBRARY, 2, batch=8, d_in=6, d_hidden=4, d_out=2).graph
    with pytest.raises(ExecutionError, match="built-in example only"):
        check_runnable(mlp.with_microbatches(2))
    llama = build_example("llama", dict(blocks=2, batch=4, seq=4, hidden=8, heads=2, vocab=16), LIBRARY)
    with pytest.raises(ExecutionError, match=r"input rope_cos \[1, 4, 4\] carries the batch nowhere"):
        check_runnable(llama.with_microbatches(2))


def _trains_like_one_process_and_the_interpreter(tmp_path, capsys, plan, nproc: int, *lowered: str) -> dict:
    """The plan file through `parsat run --runtime torch --check`, 3 Adam steps on `nproc` gloo ranks: passed
    within 1e-9, every parameter a DTensor, `lowered` in the lowering, the interpreter's losses on the file
    (`test_backend_cli_torch._like_one_process_and_the_interpreter`)."""
    from test_backend_cli_torch import _like_one_process_and_the_interpreter

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()), encoding="utf-8")
    result = _like_one_process_and_the_interpreter(capsys, path, nproc, lowered[0])
    for text in lowered[1:]:
        assert text in result["lowering"], result["lowering"]
    return result


@pytest.mark.slow   # ~70 s of a worker on the shared box: two 2-rank runs (torch, then the interpreter)
def test_a_pp_2_plan_file_trains_on_torch_pipelining_like_one_process_and_the_interpreter(tmp_path, capsys, pp2):
    _trains_like_one_process_and_the_interpreter(tmp_path, capsys, pp2, 2, "Schedule1F1B(n_microbatches=4)",
                                                 "from blocks.2", "shared: wte held by stages 0, 1")


@pytest.mark.slow
@pytest.mark.parametrize("schedule,chunks", [("gpipe", None), ("interleaved", 2)])
def test_gpipe_and_interleaved_plan_files_train_like_one_process(tmp_path, capsys, schedule, chunks):
    from test_torch_native_pipeline import MICROBATCHES, SIZES

    import parsat

    plan = parsat.optimize("gpt", machine="cpu", devices=2, sizes=SIZES, microbatches=MICROBATCHES,
                           schedule=schedule, degrees={"pp": 2}, baselines=False,
                           **({"chunks_per_stage": chunks} if chunks else {}))
    name = {"gpipe": "ScheduleGPipe", "interleaved": "ScheduleInterleaved1F1B"}[schedule]
    result = _trains_like_one_process_and_the_interpreter(tmp_path, capsys, plan, 2, name)
    assert result["lowering"].count("stage module") == 2 * (chunks or 1), result["lowering"]


@pytest.mark.slow
@pytest.mark.parametrize("inside,lowered", [({"dp": 2}, "over dp"), ({"tp": 2}, "Shard(1), column-parallel")])
def test_pp_2_x_dp_2_and_pp_2_x_tp_2_plan_files_train_on_4_ranks_like_one_process(tmp_path, capsys, inside,
                                                                                  lowered):
    plan = pipelined_plan(4, **inside)
    _trains_like_one_process_and_the_interpreter(tmp_path, capsys, plan, 4, "2 stages of 2 rank(s)", lowered)
