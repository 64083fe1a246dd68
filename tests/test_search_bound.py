"""Branch and bound over the independent grid (`mesh.CandidateSteps.fastest`): a point whose step floor
(`pcg_tasks.step_floor`) is above the fastest step simulated so far is not simulated, and the best point, and
so the plan, is the one simulating every point gives."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from parsat.ir.plan import without_timing
from parsat.search.baselines import grid_families, independent_grid
from parsat.search.mesh import CandidateSteps, best
from parsat.search.request import resolve_request, step_context
from parsat.search.step import _LayoutFloors, independent_points, keeps_pins

# large enough a batch that data parallelism is bound by its compute, which tensor parallelism only slows
SIZES = {"blocks": 2, "hidden": 512, "heads": 8, "batch": 256, "seq": 512, "vocab": 2048}


def _grid():
    request = resolve_request("gpt", "h100x8", None, None, 8, sizes=SIZES)
    step = step_context(request, 1)
    points = independent_grid(step.graph, request.library, step.machine, True, step.devices, step.memory.fits)
    return request, step, points


@pytest.fixture(scope="module")
def grid():
    """`_grid()` once for the module's three tests of the 8-device grid (each resolved the request and laid out
    the grid again, ~0.6 CPU s). Each test bounds and simulates the points with `CandidateSteps` of its own, as
    before; the points are frozen, and the step's memory judgments (`step.memory`) are the same figures however
    often they are asked."""
    return _grid()


def test_points_that_cannot_be_the_fastest_are_not_simulated(grid):
    request, step, points = grid
    bounded = CandidateSteps(request.library, step.machine, 1)
    kept, bar = bounded.fastest(points, step.memory.fits)
    kept = [kept[i] for i in sorted(kept)]
    every = CandidateSteps(request.library, step.machine, 1)
    simulated = [every(p) if step.memory.fits(p) else p for p in points]
    assert bounded.skipped > 0 and len(kept) == len(points) - bounded.skipped
    assert len(bounded.simulated) == len(points) - bounded.skipped     # the skipped ones never ran
    chosen, unbounded = best(kept, step.memory), best(simulated, step.memory)
    assert chosen.pcg == unbounded.pcg and chosen.config == unbounded.config and chosen.totals == unbounded.totals
    assert bar == round(chosen.totals.time_s, 12)
    left_out = [s for s in simulated if not any(k.pcg == s.pcg for k in kept)]
    assert left_out and all(s.totals.time_s > chosen.totals.time_s for s in left_out)
    assert [k.config for k in kept] == [s.config for s in simulated if any(k.pcg == s.pcg for k in kept)]


def test_a_lone_candidate_under_no_bar_is_simulated_without_its_floor(monkeypatch, grid):
    """`fastest` asks no floor where one candidate fits and no bar is set (nothing to order, nothing it could be
    above): the candidate comes back simulated, as with its floor; with a bar, or two fitting, floors are asked."""
    request, step, points = grid
    fitting = [p for p in points if step.memory.fits(p)]
    asked, floor = [], CandidateSteps.floor
    monkeypatch.setattr(CandidateSteps, "floor", lambda self, pcg, plan=True: asked.append(pcg) or floor(self, pcg,
                                                                                                         plan))
    steps = CandidateSteps(request.library, step.machine, 1)
    kept, bar = steps.fastest(fitting[:1], step.memory.fits)
    assert not asked and kept[0].totals.simulation is not None and bar == round(kept[0].totals.time_s, 12)
    again, _bar = CandidateSteps(request.library, step.machine, 1).fastest(fitting[:1], step.memory.fits, bar=1e9)
    assert asked and again[0].totals == kept[0].totals
    asked.clear()
    CandidateSteps(request.library, step.machine, 1).fastest(fitting[:2], step.memory.fits)
    assert len(asked) == 2


def test_a_layout_is_left_out_whole_where_its_floor_is_beyond_the_fastest_point(grid):
    """A layout's points (ZeRO 0 and 3, and the fallbacks) compute alike, so they share one floor
    (`baselines.grid_families`); a layout `skip` turns down on its first point yields none of its points."""
    request, step, points = grid
    steps = CandidateSteps(request.library, step.machine, 1)
    families = list(grid_families(step.graph, request.library, step.machine, True, step.devices, step.memory.fits))
    for family in families:
        layout = {steps.floor(point.pcg, plan=False) for _place, point in family}
        assert len(layout) == 1 and all(steps.floor(point.pcg) >= min(layout) for _place, point in family)
    bar = round(min(steps(p).totals.time_s for p in points if p.config["tp"] == 1), 12)
    shown = []

    def skip(pcg) -> bool:
        shown.append(pcg)
        return steps.beyond(pcg, bar)

    kept = list(grid_families(step.graph, request.library, step.machine, True, step.devices, step.memory.fits,
                              skip))
    assert len(shown) == len(families) and [len(f) for f in kept].count(0) == sum(map(steps.beyond, shown,
                                                                                        [bar] * len(shown))) > 0
    assert all(not f or steps.floor(f[0][1].pcg, plan=False) <= bar for f in kept)
    assert [f for f in kept if f] == [f for f in families if not steps.beyond(f[0][1].pcg, bar)]




def test_a_pinned_search_bounds_only_the_points_that_keep_the_pins():
    """Pinned dp 2 x tp 4, a layout slower than data parallelism here: only points that keep the pins can be
    the best grid point (`step.keeps_pins`), so the best of them is the one simulating every point gives. A
    bar set by the faster dp 8 points would leave every point of the pinned layout out."""
    request = resolve_request("gpt", "h100x8", None, None, 8, sizes=SIZES, degrees={"dp": 2, "tp": 4})
    step = step_context(request, 1)
    steps = CandidateSteps(request.library, step.machine, 1, request.simulations)
    kept = [p for p in independent_points(step, steps) if keeps_pins(p, request)]
    every = CandidateSteps(request.library, step.machine, 1)
    points = [every(p) for p in independent_grid(step.graph, request.library, step.machine, True, step.devices,
                                                  step.memory.fits)]
    chosen, unbounded = best(kept, step.memory), best([p for p in points if keeps_pins(p, request)], step.memory)
    assert chosen is not None and (chosen.config, chosen.totals) == (unbounded.config, unbounded.totals)
    # sequence parallelism off and on, each with ZeRO 0, 1 (GPUs overlap its gathers: `grid_families`) and 3
    assert best(points, step.memory).config["dp"] == 8 and len(kept) == 6
    assert all(p.totals.simulation is None for p in independent_points(step, steps) if not keeps_pins(p, request))


@pytest.mark.parametrize("microbatches", [1, 2])
def test_every_grid_point_s_floor_is_below_its_simulated_step(microbatches):
    """What the bound rests on, for every point of the grid on 16 devices of two nodes (data, tensor and both,
    ZeRO 0 and 3, sequence parallelism, whose in-node collectives are pipelined with their products): its
    floor is below its simulated step, and so is the floor of its layout (`plan=False`, the family's first
    point's), which `beyond` reads for the whole family."""
    request = resolve_request("gpt", "h100x8", None, None, 16, sizes=SIZES)
    step = step_context(request, microbatches)
    steps = CandidateSteps(request.library, step.machine, microbatches)
    families = [f for f in grid_families(step.graph, request.library, step.machine, True, step.devices,
                                         lambda point: True) if f]
    assert len(families) >= 6 and any(p.config["sp"] for f in families for _i, p in f)
    for family in families:
        layout = steps.floor(family[0][1].pcg, plan=False)
        for _place, point in family:
            simulated = steps(point).totals
            assert simulated.simulation is not None
            assert layout <= steps.floor(point.pcg) <= simulated.time_s


@pytest.mark.slow
@pytest.mark.parametrize("degrees", [{"dp": 8}, {"dp": 4, "tp": 2}])
def test_the_plan_is_the_one_simulating_every_point_gives(monkeypatch, degrees):
    """The whole call, with the bound and with every point simulated (no floor): the same plan, field for field
    but its timings, and the bound skipped points. Pinned dp 4 x tp 2, a layout slower than data parallelism
    here: its points are the only ones that can be the best grid point, so a faster point that does not keep
    the pins must not set the bar they are left out by."""
    import parsat

    skipped = []
    fastest, beyond, floors_beyond = CandidateSteps.fastest, CandidateSteps.beyond, _LayoutFloors.beyond

    def counting(self, *args):
        before = self.skipped
        found = fastest(self, *args)
        skipped.append(self.skipped - before)
        return found

    def layouts(self, *args):   # a layout left out whole
        out = beyond(self, *args)
        skipped.append(int(out))
        return out

    def layout_floors(self, *args):   # the same, as the independent grid asks it (`step._LayoutFloors`)
        out = floors_beyond(self, *args)
        skipped.append(int(out))
        return out

    def plan() -> dict:
        found = parsat.optimize("gpt", machine="h100x8", devices=8, sizes=SIZES, degrees=degrees)
        return without_timing(json.loads(found.to_json()))

    monkeypatch.setattr(CandidateSteps, "fastest", counting)
    monkeypatch.setattr(CandidateSteps, "beyond", layouts)
    monkeypatch.setattr(_LayoutFloors, "beyond", layout_floors)
    bounded = plan()
    assert sum(skipped) > 0
    monkeypatch.setattr(CandidateSteps, "floor", lambda self, pcg, plan=True: None)
    skipped.clear()
    assert plan() == bounded and sum(skipped) == 0


def test_a_layout_that_fits_with_its_state_whole_is_also_a_zero_1_point_where_gpus_overlap_its_gathers():
    """On GPUs ZeRO-1's gathers of the updated shards run during the next forward (`pcg_tasks.DDP`), so a layout
    that fits with ZeRO 0 can still be faster with its state sharded: the grid offers both, and the simulation
    chooses. On a CPU box (`PARSAT_RUN`: gathered after the update, inline) ZeRO-1 stays a fallback for a
    layout that does not fit."""
    for machine, sharded_too in (("h100x8", True), ("cpu", False)):
        request = resolve_request("gpt", machine, None, None, 8 if machine == "h100x8" else 4, sizes=SIZES)
        step = step_context(request, 1)
        points = independent_grid(step.graph, request.library, step.machine, True, step.devices, lambda p: True)
        layouts = {(p.config["dp"], p.config["tp"], p.config["sp"]): set() for p in points}
        for p in points:
            layouts[(p.config["dp"], p.config["tp"], p.config["sp"])].add(p.config["zero"])
        spread = [zeros for (dp, _tp, _sp), zeros in layouts.items() if dp > 1]
        assert spread and all((1 in zeros) == sharded_too for zeros in spread), (machine, layouts)
        # ZeRO 0 and 1 hold the same layout's state whole or sharded (`PCG.zero`); ZeRO-3 stores the weights split
        assert all(p.pcg.zero == p.config["zero"] for p in points if p.config["zero"] in (0, 1))


def _grid_order_points(step, steps, request) -> list:
    """`independent_points` as it was before the layouts were ordered by their floors: the branch and bound in
    the grid's order (the reference the ordered one is held to)."""
    kept, bar = [], float("inf")
    for family in grid_families(step.graph, request.library, step.machine, True, step.devices, step.memory.fits,
                                skip=lambda pcg: steps.beyond(pcg, bar)):
        points, bar = steps.fastest([point for _place, point in family], step.memory.fits, bar)
        kept += [(family[i][0], point) for i, point in points.items()]
    return [point for _place, point in sorted(kept, key=lambda pair: pair[0])]


@pytest.mark.parametrize("devices, microbatches, tp_first", [(8, 1, False), (16, 2, False), (16, 1, True)])
def test_layouts_in_the_order_of_their_floors_give_the_best_point_the_grid_order_gives(devices, microbatches,
                                                                                      tp_first):
    """The independent grid visits its layouts in the ascending order of their floors (`grid_families`' `order`):
    the best point, and every point as fast as it, are those the grid's own order gives, and no more points
    are simulated. With a batch that makes tensor parallelism the fastest (`tp_first`), the grid's order meets
    data parallelism first and simulates its points; the floors' order meets the fastest layout first, and its
    bar leaves out a point the grid's order simulated."""
    # seq 64: at seq 256 the floors' order left nothing out once the grid's loss was vocabulary-parallel, at
    # seq 128 once a bias gradient stopped costing a third GEMM in simulated steps (2026-12-04)
    sizes = {**SIZES, "batch": 16, "seq": 64, "hidden": 4096, "heads": 32} if tp_first else SIZES
    request = resolve_request("gpt", "h100x8", None, None, devices, sizes=sizes)
    step = step_context(request, microbatches)
    ordered, plain = (CandidateSteps(request.library, step.machine, microbatches) for _ in range(2))
    seen = []
    floors = _LayoutFloors(ordered)
    recording = lambda pcg: seen.append(floors(pcg)) or seen[-1]   # noqa: E731 - the order asked, recorded
    families = list(grid_families(step.graph, request.library, step.machine, True, step.devices, step.memory.fits,
                                  order=recording))
    assert len(seen) == len(families) > 1
    visited = [floors(f[0][1].pcg) for f in families if f]
    assert visited == sorted(visited)
    new = independent_points(step, ordered)
    old = _grid_order_points(step, plain, request)
    chosen, reference = best(new, step.memory), best(old, step.memory)
    assert (chosen.pcg, chosen.config, chosen.totals) == (reference.pcg, reference.config, reference.totals)
    fastest = round(reference.totals.time_s, 12)
    as_fast = lambda points: [(p.config, p.totals) for p in points   # noqa: E731
                              if p.totals.simulation is not None and round(p.totals.time_s, 12) == fastest]
    assert as_fast(new) == as_fast(old)
    assert len(ordered.simulated) <= len(plain.simulated)
    if tp_first:   # a tensor-parallel layout is the fastest (dp 2 x tp 8), the grid's order meets it late
        assert chosen.config["tp"] > 1 and len(ordered.simulated) < len(plain.simulated)


def test_no_layout_is_left_out_when_no_point_fits():
    """Where no point fits, no step is simulated, the bar never falls and the floors' order leaves nothing out:
    every point of the grid is kept (unsimulated, ranked by memory), as the grid's order keeps them."""
    request = resolve_request("gpt", "h100x8", None, None, 8, sizes=SIZES)
    step = step_context(request, 1)
    tiny = replace(step, memory=replace(step.memory, machine=replace(step.machine, memory_capacity=1)))
    steps = CandidateSteps(request.library, tiny.machine, 1)
    kept = independent_points(tiny, steps)
    every = independent_grid(tiny.graph, request.library, tiny.machine, True, tiny.devices, tiny.memory.fits)
    assert kept and not any(tiny.memory.fits(p) for p in every) and not steps.simulated
    assert [(p.config, p.totals) for p in kept] == [(p.config, p.totals) for p in every]


@pytest.mark.parametrize("devices, microbatches", [(8, 1), (16, 2)])
def test_the_leanest_first_scan_yields_the_grid_s_points(devices, microbatches):
    """`grid_families(lean_first=True)` (what `step.a_grid_point_fits` scans) gives the points the grid's order
    gives, the same layouts priced alike, only in another order: tensor parallelism's widest layouts and ZeRO-3
    first. So whether some point fits is answered alike whichever point the scan stops at."""
    request = resolve_request("gpt", "h100x8", None, None, devices, sizes=SIZES)
    step = step_context(request, microbatches)

    def points(**how):
        found = [pair for family in grid_families(step.graph, request.library, step.machine, True, step.devices,
                                                  step.memory.fits, **how) for pair in family]
        return found, [(place, p.config, p.pcg, p.totals) for place, p in sorted(found, key=lambda pair: pair[0])]
    lean, lean_sorted = points(lean_first=True)
    _plain, plain_sorted = points()
    assert lean_sorted == plain_sorted and len(lean) > 2
    widest = max(p.config["tp"] for _place, p in lean)
    assert lean[0][1].config["tp"] == widest and lean[0][1].config["sp"]
    spread = [p.config for _place, p in lean if p.config["dp"] > 1 and p.config["zero"] in (0, 3)]
    assert spread and spread[0]["zero"] == 3   # a layout over data-parallel replicas: ZeRO-3 first
