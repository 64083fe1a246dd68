"""ZeRO-1 beside pipelining, its optimizer state through a DCP checkpoint (issue 30, Build 2: resume training).

Megatron's distributed optimizer inside each pipeline stage: the built-in
`gpt` of `test_torch_native_pipeline` planned pp 2 x dp 2 with ZeRO-1
(`zero.zero_optimizer` shards each stage's AdamW state over the stage's two
data ranks) trains 2 steps on 4 gloo ranks through the user's loop and
writes `{"model": model.state_dict(), "optim": optimizer.state_dict()}`
with `torch.distributed.checkpoint`. Another module (another seed), under
the same plan on 4 fresh ranks, loads it and trains the third step: its
weights must be the unmodified module's trained 3 steps in one process
(1e-4 relative). Each stage's state is keyed by the rank's stage
coordinate: were both stages' flat parameters saved under one key, DCP
would keep one stage's moments for both and the resumed step would leave
the reference. The same resumed with a fresh optimizer must not match (the
check can fail).
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import parsat  # noqa: E402
from test_torch_native_pipeline import (TOLERANCE, _relative, batch, gpt_module, pipelined_plan,  # noqa: E402
                                        weight_names)

STEPS_BEFORE = 2
LR = 1e-2


def _parallelized(plan: dict, seed: int):
    from parsat.backend.torch_native.zero import zero_optimizer

    data = 2   # the plan's data-parallel replicas: each rank passes its half of the batch
    example = tuple(x[: x.shape[0] // data] for x in batch(0))
    model = parsat.parallelize(gpt_module(seed=seed), plan, example, runtime="torch", weight_names=weight_names())
    # another learning rate and weight decay than the writer's: the loaded param groups must replace them
    optimizer = zero_optimizer(model, torch.optim.AdamW, lr=LR if seed == 0 else LR / 7,
                               weight_decay=0.01 if seed == 0 else 0.5)
    return model, optimizer


def _step(model, optimizer, step: int) -> None:
    from parsat.backend.torch_native.apply import local_batch

    model.step(*local_batch(model, *batch(step)))
    model.clip_grad_norm_(max_norm=0.5)
    optimizer.step()
    optimizer.zero_grad()


def write_job(ctx, plan: dict, folder: str) -> dict:
    """STEPS_BEFORE steps of the pipelined ZeRO-1 plan, then the model's and the optimizer's state written."""
    import torch.distributed.checkpoint as dcp

    from parsat.backend.torch_native.zero import ZeroOneOptimizer

    model, optimizer = _parallelized(plan, seed=0)
    for step in range(STEPS_BEFORE):
        _step(model, optimizer, step)
    state = optimizer.state_dict()
    dcp.save({"model": model.state_dict(), "optim": state}, checkpoint_id=folder)
    return {"zero1": isinstance(optimizer, ZeroOneOptimizer), "keys": sorted(state["state"]),
            "layout": sorted(state["layout"])}


def resume_job(ctx, plan: dict, folder: str) -> dict:
    """The checkpoint loaded into another module under `plan`, one more step; the largest relative difference
    of the stage's weights from the unmodified module trained STEPS_BEFORE + 1 steps here; the same with a
    fresh optimizer (the model's weights alone loaded)."""
    import torch.distributed.checkpoint as dcp

    reference = copy.deepcopy(gpt_module())
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    for step in range(STEPS_BEFORE + 1):
        reference(*batch(step)).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    out = {}
    for label in ("with_optimizer", "model_only"):
        model, optimizer = _parallelized(plan, seed=1)
        state = {"model": model.state_dict()}
        if label == "with_optimizer":
            state["optim"] = optimizer.state_dict()
        dcp.load(state, checkpoint_id=folder)
        model.load_state_dict(state["model"])
        if label == "with_optimizer":
            optimizer.load_state_dict(state["optim"])
            out["lr"] = optimizer.param_groups[0]["lr"]
            out["step"] = sorted({float(group["step"]) for group in optimizer.state_dict()["state"].values()})
        _step(model, optimizer, STEPS_BEFORE)
        out[label] = max(_relative((t.full_tensor() if hasattr(t, "full_tensor") else t).detach(),
                                   reference.get_parameter(name).detach())
                         for name, t in model.named_parameters())
    return out


@pytest.mark.slow
def test_zero1_state_of_each_pipeline_stage_written_and_resumed_like_one_process(tmp_path):
    from parsat.backend.launch import LaunchConfig, launch

    plan = pipelined_plan(4, dp=2, zero=1).to_dict()
    folder = str(tmp_path / "ckpt")
    written = launch(write_job, (plan, folder), LaunchConfig(nproc=4, backend="gloo", timeout_s=600))
    assert all(w["zero1"] for w in written), written
    # each stage's state under its own key (ranks 0, 1 hold stage 0; 2, 3 stage 1), shared by its two data ranks
    assert [w["keys"] for w in written] == [["pp=0/0"]] * 2 + [["pp=1/0"]] * 2, written
    resumed = launch(resume_job, (plan, folder), LaunchConfig(nproc=4, backend="gloo", timeout_s=600))
    for result in resumed:
        assert result["with_optimizer"] <= TOLERANCE, result
        assert result["model_only"] > 10 * TOLERANCE, result   # a fresh optimizer state: not the same training
        assert result["lr"] == LR and result["step"] == [STEPS_BEFORE], result
