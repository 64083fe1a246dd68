"""Which collectives a tensor-parallel pipeline stage issues on the torch runtime, against the plan's.

Tensor parallelism inside a pipeline stage (docs/TORCH_NATIVE.md,
"Pipelining") places the traced stage modules' parameters as the plan
stores them (`Shard(d)` / `Replicate()` DTensors) and lets DTensor's
sharding propagation run the operators between them. The plan's
activation collectives are then DTensor's choice, not the plan's. This
script counts both for the built-in gpt of tests/test_torch_native_pipeline.py
(4 blocks, hidden 16, 2 heads, vocabulary 32; Megatron's tp 2 inside each
of the pp=2 plan's 2 stages): on 2 gloo ranks (one tp pair), both stage
modules of the real lowering (`lower_pipeline`, `traced_tensor_parallel`,
`dtensor_step`) run one micro-batch forward and backward in sequence under
`CommDebugMode`; the plan's count is its parallel operators on activations
in each chunk (a `reduce` is a forward all-reduce, a `replicate` of an
activation a backward all-reduce, a `combine` a forward all-gather; the
ids' `partition` moves nothing). Results: benchmarks/torch_native_results.md, section 3.

    PYTHONPATH=. python benchmarks/torch_native_pipeline_tp.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def plan_counts(plan) -> dict:
    """Per stage, the plan's parallel operators on activations (not on weights alone), by operator."""
    static: set[int] = set()
    for node in plan.pcg.nodes:
        if (node.kind == "leaf" and node.role == "weight") or (node.kind != "leaf" and node.inputs and
                                                               all(i in static for i in node.inputs)):
            static.add(node.id)
    out: dict[str, int] = {}
    for chunk in plan.pipeline.layout.chunks:
        for ident in chunk.nodes:
            node = plan.pcg.node(ident)
            if node.kind == "parallel" and ident not in static:
                key = f"stage {chunk.stage}: {node.op}"
                out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def job(ctx, plan_dict: dict) -> dict:
    """On each of the 2 ranks: both stage modules tensor-parallel on tp 2, one micro-batch in sequence."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import SplitPoint, pipeline
    from torch.distributed.tensor.debug import CommDebugMode

    from parsat.backend.torch_native.apply import dtensor_step, module_info, traced_tensor_parallel
    from parsat.backend.torch_native.pipeline_lowering import lower_pipeline
    from parsat.backend.torch_native.pipelined import TRACED_PREFIX, _PassInputsThrough, _relays_out_of_place
    from parsat.backend.parallelize import resolve_plan
    from test_torch_native_pipeline import MICROBATCHES, batch, gpt_module, weight_names

    pcg, graph, pipe_plan = resolve_plan(plan_dict)
    module = gpt_module()
    lowering = lower_pipeline(pcg, graph, pipe_plan, module_info(module, weight_names()))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids, labels = (x[: x.shape[0] // MICROBATCHES] for x in batch(0))
    cuts = lowering.split_points()
    pipe = pipeline(_PassInputsThrough(module, cuts), mb_args=(ids, labels),
                    split_spec={TRACED_PREFIX + c: SplitPoint.BEGINNING for c in cuts})
    _relays_out_of_place(pipe.split_gm)
    stages = [pipe.get_stage_module(c.index) for c in lowering.chunks]
    for sub in stages:
        traced_tensor_parallel(sub, lowering.stage, mesh, prefix=TRACED_PREFIX)
    counts, inputs, outputs = [], [], []
    with dtensor_step(torch.device("cpu")):
        values = (ids, labels)
        for sub in stages:   # each stage receives what the one before sent: fresh leaves, as PipelineStage's
            values = tuple(v.detach().requires_grad_(v.is_floating_point()) for v in values)
            inputs.append(values)
            with CommDebugMode() as forward:
                values = sub(*values)
            values = values if isinstance(values, tuple) else (values,)
            outputs.append(values)
            counts.append({"forward": _counts(forward)})
        for index in reversed(range(len(stages))):   # backward, last stage first, as the schedule runs it
            sent = [o for o in outputs[index] if o.requires_grad]
            if index == len(stages) - 1:
                grads = [torch.ones_like(o) for o in sent]
            else:   # the gradient of the one floating value sent is the next stage's input's gradient
                grads = [x.grad for x in inputs[index + 1] if x.is_floating_point()]
            assert len(sent) == len(grads) == 1, (len(sent), len(grads))
            with CommDebugMode() as backward:
                torch.autograd.backward(sent, grads)
            counts[index]["backward"] = _counts(backward)
    return {"counts": counts, "loss": float(outputs[-1][0].detach())}


def _counts(mode) -> dict:
    """Collectives by kind (all_reduce, all_gather_into_tensor, ...), whichever namespace counted them."""
    out: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = getattr(op, "__name__", str(op)).split(".")[0]
        out[name] = out.get(name, 0) + n
    return out


def main() -> None:
    from parsat.backend.launch import LaunchConfig, launch
    from test_torch_native_pipeline import megatron_stage_plan, pipelined_plan

    plan = megatron_stage_plan(pipelined_plan(2))
    results = launch(job, (plan.to_dict(),), LaunchConfig(nproc=2, backend="gloo", timeout_s=600))
    print(json.dumps({"plan_per_microbatch": plan_counts(plan), "dtensor_per_microbatch": results[0]["counts"],
                      "ranks_agree": results[0]["counts"] == results[1]["counts"]}, indent=1))


if __name__ == "__main__":
    main()
