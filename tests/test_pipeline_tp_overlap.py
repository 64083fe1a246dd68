"""Tensor-parallel communication overlap in a pipelined stage's price (`cost.pipeline.TpOverlap`): the step
simulator's overlap of one micro-batch of the stage plan (`ExecutionProfile.tp_comm_overlap`) taken off the
chunks' forward and backward, never more than their in-node collectives."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.cost.pcg_tasks import DDP, PARSAT_RUN, OpTimes, collective_pipelines, simulate_pcg, task_facts
from parsat.cost.pipeline import NO_OVERLAP, StageMemo, StagePricer, equal_starts, pipelined, tp_overlap
from parsat.cost.step_report import phase_ends
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


def test_where_no_collective_pipelines_no_simulation_gives_the_overlap_both_would(sp_stage, monkeypatch):
    """Without sequence parallelism tp 2 runs all-reduces, which no profile pipelines (`collective_pipelines`
    finds none): the run without `tp_comm_overlap` builds the same tasks as the run with it, so both give the same
    extents and nothing is saved, and `tp_overlap` gives that figure without simulating; with sequence parallelism
    it simulates twice and saves. `collective_pipelines` is what the builder runs pipelined (its `pipelined`).
    Fails if the shortcut were taken where a collective pipelines (the sequence-parallel stage's overlap would be
    0), or if the figure differed from the two simulations' (0 saved, 0 of the collectives hidden)."""
    import parsat.cost.pipeline as pipeline_module
    pcg = megatron_pcg(sp_stage.graph, LIB, (1, 2), 8, sequence=False)
    plain = replace(sp_stage, pcg=pcg, costs=price_pcg(pcg, LIB, sp_stage.machine, True, sp_stage.graph.microbatches))
    base = replace(DDP, overlap_param_gather=False)
    runs = [simulate_pcg(plain.pcg, LIB, plain.machine, replace(base, tp_comm_overlap=flag), microbatches=1)
            for flag in (True, False)]
    assert not runs[0].pipelined and not runs[1].pipelined
    assert runs[0].result.step_s == runs[1].result.step_s
    assert not collective_pipelines(plain.pcg, base)
    piped = collective_pipelines(sp_stage.pcg, base)
    assert piped and simulate_pcg(sp_stage.pcg, LIB, sp_stage.machine, base, microbatches=1).pipelined
    assert not collective_pipelines(sp_stage.pcg, replace(base, tp_comm_overlap=False))
    # what the two simulations give, as `tp_overlap` worked it out from them
    ends = [phase_ends(r) for r in runs]
    extents = [(e.get("forward", 0.0), e.get("backward", e.get("forward", 0.0)) - e.get("forward", 0.0))
               for e in ends]
    both = (extents[1][0] - extents[0][0], extents[1][1] - extents[0][1])
    assert both == (0.0, 0.0)
    simulated = []

    def counted(*args, **kwargs):
        found = simulate_pcg(*args, **kwargs)
        simulated.append(found.pipelined)
        return found
    monkeypatch.setattr(pipeline_module, "simulate_pcg", counted)
    found = tp_overlap(plain, LIB, DDP, 1.0)
    assert simulated == []
    assert found == replace(NO_OVERLAP, forward=min(1.0, both[0] / 1.0), backward=min(1.0, both[1] / 1.0),
                            saved_forward_s=both[0], saved_backward_s=both[1])
    assert tp_overlap(sp_stage, LIB, DDP, 1.0).saved_forward_s > 0
    assert simulated == [True, False]   # the run with the overlap pipelines, the one without does not


def _tasks(prediction):
    """A simulated step's tasks, column by column, and its step: what two simulations must agree on."""
    b = prediction.result._columns[0]
    return b.names, b.stream_of, b.durations, b.deps, b.allocs, b.frees, b.phases, prediction.result.step_s


def test_a_simulation_reading_another_profile_s_task_facts_builds_the_tasks_it_builds_alone(sp_stage):
    """The task builder's per-node facts are kept with the PCG for every profile that differs in `tp_comm_overlap`
    alone (`pcg_tasks.task_facts`): a run with the overlap after one without (and the reverse) builds the tasks a
    fresh copy of the PCG builds, task by task. Fails if a product the overlap pipelines read the unpipelined
    backward the run without it left (its chunks would be one whole task), or a fact were keyed too loosely."""
    base = replace(DDP, overlap_param_gather=False)
    on, off = replace(base, tp_comm_overlap=True), replace(base, tp_comm_overlap=False)
    machine = sp_stage.machine
    for first, second in ((off, on), (on, off)):
        pcg, times = replace(sp_stage.pcg), OpTimes(LIB, machine)   # a copy: no facts kept yet
        simulate_pcg(pcg, LIB, machine, first, times=times, microbatches=2)
        assert any(task_facts(pcg, machine, second, times))   # the second run reads the first's
        shared = simulate_pcg(pcg, LIB, machine, second, times=times, microbatches=2)
        alone = simulate_pcg(replace(sp_stage.pcg), LIB, machine, second, times=OpTimes(LIB, machine),
                             microbatches=2)
        assert _tasks(shared) == _tasks(alone)
        assert shared.pipelined is (second is on)
        # with the overlap, products run their backward in chunks too, which the facts must not skip
        assert any(" backward [1/2]" in name for name in _tasks(shared)[0]) is (second is on)


def test_the_phase_ends_are_the_timeline_s(sp_stage):
    """`step_report.phase_ends` (what `tp_overlap` reads) gives each reported phase's end as `summarize`'s
    timeline does, on a pipelined step of two micro-batches."""
    from parsat.cost.step_report import summarize
    prediction = simulate_pcg(sp_stage.pcg, LIB, sp_stage.machine, DDP, microbatches=2)
    timeline = summarize(prediction, DDP.name, 2)[1]
    ends = phase_ends(prediction)
    assert {p.phase: p.end_s for p in timeline.phases} == {p: ends[p] for p in (q.phase for q in timeline.phases)}
    assert ends["backward"] > ends["forward"] > 0


def test_the_overlap_memo_gives_each_stage_plan_its_own_figure(sp_stage):
    """`StageMemo.overlap` keeps many stage plans' overlaps by their PCGs' content: two stage plans differing in
    one field (their recomputation) each get their own simulation's figure, in either order, and the same PCG
    asked again is not simulated again. Fails if the memo returned the other plan's (stale) overlap."""
    recomputed = replace(sp_stage, pcg=replace(sp_stage.pcg, recompute="blocks"))
    comm_s = 1.0
    alone = [tp_overlap(p, LIB, DDP, comm_s) for p in (sp_stage, recomputed)]
    assert alone[0] != alone[1]
    for order in ((0, 1), (1, 0)):
        memo = StageMemo(library=LIB)
        plans = (sp_stage, recomputed)
        got = {k: memo.overlap(plans[k], DDP, comm_s) for k in order}
        assert [got[0], got[1]] == alone
        assert memo.overlap(plans[order[0]], DDP, comm_s) is got[order[0]]
