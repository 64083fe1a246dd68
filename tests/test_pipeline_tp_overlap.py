"""Tensor-parallel communication overlap in a pipelined stage's price (`cost.pipeline.TpOverlap`): the step
simulator's overlap of one micro-batch of the stage plan (`ExecutionProfile.tp_comm_overlap`) taken off the
chunks' forward and backward, never more than their in-node collectives."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.cost.pcg_tasks import DDP, PARSAT_RUN, simulate_pcg
from parsat.cost.pipeline import NO_OVERLAP, StageMemo, StagePricer, equal_starts, pipelined, tp_overlap
from parsat.dsl.library import load_library, shipped_rules_dir
from parsat.ir.machine import Machine
from parsat.ir.megatron import megatron_pcg
from parsat.ir.pipeline import ONE_F_ONE_B
from parsat.search.optimize import optimize
from parsat.search.solve import price_pcg

LIB = load_library([shipped_rules_dir() / "ops.rule"])[0]
MACHINE = Machine.resolve("h100x8").with_devices(4)   # 2 stages of tp 2, inside one node


@pytest.fixture(scope="module")
def sp_stage():
    """A gpt stage plan in Megatron's tensor- and sequence-parallel layout on tp 2 (all-gathers feeding the
    column-parallel GEMMs, reduce-scatters of the row-parallel ones: what the overlap pipelines)."""
    plan = optimize("gpt", "h100x8", devices=2, sizes={"blocks": 4, "batch": 8, "seq": 512, "hidden": 1024,
                                                       "heads": 8, "vocab": 4096},
                    microbatches=4, pipeline=False, baselines=False, degrees={"tp": 2}, recompute="none")
    pcg = megatron_pcg(plan.graph, LIB, (1, 2), 8, sequence=True)
    return replace(plan, pcg=pcg, costs=price_pcg(pcg, LIB, plan.machine, True, plan.graph.microbatches))


def _priced(plan, tp_comm_overlap, library=LIB):
    pricer = StagePricer(plan, MACHINE, memo=StageMemo(library=library), tp_comm_overlap=tp_comm_overlap)
    return pricer, pricer.pipelined(2, ONE_F_ONE_B, starts=equal_starts(pricer.layer_map.layers, 2))


def test_the_overlap_shortens_a_tensor_parallel_stage_and_off_it_changes_nothing(sp_stage):
    on_pricer, on = _priced(sp_stage, None)            # h100x8's profile: DDP, the overlap on
    _off_pricer, off = _priced(sp_stage, False)
    _none, without = _priced(sp_stage, None, library=None)   # no library: no simulation, the per-node sums
    assert off.totals.time_s == without.totals.time_s
    assert off.pipeline.chunk_forward_s == without.pipeline.chunk_forward_s
    assert on.totals.time_s < off.totals.time_s
    overlap = on_pricer.overlap
    assert 0 < overlap.forward <= 1 and 0 < overlap.backward <= 1
    for c, chunk in enumerate(on.pipeline.chunk_forward_s):
        assert chunk < off.pipeline.chunk_forward_s[c] and on.pipeline.chunk_backward_s[c] < \
            off.pipeline.chunk_backward_s[c]
    # memory is not the overlap's: the same per stage
    assert [s.memory_bytes for s in on.pipeline.stages] == [s.memory_bytes for s in off.pipeline.stages]


def test_the_saving_is_the_simulator_s_and_the_price_never_drops_below_the_computation(sp_stage):
    pricer, on = _priced(sp_stage, None)
    base = replace(DDP, overlap_param_gather=False)
    runs = [simulate_pcg(sp_stage.pcg, LIB, sp_stage.machine, replace(base, tp_comm_overlap=flag), microbatches=1)
            for flag in (True, False)]
    saved = pricer.overlap.saved_forward_s + pricer.overlap.saved_backward_s
    assert saved == pytest.approx(runs[1].step_s - runs[0].step_s, rel=0.05)
    # the floor: every in-node activation collective free (its whole time hidden)
    hideable = {i for i, s in pricer.shares.items() if s.tp_comm_s > 0}
    assert hideable
    free = replace(sp_stage, costs={i: replace(c, comm_s=0.0) if i in hideable else c
                                    for i, c in sp_stage.costs.items()})
    _p, floor = _priced(free, False)
    assert floor.totals.time_s <= on.totals.time_s
    for c, chunk in enumerate(on.pipeline.chunk_forward_s):
        assert chunk >= floor.pipeline.chunk_forward_s[c] - 1e-15
        assert on.pipeline.chunk_backward_s[c] >= floor.pipeline.chunk_backward_s[c] - 1e-15
    # a saving larger than the collectives takes them all off and no more
    capped = replace(pricer.overlap, forward=1.0, backward=1.0)
    for share in pricer.shares.values():
        done = capped.applied(share)
        assert done.forward_s >= share.forward_s - share.tp_comm_s - 1e-18


def test_no_simulation_where_the_profile_pipelines_nothing(sp_stage):
    assert tp_overlap(sp_stage, LIB, PARSAT_RUN, 1.0) is NO_OVERLAP
    assert tp_overlap(sp_stage, LIB, replace(DDP, tp_comm_overlap=False), 1.0) is NO_OVERLAP
    assert tp_overlap(sp_stage, LIB, DDP, 0.0) is NO_OVERLAP
    # the public helper takes the library and gives the pricer's figure; a memo simulates a stage plan once
    cut = equal_starts(StagePricer(sp_stage, MACHINE).layer_map.layers, 2)
    assert pipelined(sp_stage, 2, ONE_F_ONE_B, MACHINE, starts=cut, library=LIB).totals.time_s == \
        _priced(sp_stage, None)[1].totals.time_s
    memo = StageMemo(library=LIB)
    first = StagePricer(sp_stage, MACHINE, memo=memo).overlap
    assert StagePricer(sp_stage, MACHINE, memo=memo).overlap is first


def test_where_no_collective_pipelines_one_simulation_gives_the_overlap_both_would(sp_stage, monkeypatch):
    """Without sequence parallelism tp 2 runs all-reduces, which no profile pipelines (`_Builder._pipelines`): the
    run without `tp_comm_overlap` builds the same tasks, so `tp_overlap` simulates once and gives what the two
    simulations give (nothing saved); with sequence parallelism it simulates twice and saves. Fails if the one
    simulation were taken where a collective pipelines (the sequence-parallel stage's overlap would be 0)."""
    import parsat.cost.pipeline as pipeline_module
    pcg = megatron_pcg(sp_stage.graph, LIB, (1, 2), 8, sequence=False)
    plain = replace(sp_stage, pcg=pcg, costs=price_pcg(pcg, LIB, sp_stage.machine, True, sp_stage.graph.microbatches))
    base = replace(DDP, overlap_param_gather=False)
    runs = [simulate_pcg(plain.pcg, LIB, plain.machine, replace(base, tp_comm_overlap=flag), microbatches=1)
            for flag in (True, False)]
    assert not runs[0].pipelined and not runs[1].pipelined
    assert runs[0].result.step_s == runs[1].result.step_s
    simulated = []

    def counted(*args, **kwargs):
        found = simulate_pcg(*args, **kwargs)
        simulated.append(found.pipelined)
        return found
    monkeypatch.setattr(pipeline_module, "simulate_pcg", counted)
    found = tp_overlap(plain, LIB, DDP, 1.0)
    assert simulated == [False]
    assert found == replace(NO_OVERLAP, forward=0.0, backward=0.0)
    simulated.clear()
    assert tp_overlap(sp_stage, LIB, DDP, 1.0).saved_forward_s > 0
    assert simulated == [True, False]   # the run with the overlap pipelines, the one without does not
