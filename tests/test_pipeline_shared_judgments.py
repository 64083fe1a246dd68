"""The search of every stage mesh at a pair shares its scout's judgments (issue 28): the stage candidates' memory
figures (`request.stage_figures`, `search.fit.MemoryFit`) and the scout's `StageMemo`
(`pipeline_search._search_every_mesh`), and finds what judging afresh finds; and a stage candidate that fits is
ranked by the fastest pipelined plan that fits of those the pipeline search prices from it (`mesh.rank`)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

import parsat.search.pipeline_search as pipeline_search
from parsat.cost.pipeline import StageFit, StageMemo
from parsat.ir.machine import Machine
from parsat.ir.plan import without_timing
from parsat.search.fit import MemoryFit
from parsat.search.mesh import best, first_ranked, rank
from parsat.search.optimize import optimize
from parsat.search.request import resolve_request, step_context

SIZES = {"blocks": 4, "batch": 16, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}
MACHINE = Machine.resolve("h100x8").with_devices(8)


def _stage_machine(p: int) -> Machine:
    return replace(MACHINE.with_devices(8 // p), memory_capacity=MACHINE.memory_capacity * p)


@pytest.fixture(scope="module")
def candidates():
    """A stage step's plan at 2 stages x 4 micro-batches and its baselines: the candidates a stage step judges."""
    step = optimize("gpt", _stage_machine(2), devices=4, sizes=SIZES, microbatches=4, pipeline=False)
    return [step] + [replace(step, pcg=b.pcg, costs=b.costs) for b in step.baseline_plans.values()
                     if b.pcg is not None]


def test_steps_alike_but_for_the_memo_bar_and_scout_share_figures_that_are_fresh_ones(candidates):
    """Two stage steps of one pair (a scout's with its bar, the search of every mesh's without: `StageFit` equal
    but for its memo and bar) judge with one table, and each figure is the one a fresh judgment gives; a step of
    another degree, micro-batch count or schedule pin has its own table, its figures its own fresh ones."""
    request = resolve_request("gpt", "h100x8", None, None, 8, sizes=SIZES)
    scout = step_context(request, 4, _stage_machine(2), 4, stage=StageFit(2, MACHINE, bar_s=1.0), scout=True)
    every = step_context(request, 4, _stage_machine(2), 4, 2, stage=StageFit(2, MACHINE, memo=StageMemo()))
    assert scout.memory._known is every.memory._known
    others = [step_context(request, 4, _stage_machine(4), 2, stage=StageFit(4, MACHINE)),
              step_context(request, 8, _stage_machine(2), 4, stage=StageFit(2, MACHINE)),
              step_context(request, 4, _stage_machine(2), 4, stage=StageFit(2, MACHINE, "gpipe"))]
    assert len({id(s.memory._known) for s in [scout, *others]}) == 4
    for plan in candidates:
        first = scout.memory.needs(plan)
        assert every.memory.needs(plan) == first       # read from the scout's table
        fresh = MemoryFit(every.machine, every.graph, every.devices, StageFit(2, MACHINE))
        assert fresh.needs(plan) == first and fresh.fits(plan) == every.memory.fits(plan)
        for other in others:
            alone = MemoryFit(other.machine, other.graph, other.devices, replace(other.stage, memo=StageMemo()))
            assert other.memory.needs(plan) == alone.needs(plan)
    assert len(every.memory._known) == len({id(p.costs) for p in candidates})




@pytest.mark.slow
def test_the_search_of_every_mesh_with_its_scout_s_memo_finds_what_a_fresh_memo_finds(monkeypatch):
    """gpt on 8 H100s, pipelined, with no bar (every pair searched, and every stage mesh searched at the pair a
    scout found best even where the unstaged plan is faster): the search of every stage mesh runs with its
    scout's `StageMemo`, and the plan, the pipeline search's trace included, is the one a fresh memo gives."""
    monkeypatch.setattr(pipeline_search, "bar_of", lambda flat: None)
    every_mesh = pipeline_search._search_every_mesh
    seen: dict[str, list] = {"memos": [], "unscouted": []}

    def unbarred(search, *args, share=True):
        def spying(*step_args):
            if not step_args[6]:   # the search of every mesh (not a scout's)
                seen["unscouted"].append(step_args[4].memo)
            return search(*step_args)
        args = list(args)
        args[9] = None   # `bar`: the unstaged plan, which outranks these small pipelines
        seen["memos"].append(args[11])
        return every_mesh(spying, *args[:11], memos=args[11] if share else None)

    monkeypatch.setattr(pipeline_search, "_search_every_mesh", unbarred)
    shared = optimize("gpt", "h100x8", devices=8, sizes=SIZES, pipeline=True)
    assert len(seen["unscouted"]) == 1 and any(memo is seen["unscouted"][0] for memo in seen["memos"][0].values())
    monkeypatch.setattr(pipeline_search, "_search_every_mesh", lambda *args: unbarred(*args, share=False))
    alone = optimize("gpt", "h100x8", devices=8, sizes=SIZES, pipeline=True)
    assert len(seen["unscouted"]) == 2 and not any(m is seen["unscouted"][1] for m in seen["memos"][1].values())
    assert without_timing(json.loads(shared.to_json())) == without_timing(json.loads(alone.to_json()))


@pytest.mark.parametrize("capacity,fitting", [(1.0, True), (1e-9, False)])
def test_a_grid_scanned_for_a_point_that_fits_answers_as_the_grid_made(capacity, fitting):
    """`step.a_grid_point_fits` (a scout's first mesh holding no plan that fits asks it before searching every
    mesh) says a point fits exactly where a point `independent_points` keeps does: on 8 devices with the memory a
    point needs, or a billionth of it (where none fits), unstaged and as a stage; and
    the grid made after the scan is the grid made at once (each point's configuration and simulated step)."""
    from parsat.search.mesh import CandidateSteps
    from parsat.search.step import a_grid_point_fits, independent_points
    machine = replace(MACHINE, memory_capacity=MACHINE.memory_capacity * capacity)
    for stage in (None, StageFit(2, machine)):
        def context():
            request = resolve_request("gpt", machine, None, None, 8, sizes=SIZES)
            if stage is None:
                return step_context(request, 2)
            return step_context(request, 4, replace(machine.with_devices(4), memory_capacity=machine.memory_capacity
                                                    * 2), 4, stage=replace(stage, memo=StageMemo()))
        scanned, made = context(), context()
        steps = [CandidateSteps(s.request.library, s.machine, s.graph.microbatches, s.request.simulations)
                 for s in (scanned, made)]
        fits = a_grid_point_fits(scanned)
        grid = independent_points(made, steps[1])
        assert fits == any(made.memory.fits(point) for point in grid)
        again = independent_points(scanned, steps[0])
        assert [(p.config, p.totals.time_s, p.totals.peak_memory_bytes) for p in again] == \
            [(p.config, p.totals.time_s, p.totals.peak_memory_bytes) for p in grid]
        assert fits == fitting   # both answers are tested


@pytest.mark.slow
def test_a_stage_plan_priced_again_reads_its_prices_and_gives_the_plan_pricing_anew_gives(monkeypatch):
    """`pipeline_search.PricedOnce`: the search of every stage mesh (forced here: no bar) chooses the scout's
    stage plan again, the same PCG and costs, and its schedules and grid points are read, not cut and priced
    again; the plan, the pipeline search's trace included, is the one pricing anew gives. A stage plan with other
    costs (a copy: another identity) is priced anew."""
    from parsat.cost.pipeline import StagePricer
    monkeypatch.setattr(pipeline_search, "bar_of", lambda flat: None)
    every_mesh = pipeline_search._search_every_mesh
    priced = []
    inner = StagePricer.pipelined
    monkeypatch.setattr(StagePricer, "pipelined", lambda self, *a, **k: priced.append(a) or inner(self, *a, **k))

    def unbarred(search, *args, share=True):
        args = list(args)
        args[9] = None   # `bar`: the unstaged plan, which outranks these small pipelines
        return every_mesh(search, *args[:13], once=args[13] if share else None)
    monkeypatch.setattr(pipeline_search, "_search_every_mesh", unbarred)
    shared = optimize("gpt", "h100x8", devices=8, sizes=SIZES, pipeline=True)
    read = len(priced)
    monkeypatch.setattr(pipeline_search, "_search_every_mesh", lambda *args: unbarred(*args, share=False))
    priced.clear()
    alone = optimize("gpt", "h100x8", devices=8, sizes=SIZES, pipeline=True)
    assert read < len(priced)
    assert without_timing(json.loads(shared.to_json())) == without_timing(json.loads(alone.to_json()))


@pytest.mark.slow
def test_the_search_of_every_mesh_answers_with_the_scout_s_stage_plan_where_it_chooses_it_again(monkeypatch):
    """`step._the_scouts_choice`: the search of every stage mesh (forced here: no bar), choosing the scout's stage
    plan and grid point again, answers with the scout's stage plan before simulating its meshes' joint plans (the
    scout's own was simulated before: none is simulated); the plan, the pipeline search's trace included, is the
    one the step's own plan gives (the step asked for none: it simulates and makes its plan, as before)."""
    import parsat.search.mesh as mesh_module
    import parsat.search.step as step_module
    monkeypatch.setattr(pipeline_search, "bar_of", lambda flat: None)
    every_mesh, choice, simulate = (pipeline_search._search_every_mesh, step_module._the_scouts_choice,
                                    mesh_module.simulated_step)
    answers, simulated, during = [], [], []
    monkeypatch.setattr(step_module, "_the_scouts_choice", lambda *a: answers.append(choice(*a)) or answers[-1])
    monkeypatch.setattr(mesh_module, "simulated_step", lambda *a, **k: simulated.append(a[0]) or simulate(*a, **k))

    def unbarred(search, *args):
        args = list(args)
        args[9] = None   # `bar`: the unstaged plan, which outranks these small pipelines
        before = len(simulated)
        try:
            return every_mesh(search, *args)
        finally:
            during.append(len(simulated) - before)
    monkeypatch.setattr(pipeline_search, "_search_every_mesh", unbarred)
    shared = optimize("gpt", "h100x8", devices=8, sizes=SIZES, pipeline=True)
    answered = [a for a in answers if a is not None]   # other steps (the scouts') are answered None
    assert len(answered) == 1 and answers[-1] is answered[0] and during == [0]
    monkeypatch.setattr(step_module, "_the_scouts_choice", lambda *a: None)   # the step makes its own plan
    own = optimize("gpt", "h100x8", devices=8, sizes=SIZES, pipeline=True)
    assert during[1] > 0   # its meshes' joint plans simulated
    assert without_timing(json.loads(shared.to_json())) == without_timing(json.loads(own.to_json()))


def test_prices_are_read_only_for_the_same_pcg_and_costs(candidates, monkeypatch):
    """`PricedOnce` keys a stage plan's price by its PCG and costs' identity: the same stage plan priced again is
    read (the plan equal), a copy of its costs is priced anew to the same figures, put on the copy."""
    from parsat.cost.pipeline import StagePricer
    priced = []
    inner = StagePricer.pipelined
    monkeypatch.setattr(StagePricer, "pipelined", lambda self, *a, **k: priced.append(a) or inner(self, *a, **k))
    once, stage = pipeline_search.PricedOnce(), candidates[0]
    first = once.pipelined(stage, MACHINE, lambda: StagePricer(stage, MACHINE), 2, "1f1b", 1)
    again = once.pipelined(stage, MACHINE, lambda: StagePricer(stage, MACHINE), 2, "1f1b", 1)
    copied = replace(stage, costs=dict(stage.costs))
    other = once.pipelined(copied, MACHINE, lambda: StagePricer(copied, MACHINE), 2, "1f1b", 1)
    assert len(priced) == 2 and first == again and first == StagePricer(stage, MACHINE).pipelined(2, "1f1b", 1)
    assert other.totals == first.totals and other.pipeline == first.pipeline and other.costs is copied.costs


@pytest.fixture(scope="module")
def ranked(candidates):
    """The stage step's plan, its joint plan and data parallelism as candidates, and the step's judgment
    (`MemoryFit` with the pipeline's `StageFit`): what `mesh.rank` reads."""
    from parsat.search.baselines import Candidate
    plan = candidates[0]
    joint = Candidate("joint", plan.pcg, plan.costs, plan.totals)
    dp = plan.baseline_plans["data_parallel"]
    data = Candidate("data_parallel", dp.pcg, dp.costs, plan.baselines["data_parallel"])
    return plan, joint, data, MemoryFit(_stage_machine(2), plan.graph, 4, StageFit(2, MACHINE))


def _priced_by_the_pipeline_search(plan, candidate) -> float:
    """The fastest pipelined plan that fits of those the pipeline search prices from `candidate`."""
    found = pipeline_search._price_schedules(replace(plan, pcg=candidate.pcg, costs=candidate.costs), 2, 4, None,
                                             MACHINE, 1, [])
    return min((p.totals.time_s for p in found if p.totals.fits(MACHINE)), default=math.inf)


def test_a_stage_candidate_s_rank_is_the_pipeline_search_s_fastest_fitting_price(ranked):
    plan, joint, data, memory = ranked
    for candidate in (joint, data):
        assert memory.fits(candidate)
        assert memory.pipelined_s(candidate) == _priced_by_the_pipeline_search(plan, candidate)
        assert rank(candidate, memory)[1] == (0, round(memory.pipelined_s(candidate), 12))
    assert MemoryFit(_stage_machine(2), plan.graph, 4).pipelined_s(joint) == math.inf   # unstaged: no pipeline


def test_the_stage_plan_that_pipelines_faster_ranks_first_though_its_stage_step_is_slower(ranked):
    """Two candidates whose stage steps and pipelined prices order them oppositely (data parallelism's stage step
    set below the joint plan's, its PCG and costs as they are: llama-70b:64's `gpu 8` plan beside `4 x 2`'s, small):
    the one that pipelines faster is chosen, as the pipeline search would choose between their pipelined plans.
    Ranked by the stage step, the other was."""
    plan, joint, data, memory = ranked
    quick = replace(data, totals=replace(data.totals, time_s=joint.totals.time_s / 2))
    assert quick.totals.time_s < joint.totals.time_s
    assert memory.pipelined_s(quick) > memory.pipelined_s(joint)
    assert best([quick, joint], memory) is joint and best([joint, quick], memory) is joint
    assert first_ranked([quick, joint], memory) is joint


def test_first_ranked_prices_only_what_its_floors_leave_and_chooses_what_min_chooses(ranked, monkeypatch):
    """`first_ranked` prices a stage candidate only while its floor (`StageFit.floor_s`) is at or below the fastest
    price so far, and chooses what `min` by `rank` over every candidate chooses; a candidate whose floor is above
    that price is left unpriced."""
    plan, joint, data, memory = ranked
    slow = replace(data, costs={i: replace(c, forward_s=c.forward_s * 50, backward_s=c.backward_s * 50)
                                for i, c in data.costs.items()})
    assert memory.stage.floor_s(slow.pcg, slow.costs) > memory.pipelined_s(joint)
    asked = []
    fresh = MemoryFit(_stage_machine(2), plan.graph, 4, StageFit(2, MACHINE))
    inner = MemoryFit.pipelined_s
    monkeypatch.setattr(MemoryFit, "pipelined_s", lambda self, c: asked.append(c) or inner(self, c))
    for order in ([slow, joint, data], [data, slow, joint]):
        asked.clear()
        chosen = first_ranked(order, fresh)
        assert all(c is not slow for c in asked) and asked
        assert chosen is min(order, key=lambda c: rank(c, memory)) is joint


def test_a_stage_s_branch_and_bound_prices_pipelined_and_keeps_the_candidate_that_pipelines_fastest(ranked):
    """`BestFirst` judging a stage's candidates by their pipelined prices (`PipelinedSteps`): of a candidate whose
    stage step is the faster and one that pipelines faster, it keeps the latter (a bound by the simulated stage
    steps would have set its bar from the former); a candidate whose floor is above that price is left out
    unpriced; none is simulated; and every floor is at or below its price (the bound is sound)."""
    from parsat.search.mesh import BestFirst, CandidateSteps, PipelinedSteps
    plan, joint, data, memory = ranked
    quick = replace(data, totals=replace(data.totals, time_s=joint.totals.time_s / 2))
    slow = replace(data, name="slow", costs={i: replace(c, forward_s=c.forward_s * 50, backward_s=c.backward_s * 50)
                                             for i, c in data.costs.items()})
    judge = PipelinedSteps(memory)
    for candidate in (quick, joint):
        assert judge.floor(candidate) <= memory.pipelined_s(candidate)
    request = resolve_request("gpt", "h100x8", None, None, 8, sizes=SIZES)
    steps = CandidateSteps(request.library, _stage_machine(2), 4)
    search = BestFirst(steps, memory.fits, judge=judge)
    search.add(enumerate([quick, joint, slow]))
    search.run()
    assert search.kept[0] is quick and search.kept[1] is joint and 2 not in search.kept and steps.skipped == 1
    assert search.bar == round(memory.pipelined_s(joint), 12) and not steps.simulated
    assert best(list(search.kept.values()), memory) is joint


def test_a_stage_step_s_independent_grid_keeps_the_point_that_pipelines_fastest():
    """A stage step's independent grid (`step.independent_points`) keeps, of the grid's points, the one that ranks
    first as a stage ranks them (`mesh.rank`: the fastest pipelined price that fits), simulating none: its best
    point is the best of every point of the grid unbounded (`step._grid_families`)."""
    from parsat.search.mesh import CandidateSteps
    from parsat.search.step import _grid_families, independent_points
    request = resolve_request("gpt", "h100x8", None, None, 8, sizes=SIZES)
    stage = step_context(request, 4, _stage_machine(2), 4, stage=StageFit(2, MACHINE))
    steps = CandidateSteps(request.library, stage.machine, 4)
    kept = independent_points(stage, steps)
    every = [point for family in _grid_families(stage) for _place, point in family]
    assert len(kept) <= len(every) and not steps.simulated
    assert any(stage.memory.fits(p) for p in every)
    chosen, unbounded = best(kept, stage.memory), best(every, stage.memory)
    assert rank(chosen, stage.memory) == rank(unbounded, stage.memory) and chosen.config == unbounded.config


@pytest.mark.parametrize("capacity", [720_000, 800_000, 1_000_000])
def test_fastest_s_prices_only_schedules_whose_floor_can_beat_the_fastest_and_gives_the_least_of_all(
        candidates, capacity, monkeypatch):
    """`StageFit.fastest_s` skips a schedule none of whose plans can fit (GPipe holds every micro-batch: over 720
    and 800 KB a device here, `schedule_fitting_floors` inf) and one whose floor is above the fastest price that
    fits so far (1F1B after interleaved at 800 KB and 1 MB), and gives the least price that fits of every
    schedule priced on its own."""
    from parsat.cost.pipeline import StagePricer, applicable_schedules
    plan = candidates[0]
    fit = StageFit(2, replace(MACHINE, memory_capacity=capacity))
    schedules = applicable_schedules(None, 2, 4, fit._pricer(plan).layer_map.model_layers)
    every = {name: StagePricer(plan, fit.machine).pipelined(2, name, v) for name, v in schedules}
    least = min((p.totals.time_s for p in every.values() if p.totals.fits(fit.machine)), default=math.inf)
    priced = []
    inner = StagePricer.pipelined
    monkeypatch.setattr(StagePricer, "pipelined", lambda self, p, name, v=1, starts=None:
                        priced.append(name) or inner(self, p, name, v, starts=starts))
    assert fit.fastest_s(plan) == least < math.inf
    floors = dict(zip((n for n, _v in schedules), fit._pricer(plan).schedule_fitting_floors(2, schedules)))
    assert "gpipe" not in priced and (capacity > 800_000 or floors["gpipe"][0] == math.inf)
    assert priced == (["1f1b"] if capacity == 720_000 else ["interleaved"])
    assert all(not every[n].totals.fits(fit.machine) or every[n].totals.time_s >= floors[n][0] * (1 - 1e-9)
               for n in every)
