"""Extraction finds a plan that fits where every pass ranked by time alone finds none (`extract.lean_choices`).

The passes (bottom-up, greedy DAG) rank by time, and the ILP, which holds the memory limit, sees only the
e-nodes their order admits: a plan that fits by sharding more lay outside it. On llama-70b on 64 H100s every
unstaged joint plan "needed" 168-280 GiB while the same e-graph held a plan of 75.7 GiB (found when pinned
dp 16 x tp 4). Here the same on a small LLaMA with grouped-query attention on 4 cpu devices, its device memory set
below what the fastest plans need."""

from __future__ import annotations

import dataclasses

import pytest

import parsat
from parsat.ir.errors import DoesNotFit
from parsat.ir.machine import Machine
from parsat.ir.models import llama
from parsat.ir.plan import load_plan_dict
from parsat.search.extract import LEAN, LEAN_ILP

MIB = 2 ** 20


def _plan(capacity_mib: float):
    machine = dataclasses.replace(Machine.preset("cpu"), memory_capacity=capacity_mib * MIB)
    graph = llama(blocks=2, batch=8, seq=32, hidden=128, heads=8, kv_heads=2, ffn=256, vocab=256)
    return parsat.optimize(graph, machine=machine, devices=4, microbatches=1, recompute="none")


def test_a_plan_that_fits_by_sharding_more_is_found_where_the_fastest_do_not_fit(tmp_path):
    roomy = _plan(3.5)   # the grid's dp 2 x tp 2 point, 3.48 MiB
    tight = _plan(3.0)   # 38aa390: "no plan fits in memory: the smallest plan found needs 4.11 MiB"
    assert tight.totals.peak_memory_bytes <= 3.0 * MIB
    assert tight.totals.time_s > roomy.totals.time_s   # memory bought with time
    assert tight.extraction["chosen"] == "joint" and tight.extraction["method"] in (LEAN, LEAN_ILP)
    # the passes that found none are written null (the schema's), and the plan reads back
    tight.save(tmp_path / "tight.json")
    record = load_plan_dict(tmp_path / "tight.json")["extraction"]["candidates"]
    assert None in record.values() and record[tight.extraction["method"]] is not None


def test_below_every_plan_it_is_still_a_clear_refusal():
    with pytest.raises(DoesNotFit, match="no plan fits in memory"):
        _plan(1.0)
