"""Ring attention (issue 31, build 1): fused bidirectional attention split by its queries' sequence, proven,
and priced as a ring runs it.

`attention_query_parallel` (rules/parallel_layers.rule) splits attention's output on the query sequence with
k and v whole on every rank: what ring attention computes (each rank's query block against every key/value
block). The verifier proves it and its reverse, and refuses the ways of getting it wrong (the sequence split
with no ring, the blocks' outputs summed unnormalised, a key block read as a query block: ILLEGAL, attention
divides by a partial sum; keys and values swapped: REFUTED). In a plan it is attention whose q is split on
the sequence and whose k and v are all-gathered for it alone (`ir.ring_attention`); a GPU framework runs that
as a ring, and the step simulator prices it so (`cost.pcg_tasks._Builder._ring`): the blocks' send/recv under
the blocks' attention, one block of k and v held. The interpreter runs it as written (all-gathers), checked.
"""

from __future__ import annotations

import unittest.mock as mock
from pathlib import Path

import pytest

from parsat.cost import ring_time
from parsat.cost.collectives import SEND_RECV, price
from parsat.cost.pcg_tasks import mesh_groups, profile_for, simulate_pcg
from parsat.dsl.library import load_library
from parsat.ir.machine import Machine
from parsat.ir.models import build_example
from parsat.ir.parallelism import describe
from parsat.ir.ring_attention import ring_attentions
from parsat.search.optimize import optimize
from parsat.verifier.api import verify

ROOT = Path(__file__).resolve().parents[1]
RULES = ("attention_query_parallel", "attention_of_query_blocks")
# one block of a BERT whose attention has a single head: it cannot be split by heads, and on 2 ranks of the
# `cpu` preset the search splits it by its queries' sequence, k and v gathered (1.2 CPU s)
SMALL = {"blocks": 1, "batch": 1, "seq": 1024, "hidden": 32, "heads": 1, "vocab": 128}


@pytest.fixture(scope="module")
def library():
    return load_library()[0]


@pytest.fixture(scope="module")
def small(library):
    graph = build_example("bert", SMALL, library)
    return graph, optimize(graph, machine="cpu", devices=2, rules=library, baselines=False)


def test_the_query_split_is_proved_and_its_wrong_variants_refused():
    shipped = {v.name: v for v in verify([ROOT / "rules" / "parallel_layers.rule"], match=list(RULES))}
    for name in RULES:
        assert shipped[name].verdict == "PROVED", shipped[name]
    wrong = {v.name: v for v in verify([ROOT / "tests" / "wrong_rules" / "ring_attention_wrong.rule"])}
    for name in ("attention_sequence_split_without_ring", "attention_key_blocks_summed_unnormalised",
                 "attention_key_blocks_read_as_query_blocks"):
        assert wrong[name].verdict == "ILLEGAL" and "divides by a partial sum" in wrong[name].reason, wrong[name]
    swapped = wrong["attention_query_parallel_keys_and_values_swapped"]
    assert swapped.verdict == "REFUTED" and swapped.counterexample is not None, swapped


def test_a_single_head_attention_is_split_by_its_queries_and_priced_as_a_ring(library, small):
    """The plan's attention reads q split on the sequence and k, v gathered for it alone; under a GPU profile the
    simulator runs it as p chunks of the kernel, chunk i after the send/recv of block i (one k and one v block),
    backward with twice the bytes and one last step home, and holds one block where the gathered form holds the
    sequence: less memory, and a step no slower."""
    _graph, plan = small
    pcg = plan.pcg
    rings = ring_attentions(pcg)
    attention = next(n for n in pcg.nodes if n.op == "attention")
    assert set(rings) == {attention.id, *rings[attention.id].gathers}, rings
    assert any(r.startswith("attention_query_parallel") for r in attention.rules), attention.rules
    assert "ring attention (k, v blocks passed round) over gpu 2" in describe(pcg), describe(pcg)

    h100 = Machine.preset("h100x8")
    ring = simulate_pcg(pcg, library, h100, profile_for(h100))
    with mock.patch.object(ring_time, "ring_attentions", lambda _pcg: {}):
        gathered = simulate_pcg(pcg, library, h100, profile_for(h100))
    assert ring.peak_memory_bytes < gathered.peak_memory_bytes
    assert ring.step_s <= gathered.step_s

    spans = [s for s in ring.result.spans if f"#{attention.id}" in s.name and "ring attention" in s.name]
    forward = [s for s in spans if "backward" not in s.name]
    chunks = [s for s in forward if s.stream.kind == "compute"]
    sends = [s for s in forward if s.stream.kind == "comm"]
    parts = rings[attention.id].parts
    assert len(chunks) == parts and len(sends) == parts - 1
    k, v = (pcg.node(g) for g in rings[attention.id].gathers)
    block_bytes = sum(pcg.node(g.inputs[0]).piece_size for g in (k, v)) * h100.dtype_bytes
    group = mesh_groups(pcg)(k)
    assert sends[0].end - sends[0].start == pytest.approx(price(SEND_RECV, group, block_bytes, h100).seconds)
    block, transfer = chunks[0].end - chunks[0].start, sends[0].end - sends[0].start
    assert chunks[-1].end - chunks[0].start == pytest.approx(block + (parts - 1) * max(block, transfer))
    backward = [s for s in spans if "backward" in s.name and s.stream.kind == "comm"]
    assert len(backward) == parts   # p - 1 steps with k, v, dk and dv, one bringing dk and dv home
    assert backward[0].end - backward[0].start == pytest.approx(
        price(SEND_RECV, group, 2 * block_bytes, h100).seconds)


def test_each_rank_computes_its_query_rows_of_attention_as_the_interpreter_runs_it(small):
    """What the slow test's ranks run, without processes: the interpreter accepts the plan's placements on 2
    ranks, and the torch operator it runs (`torch_ops.OPS["attention"]`) on a query block against the whole k
    and v gives that block's rows of attention over the whole sequence."""
    torch = pytest.importorskip("torch")
    from parsat.backend.executor import check_mesh
    from parsat.importer.torch_ops import OPS
    from parsat.ir.placement import shard
    _graph, plan = small
    attention = next(n for n in plan.pcg.nodes if n.op == "attention")
    assert check_mesh(plan.pcg, 2)[attention.id].codes == (shard(2),)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    whole = OPS["attention"].fn(q, k, v, 0.5)
    for rank in range(2):
        rows = slice(4 * rank, 4 * rank + 4)
        torch.testing.assert_close(OPS["attention"].fn(q[:, :, rows], k, v, 0.5), whole[:, :, rows])


@pytest.mark.slow
def test_the_ring_plan_trains_on_two_gloo_ranks_as_one_process(small):
    """The interpreter runs the plan as written (k and v all-gathered, attention on the query block), checked
    against one process."""
    pytest.importorskip("torch")
    from parsat.backend.executor import TrainConfig, run_plan
    graph, plan = small
    result = run_plan(plan.pcg, 2, TrainConfig(steps=2, optimizer="adam", lr=0.01, check=True, tolerance=1e-4),
                      graph=graph, backend="gloo")
    assert result.check == "passed", result


@pytest.mark.slow
def test_with_fewer_heads_than_devices_the_search_takes_the_ring_over_ulysses(library):
    """BERT-sized blocks (hidden 1,024) with 4 heads, 16,384 tokens, batch 1, on 8 H100s: Ulysses can split the
    heads 4 ways only; the search runs attention as a ring over all 8 and predicts a faster step than with the
    ring's rules left out, where it takes Ulysses on 4 (predictions: no GPU)."""
    graph = build_example("bert", {"blocks": 2, "batch": 1, "seq": 16384, "hidden": 1024, "heads": 4}, library)
    plan = optimize(graph, machine="h100x8", devices=8, rules=library, baselines=False)
    assert "ring attention (k, v blocks passed round) over gpu 8" in describe(plan.pcg), describe(plan.pcg)
    without = optimize(graph, machine="h100x8", devices=8, rules=library, baselines=False, without_rules=list(RULES))
    assert "Ulysses" in describe(without.pcg) and not ring_attentions(without.pcg), describe(without.pcg)
    assert plan.totals.time_s < without.totals.time_s
