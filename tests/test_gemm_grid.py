"""A calibrated machine's GEMM price: measured on a grid of products, read between its points, the fit beyond."""

from __future__ import annotations

import json
from math import prod

import pytest

from parsat.ir.errors import MachineError
from parsat.ir.gemm_grid import GemmGrid, grid_fractions
from parsat.ir.machine import PRESETS
from parsat.ir.machine_profile import OpEfficiency

PEAK, HALVES, DISPATCH = 45e9, (8.0, 16.0, 4.0), 5e-6
NODES = (128, 256, 512)


def hockney(m, n, k, halves=HALVES):
    return 1 / prod(1 + h / x for h, x in zip(halves, (m, n, k)))


def seconds(m, n, k, slower=None):
    """A call as calibrated: its dispatch and its FLOPs at the Hockney rate, `slower` x at the shapes it names."""
    return DISPATCH + 2.0 * m * n * k / (PEAK * hockney(m, n, k)) * (slower or {}).get((m, n, k), 1.0)


def grid_machine(slower=None) -> OpEfficiency:
    measured = {(a, b, c): seconds(a, b, c, slower) for a in NODES for b in NODES for c in NODES}
    grid = grid_fractions("nn", measured, NODES, PEAK, DISPATCH)
    return OpEfficiency(dispatch_s=DISPATCH, gemm_half_m=HALVES[0], gemm_half_n=HALVES[1], gemm_half_k=HALVES[2],
                        gemm_grids=(grid,))


def priced(eff: OpEfficiency, m, n, k) -> float:
    return DISPATCH + 2.0 * m * n * k / (PEAK * eff.gemm_efficiency(m, n, k))


def test_a_grid_point_is_priced_as_measured_even_where_the_fit_misses_it():
    """256 x 512 x 128 measured 1.3x what the curve gives: priced at 1.3x there, not at the fit; a product between
    grid points reads its neighbours in log space (halfway between 256 and 512 in log2 is 362)."""
    slow = {(256, 512, 128): 1.3}
    eff = grid_machine(slow)
    assert priced(eff, 256, 512, 128) == pytest.approx(seconds(256, 512, 128, slow), rel=1e-12)
    assert priced(eff, 512, 512, 512) == pytest.approx(seconds(512, 512, 512), rel=1e-12)
    middle = 256 * 2 ** 0.5
    fraction = 2.0 * middle * 512 * 128 / (PEAK * (priced(eff, middle, 512, 128) - DISPATCH))
    ends = [2.0 * x * 512 * 128 / (PEAK * (seconds(x, 512, 128, slow) - DISPATCH)) for x in (256, 512)]
    assert fraction == pytest.approx((ends[0] * ends[1]) ** 0.5, rel=1e-3)


def test_beyond_the_grid_the_fit_carries_the_nearest_measured_point():
    """The demo's head ([128, 256] @ [256, 10]: n = 10, below the grid) and its first layer (k = 784, above it):
    the nearest point of the grid's box, read from its measured points, times the curve's change from there."""
    eff = grid_machine({(128, 128, 256): 1.2, (256, 256, 512): 0.9})
    for shape, edge in (((128, 10, 256), (128, 128, 256)), ((128, 256, 784), (128, 256, 512))):
        at_edge = eff.gemm_efficiency(*edge)
        assert eff.gemm_efficiency(*shape) == pytest.approx(at_edge * hockney(*shape) / hockney(*edge), rel=1e-12)
    assert eff.gemm_efficiency(128, 128, 256) == pytest.approx(hockney(128, 128, 256) / 1.2, rel=1e-12)


def test_a_dispatch_bound_shape_does_not_move_a_product_priced_on_the_grid(monkeypatch):
    """Small calls (8 to 32 a side: 3-6 us, mostly their dispatch) are read by the fit alone: timed 3x slower,
    they move the fitted peak but not the price of any product inside the grid."""
    pytest.importorskip("torch")
    from parsat.backend import calibrate
    from parsat.backend.calibrate import OpTiming, fit_gemm, fit_grids, gemm_grid_nodes, gemm_shapes

    monkeypatch.setattr(calibrate, "HALF_GRID", (0, 4, 8, 16, 32))   # the half lengths' search, smaller (fast)

    def machine(slow_small: float) -> OpEfficiency:
        timings = [OpTiming("matmul", s, seconds(*s) * (slow_small if max(s) <= 32 else 1.0),
                            2.0 * prod(s), 0.0) for s in gemm_shapes(512)]
        peak, halves = fit_gemm(timings)
        grids = fit_grids(timings, gemm_grid_nodes(512), peak, DISPATCH)
        return OpEfficiency(dispatch_s=DISPATCH, gemm_half_m=halves[0], gemm_half_n=halves[1],
                            gemm_half_k=halves[2], **grids), peak

    (plain, plain_peak), (dragged, dragged_peak) = machine(1.0), machine(3.0)
    assert plain_peak == pytest.approx(PEAK)
    assert dragged_peak != pytest.approx(PEAK, rel=0.01)   # the fit moved ...
    for shape in ((128, 256, 512), (200, 300, 400), (512, 512, 512)):   # ... the grid's prices did not
        assert 2.0 * prod(shape) / (dragged_peak * dragged.gemm_efficiency(*shape)) == pytest.approx(
            2.0 * prod(shape) / (plain_peak * plain.gemm_efficiency(*shape)), rel=1e-9)


def test_the_calibration_times_every_combination_of_the_grid_sizes():
    pytest.importorskip("torch")
    from parsat.backend.calibrate import gemm_grid_nodes, gemm_shapes

    assert gemm_grid_nodes(512) == NODES
    shapes = gemm_shapes(512)
    assert len(shapes) == len(set(shapes))
    assert {(a, b, c) for a in NODES for b in NODES for c in NODES} <= set(shapes)
    assert (8, 512, 512) in shapes and (8, 8, 8) in shapes   # the fit's small and skinny products stay


def test_a_grid_missing_a_point_or_a_call_within_its_dispatch_gives_none():
    measured = {(a, b, c): seconds(a, b, c) for a in NODES for b in NODES for c in NODES}
    assert grid_fractions("nn", {s: t for s, t in measured.items() if s != (128, 256, 512)}, NODES, PEAK,
                          DISPATCH) is None
    assert grid_fractions("nn", measured | {(128, 128, 128): DISPATCH}, NODES, PEAK, DISPATCH) is None
    assert grid_fractions("nn", measured, (512,), PEAK, DISPATCH) is None


def test_the_grid_round_trips_through_the_machine_file_and_is_checked():
    eff = grid_machine({(256, 256, 256): 1.1})
    data = json.loads(json.dumps(eff.to_dict()))
    assert OpEfficiency.from_dict(data) == eff
    assert "gemm_grids" not in OpEfficiency().to_dict()
    bad = json.loads(json.dumps(data))
    bad["gemm_grids"]["nn"]["fractions"].pop()
    with pytest.raises(MachineError, match="one fraction per grid point"):
        OpEfficiency.from_dict(bad)
    bad = json.loads(json.dumps(data))
    bad["gemm_grids"]["nn"]["m"] = [256, 128, 512]
    with pytest.raises(MachineError, match="growing"):
        OpEfficiency.from_dict(bad)
    bad = json.loads(json.dumps(data))
    bad["gemm_grids"]["xx"] = bad["gemm_grids"].pop("nn")
    with pytest.raises(MachineError, match="unknown field"):
        OpEfficiency.from_dict(bad)


def test_a_machine_without_a_grid_prices_by_its_curve_as_before():
    """The presets (fitted to published tables) have no grid: their GEMM rate is the Hockney curve, unchanged."""
    for machine in PRESETS.values():
        e = machine.efficiency
        assert not e.gemm_grids
        expected = e.gemm_peak_fraction / prod(1 + h / x for h, x in zip((e.gemm_half_m, e.gemm_half_n,
                                                                             e.gemm_half_k), (128, 1000, 4096)))
        assert e.gemm_efficiency(128, 1000, 4096) == expected


def test_a_grid_of_one_layout_leaves_the_others_to_their_curves():
    grid = GemmGrid("tn", (128.0, 512.0), (128.0, 512.0), (128.0, 512.0), (0.5,) * 8)
    eff = OpEfficiency(gemm_tn_rate=1.1, gemm_nt_rate=0.9, gemm_nt_half_m=16.0, gemm_grids=(grid,))
    assert eff.layout_efficiency("tn", 200, 300, 400) == pytest.approx(0.5)
    assert eff.layout_efficiency("nt", 200, 300, 400) == pytest.approx(0.9 / (1 + 16 / 200))
    assert eff.gemm_efficiency(200, 300, 400) == 1.0


def test_a_grid_product_is_timed_in_a_third_of_a_round():
    """The grid's 81 products in rounds a third as long (`GRID_ROUND_SHARE`): 2 calls of 0.9 ms a round where a
    product of the fit makes 6 (a 30 ms window over 5 rounds), each figure still the median of the passes."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from parsat.backend import calibrate
    from parsat.backend.launch import RankContext

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        now = [0.0]
        calls = {"fit": 0, "grid": 0}

        def call(name):
            def run():
                calls[name] += 1
                now[0] += 0.0009
            return run

        budget = calibrate.Budget(repeats=5, window_s=0.03, clock=lambda: now[0])
        products = calibrate.GemmPasses(RankContext(0, 1, "gloo", torch.device("cpu")), budget, lambda: None)
        products.add(["matmul", [8, 8, 8], 1024.0, 0.0], call("fit"))
        products.add(["matmul", [96, 96, 96], 1024.0, 0.0], call("grid"), round_share=calibrate.GRID_ROUND_SHARE)
        calls.update(fit=0, grid=0)
        products.run_pass()
        assert calls == {"fit": 6, "grid": 2}
        assert [row[2] for row in products.rows()] == [pytest.approx(0.0009)] * 2
    finally:
        dist.destroy_process_group()
