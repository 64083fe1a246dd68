"""`parsat.from_torch`: torch modules as parsat graphs (torch.export) that compute what the module computes.

Each imported graph is evaluated with the library's torch operators on the
module's own parameters and its data leaves (`ImportedModule.data_values`)
and compared with the module's forward; unsupported operators are listed
all at once with their source lines; `parsat optimize model.py:make_model`
optimizes a module from a file and `parsat run --check` trains the plan on
2 ranks.
"""

from __future__ import annotations

import json
import math
import textwrap

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import parsat  # noqa: E402
from parsat.backend.executor import evaluate_graph  # noqa: E402
from parsat.importer.errors import TorchImportError  # noqa: E402
from parsat.importer.export import import_module  # noqa: E402
from parsat.importer.model_file import load_model_file  # noqa: E402
from parsat.cli import main  # noqa: E402


class Block(nn.Module):
    """Post-LN encoder block of torch layers (nn.MultiheadAttention)."""

    def __init__(self, hidden=16, heads=2, ffn=32, batch_first=True):
        super().__init__()
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=batch_first)
        self.ln1 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, hidden)
        self.drop = nn.Dropout(0.0)
        self.ln2 = nn.LayerNorm(hidden)

    def forward(self, x):
        a, _ = self.attn(x, x, x)
        x = self.ln1(x + a)
        return self.ln2(x + self.drop(self.fc2(self.act(self.fc1(x)))))


class HandAttention(nn.Module):
    """Attention written out: view/permute/transpose/matmul/softmax/scaling, no bias on k."""

    def __init__(self, hidden=16, heads=4):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, d = x.shape
        dh = d // self.heads
        q = self.q(x).view(b, s, self.heads, dh).permute(0, 2, 1, 3)
        k = self.k(x).view(b, s, self.heads, dh).transpose(1, 2)
        v = self.v(x).reshape(b, s, self.heads, dh).transpose(1, 2)
        probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(dh), dim=-1)
        ctx = (probs @ v).transpose(1, 2).contiguous().view(b, s, d)
        return torch.relu(self.out(ctx)) + x


class Sdpa(nn.Module):
    """Attention through `F.scaled_dot_product_attention`: causal by flag, by the causal mask made from positions
    (as Hugging Face's `sdpa` attention passes it), under another constant mask, without a mask, or under a
    constant mask that keeps every key (Hugging Face BERT's without an attention mask)."""

    def __init__(self, mode: str, hidden=16, heads=4):
        super().__init__()
        self.mode, self.heads = mode, heads
        self.qkv = nn.Linear(hidden, 3 * hidden)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        sdpa = nn.functional.scaled_dot_product_attention
        if self.mode == "flag":
            ctx = sdpa(q, k, v, is_causal=True, scale=0.3)
        elif self.mode == "causal_mask":
            positions = torch.arange(s)
            ctx = sdpa(q, k, v, attn_mask=positions[None, :] <= positions[:, None])
        elif self.mode == "no_mask":
            ctx = sdpa(q, k, v, scale=0.3)
        elif self.mode == "full_mask":
            ctx = sdpa(q, k, v, attn_mask=torch.zeros(b, 1, s, s))
        elif self.mode == "input_mask":   # keeps every key too, but made from the inputs (as a padding mask is)
            ctx = sdpa(q, k, v, attn_mask=torch.zeros_like(x[:, None, :, :1]).expand(b, 1, s, s))
        else:   # keys t <= r + 1: not causal
            positions = torch.arange(s)
            ctx = sdpa(q, k, v, attn_mask=positions[None, :] <= positions[:, None] + 1)
        return ctx.transpose(1, 2).reshape(b, s, d).sum()


@pytest.mark.parametrize("mode,attention", [("flag", "attention_causal"), ("causal_mask", "attention_causal"),
                                            ("other_mask", "softmax_masked"), ("no_mask", "attention"),
                                            ("full_mask", "attention"), ("input_mask", "softmax_masked")])
def test_causal_sdpa_is_the_fused_operator(mode, attention):
    """A causal square SDPA, by flag or by the causal mask itself, imports as `attention_causal` (no mask input,
    no [b, h, s, s] scores); one without a mask, or under a constant mask keeping every key, as `attention`;
    any other mask, even one keeping every key when it is made from the inputs, stays written out with its mask
    a data leaf."""
    torch.manual_seed(0)
    want, got, graph = imported_output(Sdpa(mode), (torch.randn(2, 5, 16),))
    ops = {n.op for n in graph.nodes}
    assert attention in ops and (attention == "softmax_masked" or not ops & {"bmm", "softmax_masked", "softmax"})
    assert len([leaf for leaf in graph.leaves if leaf.role == "input"]) == (2 if attention == "softmax_masked" else 1)
    assert (got - want).abs().max() < 1e-10


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=1, padding=1, bias=False)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv(x)))
        x = torch.tanh(self.conv2(x))
        return self.head(torch.flatten(self.gap(x), 1)).softmax(dim=1)


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 5)

    def forward(self, ids):
        return nn.functional.gelu(self.proj(self.norm(self.emb(ids))))


def imported_output(module, inputs):
    """(the module's output, the imported graph's output on the same weights and data), in float64."""
    module = module.double().eval()
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    imported = import_module(module, inputs)
    graph = imported.graph
    leaves = {name: module.get_parameter(p).detach() for name, p in imported.weights.items()}
    leaves.update(imported.constant_values(torch.float64))
    leaves.update(imported.data_values(inputs, torch.float64))
    env = evaluate_graph(graph, leaves)
    with torch.no_grad():
        want = module(*inputs)
    return want, env[graph.outputs[0]], graph


@pytest.mark.parametrize("module,shape", [
    (Block(), (2, 6, 16)),
    (Block(batch_first=False), (6, 2, 16)),
    (HandAttention(), (2, 5, 16)),
    (Cnn(), (2, 3, 8, 8)),
])
def test_imported_graph_computes_the_module(module, shape):
    torch.manual_seed(0)
    want, got, _ = imported_output(module, (torch.randn(*shape),))
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-10


def test_embedding_ids_become_a_one_hot_input():
    torch.manual_seed(0)
    ids = torch.randint(0, 20, (3, 7))
    want, got, graph = imported_output(Tagger(), (ids,))
    assert graph.leaf("ids_onehot").shape == (3, 7, 20)
    assert (got - want).abs().max() < 1e-10


def test_weights_are_named_by_the_module_parameters():
    module = Block()
    graph = parsat.from_torch(module, torch.randn(2, 6, 16))
    names = {leaf.name for leaf in graph.weights}
    assert names == {name for name, _ in module.named_parameters()}
    shapes = {leaf.name: leaf.shape for leaf in graph.weights}
    assert shapes["fc1.weight"] == (32, 16)            # the module's own [out, in] layout, read by torch's F.linear
    assert shapes["attn.in_proj_weight"] == (48, 16)
    assert shapes["ln1.weight"] == (16,)
    assert any(n.op in ("linear_t", "linear_nobias_t") and n.inputs[1] == "fc1.weight" for n in graph.nodes)
    assert not any(n.op == "transpose" and n.inputs == ("fc1.weight",) for n in graph.nodes)


class WithUnsupported(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveMaxPool2d(2))

    def forward(self, x):
        return self.body(x)


class ManyUnsupported(nn.Module):
    """Three operators parsat does not map, in three places: all are reported in one error."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.Hardswish()

    def forward(self, x):
        h = self.fc(x)
        a = torch.cumsum(h, dim=1)          # not mapped
        b = self.act(h)                     # not mapped
        c = torch.floor_divide(h, 2.0)      # not mapped
        return (a + b + c + torch.relu(h)).sum()


def test_unsupported_operator_is_named_with_its_place():
    with pytest.raises(TorchImportError) as err:
        parsat.from_torch(WithUnsupported(), torch.randn(1, 3, 8, 8))
    assert "adaptive_max_pool2d" in str(err.value) and "body.1" in str(err.value)


def test_every_unsupported_operator_is_listed_at_once_with_its_source_line():
    with pytest.raises(TorchImportError) as err:
        parsat.from_torch(ManyUnsupported(), torch.randn(2, 4))
    text = str(err.value)
    assert "3 operator(s) parsat cannot import" in text
    for op, code in (("cumsum", "torch.cumsum(h, dim=1)"), ("hardswish", "self.act(h)"),
                     ("floor_divide", "torch.floor_divide(h, 2.0)")):
        assert op in text and code in text
    assert "test_backend_fx.py" in text and "module 'act'" in text and "Traceback" not in text


MODEL_FILE = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden=64, heads=4, ffn=256):
        super().__init__()
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln1 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.ln2 = nn.LayerNorm(hidden)

    def forward(self, x):
        a, _ = self.attn(x, x, x)
        x = self.ln1(x + a)
        return self.ln2(x + self.fc2(nn.functional.gelu(self.fc1(x))))


def make_model():
    return Block(), torch.randn(4, 32, 64)
'''


def test_load_model_file_errors(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(MODEL_FILE), encoding="utf-8")
    assert load_model_file(f"{path}:make_model").leaf("x").shape == (4, 32, 64)
    for spec, message in ((f"{path}:nothing", "no function 'nothing'"), (f"{tmp_path}/no.py:f", "is not a file"),
                          (str(path), "like model.py:make_model")):
        with pytest.raises(TorchImportError, match=message):
            load_model_file(spec)


def test_torch_block_optimized_and_run_with_check(tmp_path, capsys):
    """A torch nn.Module transformer block: `parsat optimize model.py:make_model`, then `parsat run --check`."""
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent(MODEL_FILE), encoding="utf-8")
    plan = tmp_path / "plan.json"
    assert main(["optimize", f"{model}:make_model", "--devices", "2", "--machine", "cpu", "-q", "--no-baselines",
                 "-o", str(plan)]) == 0
    data = json.loads(plan.read_text())
    assert {w["name"] for w in data["graph"]["weights"]} >= {"attn.in_proj_weight", "fc1.weight", "ln2.bias"}
    capsys.readouterr()
    assert main(["run", str(plan), "--nproc", "2", "--check", "--json", "--model", f"{model}:make_model"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["check"] == "passed" and result["comm_matches"] is True
    assert result["comm_elements_measured"] > 0  # the plan really splits the block


def test_optimize_reports_an_unsupported_module_without_a_trace(tmp_path, capsys):
    model = tmp_path / "bad.py"
    model.write_text("import torch\n\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(4, 4), "
                     "torch.nn.Hardswish()), torch.randn(2, 4)\n", encoding="utf-8")
    assert main(["optimize", f"{model}:make", "--devices", "2", "-q"]) == 1
    err = capsys.readouterr().err
    assert "hardswish" in err and "'1'" in err and "Traceback" not in err
