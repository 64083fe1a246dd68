"""A plan whose graph an algebraic rule rewrote, lowered with `runtime="torch"`: the module computes the plan's graph.

HF BERT (small config, float64, dropout off, every position a target), imported and optimized by
`parsat.optimize` for 2 `cpu` devices with `--degrees dp=2`: the plan stores its weights ZeRO-3 style and
computes attention as `bmm(scale(q), k)` where the module computes `scale(bmm(q, k))` (`scale_into_bmm_left`,
46 nodes computing otherwise than the module's graph, every later one). `parallelize(..., runtime="torch")`
replaces the module's forward by one evaluating the plan's graph on the module's parameters and the rank's local
batch (`torch_native/rewritten.py`), `fully_shard` on the root.

What fails if the module's own forward ran: a `TorchFunctionMode` trace of one forward counts the matmuls whose
left operand is a product by a Python float (the plan's scaled queries: 2, one a layer) and the module's
attention kernel (`scaled_dot_product_attention`: the module calls it once a layer, the plan never).
"""

from __future__ import annotations

import contextlib
import json
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

import parsat  # noqa: E402
from test_torch_native_runtime import (IMPORTED, LR, PADDED, VOCABULARY_LOOKUP_SIZES, _batch,  # noqa: E402
                                       _check_run, _dcp_loads_into_the_unmodified_module, _factory, _plan,
                                       _relative, _train_hf, check_vocabulary_lookup, train_job,
                                       vocabulary_lookup_plan)

BATCH, SEQ, VOCAB = 8, 32, 256


class Trace(TorchFunctionMode):
    """Counts, in the forwards it surrounds, the attention kernel's calls (`sdpa`), the matmuls whose left
    operand is a tensor times (or over) a Python float (`scaled_left`: queries scaled before the score product)
    and the projections without a bias (`linear_nobias`: Megatron's row-parallel bias added after the sum)."""

    def __init__(self):
        super().__init__()
        self.scaled: list[torch.Tensor] = []   # held, so that no other tensor takes a scaled one's identity
        self.counts = {"sdpa": 0, "scaled_left": 0, "linear_nobias": 0}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if func is nn.functional.scaled_dot_product_attention:
            self.counts["sdpa"] += 1
        elif func is nn.functional.linear and (args[2] if len(args) > 2 else (kwargs or {}).get("bias")) is None:
            self.counts["linear_nobias"] += 1
        elif name in ("__mul__", "mul", "__truediv__", "div") and len(args) == 2 and isinstance(args[1], float):
            self.scaled.append(out)
        elif name in ("matmul", "__matmul__", "bmm") and any(args[0] is t for t in self.scaled):
            self.counts["scaled_left"] += 1
        return out


@pytest.fixture(scope="module")
def bert():
    """(module, example, import, the optimizer's dp=2 plan dict) of HF BERT, float64, dropout off, its last key
    padding: a constant attention mask that keeps the attention written out (bmm, scale, `softmax_masked`), which
    these tests rewrite and slice (without padding BERT's attention imports as the fused `attention`)."""
    from parsat.importer.export import import_module

    module, example = _factory("bert" + PADDED)()
    imported = import_module(module, example, check=False)
    plan = parsat.optimize(imported.graph, machine="cpu", devices=2, degrees={"dp": 2}, baselines=False)
    return module, example, imported, plan.to_dict()


def _rewrite(module, imported, plan: dict):
    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.lowering import lower
    from parsat.backend.torch_native.rewritten import lowered_rewrite
    from parsat.ir.plan import pcg_from_dict

    pcg = pcg_from_dict(plan)
    return lowered_rewrite(pcg, imported.graph, lower(pcg, imported.graph, module_info(module, imported.weights)),
                           imported)


def test_a_rewritten_plan_computes_its_own_graph_on_each_local_batch(bert):
    """Without processes: the optimizer's plan computes otherwise than the module (among its rewrites, the queries scaled by
    `scale_into_bmm_left`), so the lowering says the forward is the plan's graph; the batch-carrying leaves are
    encoded at the local batch, the batch-wide constants (token types, attention mask) sliced. Each rank's
    forward (coordinate 0 and 1, the module's own parameters) gives the module's loss of that local batch
    (float64, 1e-12) and runs the plan's operators: 2 matmuls of scaled queries, no attention kernel, where the
    module's forward runs the kernel twice and scales no matmul operand. Megatron's dp plan computes the graph
    itself (no rewrite: nothing changes); its tp plan (a row-parallel bias added after the all-reduce, 44 nodes
    computing otherwise) lowers to a rewritten forward too, without styles: the parameters stored as the plan
    stores them (the tied word table whole, where the styles store it vocabulary-split)."""
    from parsat.backend.torch_native.lowering import rewritten_nodes
    from torch.distributed.tensor import Replicate, Shard

    from parsat.backend.torch_native.rewritten import SLICE, RewrittenForward, dtensor_placement
    from parsat.ir.plan import pcg_from_dict

    module, _, imported, plan = bert
    rewritten = rewritten_nodes(pcg_from_dict(plan), imported.graph)
    assert any(n.op == "scale" and n.rules[0].startswith("scale_into_bmm_left") for n in rewritten), rewritten
    lowering, rewrite = _rewrite(module, imported, plan)
    assert rewrite is not None and "forward: the plan's graph" in lowering.describe()
    assert not any("computes otherwise" in n for n in lowering.notes)
    assert dict(rewrite.local_shapes) == {"x_onehot": (4, SEQ, VOCAB), "view_7_onehot": (4 * SEQ, VOCAB)}
    sliced = {plan_node_leaf(plan, s.inputs[0]) for s in rewrite.steps if s.action == SLICE}
    assert sliced == {"expand_1_onehot", "expand_2_mask"}, sliced
    ids, labels = _batch(0, BATCH, SEQ, VOCAB)
    for rank in (0, 1):
        mine = ids[4 * rank:4 * rank + 4], labels[4 * rank:4 * rank + 4]
        plan_trace, module_trace = Trace(), Trace()
        with plan_trace:
            got = RewrittenForward(module, rewrite, imported, rank, (rank,))(*mine).detach()
        with module_trace:
            want = module(*mine).detach()
        assert abs(float(got) - float(want)) <= 1e-12 * abs(float(want)), (rank, float(got), float(want))
        assert plan_trace.counts == {"sdpa": 0, "scaled_left": 2, "linear_nobias": 0}, plan_trace.counts
        assert module_trace.counts == {"sdpa": 2, "scaled_left": 0, "linear_nobias": 0}, module_trace.counts
    graph = imported.graph
    assert _rewrite(module, imported, _plan(graph, (2, 1)))[1] is None
    tp, rewrite = _rewrite(module, imported, _plan(graph, (1, 2)))
    assert rewrite is not None and rewrite.tensor_axis == 0 and tp.styles == ()
    assert "linear_nobias_t" in tp.rewritten and "placed as the plan stores its weight" in tp.describe()
    stored = dict(rewrite.stored)   # the plan's own placements: the tied table whole, not torch's Shard(0)
    assert dtensor_placement(stored["model.bert.embeddings.word_embeddings.weight"]) == Replicate()
    assert dtensor_placement(stored["model.bert.encoder.layer.0.attention.self.query.weight"]) == Shard(0)
    assert not any("torch stores it" in n for n in tp.notes)


def test_a_rewritten_plan_recomputing_blocks_checkpoints_each_block_region(bert):
    """The optimizer's plan of BERT with `recompute="blocks"`: the importer's blocks are not BERT's layer modules
    (block 0 begins at the embeddings' LayerNorm), so the module's own form could not checkpoint them, but the
    rewritten forward checkpoints the plan's own regions (`recompute_regions.forward_units`, one a block, as the
    interpreter runs them): the same loss and gradients as without recomputation (float64, 1e-12) while autograd
    saves fewer than 60 % of the tensors (95 -> 52 measured). Without the import the plan is refused, naming
    the layer no module holds."""
    import copy
    from dataclasses import replace

    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.lowering import LoweringError, lower
    from parsat.backend.torch_native.rewritten import RewrittenForward, lowered_rewrite
    from parsat.ir.plan import pcg_from_dict

    module, _, imported, plan = bert
    pcg = replace(pcg_from_dict(plan), recompute="blocks")
    lowering = lower(pcg, imported.graph, module_info(module, imported.weights))
    assert lowering.recompute == () and "no submodule of the module holds" in lowering.unrecomputable
    with pytest.raises(LoweringError, match="no submodule of the module holds"):
        lowered_rewrite(pcg, imported.graph, lowering, None)
    lowering, rewrite = lowered_rewrite(pcg, imported.graph, lowering, imported)
    assert len(rewrite.recomputed) == 2 and "2 blocks recomputed" in lowering.describe()
    ids, labels = _batch(0, BATCH, SEQ, VOCAB)
    runs = {}
    for label, rewritten in (("plain", _rewrite(module, imported, plan)[1]), ("recomputed", rewrite)):
        copied, saved = copy.deepcopy(module), []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
            loss = RewrittenForward(copied, rewritten, imported, 0, (0,))(ids[:4], labels[:4])
        loss.backward()
        runs[label] = (float(loss.detach()), len(saved), {k: p.grad for k, p in copied.named_parameters()})
    (plain, plain_saved, plain_grads), (again, saved, grads) = runs["plain"], runs["recomputed"]
    assert abs(again - plain) <= 1e-12 * abs(plain) and saved < 0.6 * plain_saved, (again, plain, saved, plain_saved)
    assert max(_relative(grads[k], plain_grads[k]) for k in grads) <= 1e-12


def plan_node_leaf(plan: dict, node: int) -> str:
    """The leaf a plan node is, or the leaf its chain of parallel operators starts at."""
    from parsat.ir.plan import pcg_from_dict

    pcg = pcg_from_dict(plan)
    n = pcg.node(node)
    while n.kind == "parallel":
        n = pcg.node(n.inputs[0])
    return n.op


def rewritten_job(ctx, plans: dict, folder: str) -> dict:
    """On every rank, per plan: BERT lowered as the plan says (the import's example given), the user's loop (AdamW,
    clip_grad_norm_) on this rank's local batch for 3 steps beside the unmodified module on the global batch in
    this process, the first step's forward traced (`Trace`); the DCP checkpoint to folder/<label>, rank 0's whole
    weights to folder/<label>.pt."""
    import torch.distributed as dist

    out = {}
    for label, plan in plans.items():
        out[label] = _train_rewritten(ctx, plan, f"{folder}/{label}")
        dist.barrier()
    return out


def _train_rewritten(ctx, plan: dict, path: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from parsat.backend.torch_native.apply import local_batch, lowering_of
    from parsat.backend.torch_native.rewritten import RewrittenForward

    module, example = _factory("bert" + PADDED)()
    reference = _factory("bert" + PADDED)()[0]
    model = parsat.parallelize(module, plan, example, runtime="torch")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    run = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": []}
    trace = Trace()
    for step in range(3):
        ids, labels = _batch(step, BATCH, SEQ, VOCAB)
        with trace if step == 0 else contextlib.nullcontext():
            loss = model(*local_batch(model, ids, labels))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        held = loss.detach().clone()
        dist.all_reduce(held)
        run["losses"].append(float(held) / ctx.world)
        run["norms"].append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        want = reference(ids, labels)
        want.backward()
        run["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)))
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        run["ref_losses"].append(float(want.detach()))
    worst, worst_name = 0.0, ""
    for name, want_param in reference.named_parameters():
        got = model.get_parameter(name)
        rel = _relative((got.full_tensor() if isinstance(got, DTensor) else got).detach(), want_param.detach(),
                        floor=LR)
        worst, worst_name = max((worst, worst_name), (rel, name))
    params = dict(model.named_parameters())
    state = get_model_state_dict(model)
    dcp.save(state, checkpoint_id=path)
    whole = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}
    if ctx.rank == 0:
        torch.save(whole, f"{path}.pt")
    run.update(worst_weight=worst, worst_name=worst_name, counts=trace.counts,
               not_dtensor=sorted(n for n, t in params.items() if not isinstance(t, DTensor)),
               meshes=sorted({str(getattr(t, "device_mesh", None)) for t in params.values()}),
               placements=sorted({repr(t.placements) for t in params.values() if isinstance(t, DTensor)}),
               table=repr(params["model.bert.embeddings.word_embeddings.weight"].placements),
               lowering=lowering_of(model).describe(),
               own_forward=not isinstance(model.__dict__.get("forward"), RewrittenForward))
    return run


@pytest.mark.slow
def test_rewritten_plans_train_on_two_ranks_like_the_module_in_one_process(bert, tmp_path):
    """On 2 gloo ranks the lowered module, under the optimizer's plan (`fully_shard`: every parameter a `Shard(0)`
    DTensor) and the same search with ZeRO pinned off (`replicate`: `Replicate()`), its forward the plan's graph
    (2 scaled-query matmuls, no attention kernel, in the first step's forward), trains 3 AdamW steps with clipping
    like the unmodified module on the global batch in one process (1e-4 asked), and each checkpoint loads into
    the unmodified module with the same weights."""
    from parsat.backend.launch import LaunchConfig, launch

    module, _, imported, zero3 = bert
    replicated = parsat.optimize(imported.graph, machine="cpu", devices=2, degrees={"dp": 2, "zero": 0},
                                 baselines=False).to_dict()
    plans = {"zero3": zero3, "replicate": replicated}
    results = launch(rewritten_job, (plans, str(tmp_path)), LaunchConfig(nproc=2, backend="gloo", timeout_s=600))
    placements = {"zero3": ["(Shard(dim=0),)"], "replicate": ["(Replicate(),)"]}
    for label in plans:
        for result in results:
            _check_run(result, label)
            run = result[label]
            assert run["counts"] == {"sdpa": 0, "scaled_left": 2, "linear_nobias": 0}, run["counts"]
            assert run["placements"] == placements[label], run["placements"]
            assert not run["own_forward"] and "forward: the plan's graph" in run["lowering"]
        assert _dcp_loads_into_the_unmodified_module(tmp_path, label, "bert") == 0.0
        run = results[0][label]
        print(json.dumps({label: {k: run[k] for k in ("losses", "ref_losses", "norms", "ref_norms", "worst_weight",
                                                      "worst_name", "lowering")}}))


@pytest.mark.slow
def test_a_rewritten_tensor_parallel_plan_trains_on_two_ranks_like_the_module_in_one_process(bert, tmp_path):
    """Megatron's tp 2 plan of BERT (row-parallel projections as `linear_nobias_t`, `reduce`, `bias_add`): every
    parameter a DTensor placed as the plan stores it (the tied word table `Replicate()`, the projections `Shard`),
    the forward the plan's graph on DTensors redistributed at its parallel operators (4 bias-free projections, no
    attention kernel), 3 AdamW steps with clipping like the unmodified module in one process (1e-4 asked), the
    checkpoint loading into the unmodified module."""
    from parsat.backend.launch import LaunchConfig, launch

    plans = {"tp": _plan(bert[2].graph, (1, 2))}
    results = launch(rewritten_job, (plans, str(tmp_path)), LaunchConfig(nproc=2, backend="gloo", timeout_s=600))
    for result in results:
        _check_run(result, "tp")
        run = result["tp"]
        assert run["counts"] == {"sdpa": 0, "scaled_left": 0, "linear_nobias": 4}, run["counts"]
        assert run["placements"] == ["(Replicate(),)", "(Shard(dim=0),)", "(Shard(dim=1),)"], run["placements"]
        assert run["table"] == "(Replicate(),)" and not run["own_forward"]
    assert _dcp_loads_into_the_unmodified_module(tmp_path, "tp", "bert") == 0.0
    run = results[0]["tp"]
    print(json.dumps({k: run[k] for k in ("losses", "ref_losses", "norms", "ref_norms", "worst_weight", "worst_name",
                                          "lowering")}))


def test_what_a_rewritten_forward_cannot_compute_is_refused_naming_the_node():
    """On the tiny LM's data-parallel plan, edited by hand: a `scale` after the loss's sum over the data ranks (a
    normalisation fixed at the global batch would be off on each rank's local batch), and an embedding reading the
    ids before the plan splits them (each rank holds only its local batch), each refused naming the node; the
    plan as it is computes the graph itself (no rewrite)."""
    from dataclasses import replace

    from test_torch_native_runtime import tiny

    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.lowering import LoweringError, lower
    from parsat.backend.torch_native.rewritten import lowered_rewrite, rewrite_of
    from parsat.importer.export import import_module
    from parsat.ir.plan import pcg_from_dict

    module, example = tiny()
    imported = import_module(module, example, check=False)
    graph = imported.graph
    pcg = pcg_from_dict(_plan(graph, (2, 1)))
    lowering = lower(pcg, graph, module_info(module, imported.weights))
    assert lowered_rewrite(pcg, graph, lowering, imported)[1] is None
    loss, = pcg.outputs
    scaled = replace(pcg.node(loss), id=loss + 1, kind="op", op="scale", inputs=(loss,), attrs=(("c", 0.5),),
                     rules=())
    with pytest.raises(LoweringError, match=rf"node #{loss + 1} scale\(c=0.5\) scales a value summed or gathered "
                                            "over the data ranks"):
        rewrite_of(replace(pcg, nodes=pcg.nodes + (scaled,), outputs=(scaled.id,)), graph, lowering, imported)
    embedding = next(n for n in pcg.nodes if n.op == "embedding")
    split, table = embedding.inputs
    early = replace(embedding, inputs=(pcg.node(split).inputs[0], table))
    nodes = tuple(early if n.id == embedding.id else n for n in pcg.nodes)
    with pytest.raises(LoweringError, match=rf"node #{embedding.id} embedding .* computes on the user's data before "
                                            "the plan splits it"):
        rewrite_of(replace(pcg, nodes=nodes), graph, lowering, imported)



# ------------------------------------------------------------------ beside data axes, and vocabulary-split lookups


@pytest.fixture(scope="module")
def gpt2():
    """(module, import) of HF GPT-2, float64 (its loss too), dropout off."""
    from parsat.importer.export import import_module

    module, example = _factory("gpt2")()
    return module, import_module(module, example, check=False)


def test_dp_by_tp_and_vocabulary_split_plans_lower_to_rewritten_forwards(bert, gpt2):
    """Without processes: Megatron's dp 2 x tp 2 plan of BERT (its attention mask and token-type one-hots, built by
    the module at its batch's shape, split with the batch on dp) lowers to a rewritten forward with a tensor axis
    beside the data axis: the constants sliced at the rank's dp coordinate, the parallel operators on tp
    redistributions, the token-type table looked up vocabulary-parallel. GPT-2's tp 2 plan looks its word table
    up split along the vocabulary on tp (`lookup`: each rank's rows, `rewritten.vocabulary_lookup`), where
    DTensor's own sharding of the lookup fails in the backward. The same plan with the lookup reading the ids
    whole is refused, naming the node."""
    from dataclasses import replace

    from parsat.backend.torch_native.lowering import LoweringError
    from parsat.backend.torch_native.rewritten import LOOKUP, PLACE, SLICE, rewrite_of
    from parsat.ir.plan import pcg_from_dict

    module, _, imported, _ = bert
    plan = _plan(imported.graph, (2, 2))
    lowering, rewrite = _rewrite(module, imported, plan)
    assert rewrite is not None and rewrite.tensor_axis == 1 and lowering.batch_axes == (0,) and lowering.styles == ()
    assert "forward: the plan's graph" in lowering.describe()
    slices = {(plan_node_leaf(plan, s.inputs[0]), s.axis, s.dim) for s in rewrite.steps if s.action == SLICE}
    assert slices == {("expand_1_onehot", 0, 0), ("expand_2_mask", 0, 0)}, slices
    assert {s.axis for s in rewrite.steps if s.action == PLACE} == {1}
    pcg = pcg_from_dict(plan)
    lookups = [plan_node_leaf(plan, s.inputs[1]) for s in rewrite.steps if s.action == LOOKUP]
    assert lookups == ["model.bert.embeddings.token_type_embeddings.weight"], lookups
    module, imported = gpt2
    plan = _plan(imported.graph, (1, 2))
    lowering, rewrite = _rewrite(module, imported, plan)
    lookups = [s for s in rewrite.steps if s.action == LOOKUP]
    assert [plan_node_leaf(plan, s.inputs[1]) for s in lookups] == ["model.lm_head.weight"]   # tied to wte
    assert not any("looks up rows" in n for n in lowering.notes)
    pcg = pcg_from_dict(plan)
    node = pcg.node(lookups[0].node)
    whole = replace(node, inputs=(pcg.node(node.inputs[0]).inputs[0], node.inputs[1]))
    edited = replace(pcg, nodes=tuple(whole if n.id == node.id else n for n in pcg.nodes))
    with pytest.raises(LoweringError, match=rf"node #{node.id} embedding .* reads a table split along the "
                                            "vocabulary on axis tp without its ids split so"):
        rewrite_of(edited, imported.graph, lowering, imported)


@pytest.mark.slow
def test_a_vocabulary_parallel_lookup_trains_like_the_module_in_one_process_on_a_dp_by_tp_mesh(tmp_path):
    """The tiny tied LM (float64, its import given): Megatron's dp 2 x tp 2 plan (4 ranks, slow: 48 CPU s), as
    test_torch_native_runtime's test_a_vocabulary_parallel_lookup_trains_like_the_module_in_one_process checks the
    tp 2 plan (2 ranks, in that file's one 2-rank launch, `vocabulary_lookup_plan`, `check_vocabulary_lookup`):
    it computes otherwise than the module and looks the ids up in the table split along the vocabulary on tp,
    every parameter placed as the plan stores it on each mesh axis (`Replicate()` on dp)."""
    from parsat.backend.launch import LaunchConfig, launch

    factory, plan = "tiny64" + IMPORTED, vocabulary_lookup_plan((2, 2))
    results = launch(train_job, (factory, {"dp_tp": plan}, 3, str(tmp_path), VOCABULARY_LOOKUP_SIZES),
                     LaunchConfig(nproc=4, backend="gloo", timeout_s=300))
    check_vocabulary_lookup(results, "dp_tp", tmp_path, data=["Replicate()"])


@pytest.mark.slow
def test_dp_by_tp_plans_of_bert_and_gpt2_train_on_four_ranks_like_the_module_in_one_process(tmp_path):
    """Megatron's dp 2 x tp 2 plans of HF BERT and GPT-2 and GPT-2's tp 4 plan, each computing otherwise than the
    module (row-parallel projections as bias-free products, then the all-reduce, then the bias), on 4 gloo ranks
    (float64): the module's forward the plan's graph on DTensors of the tp mesh and each rank's local batch, every
    parameter a DTensor on the 2-D mesh placed as the plan stores it per axis (`Replicate()` on dp), GPT-2's word
    table and BERT's token-type table looked up vocabulary-parallel (each rank's rows, no `nn.Embedding` call),
    3 AdamW steps with clipping like the unmodified module in one process (1e-4 asked), the checkpoints loading
    into the unmodified modules."""
    bert = _train_hf("bert", {"bert_dp2_tp2": _plan_of("bert", (2, 2))}, 4, tmp_path)
    gpt2 = _train_hf("gpt2", {"gpt2_dp2_tp2": _plan_of("gpt2", (2, 2)), "gpt2_tp4": _plan_of("gpt2", (1, 4))}, 4,
                     tmp_path)
    for result in bert:
        run = result["bert_dp2_tp2"]
        assert not run["own_forward"] and "embedding" not in run["lookups"], run["lookups"]
        assert run["lookups"]["rows [1, 128]"] == 1, run["lookups"]   # the token-type table's row on this rank
        placements = run["placements"]
        assert placements["model.bert.encoder.layer.0.attention.self.query.weight"] == ["Replicate()", "Shard(dim=0)"]
        assert placements["model.bert.encoder.layer.1.output.dense.weight"] == ["Replicate()", "Shard(dim=1)"]
        assert placements["model.bert.embeddings.word_embeddings.weight"] == ["Replicate()", "Replicate()"]
    for result in gpt2:
        for label, rows in (("gpt2_dp2_tp2", "rows [128, 128]"), ("gpt2_tp4", "rows [64, 128]")):
            run = result[label]
            assert not run["own_forward"] and "embedding" not in run["lookups"], run["lookups"]
            assert run["lookups"][rows] == 1, run["lookups"]   # the word table's rows on this rank
        placements = result["gpt2_dp2_tp2"]["placements"]
        assert placements["model.transformer.wte.weight"] == ["Replicate()", "Shard(dim=0)"], placements
        assert placements["model.transformer.h.0.attn.c_attn.weight"] == ["Replicate()", "Shard(dim=1)"]
        assert placements["model.transformer.h.0.mlp.c_proj.weight"] == ["Replicate()", "Shard(dim=0)"]


def _plan_of(name: str, shape: tuple[int, int]) -> dict:
    """Megatron's plan of a Hugging Face model as `_factory` builds it, on the graph its import makes."""
    from parsat.importer.export import import_module

    module, example = _factory(name)()
    return _plan(import_module(module, example, check=False).graph, shape)


@pytest.mark.slow
def test_a_tensor_parallel_plan_recomputing_blocks_trains_on_two_ranks(tmp_path):
    """Megatron's tp 2 plan of BERT with `recompute="blocks"` on 2 gloo ranks: the rewritten forward checkpoints
    the plan's 2 block regions, whose redistributions on tp run again in the backward on both ranks alike (the
    first step issues more all-reduces than the 11 of the plan without recomputation), and 3 AdamW steps with
    clipping train like the unmodified module in one process (1e-4 asked)."""
    plan = {**_plan_of("bert", (1, 2)), "recompute": "blocks"}
    results = _train_hf("bert", {"bert_tp2_recompute": plan}, 2, tmp_path)
    for result in results:
        run = result["bert_tp2_recompute"]
        assert not run["own_forward"] and "2 blocks recomputed" in run["lowering"], run["lowering"]
        assert run["checkpointed"] == [] and run["comms"]["all_reduce"] > 11, run["comms"]


# ------------------------------------------------------------------ plans no style runs; the module's dtypes


def _llama(heads: int, kv_heads: int):
    """(module, import) of HF LLaMA as `_factory("llama")` builds it (float64, transformers' float32 loss) with
    `heads` attention heads and `kv_heads` KV heads."""
    import hf_models
    import transformers

    from parsat.importer.export import import_module

    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=256,
                                      max_position_embeddings=64)
    module = hf_models.Loss(transformers.LlamaForCausalLM(config), "causal").double()
    ids = torch.randint(1, 256, (BATCH, SEQ))
    return module, import_module(module, (ids, ids), check=False)


@pytest.fixture(scope="module")
def llama_plans():
    """(heads, kv_heads, tp) -> (module, import, the optimizer's plan pinned tp) of `_llama(heads, kv_heads)`, made
    once per module: the tp 4 plan of the 2-KV-head LLaMA is both the plan that slices the repeated heads and the
    one whose rewritten forward computes in the module's dtypes (an import and a search: ~3 CPU s each time).
    Nothing here mutates them (a plan and a graph are frozen; the module is only read)."""
    made: dict = {}

    def get(heads: int, kv_heads: int, tp: int):
        if (heads, kv_heads, tp) not in made:
            module, imported = _llama(heads, kv_heads)
            plan = parsat.optimize(imported.graph, machine="cpu", devices=tp, degrees={"tp": tp})
            made[heads, kv_heads, tp] = module, imported, plan
        return made[heads, kv_heads, tp]

    return get


@pytest.mark.parametrize("heads,kv_heads,tp", [(4, 2, 4), (4, 1, 2)])
def test_a_plan_slicing_the_heads_repeat_kv_makes_runs_its_graph_on_dtensors(llama_plans, heads, kv_heads, tp):
    """HF LLaMA with fewer KV heads than tp ranks, pinned tp (`optimize --degrees tp=N`): the plan computes k and v
    column-parallel, gathers them, repeats their heads (`repeat_kv`) and slices the repeated heads on tp before
    attention (a `partition` along dim 1 of a value the module's code makes), which no torch style does
    (torchtitan and Megatron require tp to divide the KV heads). The styles' lowering says so (`UnstyledAxis`);
    given the import, the module's forward evaluates the plan's graph on DTensors, where that partition is a
    `redistribute` to `Shard(1)` (each rank's heads: a local slice), every parameter placed as the plan stores
    it, no style; without the import the refusal says what would run it."""
    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.lowering import LoweringError, UnstyledAxis, lower
    from parsat.backend.torch_native.rewritten import PLACE, lowered_plan
    from parsat.ir.placement import shard

    module, imported, plan = llama_plans(heads, kv_heads, tp)
    pcg, graph, info = plan.pcg, plan.graph, module_info(module, imported.weights)
    with pytest.raises(UnstyledAxis, match=r"node #(\d+) partition\(dim=1, axis=tp, degree=\d\) on tensor axis tp is "
                                           "not at the input or output of a split nn.Linear") as refused:
        lower(pcg, graph, info)
    node = int(refused.value.args[0].split("#")[1].split(" ")[0])
    assert pcg.node(pcg.node(node).inputs[0]).op == "flatten"   # repeat_kv's merge of the KV heads' copies
    lowering, rewrite = lowered_plan(pcg, graph, info, imported)
    assert rewrite is not None and lowering.styles == ()
    assert f"torch's styles cannot run its tensor axis on the module's own forward (node #{node} partition" \
        in lowering.rewritten, lowering.rewritten
    assert any(s.node == node and s.action == PLACE and s.code == shard(1) for s in rewrite.steps)
    stored = dict(rewrite.stored)
    assert stored["model.model.layers.0.self_attn.k_proj.weight"] == shard(0)   # column-parallel, as planned
    with pytest.raises(LoweringError, match="a forward evaluating the plan's graph on DTensors would run it: give "
                                            "parallelize the example inputs"):
        lowered_plan(pcg, graph, info, None)


def test_the_rewritten_forward_computes_in_the_modules_dtypes(llama_plans, gpt2):
    """The import records where a float64 LLaMA computes in float32 (`ImportedModule.dtypes`): each RMSNorm reads
    its input `.to(torch.float32)`, the loss reads the logits `.float()` and computes in float32; GPT-2 with a
    float64 loss records nothing. The rewritten forward of the tp 4 plan applies them to the plan's nodes (its
    vocabulary-parallel logsumexp's steps in float32 too), and a cross-entropy `nll_sum(x, logsumexp(x), y)` so
    computed is evaluated as `-sum(y * log_softmax(x))`: its gradient bit for bit torch's `F.cross_entropy` on
    the float32 logits (the module's), where `nll_sum` on the same float32 values rounds otherwise."""
    from parsat.backend.torch_native.rewritten import NLL_OF_LOG_SOFTMAX, OP, Step, _apply, node_dtypes
    from parsat.importer.imported import NodeDtypes

    _, imported, plan = llama_plans(4, 2, 4)
    norms = [n.name for n in imported.graph.nodes if n.op == "rmsnorm"]
    assert len(norms) == 5 and all(imported.dtypes[n] == NodeDtypes(((0, "float32"),), "") for n in norms)
    loss = next(n for n in imported.graph.nodes if n.op == "nll_sum")
    assert imported.dtypes[loss.name].makes == "float32" and len(imported.dtypes[loss.name].reads) == 3
    assert gpt2[1].dtypes == {}   # the module fixture's import: `_factory("gpt2")`'s module, unchecked, as here before
    found = node_dtypes(plan.pcg, plan.graph, imported.dtypes)
    assert sum(plan.pcg.node(i).op == "rmsnorm" for i in found) == 5
    assert {plan.pcg.node(i).op for i, d in found.items() if d.makes == "float32"} >= {"amax", "sumexp_shifted",
                                                                                    "nll_sum"}
    torch.manual_seed(0)
    logits = torch.randn(64, 32, dtype=torch.float64) * 3
    targets = torch.randint(0, 32, (64,))
    want = logits.clone().requires_grad_()
    nn.functional.cross_entropy(want.float(), targets).backward()
    reads = tuple((k, "float32") for k in range(3))
    got = {}
    for name in (NLL_OF_LOG_SOFTMAX, "nll_sum"):
        x = logits.clone().requires_grad_()
        env = {0: x, 2: nn.functional.one_hot(targets, 32).double(), 3: torch.tensor(1 / 64, dtype=torch.float64)}
        _apply(Step(1, OP, "logsumexp", (0,), reads=reads[:1], makes="float32"), env, {}, {}, ())
        _apply(Step(4, OP, name, (0, 1, 2), reads=reads, makes="float32"), env, {}, {}, ())
        _apply(Step(5, OP, "mul", (4, 3), reads=reads[:2], makes="float32"), env, {}, {}, ())
        env[5].backward()
        got[name] = (x.grad - want.grad).abs().max().item()
    assert got[NLL_OF_LOG_SOFTMAX] == 0.0 and got["nll_sum"] > 0.0, got


@pytest.mark.slow
def test_llama_tp4_with_two_kv_heads_and_the_dp_tp_plan_train_on_four_ranks_like_one_process(tmp_path):
    """On 4 gloo ranks, 3 AdamW steps with clipping against the unmodified module in one process (1e-4), every
    parameter a DTensor, the checkpoints loading into the unmodified module: (1) the tp 4 plan of HF LLaMA with 2 KV
    heads (above), its forward the plan's graph on DTensors (the repeated heads sliced on each rank), checked with
    the loss in float64 (`LOSS64`): its vocabulary-parallel float32 loss sums its pieces in another order than
    torch's, which AdamW turns into 4e-3 of a weight in 3 steps; (2) the searched dp 2 x tp 2 plan (58 nodes
    reordered by add_commute) through the rewritten forward with transformers' float32 loss, whose float32
    sections (RMSNorm, the loss) the forward computes as the module does (2026-12-05: weights 6.2e-13 apart,
    4.9e-4 when it computed them in float64)."""
    from test_torch_native_hf_pipeline import searched_hf_llama_dp_tp_plan
    from test_torch_native_runtime import LOSS64

    module, example = _factory("llama" + LOSS64)()
    tp4 = parsat.optimize(parsat.from_torch(module, example), machine="cpu", devices=4, degrees={"tp": 4})
    for name, label, plan in (("llama" + LOSS64, "tp4", tp4), ("llama", "dp2_tp2", searched_hf_llama_dp_tp_plan())):
        for result in _train_hf(name, {label: plan.to_dict()}, 4, tmp_path):
            run = result[label]
            assert not run["own_forward"], run["lowering"]
            if label == "tp4":
                assert "torch's styles cannot run its tensor axis" in run["lowering"], run["lowering"]
                assert run["placements"]["model.model.layers.0.self_attn.k_proj.weight"] == ["Shard(dim=0)"]
