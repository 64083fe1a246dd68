"""The memory floor (`cost.pcg_tasks.peak_floor`): a lower bound of the simulated peak memory per device, which
lets a search refuse a candidate that cannot fit without simulating it. What the refusal rests on: the floor is
never above the peak `simulate_pcg` gives, for every profile, ZeRO stage, recomputation and micro-batch count,
and for every candidate a search simulates; and it counts more than the weights' state (it is not a trivial
bound)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import parsat
import parsat.search.mesh as mesh_module
import parsat.search.step as step_module
from parsat.cost.pcg_tasks import DDP, PARSAT_RUN, TORCH_NATIVE, peak_floor, simulate_pcg
from parsat.ir.errors import DoesNotFit
from parsat.ir.machine import Machine
from parsat.ir.models import build_example
from parsat.ir.plan import without_timing
from parsat.ir.recompute import BLOCKS, NONE
from parsat.search.baselines import independent_grid
from parsat.search.mesh import CandidateSteps
from parsat.search.optimize import optimize
from parsat.search.request import resolve_request, step_context

GPT = {"blocks": 2, "hidden": 256, "heads": 8, "batch": 16, "seq": 128, "vocab": 2048}
LLAMA = {"blocks": 2, "hidden": 256, "heads": 8, "kv_heads": 2, "batch": 16, "seq": 128, "vocab": 2048}
MODELS = {("gpt", "h100x8"): GPT, ("llama", "h100x8"): LLAMA, ("gpt", "cpu"): GPT, ("llama", "cpu"): LLAMA}


@pytest.fixture(scope="module", params=sorted(MODELS))
def grid(request):
    """A model's step on 8 devices of a machine, every point of its independent grid (data x tensor parallelism,
    sequence parallelism or not, ZeRO 0, 1 and 3), and one cache of compute times."""
    name, machine = request.param
    resolved = resolve_request(name, machine, None, None, 8, sizes=MODELS[request.param])
    step = step_context(resolved, 1)
    points = independent_grid(step.graph, resolved.library, step.machine, True, step.devices, lambda point: True)
    return resolved, step, points, CandidateSteps(resolved.library, step.machine, 1)


def _forms(pcg):
    """`pcg` as each recomputation and ZeRO stage of its state (`PCG.zero`: 0, 1, 2) runs it; ZeRO-3 is a layout of
    its own (the grid's points that gather their weights)."""
    for recompute in (NONE, BLOCKS):
        for zero in (0, 1, 2):
            yield replace(pcg, recompute=recompute, zero=zero)


def _distinct_forms(points):
    """(point, form) for each form (`_forms`) of the points, each form once: a GPU grid's ZeRO-1 twin of a point is
    that point's layout with `PCG.zero` 1, so its six forms are equal to the point's own (30 of 102 on h100x8), the
    same PCG, floor and simulated peak, the same check done again."""
    seen: list = []
    for point in points:
        for pcg in _forms(point.pcg):
            if pcg not in seen:
                seen.append(pcg)
                yield point, pcg


@pytest.mark.parametrize("profile", [DDP, PARSAT_RUN, TORCH_NATIVE], ids=lambda p: p.name.split("(")[0])
def test_the_floor_is_below_every_grid_point_s_simulated_peak(grid, profile):
    """Every point, each ZeRO stage and recomputation of it, over 1 and 3 micro-batches, under each profile: the
    floor is at most the simulated peak, and above the resident state wherever a micro-batch holds
    activations (so it counts them)."""
    resolved, step, points, steps = grid
    assert {p.config["zero"] for p in points} >= {0, 3}
    checked = above = 0
    for point, pcg in _distinct_forms(points):
        for microbatches in (1, 3):
            simulated = simulate_pcg(pcg, resolved.library, step.machine, profile, times=steps.times,
                                     microbatches=microbatches)
            floor = peak_floor(pcg, step.machine, steps.times, microbatches, profile)
            assert floor <= simulated.peak_memory_bytes, (point.name, point.config, pcg.zero, pcg.recompute,
                                                          microbatches)
            checked += 1
            above += floor > simulated.resident_bytes
    assert checked >= 24 and above == checked


def test_the_floor_tracks_the_activations(grid):
    """Keeping every activation needs more than recomputing blocks, and the floor says so; and the floor comes
    within a factor of two of the peak it bounds at data parallelism (activations and state at the
    forward-backward boundary are most of it)."""
    resolved, step, points, steps = grid
    dp = next(p for p in points if p.config["tp"] == 1 and p.config["zero"] == 0)
    kept = peak_floor(dp.pcg, step.machine, steps.times)
    recomputed = peak_floor(replace(dp.pcg, recompute=BLOCKS), step.machine, steps.times)
    assert recomputed < kept
    peak = simulate_pcg(dp.pcg, resolved.library, step.machine, DDP, times=steps.times).peak_memory_bytes
    assert 2 * kept > peak


@pytest.mark.parametrize("machine,options", [   # recompute and pinned (~7-8 s each) in the slow run
    ("h100x8", {}),
    pytest.param("h100x8", {"recompute": BLOCKS}, marks=pytest.mark.slow),
    ("cpu", {}),
    pytest.param("h100x8", {"degrees": {"dp": 2, "tp": 2, "zero": 1}}, marks=pytest.mark.slow),
], ids=["free", "recompute", "cpu", "pinned"])
def test_the_floor_is_below_every_candidate_a_search_simulates(monkeypatch, machine, options):
    """Every candidate a search simulates (its meshes' joint plans, their restricted baselines, data
    parallelism, the independent grid's points), free and pinned: the floor at most its simulated peak."""
    seen = []
    simulate = mesh_module.simulated_step

    def recorded(pcg, library, machine_, microbatches=1, times=None):
        found = simulate(pcg, library, machine_, microbatches, times)
        seen.append((pcg, library, machine_, microbatches, times, found.peak_memory_bytes))
        return found
    monkeypatch.setattr(mesh_module, "simulated_step", recorded)
    optimize("gpt", machine, devices=4, sizes={**GPT, "batch": 8}, pipeline=False, **options)
    assert len(seen) >= 3
    for pcg, library, machine_, microbatches, times, peak in seen:
        assert peak_floor(pcg, machine_, times, microbatches) <= peak


SMALL_GPT = {"blocks": 2, "batch": 8, "seq": 128, "hidden": 256, "heads": 4, "vocab": 2048}


def _search(monkeypatch, capacity_mib: int, refusing: bool):
    """The 2-block GPT of tests/test_search_leanness.py on 4 H100-like devices of `capacity_mib` at one
    micro-batch, with the unstaged step refusing candidates by their floors or not: (the plan's JSON apart from
    its timing fields, or the DoesNotFit raised; the PCGs simulated; those refused and simulated after all)."""
    simulated, settled = [], []
    simulate, settle = mesh_module.simulated_step, mesh_module.CandidateSteps.settled

    def settling(steps, candidate):
        if candidate is not None and candidate.totals.floor_bytes is not None:
            settled.append(candidate.pcg)
        return settle(steps, candidate)
    monkeypatch.setattr(mesh_module.CandidateSteps, "settled", settling)

    def recorded(pcg, *args, **kwargs):
        simulated.append(pcg)
        return simulate(pcg, *args, **kwargs)
    monkeypatch.setattr(mesh_module, "simulated_step", recorded)
    if not refusing:
        monkeypatch.setattr(step_module, "_refusing", lambda step: False)
    machine = replace(Machine.preset("h100x8"), memory_capacity=capacity_mib * 2 ** 20)
    graph = build_example("gpt", SMALL_GPT)
    try:
        answer = json.dumps(without_timing(parsat.optimize(graph, machine=machine, devices=4, microbatches=1,
                                                           pipeline=False).to_dict()))
    except DoesNotFit as err:
        answer = err
    monkeypatch.undo()
    return answer, simulated, settled


@pytest.mark.slow
def test_a_step_refuses_what_cannot_fit_unsimulated_and_makes_the_same_plan(monkeypatch):
    """Where a plan fits (16 MiB devices), candidates whose floor is over the device (data parallelism: every
    weight's state whole) are refused unsimulated, then simulated after all for the plan's baselines: the plan
    JSON is the one simulating every candidate gives. Where none fits (12 MiB), the step says so without
    simulating the refused ones: the same answer (DoesNotFit), and a lower bound where it names one."""
    plain, everything, _ = _search(monkeypatch, 16, refusing=False)
    refused, some, settled = _search(monkeypatch, 16, refusing=True)
    assert isinstance(plain, str) and refused == plain
    assert settled and set(some) == set(everything)   # refused, then simulated: the plan shows each one's step
    tight, all_tight, _ = _search(monkeypatch, 12, refusing=False)
    short, few, none = _search(monkeypatch, 12, refusing=True)
    assert isinstance(tight, DoesNotFit) and isinstance(short, DoesNotFit)
    assert len(set(few)) < len(set(all_tight)) and not none   # the refused ones never simulated
    if "at least" in str(short):
        assert "a lower bound of its simulated peak" in str(short)


def test_the_floor_counts_what_recomputed_blocks_keep():
    """Recomputing blocks, each block's output stays allocated to the end of forward (the next block's
    recomputation starts from it; `_release` leaves it although no backward reads it, where a sequence-parallel
    norm reads it through a gather): llama-70b:64's grid points hold 80 of them, 142-230 GiB simulated. A
    12-block LLaMA on 8 devices, every dp 2 x tp 4 point: the floor comes within 0.45-0.53 of the peak; leaving
    those outputs out gave 0.18-0.27 (and refused none of llama-70b:64's grid points)."""
    sizes = {"blocks": 12, "hidden": 128, "heads": 4, "kv_heads": 2, "batch": 32, "seq": 256, "vocab": 256}
    resolved = resolve_request("llama", "h100x8", None, None, 8, sizes=sizes)
    step = step_context(resolved, 1)
    points = [p for p in independent_grid(step.graph, resolved.library, step.machine, True, step.devices,
                                          lambda point: True) if p.config["tp"] == 4]
    steps = CandidateSteps(resolved.library, step.machine, 1)
    assert len(points) >= 4
    for point in points:
        pcg = replace(point.pcg, recompute=BLOCKS)
        peak = simulate_pcg(pcg, resolved.library, step.machine, DDP, times=steps.times).peak_memory_bytes
        assert 0.4 * peak < peak_floor(pcg, step.machine, steps.times) <= peak, point.config
