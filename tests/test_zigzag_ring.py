"""The balanced causal ring (zigzag; issue 31, build 1): causal attention with its sequence in zigzag order
(`zigzag`, rules/ops.rule: 2p chunks, rank i's block holding chunks i and 2p - 1 - i), split by its queries, is
masked attention of the zigzag query block against k and v whole under the causal mask's rows in the same order
(`attention_causal_zigzag_query_parallel`, PROVED); the wrong ways of writing it are refused; every rank does
half the dense block row (`cost.ring_time.ring_work`), and extraction prices it so."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from parsat.cost.ring_time import ring_work
from parsat.egraph.snapshot import ENode, Snapshot
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import Degrees
from parsat.search.extract import made_in_kernel, ring_form
from parsat.verifier.api import verify

ROOT = Path(__file__).resolve().parents[1]


def test_the_zigzag_query_split_is_proved_and_its_wrong_variants_refused():
    shipped = verify([ROOT / "rules" / "parallel_layers.rule"], match=["attention_causal_zigzag_query_parallel"])
    assert [v.verdict for v in shipped] == ["PROVED"], shipped
    wrong = {v.name: v for v in verify([ROOT / "tests" / "wrong_rules" / "zigzag_ring_wrong.rule"])}
    for name in ("attention_causal_zigzag_mask_rows_unpermuted", "attention_causal_zigzag_keys_permuted_mask_not",
                 "attention_causal_zigzag_ring_not_unpermuted"):
        assert wrong[name].verdict == "REFUTED" and wrong[name].counterexample is not None, wrong[name]
    alone = wrong["attention_causal_zigzag_without_ring"]
    assert alone.verdict == "ILLEGAL" and "local instead of global positions" in alone.reason, alone


@pytest.mark.parametrize("p", [2, 3, 4])
def test_each_rank_holds_chunks_i_and_2p_minus_1_minus_i(p):
    from parsat.importer.torch_ops import zigzag_order
    w = 3
    order = zigzag_order(2 * p * w, 2 * p)
    assert sorted(order) == list(range(2 * p * w))
    for rank in range(p):
        block = order[2 * rank * w:2 * (rank + 1) * w]
        assert block == [*range(rank * w, (rank + 1) * w), *range((2 * p - 1 - rank) * w, (2 * p - rank) * w)]


def test_each_rank_computes_its_zigzag_rows_of_causal_attention_under_its_zigzag_mask_rows():
    """What the ranks run, without processes: each rank's zigzag query block under its zigzag rows of the causal
    mask, against the whole k and v in causal order, gives its zigzag rows of causal attention, and unzigzag of the
    blocks gathered is causal attention; the mask's rows left in causal order do not."""
    torch = pytest.importorskip("torch")
    from parsat.importer.torch_ops import OPS
    generator = torch.Generator().manual_seed(0)
    p, s = 2, 8
    q, k, v = (torch.randn(1, 2, s, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    whole = OPS["attention_causal"].fn(q, k, v, 0.5)
    zq = OPS["zigzag"].fn(q, 2, 2 * p)
    rows = OPS["zigzag"].fn(OPS["causal_mask"].fn(s), 0, 2 * p)
    blocks = [OPS["attention_masked"].fn(zq[:, :, r * s // p:(r + 1) * s // p], k, v, rows[r * s // p:(r + 1) * s // p],
                                         0.5) for r in range(p)]
    torch.testing.assert_close(OPS["unzigzag"].fn(torch.cat(blocks, dim=2), 2, 2 * p), whole)
    unpermuted = OPS["attention_masked"].fn(zq[:, :, :s // p], k, v, OPS["causal_mask"].fn(s)[:s // p], 0.5)
    assert not torch.allclose(unpermuted, blocks[0])


def _zigzag_snapshot(p: int = 2, s: int = 64) -> Snapshot:
    """Masked attention of zigzag query blocks under the zigzag rows of the causal mask (class 5), on p devices."""
    whole, rows = Degrees((1, 1, 1), copy=p), Degrees((1, p, 1))
    classes = {
        0: (ENode("leaf", (), ("q",)),), 1: (ENode("leaf", (), ("k",)),), 2: (ENode("leaf", (), ("v",)),),
        3: (ENode("partition", (0,), (1, 0)),),
        6: (ENode("causal_mask", (), (s,)),),
        9: (ENode("zigzag", (6,), (0, 2 * p)),),
        7: (ENode("partition", (9,), (0, 0)),),
        5: (ENode("attention_masked", (3, 1, 2, 7), ("0.125",)),),
    }
    shape = (1, s, 8)
    shapes = {0: shape, 1: shape, 2: shape, 3: shape, 5: shape, 6: (s, s), 9: (s, s), 7: (s, s)}
    degrees = {0: whole, 1: whole, 2: whole, 3: rows, 5: rows, 6: Degrees((1, 1)), 9: Degrees((1, 1)),
               7: Degrees((p, 1))}
    return Snapshot(classes, shapes, degrees, {}, mesh=Mesh.of((p,), p))


@pytest.mark.parametrize("p", [2, 4])
def test_extraction_prices_the_zigzag_ring_balanced_and_its_mask_made_in_the_kernel(p):
    snapshot = _zigzag_snapshot(p)
    assert ring_form(snapshot, snapshot.classes[5][0]) == pytest.approx(ring_work(p, True, balanced=True))
    assert sum(ring_form(snapshot, snapshot.classes[5][0])) == pytest.approx(0.5)
    assert all(made_in_kernel(snapshot, snapshot.classes[c][0]) for c in (6, 9, 7))
    assert not made_in_kernel(snapshot, snapshot.classes[3][0])


def test_the_torch_native_lowering_refuses_the_zigzag_ring_by_name():
    from parsat.backend.torch_native.lowering import LoweringError, lower
    pcg = SimpleNamespace(mesh=SimpleNamespace(world=4), nodes=[SimpleNamespace(kind="op", op="zigzag", id=3)])
    with pytest.raises(LoweringError, match=r"node #3 is zigzag: the causal ring.*zigzag.*interpreter"):
        lower(pcg, graph=None, module=None)


def _zigzag_attention_graph(library, s: int = 2048, h: int = 128, p: int = 4):
    """One causal attention whose output is read in zigzag order over 2p chunks (a sequence kept zigzagged, as
    Megatron-LM's data loader gives it): the search may split it by its queries only through the zigzag ring."""
    from parsat.ir.graph import GraphBuilder
    g = GraphBuilder(library, name="zigzag_attention")
    x = g.input("x", [1, s, h])
    q, k, v = (g.op("linear_nobias", x, g.weight(f"w{n}", [h, h]), name=n) for n in "qkv")
    zigzagged = g.op("zigzag", g.op("attention_causal", q, k, v, c=h ** -0.5, name="attention"), dim=1, g=2 * p,
                     name="zigzagged")
    squares = g.op("reduce_sum", g.op("mul", zigzagged, zigzagged, name="sq"), dim=2, name="rows")
    g.output(g.op("reduce_sum", g.op("reduce_sum", squares, dim=1, name="tokens"), dim=0, name="loss"))
    return g.build()


def test_under_a_gpu_profile_the_zigzagged_attention_is_the_balanced_ring_and_faster_than_unbalanced():
    """On 8 H100s the zigzagged attention of 16,384 tokens is split as the zigzag ring (about 1 CPU s of search):
    `describe` names it, its mask's nodes are made in the kernel, and the step priced with the ring balanced is
    below the same plan priced as the contiguous ring's last rank."""
    from dataclasses import replace
    from unittest import mock

    from parsat.cost import ring_time
    from parsat.cost.pcg_tasks import profile_for, simulate_pcg
    from parsat.dsl.library import load_library
    from parsat.ir.machine import Machine
    from parsat.ir.parallelism import describe
    from parsat.ir.ring_attention import ring_attentions
    from parsat.search.optimize import optimize
    library = load_library()[0]
    plan = optimize(_zigzag_attention_graph(library, s=16384, h=1024, p=8), machine="h100x8", devices=8,
                    rules=library, baselines=False)
    rings = ring_attentions(plan.pcg)
    (ring,) = set(rings.values())
    assert ring.causal and ring.balanced and ring.parts == 8 and len(ring.generated) == 3, ring
    assert "balanced (zigzag) causal ring attention" in describe(plan.pcg), describe(plan.pcg)
    h100 = Machine.preset("h100x8")
    balanced = simulate_pcg(plan.pcg, library, h100, profile_for(h100)).step_s
    contiguous = {i: replace(r, balanced=False) for i, r in rings.items()}
    with mock.patch.object(ring_time, "ring_attentions", lambda _pcg: contiguous):
        unbalanced = simulate_pcg(plan.pcg, library, h100, profile_for(h100)).step_s
    assert balanced < unbalanced


@pytest.mark.slow
def test_the_zigzag_ring_plan_trains_on_four_gloo_ranks_as_one_process():
    """The search splits the zigzagged attention by its queries through the zigzag ring on 4 ranks of the `cpu`
    preset (each rank's zigzag block against the whole keys under its zigzag mask rows); the interpreter runs it
    (the mask made, zigzagged and sliced), checked against one process."""
    pytest.importorskip("torch")
    from parsat.backend.executor import TrainConfig, run_plan
    from parsat.dsl.library import load_library
    from parsat.search.optimize import optimize
    library = load_library()[0]
    graph = _zigzag_attention_graph(library)
    plan = optimize(graph, machine="cpu", devices=4, rules=library, baselines=False)
    attention = next(n for n in plan.pcg.nodes if n.op == "attention_masked")
    assert any(r.startswith("attention_causal_zigzag_query_parallel") for r in attention.rules), attention.rules
    mask = plan.pcg.node(plan.pcg.node(attention.inputs[3]).inputs[0])
    assert mask.op == "zigzag" and plan.pcg.node(mask.inputs[0]).op == "causal_mask"
    result = run_plan(plan.pcg, 4, TrainConfig(steps=2, optimizer="adam", lr=0.01, check=True, tolerance=1e-4),
                      graph=graph, backend="gloo")
    assert result.check == "passed", result
