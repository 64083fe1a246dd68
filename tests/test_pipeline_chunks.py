"""Interleaved chunks as Megatron-LM cuts them: each stage's layers split evenly into its chunks
(`ir.pipeline.interleaved_chunk_counts`), in the search's choice, the pricing and the pin."""

from __future__ import annotations

import json

import pytest

from parsat.cost.pipeline import StageFit, StagePricer, applicable_schedules, schedule_chunks
from parsat.ir.blocks import OUTSIDE
from parsat.ir.errors import OptimizeError
from parsat.ir.machine import Machine
from parsat.ir.pipeline import INTERLEAVED, PipelineError, chunks_refusal, interleaved_chunk_counts
from parsat.search.optimize import optimize

SIZES = {"blocks": 6, "batch": 8, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}


def test_the_chunks_per_stage_are_those_that_split_each_stages_layers_evenly():
    """105 layers on 35 stages (SC'21's 529.6B) run interleaved only as 3 chunks of one layer, 92 on 4
    (Megatron-Core's 119B) as 23, 112 on 16 as 7; 96 on 12 as 2, 4 or 8. The search prices the least (2 where
    it divides, as before), a pin where it divides, and no interleaved layout where none does."""
    assert interleaved_chunk_counts(105, 35) == (3,)
    assert interleaved_chunk_counts(92, 4) == (23,)
    assert interleaved_chunk_counts(96, 12) == (2, 4, 8)
    assert interleaved_chunk_counts(7, 7) == () and interleaved_chunk_counts(10, 3) == ()
    assert (INTERLEAVED, 3) in applicable_schedules(None, 35, 70, 105)
    assert (INTERLEAVED, 2) not in applicable_schedules(None, 35, 70, 105)
    assert applicable_schedules(INTERLEAVED, 12, 24, 96) == ((INTERLEAVED, 2),)
    assert applicable_schedules(INTERLEAVED, 12, 24, 96, chunks=4) == ((INTERLEAVED, 4),)
    assert applicable_schedules(INTERLEAVED, 12, 24, 96, chunks=5) == ()
    assert applicable_schedules(INTERLEAVED, 3, 6, 10) == ()
    assert schedule_chunks("1f1b", 3, 10) == 1 and schedule_chunks("1f1b", 3, 12, pinned=2) is None
    assert "evenly" in chunks_refusal(INTERLEAVED, 105, 35, 2) and chunks_refusal(INTERLEAVED, 105, 35, 3) is None


@pytest.fixture(scope="module")
def stage_plan():
    machine = Machine.resolve("cpu").with_devices(2)
    return optimize("gpt", machine, devices=2, sizes=SIZES, microbatches=4, pipeline=False)


def test_the_pricing_refuses_uneven_chunks_and_counts_the_models_layers(stage_plan):
    """6 blocks (7 layers with the embedding's, which rides with the first chunk) on 2 stages: 3 chunks a stage
    of one block each price, 2 chunks a stage (blocks of 2 and 1) are refused with the reason; the memory
    check (`StageFit`) judges by the same schedules."""
    machine = Machine.resolve("cpu").with_devices(4)
    pricer = StagePricer(stage_plan, machine)
    assert pricer.layer_map.model_layers == 6 == len(pricer.layer_map.layers) - 1
    plan = pricer.pipelined(2, INTERLEAVED, 3)
    assert plan.pipeline.layout.chunks_per_stage == 3
    with pytest.raises(PipelineError, match="evenly"):
        pricer.pipelined(2, INTERLEAVED, 2)
    assert StageFit(2, machine, INTERLEAVED).peak_bytes(stage_plan) is not None
    assert StageFit(2, machine, INTERLEAVED, chunks=2).peak_bytes(stage_plan) is None


def test_a_chunks_pin_is_refused_with_its_reason_where_it_cannot_hold():
    """`chunks_per_stage` (Megatron's virtual pipeline size) beside a one-chunk schedule, or one that does not
    split each stage's blocks evenly, is refused before any search."""
    with pytest.raises(OptimizeError, match="interleaved schedule"):
        optimize("gpt", "cpu", devices=4, sizes=SIZES, degrees={"pp": 2}, schedule="1f1b", chunks_per_stage=3)
    with pytest.raises(OptimizeError, match="6 layers on 2 stages split into 3 chunks"):
        optimize("gpt", "cpu", devices=4, sizes=SIZES, degrees={"pp": 2}, chunks_per_stage=2)
    with pytest.raises(OptimizeError, match="positive integer"):
        optimize("gpt", "cpu", devices=4, sizes=SIZES, degrees={"pp": 2}, chunks_per_stage=0)


def test_a_pinned_chunk_count_is_the_plans():
    """Pinned at 3 chunks a stage, the plan is interleaved with 3."""
    plan = optimize("gpt", "cpu", devices=4, sizes=SIZES, degrees={"pp": 2}, microbatches=4, chunks_per_stage=3)
    assert plan.pipeline is not None
    assert (plan.pipeline.schedule, plan.pipeline.layout.chunks_per_stage) == (INTERLEAVED, 3)


def _block_counts(plan) -> list[int]:
    """Each chunk's blocks (the embedding's layer, `OUTSIDE`, left out), in chunk order."""
    return [sum(1 for layer in chunk.layers if layer != OUTSIDE) for chunk in plan.pipeline.layout.chunks]


def test_an_interleaved_cut_keeps_every_chunk_at_the_same_block_count():
    """8 blocks on 2 stages, 2 chunks a stage, with a large vocabulary (the last chunk holds the head): the
    pricer's balanced cut would move a block off the last chunk, a layout Megatron cannot run
    (`chunks_refusal`), so an interleaved schedule is priced at the equal cut alone, 2 blocks a chunk."""
    sizes = dict(SIZES, blocks=8, vocab=4096)
    machine = Machine.resolve("cpu").with_devices(4)
    stage_plan = optimize("gpt", machine.with_devices(2), devices=2, sizes=sizes, microbatches=4, pipeline=False)
    pricer = StagePricer(stage_plan, machine)
    assert len(pricer.start_cuts(2, INTERLEAVED, 2)) == 1
    assert _block_counts(pricer.pipelined(2, INTERLEAVED, 2)) == [2, 2, 2, 2]


def test_a_plan_file_with_uneven_interleaved_chunks_is_refused_on_load(tmp_path, capsys):
    """A plan file whose interleaved chunks hold 2, 1, 1, 2 blocks (edited by hand, or written before the rule)
    is refused when read, with the rule's reason, and `parsat run` says so without a stack trace."""
    from parsat.cli import main
    from parsat.ir.plan import PlanError, load_plan_dict

    plan = optimize("gpt", "cpu", devices=4, sizes=dict(SIZES, blocks=4), degrees={"pp": 2}, microbatches=4,
                    chunks_per_stage=2)
    assert (plan.pipeline.schedule, _block_counts(plan)) == (INTERLEAVED, [1, 1, 1, 1])
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    plan.save(good)
    data = load_plan_dict(good)
    chunks = data["pipeline"]["layout"]["chunks"]
    chunks[0]["layers"].append(chunks[1]["layers"].pop(0))
    bad.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="same number of layers.*2, 0, 1, 1"):
        load_plan_dict(bad)
    assert main(["run", str(bad), "--nproc", "4"]) != 0
    err = capsys.readouterr().err
    assert "same number of layers" in err and "Traceback" not in err
    chunks[0]["layers"] = "1"   # the schema's structure check comes first, with where it failed
    bad.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"pipeline\.layout\.chunks\[0\]\.layers: must be a JSON array"):
        load_plan_dict(bad)
