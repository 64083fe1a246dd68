"""Fused patterns and shared data in an import (issue 32, build item 4: the imported Llama-2-7B's graph as lean as
the built-in's).

An RMS normalization written in torch's pieces (HF's `LlamaRMSNorm`, Gemma's
`1 + weight` gain) imports as one `rmsnorm`, exactly (the import's float64
self-check runs in every test here); a look-alike that is not one (a mean
over another dim, a normalized value read elsewhere too) stays in pieces.
A data value read through views in every layer (HF LLaMA's rotary tables,
unsqueezed per layer) is one leaf, each of its reshapes made once for all
readers, fed right from each batch when it depends on the inputs.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from parsat.importer.export import import_module  # noqa: E402


class Norm(nn.Module):
    """`gain * (x * rsqrt(mean(x^2, dim) + eps))` as HF writes it (float32 casts included); `gemma`: gain 1 + w."""

    def __init__(self, n: int, dim: int = -1, gemma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.dim, self.gemma = dim, gemma

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(self.dim, keepdim=True) + 1e-6)
        gain = 1.0 + self.weight if self.gemma else self.weight
        return gain * h.to(x.dtype)


class NormNet(nn.Module):
    """A linear layer, a norm, a linear layer and a squared loss; `leak` also reads the normalized value."""

    def __init__(self, norm: Norm, leak: bool = False):
        super().__init__()
        self.fc1, self.norm, self.fc2, self.leak = nn.Linear(6, 8), norm, nn.Linear(8, 3), leak
        if leak:
            self.norm.forward = self._leaky_norm

    def _leaky_norm(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.norm.weight * h + h

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x))).pow(2).mean()


def ops_of(module, *inputs) -> list[str]:
    torch.manual_seed(0)
    return [n.op for n in import_module(module, inputs).graph.nodes]


def test_an_rms_normalization_in_pieces_imports_as_rmsnorm():
    torch.manual_seed(0)
    ops = ops_of(NormNet(Norm(8)), torch.randn(4, 5, 6))
    assert ops.count("rmsnorm") == 1
    assert not {"rsqrt", "add_scalar", "mul_bcast_dim"} & set(ops)


def test_a_gain_computed_from_the_weight_is_the_rmsnorm_gain():
    torch.manual_seed(0)
    ops = ops_of(NormNet(Norm(8, gemma=True)), torch.randn(4, 6))
    assert ops.count("rmsnorm") == 1 and "rsqrt" not in ops


@pytest.mark.parametrize("case", ["mean over another dim", "normalized value read twice"])
def test_what_is_not_an_rms_normalization_stays_in_pieces(case):
    torch.manual_seed(0)
    module = NormNet(Norm(8, dim=0)) if case == "mean over another dim" else NormNet(Norm(8), leak=True)
    ops = ops_of(module, torch.randn(8, 6))
    assert "rmsnorm" not in ops and "rsqrt" in ops


class Rotary(nn.Module):
    """`layers` layers, each multiplying by the same tables unsqueezed again (as HF LLaMA's rotary tables are read)."""

    def __init__(self, layers: int):
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))
        self.register_buffer("freq", torch.arange(8, dtype=torch.float32) / 8)

    def forward(self, x, pos):
        table = torch.cos(pos.to(torch.float32)[:, :, None] * self.freq)      # [b, s, 8], from the inputs
        fixed = torch.sin(torch.arange(x.shape[2], dtype=torch.float32)[:, None] * self.freq)[None]   # [1, s, 8]
        for fc in self.fc:
            h = fc(x)                                                     # [b, heads, s, 8]
            x = h * table.unsqueeze(1) + fixed.unsqueeze(1) * h
        return x.pow(2).mean()


@pytest.mark.parametrize("layers", [2, 4])
def test_a_table_read_through_views_in_every_layer_is_one_leaf(layers):
    torch.manual_seed(0)
    pos = torch.arange(5).expand(3, 5)
    imported = import_module(Rotary(layers), (torch.randn(3, 2, 5, 8), pos))
    graph = imported.graph
    data = [leaf for leaf in graph.leaves if leaf.name in imported.data and leaf.name != "x"]
    assert len(data) == 2                                       # the varying table and the fixed one, once each
    reshapes = [n for n in graph.nodes if n.op in ("flatten", "unflatten")]
    # made once for every layer: [3, 1, 5, 8] -> [3, 5, 8] (one flatten), [1, 1, 5, 8] -> [5, 8] (two)
    assert len(reshapes) == 3
    other = (torch.randn(3, 2, 5, 8), torch.arange(5).expand(3, 5) + 2)
    values = imported.data_values(other, torch.float64)        # fed from another batch's positions
    varying = next(leaf for leaf in data if leaf.name not in graph.constants)
    want = torch.cos((torch.arange(5) + 2).to(torch.float64)[None, :, None] * Rotary(1).freq.double())
    torch.testing.assert_close(values[varying.name], want.expand(3, 5, 8).reshape(varying.shape))
