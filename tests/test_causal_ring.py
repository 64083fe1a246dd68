"""The causal ring (issue 31, build 1): fused causal attention split by its queries' sequence, proven, priced as
its slowest rank runs it, and run.

`attention_causal_query_parallel` (rules/parallel_layers.rule) splits causal attention's output on the query
sequence into masked attention (`attention_masked`) of each query block against k and v whole, under the block's
rows of the causal mask (`causal_mask`, made from positions): the mask block carries the block's offset, so no
condition reads a sharded index. The verifier proves it, and refuses the ways of getting it wrong (each block
masked by local positions, or the transposed mask: REFUTED; each block causal over its own keys alone, and the
key blocks summed without the merge: ILLEGAL). In a plan it is a ring whose rank i meets i key blocks in full and
its own block causally: the step simulator prices the slowest rank (`cost.pcg_tasks._Builder._ring`), and the
mask as made inside the kernel. The interpreter runs it as written (the mask made and sliced), checked.
"""

from __future__ import annotations

import re
import unittest.mock as mock
from pathlib import Path
from types import SimpleNamespace

import pytest

from parsat.cost import ring_time
from parsat.cost.collectives import SEND_RECV, price
from parsat.cost.pcg_tasks import mesh_groups, profile_for, simulate_pcg
from parsat.dsl.library import load_library
from parsat.ir.machine import Machine
from parsat.ir.models import build_example
from parsat.ir.parallelism import describe
from parsat.ir.ring_attention import RingAttention, ring_attentions
from parsat.search.optimize import optimize
from parsat.verifier.api import verify

ROOT = Path(__file__).resolve().parents[1]
RULES = ("attention_causal_query_parallel", "attention_masked_query_parallel")
# one block of a GPT whose attention has a single head, 2,048 tokens: on 4 ranks of the `cpu` preset the search
# runs it as the causal ring (4 CPU s); on 2 it does not (each rank's block against the whole keys is as much
# work as the whole causal attention)
SMALL = {"blocks": 1, "batch": 1, "seq": 2048, "hidden": 32, "heads": 1, "vocab": 128}


@pytest.fixture(scope="module")
def small():
    """The library, the small GPT and its causal-ring plan."""
    library = load_library()[0]
    graph = build_example("gpt", SMALL, library)
    return library, graph, optimize(graph, machine="cpu", devices=4, rules=library, baselines=False)


def test_the_causal_query_split_is_proved_and_its_wrong_variants_refused():
    shipped = {v.name: v for v in verify([ROOT / "rules" / "parallel_layers.rule"], match=list(RULES))}
    for name in RULES:
        assert shipped[name].verdict == "PROVED", shipped[name]
    wrong = {v.name: v for v in verify([ROOT / "tests" / "wrong_rules" / "causal_ring_wrong.rule"])}
    for name in ("attention_causal_query_blocks_masked_locally", "attention_causal_query_blocks_mask_transposed"):
        assert wrong[name].verdict == "REFUTED" and wrong[name].counterexample is not None, wrong[name]
    assert wrong["attention_causal_query_blocks_without_ring"].verdict == "ILLEGAL"
    assert "local instead of global positions" in wrong["attention_causal_query_blocks_without_ring"].reason
    summed = wrong["attention_causal_key_blocks_summed"]
    assert summed.verdict == "ILLEGAL" and "divides by a partial sum" in summed.reason, summed


def test_each_rank_computes_its_query_rows_of_causal_attention_under_its_mask_rows():
    """What the ranks run, without processes: the torch operators (`torch_ops.OPS`) of a query block under its
    rows of the causal mask, against the whole k and v, give that block's rows of causal attention; and the
    first block's rows taken by every block (local positions) do not."""
    torch = pytest.importorskip("torch")
    from parsat.importer.torch_ops import OPS
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    whole = OPS["attention_causal"].fn(q, k, v, 0.5)
    mask = OPS["causal_mask"].fn(8)
    for rank in range(4):
        rows = slice(2 * rank, 2 * rank + 2)
        torch.testing.assert_close(OPS["attention_masked"].fn(q[:, :, rows], k, v, mask[rows], 0.5), whole[:, :, rows])
    local = OPS["attention_masked"].fn(q[:, :, 6:8], k, v, mask[0:2], 0.5)
    assert not torch.allclose(local, whole[:, :, 6:8])


def test_the_torch_native_lowering_refuses_the_causal_ring_by_name():
    """Its masked attention and causal mask are no module call the torch-native runtime could style: it says so
    and points at the interpreter, before it looks at the module."""
    from parsat.backend.torch_native.lowering import LoweringError, lower
    pcg = SimpleNamespace(mesh=SimpleNamespace(world=4),
                          nodes=[SimpleNamespace(kind="op", op="attention_masked", id=7)])
    with pytest.raises(LoweringError, match=r"node #7 is attention_masked: the causal ring.*interpreter"):
        lower(pcg, graph=None, module=None)


@pytest.mark.slow
def test_a_single_head_causal_attention_is_a_causal_ring_priced_as_its_slowest_rank(small):
    """The plan's masked attention reads q and the causal mask's rows split on the sequence and k, v gathered for
    it alone; under a GPU profile the simulator runs the last rank's pass: its own block causally (half a block's
    kernel) and the p - 1 blocks before it in full, each after its send/recv; the mask and its split run nothing
    and hold nothing (made from the offset in the kernel), so the step is no slower and the peak lower than with
    the mask made and the ring priced as bidirectional."""
    library, _graph, plan = small
    pcg = plan.pcg
    rings = ring_attentions(pcg)
    attention = next(n for n in pcg.nodes if n.op == "attention_masked")
    ring = rings[attention.id]
    assert ring.causal and len(ring.generated) == 2, ring
    assert any(r.startswith("attention_causal_query_parallel") for r in attention.rules), attention.rules
    assert "causal ring attention (k, v blocks passed round) over gpu 4" in describe(pcg), describe(pcg)

    h100 = Machine.preset("h100x8")
    causal = simulate_pcg(pcg, library, h100, profile_for(h100))
    as_bidirectional = {i: RingAttention(r.attention, r.gathers, r.parts) for i, r in rings.items()}
    with mock.patch.object(ring_time, "ring_attentions", lambda _pcg: as_bidirectional):
        dense = simulate_pcg(pcg, library, h100, profile_for(h100))
    assert causal.peak_memory_bytes < dense.peak_memory_bytes
    assert causal.step_s < dense.step_s

    spans = [s for s in causal.result.spans if f"#{attention.id}" in s.name and "causal ring attention" in s.name]
    forward = [s for s in spans if "backward" not in s.name]
    chunks = [s for s in forward if s.stream.kind == "compute"]
    sends = [s for s in forward if s.stream.kind == "comm"]
    assert len(chunks) == ring.parts and len(sends) == ring.parts - 1
    diagonal, block = (c.end - c.start for c in chunks[:2])
    assert diagonal < block
    k, v = (pcg.node(g) for g in ring.gathers)
    block_bytes = sum(pcg.node(g.inputs[0]).piece_size for g in (k, v)) * h100.dtype_bytes
    transfer = price(SEND_RECV, mesh_groups(pcg)(k), block_bytes, h100).seconds
    assert sends[0].end - sends[0].start == pytest.approx(transfer)
    assert chunks[-1].end - chunks[0].start == pytest.approx(diagonal + (ring.parts - 1) * max(block, transfer))
    generated = [s for s in causal.result.spans if any(re.search(rf"#{i}\b", s.name) for i in ring.generated)]
    assert not generated, generated


@pytest.mark.slow
def test_the_causal_ring_plan_trains_on_four_gloo_ranks_as_one_process(small):
    """The interpreter runs the plan as written (the causal mask made and its rows sliced, k and v all-gathered,
    masked attention on the query block), checked against one process (about 20 s on 2 cores)."""
    pytest.importorskip("torch")
    from parsat.backend.executor import TrainConfig, run_plan
    _library, graph, plan = small
    result = run_plan(plan.pcg, 4, TrainConfig(steps=2, optimizer="adam", lr=0.01, check=True, tolerance=1e-4),
                      graph=graph, backend="gloo")
    assert result.check == "passed", result


@pytest.mark.slow
def test_with_fewer_heads_than_devices_a_llama_takes_the_causal_ring_over_ulysses():
    """LLaMA blocks (hidden 1,024) with 4 heads, 16,384 tokens, batch 1, on 8 H100s: Ulysses can split the heads
    4 ways only; the search runs attention as the causal ring over all 8 and predicts a faster step than with the
    ring's rule left out, where it takes Ulysses on 4 (predictions: no GPU)."""
    library = load_library()[0]
    sizes = {"blocks": 2, "batch": 1, "seq": 16384, "hidden": 1024, "heads": 4, "vocab": 8192}
    graph = build_example("llama", sizes, library)
    plan = optimize(graph, machine="h100x8", devices=8, rules=library, baselines=False)
    assert "causal ring attention (k, v blocks passed round) over gpu 8" in describe(plan.pcg), describe(plan.pcg)
    without = optimize(graph, machine="h100x8", devices=8, rules=library, baselines=False,
                       without_rules=[RULES[0]])
    assert "Ulysses" in describe(without.pcg) and not ring_attentions(without.pcg), describe(without.pcg)
    assert plan.totals.time_s < without.totals.time_s
