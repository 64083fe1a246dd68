"""What a step says the leanest plan needs when nothing fits: like compared with like (issue 28).

An unstaged candidate's memory is its simulated peak once simulated, else extraction's per-node bound, and the
two are not comparable (the bound is neither below nor above the peak). A candidate whose bound is over the
device's memory is never simulated, so `mesh.rank` ranking the two figures together made an unsimulated grid
point's bound "the smallest plan" beside plans that simulate higher (llama-70b:64 at one micro-batch: 83.65
GiB said, the leanest plan simulated 116.42 GiB). Now simulated peaks rank first (`search.fit.MemoryFit.leanness`), and what the
step says, DoesNotFit's figure, is the simulated peak of the leanest candidate simulated."""

from __future__ import annotations

import dataclasses

import pytest

import parsat
from parsat.ir.costs import SimulatedStep, StepStreams, StepTimeline, Totals
from parsat.ir.errors import DoesNotFit
from parsat.ir.machine import Machine
from parsat.ir.models import build_example
from parsat.search.baselines import Candidate
from parsat.search.fit import MemoryFit
from parsat.search.mesh import best, rank

MIB = 2 ** 20


def _candidate(name: str, bound: int, simulated: int | None = None, time_s: float = 1.0) -> Candidate:
    totals = Totals(time_s, 0, 0, bound, 0, time_s, 0.0)
    if simulated is not None:
        streams = StepStreams(time_s, time_s, 0.0, 0.0, 0.0)
        totals = totals.simulated(SimulatedStep.known(streams, StepTimeline("ddp", 1, simulated, (), ())))
    return Candidate(name, None, {}, totals)


def _memory(capacity: int) -> MemoryFit:
    return MemoryFit(dataclasses.replace(Machine.preset("cpu"), memory_capacity=capacity), None, 1)


def test_a_simulated_peak_ranks_before_a_bound_it_cannot_be_compared_with():
    """Nothing fits in 100 bytes. `simulated`'s per-node bound (105) exceeds its simulated peak (103), as
    sc21-1.7b's does (27.32 against 25.59 GiB); `unsimulated`'s bound (102, over the device, so never
    simulated) lies between. Before, the smallest figure won: the unsimulated bound, a figure of another kind
    whose own simulated peak is unknown (it may be higher: llama-70b's were 1.7-2.7x)."""
    memory = _memory(100)
    simulated = _candidate("best_grid", bound=105, simulated=103)
    unsimulated = _candidate("data_parallel", bound=102)
    assert not memory.fits(simulated) and not memory.fits(unsimulated)
    assert memory.leanness(simulated) == (0, 103) and memory.leanness(unsimulated) == (2, 102)
    assert best([unsimulated, simulated], memory) is simulated
    assert best([simulated, unsimulated], memory) is simulated
    # among simulated candidates the simulated peaks decide, among unsimulated ones the bounds
    leaner = _candidate("megatron", bound=140, simulated=101)
    assert best([simulated, leaner, unsimulated], memory) is leaner
    assert best([_candidate("a", 130), unsimulated], memory) is unsimulated
    # one refused unsimulated by a lower bound of its simulated peak (`Totals.refused`) does not fit, and ranks by
    # that bound after the simulated peaks and before the per-node bounds
    refused = dataclasses.replace(unsimulated, totals=unsimulated.totals.refused(104))
    assert not memory.fits(refused) and memory.needs(refused) == 104 and memory.leanness(refused) == (1, 104)
    assert best([unsimulated, refused, simulated], memory) is simulated
    assert best([unsimulated, refused], memory) is refused
    # a candidate that fits still ranks first, by its time
    fitting = _candidate("joint", bound=120, simulated=99, time_s=9.0)
    assert rank(fitting, memory) < rank(leaner, memory) and best([leaner, fitting], memory) is fitting


def test_a_stage_candidates_figure_is_one_kind_whether_simulated_or_not():
    """A pipeline stage's step ranks by its busiest stage's memory (`StageFit`), whatever the simulator did:
    `leanness` keeps every candidate in one class there."""

    class Stage:
        def peak_bytes(self, plan):
            return plan.totals.peak_memory_bytes + 7

        def fits(self, needed):
            return needed <= 50

    graph = build_example("mlp", {"batch": 4, "d_in": 4, "d_hidden": 4, "d_out": 2})
    memory = MemoryFit(Machine.preset("cpu"), graph, 1, Stage())
    simulated, unsimulated = _candidate("joint", bound=90, simulated=60), _candidate("best_grid", bound=80)
    assert memory.leanness(simulated) == (0, 97) and memory.leanness(unsimulated) == (0, 87)
    assert best([simulated, unsimulated], memory) is unsimulated


@pytest.mark.slow
def test_a_small_gpt_that_fits_nowhere_is_told_what_its_leanest_simulated_plan_needs():
    """A 2-block GPT on 4 H100-like devices of 12 MiB at one micro-batch: a joint plan fits by the per-node
    bound (11.59 MiB) but simulates at 14.59 MiB, and no candidate fits as simulated. Before, the step said
    "needs 13.59 MiB" with no word of which figure: a grid point's per-node bound, over 12 MiB and so never
    simulated (measured 2026-12-05; with 14 MiB that point is simulated, at 13.96 MiB, and fits). Now the figure
    is a simulated peak and says so. (It is the leanest simulated, not a lower bound: a point left unsimulated
    may need less, as that one does.)"""
    machine = dataclasses.replace(Machine.preset("h100x8"), memory_capacity=12 * MIB)
    graph = build_example("gpt", {"blocks": 2, "batch": 8, "seq": 128, "hidden": 256, "heads": 4, "vocab": 2048})
    with pytest.raises(DoesNotFit) as raised:
        parsat.optimize(graph, machine=machine, devices=4, microbatches=1, pipeline=False)
    err = raised.value
    assert "as simulated (transient buffers included;" in str(err), str(err)
    assert err.needed_bytes > 12 * MIB
