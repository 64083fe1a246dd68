"""The importer checks itself (issue 32): each imported graph is evaluated against the module in float64.

A correct import passes and leaves the module as it was; an operator
mapped onto the wrong library operator (patched in here, for the test
only) is refused before any plan is made, naming the graph node, the ATen
operator, the module path and the user's source line; meta tensors skip
the check (a constant causal mask is made again on the CPU to be seen); data written in place into a view (T5's decoder inputs: labels
copied into a slice of zeros, which the importer once fed as zeros) is fed
with its writes, and T5 imports exactly.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import parsat  # noqa: E402
from parsat.importer.aten import HANDLERS  # noqa: E402
from parsat.importer.errors import TorchImportError  # noqa: E402
from parsat.importer.export import import_module  # noqa: E402
from parsat.importer.torch_ops import evaluate_graph  # noqa: E402


class Mlp(nn.Module):
    """Two linear layers with a GELU between them, and their mean squared error against a target."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x, target):
        h = F.gelu(self.fc1(x))  # the operator the test mis-maps
        return ((self.fc2(h) - target) ** 2).mean()


def mlp():
    torch.manual_seed(0)
    return Mlp(), (torch.randn(4, 8), torch.randn(4, 4))


def marked_line() -> str:
    """`file:line` of this file's line that applies the GELU (where the importer must point)."""
    lines = Path(__file__).read_text(encoding="utf-8").splitlines()
    number = next(i for i, line in enumerate(lines, 1) if "# the operator the test mis-maps" in line)
    return f"{Path(__file__).resolve()}:{number}"


def test_a_correct_import_passes_and_leaves_the_module_as_it_was():
    module, inputs = mlp()
    before = copy.deepcopy(module.state_dict())
    graph = parsat.from_torch(module, inputs)
    assert {n.op for n in graph.nodes} >= {"gelu", "linear_t"} and "transpose" not in {n.op for n in graph.nodes}
    assert all(p.dtype == torch.float32 and p.grad is None for p in module.parameters())
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_a_mis_mapped_operator_is_refused_naming_its_node_and_source_line(monkeypatch):
    monkeypatch.setitem(HANDLERS, "gelu", lambda t, node, x, approximate="none": t.op("relu", t.tensor(x)))
    module, inputs = mlp()
    with pytest.raises(TorchImportError) as err:
        parsat.from_torch(module, inputs)
    message = str(err.value)
    assert "the imported graph does not compute what the module computes" in message
    assert "first value that differs: graph node 'gelu' (relu), made from aten.gelu.default" in message
    assert marked_line() in message and "Traceback" not in message
    assert parsat.from_torch(module, inputs, check=False) is not None  # the opt-out


def test_a_linear_that_reads_the_weight_untransposed_is_refused(monkeypatch):
    """torch's [out, in] weight read as if it were [in, out] (`linear` instead of `linear_t`, shapes agree on a
    square layer): the self-check catches the layout, not only the operator."""
    monkeypatch.setitem(HANDLERS, "linear", lambda t, node, x, w, b=None: t.op("linear", t.tensor(x), t.tensor(w),
                                                                                t.tensor(b)))
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    with pytest.raises(TorchImportError, match=r"does not compute what the module computes"):
        import_module(Squared(module), (torch.randn(3, 6),))


class Squared(nn.Module):
    """The mean square of a module's output: a loss to check an import by."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).pow(2).mean()


def test_a_wrong_subtraction_is_refused_at_its_node(monkeypatch):
    monkeypatch.setitem(HANDLERS, "sub", HANDLERS["add"])
    module, inputs = mlp()
    with pytest.raises(TorchImportError, match=r"graph node 'sub' \(add\), made from aten.sub.Tensor"):
        import_module(module, inputs)


def test_meta_tensors_skip_the_check():
    with torch.device("meta"):
        module = Mlp()
        inputs = (torch.empty(4, 8), torch.empty(4, 4))
    assert parsat.from_torch(module, inputs).outputs


def test_a_meta_import_sees_the_causal_mask_hugging_face_passes():
    """On meta tensors the mask HF's sdpa attention passes (built from positions) has no values: it is made again
    on the CPU, and the attention imports fused, as on real tensors (it raised NotImplementedError before)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      vocab_size=64, max_position_embeddings=16)
    with torch.device("meta"):
        module = LmLoss(transformers.LlamaForCausalLM(config))
        ids = torch.randint(0, 64, (2, 16))
    ops = {n.op for n in import_module(module, (ids, ids)).graph.nodes}
    assert "attention_causal" in ops and "softmax_masked" not in ops


class ShiftedIds(nn.Module):
    """Embeds its ids shifted right by one, made as T5 makes its decoder inputs: written into a slice of zeros."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()   # a copy_ into a view that no node reads
        shifted[:, 0] = 3
        return self.embed(shifted).pow(2).mean()


def test_data_written_in_place_into_a_view_is_fed_with_its_writes():
    torch.manual_seed(0)
    module = ShiftedIds()
    imported = import_module(module, (torch.randint(0, 16, (2, 5)),))   # the check passes
    batch = torch.randint(0, 16, (2, 5))
    (onehot,) = imported.data_values((batch,), torch.float64).values()
    shifted = torch.cat([torch.full((2, 1), 3), batch[:, :-1]], dim=1)
    assert torch.equal(onehot, F.one_hot(shifted, 16).double())


class LmLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels, use_cache=False).loss


def test_t5_imports_exactly():
    """The loss and every gradient of the imported T5 equal the module's: the check passes (float64 throughout),
    and against the unmodified float64 module to 1e-6 of each tensor's scale (T5's layer norm takes its
    variance in float32, which the module keeps)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                                   attn_implementation="eager")
    module = LmLoss(transformers.T5ForConditionalGeneration(config))
    inputs = (torch.randint(1, 256, (4, 16)), torch.randint(1, 256, (4, 16)))
    imported = import_module(module, inputs)
    reference = copy.deepcopy(module).double()
    weights = {p: reference.get_parameter(p).detach().clone().requires_grad_() for p in imported.weights.values()}
    leaves = {leaf: weights[p] for leaf, p in imported.weights.items()}
    leaves.update(imported.constant_values(torch.float64))
    leaves.update(imported.data_values(inputs, torch.float64))
    leaves.update({leaf.name: torch.full(leaf.shape, 1.0 - leaf.rate, dtype=torch.float64)
                   for leaf in imported.data.values() if leaf.encoding == "dropout"})
    reference.eval()   # masks of 1 - p: the graph's dropouts are the identity, as the module's in evaluation
    got = evaluate_graph(imported.graph, leaves)[imported.graph.outputs[0]]
    want = reference(*inputs)
    got.backward()
    want.backward()
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-6 * abs(float(want.detach()))
    assert len(weights) == len(list(reference.parameters()))
    for name, w in weights.items():
        expected = reference.get_parameter(name).grad
        assert float((w.grad - expected).abs().max()) <= 1e-6 * float(expected.abs().max()), name
