"""What the search keeps instead of working out again (`PCG.readers_of`, `PCG.storage_chains`, `pcg_roles` through `PCG.derive`,
`needs_gradient`'s operator look-ups, `extract.bottom_up`'s bound look-ups) gives the answers working them out
afresh gives: the same readers, storage chains, roles and gradients, the same floors and simulated steps, the same
extraction, and a PCG's shared tables cannot be changed through what callers are handed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.cost.pcg_tasks import OpTimes, needs_gradient, step_floor
from parsat.cost.step_report import simulate_step
from parsat.dsl.gradient import gradient_free
from parsat.dsl.checker import resolve_library
from parsat.egraph.runner import Limits
from parsat.egraph.saturate import saturate
from parsat.ir.machine import Machine
from parsat.ir.models import build_example
from parsat.ir.pcg import WEIGHT_PIECE, WEIGHT_ROLES, _pcg_roles, pcg_roles, readers, weight_chains, weight_storage
from parsat.search.baselines import independent_grid
from parsat.search.extract import bottom_up, node_costs
from parsat.search.request import resolve_request, step_context

from test_extraction_passes import _plain_bottom_up  # noqa: E402 (a sibling test module: the pass written plainly)

SIZES = {"blocks": 2, "hidden": 256, "heads": 8, "batch": 64, "seq": 128, "vocab": 1024}


@pytest.fixture(scope="module")
def grid():
    request = resolve_request("gpt", "h100x8", None, None, 8, sizes=SIZES)
    step = step_context(request, 1)
    points = independent_grid(step.graph, request.library, step.machine, True, step.devices, step.memory.fits)
    assert len(points) >= 6
    return request, step, points


def _fresh(pcg):
    """The same PCG as a new object: nothing worked out yet."""
    return replace(pcg, nodes=tuple(pcg.nodes))


def _gradients_afresh(pcg, library) -> dict:
    """`needs_gradient` as it was before it looked each operator up once: per node."""
    out = {}
    for node in pcg.nodes:
        if node.kind == "leaf":
            out[node.id] = node.role == "weight"
            continue
        op = library.ops.get(node.op) if node.kind == "op" else None
        free = gradient_free(op) if op is not None else frozenset()
        names = [p.name for p in op.tensor_params] if op is not None else []
        out[node.id] = any(out[i] for k, i in enumerate(node.inputs) if k >= len(names) or names[k] not in free)
    return out


def test_a_pcg_s_kept_readers_storage_and_gradients_are_those_worked_out_afresh(grid):
    request, _step, points = grid
    assert any(point.pcg.zero for point in points) and any(len(weight_storage(p.pcg)) for p in points)
    assert any(WEIGHT_PIECE in pcg_roles(p.pcg).values() for p in points)   # stored pieces among the roles
    for point in points:
        pcg = point.pcg
        assert pcg.readers_of == {i: tuple(users) for i, users in readers(pcg).items()}
        assert weight_storage(pcg) == weight_storage(_fresh(pcg))
        assert needs_gradient(pcg, request.library) == _gradients_afresh(pcg, request.library)
        handed = weight_storage(pcg)
        handed.clear()
        assert weight_storage(pcg) == weight_storage(_fresh(pcg))   # a caller's copy, not the PCG's table
        assert pcg == _fresh(pcg) and hash(pcg) == hash(_fresh(pcg))   # kept tables are no part of its value
        roles = pcg_roles(pcg)
        assert roles == _pcg_roles(_fresh(pcg)) and roles
        assert pcg_roles(pcg) is roles   # worked out once per PCG and shared (`PCG.derive`): read only
        assert weight_chains(pcg) == {i for i, role in _pcg_roles(_fresh(pcg)).items() if role in WEIGHT_ROLES}


def test_floors_and_simulated_steps_are_the_same_with_the_tables_kept_or_not(grid):
    request, step, points = grid
    machine = step.machine
    for point in points[:6]:
        warm, cold = point.pcg, _fresh(point.pcg)
        times = OpTimes(request.library, machine)
        for plan in (False, True):
            assert step_floor(warm, machine, times, 2, plan=plan) == \
                step_floor(cold, machine, OpTimes(request.library, machine), 2, plan=plan)
        streams, timeline = simulate_step(warm, request.library, machine, 2, times)
        assert (streams, timeline) == simulate_step(_fresh(point.pcg), request.library, machine, 2,
                                                    OpTimes(request.library, machine))


def test_bottom_up_chooses_as_it_did_before_its_look_ups_were_bound():
    library = resolve_library(None)
    graph = build_example("mlp", library=library)
    result = saturate(graph, library, library.rules, 2, Limits())
    snapshot = result.snapshot
    costs = node_costs(snapshot, graph, library, Machine.preset("cpu").with_devices(2))
    assert len(costs) > 20
    for usable in (lambda nid: nid in costs, lambda nid: nid in costs and nid[1] % 2 == 0):
        assert bottom_up(snapshot, costs, usable) == _plain_bottom_up(snapshot, costs, usable)
