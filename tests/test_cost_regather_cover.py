"""The backward re-gather of a sequence-parallel activation: what its readers' input gradients hide of it.

Megatron-LM keeps the sequence shard of a gathered activation and all-gathers it again in backward, launched
asynchronously before the input gradient of the product that reads it (the input gradient reads the weight,
not the gathered value), so only what that GEMM cannot cover is exposed; Megatron-Core computes q, k and v as
one fused GEMM (`linear_qkv`), whose input gradient is all three. The per-node price charges that exposed part
(`cost.saved.exposed_regather_s`, over `regather_cover`) and the step simulator runs the same tasks: every
sibling's input gradient beside the all-gather, then the weight gradients. Both must agree, so that a PCG's
per-node sum (the grid's layouts, a re-priced plan) ranks layouts as the simulator runs them, and the pipelined
stage price (`cost.pipeline.TpOverlap`, whose reference run hides the re-gather too) does not take it off twice.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from test_cost_pcg_tasks import H100, LIB, SERIAL_DDP, mesh_pcg  # noqa: E402 (a sibling test module)

from parsat.ir.mesh import Mesh
from parsat.cost.collectives import ALL_GATHER, REDUCE_SCATTER, GroupTopology, price
from parsat.cost.pcg_tasks import DDP, OpTimes, simulate_pcg, step_floor
from parsat.cost.saved import exposed_regather_s, regather_cover
from parsat.search.solve import price_pcg

ROWS = 8192
AGAIN = "all_gather(dim=0, axis=tp, degree=8) #8 all-gather again for backward"


def qkv(hidden: int, readers: int = 3):
    """A sequence-parallel attention input on a tp axis of 8 (one node of h100x8): rows split (#4), a first
    product (#7) makes them an activation with a gradient, all-gathered (#8) into `readers` column-parallel
    products (q, k, v: #10, #12, #14), whose sum is the output. Each product's weight gradient reads the
    gathered value, so #8 is gathered again in backward. Five leaves whatever `readers` is (unused inputs
    stand for the weights left out), so the nodes keep their numbers."""
    rows = [("leaf", "x", (), (ROWS, hidden), {}, "input"),
            ("leaf", "w0", (), (hidden, hidden), {}, "weight")]
    rows += [("leaf", f"w{k + 1}", (), (hidden, hidden), {}, "weight") for k in range(3)]
    rows = rows[:2] + rows[2:2 + readers] + [("leaf", f"pad{k}", (), (1,), {}, "input") for k in range(3 - readers)]
    rows += [("parallel", "partition", (0,), (ROWS, hidden), {"dim": 0, "axis": "tp"}, ""),
             ("parallel", "replicate", (1,), (hidden, hidden), {"axis": "tp"}, ""),
             ("op", "matmul", (5, 6), (ROWS, hidden), {}, ""),
             ("parallel", "all_gather", (7,), (ROWS, hidden), {"dim": 0, "axis": "tp"}, "")]
    products = []
    for k in range(readers):
        at = len(rows)
        rows += [("parallel", "partition", (2 + k,), (hidden, hidden), {"dim": 1, "axis": "tp"}, ""),
                 ("op", "matmul", (8, at), (ROWS, hidden), {}, "")]
        products.append(at + 1)
    total = products[0]
    for p in products[1:]:
        rows.append(("op", "add", (total, p), (ROWS, hidden), {}, ""))
        total = len(rows) - 1
    return mesh_pcg(Mesh.of((8,), 8, names=("tp",)), rows), products


def _exposed_per_node(pcg, products) -> tuple[float, float, float]:
    """(the second all-gather's seconds, its readers' input gradients, what the per-node price charges of it)."""
    costs = price_pcg(pcg, LIB, H100)
    group, nbytes = GroupTopology.of_axis(pcg.mesh, 0), ROWS * pcg.nodes[8].shape[1] * H100.dtype_bytes
    seconds = price(ALL_GATHER, group, nbytes, H100).seconds
    scatter = price(REDUCE_SCATTER, group, nbytes, H100).seconds   # the gradient's, in backward
    cover = regather_cover(costs[p].input_grad_s[0] for p in products)
    return seconds, cover, costs[8].comm_s - seconds - scatter   # the forward gather is the same all-gather


@pytest.mark.parametrize("hidden", [1024, 8192])
def test_the_per_node_charge_is_what_the_input_gradients_leave_exposed(hidden):
    """The per-node price of the gather (#8: its forward all-gather and the second one) charges the second
    all-gather less its three readers' input gradients, never below zero: at hidden 1024 they cover part of
    it, at 8192 all of it."""
    pcg, products = qkv(hidden)
    seconds, cover, charged = _exposed_per_node(pcg, products)
    assert cover > 0
    assert charged == pytest.approx(exposed_regather_s(seconds, cover), abs=1e-12)
    if hidden == 1024:
        assert 0 < charged < seconds
    else:
        assert charged == pytest.approx(0.0, abs=1e-12) and cover > seconds


@pytest.mark.parametrize("hidden", [1024, 8192])
def test_every_sibling_input_gradient_runs_beside_the_regather_before_any_weight_gradient(hidden):
    """The step simulator runs q's, k's and v's input gradients beside the second all-gather, then their weight
    gradients (as Megatron-Core's fused QKV GEMM runs its one input gradient, then its one weight gradient),
    and the compute stream waits for the all-gather what the per-node price charges of it, less the other
    backward compute issued after it that runs before the first input gradient (here the sum's). Without
    tensor-parallel pipelining (the reference run of `TpOverlap`) the same; a profile without a communication
    stream waits for all of it."""
    pcg, products = qkv(hidden)
    seconds, cover, charged = _exposed_per_node(pcg, products)
    for profile in (SERIAL_DDP, DDP):
        spans = simulate_pcg(pcg, LIB, H100, profile).result.spans
        again = next(s for s in spans if s.name == AGAIN)
        dgrads = [s for s in spans if "(input gradient)" in s.name]
        wgrads = [s for s in spans if "(weight gradient)" in s.name]
        assert len({s.name.split(" ")[1] for s in dgrads}) == len(wgrads) == 3
        assert max(s.end for s in dgrads) <= min(s.start for s in wgrads)
        assert min(s.start for s in wgrads) >= again.end
        if profile is SERIAL_DDP:   # nothing else on the link: the wait is the per-node figure, less what
            # other backward compute issued after the all-gather (the sum's) hides before the first input gradient
            ahead = min(s.start for s in dgrads) - again.start
            waited = min(s.start for s in wgrads) - max(s.end for s in dgrads)
            assert ahead >= 0 and waited <= charged + 1e-12
            assert waited == pytest.approx(exposed_regather_s(seconds, cover + ahead), rel=1e-6, abs=1e-12)
        assert step_floor(pcg, H100, OpTimes(LIB, H100), profile=profile) <= simulate_pcg(
            pcg, LIB, H100, profile).step_s
    inline = simulate_pcg(pcg, LIB, H100, replace(SERIAL_DDP, overlap=False)).result.spans
    again = next(s for s in inline if s.name == AGAIN)
    assert all(s.start >= again.end for s in inline if s.name.startswith(tuple(f"matmul #{p} " for p in products)))


def test_one_reader_hides_less_than_three_siblings():
    """The first reader's input gradient alone (one product reading the gathered value) leaves more of the
    all-gather exposed than q, k and v together, per node and as simulated."""
    one, three = qkv(1024, readers=1), qkv(1024)
    assert _exposed_per_node(*one)[2] > _exposed_per_node(*three)[2] > 0
    waits = []
    for pcg, _products in (one, three):
        spans = simulate_pcg(pcg, LIB, H100, SERIAL_DDP).result.spans
        wgrad = min(s.start for s in spans if "(weight gradient)" in s.name)
        waits.append(wgrad - max(s.end for s in spans if "(input gradient)" in s.name and s.end <= wgrad))
    assert waits[0] > waits[1] > 0


def _gathered_into(reader: str, hidden: int = 1024):
    """`qkv`'s gathered input (#8) read by `reader` alone ("gelu": its backward reads its input; "matmul": a
    column-parallel product's weight gradient reads it) or by both ("both": #9 gelu, #11 the product, both outputs)."""
    pcg, _ = qkv(hidden, readers=1)
    rows = [(n.kind, n.op, n.inputs, n.shape, {k: v for k, v in n.attrs if k != "degree"}, n.role)
            for n in pcg.nodes[:9]]
    if reader in ("gelu", "both"):
        rows.append(("op", "gelu", (8,), (ROWS, hidden), {}, ""))
    if reader in ("matmul", "both"):
        rows += [("parallel", "partition", (2,), (hidden, hidden), {"dim": 1, "axis": "tp"}, ""),
                 ("op", "matmul", (8, len(rows)), (ROWS, hidden), {}, "")]
    return mesh_pcg(Mesh.of((8,), 8, names=("tp",)), rows, outputs=(9, 11) if reader == "both" else None)


@pytest.mark.parametrize("reader", ["gelu", "matmul", "both"])
def test_only_a_gathered_value_only_products_read_in_backward_is_gathered_again(reader):
    """Megatron-LM re-gathers the input of a sequence-parallel column-parallel product, for its weight gradient;
    a gathered value another backward reads (a cross-entropy's logits, an activation function's input) autograd
    keeps whole. On h100x8 (a runtime that re-gathers) the per-node price and the step simulator agree: the
    product's input (#8) is gathered again and keeps nothing of its own (its shard is kept), the gelu's (alone or
    beside a product) is kept whole and gathered once."""
    from parsat.cost.pcg_tasks import regathered
    from parsat.cost.saved import kept_values, regathered_values

    pcg = _gathered_into(reader)
    again = reader == "matmul"
    assert H100.runtime_regathers and 8 in kept_values(pcg, LIB)
    assert (8 in regathered_values(pcg, LIB)) == (8 in regathered(pcg, LIB)) == again
    cost = price_pcg(pcg, LIB, H100)[8]
    assert any(c.startswith("bwd all-gather") for c in cost.collectives) == again, cost.collectives
    assert cost.activation_bytes == (0 if again else ROWS * 1024 * H100.dtype_bytes)
    spans = simulate_pcg(pcg, LIB, H100, DDP).result.spans
    assert any(s.name == AGAIN for s in spans) == again
