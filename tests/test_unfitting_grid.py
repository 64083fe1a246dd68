"""An unstaged count's scout whose joint plans do not fit makes its independent grid without floors where no point
fits (`step._unfitting_grid`, issue 28): the same grid the branch and bound makes, and never where a point fits;
the micro-batch search it serves ends with the same plan, or the same DoesNotFit."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

import parsat.ir.megatron as megatron_module
import parsat.search.step as step_module
from parsat.egraph.runner import Limits
from parsat.ir.errors import DoesNotFit
from parsat.ir.machine import Machine
from parsat.ir.plan import without_timing
from parsat.search.baselines import _grid_layouts
from parsat.search.deadline import Deadline
from parsat.search.mesh import CandidateSteps
from parsat.search.optimize import optimize
from parsat.search.request import resolve_request, step_context

SIZES = {"blocks": 4, "batch": 16, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}
MACHINE = Machine.resolve("h100x8").with_devices(8)


def _grid(capacity: int, scan: bool):
    """The unstaged scout's step at one micro-batch on 8 devices of `capacity` bytes, its refusing steps, and its
    grid: scanned (`_unfitting_grid`, None where a point may fit) or made by the branch and bound."""
    machine = replace(MACHINE, memory_capacity=capacity)
    step = step_context(resolve_request("gpt", machine, None, None, 8, sizes=SIZES), 1, scout=True)
    request = step.request
    steps = CandidateSteps(request.library, step.machine, step.graph.microbatches, request.simulations,
                           refusing=True)
    grid = step_module._unfitting_grid(step, steps) if scan else step_module.independent_points(step, steps)
    return step, steps, grid


def _untimed(said: list[str]) -> list[str]:
    """A search's trace without the seconds it reports (saturation's wall clock)."""
    return [re.sub(r"\d+(\.\d+)? s\b", "_ s", line) for line in said]


def _spelled(points, steps: CandidateSteps):
    return [(p.config, p.totals, p.pcg in steps.refused) for p in points]


def _bytes_at(share: float) -> int:
    """A capacity `share` of the way between the leanest grid point's per-node bound and its simulated peak, on a
    device where no point fits (each in its leanest form: ZeRO-1 or 3, recomputing blocks)."""
    _step, steps, grid = _grid(1, scan=False)
    lean = min(grid, key=lambda p: p.totals.memory_bytes)
    low, high = lean.totals.peak_memory_bytes, steps.simulate(lean).totals.memory_bytes
    assert low < high
    return int(low + share * (high - low))


def test_the_scan_makes_the_grid_the_branch_and_bound_makes_where_no_point_fits():
    """Below every point's per-node bound, and where points fit by their bounds but are refused by their peak
    floors (the floors raised over the capacity: `CandidateSteps.peak_floor` shifted), the scanned grid is the
    made one: every point in the grid's order, each with its totals (refused ones with their floors)."""
    capacity = _bytes_at(0.0) - 1
    step, steps, made = _grid(capacity, scan=False)
    assert made and not any(step.memory.fits(p) for p in made)
    _step, scanned_steps, scanned = _grid(capacity, scan=True)
    assert scanned is not None and _spelled(scanned, scanned_steps) == _spelled(made, steps)


def test_the_scan_builds_each_layout_once_and_derives_its_zero3_form(monkeypatch):
    """The scan, leanest first (ZeRO-3 before 0), builds each tensor-parallel layout once, as the branch and bound
    does: the ZeRO-0 build first, the ZeRO-3 layout derived from it (`megatron._built_layout`), not built again;
    and its points are the made grid's (the same layouts)."""
    made = []
    inner = megatron_module._MegatronBuilder.__init__

    def counted(self, *args, **kwargs):
        made.append(args[2])   # zero3
        inner(self, *args, **kwargs)
    monkeypatch.setattr(megatron_module._MegatronBuilder, "__init__", counted)
    step, steps, scanned = _grid(1, scan=True)
    scanned_builds, made[:] = list(made), []
    _step, made_steps, grid = _grid(1, scan=False)
    layouts = [layout for layout in _grid_layouts(8, MACHINE.devices_per_node) if layout.tp > 1]
    assert len(layouts) == 6 and sum(len(layout.zeros) > 1 for layout in layouts) == 4
    assert scanned_builds == made == [False] * len(layouts)   # one ZeRO-0 build per layout, ZeRO-3 derived
    assert scanned is not None and _spelled(scanned, steps) == _spelled(grid, made_steps)


def test_points_refused_by_their_floors_are_kept_refused(monkeypatch):
    """Points within their per-node bounds whose peak floors are over the capacity: kept as the branch and bound
    keeps them (refused, with their floors), none simulated."""
    inner = CandidateSteps.peak_floor
    monkeypatch.setattr(CandidateSteps, "peak_floor", lambda self, pcg: inner(self, pcg) + (1 << 30))
    capacity = 1 << 29   # every point's bound fits; every floor is over it
    step, steps, made = _grid(capacity, scan=False)
    _step, scanned_steps, scanned = _grid(capacity, scan=True)
    assert any(p.totals.floor_bytes is not None for p in made) and not any(step.memory.fits(p) for p in made)
    assert scanned is not None and _spelled(scanned, scanned_steps) == _spelled(made, steps)
    assert not any(p.totals.simulation is not None for p in scanned)


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_no_grid_is_scanned_where_a_point_fits(share):
    """Where the leanest layout's point alone fits (its simulated peak is the capacity; every other point needs
    more), the scan answers None (the grid is made with its floors): it never makes a grid whose fitting point it
    left out. Half way the leanest point is simulated and does not fit: None too (a point that would be
    simulated ends the scan)."""
    capacity = _bytes_at(share)
    step, _steps, made = _grid(capacity, scan=False)
    fitting = [p.config for p in made if step.memory.fits(p)]
    _step, _scanned_steps, scanned = _grid(capacity, scan=True)
    assert scanned is None
    assert len(fitting) == (1 if share == 1.0 else 0)
    if fitting:
        assert fitting[0]["sp"] and fitting[0]["zero"] == 3 and fitting[0]["recompute"] == "blocks"


@pytest.mark.slow   # ~45 s of a worker: five runs / a whole micro-batch search twice
def test_the_search_over_counts_ends_alike_with_the_scan_and_without(monkeypatch):
    """The micro-batch search (whole batch first, then more micro-batches) on a device below every one-batch
    point's bound: the scouts that raise scan their grids (some scan makes one), and the plan, its trace and
    baselines included, is the one the branch and bound alone gives; the scout of the whole batch raises the same
    DoesNotFit, message and figures."""
    made = []
    inner = step_module._unfitting_grid

    def counted(step, steps):
        found = inner(step, steps)
        made.append(found is not None)
        return found

    monkeypatch.setattr(step_module, "_unfitting_grid", counted)
    machine = replace(MACHINE, memory_capacity=_bytes_at(0.0) - 1)
    said = []
    scanned = optimize("gpt", machine, devices=8, sizes=SIZES, pipeline=False, progress=said.append)
    assert any(made)
    monkeypatch.setattr(step_module, "_unfitting_grid", lambda step, steps: None)
    said_made = []
    plain = optimize("gpt", machine, devices=8, sizes=SIZES, pipeline=False, progress=said_made.append)
    assert without_timing(json.loads(scanned.to_json())) == without_timing(json.loads(plain.to_json()))
    assert _untimed(said) == _untimed(said_made)

    # the scout of one micro-batch on that device: the same DoesNotFit, its grid scanned
    errors = []
    for unfitting in (counted, lambda step, steps: None):
        monkeypatch.setattr(step_module, "_unfitting_grid", unfitting)
        made.clear()
        scout = step_context(resolve_request("gpt", machine, None, None, 8, sizes=SIZES), 1, scout=True)
        with pytest.raises(DoesNotFit) as raised:
            step_module.search_step(scout, Deadline.starting_now(Limits.resolve(None)))
        errors.append((str(raised.value), raised.value.needed_bytes, raised.value.capacity_bytes, any(made)))
    assert errors[0][:3] == errors[1][:3] and errors[0][3]
