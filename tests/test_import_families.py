"""The operators of more Hugging Face families import exactly (issue 32, build 2): one tiny module per operator.

Each module uses one operator the way a family does (Falcon's `w.T`, T5's
`torch.where` with a scalar and its position bias as an attention mask,
GPT-J's `x[..., ::2]`, Phi-3's empty slice, Falcon's `x[..., [-2], :]` and
multi-query attention, ConvNeXt's depthwise convolution, Whisper's conv1d,
Swin's padding); `import_module` runs the importer's float64 self-check
(loss and every gradient against the module), so an import that returns is
an exact one. Mixtral's top-k routing imports as `topk_onehot` whose one-hot
picks each token's expert weights; its indices read any other way are
refused with the operator and the user's source line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from parsat.importer.errors import TorchImportError  # noqa: E402
from parsat.importer.export import import_module  # noqa: E402
from parsat.ir.expert_parallel import expert_matmuls  # noqa: E402

RULES = Path(__file__).resolve().parent.parent / "rules"


def ops_of(module, *inputs) -> set[str]:
    """The library operators of the module's imported graph (the import checks itself)."""
    torch.manual_seed(0)
    return {n.op for n in import_module(module, inputs).graph.nodes}


class Transposed(nn.Module):
    """Falcon's linear layers: `x @ self.weight.T` (`aten.numpy_T`)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 4))

    def forward(self, x):
        return (x @ self.weight.T).pow(2).mean()


def test_numpy_t_product_is_torch_linear():
    """`x @ w.T` is torch's `F.linear` on the [out, in] matrix as stored: no transpose is left."""
    ops = ops_of(Transposed(), torch.randn(2, 3, 4))
    assert "linear_nobias_t" in ops and "transpose" not in ops and "linear_nobias" not in ops


class MaskedBias(nn.Module):
    """T5 with SDPA: a position bias kept where a data mask holds, the float32 minimum elsewhere
    (`aten.where.ScalarOther`), passed to attention as its mask."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(2, 5, 5))
        self.proj = nn.Linear(4, 4)

    def forward(self, x, keep):
        q = self.proj(x)
        mask = torch.where(keep[:, None, None, :], self.bias[None], torch.finfo(torch.float32).min)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).pow(2).mean()


def test_where_with_a_scalar_and_a_mask_from_the_weights():
    keep = torch.tensor([[True, True, False, True, True], [True, True, True, True, False]])
    ops = ops_of(MaskedBias(), torch.randn(2, 2, 5, 4), keep)
    assert {"mul", "add", "softmax"} <= ops and "softmax_masked" not in ops


class Where(nn.Module):
    """`torch.where` with two tensor branches, and with the scalar as the branch taken where the condition holds."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        cond = x > 0
        return (torch.where(cond, self.a(x), self.b(x)) + torch.where(cond, 2.0, self.a(x))).pow(2).mean()


def test_where_with_tensor_branches_and_a_scalar_first():
    assert {"mul", "add"} <= ops_of(Where(), torch.randn(3, 4))


class Strided(nn.Module):
    """GPT-J's rotate-every-two (`x[..., ::2]`, `x[..., 1::2]`, `torch.stack`), and a step whose last whole step
    runs past the end of the dim (`x[:, 1:8:3]` of 8: 1, 4, 7)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        rotated = torch.stack((-h[..., 1::2], h[..., ::2]), dim=-1).flatten(-2)
        return (rotated * h).mean() + h[:, 1:8:3].pow(2).mean()


def test_slices_with_a_step():
    assert {"unflatten", "split", "concat"} <= ops_of(Strided(), torch.randn(3, 8))


class EmptySlice(nn.Module):
    """Phi-3's partial rotary when the rotary dims are all of them: `cat((h[..., :8] * 2, h[..., 8:]), -1)`."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        return torch.cat((h[..., :8] * 2, h[..., 8:]), dim=-1).pow(2).mean()


def test_an_empty_slice_joined_by_cat():
    assert "concat" not in ops_of(EmptySlice(), torch.randn(3, 8))


class EmptyRead(EmptySlice):
    def forward(self, x):
        return self.proj(x)[..., 8:].sum() + self.proj(x).sum()


def test_an_empty_slice_read_by_anything_else_is_refused():
    with pytest.raises(TorchImportError, match="an empty tensor .* from an empty slice"):
        import_module(EmptyRead(), (torch.randn(3, 8),))


class MultiQuery(nn.Module):
    """Falcon's multi-query attention: one key and value head picked with `[..., [-2], :]` and `[..., [-1], :]`,
    broadcast by attention over the query heads."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        fused = self.qkv(x).view(2, 5, 6, 4)                     # 4 query heads, then one key and one value
        q, k, v = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.pow(2).mean() + self.qkv(x)[:, :, [5, 0, 1, 2]].mean()


def test_constant_indices_and_multi_query_attention():
    assert {"split", "broadcast", "attention_causal"} <= ops_of(MultiQuery(), torch.randn(2, 5, 8))


class Gathers(nn.Module):
    """Whisper's `weight[position_ids]` (a 2-D index into dim 0) and Swin's `table[index.view(-1)]` (many runs
    of positions, along dim 1 here): gathers by constant positions."""

    def __init__(self):
        super().__init__()
        self.positions = nn.Parameter(torch.randn(8, 4))
        self.table = nn.Parameter(torch.randn(3, 7))

    def forward(self, x):
        placed = x + self.positions[torch.arange(5)[None, :]]                   # [n, 5, 4]
        picked = self.table[:, torch.tensor([6, 0, 3, 3, 1, 5])]                 # [3, 6]
        return placed.pow(2).mean() + picked.pow(2).sum()


def test_gathers_by_constant_positions_are_embeddings():
    assert "embedding" in ops_of(Gathers(), torch.randn(2, 5, 4))


class Convolutions(nn.Module):
    """ConvNeXt's depthwise convolution, a grouped one, Whisper's strided conv1d, and Swin's padding to whole
    windows (`F.pad` of H and W)."""

    def __init__(self):
        super().__init__()
        self.depthwise = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.grouped = nn.Conv2d(4, 6, 3, groups=2, bias=False)
        self.audio = nn.Conv1d(3, 4, 3, stride=2, padding=1)

    def forward(self, image, audio):
        h = self.grouped(self.depthwise(image))                  # [n, 6, 4, 4]
        h = F.pad(h.permute(0, 2, 3, 1), (0, 0, 1, 2, 0, 1))     # [n, 5, 7, 6]
        return h.pow(2).sum() + self.audio(audio).pow(2).sum()   # sums: a data-parallel loss is a partial sum


def test_grouped_and_1d_convolutions_and_padding():
    ops = ops_of(Convolutions(), torch.randn(2, 4, 6, 6), torch.randn(2, 3, 9))
    assert {"conv2d_grouped", "conv1d", "pad", "bias_add"} <= ops


class Experts(nn.Module):
    """Mixtral's mixture of experts as Hugging Face's `batched_mm` runs it: a router's softmax, each token's top-2
    experts (`torch.topk`), their weights renormalized, each token repeated once per chosen expert, that
    expert's weights picked by index (`w[ids]`, indices computed from the weights) and applied by `bmm`."""

    def __init__(self, experts: int = 4, width: int = 8, hidden: int = 6):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.router = nn.Linear(width, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, hidden, width) / width ** 0.5)
        self.down = nn.Parameter(torch.randn(experts, width, hidden) / hidden ** 0.5)

    def forward(self, x):
        tokens = self.proj(x).reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.router(tokens).softmax(-1), 2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        ids = chosen.reshape(-1)
        h = torch.bmm(self.up[ids], tokens.repeat_interleave(2, dim=0).unsqueeze(-1)).squeeze(-1)
        out = torch.bmm(self.down[ids], F.silu(h).unsqueeze(-1)).squeeze(-1) * weights.reshape(-1, 1)
        return out.view(tokens.shape[0], 2, -1).sum(1).pow(2).mean()


def experts():
    torch.manual_seed(0)
    return Experts(), (torch.randn(4, 3, 8),)


def test_top_k_routing_imports_exactly_as_experts_dispatched_over_an_experts_dim():
    """The import's float64 self-check compares the loss and every gradient (the router's included, which flows
    through the picked values only) with the module's; the routing is `topk_onehot`, and each `bmm` by picked
    expert weights the dispatch form (`aten_routing.expert_matmul`): rows spread over the experts and masked by the
    one-hot, one bmm over the experts dim by the weights as stored, the experts' rows summed. No pick is left."""
    module, inputs = experts()
    graph = import_module(module, inputs).graph
    ops = [n.op for n in graph.nodes]
    assert ops.count("topk_onehot") == 1 and ops.count("embedding") == 0
    assert expert_matmuls(graph, 2) == {"bmm_experts": "up", "bmm_1_experts": "down"}
    shapes = {n.name: n.shape for n in graph.nodes}
    assert shapes["bmm_experts"] == (4, 24, 6) and shapes["bmm_1_experts"] == (4, 24, 8)   # [experts, rows, n]


class RoutedIndicesAsValues(nn.Module):
    """A top-k's indices used as numbers: nothing in the library computes integers from the weights."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4)

    def forward(self, x):
        weights, chosen = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        return weights.sum() + chosen.float().sum()  # the indices read as values


def test_top_k_indices_read_as_values_are_refused_with_the_source_line():
    with pytest.raises(TorchImportError) as err:
        import_module(RoutedIndicesAsValues(), (torch.randn(3, 8),))
    message = str(err.value)
    lines = Path(__file__).read_text(encoding="utf-8").splitlines()
    number = next(i for i, line in enumerate(lines, 1) if "# the indices read as values" in line)
    assert "the indices of a top-k (computed from the weights) are read here" in message
    assert f"{Path(__file__).resolve()}:{number}" in message


class ShiftedWindows(nn.Module):
    """Swin's shifted windows (`torch.roll` over H and W), its pooler (`adaptive_avg_pool1d` to 1) and BEiT's
    interpolation of a table to its own size (`upsample_bilinear2d`, the identity)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.table = nn.Parameter(torch.randn(1, 4, 3, 3))

    def forward(self, x):
        h = torch.roll(self.proj(x), shifts=(-1, 2), dims=(1, 2))                      # [n, 5, 6, 4]
        pooled = F.adaptive_avg_pool1d(h.flatten(1, 2).transpose(1, 2), 1)             # [n, 4, 1]
        table = F.interpolate(self.table, size=(3, 3), mode="bilinear")
        return pooled.pow(2).mean() + table.pow(2).sum()


def test_roll_pooling_and_interpolation_to_the_same_size():
    assert {"split", "concat", "mean"} <= ops_of(ShiftedWindows(), torch.randn(2, 5, 6, 4))


class Upsampled(ShiftedWindows):
    def forward(self, x):
        return F.interpolate(self.table, scale_factor=2.0, mode="bilinear").sum()


def test_interpolation_to_another_size_is_refused():
    with pytest.raises(TorchImportError, match="upsample_bilinear2d to another size than the input's"):
        import_module(Upsampled(), (torch.randn(2, 5, 6, 4),))


class DropPath(nn.Module):
    """Stochastic depth as Swin and BEiT write it: a per-sample mask drawn with `torch.rand` in forward."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        keep = (0.9 + torch.rand(x.shape[0], 1)).floor()
        return (self.proj(x) / 0.9 * keep).pow(2).mean()


def test_values_drawn_at_random_in_forward_are_refused():
    with pytest.raises(TorchImportError, match="values drawn at random in forward"):
        import_module(DropPath(), (torch.randn(3, 4),))


class PositionBias(nn.Module):
    """T5's relative position bias: a table read through bucket ids made from positions alone (a constant
    one-hot of [queries, keys, buckets], whose dim 0 is no batch), added to each sample's scores."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Embedding(8, 2)
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        positions = torch.arange(6)
        buckets = (positions[None, :] - positions[:, None]).abs().clamp(max=7)
        h = self.proj(x)
        scores = h @ h.transpose(-1, -2) + self.bias(buckets).permute(2, 0, 1)
        return scores.softmax(-1).pow(2).sum()   # a sum over the batch: a partial sum on each rank


def test_constants_are_named_and_data_parallelism_copies_them():
    from parsat.dsl.library import load_library
    from parsat.ir.data_parallel import data_parallel_pcg
    from parsat.ir.graph import Graph
    from parsat.ir.microbatch import batch_dims

    torch.manual_seed(0)
    graph = import_module(PositionBias(), (torch.randn(4, 2, 6, 4),)).graph
    (constant,) = graph.constants
    assert graph.leaf(constant).shape == (6, 6, 8) and constant not in batch_dims(graph)
    assert Graph.from_dict(graph.to_dict()).constants == graph.constants
    pcg = data_parallel_pcg(graph, load_library()[0], 2)   # the one-hot whole on each rank, the samples split
    assert pcg is not None
    leaf = next(n for n in pcg.nodes if n.kind == "leaf" and n.op == constant)
    assert [n.op for n in pcg.nodes if leaf.id in n.inputs] == ["replicate"]


class BiasedLayer(nn.Module):
    """A layer reading its own position bias through constant bucket ids (a stack of them is named by blocks)."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Embedding(8, 2)
        self.proj = nn.Linear(6, 6)

    def forward(self, x):
        positions = torch.arange(6)
        buckets = (positions[None, :] - positions[:, None]).abs().clamp(max=7)
        return torch.tanh(self.proj(x) + self.bias(buckets).permute(2, 0, 1))


def test_constants_follow_the_blocks_renaming():
    """The importer renames a stack's tensors by block (`b0_...`); the inputs the graph names constant are
    renamed with them, so each block's bucket one-hot is still held whole by data parallelism, not split."""
    from parsat.ir.microbatch import batch_dims

    torch.manual_seed(0)
    module = nn.Sequential(*(BiasedLayer() for _ in range(4)))
    imported = import_module(module, (torch.randn(4, 2, 6, 6),))
    graph = imported.graph
    made = {leaf.name for leaf in graph.leaves if leaf.role == "input" and imported.data[leaf.name].constant}
    assert len(made) == 4 and all(name.startswith(("b0_", "b1_", "b2_", "b3_")) for name in made), made
    assert graph.constants == made and not made & set(batch_dims(graph))


def convolutions():
    """`parsat run --model` factories (this file is the model file): a module and a batch of 4."""
    torch.manual_seed(0)
    return Convolutions(), (torch.randn(4, 4, 6, 6), torch.randn(4, 3, 9))


def position_bias():
    torch.manual_seed(0)
    return PositionBias(), (torch.randn(4, 2, 6, 4),)


class Frozen(nn.Module):
    """Whisper's encoder positions: a parameter with `requires_grad=False`, added to each sample."""

    def __init__(self):
        super().__init__()
        self.positions = nn.Parameter(torch.randn(5, 4), requires_grad=False)
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return (self.proj(x) + self.positions).pow(2).sum()


def frozen():
    torch.manual_seed(0)
    return Frozen(), (torch.randn(4, 5, 4),)


def test_a_frozen_parameter_is_a_constant_not_a_weight():
    module, inputs = frozen()
    imported = import_module(module, inputs)
    graph = imported.graph
    assert {leaf.name for leaf in graph.weights} == {"proj.weight", "proj.bias"}
    (constant,) = graph.constants
    assert torch.equal(imported.constants[constant], module.positions.double())


def sharded_ops(plan: dict) -> set[str]:
    """The operators a plan (its JSON form) runs on split tensors."""
    return {n["op"] for n in plan["nodes"] if n["kind"] == "op" and max(n["spread"]["shard"] or [1]) > 1}


DATA_PARALLEL = {"convolutions": {"conv2d_grouped", "conv1d", "pad", "bias_add"},
                 "position_bias": {"softmax", "add_bcast"}, "frozen": {"add_bcast"},
                 "experts": {"topk_onehot", "broadcast", "bmm"}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The four data-parallel plans and the expert-parallel one, each written to a plan file, read back as
    `parsat run` reads it (`load_plan`) and trained 3 steps on 2 gloo ranks against the unmodified module
    (float64, --check's tolerance for a module): ONE launch for all five (a launch is two fresh processes
    importing torch). label -> (plan dict, the PCG built here (None for data parallelism), RunResult)."""
    import json
    import sys

    from parsat.backend.cli import check_tolerance, load_plan
    from parsat.backend.executor import RunResult, TrainConfig, operator_library
    from parsat.backend.launch import LaunchConfig, launch
    from parsat.backend.parallelize import run_module_many
    from parsat.ir.data_parallel import data_parallel_pcg
    from parsat.ir.expert_parallel import expert_parallel_pcg
    from parsat.ir.machine import Machine
    from parsat.search.solve import price_pcg

    sys.path.insert(0, str(RULES.parent / "benchmarks"))
    import mesh_plans

    plans, built = {}, {}
    for factory in DATA_PARALLEL:
        module, inputs = globals()[factory]()
        graph = import_module(module, inputs).graph
        plans[factory] = (factory, mesh_plans.plan_dict(graph, data_parallel_pcg(graph, operator_library(), 2)))
    module, inputs = experts()
    graph = import_module(module, inputs).graph
    pcg = expert_parallel_pcg(graph, operator_library(), 2)
    assert pcg is not None
    costs = price_pcg(pcg, operator_library(), Machine.preset("cpu").with_devices(2), True, graph.microbatches)
    predicted = sum(c.comm_elements for c in costs.values())
    plans["expert_parallel"] = ("experts", mesh_plans.plan_dict(graph, pcg, predicted))
    built["expert_parallel"] = pcg
    jobs, read = [], {}
    for label, (factory, data) in plans.items():
        path = tmp_path_factory.mktemp("plans") / f"{label}.json"
        path.write_text(json.dumps(data), encoding="utf-8")
        read[label] = load_plan(str(path), 2)   # (pcg, graph, prediction), as `parsat run` reads the file
        jobs.append((label, read[label][0], read[label][1], f"{Path(__file__).resolve()}:{factory}"))
    config = TrainConfig(steps=3, dtype="float64", check=True, tolerance=check_tolerance("float64", "module"))
    reports = launch(run_module_many, (jobs, config), LaunchConfig(nproc=2, backend="gloo", timeout_s=600))
    return {label: (plans[label][1], built.get(label), RunResult.of_job([r[label] for r in reports], config,
                                                                      read[label][2]))
            for label in plans}


@pytest.mark.parametrize("factory", list(DATA_PARALLEL))
def test_the_new_operators_train_data_parallel_on_two_ranks_like_the_module(factory, trained):
    """Data parallelism (`data_parallel_pcg`) runs the new operators on batch-split tensors and holds the position
    bias's constant one-hot whole on each rank; trained 3 steps on 2 ranks, loss, gradients and weights equal the
    unmodified module's (`run_module_rank`, what `parsat run --check --model` runs on each rank, float64; the
    CLI's own path is tested in test_backend_parallelize)."""
    data, _pcg, result = trained[factory]
    assert DATA_PARALLEL[factory] <= sharded_ops(data), sharded_ops(data)
    assert result.check == "passed", (result.max_rel_diff, result.nonfinite, result.worst)


def test_the_optimizer_splits_the_batch_through_the_new_convolutions():
    """With data parallelism pinned, the batch inputs are read split: the grouped and 1-D convolutions that read
    them need rules that introduce batch parallelism, and a group count that saturation does not take for a
    mesh degree (the parallel rules alone, so that no algebraic rewrite moves them)."""
    import parsat

    module, inputs = convolutions()
    graph = import_module(module, inputs).graph
    rules = [str(RULES / "parallel.rule"), str(RULES / "parallel_layers.rule")]
    plan = parsat.optimize(graph, "cpu", rules=rules, devices=2, degrees={"dp": 2}, baselines=False)
    assert {"conv2d_grouped", "conv1d"} <= sharded_ops(plan.to_dict())


def test_imported_experts_train_expert_parallel_on_two_gloo_ranks_like_the_module(trained):
    """The imported experts (dispatch form) laid out expert-parallel (`ir.expert_parallel`: each expert's weights on
    one rank, the rows all-to-all'd to it and back around each bmm), trained 3 steps on 2 gloo ranks against the
    unmodified module (`run_module_rank`, float64); the elements sent equal the cost model's count."""
    _data, pcg, result = trained["expert_parallel"]
    weights = {n.id: n.op for n in pcg.nodes if n.kind == "leaf" and n.role == "weight"}
    stored = {weights[n.inputs[0]]: (n.op, dict(n.attrs).get("dim")) for n in pcg.nodes
              if n.kind == "parallel" and n.inputs[0] in weights}
    assert stored["up"] == stored["down"] == ("partition", 0)                  # split on the experts dim
    moves = sorted((dict(n.attrs)["dim"], dict(n.attrs)["to_dim"]) for n in pcg.nodes if n.op == "all_to_all")
    assert moves == [(0, 1), (0, 1), (1, 0), (1, 0)]                           # each bmm's dispatch and combine
    assert result.check == "passed", (result.max_rel_diff, result.nonfinite, result.worst)
    assert result.comm_elements_predicted > 0 and result.comm_matches, \
        (result.comm_elements_measured, result.comm_elements_predicted)        # what ran, predicted
