"""Fused bidirectional attention (issue 31, build 1): BERT's and ViT's attention as FlashAttention runs it.

`attention(q, k, v, c)` (rules/ops.rule) is softmax(c q k^T) v over every key, keys possibly other in number than
queries (cross-attention). `fuse_attention` (rules/algebraic.rule) proves it equal to the written-out bmm / scale /
softmax / bmm form; its heads-parallel rules and the Ulysses context-parallel rule (rules/parallel_layers.rule,
section attention) are proved, and the wrong variants (tests/wrong_rules/attention_bidirectional_wrong.rule)
refused. The cost model prices it as FlashAttention runs it: every score (twice the causal operator's FLOPs at
the same shapes), O(b s h) memory. The built-in bert builds it; the importer maps a dropout-free SDPA without a
mask, or under a constant mask keeping every key (what Hugging Face BERT passes under `torch.export`), onto it:
Hugging Face BERT's and ViT's `sdpa` attention import fused, the loss the module's (below), and Megatron's tp 2
plan of an encoder trains through it on 2 ranks like one process (below; HF BERT's in
tests/test_torch_native_runtime.py).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from parsat.cost.model import compute_cost
from parsat.dsl.library import load_library
from parsat.ir.graph import instance_for
from parsat.ir.machine import Machine
from parsat.ir.models import build_example
from parsat.ir.pcg import Degrees
from parsat.verifier.api import verify

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))   # mesh_plans
PROVED = {"algebraic.rule": ["fuse_attention"],
          "parallel_layers.rule": ["attention_partition", "partition_of_attention", "attention_replicate",
                                   "introduce_attention_parallel", "attention_context_parallel"]}
OPS = load_library()[0].ops


def test_the_fused_attention_rules_are_proved_and_the_wrong_ones_refused():
    for file, names in PROVED.items():
        verdicts = {v.name: v for v in verify([ROOT / "rules" / file], match=names)}
        assert sorted(verdicts) == sorted(names)
        for name in names:
            assert verdicts[name].verdict == "PROVED", verdicts[name]
    wrong = {v.name: v for v in verify([ROOT / "tests" / "wrong_rules" / "attention_bidirectional_wrong.rule"])}
    for name in ("attention_is_not_causal_attention", "attention_softmax_over_queries",
                 "attention_context_parallel_without_combine"):
        assert wrong[name].verdict == "REFUTED" and wrong[name].counterexample is not None, wrong[name]
    # q, k and v split alike on the sequence: each block's queries would miss the other blocks' keys
    assert wrong["attention_sequence_blocks"].verdict == "ILLEGAL", wrong["attention_sequence_blocks"]


def _instance(op: str, b: int, h: int, s: int, d: int, n: int | None = None):
    n = s if n is None else n
    return instance_for(OPS[op], ((b, h, s, d), (b, h, n, d), (b, h, n, d)), {"c": d ** -0.5})


def _cost(instance, machine, degrees=None):
    degrees = degrees or Degrees.whole(4)
    return compute_cost(instance, [degrees] * 3, degrees, machine, [False] * 3)


def test_bidirectional_attention_is_priced_at_every_score_and_keeps_only_its_output():
    """Twice the causal operator's FLOPs at equal shapes (every score, no causal half), the same kept bytes (its
    output and a logsumexp per query row), the same rate and backward; cross-attention counts s x n scores."""
    machine = Machine.preset("h100x8")
    full, causal = (_cost(_instance(op, 2, 4, 512, 64), machine) for op in ("attention", "attention_causal"))
    assert full.flops == 2 * causal.flops == 2 * 2 * 4 * 512 * 512 * (64 + 64)
    assert full.activation_bytes == causal.activation_bytes
    assert full.backward_s / full.forward_s == pytest.approx(causal.backward_s / causal.forward_s)
    cross = _cost(_instance("attention", 2, 4, 512, 64, n=128), machine)
    assert cross.flops == full.flops / 4 and cross.activation_bytes == full.activation_bytes
    heads = Degrees((1, 4, 1, 1))
    split = _cost(_instance("attention", 2, 4, 512, 64), machine, heads)
    assert split.flops == full.flops / 4 and split.activation_bytes == full.activation_bytes / 4


def test_bert_builds_fused_attention_whose_memory_is_linear_in_the_sequence():
    """The built-in bert's attention is `attention` (written out with `unfused_attention` 1); what the cost model
    keeps for its backward per token is the same at sequence 1024 and 8192 (no [b, n, s, s] scores)."""
    sizes = {"blocks": 1, "batch": 1, "hidden": 256, "heads": 4, "vocab": 512}
    per_token = []
    for seq in (1024, 8192):
        graph = build_example("bert", {**sizes, "seq": seq})
        ops = [n.op for n in graph.nodes]
        assert ops.count("attention") == 1 and "softmax" not in ops and "bmm" not in ops
        node = next(n for n in graph.nodes if n.op == "attention")
        shapes = graph.shapes()
        instance = instance_for(OPS["attention"], [shapes[i] for i in node.inputs], dict(node.attrs))
        per_token.append(_cost(instance, Machine.preset("h100x8")).activation_bytes / seq)
    assert per_token[0] == per_token[1]
    written = {n.op for n in build_example("bert", {**sizes, "seq": 1024, "unfused_attention": 1}).nodes}
    assert "softmax" in written and "attention" not in written


# ------------------------------------------------------------------ torch-native: trained through the fused op


class EncoderLM(nn.Module):
    """A one-block bidirectional encoder over token ids: q, k, v projections cut into 4 heads,
    `scaled_dot_product_attention` without a mask (what the importer makes `attention`), the heads merged, an
    output projection with a residual, and a head scored by cross-entropy."""

    def __init__(self, vocab: int = 32, width: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids, labels):
        h = self.emb(ids)
        b, s, d = h.shape
        q, k, v = (p(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        ctx = nn.functional.scaled_dot_product_attention(q, k, v)
        h = h + self.out(ctx.transpose(1, 2).reshape(b, s, d))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _encoder():
    torch.manual_seed(0)
    return EncoderLM().double()


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return tuple(torch.randint(0, 32, (4, 6), generator=g) for _ in range(2))


def _tensor_parallel_plan() -> tuple[dict, object]:
    """Megatron's tp 2 plan of the encoder's import (heads split on tp), and the import."""
    from parsat.backend.executor import operator_library
    from parsat.importer.export import import_module
    from parsat.ir.megatron import megatron_pcg
    import mesh_plans

    imported = import_module(_encoder(), _batch(0))
    pcg = megatron_pcg(imported.graph, operator_library(), (1, 2))
    assert pcg is not None
    return mesh_plans.plan_dict(imported.graph, pcg), imported


def test_the_encoders_tensor_parallel_plan_runs_fused_attention_on_the_heads_shards():
    """Without processes: the import is `attention` (no scores), Megatron's tp 2 plan places it on a split of the
    heads, and the torch-native lowering takes the plan."""
    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.lowering import lower
    from parsat.ir.placement import shard
    from parsat.ir.plan import pcg_from_dict

    plan, imported = _tensor_parallel_plan()
    assert [n.op for n in imported.graph.nodes].count("attention") == 1
    assert not {"bmm", "softmax"} & {n.op for n in imported.graph.nodes}
    pcg = pcg_from_dict(plan)
    attention = next(n for n in pcg.nodes if n.kind == "op" and n.op == "attention")
    assert attention.placement.codes == (shard(1),), attention.placement   # [batch, heads, seq, head size]
    assert lower(pcg, imported.graph, module_info(_encoder(), imported.weights)) is not None


class _SdpaCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is nn.functional.scaled_dot_product_attention
        return func(*args, **(kwargs or {}))


def encoder_job(ctx, plan: dict) -> dict:
    """On every rank: the encoder lowered under `plan` (torch-native), 3 AdamW steps with clipping on this rank's
    local batch beside the unmodified module on the global batch in this process; SDPA calls of the first
    forward counted."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import parsat
    from parsat.backend.torch_native.apply import local_batch

    module, reference = _encoder(), _encoder()
    model = parsat.parallelize(module, plan, _batch(0), runtime="torch")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, ref_losses, counter = [], [], _SdpaCalls()
    for step in range(3):
        ids, labels = _batch(step)
        with counter if step == 0 else contextlib.nullcontext():
            loss = model(*local_batch(model, ids, labels))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        held = loss.detach().clone()
        dist.all_reduce(held)
        losses.append(float(held) / ctx.world)
        want = reference(ids, labels)
        want.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(float(want.detach()))
    return {"losses": losses, "ref_losses": ref_losses, "sdpa": counter.calls,
            "dtensors": all(isinstance(p, DTensor) for p in model.parameters())}


@pytest.mark.slow
def test_the_encoders_tensor_parallel_plan_trains_on_two_ranks_like_one_process():
    """On 2 gloo ranks, Megatron's tp 2 plan of the encoder (fused `attention` on the heads' shards, run as SDPA)
    trains 3 AdamW steps with clipping like the unmodified module in one process (losses within 1e-6)."""
    from parsat.backend.launch import LaunchConfig, launch

    plan, _ = _tensor_parallel_plan()
    for result in launch(encoder_job, (plan,), LaunchConfig(nproc=2, backend="gloo", timeout_s=600)):
        assert result["dtensors"] and result["sdpa"] == 1, result
        for got, want in zip(result["losses"], result["ref_losses"]):
            assert abs(got - want) <= 1e-6 * abs(want), result


# ------------------------------------------------------------------ Hugging Face encoders imported fused


@pytest.mark.parametrize("name", ["bert", "vit"])
def test_hugging_face_sdpa_encoders_import_as_the_fused_operator(name):
    """HF BERT's and ViT's `sdpa` attention (in eval: no dropout; no padding mask, BERT's all-ones mask a constant)
    imports as `attention`, nothing written out, and the imported graph's loss is the module's (float64)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hf_models
    from test_backend_fx import imported_output

    module, inputs = hf_models.make(name)
    assert module.model.config._attn_implementation == "sdpa"
    want, got, graph = imported_output(module, inputs)
    ops = [n.op for n in graph.nodes]
    assert ops.count("attention") == 2 and not {"bmm", "softmax", "softmax_masked"} & set(ops), ops
    assert abs(float(got) - float(want)) <= 1e-10 * abs(float(want))
