"""One call builds each built-in example once per size: its steps' graphs (`search.request.step_context`) and the
grids' batch dims (`ir.microbatch.batch_dims`, through `ir.megatron._Kin`) read one memo (`SearchRequest.examples`);
a graph taken from it is the graph built afresh, and a budget still refuses it."""

from __future__ import annotations

import pytest

import parsat.ir.microbatch as microbatch
from parsat.ir.budget import GraphBudget
from parsat.ir.errors import GraphError
from parsat.ir.megatron import _Kin
from parsat.ir.microbatch import batch_dims
from parsat.ir.models import build_example
from parsat.search.request import resolve_request, step_context

SIZES = {"blocks": 2, "batch": 8, "seq": 16, "hidden": 32, "heads": 4, "vocab": 64}


@pytest.fixture
def builds(monkeypatch):
    """The sizes of every example built (each `build_example` call), in order."""
    made: list[dict] = []
    real = microbatch.build_example
    monkeypatch.setattr(microbatch, "build_example", lambda name, sizes=None, library=None, budget=None:
                        made.append(dict(sizes or {})) or real(name, sizes, library, budget))
    return made


def test_steps_and_batch_dims_share_one_build_per_size(builds):
    request = resolve_request("llama", "cpu", None, None, 2, sizes=SIZES)
    assert builds == [SIZES]
    first, again = step_context(request, 2).graph, step_context(request, 2, devices=1).graph
    assert first == again
    assert builds == [SIZES, {**SIZES, "batch": 4}]            # the second step took the first's build
    kin = _Kin.of(request.layouts, request.library)
    assert kin.examples is request.examples
    dims = batch_dims(first, request.library, kin.examples)
    # the graph's own build and the whole batch's (its double) were both made before: nothing built
    assert builds == [SIZES, {**SIZES, "batch": 4}]
    assert dims == batch_dims(first, request.library)            # as worked out alone


def test_a_kept_build_is_the_build_made_afresh():
    kept: dict = {}
    taken = microbatch.built_example("llama", SIZES, None, kept)
    assert microbatch.built_example("llama", dict(SIZES), None, kept) is taken
    assert taken == build_example("llama", SIZES)


def test_a_budget_refuses_a_kept_build_too():
    kept: dict = {}
    graph = microbatch.built_example("llama", SIZES, None, kept)
    small = GraphBudget(tensors=len(graph.nodes) // 2)
    with pytest.raises(GraphError):
        microbatch.built_example("llama", SIZES, None, kept, small)
