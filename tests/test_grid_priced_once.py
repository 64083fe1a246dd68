"""The independent grid's work that a step did twice, done once (issue 28): data parallelism, which the step builds
as a baseline, is the grid's tp 1 ZeRO-0 point, laid out once (`baselines.data_parallel`'s `kin`); a stage grid's
first layout of each family, priced for its floor, is priced once (`step._stage_layout_floor`'s `priced`). Each
gives what building and pricing anew gives."""

from __future__ import annotations

from dataclasses import replace

import parsat.search.solve as solve
import parsat.search.step as step_module
from parsat.cost.pipeline import StageFit
from parsat.ir.data_parallel import data_parallel_pcg
from parsat.ir.machine import Machine
from parsat.search.baselines import data_parallel
from parsat.search.mesh import CandidateSteps
from parsat.search.request import resolve_request, step_context

SIZES = {"blocks": 4, "batch": 16, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}
MACHINE = Machine.resolve("h100x8").with_devices(8)


def _stage_machine(p: int) -> Machine:
    return replace(MACHINE.with_devices(8 // p), memory_capacity=MACHINE.memory_capacity * p)


def _stage_step(request, microbatches: int = 4):
    return step_context(request, microbatches, _stage_machine(2), 4, stage=StageFit(2, MACHINE))


def test_data_parallelism_is_the_grid_s_tp_1_point_laid_out_once_and_as_built_alone():
    request = resolve_request("gpt", "h100x8", None, None, 8, sizes=SIZES)
    for microbatches in (1, 2):   # the second graph's layout is its kin's rescaled (`ir.megatron._Kin`)
        step = step_context(request, microbatches)
        dp = step_module.built_once(step, data_parallel)
        alone = data_parallel(step.graph, request.library, step.machine, request.free_input_placements, step.devices)
        assert dp.pcg == alone.pcg and dp.pcg.nodes == alone.pcg.nodes
        assert dp.pcg == data_parallel_pcg(step.graph, request.library, step.devices, step.machine.devices_per_node)
        assert dp.costs == alone.costs and dp.totals == alone.totals
        points = [point for family in step_module._grid_families(step) for _place, point in family
                  if point.config["tp"] == 1 and point.config["zero"] == 0]
        assert points and points[0].pcg is dp.pcg   # taken, not built again


def test_a_stage_grid_prices_each_layout_once_and_keeps_what_pricing_anew_keeps(monkeypatch):
    """Each PCG the stage grid prices is priced once, its floor read from the costs its point reads, and the grid
    keeps the points (configurations, costs, totals) that a floor from its compute nodes alone and pricing each
    point anew give."""
    priced: list = []
    inner = solve.pcg_node_costs

    def counted(pcg, *args, **kwargs):
        priced.append(pcg)
        return inner(pcg, *args, **kwargs)

    def made(floor_alone: bool) -> list:
        request = resolve_request("gpt", "h100x8", None, None, 8, sizes=SIZES)
        stage = _stage_step(request)
        steps = CandidateSteps(request.library, stage.machine, 4)
        with monkeypatch.context() as patch:
            patch.setattr(step_module, "pcg_node_costs", counted)
            patch.setattr("parsat.search.baselines.pcg_node_costs", counted)
            if floor_alone:   # as before: the compute nodes priced for the floor, the point priced anew
                original = step_module._stage_layout_floor
                patch.setattr(step_module, "_stage_layout_floor", lambda step, pcg, _priced=None: original(step, pcg))
            return step_module.independent_points(stage, steps)

    shared = made(floor_alone=False)
    once = list(priced)
    priced.clear()
    alone = made(floor_alone=True)
    assert once and len(set(once)) == len(once)      # no PCG priced twice (PCGs compare by content)
    assert len(set(priced)) < len(priced)            # pricing anew priced some twice (floor, then point)
    assert [p.config for p in shared] == [p.config for p in alone]
    assert [p.totals for p in shared] == [p.totals for p in alone]
    assert [p.costs for p in shared] == [p.costs for p in alone]
    assert [p.pcg for p in shared] == [p.pcg for p in alone]
