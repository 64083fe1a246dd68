"""A pipeline stage's candidates rank as their pipeline runs them (issue 28): by the fastest pipelined plan that fits
of those the pipeline search prices from each (`MemoryFit.pipelined_s`, `mesh.rank`), not by the stage plan's own
step. llama-70b:64's stage step chose its scout's `gpu 8` plan (the faster stage step, 16.156 s pipelined) over
`gpu0 4 x gpu1 2` keeping every activation (15.234 s pipelined)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import parsat.search.pipeline_search as pipeline_search
from parsat.cost.pipeline import StageFit
from parsat.ir.machine import Machine
from parsat.search.baselines import Candidate
from parsat.search.fit import MemoryFit
from parsat.search.mesh import best, first_ranked, rank
from parsat.search.optimize import optimize

SIZES = {"blocks": 4, "batch": 16, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}
MACHINE = Machine.resolve("h100x8").with_devices(8)
STAGE_MACHINE = replace(MACHINE.with_devices(4), memory_capacity=MACHINE.memory_capacity * 2)


@pytest.fixture(scope="module")
def stage():
    """A stage step's plan at 2 stages x 4 micro-batches, its candidates (the joint plan, data parallelism) and
    the step's judgment."""
    plan = optimize("gpt", STAGE_MACHINE, devices=4, sizes=SIZES, microbatches=4, pipeline=False)
    joint = Candidate("joint", plan.pcg, plan.costs, plan.totals)
    dp = plan.baseline_plans["data_parallel"]
    data = Candidate("data_parallel", dp.pcg, dp.costs, plan.baselines["data_parallel"])
    return plan, joint, data, MemoryFit(STAGE_MACHINE, plan.graph, 4, StageFit(2, MACHINE))


def _priced_by_the_pipeline_search(plan, candidate) -> float:
    """The fastest pipelined plan that fits of those the pipeline search prices from `candidate`."""
    found = pipeline_search._price_schedules(replace(plan, pcg=candidate.pcg, costs=candidate.costs), 2, 4, None,
                                             MACHINE, 1, [])
    return min((p.totals.time_s for p in found if p.totals.fits(MACHINE)), default=math.inf)


def test_a_stage_candidate_s_rank_is_the_pipeline_search_s_fastest_fitting_price(stage):
    plan, joint, data, memory = stage
    for candidate in (joint, data):
        assert memory.fits(candidate)
        assert memory.pipelined_s(candidate) == _priced_by_the_pipeline_search(plan, candidate)
        assert rank(candidate, memory)[1] == (0, round(memory.pipelined_s(candidate), 12))
    assert MemoryFit(STAGE_MACHINE, plan.graph, 4).pipelined_s(joint) == math.inf   # unstaged: no pipeline


def test_the_stage_plan_that_pipelines_faster_ranks_first_though_its_stage_step_is_slower(stage):
    """Two candidates whose stage steps and pipelined prices order them oppositely (data parallelism's stage step
    set below the joint plan's, its PCG and costs as they are: llama-70b:64's `gpu 8` plan beside `4 x 2`'s, small):
    the one that pipelines faster is chosen, as the pipeline search would choose between their pipelined plans.
    Ranked by the stage step, the other was."""
    plan, joint, data, memory = stage
    quick = replace(data, totals=replace(data.totals, time_s=joint.totals.time_s / 2))
    assert quick.totals.time_s < joint.totals.time_s
    assert memory.pipelined_s(quick) > memory.pipelined_s(joint)
    assert best([quick, joint], memory) is joint and best([joint, quick], memory) is joint
    assert first_ranked([quick, joint], memory) is joint


def test_first_ranked_prices_only_what_its_floors_leave_and_chooses_what_min_chooses(stage, monkeypatch):
    """`first_ranked` prices a stage candidate only while its floor (`StageFit.floor_s`) is at or below the fastest
    price so far, and chooses what `min` by `rank` over every candidate chooses; a candidate whose floor is above
    that price is left unpriced."""
    plan, joint, data, memory = stage
    slow = replace(data, costs={i: replace(c, forward_s=c.forward_s * 50, backward_s=c.backward_s * 50)
                                for i, c in data.costs.items()})
    assert memory.stage.floor_s(slow.pcg, slow.costs) > memory.pipelined_s(joint)
    asked = []
    fresh = MemoryFit(STAGE_MACHINE, plan.graph, 4, StageFit(2, MACHINE))
    inner = MemoryFit.pipelined_s
    monkeypatch.setattr(MemoryFit, "pipelined_s", lambda self, c: asked.append(c) or inner(self, c))
    for order in ([slow, joint, data], [data, slow, joint]):
        asked.clear()
        chosen = first_ranked(order, fresh)
        assert all(c is not slow for c in asked) and asked
        assert chosen is min(order, key=lambda c: rank(c, memory)) is joint
