"""What the GPU profile (`DDP`) holds around attention and the data, as GPU frameworks run them (issue 31).

Eager PyTorch on CPU (`parsat run`, `PARSAT_RUN`) copies grouped-query attention's expanded k / v and the
attention output's transpose when it flattens them, and draws the embedding's ids and the cross-entropy's
targets one-hot. A GPU run does neither: FlashAttention / `scaled_dot_product_attention(enable_gqa=True)` read
the kv heads unexpanded and write the output [b, s, heads, d], and `nn.Embedding` / Megatron's vocabulary-parallel
embedding and cross-entropy read integer ids. The simulated peak decides whether a plan fits, so those buffers
(2.5 GiB on llama-70b:64's free plan, 4.0 on gpt-6.7b:64's) decided plans no GPU run needs."""

from __future__ import annotations

import dataclasses

import pytest

from parsat.cost.pcg_tasks import DDP, PARSAT_RUN, attention_views, onehot_ids, simulate_pcg
from parsat.dsl.library import load_library
from parsat.ir.data_forms import onehot_values
from parsat.ir.machine import Machine
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import build_example

GQA = {"blocks": 1, "hidden": 1024, "heads": 16, "kv_heads": 4, "batch": 4, "seq": 512, "vocab": 8000}


@pytest.fixture(scope="module")
def library():
    return load_library()[0]


@pytest.fixture(scope="module")
def gqa_tp(library):
    """A grouped-query LLaMA block laid out as Megatron-LM lays it out, tp 4 x dp 2 on one h100x8 node."""
    return megatron_pcg(build_example("llama", GQA, library), library, (2, 4), 8, vocabulary_loss=True)


def _allocated(step, word: str) -> int:
    """Bytes the forward tasks whose name starts with `word` allocate."""
    return sum(s.alloc for s in step.result.spans if s.phase == "forward" and s.name.startswith(word))


def _steps(library, pcg, off: str):
    """The step on an h100x8 as `DDP` runs it with the field `off` False (as before issue 31), as it runs it, and
    as `parsat run` runs it."""
    machine = Machine.preset("h100x8")
    return tuple(simulate_pcg(pcg, library, machine, profile)
                 for profile in (dataclasses.replace(DDP, **{off: False}), DDP, PARSAT_RUN))


def test_the_gpu_profile_holds_no_expanded_kv_nor_a_copy_of_the_attention_output(library, gqa_tp):
    eager, gpu, cpu = _steps(library, gqa_tp, "attention_layouts")
    # eager: v's expand + reshape copies (2 samples x 4 of the 16 heads x 512 x 64 x 2 bytes on this rank), and
    # so does the attention output's transpose + flatten: 2 x 524,288 bytes (k, rotated first, is contiguous:
    # the simulator takes its expand + reshape for a view already)
    assert _allocated(eager, "flatten") == 2 * 524_288
    assert _allocated(gpu, "flatten") == 0
    assert gpu.peak_memory_bytes < eager.peak_memory_bytes
    # the CPU runtime copies as eager PyTorch does: its profile is unchanged
    assert _allocated(cpu, "flatten") == 2 * 524_288


def test_only_flattens_around_fused_attention_are_views(library, gqa_tp):
    labels = sorted(gqa_tp.node(i).origin for i in attention_views(gqa_tp))
    assert labels == ["b0_ctx_merged", "b0_k_shared", "b0_v_shared"]
    # written-out attention (bmm, softmax, bmm) copies its output's transpose on a GPU too: not a view there
    written = build_example("gpt", {"blocks": 1, "hidden": 256, "heads": 4, "batch": 2, "seq": 64, "vocab": 512,
                                    "unfused_attention": 1}, library)
    pcg = megatron_pcg(written, library, (1, 2), 8)
    assert not attention_views(pcg)


def test_ids_and_targets_are_not_priced_as_one_hot_slices_on_gpus(library, gqa_tp):
    one_hot, gpu, cpu = _steps(library, gqa_tp, "integer_ids")
    # the vocabulary-parallel embedding's and cross-entropy's slices of the one-hot ids and targets over tp:
    # 2 x 512 x 8000 / 4 x 2 bytes each
    assert _allocated(one_hot, "partition") == 2 * 4_096_000
    assert _allocated(gpu, "partition") == 0
    assert one_hot.peak_memory_bytes - gpu.peak_memory_bytes >= 4_096_000
    # `parsat run` draws them one-hot, whole, on every rank
    assert _allocated(cpu, "data ids") == _allocated(cpu, "data targets") == 4 * 512 * 8000 * 2


def test_one_hot_values_are_the_data_and_what_only_moves_its_elements(library, gqa_tp):
    ids = {gqa_tp.node(i).origin or gqa_tp.node(i).op for i in onehot_ids(gqa_tp)}
    assert {"ids", "targets"} <= ids
    assert all(gqa_tp.node(i).kind in ("leaf", "parallel") for i in onehot_ids(gqa_tp))
    assert not any("rope" in name for name in ids)
    nodes = [("ids", "ids", []), ("w", "w", []), ("p", "partition", ["ids"]), ("e", "embedding", ["p", "w"]),
             ("t", "transpose", ["e"])]
    assert onehot_values(nodes) == frozenset({"ids", "p"})
