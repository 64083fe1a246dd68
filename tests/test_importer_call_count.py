"""`importer.call_count`: the calls a module makes eagerly beyond the graph imported from it (`ir.module_calls`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import sys  # noqa: E402

from parsat.importer.call_count import count_module_calls, count_python_instructions  # noqa: E402
from parsat.importer.export import import_module  # noqa: E402


class _Viewing(nn.Module):
    """A linear layer, `views` shape-preserving views (the importer folds them), a batch norm in training mode
    and a dropout: the two that would change the module or the random stream if the count left a trace."""

    def __init__(self, views: int):
        super().__init__()
        self.lin, self.bn, self.drop, self.views = nn.Linear(4, 4), nn.BatchNorm2d(4), nn.Dropout(0.5), views

    def forward(self, x):
        y = self.lin(x)
        for _ in range(self.views):
            y = y.view(y.shape)
        return self.drop(self.bn(torch.relu(y).view(2, 4, 4, 1))).sum()


def test_folded_views_are_counted_as_calls_and_autograd_nodes_and_the_module_is_left_as_found():
    counts = {}
    for views in (0, 3):
        torch.manual_seed(0)
        module, x = _Viewing(views), torch.randn(8, 4)
        graph = import_module(module, (x,), check=False).graph
        running, generator = module.bn.running_mean.clone(), torch.get_rng_state()
        counts[views] = count_module_calls(module, x, graph)
        assert torch.equal(module.bn.running_mean, running) and torch.equal(torch.get_rng_state(), generator)
        assert counts[views].graph_nodes == len(graph.nodes)
    assert counts[3].graph_nodes == counts[0].graph_nodes   # the graph folds the views away ...
    assert counts[3].forward_calls == counts[0].forward_calls + 3   # ... the module dispatches each
    assert counts[3].backward_nodes == counts[0].backward_nodes + 3   # and autograd records each
    assert counts[3].extra_forward(counts[3].graph_nodes) == counts[0].extra_forward(counts[0].graph_nodes) + 3


class _Scaled(nn.Module):
    """A module that holds a parameter itself, with `views` views after its product: the torch-native runtime
    computes it on DTensors under a tensor axis."""

    def __init__(self, views: int):
        super().__init__()
        self.w, self.views = nn.Parameter(torch.randn(4)), views

    def forward(self, x):
        y = x * self.w
        for _ in range(self.views):
            y = y.view(y.shape)
        return y


class _Outer(nn.Module):
    """`_Scaled` inside a module holding no parameter itself, and `views` views of its own after it."""

    def __init__(self, inner: int, views: int):
        super().__init__()
        self.inner, self.views = _Scaled(inner), views

    def forward(self, x):
        y = self.inner(torch.relu(x))
        for _ in range(self.views):
            y = y.view(y.shape)
        return y.sum()


def test_calls_inside_a_module_holding_parameters_are_counted_as_dtensor_calls_forward_and_backward():
    """Only the calls made inside a module that holds parameters (and, in backward, the calls of the autograd
    nodes its forward made) are the ones a tensor axis runs on DTensors; the outer module's own views are plain
    calls; counting runs a backward but leaves every `.grad` as it was."""
    counts = {}
    for inner, outer in ((0, 0), (3, 0), (0, 3)):
        torch.manual_seed(0)
        module, x = _Outer(inner, outer), torch.randn(8, 4)
        graph = import_module(module, (x,), check=False).graph
        counts[inner, outer] = count_module_calls(module, x, graph)
        assert all(p.grad is None for p in module.parameters())
    base = counts[0, 0]
    assert base.dtensor_forward >= 1 and base.dtensor_backward >= 1   # the product and its weight's gradient
    assert counts[3, 0].dtensor_forward == base.dtensor_forward + 3
    assert counts[3, 0].dtensor_backward == base.dtensor_backward + 3
    assert counts[0, 3].forward_calls == base.forward_calls + 3
    assert (counts[0, 3].dtensor_forward, counts[0, 3].dtensor_backward) == (base.dtensor_forward,
                                                                              base.dtensor_backward)


class _Branching(nn.Module):
    """A linear layer after `reads` rounds of Python that makes no ATen call (a config read and a branch each, as
    a Hugging Face module runs between its calls)."""

    def __init__(self, reads: int):
        super().__init__()
        self.lin, self.reads, self.flags = nn.Linear(4, 4), reads, {"use_cache": False}

    def forward(self, x):
        for _ in range(self.reads):
            if self.flags.get("use_cache"):
                x = x * 2
        return self.lin(x).sum()


def test_the_forward_s_own_python_is_counted_in_bytecode_instructions_the_same_every_time():
    """`python_forward`: the instructions the forward's own Python executes, which no ATen call counts; the same
    count on every call (a measure of work, not of time), and a tracer already set is put back."""
    counts = {}
    for reads in (0, 50):
        module, x = _Branching(reads), torch.randn(2, 4)
        graph = import_module(module, (x,), check=False).graph
        counts[reads] = count_module_calls(module, x, graph)
        assert counts[reads] == count_module_calls(module, x, graph)
    assert counts[50].forward_calls == counts[0].forward_calls   # no ATen call more ...
    assert counts[50].python_forward >= counts[0].python_forward + 50 * 5   # ... but 50 rounds of Python
    assert counts[0].python_forward > 0   # nn.Module.__call__ and forward themselves

    def mine(frame, event, arg):
        return None

    sys.settrace(mine)
    try:
        assert count_python_instructions(lambda: sum(range(3))) > 0
        assert sys.gettrace() is mine
    finally:
        sys.settrace(None)
