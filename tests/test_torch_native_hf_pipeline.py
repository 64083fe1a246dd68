"""Imported (Hugging Face) modules pipelined on `runtime="torch"` (issue 30, build item 1: "on imported modules
too"): GPT-2 (tied `wte` / `lm_head`), LLaMA and BERT, code unchanged, cut into 2 stages of one device each.

Until 2026-12-05 `parsat.optimize` pipelined only the built-in examples (it now pipelines an imported graph too:
`searched_hf_llama_plan`, below), so most tests lay the pipeline out themselves, as the optimizer would: the
one-device plan of the imported graph, cut before its last block (`ir.pipeline.lay_out_stages`), 1F1B over 2
micro-batches. What it checks is the runtime: `parallelize(module, plan, example_inputs, imported=...,
runtime="torch")` traces the module with `torch.distributed.pipelining`, every parameter a DTensor on its
stage's mesh, and 3 AdamW steps with `model.clip_grad_norm_` equal the unmodified module's in one process
(float64, dropout off); each stage's DCP checkpoint loads into the unmodified module.

A tied parameter is traced under one name a stage (the one that stage's code reads it by: GPT-2's
`transformer.wte.weight` on the first, `lm_head.weight` on the last), which the stage check and the shared
weight's gradient sum accept (`ChunkLowering.groups`, `PipelinedModule.held_parameter`); where the tracer gives
one stage the tied table twice as two tensors (GPT-2's first stage: `wte`, read, and `lm_head`, unread and so
never trained), `pipelined._tie_within` makes them one again (without it rank 0's `lm_head.weight` stayed at
its initial value: 0.28 from the trained table).

BERT's blocks do not follow its modules: the importer's block i begins at the LayerNorm that ends layer i - 1
(`b1_model.bert.embeddings.LayerNorm.weight` is `encoder.layer.0.output.LayerNorm.weight`), so no submodule holds
a block alone; the cut is before that LayerNorm's call (`pipeline_lowering._cut_module`: the submodule holding
the weight the block reads first, when it holds that block's parameters only), inside `encoder.layer.0.output`.
BERT's attention mask (ones expanded over the query positions: a view) crosses that cut, which gloo sends only
contiguous (`pipelined._contiguous_outputs`), and its MLM head's bias is tied to the decoder's under two names,
both in the stage's state dict.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections import Counter
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import parsat  # noqa: E402
from test_torch_native_runtime import _factory, _relative, causal_loss_in_model_dtype  # noqa: E402

TOLERANCE, LR, STEPS = 1e-4, 1e-2, 3


@cache
def hf_pipelined_plan(name: str):
    """The one-device plan of the imported model cut into 2 stages before its last block, 1F1B, 2 micro-batches.
    Made once a process (a frozen plan; every caller derives its own with `replace`): the tests of BERT's cut and
    of its tensor-parallel stages, and the lazy and eager LLaMA stage plans, each imported the same module again
    (`parsat.from_torch`: 2.7-3 CPU s an import)."""
    from parsat.ir.pipeline import PipelinePlan, lay_out_stages, pcg_layers

    module, example = _factory(name)()
    graph = parsat.from_torch(module, example)
    one = parsat.optimize(graph, machine="cpu", devices=1, baselines=False)
    layers = pcg_layers(one.pcg)
    layout = lay_out_stages(one.pcg, [layers[0], layers[-1]], 2)
    return replace(one, pipeline=PipelinePlan("1f1b", 2, 1, layout), devices=2, costs={})


@cache
def imported_weights(name: str) -> dict:
    """The imported names of the factory's module's weights (`import_module(...).weights`), the same for every
    module the factory makes: imported once a process for the tests that read only them (`module_info`), not once
    a test (0.5-0.9 CPU s an import)."""
    from parsat.importer.export import import_module

    module, example = _factory(name)()
    return import_module(module, example, check=False).weights


@cache
def per_microbatch_graph(name: str):
    """The factory's module imported at one micro-batch's size (half its example batch), as the optimizer plans a
    pipelined step: once a process (a frozen graph; `parsat.from_torch` is 2.7-3 CPU s)."""
    module, example = _factory(name)()
    return parsat.from_torch(module, tuple(x[: x.shape[0] // 2] for x in example))


def hf_tensor_parallel_stages_plan(name: str, per_microbatch: bool = False, reduce_at_once: bool = True):
    """Megatron's tp 2 layout of the imported model (`megatron_pcg`) as the stage plan, cut into 2 stages before
    its last layer as `hf_pipelined_plan`, 1F1B, 2 micro-batches, on 4 devices (2 a stage): laid out by hand, as
    `parsat.optimize` does not pipeline an imported graph. Each partial sum reduced where it is made
    (`reduce_at_once`, Megatron-LM's row-parallel layers): LLaMA's bias-free residual stream otherwise crosses the
    cut as a partial sum, which no stage sends. `per_microbatch`: the graph imported at one micro-batch's size (as
    the optimizer plans a pipelined step), so the plan's collectives and crossings count a micro-batch's
    elements, as the runtime runs them."""
    from parsat.backend.executor import operator_library
    from parsat.ir.megatron import megatron_pcg
    from parsat.ir.pipeline import LayerMap, PipelinePlan

    one = hf_pipelined_plan(name)
    graph = one.graph
    if per_microbatch:
        graph = per_microbatch_graph(name).with_microbatches(2)
    stage_plan = megatron_pcg(graph, operator_library(), (1, 2), reduce_at_once=reduce_at_once)
    layers = LayerMap(stage_plan)
    if not reduce_at_once:   # cut where a partial sum crosses, as a plan file of before 2026-12-05 may hold: the search
        layers.blocked = {}  # lays out no such cut now (`LayerMap.blocked`), the lowering still refuses one it is given
    layout = layers.lay_out([layers.layers[0], layers.layers[-1]], 2)
    return replace(one, graph=graph, pcg=stage_plan, pipeline=PipelinePlan("1f1b", 2, 2, layout), devices=4)


def hf_job(ctx, plans: dict, folder: str) -> dict:
    """On every rank, per model: the module pipelined as its plan says, the user's loop (`step`,
    `clip_grad_norm_`, AdamW) on the example batch beside the unmodified module in this process; the stages' DCP
    checkpoint written to folder/<name>, each rank's weights (gathered whole) to folder/<name>/rank<r>.pt."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from parsat.backend.torch_native.apply import local_batch
    from parsat.importer.export import import_module

    from test_torch_native_pipeline import counted_collectives, reference_step

    out = {}
    for name, plan in plans.items():
        module, example = _factory(name)()
        if name == "llama":   # its loss in float64, as the plan's graph computes it (transformers casts the logits to
            module.model.loss_function = causal_loss_in_model_dtype   # float32, which tp's sums order otherwise)
        if name == "bert":   # every position a target: with ignored ones the micro-batches' mean of means is not
            example = (example[0], example[0].clone())   # the whole batch's mean (the lowering's note says so)
        imported = import_module(module, example, check=False)
        reference = copy.deepcopy(module)
        model = parsat.parallelize(module, plan, example, imported=imported, runtime="torch")
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
        rows: dict = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": []}
        for step in range(STEPS):
            with counted_collectives(model) if step == 0 else contextlib.nullcontext(Counter()) as counts:
                loss = model.step(*local_batch(model, *example))
            if step == 0:
                rows["collectives"] = dict(counts)
            rows["norms"].append(float(model.clip_grad_norm_(max_norm=0.5)))
            optimizer.step()
            optimizer.zero_grad()
            rows["losses"].append(float(loss.detach()))
            want, norm = reference_step(reference, ref_optimizer, example)
            rows["ref_losses"].append(want)
            rows["ref_norms"].append(norm)
        params = dict(model.named_parameters())
        whole = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in params.items()}
        rows["worst_weight"], rows["worst_name"] = max((_relative(t, reference.get_parameter(n).detach(), floor=LR), n)
                                                       for n, t in whole.items())
        rows["params"] = sorted(params)
        rows["not_dtensor"] = sorted(n for n, t in params.items() if not isinstance(t, DTensor))
        dcp.save(model.state_dict(), checkpoint_id=f"{folder}/{name}")
        torch.save(whole, f"{folder}/{name}/rank{ctx.rank}.pt")
        dist.barrier()
        out[name] = rows
    return out


def _loads_into_the_unmodified_module(folder: Path, name: str) -> float:
    import torch.distributed.checkpoint as dcp

    fresh, _ = _factory(name)()
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=str(folder / name))
    fresh.load_state_dict(state)
    held = {}
    for rank in range(2):
        held.update(torch.load(folder / name / f"rank{rank}.pt", weights_only=True))
    assert set(held) <= set(fresh.state_dict())
    return max(_relative(fresh.get_parameter(n).detach(), t) for n, t in held.items())


def _trains_like_one_process(run: dict) -> None:
    """One rank's run (`hf_job`): every parameter a DTensor, losses and clipped norms those of the unmodified module
    in one process, the norms clipped, the final weights equal."""
    assert run["not_dtensor"] == [], run["not_dtensor"]
    for key in ("losses", "norms"):
        for got, want in zip(run[key], run["ref_" + key]):
            assert abs(got - want) <= TOLERANCE * abs(want), (key, run[key], run["ref_" + key])
    assert min(run["ref_norms"]) > 0.5 and run["worst_weight"] <= TOLERANCE, run


def test_bert_is_cut_before_the_layer_norm_that_begins_its_second_block():
    """No submodule of BERT holds the importer's block 1 alone (it begins with `encoder.layer.0.output.LayerNorm`):
    the cut is before that LayerNorm, the block's first weight read, so the stages hold the chunks' parameters;
    a layer whose first-read weight's module also holds another layer's parameters is still refused."""
    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.lowering import LoweringError
    from parsat.backend.torch_native.pipeline_lowering import lower_pipeline

    bert = hf_pipelined_plan("bert")
    module, _example = _factory("bert")()
    info = module_info(module, imported_weights("bert"))
    lowering = lower_pipeline(bert.pcg, bert.graph, bert.pipeline, info)
    assert lowering.split_points() == ("model.bert.encoder.layer.0.output.LayerNorm",)
    second = lowering.chunks[1].params
    assert "model.bert.encoder.layer.0.output.LayerNorm.weight" in second
    assert "model.bert.encoder.layer.0.output.dense.weight" in lowering.chunks[0].params
    holds = dict(info.holds)   # the LayerNorm made to hold a parameter of layer 0 too: no cut there
    holds["model.bert.encoder.layer.0.output.LayerNorm"] += ("stray",)
    params = dict(info.params)
    params["model.bert.encoder.layer.0.output.LayerNorm.stray"] = info.params[
        "model.bert.encoder.layer.0.output.dense.bias"]
    with pytest.raises(LoweringError, match=r"cuts before layer 1 .* no submodule of the module holds"):
        lower_pipeline(bert.pcg, bert.graph, bert.pipeline, replace(info, holds=holds, params=params))


@pytest.mark.slow
def test_hugging_face_models_pipelined_on_two_ranks_train_like_one_process(tmp_path):
    """GPT-2 and LLaMA, pp 2 (1F1B, 2 micro-batches) on 2 gloo ranks: losses, clipped norms and final weights
    equal to the unmodified module's (1e-4), every parameter a DTensor, the stages holding the whole module
    between them (GPT-2's tied table on both), the checkpoint loading into the unmodified module. The same for
    BERT, cut inside its first encoder layer (2026-12-03: losses and norms within 2.4e-16, weights 1.0e-12)."""
    from parsat.backend.launch import LaunchConfig, launch

    names = ("gpt2", "llama", "bert")
    plans = {name: hf_pipelined_plan(name).to_dict() for name in names}
    results = launch(hf_job, (plans, str(tmp_path)), LaunchConfig(nproc=2, backend="gloo", timeout_s=900))
    for name in names:
        runs = [r[name] for r in results]
        print(json.dumps({name: {k: runs[0][k] for k in ("losses", "ref_losses", "norms", "ref_norms",
                                                         "worst_weight", "worst_name")}}))
        for run in runs:
            assert run["not_dtensor"] == [], (name, run["not_dtensor"])
            for key in ("losses", "norms"):
                for got, want in zip(run[key], run["ref_" + key]):
                    assert abs(got - want) <= TOLERANCE * abs(want), (name, key, run[key], run["ref_" + key])
            assert min(run["ref_norms"]) > 0.5 and run["worst_weight"] <= TOLERANCE, (name, run)
        module, _ = _factory(name)()
        groups: dict = {}   # every name of each parameter (a tied one has several; the tracer keeps one a stage)
        for n, p in module.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), set()).add(n)
        held = set(runs[0]["params"]) | set(runs[1]["params"])
        assert all(names & held for names in groups.values()), (name, [g for g in groups.values() if not g & held])
        both = set(runs[0]["params"]) & set(runs[1]["params"])   # only a tied table, on its two stages
        assert all(len(g) > 1 for g in groups.values() if g & both), (name, both)
        assert _loads_into_the_unmodified_module(tmp_path, name) == 0.0
    assert "model.lm_head.weight" in results[1]["gpt2"]["params"]   # the tied table, traced as the head reads it


def test_an_imported_models_tensor_parallel_stages_compute_their_nn_linear_products_on_local_pieces():
    """HF BERT with Megatron's tp 2 stage plan, traced and cut as the runtime does (no processes): each `nn.Linear`
    whose weight the plan splits traces as `aten.linear` and is pointed at `tensor_parallel_linear` (the plan's
    collectives only: tests/test_torch_native_sequence_products.py), the vocabulary-split lookup at
    `tensor_parallel_embedding`."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    from parsat.backend.torch_native import sequence_products as products
    from parsat.backend.torch_native.apply import _stored_dims, module_info
    from parsat.backend.torch_native.lowering import SPLIT, LoweringError
    from parsat.backend.torch_native.pipeline_lowering import lower_pipeline
    from parsat.backend.torch_native.pipelined import TRACED_PREFIX, _PassInputsThrough

    module, example = _factory("bert")()
    plan = hf_tensor_parallel_stages_plan("bert")
    lowering = lower_pipeline(plan.pcg, plan.graph, plan.pipeline, module_info(module, imported_weights("bert")))
    cuts = lowering.split_points()
    micro = tuple(x[: x.shape[0] // 2] for x in example)
    pipe = pipeline(_PassInputsThrough(module, cuts), mb_args=micro,
                    split_spec={TRACED_PREFIX + cut: SplitPoint.BEGINNING for cut in cuts})
    dims = _stored_dims(lowering.stage, SPLIT)
    split = products.split_weights(dims, TRACED_PREFIX)
    for index in range(2):
        sub = pipe.get_stage_module(index)
        linears = [n for m in sub.modules() for n in getattr(m, "graph", torch.fx.Graph()).nodes
                   if n.op == "call_function" and n.target is torch.ops.aten.linear.default]
        splits = sum(split(f"{p}.{n.args[1].target}" if p else n.args[1].target) for p, m in sub.named_modules()
                     for n in getattr(m, "graph", torch.fx.Graph()).nodes
                     if n.op == "call_function" and n.target is torch.ops.aten.linear.default)
        made = products.local_products(sub, split, sequence=False)
        targets = Counter(n.target.__name__ for m in sub.modules() for n in getattr(m, "graph", torch.fx.Graph()).nodes
                          if n.op == "call_function" and getattr(n.target, "__module__", "") == products.__name__)
        assert made == sum(targets.values()) and targets["tensor_parallel_linear"] == splits, targets
        assert targets["tensor_parallel_embedding"] == (index == 0), targets   # the word embeddings, first stage
        if index == 1:   # the encoder layer's 6 projections and the MLM head's: every one split on tp
            assert splits == len(linears) > 0, (splits, len(linears))


def test_llamas_megatron_stage_plan_reduces_its_partial_sums_at_once_so_its_stages_send_whole_values():
    """HF LLaMA's bias-free residual stream: Megatron's lazy layout (`megatron_pcg`) keeps it a partial sum from
    norm to norm, so it crosses the cut as `Partial()`, which no traced stage sends: no such cut is laid out
    (`ir.pipeline.LayerMap.blocked`, since 2026-12-05), and the lowering refuses one a plan holds, naming the node. Laid out with `reduce_at_once` (each row-parallel layer's and the lookup's sum all-reduced
    where it is made, as Megatron-LM's layers do) every crossing is whole and the plan lowers: the same
    all-reduces in total, of the same sizes (one per norm lazily, one per row-parallel sum at once), the cut's
    moved to the stage that makes the sum. The built-in gpt (biases: every row sum reduced before its bias)
    is laid out alike either way."""
    from parsat.backend.executor import operator_library
    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.lowering import LoweringError
    from parsat.backend.torch_native.pipeline_lowering import lower_pipeline
    from parsat.ir.megatron import TP_AXIS, megatron_pcg
    from parsat.ir.models import build_example
    from parsat.ir.pipeline import PipelineError, lay_out_stages
    from parsat.ir.placement import FREE, PARTIAL, REPLICA
    from test_torch_native_pipeline import SIZES

    llama, _example = _factory("llama")()
    info = module_info(llama, imported_weights("llama"))
    lazy, eager = hf_tensor_parallel_stages_plan("llama", reduce_at_once=False), hf_tensor_parallel_stages_plan("llama")
    tp = eager.pcg.mesh.index(TP_AXIS)

    def crossing_codes(plan):
        return [plan.pcg.node(c.node).placement.codes[tp] for c in plan.pipeline.layout.crossings]

    def reduces(plan):   # per stage: the sizes of the all-reduces on tp its chunks run
        stage_of = {n: c.stage for c in plan.pipeline.layout.chunks for n in c.nodes}
        return [sorted(n.shape for n in plan.pcg.nodes if n.op == "reduce" and stage_of.get(n.id) == s)
                for s in range(2)]

    assert PARTIAL in crossing_codes(lazy)
    with pytest.raises(PipelineError, match=r"would receive node #\d+ add \[b0_add_8\], a partial sum"):
        lay_out_stages(lazy.pcg, [lazy.pipeline.layout.chunks[c].layers[0] for c in range(2)], 2)   # the search's
    with pytest.raises(LoweringError, match=r"crosses from chunk 0 to chunk 1 as Partial\(\)"):
        lower_pipeline(lazy.pcg, lazy.graph, lazy.pipeline, info)
    assert set(crossing_codes(eager)) <= {FREE, REPLICA}
    lowering = lower_pipeline(eager.pcg, eager.graph, eager.pipeline, info)
    assert not lowering.sequence_crossings and lowering.stage.tensor_axis is not None
    (lazy0, lazy1), (eager0, eager1) = reduces(lazy), reduces(eager)
    assert sorted(lazy0 + lazy1) == sorted(eager0 + eager1)   # the same all-reduces, of the same sizes
    assert len(eager0) == len(lazy0) + 1 and len(eager1) == len(lazy1) - 1   # the cut's, on the stage before it
    library = operator_library()
    gpt = build_example("gpt", SIZES, library)
    for sequence in (False, True):
        assert megatron_pcg(gpt, library, (1, 2), sequence=sequence).nodes == \
            megatron_pcg(gpt, library, (1, 2), sequence=sequence, reduce_at_once=True).nodes


@pytest.mark.slow
def test_bert_with_tensor_parallel_stages_on_four_ranks_trains_like_one_process(tmp_path):
    """HF BERT pp 2 x tp 2 (`hf_tensor_parallel_stages_plan`: Megatron's tp 2 stage plan), 1F1B, on 4 gloo ranks,
    its split `nn.Linear` products on local pieces (`sequence_products.tensor_parallel_linear`): losses, clipped
    norms and final weights those of the unmodified module in one process, every parameter a DTensor, the
    checkpoint loading into the unmodified module. ~30 s wall."""
    _trains_on_four_ranks_like_one_process(tmp_path, "bert", hf_tensor_parallel_stages_plan("bert"))


@pytest.mark.slow
def test_llama_with_tensor_parallel_stages_on_four_ranks_trains_like_one_process_with_the_plans_collectives(tmp_path):
    """HF LLaMA pp 2 x tp 2 (1F1B, 2 micro-batches, 4 gloo ranks): Megatron's tp 2 stage plan with its partial sums
    reduced where they are made (`reduce_at_once`: the residual stream crosses the cut whole, as Megatron-LM sends
    it), planned at one micro-batch's size so its counts are the runtime's. Trained 3 AdamW steps with the
    pipeline's clipped norm like the unmodified module in one process (float64, its loss too), every parameter a
    DTensor, the checkpoint loading into the unmodified module; each rank's first-step collectives (functional
    collectives inside the schedule and after it, sends to the other stage) are its stage's in the plan, every one
    of them, and beyond them only what torch's tracer adds: the rotary tables (cos, sin: [1, seq, head_dim] each),
    which the plan computes on each stage from the positions, cross the cut, forward and their gradients back, and
    the last stage all-reduces their gradients (partial sums over its heads) as it receives them. The labels hop
    along whole (integers). Until 2026-12-05 the lowering refused the plan (`Partial()` crossing), export's dtype
    assertion stopped DTensor, and the RMSNorm's partial gradients left weights 2e-4 apart: this fails then."""
    plan = hf_tensor_parallel_stages_plan("llama", per_microbatch=True)
    module, example = _factory("llama")()
    config, m = module.model.config, plan.pipeline.microbatches
    rotary = example[0].shape[1] * (config.hidden_size // config.num_attention_heads)   # one table, a micro-batch
    runs = _trains_on_four_ranks_like_one_process(tmp_path, "llama", plan)
    planned = _only_the_plans_collectives(runs, plan, example[0], beyond=(   # per stage: what torch's tracer adds
        {"send fwd": 2 * m * rotary}, {"send bwd": 2 * m * rotary, f"schedule bwd all-reduce {rotary}": 2 * m}))
    assert all(want["schedule fwd all-reduce 16384"] and want["schedule bwd all-reduce 16384"] for want in planned)


@pytest.mark.slow
def test_gpt2_with_tensor_parallel_stages_on_four_ranks_trains_like_one_process_with_the_plans_collectives(tmp_path):
    """HF GPT-2 pp 2 x tp 2 (Megatron's tp 2 stage plan, `reduce_at_once`; 1F1B, 2 micro-batches, 4 gloo ranks),
    code unchanged (float64, its loss too), planned at one micro-batch's size: its `Conv1D` projections trace as
    `aten.addmm` and run on the local pieces (`sequence_products.tensor_parallel_addmm`); trained 3 AdamW steps with
    the pipeline's clipped norm like the unmodified module in one process, every parameter a DTensor, the
    checkpoint loading into the unmodified module; each rank's first-step collectives are its stage's in the plan,
    every one, forward and backward, and nothing beyond them but the integer ids and labels sent along. The plan
    gathers the fused `c_attn`'s column-split output before its q / k / v split (49,152 elements), computes the
    attention whole, runs the attention's `c_proj` column-parallel, adds the residual on the pieces and gathers
    the sum once for both its readers (the norm and the next residual add): `sequence_products.tensor_parallel_add`
    does that gather where DTensor converted the split sum for each reader on its own. Until 2026-12-05 each stage
    ran 2-3 forward and 5 backward all-gathers a micro-batch beyond the plan's and 1-2 fewer backward
    all-reduces: this fails then."""
    plan = hf_tensor_parallel_stages_plan("gpt2", per_microbatch=True)
    _, example = _factory("gpt2")()
    runs = _trains_on_four_ranks_like_one_process(tmp_path, "gpt2", plan)
    planned = _only_the_plans_collectives(runs, plan, example[0])
    assert all(want["schedule fwd all-gather 49152"] and want["schedule bwd all-gather 16384"] for want in planned)


def _trains_on_four_ranks_like_one_process(tmp_path, name: str, plan, job=None) -> list[dict]:
    """`plan` (pp 2 x tp 2 of the HF model `name`) trained by `job` (`hf_job` by default) on 4 gloo ranks like the
    unmodified module in one process (`_trains_like_one_process`), the tp twins holding the same parameters, the
    checkpoint loading into the unmodified module; the ranks' runs."""
    from parsat.backend.launch import LaunchConfig, launch

    results = launch(job or hf_job, ({name: plan.to_dict()}, str(tmp_path)),
                     LaunchConfig(nproc=4, backend="gloo", timeout_s=900))
    runs = [r[name] for r in results]
    print(json.dumps({k: runs[0][k] for k in ("losses", "ref_losses", "norms", "ref_norms", "worst_weight")}))
    for run in runs:
        _trains_like_one_process(run)
    assert runs[0]["params"] == runs[1]["params"] and runs[2]["params"] == runs[3]["params"]   # tp twins
    assert _loads_into_the_unmodified_module(tmp_path, name) == 0.0
    return runs


def _only_the_plans_collectives(runs: list[dict], plan, ids, beyond=({}, {})) -> list:
    """Each rank's first-step collectives are its stage's in the plan, every one, plus `beyond[stage]` (what
    torch's tracer adds), and the integer ids / labels sent whole from stage 0 only; the plan's, per stage."""
    from test_torch_native_pipeline import plan_collectives

    planned = plan_collectives(plan)
    for rank, run in enumerate(runs):
        got, want = Counter(run["collectives"]), planned[rank // 2]
        labels = got.pop("send fwd int", 0)
        assert labels % ids.numel() == 0 and bool(labels) == (rank < 2), labels   # whole, stage 0 only
        assert (dict(got - want), dict(want - got)) == (beyond[rank // 2], {}), (rank, got, want)
    return planned


def searched_hf_llama_plan(sequence: bool | None = True):
    """HF LLaMA pipelined by the search itself (`parsat.optimize` on the imported graph, `--degrees
    pp=2,tp=2,sp=2`, or `sp=1` without `sequence`, sp left to the search where `sequence` is None, 1F1B over 2
    micro-batches, the `cpu` machine): the graph imported
    at one micro-batch's size, as the search takes an imported graph's step (`search.request.step_context`). Until
    2026-12-05 the search refused to pipeline an imported graph (`_check_pipeline_pin`: "only a built-in
    example")."""
    return parsat.optimize(per_microbatch_graph("llama"), machine="cpu", devices=4, microbatches=2, schedule="1f1b",
                           degrees={"pp": 2, "tp": 2, **({} if sequence is None else {"sp": 2 if sequence else 1})})


def test_the_search_pipelines_an_imported_llama_into_stages_its_module_is_cut_into():
    """`parsat.optimize` pipelines an imported graph whose weights the importer names into blocks
    (`search.request.graph_blocks`): HF LLaMA's 2 layers, pinned pp 2 x tp 2 x sp 2, give 2 stages of 2 ranks, cut
    before a decoder layer, every crossing a piece of the sequence (no partial sum: `ir.pipeline.LayerMap.cuttable`),
    which the torch-native lowering takes (the cut at `model.model.layers.1`, each tp rank sending its `Shard(1)`
    piece). A graph without blocks pinned to a pipeline is refused, saying why."""
    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.pipeline_lowering import lower_pipeline
    from parsat.ir.errors import OptimizeError
    from parsat.ir.models import mlp

    plan = searched_hf_llama_plan()
    assert plan.pipeline is not None and plan.pipeline.layout.degree == 2 and plan.pipeline.stage_devices == 2
    assert plan.graph.microbatches == 2
    for crossing in plan.pipeline.layout.crossings:
        assert plan.pcg.node(crossing.node).degrees.sum == 1
    module, _example = _factory("llama")()
    lowering = lower_pipeline(plan.pcg, plan.graph, plan.pipeline, module_info(module, imported_weights("llama")))
    assert lowering.split_points() == ("model.model.layers.1",) and lowering.sequence_crossings
    with pytest.raises(OptimizeError, match="only a graph of several blocks"):
        parsat.optimize(mlp(batch=8, d_in=4, d_hidden=8, d_out=2), machine="cpu", devices=2, degrees={"pp": 2})


def hf_job_with_float64_norms(ctx, plans: dict, folder: str) -> dict:
    """`hf_job` with HF LLaMA's RMSNorm computing in the model's dtype (transformers casts its input to float32 and
    back; the plan's graph, whose import drops dtype casts, does not)."""
    from transformers.models.llama import modeling_llama

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    original = modeling_llama.LlamaRMSNorm.forward
    modeling_llama.LlamaRMSNorm.forward = forward
    try:
        return hf_job(ctx, plans, folder)
    finally:
        modeling_llama.LlamaRMSNorm.forward = original


@pytest.mark.slow
@pytest.mark.parametrize("sequence", [False, True], ids=["tp", "tp+sp"])
def test_the_searched_pipelined_imported_llama_trains_on_four_ranks_like_one_process(tmp_path, sequence):
    """The search's own pp 2 x tp 2 plans of HF LLaMA (`searched_hf_llama_plan`) on 4 gloo ranks (float64, its loss
    too): sequence parallelism pinned off (the joint stage plan, its crossing whole; code unchanged) and on (sp 2:
    the stage grid's point laid out `reduce_at_once`, its crossing each tp rank's piece of the sequence). 3 AdamW
    steps with the pipeline's clipped norm equal the unmodified module's in one process (1e-4; 2026-12-05: tp
    losses 3.4e-16, weights 1.0e-12; tp+sp 4.8e-16, 4.3e-12), every parameter a DTensor, the tp twins holding the
    same parameters, the checkpoint loading into the unmodified module. With sp 2 the RMSNorm computes in float64
    (`hf_job_with_float64_norms`): with transformers' float32 section the losses agree within 2.3e-8 but the
    weights only within 3.6e-4 (the first forward's loss already 2.5e-10 apart), where every plan without sequence
    parallelism agrees within 4e-16: the ranks' float32 norms on their sequence pieces round otherwise than the
    one process's on the whole, which AdamW's first steps amplify."""
    _trains_on_four_ranks_like_one_process(tmp_path, "llama", searched_hf_llama_plan(sequence=sequence),
                                           hf_job_with_float64_norms if sequence else hf_job)


def test_the_searched_llamas_final_norm_beside_its_split_head_is_a_whole_weight_and_it_sends_batch_pieces():
    """HF LLaMA pp 2 x tp 2 with sp left to the search (`searched_hf_llama_plan(sequence=None)`): the stage plan
    runs Megatron's sequence-parallel layout along the batch (reduce-scatters and all-gathers along dim 0 around the
    split projections), so it all-reduces the final norm's weight gradient on tp beside the column-parallel
    `lm_head` (a data-axis `replicate` on the tensor axis) and its residual stream crosses the cut as `Shard(0)`
    pieces. Until 2026-12-05 the lowering refused both ("one role per axis"; "another split ... is not lowered"):
    torch keeps such a weight a `Replicate()` DTensor whose gradient every rank computes whole (role `whole`, a note
    saying the all-reduce moves to the activation's gradient), and the traced stages send batch pieces as they
    send sequence pieces (`piece_dim` 0). A crossing split along the hidden dim is still refused, by name."""
    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.lowering import TENSOR, WHOLE, LoweringError, lower
    from parsat.backend.torch_native.pipeline_lowering import lower_pipeline
    from parsat.ir.placement import Placement, shard

    plan = searched_hf_llama_plan(sequence=None)
    module, _example = _factory("llama")()
    info = module_info(module, imported_weights("llama"))
    stage = lower(plan.pcg, replace(plan.graph, microbatches=1), info, traced=True)
    tp = plan.pcg.mesh.names.index("tp")
    assert stage.axis_roles[tp] == TENSOR
    roles = {w.name: w.roles[tp] for w in stage.weights}
    assert roles["model.model.norm.weight"] == WHOLE and roles["model.lm_head.weight"] == "split", roles
    assert any("model.model.norm.weight" in note and "Replicate()" in note for note in stage.notes)
    lowering = lower_pipeline(plan.pcg, plan.graph, plan.pipeline, info)
    assert lowering.sequence_crossings and lowering.piece_dim == 0
    assert lowering.split_points() == ("model.model.layers.1",)
    crossing = plan.pipeline.layout.crossings[0].node
    hidden = [replace(n, placement=Placement(tuple(shard(2) if a == tp else c
                                                   for a, c in enumerate(n.placement.codes))))
              if n.id == crossing else n for n in plan.pcg.nodes]
    with pytest.raises(LoweringError, match="crosses from chunk 0 to chunk 1 as Shard\\(2\\)"):
        lower_pipeline(replace(plan.pcg, nodes=tuple(hidden)), plan.graph, plan.pipeline, info)


@pytest.mark.slow
def test_the_searched_llama_plan_with_batch_pieces_trains_on_four_ranks_like_one_process(tmp_path):
    """The plan above (pp 2 x tp 2, sp left to the search: its final norm `whole` on tp beside the split head, its
    residual stream in batch pieces across the cut) on 4 gloo ranks: 3 AdamW steps equal the unmodified module's in
    one process (1e-4; 2026-12-05: losses 4e-16, weights 3.5e-12), every parameter a DTensor, the tp twins holding
    the same parameters, the checkpoint loading into the unmodified module. The RMSNorm computes in float64
    (`hf_job_with_float64_norms`), as with sequence pieces: with transformers' float32 section the ranks' norms on
    their batch pieces round otherwise than the one process's on the whole (losses 2.5e-10 apart, weights 3.6e-4
    after 3 steps, measured)."""
    _trains_on_four_ranks_like_one_process(tmp_path, "llama", searched_hf_llama_plan(sequence=None),
                                           hf_job_with_float64_norms)


def searched_hf_llama_dp_tp_plan(rules=None, imported=None, baselines: bool = True):
    """HF LLaMA as `parsat.optimize` lays it out on 4 `cpu` devices pinned dp 2 x tp 2 (the whole batch, no
    pipeline): ZeRO-3 on dp, Megatron's projections on tp, and `embed_tokens` stored split on tp (`Shard(0)`,
    replicated on dp) and read by a vocabulary-parallel lookup. `rules`: `parsat.optimize`'s (None: the shipped
    ones). `imported`: the module's import to plan (`_llama_import`; None: imported here, self-checked);
    `baselines`: `parsat.optimize`'s."""
    if imported is None:
        module, example = _factory("llama")()
        graph = parsat.from_torch(module, example)
    else:
        graph = imported.graph
    return parsat.optimize(graph, machine="cpu", rules=rules, devices=4, degrees={"dp": 2, "tp": 2},
                           baselines=baselines)


def _llama_import():
    """The import of `_factory("llama")`'s module at its example batch, unchecked (as `_table_lowering` read it):
    the same graph as `parsat.from_torch`'s, whose self-check of this module at this batch this file's fast tests
    still run (`hf_pipelined_plan("llama")`, and at half of it `per_microbatch_graph("llama")`)."""
    from parsat.importer.export import import_module

    module, example = _factory("llama")()
    return import_module(module, example, check=False)


def _table_lowering(plan, imported=None):
    """The lowering of `plan` (an HF LLaMA plan) on the module, its rewrite checked, and the mesh index of tp.
    `imported`: the module's import (`_llama_import`; None: imported here)."""
    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.lowering import TENSOR, lower
    from parsat.backend.torch_native.rewritten import lowered_rewrite

    module, _example = _factory("llama")()
    imported = imported or _llama_import()
    lowering = lower(plan.pcg, plan.graph, module_info(module, imported.weights))
    lowered_rewrite(plan.pcg, plan.graph, lowering, imported)
    tp = plan.pcg.mesh.names.index("tp")
    assert lowering.axis_roles[tp] == TENSOR
    return lowering, tp


def _stored_on(plan, name: str, axis: int) -> int:
    """The placement code on mesh axis `axis` of weight `name` as `plan` stores it."""
    from parsat.ir.pcg import weight_storage

    leaf = next(n for n in plan.pcg.nodes if n.kind == "leaf" and n.op == name)
    return plan.pcg.node(weight_storage(plan.pcg)[leaf.id][-1]).placement.codes[axis]


TABLE = "model.model.embed_tokens.weight"


def test_the_searched_dp_tp_llama_stores_its_table_split_where_every_read_of_it_is_split():
    """Every read of `embed_tokens` is a vocabulary-parallel lookup (`partition(dim 0)` on tp, its output a partial
    sum), and the plan stores the table split there (`Shard(0)` on tp, 1/tp of the table, its gradient and Adam
    state, no gradient gathered back). Until 2026-12-05 it stored it whole on tp (ZeRO-3 on dp), sliced where
    read: no rule reached the split storage, since the lookup's data parallelism was made only by pushing a
    partition of its result down (`partition_batch_of_embedding`: the table replicated on dp first, then split
    on tp), and the vocabulary-parallel lookup's partial sums are never partitioned.
    `introduce_embedding_batch_parallel` makes the other order, as the linear layers' introduce rules do: the
    plan's step 3.767 -> 3.688 ms, per-node bound 4.66 -> 4.47 MB. The lowering then restores nothing: the table
    is `Shard(0)` on tp as the plan stores it, the lookup `RowwiseParallel()` (Megatron's VocabParallelEmbedding).

    The search runs without baselines, on one import shared with the lowering: the plan is the joint plan, which
    wins with them (2026-12-07: the same PCG either way, `extraction.chosen` "joint"), and no assertion here reads
    a baseline (they were 2.7 of the search's 7.4 CPU s); a second import of the same module was 1-2 CPU s."""
    from parsat.backend.torch_native.lowering import SPLIT, VOCAB
    from parsat.ir.placement import shard

    imported = _llama_import()
    plan = searched_hf_llama_dp_tp_plan(imported=imported, baselines=False)
    lowering, tp = _table_lowering(plan, imported)
    assert _stored_on(plan, TABLE, tp) == shard(0)   # the plan: split, as it is read
    assert "introduce_embedding_batch_parallel" in str(plan.to_dict()["saturation"]["rule_matches"])
    table = lowering.weight(TABLE)
    assert table.roles[tp] == SPLIT and table.restored == () and table.stored.codes[tp] == shard(0)
    style = next(s for s in lowering.styles if s.module == "model.model.embed_tokens")
    assert style.kind == VOCAB and ": RowwiseParallel() (" in style.describe(), style.describe()
    assert all(w.restored == () for w in lowering.weights)


@pytest.mark.slow
def test_a_table_stored_whole_but_read_only_split_is_stored_split_as_a_vocabulary_parallel_embedding(tmp_path):
    """The plan the search gave before `introduce_embedding_batch_parallel` (searched here without it) stores
    `embed_tokens` whole on tp (so it prices the whole table, its gradient and Adam state on each tp rank, and
    all-gathers the slice's gradient in the backward) and reads it only as `Shard(0)`, by a vocabulary-parallel
    lookup whose output is a partial sum. No torch style keeps a parameter whole and reads a slice of it, so
    until 2026-12-05 the lowering refused it ("stored whole on mesh axis tp but node #26 embedding reads it as
    Shard(0)"). Torch stores it `Shard(0)` (`WeightLowering.restored`, as a tied table already was), the
    embedding `RowwiseParallel()` (Megatron's VocabParallelEmbedding, torchtitan's embedding style): the same
    values and forward all-reduce, a note saying torch holds half the table's state and gathers no gradient."""
    from parsat.backend.torch_native.lowering import SPLIT, VOCAB
    from parsat.dsl.library import shipped_rules_dir
    from parsat.ir.placement import FREE, shard

    for path in sorted(shipped_rules_dir().glob("*.rule")):   # the shipped rules less the one that splits it
        text = path.read_text()
        if "rule introduce_embedding_batch_parallel:" in text:
            head, tail = text.split("rule introduce_embedding_batch_parallel:")
            text = head + tail.split("\n\n", 1)[1]
        (tmp_path / path.name).write_text(text)
    plan = searched_hf_llama_dp_tp_plan(sorted(tmp_path.glob("*.rule")))
    lowering, tp = _table_lowering(plan)
    assert _stored_on(plan, TABLE, tp) == FREE   # the plan: whole
    table = lowering.weight(TABLE)
    assert table.roles[tp] == SPLIT and table.restored == (tp,) and table.stored.codes[tp] == shard(0)
    style = next(s for s in lowering.styles if s.module == "model.model.embed_tokens")
    assert style.kind == VOCAB and ": RowwiseParallel() (" in style.describe(), style.describe()
    note = next(n for n in lowering.notes if TABLE in n)
    assert "read only split along the vocabulary" in note and "gathers no gradient" in note, note
    assert all(w.restored == () for w in lowering.weights if w.name != TABLE)   # the projections: stored split already


@pytest.mark.slow
def test_the_searched_dp_tp_llama_plan_trains_on_four_ranks_like_one_process(tmp_path):
    """The dp 2 x tp 2 plan above (ZeRO-3 on dp, its table stored `Shard(0)` on tp and replicated on dp) on 4 gloo
    ranks, trained by the runtime tests' loop for unpipelined plans (`train_job` through `_train_hf`: the user's loop
    on each rank's local batch, `clip_grad_norm_`, AdamW; `_check_run`, the unpipelined twin of
    `_trains_like_one_process`), the module's own forward under the styles (`own_forward`: the lowering this test is about): 3 steps equal the unmodified
    module's in one process (1e-4; 2026-12-05: losses 8.5e-8, transformers' loss being float32 on both sides, norms
    2e-16, weights 6.1e-13), every parameter a DTensor on one mesh, the checkpoint loading into the unmodified module;
    the table `Shard(0)` on tp (before 2026-12-05 the plan stored it whole there, ZeRO-3 on dp, and the lowering
    stored it split: `_StridedShard` on dp under fully_shard)."""
    from test_torch_native_runtime import _train_hf

    results = _train_hf("llama", {"searched_dp2_tp2": searched_hf_llama_dp_tp_plan().to_dict()}, 4, tmp_path,
                        own_forward=True)
    for result in results:
        placements = result["searched_dp2_tp2"]["placements"]["model.model.embed_tokens.weight"]
        assert placements[-1] == "Shard(dim=0)", placements
