"""Issue 30's user-loop items on `runtime="torch"`, on 2 gloo ranks: what a PyTorch user's own loop does.

Build item 2: fused AdamW and an LR scheduler on the DTensor parameters; a
bf16 `MixedPrecisionPolicy` computing in bf16 with fp32 master weights and
gradients. Build item 3: a batch and sequence length other than the ones
the plan was made for (no re-planning: the module runs its own forward),
and gradient accumulation over micro-batches with the gradient sync turned
off for all but the last. Build item 4: the plan read from a file on rank 0
and broadcast, and ranks holding different plans refused on every rank.

Each plan's run is checked against the unmodified module trained on the
global batch in one process (losses, clipped norms, final weights, 1e-4
relative, float32), as tests/test_torch_native_runtime.py does for the
plain loop.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import parsat  # noqa: E402
from test_torch_native_runtime import (BATCH, SEQ, TOLERANCE, VOCAB_SIZE, _batch, _plan, _relative,  # noqa: E402
                                       tiny)

# the plans are made for [BATCH, SEQ] = [4, 6]; the loop runs [8, 10], each rank's [4, 10] in 2 micro-batches
GLOBAL_BATCH, GLOBAL_SEQ, MICRO, STEPS, LR = 8, 10, 2, 3, 1e-2


def _schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)


def _accumulated_step(model, ids, labels) -> torch.Tensor:
    """One step's forward and backward over MICRO micro-batches of this rank's local batch, the gradient sync
    (replicate / fully_shard) off for all but the last; the local batch's mean loss."""
    from torch.distributed.fsdp import FSDPModule

    losses = []
    for i, (mb_ids, mb_labels) in enumerate(zip(ids.chunk(MICRO), labels.chunk(MICRO))):
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(i == MICRO - 1)
        loss = model(mb_ids, mb_labels) / MICRO
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses).sum()


def loop_job(ctx, plans: dict, plan_file: str) -> dict:
    """On every rank, per plan: the tiny model lowered, then STEPS steps of the user's loop (local batch of another
    shape than planned, gradient accumulation, clip_grad_norm_, fused AdamW, LambdaLR) beside the unmodified
    module on the global batch in one process. Also: the plan from a file on rank 0 only, different plans on the
    two ranks, and a bf16 MixedPrecisionPolicy's compute and master dtypes."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from parsat.backend.torch_native.apply import NativeParallelizeError, local_batch
    from parsat.backend.torch_native.zero import zero_optimizer

    out: dict = {}
    try:   # rank 0 holds the dp plan, rank 1 the tp plan: both refuse before any mesh is made
        parsat.parallelize(tiny()[0], plans["dp"] if ctx.rank == 0 else plans["tp"], runtime="torch")
        out["mismatch"] = "accepted"
    except NativeParallelizeError as err:
        out["mismatch"] = str(err)
    for label, plan in plans.items():
        module, _ = tiny()
        reference = copy.deepcopy(module).to(ctx.device)
        held = plan_file if label == "dp" else plan   # the dp plan: a JSON file on rank 0, None on the others
        model = parsat.parallelize(module, held if ctx.rank == 0 or label != "dp" else None, runtime="torch")
        # fused AdamW, as the plan's ZeRO asks: under ZeRO-1 on this rank's chunk of the flattened parameters
        optimizer = zero_optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=0.01, fused=True)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
        schedulers = (_schedule(optimizer), _schedule(ref_optimizer))
        row: dict = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": [], "lrs": []}
        for step in range(STEPS):
            ids, labels = (t.to(ctx.device) for t in _batch(step, GLOBAL_BATCH, GLOBAL_SEQ, VOCAB_SIZE))
            loss = _accumulated_step(model, *local_batch(model, ids, labels))
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()
            dist.all_reduce(loss)
            row["losses"].append(float(loss) / ctx.world)
            row["norms"].append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
            want = reference(ids, labels)
            want.backward()
            row["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)))
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            row["ref_losses"].append(float(want.detach()))
            row["lrs"].append(optimizer.param_groups[0]["lr"])
            for scheduler in schedulers:
                scheduler.step()
        row["worst_weight"] = max(
            _relative((lambda t: t.full_tensor() if isinstance(t, DTensor) else t)(model.get_parameter(n)).detach(),
                      p.detach(), floor=LR) for n, p in reference.named_parameters())
        row["not_dtensor"] = sorted(n for n, t in model.named_parameters() if not isinstance(t, DTensor))
        out[label] = row
    out["mixed"] = _mixed_precision(plans["dp"], ctx.device)
    out["mixed_tp"] = _mixed_precision(plans["tp"], ctx.device)
    out["zero1_resumed"] = _zero1_resumed(ctx, plans["zero1"], str(Path(plan_file).parent / "zero1"))
    out["zero1_by_parameter"] = _zero1_resumed(ctx, plans["zero1"], str(Path(plan_file).parent / "zero1p"), True)
    return out


def _mixed_precision(plan: dict, device) -> dict:
    """A bf16 MixedPrecisionPolicy (fp32 reductions) on `plan` (the data-parallel one; the tensor-parallel one,
    which has no data axis: `replicate` over a one-rank axis): the dtypes fc1 computes with in the first forward,
    the gradient reduction's output (FSDP2's all-reduce hook), those of the stored parameters and their gradients
    after the backward; then STEPS AdamW steps on the global batch's local part, their losses beside the
    unmodified module's trained in fp32 in one process."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from parsat.backend.torch_native.apply import local_batch

    module, _ = tiny()
    reference = copy.deepcopy(module).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = parsat.parallelize(module, plan, runtime="torch", mp_policy=policy)
    seen, reduced = {}, set()
    hook = model.fc1.register_forward_hook(lambda mod, args, result: seen.update(
        weight=str(mod.weight.dtype), output=str(result.dtype)))
    model.set_all_reduce_hook(lambda out: reduced.add(str(out.dtype)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    row: dict = {"losses": [], "ref_losses": []}
    for step in range(STEPS):
        ids, labels = (t.to(device) for t in _batch(step, BATCH, SEQ, VOCAB_SIZE))
        loss = model(*local_batch(model, ids, labels))
        loss.backward()
        if step == 0:
            hook.remove()
            row.update(forward=seen, reduced=sorted(reduced),
                       params=sorted({str(p.dtype) for p in model.parameters()}),
                       grads=sorted({str(p.grad.dtype) for p in model.parameters()}))
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach().float()
        dist.all_reduce(loss)   # the local batches' mean (tensor-parallel ranks hold the same loss)
        row["losses"].append(float(loss) / dist.get_world_size())
        want = reference(ids, labels)
        want.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        row["ref_losses"].append(float(want.detach()))
    return row


def _zero1_resumed(ctx, plan: dict, folder: str, by_parameter: bool = False) -> dict:
    """ZeRO-1's sharded optimizer state through a DCP checkpoint on the same 2 ranks: 2 steps written
    (`test_torch_native_zero_checkpoint.write_job`), then another module under the same plan loads the model and
    the `ZeroOneOptimizer`'s state and takes the third step (`resume_job`: its weights beside the unmodified
    module's 3 steps in one process, and beside a resume with a fresh optimizer). `by_parameter`: the state keyed
    by parameter (`parameter_state_dict`), also loaded into the unmodified module's plain AdamW."""
    import torch.distributed as dist

    from test_torch_native_zero_checkpoint import resume_job, write_job

    written = write_job(ctx, plan, folder, by_parameter)
    dist.barrier()
    return {"written": written, **resume_job(ctx, plan, folder, by_parameter)}


def run_loop(folder: Path, backend: str) -> list:
    """`loop_job` on 2 ranks of `backend` for the tiny model's dp, ZeRO-3, tp and ZeRO-1 plans (the dp plan written
    to folder/dp.json, read by rank 0 only)."""
    from parsat.backend.launch import LaunchConfig, launch

    graph = parsat.from_torch(*tiny())
    plans = {"dp": _plan(graph, (2, 1)), "zero3": _plan(graph, (2, 1), zero=3), "tp": _plan(graph, (1, 2)),
             "zero1": dict(_plan(graph, (2, 1)), zero=1)}
    plan_file = folder / "dp.json"
    plan_file.write_text(json.dumps(plans["dp"]))
    return launch(loop_job, (plans, str(plan_file)), LaunchConfig(nproc=2, backend=backend, timeout_s=300))


def check_loop(results: list, label: str) -> dict:
    """Every rank's run of `label` equal to one process's (1e-4), clipped, scheduled, every parameter a DTensor;
    rank 0's run."""
    for result in results:
        run = result[label]
        assert run["not_dtensor"] == []
        for key in ("losses", "norms"):
            for got, want in zip(run[key], run["ref_" + key]):
                assert abs(got - want) <= TOLERANCE * abs(want), (label, key, run[key], run["ref_" + key])
        assert min(run["ref_norms"]) > 0.5   # clipped every step
        assert run["worst_weight"] <= TOLERANCE, (label, run["worst_weight"])
        assert run["lrs"] == [LR * 0.5 ** s for s in range(STEPS)]   # the scheduler drove the fused optimizer
    return results[0][label]


def check_mixed(results: list, label: str = "mixed") -> None:
    for result in results:
        mixed = result[label]
        assert mixed["forward"] == {"weight": "torch.bfloat16", "output": "torch.bfloat16"}, mixed
        assert mixed["params"] == ["torch.float32"] and mixed["grads"] == ["torch.float32"], mixed
        assert mixed["reduced"] == ["torch.float32"], mixed   # the gradients are reduced in fp32
        for got, want in zip(mixed["losses"], mixed["ref_losses"]):   # bf16 compute: close to fp32, not equal
            assert got == pytest.approx(want, rel=2e-2) and got != want, mixed


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory):
    return run_loop(tmp_path_factory.mktemp("plan"), "gloo")


@pytest.mark.parametrize("label", ["dp", "zero3", "tp", "zero1"])
def test_accumulation_another_batch_shape_fused_adamw_and_a_scheduler_train_like_one_process(loop_runs, label):
    run = check_loop(loop_runs, label)
    print(json.dumps({label: {k: run[k] for k in ("losses", "ref_losses", "norms", "ref_norms", "worst_weight")}}))


def test_ranks_holding_different_plans_are_refused_on_every_rank(loop_runs):
    for result in loop_runs:
        assert "rank(s) 1 hold another plan than rank 0" in result["mismatch"], result["mismatch"]


def test_a_bf16_policy_computes_in_bf16_reduces_and_keeps_weights_and_gradients_in_fp32(loop_runs):
    check_mixed(loop_runs)


def test_a_bf16_policy_on_a_tensor_parallel_plan_without_a_data_axis_does_the_same(loop_runs):
    """Megatron's tp 2 plan has no data axis: the policy rides `replicate` over a one-rank `policy` axis of the
    mesh (`apply.policy_on_one_rank`): fc1's bf16 weight is its `Shard(0)` DTensor cast, its output bf16."""
    check_mixed(loop_runs, "mixed_tp")
    print(json.dumps({label: {k: loop_runs[0][label][k] for k in ("losses", "ref_losses")}
                      for label in ("mixed", "mixed_tp")}))


def test_zero1_optimizer_state_saved_and_loaded_on_the_same_two_ranks_resumes_like_one_process(loop_runs):
    """The ZeRO-1 plan's checkpoint (model and `ZeroOneOptimizer` state, each rank's `Shard(0)` chunk of the
    flattened AdamW moments) loaded on the same 2 ranks: the next step's weights are the uninterrupted run's
    (1e-4), a fresh optimizer's are not; a state of another layout is refused (the 2 -> 4 reshard, dp x tp and
    pipeline stages: tests/test_torch_native_zero_checkpoint.py, ..._pipeline_zero_checkpoint.py, slow)."""
    from test_torch_native_zero_checkpoint import _check_resumed

    for result in loop_runs:
        resumed = result["zero1_resumed"]
        assert resumed["written"]["zero1"] and resumed["written"]["key"] == "0", resumed
        assert resumed["written"]["moments"] == {"exp_avg": ["Shard(dim=0)"], "exp_avg_sq": ["Shard(dim=0)"]}
    _check_resumed([result["zero1_resumed"] for result in loop_runs])
    print(json.dumps({k: loop_runs[0]["zero1_resumed"][k] for k in ("with_optimizer", "model_only")}))


def test_zero1_optimizer_state_keyed_by_parameter_resumes_here_and_in_the_unmodified_module(loop_runs):
    """The same through `parameter_state_dict` (each moment placed as its parameter, keyed by its name): resumed on
    the same 2 ranks, and by torch's plain AdamW of the unmodified module in one process, like the uninterrupted
    run (another tensor-parallel degree: `zero_checkpoint::test_zero1_state_keyed_by_parameter_*`, slow)."""
    from test_torch_native_zero_checkpoint import _check_resumed

    _check_resumed([result["zero1_by_parameter"] for result in loop_runs])
    for result in loop_runs:
        resumed = result["zero1_by_parameter"]
        assert resumed["written"]["fc1"] == ["Replicate()"] and resumed["unmodified"] <= TOLERANCE, resumed
    print(json.dumps({k: loop_runs[0]["zero1_by_parameter"][k]
                      for k in ("with_optimizer", "model_only", "unmodified")}))
