"""ZeRO-1's optimizer state in a DCP checkpoint, resharded (issue 30, Build 2: resume training on another rank count).

The tiny LM under the plan's ZeRO-1 (`replicate` + `zero.zero_optimizer`:
AdamW on each data rank's chunk of the flattened parameters) trains 2 steps
on 2 gloo ranks and writes `{"model": model.state_dict(), "optim":
optimizer.state_dict()}` with `torch.distributed.checkpoint`; 4 ranks, under
the same model's ZeRO-1 plan over 4, load it and train the third step. The
weights must then be those of the unmodified module trained 3 steps in one
process (1e-4 relative): the moments and step count came through, cut into
4 chunks where 2 wrote them. The same resumed with the model's weights only
(a fresh optimizer) must not be: the check can fail.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import parsat  # noqa: E402
from test_torch_native_runtime import BATCH, LR, SEQ, TOLERANCE, VOCAB_SIZE, _batch, _plan, _relative, tiny  # noqa: E402

STEPS_BEFORE = 2


def _step(model, optimizer, step: int) -> None:
    from parsat.backend.torch_native.apply import local_batch

    device = next(iter(model.parameters())).device   # the rank's (CUDA under nccl: the user-loop GPU job)
    loss = model(*local_batch(model, *(t.to(device) for t in _batch(step, BATCH, SEQ, VOCAB_SIZE))))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    optimizer.step()
    optimizer.zero_grad()


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def write_job(ctx, plan: dict, folder: str, by_parameter: bool = False) -> dict:
    """STEPS_BEFORE steps under `plan`, then the model's and the ZeRO-1 optimizer's state written with DCP (keyed
    by parameter with `by_parameter`: `parameter_state_dict`)."""
    import torch.distributed.checkpoint as dcp

    from parsat.backend.torch_native.zero import ZeroOneOptimizer, zero_optimizer

    model = parsat.parallelize(tiny()[0], plan, runtime="torch")
    optimizer = zero_optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=0.01)
    for step in range(STEPS_BEFORE):
        _step(model, optimizer, step)
    state = optimizer.parameter_state_dict() if by_parameter else optimizer.state_dict()
    dcp.save({"model": model.state_dict(), "optim": state}, checkpoint_id=folder)
    if by_parameter:
        return {"zero1": isinstance(optimizer, ZeroOneOptimizer), "names": sorted(state["state"]),
                "fc1": [repr(p) for p in state["state"]["fc1.weight"]["exp_avg"].placements]}
    (group_key, first), = state["state"].items()   # one flat parameter (one dtype)
    moments = {key: [repr(p) for p in value.placements] for key, value in first.items() if hasattr(value, "placements")}
    return {"zero1": isinstance(optimizer, ZeroOneOptimizer), "moments": moments, "key": group_key}


def resume_job(ctx, plan: dict, folder: str, by_parameter: bool = False) -> dict:
    """The checkpoint loaded under `plan` (another module seed, so loading matters), one more step; the largest
    relative difference of its weights from the unmodified module trained STEPS_BEFORE + 1 steps here. Also the
    same with the model's weights loaded and a fresh optimizer; and a checkpoint of another layout refused."""
    import torch.distributed.checkpoint as dcp

    from parsat.backend.torch_native.zero import zero_optimizer

    reference = copy.deepcopy(tiny()[0])
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    for step in range(STEPS_BEFORE + 1):
        loss = reference(*_batch(step, BATCH, SEQ, VOCAB_SIZE))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    out = {}
    for label in ("with_optimizer", "model_only"):
        model = parsat.parallelize(tiny(seed=1)[0], plan, runtime="torch")
        optimizer = zero_optimizer(model, torch.optim.AdamW, lr=LR / 7, weight_decay=0.5)
        state = {"model": model.state_dict()}
        if label == "with_optimizer":
            state["optim"] = optimizer.parameter_state_dict() if by_parameter else optimizer.state_dict()
        dcp.load(state, checkpoint_id=folder)
        if label == "with_optimizer":
            (optimizer.load_parameter_state_dict if by_parameter else optimizer.load_state_dict)(state["optim"])
            out["lr"] = optimizer.param_groups[0]["lr"]
            out["step"] = [float(group["step"]) for group in optimizer.state_dict()["state"].values()]
        _step(model, optimizer, STEPS_BEFORE)
        out[label] = max(_relative(_whole(model.get_parameter(n)).detach().cpu(), p.detach(), floor=LR)
                         for n, p in reference.named_parameters())
    try:   # the saved layout is checked: a state of other parameters is refused before anything changes
        if by_parameter:
            optimizer.load_parameter_state_dict({"state": {}, "param_groups": []})
        else:
            saved = optimizer.state_dict()
            optimizer.load_state_dict({**saved, "layout": {key: [[1, 2, 3]] for key in saved["layout"]}})
        out["refused"] = ""
    except ValueError as err:
        out["refused"] = str(err)
    if by_parameter:
        out["unmodified"] = _resumed_unmodified(folder, reference)
    return out


def _resumed_unmodified(folder: str, reference) -> float:
    """The checkpoint loaded into the unmodified module and a plain AdamW in this process (torch's own
    `get_optimizer_state_dict` / `set_optimizer_state_dict`, keyed by parameter name as the parallelized run
    wrote it), one more step: the largest relative difference from `reference`'s weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    plain = tiny(seed=1)[0]
    optimizer = torch.optim.AdamW(plain.parameters(), lr=LR / 7, weight_decay=0.5)
    state = {"model": plain.state_dict(), "optim": get_optimizer_state_dict(plain, optimizer)}
    dcp.load(state, checkpoint_id=folder)
    plain.load_state_dict(state["model"])
    set_optimizer_state_dict(plain, optimizer, state["optim"])
    loss = plain(*_batch(STEPS_BEFORE, BATCH, SEQ, VOCAB_SIZE))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm=0.5)
    optimizer.step()
    return max(_relative(plain.get_parameter(n).detach(), p.detach(), floor=LR)
               for n, p in reference.named_parameters())


@pytest.mark.slow
def test_zero1_optimizer_state_written_on_two_ranks_resumes_on_four_like_one_process(tmp_path):
    from parsat.backend.launch import LaunchConfig, launch

    graph = parsat.from_torch(*tiny())
    folder = str(tmp_path / "ckpt")
    written = launch(write_job, (dict(_plan(graph, (2, 1)), zero=1), folder),
                     LaunchConfig(nproc=2, backend="gloo", timeout_s=300))
    assert all(w["zero1"] for w in written)
    assert written[0]["moments"] == {"exp_avg": ["Shard(dim=0)"], "exp_avg_sq": ["Shard(dim=0)"]}, written[0]
    resumed = launch(resume_job, (dict(_plan(graph, (4, 1)), zero=1), folder),
                     LaunchConfig(nproc=4, backend="gloo", timeout_s=300))
    assert [w["key"] for w in written] == ["0", "0"]
    _check_resumed(resumed)


def _check_resumed(resumed: list) -> None:
    for result in resumed:
        assert result["with_optimizer"] <= TOLERANCE, result
        assert result["model_only"] > 10 * TOLERANCE, result   # a fresh optimizer state: not the same training
        assert result["lr"] == LR and result["step"] == [STEPS_BEFORE], result   # the saved groups and step count
        assert "saved for other parameters" in result["refused"] or "holds no entry" in result["refused"], result


@pytest.mark.slow
def test_zero1_beside_tensor_parallelism_keys_each_tp_rank_s_state_and_resumes_like_one_process(tmp_path):
    """dp 2 x tp 2, ZeRO-1 over dp: each tp rank's flat parameters are its own pieces of the weights, so its state
    is saved under its tp coordinate (`tp=0/0`, `tp=1/0`): saved under one key, DCP would keep one tp rank's
    and the resumed run would leave one process's."""
    from parsat.backend.launch import LaunchConfig, launch

    graph = parsat.from_torch(*tiny())
    plan = dict(_plan(graph, (2, 2)), zero=1)
    folder = str(tmp_path / "ckpt")
    written = launch(write_job, (plan, folder), LaunchConfig(nproc=4, backend="gloo", timeout_s=300))
    assert sorted({w["key"] for w in written}) == ["tp=0/0", "tp=1/0"], written
    _check_resumed(launch(resume_job, (plan, folder), LaunchConfig(nproc=4, backend="gloo", timeout_s=300)))


def test_each_rank_copies_exactly_its_chunk_of_the_members_laid_end_to_end():
    """`_overlaps` gives `step` the pieces of this rank's chunk and nothing else: over 3 ranks of 3 + 4 + 2
    elements (chunk 3), every element of every member lands once, at its offset in the concatenation."""
    from parsat.backend.torch_native.zero import _overlaps

    members = [torch.arange(3.0), torch.arange(3.0, 7.0).reshape(2, 2), torch.arange(7.0, 9.0)]
    seen = []
    for start in (0, 3, 6):
        chunk = torch.full((3,), -1.0)
        for p, member, part in _overlaps(members, start, 3):
            chunk[part] = p.reshape(-1)[member]
        seen.append(chunk)
    assert torch.equal(torch.cat(seen), torch.tensor([0.0, 1, 2, 3, 4, 5, 6, 7, 8]))
    assert [(member, part) for _p, member, part in _overlaps(members, 6, 3)] == [
        (slice(3, 4), slice(0, 1)), (slice(0, 2), slice(1, 3))]


@pytest.mark.slow
def test_zero1_state_keyed_by_parameter_resumes_on_another_tensor_parallel_degree_and_in_one_process(tmp_path):
    """`parameter_state_dict`: written under dp 2 x tp 2 on 4 gloo ranks, each moment placed as its parameter
    (fc1's `[Replicate(), Shard(0)]`), keyed by the module's names as torch keys a plain optimizer's; loaded under
    dp 4 (tensor-parallel degree 1: DCP reshards each parameter's pieces) the third step is one process's, and
    so it is loaded into the unmodified module with torch's plain AdamW (`set_optimizer_state_dict`)."""
    from parsat.backend.launch import LaunchConfig, launch

    graph = parsat.from_torch(*tiny())
    folder = str(tmp_path / "ckpt")
    written = launch(write_job, (dict(_plan(graph, (2, 2)), zero=1), folder, True),
                     LaunchConfig(nproc=4, backend="gloo", timeout_s=300))
    assert all(w["zero1"] for w in written)
    assert written[0]["names"] == sorted(n for n, _ in tiny()[0].named_parameters()), written[0]
    assert written[0]["fc1"] == ["Replicate()", "Shard(dim=0)"], written[0]
    resumed = launch(resume_job, (dict(_plan(graph, (4, 1)), zero=1), folder, True),
                     LaunchConfig(nproc=4, backend="gloo", timeout_s=300))
    _check_resumed(resumed)
    for result in resumed:
        assert result["unmodified"] <= TOLERANCE, result
    print({key: resumed[0][key] for key in ("with_optimizer", "model_only", "unmodified")})
