"""A bf16 `MixedPrecisionPolicy` on pipelined plans (issue 30, Build 2: bf16 compute, fp32 master weights).

The built-in `gpt` of `test_torch_native_pipeline` in float32, planned with
the pipeline pinned (pp 2, 1F1B, 4 micro-batches), is parallelized with
`mp_policy=MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`
as an unpipelined plan would be: each traced stage module is `replicate`d
with the policy (over its one-rank `stage` axis; with a tensor axis and no
data axis, over a one-rank `policy` axis of the mesh), so each stage
computes in bf16 while its stored weights, gradients and their reduction
stay fp32, its outputs cast back to the traced fp32 that the next stage's
receive buffers hold (`pipelined.stage_policy`). Checked on 2 gloo ranks,
and pp 2 x tp 2 on 4 (slow): every weight product inside each stage
computes in bf16, the stored parameters and their gradients are fp32, and
3 steps of the user's loop (`step`, `clip_grad_norm_`, AdamW) give losses
within 2e-2 of the unmodified module trained in fp32 in one process (the
tolerance of the unpipelined bf16 tests), not equal to them.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import parsat  # noqa: E402
from test_torch_native_pipeline import batch, gpt_module, pipelined_plan, weight_names  # noqa: E402

STEPS = 3
LR = 1e-2


def mixed_job(ctx, plan: dict) -> dict:
    """On every rank: the float32 GPT parallelized with `plan` under a bf16 policy; the dtypes of the stage's
    weight products' operands and results in the first step (seen through a dispatch mode), of its stored
    parameters and gradients after it; STEPS steps' losses beside the unmodified module's in fp32."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.utils._python_dispatch import TorchDispatchMode

    from parsat.backend.torch_native.apply import local_batch

    class ProductDtypes(TorchDispatchMode):
        """The dtypes of every aten product of two matrices this rank computes, forward and backward: the
        products with a weight (`x @ w` of a [batch, seq, in] input runs as `mm` / `addmm`), not attention's
        batched ones (`bmm`: on CPU under DTensor attention runs as torch's math decomposition, which computes
        bf16 scores in fp32 by design, `torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp`)."""

        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                self.seen.add(f"{args[-2].dtype}@{args[-1].dtype}->{out.dtype}")

            return out

    module = gpt_module().float()
    reference = copy.deepcopy(module)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = parsat.parallelize(module, plan, tuple(batch(0)), runtime="torch", weight_names=weight_names(),
                               mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    out: dict = {"losses": [], "ref_losses": []}
    for step in range(STEPS):
        ids, labels = batch(step)
        if step == 0:
            with ProductDtypes() as products:
                loss = model.step(*local_batch(model, ids, labels))
            out.update(products=sorted(products.seen), params=sorted({str(p.dtype) for p in model.parameters()}),
                       grads=sorted({str(p.grad.dtype) for p in model.parameters()}))
        else:
            loss = model.step(*local_batch(model, ids, labels))
        model.clip_grad_norm_(max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(float(loss))
        want = reference(ids, labels)
        want.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        out["ref_losses"].append(float(want.detach()))
    out["stage"] = model.stage
    dist.barrier()
    return out


def check_mixed(results: list) -> None:
    print({key: results[-1][key] for key in ("losses", "ref_losses")})
    for result in results:
        # the stage's products: bf16 operands and results (the forward's and the backward's), none in fp32
        assert result["products"] and all(p == "torch.bfloat16@torch.bfloat16->torch.bfloat16"
                                          for p in result["products"]), result
        assert result["params"] == ["torch.float32"] and result["grads"] == ["torch.float32"], result
        for got, want in zip(result["losses"], result["ref_losses"]):
            assert got == pytest.approx(want, rel=2e-2) and got != want, result


@pytest.mark.slow
def test_a_bf16_policy_on_a_pipelined_plan_computes_each_stage_in_bf16_with_fp32_weights_and_gradients():
    from parsat.backend.launch import LaunchConfig, launch

    plan = pipelined_plan(2).to_dict()
    results = launch(mixed_job, (plan,), LaunchConfig(nproc=2, backend="gloo", timeout_s=600))
    assert sorted(r["stage"] for r in results) == [0, 1]
    check_mixed(results)


def test_each_stage_s_policy_sends_its_outputs_in_the_traced_dtype_and_another_output_dtype_is_refused():
    """Without processes: the float32 GPT traced and cut as `apply_pipeline` cuts it; `stage_policy` gives each
    stage module the user's bf16 policy with `output_dtype` float32 (what its outputs were traced in, what the
    next stage's receive buffers hold), and refuses a policy asking for bf16 outputs by name."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.pipelining import SplitPoint, pipeline

    from parsat.backend.torch_native.apply import NativeParallelizeError, module_info
    from parsat.backend.torch_native.pipeline_lowering import lower_pipeline
    from parsat.backend.torch_native.pipelined import TRACED_PREFIX, _PassInputsThrough, stage_policy
    from test_torch_native_pipeline import MICROBATCHES, SIZES

    plan = pipelined_plan(2)
    module = gpt_module().float()
    lowering = lower_pipeline(plan.pcg, plan.graph, plan.pipeline, module_info(module, weight_names()))
    cuts = lowering.split_points()
    micro = tuple(x[: SIZES["batch"] // MICROBATCHES] for x in batch(0))
    pipe = pipeline(_PassInputsThrough(module, cuts), mb_args=micro,
                    split_spec={TRACED_PREFIX + cut: SplitPoint.BEGINNING for cut in cuts})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for index in (0, 1):
        got = stage_policy(pipe.get_stage_module(index), index, policy)
        assert (got.param_dtype, got.reduce_dtype, got.output_dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert stage_policy(pipe.get_stage_module(0), 0, None) is None
    with pytest.raises(NativeParallelizeError, match=r"output_dtype torch.bfloat16 .* stage module 0 sends values "
                                                     r"traced in \['torch.float32'\]"):
        stage_policy(pipe.get_stage_module(0), 0, MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                       output_dtype=torch.bfloat16))


@pytest.mark.slow
def test_a_bf16_policy_on_tensor_parallel_stages_without_a_data_axis():
    """pp 2 x tp 2 on 4 gloo ranks (Megatron's tp 2 layout as the stage plan: no data axis, so each stage module
    is `replicate`d with the policy over a one-rank `policy` axis of the job's mesh): the same checks, the
    products now on each tp rank's pieces (DTensors of the stage's tp slice)."""
    from parsat.backend.launch import LaunchConfig, launch
    from test_torch_native_pipeline import megatron_stage_plan

    plan = megatron_stage_plan(pipelined_plan(2)).to_dict()
    results = launch(mixed_job, (plan,), LaunchConfig(nproc=4, backend="gloo", timeout_s=600))
    assert sorted(r["stage"] for r in results) == [0, 0, 1, 1]
    check_mixed(results)
