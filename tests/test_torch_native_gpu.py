"""`runtime="torch"` on nccl (issue 30, build item 5): the user-loop job of tests/test_torch_native_user_loop.py
(dp `replicate`, ZeRO-3 `fully_shard`, Megatron tp styles; gradient accumulation, fused AdamW, an LR scheduler,
a bf16 MixedPrecisionPolicy, plans shared from rank 0 and different plans refused) on 2 CUDA devices, one rank
each, against the unmodified module on one device. Skipped without 2 CUDA devices: CI stays CPU.

What nccl adds over gloo here: the parameters, batches and collectives on CUDA, and FSDP2's own streams for its
all-gathers and gradient reductions (torch's, not parsat's: the lowering hands the modules to `replicate` /
`fully_shard` unchanged). Attention keeps its CUDA kernels (`dtensor_step` forces the math one on CPU only).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_torch_native_user_loop import check_loop, check_mixed, run_loop  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="nccl needs one CUDA device per rank (2)")]


@pytest.fixture(scope="module")
def nccl_runs(tmp_path_factory):
    return run_loop(tmp_path_factory.mktemp("plan"), "nccl")


@pytest.mark.parametrize("label", ["dp", "zero3", "tp"])
def test_the_user_loop_on_nccl_trains_like_one_process(nccl_runs, label):
    check_loop(nccl_runs, label)


def test_ranks_holding_different_plans_are_refused_on_nccl(nccl_runs):
    for result in nccl_runs:
        assert "rank(s) 1 hold another plan than rank 0" in result["mismatch"], result["mismatch"]


def test_a_bf16_policy_on_cuda_computes_in_bf16(nccl_runs):
    check_mixed(nccl_runs)
