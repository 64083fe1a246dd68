"""Activation recomputation (parsat/ir/recompute.py, parsat/search/recompute.py): which nodes a block re-runs, what that
costs per node, in the plan's totals and in the simulated step, and when the search turns it on."""

from __future__ import annotations

from dataclasses import replace

import pytest

import parsat
from parsat.ir.blocks import OUTSIDE, node_blocks
from parsat.ir.costs import NodeCost, totals
from parsat.ir.machine import Machine
from parsat.ir.pcg import weight_chains
from parsat.ir.plan import load_plan_dict, pcg_from_dict
from parsat.ir.recompute import BLOCKS, NONE, RecomputeError, checkpoints
from parsat.ir.errors import DoesNotFit, OptimizeError
from parsat.dsl.checker import resolve_library
from parsat.cost.pcg_tasks import DDP, simulate_pcg
from parsat.search.solve import price_pcg
from parsat.report.explain import explain_plan

SIZES = {"blocks": 3, "hidden": 64, "heads": 4, "seq": 64, "batch": 8, "vocab": 256}


@pytest.fixture(scope="module")
def library():
    return resolve_library(None)


@pytest.fixture(scope="module")
def one_device():
    return parsat.optimize("gpt", "h100x8", devices=1, sizes=SIZES, pipeline=False,
                           recompute=NONE, baselines=False)


# Compute slow and links nearly free inside a node: at these tiny sizes a plan splits.
SLOW = Machine("two-nodes-of-two", 2, 2, peak_flops=1e8, memory_bandwidth=1e12, memory_capacity=2 ** 30,
               intra_bandwidth=1e12, intra_latency=1e-9, inter_bandwidth=1e9, inter_latency=1e-6)


@pytest.fixture(scope="module")
def tensor_parallel():
    return parsat.optimize("gpt", SLOW, devices=2, sizes=SIZES, pipeline=False,
                           recompute=NONE, baselines=False, degrees={"tp": 2})


def test_each_block_keeps_only_what_leaves_it(one_device):
    pcg = replace(one_device.pcg, recompute=BLOCKS)
    blocks = node_blocks(pcg)
    found = checkpoints(pcg)
    assert [c.block for c in found] == [0, 1, 2]
    chains = weight_chains(pcg)
    readers = {}
    for node in pcg.nodes:
        for i in node.inputs:
            readers.setdefault(i, set()).add(blocks[node.id])
    for c in found:
        assert c.dropped, "a block keeps every value: nothing is saved"
        for ident in c.runs:
            assert blocks[ident] == c.block and ident not in chains and pcg.node(ident).kind != "leaf"
            crosses = ident in pcg.outputs or not readers.get(ident, set()) <= {c.block}
            assert (ident in c.kept) == crosses
    assert not checkpoints(one_device.pcg)      # "none": nothing recomputed
    assert all(blocks[i] != OUTSIDE for c in found for i in c.dropped)


def test_unknown_policy_is_refused(one_device):
    with pytest.raises(RecomputeError, match="unknown recomputation policy 'most'"):
        checkpoints(replace(one_device.pcg, recompute="most"))


def test_node_cost_recomputed():
    cost = NodeCost(forward_s=1.0, backward_s=2.0, comm_s=0.5, comm_elements=30, memory_bytes=100,
                    activation_bytes=60, forward_comm_s=0.2, forward_comm_elements=10)
    dropped = cost.recomputed(kept=False)
    assert (dropped.backward_s, dropped.comm_s, dropped.comm_elements) == (3.0, 0.7, 40)
    assert (dropped.activation_bytes, dropped.transient_bytes, dropped.memory_bytes) == (0, 60, 100)
    # a block's transient activations do not repeat with the blocks a node stands for
    assert dropped.times(4).memory_bytes == 4 * 40 + 60
    kept = cost.recomputed(kept=True)
    assert (kept.activation_bytes, kept.transient_bytes, kept.backward_s) == (60, 0, 3.0)


def test_node_cost_derived_costs_are_what_replace_makes():
    """`NodeCost._changed` stands for `dataclasses.replace` in every derivation: the same fields, `problems`
    (left out of ==) included, and the cost derived from is left as it was."""
    cost = NodeCost(1.0, 2.0, 3.0, 0.5, 30, 6, 100, 8.0, ("c",), ("p",), 60, False, 7, 0.2, 10, 20, 0.1, (0.3,))
    before = dict(vars(cost))
    derived = cost._changed(backward_s=3.0, transient_bytes=5)
    assert vars(derived) == vars(replace(cost, backward_s=3.0, transient_bytes=5))
    assert type(derived) is NodeCost and vars(cost) == before
    assert vars(cost.per_step(3)) == vars(replace(cost, forward_s=3.0, backward_s=6.0, comm_s=1.5, comm_elements=90,
                                                  flops=24.0, forward_comm_s=cost.forward_comm_s * 3,
                                                  forward_comm_elements=30))
    assert vars(cost.recomputed(kept=False)) == vars(replace(
        cost, backward_s=3.0, comm_s=0.5 + 0.2, comm_elements=40, activation_bytes=0, transient_bytes=20 + 60))


def test_priced_plan_pays_one_more_forward_and_holds_less(tensor_parallel, library):
    plan = tensor_parallel
    kept = price_pcg(plan.pcg, library, plan.machine)
    pcg = replace(plan.pcg, recompute=BLOCKS)
    again = price_pcg(pcg, library, plan.machine)
    runs = [i for c in checkpoints(pcg) for i in c.runs]
    assert any(kept[i].forward_comm_elements for i in runs), "no collective inside a block: TP did not split one"
    before, after = totals(kept, plan.machine), totals(again, plan.machine)
    assert after.comm_elements - before.comm_elements == sum(kept[i].forward_comm_elements for i in runs)
    assert after.time_s - before.time_s == pytest.approx(sum(kept[i].forward_s + kept[i].forward_comm_s
                                                             for i in runs))
    assert after.peak_memory_bytes < before.peak_memory_bytes
    # the largest block's dropped activations are counted once, not once per block
    per_block = [sum(kept[i].activation_bytes for i in c.dropped) for c in checkpoints(pcg)]
    dropped = sum(per_block)
    assert after.peak_memory_bytes == before.peak_memory_bytes - dropped + max(per_block)


def test_simulated_step_recomputes_in_backward(one_device, library):
    plan = one_device
    kept = simulate_pcg(plan.pcg, library, plan.machine, DDP)
    again = simulate_pcg(replace(plan.pcg, recompute=BLOCKS), library, plan.machine, DDP)
    assert again.peak_memory_bytes < kept.peak_memory_bytes
    # the step is at least the recomputed forward longer (the compute stream is the critical path here)
    costs = price_pcg(plan.pcg, library, plan.machine)
    forward = sum(costs[i].forward_s for c in checkpoints(replace(plan.pcg, recompute=BLOCKS)) for i in c.runs)
    assert again.step_s - kept.step_s >= 0.9 * forward
    tasks = again.result._columns[0]          # the builder's columns: names and phases in issue order
    phases = list(zip(tasks.names, tasks.phases))
    recomputed = [k for k, (name, _) in enumerate(phases) if name.startswith("recompute ")]
    assert recomputed and all(phases[k][1] in ("backward", "backward_comm") for k in recomputed)
    first_backward = min(k for k, (name, phase) in enumerate(phases)
                         if phase == "backward" and not name.startswith("recompute "))
    assert min(recomputed) > first_backward - 1   # the last block is recomputed when backward reaches it


def test_plan_file_keeps_the_policy(one_device, tmp_path):
    plan = replace(one_device, pcg=replace(one_device.pcg, recompute=BLOCKS))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert pcg_from_dict(load_plan_dict(path)).recompute == BLOCKS
    assert "full activation recomputation per block" in explain_plan(plan)


def test_auto_recomputes_only_when_keeping_activations_does_not_fit(one_device, library):
    plan = one_device
    kept = totals(price_pcg(plan.pcg, library, plan.machine), plan.machine).peak_memory_bytes
    again = totals(price_pcg(replace(plan.pcg, recompute=BLOCKS), library, plan.machine),
                   plan.machine).peak_memory_bytes
    tight = replace(Machine.resolve("h100x8"), memory_capacity=(kept + again) // 2)
    options = dict(devices=1, sizes=SIZES, pipeline=False, baselines=False,
                   microbatches=1)
    found = parsat.optimize("gpt", tight, **options)
    assert found.pcg.recompute == BLOCKS and found.totals.fits(found.machine)
    roomy = parsat.optimize("gpt", "h100x8", **options)
    assert roomy.pcg.recompute == NONE
    with pytest.raises(DoesNotFit):
        parsat.optimize("gpt", tight, recompute=NONE, **options)
    # with the micro-batch count searched, a count that keeps every activation is tried too, and the faster wins
    said: list[str] = []
    free = {k: v for k, v in options.items() if k != "microbatches"}
    chosen = parsat.optimize("gpt", tight, progress=said.append, **free)
    assert any("by recomputing activations: trying" in line for line in said)
    assert chosen.totals.fits(chosen.machine)
    assert chosen.totals.time_s <= found.totals.time_s


def test_bad_policy_is_a_clear_error():
    with pytest.raises(OptimizeError, match="--recompute must be one of"):
        parsat.optimize("gpt", "h100x8", devices=1, sizes=SIZES, recompute="sometimes")


def test_blocks_on_a_graph_without_blocks_is_a_clear_error():
    with pytest.raises(OptimizeError, match="has no blocks to recompute"):
        parsat.optimize("mlp", "h100x8", devices=1, recompute=BLOCKS, baselines=False)
