"""Repeated blocks by structure (`ir.block_layout`): an imported stack's identical blocks are found and named as the
built-in examples name theirs (`b{i}_...`), so it gets the repeated-block search; a graph without such a stack,
or whose named blocks are not alike, is left alone."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from parsat.dsl.library import load_library
from parsat.ir.block_layout import block_names, named_layout, searched_blocks
from parsat.ir.blocks import block_of
from parsat.ir.models import build_example

LIBRARY = load_library()[0]
SMALL = {"batch": 4, "seq": 8, "hidden": 16, "heads": 2, "vocab": 32}


@pytest.mark.parametrize("name", ["gpt", "llama", "bert", "stack"])
def test_a_built_in_example_cut_to_three_blocks_is_the_example_built_with_three(name):
    """One way to search three blocks of any stack: the whole graph cut (what an import gets) is, for a built-in
    example, exactly the example built with three blocks (what the search saturated before)."""
    sizes = {key: value for key, value in SMALL.items() if key != "vocab" or name != "stack"}
    whole = build_example(name, {**sizes, "blocks": 6}, LIBRARY)
    layout = named_layout(whole)
    assert layout is not None and layout.count == 6
    assert searched_blocks(whole, layout.count, 3) == build_example(name, {**sizes, "blocks": 3}, LIBRARY)
    assert block_names(whole) == {}      # already named: left as it is


def test_named_blocks_that_are_not_alike_are_not_a_layout():
    """Names are not enough: a block whose operators differ from the others' has no layout (never repeated)."""
    from parsat.search.repeat import repetition_for

    whole = build_example("gpt", {**SMALL, "blocks": 5}, LIBRARY)
    assert repetition_for(whole) is not None
    nodes = tuple(replace(n, op="gelu") if n.name == "b2_ffn_act" else n for n in whole.nodes)
    assert named_layout(replace(whole, nodes=nodes)) is None and repetition_for(replace(whole, nodes=nodes)) is None


def test_branches_side_by_side_are_not_blocks():
    """Two alike branches of one layer (both read the input, a concat joins them) are not a stack."""
    assert block_names(build_example("branches", {}, LIBRARY)) == {}


# ------------------------------------------------------------------ imported modules

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from parsat.importer.export import import_module  # noqa: E402


class Layer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Stack(nn.Module):
    """`depth` identical layers in a ModuleList (named layers.0, layers.1, ...) and a head: a loss."""

    def __init__(self, depth: int = 4, width: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(Layer(width) for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return ((self.head(x) - y) ** 2).mean()


class Widening(nn.Module):
    """Layers of alike operators whose widths differ: no two blocks are alike."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(w, w + 2) for w in (8, 10, 12, 14))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return (x * x).mean()


def _stack(depth: int = 4):
    torch.manual_seed(0)
    return Stack(depth).double(), (torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64))


def test_an_imported_stack_is_named_by_its_blocks():
    """The layers are found by structure and named `b{i}_`; the module's parameter names stay in `weights`, the
    self-check passed on the renamed graph."""
    module, inputs = _stack()
    imported = import_module(module, inputs)
    graph = imported.graph
    layout = named_layout(graph)
    assert layout is not None and layout.count == 4
    assert imported.weights["b2_layers.#.fc.weight"] == "layers.2.fc.weight"
    assert {imported.weights[leaf.name] for leaf in graph.weights} == {n for n, _ in module.named_parameters()}
    assert {block_of(leaf.name) for leaf in graph.weights} == {-1, 0, 1, 2, 3}
    assert [leaf.name for leaf in graph.weights if block_of(leaf.name) == -1] == ["head.weight", "head.bias"]


class ConvLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return x + torch.relu(self.bn(self.conv(x)))


def test_a_stack_with_batch_norms_keeps_its_running_statistics():
    """Training-mode batch norms in each block: the batch statistics the backend reads are the renamed nodes, the
    running statistics still the module's buffers."""
    module = nn.Sequential(*(ConvLayer() for _ in range(4)), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).double()
    imported = import_module(module, (torch.randn(2, 4, 6, 6, dtype=torch.float64),))
    assert named_layout(imported.graph).count == 4
    nodes = {n.name for n in imported.graph.nodes}
    assert [(block_of(s.mean), s.running_mean) for s in imported.running_stats] == \
        [(b, f"{b}.bn.running_mean") for b in range(4)]
    assert all(s.mean in nodes and s.var in nodes for s in imported.running_stats)


def test_an_imported_module_without_a_stack_is_left_alone():
    """One layer, or layers that are not alike: every name is the module's own."""
    for module, inputs in ((Layer(8).double(), (torch.randn(4, 8, dtype=torch.float64),)),
                           (Widening().double(), (torch.randn(4, 8, dtype=torch.float64),))):
        imported = import_module(module, inputs)
        assert {leaf.name for leaf in imported.graph.weights} == {n for n, _ in module.named_parameters()}
        assert all(block_of(n.name) == -1 for n in imported.graph.nodes)


def test_an_imported_stack_gets_the_repeated_block_search_and_trains_like_one_process():
    """Four imported layers are searched as three, the middle one's plan repeated: the plan reads every weight of
    the import, and trains on 2 ranks like one process."""
    import parsat
    from parsat.backend.executor import TrainConfig, run_plan

    module, inputs = _stack()
    graph = import_module(module, inputs).graph
    plan = parsat.optimize(graph, "cpu", devices=2, limits={"iterations": 4}, baselines=False)
    assert plan.saturation["repeated_blocks"]["blocks"] == 4
    assert {n.op for n in plan.pcg.nodes if n.kind == "leaf"} == {leaf.name for leaf in graph.leaves}
    result = run_plan(plan.pcg, 2, TrainConfig(steps=2, check=True, dtype="float64"), graph=graph, backend="gloo")
    assert result.check == "passed"


def test_parallelize_keeps_the_modules_parameter_names():
    """A renamed import runs under `parallelize` with the module's own names: its pieces, and `gather_weights`."""
    import torch.distributed as dist

    import parsat
    from parsat.backend.executor import operator_library
    from parsat.ir.costs import Totals
    from parsat.ir.machine import Machine
    from parsat.ir.plan import Plan

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import mesh_plans

    module, inputs = _stack()
    imported = import_module(module, inputs)
    pcg = mesh_plans.redundant_pcg(imported.graph, operator_library(), 1)
    plan = Plan(imported.graph, Machine.preset("cpu").with_devices(1), 1, pcg, {}, Totals(0.0, 0, 0, 0, 0, 0.0, 0.0))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pmodule = parsat.parallelize(module, plan, imported=imported)
        assert set(pmodule.named_pieces()) == {n for n, _ in module.named_parameters()}
        pmodule(*inputs).backward()
        with torch.no_grad():
            for piece in pmodule.parameters():
                piece -= 0.1 * piece.grad
        state = parsat.gather_weights(pmodule)
        assert torch.equal(state["layers.2.fc.weight"], pmodule.named_pieces()["layers.2.fc.weight"].detach())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_hugging_face_llama_has_its_layers_found():
    """LlamaForCausalLM (rotary tables read by each layer, grouped-query attention, RMSNorm) of 4 layers."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 16))

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(input_ids=x, labels=x, use_cache=False).loss

    imported = import_module(Loss(), (ids,))
    layout = named_layout(imported.graph)
    assert layout is not None and layout.count == 4
    assert imported.weights["b3_model.model.layers.#.mlp.up_proj.weight"] == "model.model.layers.3.mlp.up_proj.weight"
