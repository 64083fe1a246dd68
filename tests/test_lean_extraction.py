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


@pytest.fixture(scope="module")
def tight():
    """The search at 4.0 MiB, once for the module, with each lean-asking extraction recorded: (the plan, the
    calls as [the policy's ZeRO stage, asked lean, found lean])."""
    calls: list = []
    with pytest.MonkeyPatch.context() as patch:
        _record_lean_calls(patch, calls)
        return _plan(4.0), calls


@pytest.fixture(scope="module")
def roomy():
    """The search at 64 MiB, where every policy's fastest plan fits, once for the module, with its lean-asking
    extractions recorded as `tight`'s are. Its plan is the one the search finds at 4.5 MiB (the grid's dp 2 x tp 2
    point, 3.48 MiB by the per-node bound, 4.34 MiB simulated: the same point, the same step time), so the first
    test compares the tight plan with it as it did with a search of its own at 4.5 MiB, and asserts it fits there."""
    calls: list = []
    with pytest.MonkeyPatch.context() as patch:
        _record_lean_calls(patch, calls)
        return _plan(64.0), calls


def _record_lean_calls(patch: pytest.MonkeyPatch, calls: list) -> None:
    """`mesh.solve` patched to append [the policy's ZeRO stage, asked lean, found lean] for each policy's
    extraction (a baseline's restricted one passes no `lean`)."""
    import parsat.search.mesh as mesh

    solve = mesh.solve

    def recording(*args, **kwargs):
        if "lean" not in kwargs:
            return solve(*args, **kwargs)
        call = [kwargs["zero"], kwargs["lean"], None]
        calls.append(call)   # in the order the calls start (a policy's solve asks the next ones inside it)
        pcg, costs, extraction = solve(*args, **kwargs)
        call[2] = extraction.lean
        return pcg, costs, extraction

    patch.setattr(mesh, "solve", recording)


def test_a_plan_that_fits_by_sharding_more_is_found_where_the_fastest_do_not_fit(tight, roomy, tmp_path):
    # device memory is judged by the simulated peak where a plan is simulated (`Totals.memory_bytes`: on this cpu
    # machine, as `parsat run` holds it, every activation and the whole batch kept to the end of the step)
    roomy, _calls = roomy  # the grid's dp 2 x tp 2 point, 3.48 MiB by the per-node bound, 4.34 MiB simulated
    assert roomy.totals.memory_bytes <= 4.5 * MIB   # a plan that fits in 4.5 MiB, as the search there finds
    tight, _calls = tight  # a joint plan storing weights split (ZeRO-2), 3.09 MiB by the bound, 3.82 MiB simulated
    assert tight.totals.memory_bytes <= 4.0 * MIB and tight.totals.fits(tight.machine)
    assert tight.totals.time_s > roomy.totals.time_s   # memory bought with time
    assert tight.extraction["chosen"] == "joint" and tight.extraction["method"] in (LEAN, LEAN_ILP)
    # the passes that found none are written null (the schema's), and the plan reads back
    tight.save(tmp_path / "tight.json")
    record = load_plan_dict(tmp_path / "tight.json")["extraction"]["candidates"]
    assert None in record.values() and record[tight.extraction["method"]] is not None


def test_below_every_plan_it_is_still_a_clear_refusal():
    with pytest.raises(DoesNotFit, match="no plan fits in memory"):
        _plan(1.0)



def test_where_the_leanest_policy_fits_only_lean_the_policies_between_are_asked_lean_too(tight, roomy):
    """The leanest policy (ZeRO-2 here) fits only by trading time for memory: then no policy between fits by time
    either, and each is asked lean as well, the fastest of the lean plans kept (llama-70b on 64 H100s
    `--no-pipeline`: the leanest's lean plan 22.620 s, ZeRO-1's 14.985 s). Where a time-ranked pass fits, no
    policy but the leanest is asked lean."""
    tight, calls = tight
    assert tight.extraction["method"] in (LEAN, LEAN_ILP)
    # each mesh's extractions: ZeRO-0 by time, the leanest (ZeRO-2) lean, then ZeRO-1
    runs = [calls[i:i + 3] for i, call in enumerate(calls) if call[0] == 0 and i + 2 < len(calls)]
    leaned = [run for run in runs if run[1][:3] == [2, True, True]]
    assert leaned, calls
    assert all([(zero, lean) for zero, lean, _ in run] == [(0, False), (2, True), (1, True)] for run in leaned)
    _roomy, roomy_calls = roomy   # every policy's fastest plan fits: the first policy, by time
    assert roomy_calls and all(call == [0, False, False] for call in roomy_calls)
