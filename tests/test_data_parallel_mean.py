"""The textbook data-parallel PCG of a `.mean()` loss over the split batch (issue 32).

`mean` divides by its dim's size, which a piece of a split dim does not
know, so the placement analysis refuses it on a split dim; the builder
writes it as each rank's sum of its rows, scaled by one over the global
count, and all-reduced: the global mean exactly. An operator that is not
exact over a split batch (softmax across the batch) is still refused, with
the operator and the reason.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import parsat  # noqa: E402
from parsat.backend.executor import TrainConfig, operator_library, run_plan  # noqa: E402
from parsat.ir.data_parallel import data_parallel_pcg, data_parallel_refusal  # noqa: E402
from parsat.ir.placement import PARTIAL  # noqa: E402


class MeanSquaredError(nn.Module):
    """A regression loss as users write it: `((f(x) - y) ** 2).mean()`, a mean over every dim, batch included."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, y):
        return ((self.fc(x) - y) ** 2).mean()


class SoftmaxOverBatch(nn.Module):
    """A softmax across the batch: every row's value depends on the others' through a divisor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return (torch.softmax(self.fc(x), 0) * self.fc(x)).sum()


def _mean_loss_graph(batch: int = 8):
    torch.manual_seed(0)
    return parsat.from_torch(MeanSquaredError(), (torch.randn(batch, 8), torch.randn(batch, 4)))


@pytest.mark.parametrize("devices", [2, 4])
def test_a_mean_loss_over_the_split_batch_is_a_sum_of_rows_scaled_by_the_global_count(devices):
    graph = _mean_loss_graph()
    pcg = data_parallel_pcg(graph, operator_library(), devices)
    assert pcg is not None, data_parallel_refusal(graph, operator_library(), devices)
    output = pcg.node(pcg.outputs[0])
    assert output.kind == "parallel" and output.op == "reduce"          # the partial means summed once
    scaled = pcg.node(output.inputs[0])
    total = pcg.node(scaled.inputs[0])
    assert (scaled.op, dict(scaled.attrs)["c"]) == ("scale", 1.0 / 8)    # the global batch, not a rank's 8 / devices
    assert total.op == "reduce_sum" and dict(total.attrs)["dim"] == 0
    assert scaled.placement.codes[0] == PARTIAL and total.placement.codes[0] == PARTIAL
    assert pcg.node(total.inputs[0]).degrees.shard[0] == devices        # each rank sums only its own rows
    assert data_parallel_refusal(graph, operator_library(), devices) is None


def test_an_operator_not_exact_over_the_split_batch_is_refused_naming_it_and_why():
    graph = parsat.from_torch(SoftmaxOverBatch(), (torch.randn(8, 8),))
    assert data_parallel_pcg(graph, operator_library(), 2) is None
    why = data_parallel_refusal(graph, operator_library(), 2)
    assert why.startswith("operator 'softmax' (softmax) does not accept its inputs split along the batch")
    assert "partial sum" in why


@pytest.mark.slow
def test_a_mean_loss_trains_data_parallel_equal_to_the_whole_batch_on_2_ranks():
    graph = _mean_loss_graph()
    result = run_plan(data_parallel_pcg(graph, operator_library(), 2), 2, TrainConfig(steps=2, check=True),
                      graph=graph)
    assert result.check == "passed", result
