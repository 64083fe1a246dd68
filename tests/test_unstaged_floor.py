"""The weights' state floor (`optimize.state_floor`): where the weights' state alone cannot fit, no search runs
(no unstaged count, no pipeline pair); just under it the search runs as before, and every plan it finds holds at
least the floor."""

from __future__ import annotations

from dataclasses import replace

import pytest

import parsat.search.microbatches as microbatches
import parsat.search.optimize as optimize_module
from parsat.api import optimize
from parsat.ir.errors import DoesNotFit
from parsat.search.request import resolve_request

# a LLaMA of 5 alike blocks (searched as 3, the middle one repeated), small enough to search in seconds
SIZES = dict(blocks=5, hidden=64, heads=8, kv_heads=2, batch=8, seq=16, vocab=128)
LEAST_ACTIVATIONS = 8   # micro-batches: one sample each


def _floor(machine: str = "h100x8") -> tuple[int, object]:
    request = resolve_request("llama", machine, None, None, 4, sizes=SIZES)
    return optimize_module.state_floor(request), request.machine


def _counting_steps(monkeypatch) -> list[int]:
    """The micro-batch counts whose step is searched, in order: unstaged counts and pipeline pairs' stage steps."""
    real, counts = microbatches.search_step, []

    def search_step(step, clock):
        counts.append(step.graph.microbatches)
        return real(step, clock)

    monkeypatch.setattr(microbatches, "search_step", search_step)
    monkeypatch.setattr(optimize_module, "search_step", search_step)
    return counts


# the count holding the fewest activations each case can split (dp 4 needs 4 samples a micro-batch); on the CPU box
# the pipeline searched too (a pipelined plan's most loaded stage holds at least the floor: `state_floor`)
@pytest.mark.parametrize("machine, degrees, count, pipeline", [("cpu", None, None, True),
                                                               ("h100x8", {"dp": 4, "zero": 3}, 2, False)])
def test_every_plan_and_baseline_holds_at_least_the_floor(machine, degrees, count, pipeline):
    """The floor bounds every figure a step judges fit by, on a CPU box (SGD, `PARSAT_RUN`), where the plan is
    pipelined, and on a GPU (Adam, `DDP`) where every weight is stored split over every device (ZeRO-3, the
    least state a plan can hold; the free search on a GPU is `test_at_the_floor_...`'s): the plan's and every
    baseline's memory, simulated or by the per-node bound."""
    floor, _machine = _floor(machine)
    plan = optimize("llama", machine=machine, devices=4, sizes=SIZES, pipeline=pipeline, degrees=degrees,
                    microbatches=count)
    assert (plan.pipeline is not None) == pipeline
    figures = [plan.totals.memory_bytes, plan.totals.peak_memory_bytes]
    figures += [t.memory_bytes for t in plan.baselines.values() if t is not None]
    figures += [t.peak_memory_bytes for t in plan.baselines.values() if t is not None]
    assert len(figures) > 2 and min(figures) >= floor


@pytest.mark.parametrize("pipeline", [False, True])
def test_just_over_the_floor_nothing_is_searched(monkeypatch, pipeline):
    """Refused before any search, unstaged or pipelined (`pipeline=True`: every pair the pipeline search would
    try: the floor bounds every stage's plan too)."""
    floor, machine = _floor()
    tight = replace(machine, memory_capacity=floor - 1)
    counts = _counting_steps(monkeypatch)
    with pytest.raises(DoesNotFit, match="weights' training state alone") as refused:
        optimize("llama", machine=tight, devices=4, sizes=SIZES, pipeline=pipeline)
    assert counts == [] and refused.value.needed_bytes == floor
    # that the search itself finds no plan there is `test_at_the_floor_...`'s first half: none fits at the floor,
    # so none at a byte less


def test_at_the_floor_the_counts_are_searched_and_near_it_a_plan_fits(monkeypatch):
    """At the floor itself nothing is refused unsearched (the search finds no plan there, by its own figure, even
    at the count holding the fewest activations: one sample a micro-batch); a tenth above it, the search finds
    a plan at that count: the floor is not far below what a plan can hold."""
    floor, machine = _floor()
    counts = _counting_steps(monkeypatch)
    with pytest.raises(DoesNotFit, match="the smallest plan found needs") as found:
        optimize("llama", machine=replace(machine, memory_capacity=floor), devices=4, sizes=SIZES, pipeline=False,
                 microbatches=LEAST_ACTIVATIONS)
    assert counts and found.value.needed_bytes > floor
    roomier = replace(machine, memory_capacity=int(floor * 1.1))
    plan = optimize("llama", machine=roomier, devices=4, sizes=SIZES, pipeline=False, microbatches=LEAST_ACTIVATIONS)
    figures = [plan.totals.memory_bytes, plan.totals.peak_memory_bytes]
    figures += [t.memory_bytes for t in plan.baselines.values() if t is not None]
    assert floor <= min(figures) and plan.totals.memory_bytes <= roomier.memory_capacity
