"""A pipelined plan on torch's own pipelining: `parsat.parallelize(module, plan, example_inputs, runtime="torch")`.

The built-in `gpt` (4 blocks, tied embedding and head), written as a torch
module with the graph's weights (`GPT` below: block i's weights under
`blocks.{i}.`, the plan's `b{i}_...` mapped by `weight_names`), is planned
with the pipeline pinned (`--degrees pp=2`, as `parsat optimize gpt --set
blocks=4 ... --devices 2 --machine cpu --degrees pp=2` does). Without
processes: the lowering (the cut before `blocks.2`, the schedule, the tied
embedding shared by the first and last stage) and its refusals. On gloo
ranks (slow): the user's loop (`model.step`, `model.clip_grad_norm_`,
AdamW) trains it 3 steps on 2 ranks (pp 2) and on 4 ranks (pp 2 x dp 2,
and pp 2 x tp 2: Megatron's tensor parallelism inside each stage, the
traced stages' parameters DTensors placed as the plan stores them)
like the unmodified module trained on the whole batch in one process:
losses, clipped norms and final weights within 1e-4 relative, every
parameter a DTensor.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import re
from collections import Counter
from dataclasses import replace
from functools import partial

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import parsat  # noqa: E402
from parsat.backend.torch_native.apply import module_info  # noqa: E402
from parsat.backend.torch_native.lowering import LoweringError  # noqa: E402
from parsat.backend.torch_native.pipeline_lowering import lower_pipeline  # noqa: E402

SIZES = {"blocks": 4, "batch": 8, "seq": 8, "hidden": 16, "heads": 2, "vocab": 32}
MICROBATCHES = 4
TOLERANCE = 1e-4
BLOCK_WEIGHTS = ("ln1_g", "ln1_b", "wqkv", "bqkv", "wo", "bo", "ln2_g", "ln2_b", "w1", "b1", "w2", "b2")


class Block(nn.Module):
    """`ir.models._gpt_block` in torch: pre-LN, causal multi-head attention (q, k, v one product laid out per head,
    as Megatron-LM's `query_key_value`), tanh-GELU MLP; weights [in, out]."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        shapes = {"wqkv": (hidden, 3 * hidden), "bqkv": (3 * hidden,), "wo": (hidden, hidden),
                  "w1": (hidden, 4 * hidden), "w2": (4 * hidden, hidden), "b1": (4 * hidden,)}
        for name in BLOCK_WEIGHTS:
            shape = shapes.get(name, (hidden,))
            init = torch.ones(shape) if name.endswith("_g") else torch.randn(shape) * 0.2
            setattr(self, name, nn.Parameter(init))

    def forward(self, x):
        h = x.shape[-1]
        dh = h // self.heads

        a = F.layer_norm(x, (h,), self.ln1_g, self.ln1_b, 1e-5)
        q, k, v = (a @ self.wqkv + self.bqkv).unflatten(2, (self.heads, 3 * dh)).transpose(1, 2).split(dh, dim=-1)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(dh))
        x = x + ctx.transpose(1, 2).flatten(2) @ self.wo + self.bo
        m = F.layer_norm(x, (h,), self.ln2_g, self.ln2_b, 1e-5)
        return x + F.gelu(m @ self.w1 + self.b1, approximate="tanh") @ self.w2 + self.b2


class GPT(nn.Module):
    """`ir.models.gpt` in torch: token and position embeddings, the blocks, a final LayerNorm, the head tied to
    the token embedding, mean cross-entropy over every position."""

    def __init__(self, blocks: int, seq: int, hidden: int, heads: int, vocab: int):
        super().__init__()
        self.wte = nn.Parameter(torch.randn(vocab, hidden) * 0.2)
        self.wpe = nn.Parameter(torch.randn(seq, hidden) * 0.2)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(blocks))
        self.lnf_g, self.lnf_b = nn.Parameter(torch.ones(hidden)), nn.Parameter(torch.zeros(hidden))

    def positions(self, _ids):
        """The position embeddings added to the tokens' (the whole table: the traced sequence is its length)."""
        return self.wpe

    def forward(self, ids, targets):
        x = F.embedding(ids, self.wte) + self.positions(ids)
        for block in self.blocks:
            x = block(x)
        x = F.layer_norm(x, (x.shape[-1],), self.lnf_g, self.lnf_b, 1e-5)
        return F.cross_entropy((x @ self.wte.t()).flatten(0, 1), targets.flatten())


def gpt_module(seed: int = 0) -> GPT:
    """In float64: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift of every score),
    and in float32 AdamW turns its rounding noise into whole learning-rate steps (5e-3 of the bias apart after 3
    steps, while losses and norms agree within 2e-7)."""
    torch.manual_seed(seed)
    return GPT(SIZES["blocks"], SIZES["seq"], SIZES["hidden"], SIZES["heads"], SIZES["vocab"]).double()


def weight_names() -> dict[str, str]:
    """The plan's names (`b{i}_wqkv`) -> the module's (`blocks.{i}.wqkv`)."""
    return {f"b{i}_{name}": f"blocks.{i}.{name}" for i in range(SIZES["blocks"]) for name in BLOCK_WEIGHTS}


def batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    shape = (SIZES["batch"], SIZES["seq"])
    return torch.randint(0, SIZES["vocab"], shape, generator=g), torch.randint(0, SIZES["vocab"], shape, generator=g)


def pipelined_plan(devices: int, schedule: str = "1f1b", **degrees):
    """The built-in gpt planned with the pipeline pinned (pp=2) on the `cpu` machine."""
    return parsat.optimize("gpt", machine="cpu", devices=devices, sizes=SIZES, microbatches=MICROBATCHES,
                           schedule=schedule, degrees={"pp": 2, **degrees}, baselines=False)


@pytest.fixture(scope="module")
def pp2():
    return pipelined_plan(2)


# ------------------------------------------------------------------ the lowering, without processes


def test_a_pipelined_plan_is_cut_before_a_block_with_the_tied_embedding_on_both_ends(pp2):
    lowering = lower_pipeline(pp2.pcg, pp2.graph, pp2.pipeline, module_info(gpt_module(), weight_names()))
    starts = [c.layers[0] for c in pp2.pipeline.layout.chunks]
    assert lowering.split_points() == tuple(f"blocks.{layer}" for layer in starts[1:])
    assert lowering.torch_schedule == "Schedule1F1B" and lowering.microbatches == MICROBATCHES
    assert lowering.shared == ((("wte",), (0, 1)),)
    first, last = lowering.chunks
    assert {"wte", "wpe", "blocks.0.wqkv"} <= set(first.params) and "lnf_g" not in first.params
    assert {"wte", "lnf_g", f"blocks.{SIZES['blocks'] - 1}.w2"} <= set(last.params)
    assert not set(first.params) & set(last.params) - {"wte"}
    assert lowering.stage is None and "Schedule1F1B(n_microbatches=4)" in lowering.describe()


def test_recomputing_blocks_checkpoints_each_block_module(pp2):
    """A plan that recomputes blocks names each block's module; `checkpoint_blocks` runs their forwards under
    torch.utils.checkpoint: the forward keeps fewer tensors for backward, and the gradients are the same."""
    from parsat.backend.torch_native.apply import checkpoint_blocks

    info = module_info(gpt_module(), weight_names())
    lowering = lower_pipeline(replace(pp2.pcg, recompute="blocks"), pp2.graph, pp2.pipeline, info)
    assert lowering.recompute == tuple(f"blocks.{i}" for i in range(SIZES["blocks"]))
    assert "torch.utils.checkpoint" in lowering.describe()
    kept, grads = [], []
    for recompute in (False, True):
        module = gpt_module()
        if recompute:
            checkpoint_blocks(module, lowering.recompute)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            loss = module(*batch(0))
        loss.backward()
        kept.append(sum(saved))
        grads.append({n: p.grad for n, p in module.named_parameters()})
    assert kept[1] < kept[0] / 2, kept
    assert all(torch.allclose(grads[0][n], grads[1][n], rtol=1e-12, atol=1e-14) for n in grads[0])


def test_what_torch_pipelining_cannot_run_is_refused(pp2):
    info = module_info(gpt_module(), weight_names())
    # the cut block's weights held by two blocks' modules (one read from the block before): no one submodule
    # holds the layer alone, so there is nothing to cut before
    names = dict(weight_names())
    cut = pp2.pipeline.layout.chunks[1].layers[0]
    names[f"b{cut}_wqkv"] = f"blocks.{cut - 1}.wqkv"
    with pytest.raises(LoweringError, match=rf"cuts before layer {cut}.*no submodule"):
        lower_pipeline(pp2.pcg, pp2.graph, pp2.pipeline, module_info(gpt_module(), names))
    with pytest.raises(LoweringError, match="give parallelize weight_names"):
        lower_pipeline(pp2.pcg, pp2.graph, pp2.pipeline, module_info(gpt_module()))


def test_ranks_holding_pipelines_that_differ_hold_different_plans(pp2):
    """The plan every rank must hold (`plan_share.fingerprint`) includes its pipeline: the same stage plan cut
    into other chunks or run in another schedule is another plan."""
    from parsat.backend.plan_share import fingerprint
    from parsat.ir.pipeline import lay_out_stages

    mine = fingerprint(pp2.pcg, pp2.graph, pp2.pipeline)
    assert mine == fingerprint(pp2.pcg, pp2.graph, replace(pp2.pipeline, bubble_fraction=0.0))   # a prediction
    assert mine != fingerprint(pp2.pcg, pp2.graph, replace(pp2.pipeline, schedule="gpipe"))
    assert mine != fingerprint(pp2.pcg, pp2.graph, replace(pp2.pipeline, layout=lay_out_stages(pp2.pcg, [-1, 1], 2)))
    assert mine != fingerprint(pp2.pcg, pp2.graph)
    assert mine != fingerprint(pp2.pcg, pp2.graph, pp2.pipeline, regathers=True)   # one more all-gather a product


def test_the_plans_machine_says_whether_the_torch_runtime_re_gathers(pp2):
    """`parallelize.resolved_plan` reads the plan's machine (a `Plan`'s, a plan dict's, a plan file's) into the
    one boolean the torch runtime needs: priced as a runtime that re-gathers (a GPU preset: Megatron-LM's choice)
    or not (`cpu`: autograd keeps the gathered input), as `cost.saved.runtime_regathers` prices it."""
    from parsat.backend.parallelize import resolve_plan, resolved_plan
    from parsat.cost.saved import runtime_regathers
    from parsat.ir.machine import Machine

    gpu = replace(pp2, machine=Machine.preset("h100x8"))
    assert [resolved_plan(p)[3] for p in (pp2, pp2.to_dict(), gpu, gpu.to_dict())] == [False, False, True, True]
    assert [runtime_regathers(p.machine) for p in (pp2, gpu)] == [False, True]
    assert resolve_plan(gpu) == resolved_plan(gpu)[:3] and len(resolve_plan(gpu.to_dict())) == 3
    data = gpu.to_dict()
    del data["machine"]
    assert resolved_plan(data)[3] is False
    lowering = lower_pipeline(pp2.pcg, pp2.graph, pp2.pipeline, module_info(gpt_module(), weight_names()),
                              regathers=True)
    assert lowering.regathers and not lower_pipeline(pp2.pcg, pp2.graph, pp2.pipeline,
                                                     module_info(gpt_module(), weight_names())).regathers


def test_a_pipelined_plan_without_example_inputs_is_refused_before_any_process_starts(pp2):
    from parsat.backend.torch_native.apply import NativeParallelizeError

    with pytest.raises(NativeParallelizeError, match="pipelined plan needs example_inputs"):
        parsat.parallelize(gpt_module(), pp2, runtime="torch", weight_names=weight_names())


def megatron_stage_plan(pp2, sequence: bool = False, shape: tuple[int, int] = (1, 2)):
    """The pp=2 plan's cut and schedule with Megatron's layout (`shape`: dp x tp, default tp 2) as the stage plan,
    on 2 x dp x tp devices: what `--degrees pp=2,tp=2` asks for, laid out by the test itself as the PTD-P baseline
    does (the optimizer's own pinned plan splits every contraction's weight on tp too: below)."""
    from parsat.backend.executor import operator_library
    from parsat.ir.megatron import megatron_pcg
    from parsat.ir.pipeline import lay_out_stages

    stage_plan = megatron_pcg(pp2.graph, operator_library(), shape, sequence=sequence)
    starts = [c.layers[0] for c in pp2.pipeline.layout.chunks]
    devices = shape[0] * shape[1]
    pipeline = replace(pp2.pipeline, stage_devices=devices, layout=lay_out_stages(stage_plan, starts, 2))
    return replace(pp2, pcg=stage_plan, costs={}, devices=2 * devices, pipeline=pipeline)


def test_tensor_parallelism_inside_a_stage_is_each_weights_dtensor_placement(pp2):
    """Megatron's layout on each stage's 2 devices (tp 2), cut as the pp=2 plan is: the traced stage modules call
    no nn.Linear, so each split weight is a Shard(d) DTensor, d as the plan stores it (the projections read
    `x @ w`, [in, out]: the fused q/k/v and the MLP's first weight column-parallel, Shard(1); the output projections
    row-parallel, Shard(0)), every other parameter Replicate(); the same role analysis as `lower`."""
    plan = megatron_stage_plan(pp2)
    lowering = lower_pipeline(plan.pcg, plan.graph, plan.pipeline, module_info(gpt_module(), weight_names()))
    stage = lowering.stage
    assert stage.mesh.names == ("tp",) and stage.tensor_axis == 0 and stage.styles == ()
    assert lowering.device_mesh_shape() == ((2, 2), ("pp", "tp"))
    splits = {s.params[0]: s for s in stage.traced_splits}
    for name in ("wqkv", "w1", "bqkv", "b1"):
        assert splits[f"blocks.0.{name}"].dim == (1 if name.startswith("w") else 0), name
    assert splits["blocks.3.wqkv"].kind == "column-parallel" and splits["blocks.3.wo"].kind == "row-parallel"
    assert splits["blocks.1.w2"].dim == 0 and splits["blocks.1.w2"].kind == "row-parallel"
    assert "blocks.0.ln1_g" not in splits and "blocks.0.bo" not in splits and "lnf_g" not in splits
    text = lowering.describe()
    assert "DTensor parameters" in text and "blocks.0.wo: Shard(0), row-parallel" in text, text


def test_a_stage_with_data_and_tensor_axes_is_replicate_over_dp_and_dtensor_placements_on_tp(pp2):
    """3-D parallelism, pp 2 x dp 2 x tp 2 (8 ranks): Megatron's dp 2 x tp 2 layout as the stage plan lowers,
    without processes, to a (pp, dp, tp) mesh, each stage module's split weights Shard(d) on tp and the module
    `replicate`d over dp. Not run on 8 ranks here (too slow on this box's 2 cores; docs/TORCH_NATIVE.md)."""
    plan = megatron_stage_plan(pp2, shape=(2, 2))
    lowering = lower_pipeline(plan.pcg, plan.graph, plan.pipeline, module_info(gpt_module(), weight_names()))
    assert lowering.device_mesh_shape() == ((2, 2, 2), ("pp", "dp", "tp"))
    stage = lowering.stage
    assert stage.axis_roles == ("data", "tensor") and stage.batch_axes == (0,)
    splits = {s.params[0]: s for s in stage.traced_splits}
    assert splits["blocks.0.wqkv"].dim == 1 and splits["blocks.2.wo"].kind == "row-parallel"
    assert "replicate over dp" in lowering.describe()


def test_sequence_parallel_stages_send_and_receive_pieces_of_the_sequence(pp2):
    """Without processes: the module traced and cut as `apply_pipeline` cuts it, each stage module's floating
    outputs (and a later stage's floating inputs) get the shape of one tp rank's `Shard(1)` piece in their traced
    values (what torch's PipelineStage sizes its send checks and receive buffers by, forward and backward), the
    carried integer labels and the loss whole; a sequence the tp ranks do not divide is refused by name."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    from parsat.backend.torch_native.apply import NativeParallelizeError
    from parsat.backend.torch_native.pipelined import (TRACED_PREFIX, _PassInputsThrough, _contiguous_outputs,
                                                       _flat_nodes, _sequence_pieces)

    lowering = lower_pipeline(pp2.pcg, pp2.graph, pp2.pipeline, module_info(gpt_module(), weight_names()))
    cuts = lowering.split_points()
    micro = tuple(x[: SIZES["batch"] // MICROBATCHES] for x in batch(0))
    pipe = pipeline(_PassInputsThrough(gpt_module(), cuts), mb_args=micro,
                    split_spec={TRACED_PREFIX + cut: SplitPoint.BEGINNING for cut in cuts})
    first, last = pipe.get_stage_module(0), pipe.get_stage_module(1)
    _contiguous_outputs([first, last])

    def shapes(sub, op: str) -> list:
        out = next(n for n in sub.graph.nodes if n.op == "output")
        nodes = [n for n in sub.graph.nodes if n.op == "placeholder"] if op == "placeholder" else _flat_nodes(out.args)
        return sorted((str(n.meta["val"].dtype), tuple(n.meta["val"].shape)) for n in nodes)

    whole = (SIZES["batch"] // MICROBATCHES, SIZES["seq"], SIZES["hidden"])
    piece = (whole[0], whole[1] // 2, whole[2])
    assert ("torch.float64", whole) in shapes(first, "output") and ("torch.float64", whole) in shapes(last, "placeholder")
    with pytest.raises(NativeParallelizeError, match=r"split along the sequence \(dim 1\) on 3 tp ranks"):
        _sequence_pieces(first, 3, received=False)
    _sequence_pieces(first, 2, received=False)
    _sequence_pieces(last, 2, received=True)
    assert ("torch.float64", piece) in shapes(first, "output") and ("torch.float64", whole) not in shapes(first, "output")
    assert ("torch.float64", piece) in shapes(last, "placeholder")
    assert ("torch.int64", tuple(micro[1].shape)) in shapes(last, "placeholder")   # the labels, carried whole
    assert shapes(last, "output") == [("torch.float64", ())]   # the loss


@pytest.mark.parametrize("sequence", [True, False], ids=["sequence-parallel", "tensor-parallel"])
def test_a_tensor_parallel_stage_computes_its_split_products_on_local_pieces(pp2, sequence):
    """Without processes: in the traced stages of Megatron's stage plan, with sequence parallelism and without,
    every `matmul` of a weight the plan splits on tp (each block's wqkv and w1 column-parallel, wo and w2
    row-parallel, and on the last stage the tied head's `wte.t()`) calls `sequence_parallel_matmul` (with) or
    `tensor_parallel_matmul` (without: the row sums all-reduced at once), and the first stage's lookup of the
    vocabulary-split table `vocabulary_parallel_embedding` or `tensor_parallel_embedding` (the plan's
    collectives only, tests/test_torch_native_sequence_products.py); nothing else does (the attention's
    products, no weight), and without sequence parallelism each add calls `tensor_parallel_add` (DTensor's own
    add for the gpt's, whose residual stream is whole); the last stage's cross-entropy can be pointed at `traced_cross_entropy`
    (`traced_losses`, where the plan's loss is vocabulary-parallel)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    from parsat.backend.torch_native import sequence_products as products
    from parsat.backend.torch_native.apply import _stored_dims
    from parsat.backend.torch_native.loss_parallel import traced_losses
    from parsat.backend.torch_native.lowering import SPLIT
    from parsat.backend.torch_native.pipelined import TRACED_PREFIX, _PassInputsThrough

    plan = megatron_stage_plan(pp2, sequence=sequence)
    lowering = lower_pipeline(plan.pcg, plan.graph, plan.pipeline, module_info(gpt_module(), weight_names()))
    cuts = lowering.split_points()
    micro = tuple(x[: SIZES["batch"] // MICROBATCHES] for x in batch(0))
    pipe = pipeline(_PassInputsThrough(gpt_module(), cuts), mb_args=micro,
                    split_spec={TRACED_PREFIX + cut: SplitPoint.BEGINNING for cut in cuts})
    split = products.split_weights(_stored_dims(lowering.stage, SPLIT), TRACED_PREFIX)
    blocks = SIZES["blocks"] // 2
    matmul, lookup = ((products.sequence_parallel_matmul, products.vocabulary_parallel_embedding) if sequence else
                      (products.tensor_parallel_matmul, products.tensor_parallel_embedding))
    named = {matmul: 1, lookup: 0}   # the argument naming the weight
    everything = {getattr(products, f) for f in dir(products) if f.endswith(("_matmul", "_linear", "_embedding"))}

    def adds(sub) -> int:   # retargeted to `tensor_parallel_add` without sequence parallelism, counted as made
        return 0 if sequence else sum(n.op == "call_function" and n.target is torch.ops.aten.add.Tensor
                                      for m in sub.modules() for n in getattr(m, "graph", torch.fx.Graph()).nodes)

    for index, last in ((0, 0), (1, 1)):
        sub = pipe.get_stage_module(index)
        added = adds(sub)
        assert products.local_products(sub, split, sequence) == 4 * blocks + 1 + added   # tensor_parallel_add's too
        nodes = [n for m in sub.modules() for n in getattr(m, "graph", torch.fx.Graph()).nodes
                 if n.op == "call_function" and n.target in everything]
        assert {n.target for n in nodes} <= set(named), {n.target.__name__ for n in nodes}
        calls = Counter((n.target, str(n.args[named[n.target]])) for n in nodes)
        ends = {(matmul, "t_default"): 1} if last else {(lookup, "wte"): 1}
        assert calls == Counter({**{(matmul, w): blocks for w in ("wqkv", "wo", "w1", "w2")}, **ends})
        assert products.local_products(sub, split, sequence) == 0   # made once
        assert traced_losses(sub) == last   # the cross-entropy, on the last stage (run as loss parallelism)
    # the plan's machine priced as a runtime that re-gathers: the re-gathering products (which re-gather the
    # column-parallel ones' input), except in a checkpointed block (its recomputation gathers again already)
    pipe = pipeline(_PassInputsThrough(gpt_module(), cuts), mb_args=micro,
                    split_spec={TRACED_PREFIX + cut: SplitPoint.BEGINNING for cut in cuts})
    sub = pipe.get_stage_module(1)
    recomputed = sorted({n for n, _ in sub.named_modules() if n.startswith(TRACED_PREFIX + "blocks.")
                         and n.count(".") == 2})[:1]
    assert recomputed, [n for n, _ in sub.named_modules()]
    added = adds(sub)
    assert products.local_products(sub, split, sequence, regather=True, recomputed=recomputed) == \
        4 * blocks + 1 + added
    made = Counter(n.target for m in sub.modules() for n in getattr(m, "graph", torch.fx.Graph()).nodes
                   if n.op == "call_function" and n.target in everything)
    assert made == (Counter({products.sequence_parallel_regathering_matmul: 4 * (blocks - 1) + 1, matmul: 4})
                    if sequence else Counter({matmul: 4 * blocks + 1}))


def test_a_sequence_parallel_stage_plan_is_lowered_and_what_still_cannot_be_is_refused(pp2):
    """Sequence parallelism inside a stage is lowered: Megatron's stage plan with `sequence=True` and the
    optimizer's own pinned `pp=2,tp=2,sp=2` plan (its layer norms' weights `Replicate()` beside the split ones,
    the values crossing between the stages split along the sequence on tp: each tp rank sends its `Shard(1)`
    piece). The optimizer's pinned pp=2 x tp=2 plan without sp crosses whole. Refused, naming the node: a crossing
    split on tp otherwise than along the sequence (torch's traced stages send each value whole, or its piece of
    the sequence only)."""
    info = module_info(gpt_module(), weight_names())
    for plan, loss in ((megatron_stage_plan(pp2, sequence=True), ()), (pipelined_plan(4, tp=2, sp=2), ("nll",))):
        lowered = lower_pipeline(plan.pcg, plan.graph, plan.pipeline, info)
        assert lowered.stage.tensor_axis == 0 and lowered.sequence_crossings
        assert lowered.device_mesh_shape() == ((2, 2), ("pp", "tp"))
        assert lowered.stage.loss_parallel == loss   # the optimizer's vocabulary-parallel loss: loss parallelism
    pinned = pipelined_plan(4, tp=2)
    lowered = lower_pipeline(pinned.pcg, pinned.graph, pinned.pipeline, info)
    assert lowered.stage.tensor_axis == 0 and not lowered.sequence_crossings
    from parsat.ir.placement import Placement, shard

    plan = megatron_stage_plan(pp2)
    crossing = plan.pipeline.layout.crossings[0].node
    nodes = tuple(replace(n, placement=Placement((shard(2),))) if n.id == crossing else n for n in plan.pcg.nodes)
    with pytest.raises(LoweringError, match=rf"node #{crossing} .* crosses from chunk 0 to chunk 1 as .* on tensor "
                                            "axis tp: the traced stages send each value whole"):
        lower_pipeline(replace(plan.pcg, nodes=nodes), plan.graph, plan.pipeline, info)


# ------------------------------------------------------------------ training on gloo ranks (slow)



# ------------------------------------------------------------------ collectives counted on the ranks (test only)


FUNCTIONAL = {"all_gather_single": "all-gather", "reduce_scatter_single": "reduce-scatter", "all_reduce": "all-reduce"}
# one line of a plan node's `collectives` (`cost.model._price_runs`): "fwd all-gather x1 (2 devices, 256 elements)"
PLAN_LINE = re.compile(r"^(fwd|bwd) (all-gather|reduce-scatter|all-reduce|all-to-all) x(\d+) \((\d+) devices, "
                       r"(\d+) elements\)( \[gradient sync\])?$")


@contextlib.contextmanager
def counted_collectives(model):
    """Test-only: every functional collective this rank issues while inside (DTensor's redistributions call
    `torch.distributed._functional_collectives`' `all_gather_single`, `reduce_scatter_single` and `all_reduce` by
    module attribute, so wrapping those attributes sees them all; CommDebugMode's dispatch mode broke the first
    stage's run), counted as "schedule {fwd|bwd} {kind} {n}" inside the pipeline schedule's step (the
    micro-batches' forward and backward: `bwd` while autograd's backward runs it) and "after {kind} {n}" outside it
    (the gradients placed as their parameters), n the cost model's (the gathered size, the reduce-scattered
    input's, the all-reduced one's); and the elements this rank's stages send to another stage
    (`PipelineStage.get_fwd_send_ops` / `get_bwd_send_ops`, wrapped on the instances), "send fwd" / "send bwd"
    (" int" after it: integer values). Yields the Counter."""
    import torch.distributed._functional_collectives as funcol

    counts: Counter = Counter()
    where = ["after"]

    def wrap_collective(name, kind):
        original = getattr(funcol, name)
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            group = bound["group"]
            size = group[0].size(group[1]) if isinstance(group, tuple) else funcol._resolve_group(group).size()
            n = bound["self"].numel() * (size if kind == "all-gather" else 1)
            if where[0] == "schedule":
                counts[f"schedule {'bwd' if torch._C._current_graph_task_id() != -1 else 'fwd'} {kind} {n}"] += 1
            else:
                counts[f"after {kind} {n}"] += 1
            return original(*args, **kwargs)
        return original, counted

    def wrap_sends(stage, name, phase):
        original = getattr(stage, name)

        def counted(chunk):
            ops = original(chunk)
            for op in ops:   # the module's carried integer inputs (ids, labels) hop too: counted apart
                counts[f"send {phase}" + ("" if op.tensor.is_floating_point() else " int")] += op.tensor.numel()
            return ops
        setattr(stage, name, counted)

    schedule = model.schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        wrap_sends(stage, "get_fwd_send_ops", "fwd")
        wrap_sends(stage, "get_bwd_send_ops", "bwd")
    originals = {name: wrap_collective(name, kind) for name, kind in FUNCTIONAL.items()}
    step = schedule.step

    def scheduled(*args, **kwargs):
        where[0] = "schedule"
        try:
            return step(*args, **kwargs)
        finally:
            where[0] = "after"
    schedule.step = scheduled
    for name, (_, counted) in originals.items():
        setattr(funcol, name, counted)
    try:
        yield counts
    finally:
        for name, (original, _) in originals.items():
            setattr(funcol, name, original)
        del schedule.step
        for stage in stages:
            del stage.get_fwd_send_ops, stage.get_bwd_send_ops


def plan_collectives(plan) -> list[Counter]:
    """Per pipeline stage, the collectives the plan's stage plan runs in a step, as `counted_collectives` counts
    them: each node's `collectives` (the cost model's, `NodeCost.collectives`; a plan made without costs, the
    test's Megatron layout, priced by `search.solve.price_pcg`), those of a weight's chain (its gradient's
    all-reduce) once a step "after" the schedule, every other once a micro-batch inside it; and what each stage
    sends another (the crossings' pieces, forward and their gradients back, as `ir.pipeline.p2p_elements`)."""
    from parsat.backend.executor import operator_library
    from parsat.search.solve import price_pcg

    pipeline = plan.pipeline
    m = pipeline.microbatches
    costs = plan.costs or price_pcg(plan.pcg, operator_library(), plan.machine, microbatches=m)
    out = [Counter() for _ in range(pipeline.degree)]
    for chunk in pipeline.layout.chunks:
        for node in chunk.nodes:
            cost = costs.get(node)
            for line in cost.collectives if cost is not None else ():
                phase, kind, pieces, _, n, _ = PLAN_LINE.match(line).groups()
                key = f"after {kind} {n}" if cost.weight_chain else f"schedule {phase} {kind} {n}"
                out[chunk.stage][key] += int(pieces) * (1 if cost.weight_chain else m)
    stage = {c.index: c.stage for c in pipeline.layout.chunks}
    for crossing in pipeline.layout.crossings:   # as `ir.pipeline.p2p_elements`, by direction
        if stage[crossing.source] != stage[crossing.target]:
            out[stage[crossing.source]]["send fwd"] += crossing.piece_elements * m
            out[stage[crossing.target]]["send bwd"] += crossing.piece_elements * m
    return out


SEQUENCE_PIECE = SIZES["batch"] // MICROBATCHES * SIZES["seq"] * SIZES["hidden"]   # a micro-batch's residual stream


def _relative(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def train_job(ctx, plans: dict, steps: int, folder: str | None = None) -> dict:
    """`train_plan` for each plan, in one job: label -> its result. The GPipe plan is held by rank 0 only (the
    others pass None and receive it, pipeline included)."""
    return {label: train_plan(ctx, plan, steps, held_by_all=label != "gpipe", folder=folder and f"{folder}/{label}")
            for label, plan in plans.items()}


def train_plan(ctx, plan: dict, steps: int, held_by_all: bool = True, folder: str | None = None) -> dict:
    """On every rank: the GPT parallelized with the pipelined plan, the user's loop (`step`, `clip_grad_norm_`,
    AdamW) on this rank's local batch, beside the unmodified module trained on the whole batch in this process;
    with a folder, the DCP checkpoint of `model.state_dict()` written there and each rank's weights gathered
    whole saved beside it (`rank{r}.pt`)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from parsat.backend.torch_native.apply import NativeParallelizeError, local_batch, lowering_of
    from parsat.backend.torch_native.zero import zero_optimizer

    module = gpt_module()
    reference = copy.deepcopy(module)
    # the stage plan's data-parallel replicas (its axes but the tensor axis; tensor-parallel ranks share a batch)
    data = math.prod(a["size"] for a in plan["mesh"]["axes"] if a["name"] != "tp")
    example = tuple(x[: x.shape[0] // data] for x in batch(0))   # a local batch's shape
    held = plan if held_by_all or ctx.rank == 0 else None
    model = parsat.parallelize(module, held, example, runtime="torch", weight_names=weight_names())
    refusals = []   # calling it as a module, and a step of another batch shape: clear errors, nothing run
    for wrong in (lambda: model(*batch(0)), lambda: model.step(*(x[:1] for x in batch(0)))):
        try:
            wrong()
        except NativeParallelizeError as err:
            refusals.append(str(err))
    # the optimizer the plan asks for: ZeRO-1's sharded state where the stage plan has it, else AdamW itself
    optimizer = zero_optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    rows = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": [], "collectives": {}}
    for step in range(steps):
        ids, labels = batch(step)
        with counted_collectives(model) if step == 0 else contextlib.nullcontext(Counter()) as counts:
            loss = model.step(*local_batch(model, ids, labels))
        if step == 0:
            rows["collectives"] = dict(counts)
        norm = model.clip_grad_norm_(max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        held = loss.detach().clone()
        dist.all_reduce(held)   # every rank holds its data-parallel replica's loss: the mean over the ranks
        rows["losses"].append(float(held) / ctx.world)
        rows["norms"].append(float(norm))
        want = reference(ids, labels)
        want.backward()
        rows["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)))
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        rows["ref_losses"].append(float(want.detach()))
    worst, worst_name = 0.0, ""
    params = dict(model.named_parameters())
    for name, got in params.items():
        whole = got.full_tensor() if isinstance(got, DTensor) else got
        rel = _relative(whole.detach(), reference.get_parameter(name).detach())
        if rel >= worst:
            worst, worst_name = rel, name
    if folder is not None:
        import torch.distributed.checkpoint as dcp

        dcp.save(model.state_dict(), checkpoint_id=folder)
        torch.save({name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
                    for name, t in model.state_dict().items()}, f"{folder}/rank{ctx.rank}.pt")
        dist.barrier()
    checkpointed = sorted(name[len("module."):] for stage in model.stage_modules for name, sub in stage.named_modules()
                          if isinstance(sub.__dict__.get("forward"), partial))
    return {**rows, "worst_weight": worst, "worst_name": worst_name, "checkpointed": checkpointed, "refusals": refusals,
            "params": sorted(params), "not_dtensor": sorted(n for n, t in params.items() if not isinstance(t, DTensor)),
            "placements": sorted({str(list(t.placements)) for t in params.values() if isinstance(t, DTensor)}),
            "lowering": lowering_of(model).describe(), "optimizer": type(optimizer).__name__,
            # elements of optimizer state this rank holds (its shard under ZeRO-1) against its stage's parameters
            "state_elements": sum(v.numel() if not hasattr(v, "to_local") else v.to_local().numel()
                                  for state in optimizer.state.values() for k, v in state.items() if k == "exp_avg"),
            "param_elements": sum(_local(p).numel() for p in model.parameters())}


def reference_step(reference, optimizer, inputs: tuple, max_norm: float = 0.5) -> tuple[float, float]:
    """One step of the unmodified module in this process on the whole batch: its loss and its clipped norm."""
    want = reference(*inputs)
    want.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=max_norm))
    optimizer.step()
    optimizer.zero_grad()
    return float(want.detach()), norm


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _check_run(results: list) -> None:
    worst = {key: max(abs(g - w) / abs(w) for r in results for g, w in zip(r[key], r[f"ref_{key}"]))
             for key in ("losses", "norms")}
    print(json.dumps({**worst, "weights": max(r["worst_weight"] for r in results)}))   # the figures docs cite
    held = set()
    for result in results:
        assert result["not_dtensor"] == [], result["not_dtensor"]
        for key in ("losses", "norms"):
            for got, want in zip(result[key], result[f"ref_{key}"]):
                assert abs(got - want) <= TOLERANCE * abs(want), (key, result[key], result[f"ref_{key}"])
        assert min(result["ref_norms"]) > 0.5   # the norms were clipped
        assert result["worst_weight"] <= TOLERANCE, (result["worst_name"], result["worst_weight"])
        held |= set(result["params"])
    assert held == {n for n, _ in gpt_module().named_parameters()}   # the stages hold the whole module between them
    assert "wte" in results[0]["params"] and "wte" in results[-1]["params"]   # the tied embedding on both ends


def _check_collectives(run: list, plan, differ: dict | None = None) -> None:
    """Each rank's first-step collectives and sends (`counted_collectives`, ranks in order, tp 2 a stage) are its
    stage's in the plan (`plan_collectives`), but for `differ`: stage -> (counted beyond the plan, planned and
    not counted). The labels the last stage reads hop along whole (integers; the plan's graph gives them every
    device)."""
    planned = plan_collectives(plan)
    for rank, result in enumerate(run):
        stage = rank // 2
        got, want = Counter(result["collectives"]), planned[stage]
        labels = got.pop("send fwd int", 0)
        assert labels % (SIZES["batch"] * SIZES["seq"]) == 0 and (labels or stage), labels   # whole, never a piece
        sends = {key: got[key] for key in ("send fwd", "send bwd")}
        assert sends == {"send fwd": want["send fwd"], "send bwd": want["send bwd"]}, sends
        differs = (dict(got - want), dict(want - got))
        assert differs == (differ or {}).get(stage, ({}, {})), (rank, differs)


def _launch(plans: dict, nproc: int, folder=None, timeout_s: float = 600) -> list:
    from parsat.backend.launch import LaunchConfig, launch

    plans = {label: plan if isinstance(plan, dict) else plan.to_dict() for label, plan in plans.items()}
    return launch(train_job, (plans, 3, None if folder is None else str(folder)),
                  LaunchConfig(nproc=nproc, backend="gloo", timeout_s=timeout_s))


def _checkpoint_loads_into_the_unmodified_module(folder, ranks: int) -> float:
    """The DCP checkpoint the pipeline's ranks wrote, loaded in this process (no process group) into a fresh
    unmodified GPT: the largest relative difference from the weights the ranks held (every weight some rank's)."""
    import torch.distributed.checkpoint as dcp

    fresh = gpt_module()
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=str(folder))
    fresh.load_state_dict(state)
    held = {}
    for r in range(ranks):
        held.update(torch.load(folder / f"rank{r}.pt", weights_only=True))
    assert set(held) == set(fresh.state_dict()), sorted(set(held) ^ set(fresh.state_dict()))
    return max(_relative(value, held[name]) for name, value in fresh.state_dict().items())


def load_job(ctx, plan: dict, folder: str, written_ranks: int) -> dict:
    """On every rank: another GPT (another seed) parallelized with `plan`, its weights loaded from the DCP
    checkpoint in `folder` (`dcp.load(model.state_dict())` in place, then `model.load_state_dict`), and a third
    from the whole module's plain state dict the writing ranks' weights make (`load_state_dict` cutting each to
    this rank's piece); each held weight against the written one (largest relative difference), and one step's
    loss of each against the unmodified module holding the written weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from parsat.backend.torch_native.apply import local_batch

    written = {}
    for r in range(written_ranks):
        written.update(torch.load(f"{folder}/rank{r}.pt", weights_only=True))
    reference = gpt_module(seed=1)
    reference.load_state_dict(written)
    data = math.prod(a["size"] for a in plan["mesh"]["axes"] if a["name"] != "tp")
    example = tuple(x[: x.shape[0] // data] for x in batch(0))
    ids, labels = batch(3)
    out = {"ref_loss": float(reference(ids, labels).detach())}
    for label in ("dcp", "plain"):
        model = parsat.parallelize(gpt_module(seed=1), plan, example, runtime="torch", weight_names=weight_names())
        if label == "dcp":
            state = model.state_dict()
            dcp.load(state, checkpoint_id=folder)
            missing = model.load_state_dict(state)
        else:
            missing = model.load_state_dict(written)
        worst = max(_relative((t.full_tensor() if isinstance(t, DTensor) else t).detach(), written[name])
                    for name, t in model.state_dict().items())
        loss = model.step(*local_batch(model, ids, labels)).detach().clone()
        torch.distributed.all_reduce(loss)   # every rank holds its data-parallel replica's loss: the mean
        out[label] = {"worst_weight": worst, "missing": missing, "loss": float(loss) / ctx.world,
                      "held": len(model.state_dict())}
    return out


def _loads_on(plan, nproc: int, folder, written_ranks: int) -> list:
    from parsat.backend.launch import LaunchConfig, launch

    plan = plan if isinstance(plan, dict) else plan.to_dict()
    return launch(load_job, (plan, str(folder), written_ranks), LaunchConfig(nproc=nproc, backend="gloo",
                                                                             timeout_s=600))


def _check_loaded(results: list) -> None:
    """Every rank's loaded weights are the written ones exactly, and its step's loss the unmodified module's."""
    for result in results:
        for label in ("dcp", "plain"):
            got = result[label]
            assert got["missing"] == [] and got["held"] > 0, got
            assert got["worst_weight"] == 0.0, (label, got)
            assert abs(got["loss"] - result["ref_loss"]) <= TOLERANCE * abs(result["ref_loss"]), (label, got, result)


@pytest.mark.slow
def test_pp2_trained_on_two_ranks_like_the_module_in_one_process(pp2, tmp_path):
    """1F1B (the optimizer's choice), GPipe and interleaved 1F1B (2 chunks a stage) on 2 ranks, and 1F1B
    recomputing blocks (each stage's blocks checkpointed); each plan's DCP checkpoint, written by the 2 stages
    (`model.state_dict()`), loads into the unmodified module here with the weights the stages held; the 1F1B one
    also into a pp 2 x dp 2 ZeRO-3 pipeline on 4 ranks (`load_job`: resharded, the same weights and step)."""
    plans = {"1f1b": pp2, "gpipe": pipelined_plan(2, "gpipe"), "interleaved": pipelined_plan(2, "interleaved"),
             "recompute": dict(pp2.to_dict(), recompute="blocks")}
    results = _launch(plans, 2, tmp_path)
    for label in plans:
        assert _checkpoint_loads_into_the_unmodified_module(tmp_path / label, 2) == 0.0
    # the 1F1B checkpoint of 2 stages loads into 2 stages of 2 ZeRO-3 replicas each, on 4 ranks (resharded)
    _check_loaded(_loads_on(pipelined_plan(4, dp=2), 4, tmp_path / "1f1b", 2))
    for label in plans:
        assert label == "recompute" or plans[label].pipeline.schedule == label
        _check_run([r[label] for r in results])
        first, last = results[0][label], results[1][label]
        assert first["losses"] == last["losses"] and first["norms"] == last["norms"]
        assert "wpe" in first["params"] and "wpe" not in last["params"]
        assert first["placements"] == ["[Replicate()]"]   # a one-rank mesh per stage
    assert "ScheduleInterleaved1F1B" in results[0]["interleaved"]["lowering"]
    assert results[0]["recompute"]["checkpointed"] == ["blocks.0", "blocks.1"]
    assert results[1]["recompute"]["checkpointed"] == ["blocks.2", "blocks.3"]
    assert results[0]["1f1b"]["checkpointed"] == []
    refusals = results[0]["1f1b"]["refusals"]
    assert len(refusals) == 2 and "call model.step(*batch)" in refusals[0] and "micro-batches must divide" in refusals[1], refusals


@pytest.mark.slow
def test_pp2_by_dp2_trained_on_four_ranks_like_the_module_in_one_process(tmp_path):
    """The optimizer's pp 2 x dp 2 plan (its stage plan keeps ZeRO-3 over dp: fully_shard on each stage module),
    the same with ZeRO pinned off (replicate on each stage module) and with ZeRO-1 (replicate, and
    `zero_optimizer` sharding the state over each stage's dp ranks); the DCP checkpoints (sharded DTensors
    on each stage's dp ranks for ZeRO-3) load into the unmodified module here; the ZeRO-3 one also into the
    plain pp 2 pipeline on 2 ranks (`load_job`: the same weights and step)."""
    plans = {"zero3": pipelined_plan(4, dp=2), "replicate": pipelined_plan(4, dp=2, zero=0),
             "zero1": pipelined_plan(4, dp=2, zero=1)}
    results = _launch(plans, 4, tmp_path)
    for label in plans:
        _check_run([r[label] for r in results])
        assert _checkpoint_loads_into_the_unmodified_module(tmp_path / label, 4) == 0.0
    # ZeRO-1 in each stage (Megatron's distributed optimizer beside pipelining): each rank holds half of its
    # stage's AdamW state, where the replicated stages hold all of it
    for result in results:
        zero1, whole = result["zero1"], result["replicate"]
        assert zero1["optimizer"] == "ZeroOneOptimizer" and whole["optimizer"] == "AdamW"
        assert whole["state_elements"] == whole["param_elements"]
        assert zero1["state_elements"] == -(-zero1["param_elements"] // 2), (zero1["state_elements"],
                                                                             zero1["param_elements"])
    # the ZeRO-3 checkpoint of 4 ranks (sharded DTensors) loads into the plain 2-stage pipeline on 2 ranks
    _check_loaded(_loads_on(pipelined_plan(2), 2, tmp_path / "zero3", 4))
    assert "fully_shard over dp" in results[0]["zero3"]["lowering"]
    assert any("Shard(dim=" in p for p in results[0]["zero3"]["placements"])
    assert "replicate over dp" in results[0]["replicate"]["lowering"]
    assert results[0]["replicate"]["placements"] == ["[Replicate()]"]   # on each stage's dp slice


@pytest.mark.slow
def test_pp2_by_tp2_trained_on_four_ranks_like_the_module_in_one_process(pp2):
    """Megatron's tp 2 inside each of the 2 stages (`megatron_stage_plan`), 1F1B over 4 micro-batches, and the
    same interleaved (2 chunks a stage: two tensor-parallel stage modules on each rank): the traced stage modules'
    parameters DTensors on their stage's tp slice (the split ones Shard(d) as the plan stores them), trained 3
    AdamW steps with the pipeline's clipped norm like the unmodified module in one process. The first step's
    collectives, counted on each rank, are exactly its stage's in the plan (`_check_collectives`): each product
    of a split weight and the first stage's lookup computed on local pieces (`sequence_products`, the row sums
    all-reduced at once); until 2026-12-04 DTensor's own products left them `Partial` along the residual stream
    and all-reduced them again in each norm's backward (1F1B: 28 and 36 backward all-reduces a step on the two
    stages where the plan has 16 and 20): this fails then. ~1 min wall."""
    plans = {"1f1b": megatron_stage_plan(pp2), "interleaved": megatron_stage_plan(pipelined_plan(2, "interleaved"))}
    results = _launch(plans, 4)
    for label, plan in plans.items():
        run = [r[label] for r in results]
        _check_run(run)
        _check_collectives(run, plan)
        assert all(r["placements"] == ["[Replicate()]", "[Shard(dim=0)]", "[Shard(dim=1)]"] for r in run), \
            [r["placements"] for r in run]
        assert "tensor parallelism on tp: DTensor parameters" in run[0]["lowering"]
        assert run[0]["losses"] == run[1]["losses"] and run[0]["norms"] == run[3]["norms"]   # tp twins, every rank
        assert run[0]["params"] == run[1]["params"] and "wpe" in run[0]["params"] and "wpe" not in run[2]["params"]
    assert "ScheduleInterleaved1F1B" in results[0]["interleaved"]["lowering"]


@pytest.mark.slow
def test_pp2_by_tp2_sequence_parallel_trained_on_four_ranks_like_the_module_in_one_process(pp2):
    """Sequence parallelism inside each of the 2 stages: Megatron's stage plan with `sequence=True` (1F1B, and
    interleaved: 2 chunks a stage, 3 crossings a micro-batch) and the optimizer's own `--degrees pp=2,tp=2,sp=2`
    plan on the `cpu` machine (1F1B), 4 micro-batches. The values crossing between the stages (split along the
    sequence on tp) travel as each tp rank's `Shard(1)` piece to the same tp rank of the other stage, forward and
    their gradients back, and enter the next stage as `Shard(1)` DTensors, so DTensor runs its norms and residual
    adds on the slice; trained 3 AdamW steps with the pipeline's clipped norm like the unmodified module in one
    process. The first step's collectives, counted on each rank (`counted_collectives`), are exactly its stage's
    in the plan (`plan_collectives`), the loss's apart (below): each product of a split weight and the first
    stage's lookup computed on local pieces (`sequence_products`; until 2026-12-04 DTensor's mm gathered in
    backward 12-13 times a micro-batch where the plan does 4-5, and its lookup reduce-scattered a whole-table
    gradient once a step: this fails then), and each rank sends the plan's pieces (1F1B: 512 elements a step,
    where gathering each crossing before the send sent 1,024 and added an all-gather a micro-batch on each side:
    this fails then);
    the labels the last stage reads hop along whole (integers, `_PassInputsThrough`; the plan's graph gives them
    every device). The optimizer's plan computes the loss vocabulary-parallel (its block maxima gathered, sum-exp
    and loss all-reduced, two all-reduces backward); the traced last stage runs it as torch's loss parallelism
    (`loss_parallel.traced_losses`: each row's max, sum-exp and target logit all-reduced forward, nothing
    backward; the logits never gathered, where DTensor gathered them each micro-batch until 2026-12-04):
    asserted as it is. ~1-2 min wall on this box."""
    plans = {"megatron": megatron_stage_plan(pp2, sequence=True), "pinned": pipelined_plan(4, tp=2, sp=2),
             "interleaved": megatron_stage_plan(pipelined_plan(2, "interleaved"), sequence=True)}
    results = _launch(plans, 4)
    rows, m = SIZES["batch"] // MICROBATCHES * SIZES["seq"], MICROBATCHES   # the loss's rows a micro-batch
    loss_parallel = ({f"schedule fwd all-reduce {rows}": 2 * m},   # torch's: each row's max, sum-exp, target logit
                     {f"schedule fwd all-gather {2 * rows}": m, "schedule fwd all-reduce 1": m,   # the plan's: the
                      f"schedule bwd all-reduce {rows}": 2 * m})   # block maxima gathered, the loss reduced
    for label, plan in plans.items():
        run = [r[label] for r in results]
        _check_run(run)
        assert "tensor parallelism on tp: DTensor parameters" in run[0]["lowering"]
        assert run[0]["losses"] == run[1]["losses"] and run[0]["norms"] == run[3]["norms"]
        assert all(2 * c.piece_elements == SEQUENCE_PIECE for c in plan.pipeline.layout.crossings)   # tp 2's pieces
        _check_collectives(run, plan, {1: loss_parallel} if label == "pinned" else {})
    assert "ScheduleInterleaved1F1B" in results[0]["interleaved"]["lowering"]


@pytest.mark.slow
def test_a_sequence_parallel_stage_gathers_again_in_backward_where_the_plans_machine_is_priced_so(pp2):
    """Megatron's sequence-parallel stage plan (pp 2 x tp 2, 4 gloo ranks) with its machine a GPU preset, which the
    cost model prices as a runtime that re-gathers (`Machine.runtime_regathers`): `parallelize_native` carries the
    plan's machine to the traced stages, whose column-parallel products then keep the input's shard and gather it
    again in backward: the first step's collectives are the plan's as priced on that machine (one more backward
    all-gather per column-parallel product a micro-batch than on `cpu`), and training matches the unmodified
    module as on `cpu`. The loss's gathered logits, which a cross-entropy's backward reads (not a product's), are
    kept whole by the runtime (DTensor's cross-entropy) and priced so (`cost.saved.regathers`): not gathered
    again."""
    from parsat.ir.machine import Machine

    rows, m = SIZES["batch"] // MICROBATCHES * SIZES["seq"], MICROBATCHES   # the rows a micro-batch

    cpu = megatron_stage_plan(pp2, sequence=True)
    plans = {"cpu": cpu, "gpu": replace(cpu, machine=Machine.preset("h100x8").with_precision("fp32"))}
    results = _launch(plans, 4)
    counted = {}
    for label, plan in plans.items():
        run = [r[label] for r in results]
        _check_run(run)
        _check_collectives(run, plan, {})
        counted[label] = [Counter(r["collectives"]) for r in run]
    # each stage's column-parallel products a micro-batch: wqkv and w1 of its 2 blocks, and the tied head's on the last
    for rank, (cpu_run, gpu_run) in enumerate(zip(counted["cpu"], counted["gpu"])):
        products = 4 + (rank // 2 == 1)
        assert gpu_run - cpu_run == Counter({f"schedule bwd all-gather {rows * SIZES['hidden']}": products * m}) \
            and not cpu_run - gpu_run, (gpu_run - cpu_run, cpu_run - gpu_run)


@pytest.mark.slow
def test_pp2_by_dp2_by_tp2_trained_on_eight_ranks_like_the_module_in_one_process(pp2):
    """3-D parallelism on 8 gloo ranks: Megatron's dp 2 x tp 2 inside each of the 2 stages, 1F1B over 4
    micro-batches: each stage module's split weights Shard(d) on its tp slice, the module `replicate`d over its
    dp slice (FSDP2 over a DTensor-parameter module, as the unpipelined dp x tp), trained 3 AdamW steps with the
    pipeline's clipped norm like the unmodified module in one process. 8 processes on 2 cores: many minutes."""
    results = _launch({"3d": megatron_stage_plan(pp2, shape=(2, 2))}, 8, timeout_s=1500)
    run = [r["3d"] for r in results]
    _check_run(run)
    assert "replicate over dp" in run[0]["lowering"] and "tensor parallelism on tp" in run[0]["lowering"]
    for r in run:
        assert r["placements"] == ["[Replicate(), Replicate()]", "[Replicate(), Shard(dim=0)]",
                                   "[Replicate(), Shard(dim=1)]"], r["placements"]
    assert all(r["losses"] == run[0]["losses"] for r in run)   # the ranks' mean, the same on every rank
    assert "wpe" in run[0]["params"] and "wpe" not in run[4]["params"]   # ranks 0-3 stage 0, 4-7 stage 1
