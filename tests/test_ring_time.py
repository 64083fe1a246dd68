"""Ring attention's one price (`cost.ring_time`): the slowest rank's work step by step, the pass as the
simulator's streams run it, and extraction reading the same price (`search.extract.ring_form`), where pricing
the ring dense would choose another e-node."""

from __future__ import annotations

import math

import pytest

from parsat.cost.ring_time import ring_compute_s, ring_work
from parsat.dsl.library import load_library
from parsat.egraph.snapshot import ENode, Snapshot
from parsat.ir.costs import NodeCost
from parsat.ir.machine import Machine
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import Degrees
from parsat.search.extract import Pricer, bottom_up, made_in_kernel, ring_form


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_ring_work_shares(p):
    """Bidirectional: the whole row, 1/p a step; causal contiguous: the last rank's diagonal then p - 1 full
    blocks, (p - 1/2)/p; zigzag: half a block every step, half the row on every rank."""
    assert ring_work(p, False) == pytest.approx((1 / p,) * p)
    assert sum(ring_work(p, True)) == pytest.approx((p - 0.5) / p)
    assert ring_work(p, True)[0] == pytest.approx(1 / (2 * p))
    assert ring_work(p, True, balanced=True) == pytest.approx((1 / (2 * p),) * p)


def _zigzag_rank_pairs(p: int, rank: int) -> float:
    """A rank's causal work counted chunk pair by chunk pair on 2p chunks (query chunks rank and 2p - 1 - rank
    against every key chunk; a diagonal pair half), in units of the dense block row (2 x 2p pairs)."""
    queries = (rank, 2 * p - 1 - rank)
    pairs = sum(1.0 if key < query else 0.5 if key == query else 0.0 for query in queries for key in range(2 * p))
    return pairs / (2 * 2 * p)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zigzag_share_is_every_ranks_count(p):
    """The balanced share is what each rank's chunk pairs add up to, the same on every rank."""
    assert {round(_zigzag_rank_pairs(p, r), 12) for r in range(p)} == {round(sum(ring_work(p, True, True)), 12)}


def test_the_ring_s_compute_is_its_chunks_summed():
    assert ring_compute_s(8.0, ring_work(4, True), lambda s: s) == pytest.approx(8.0 * 3.5 / 4)


S, D, P = 8192, 64, 2


def _ring_snapshot() -> tuple[Snapshot, int]:
    """Class 5 (the output's query blocks on a 2-device axis) made two ways: the causal ring (masked attention of
    the query block under the causal mask's rows, k and v whole) or each rank's rows of whole causal attention."""
    whole, rows = Degrees((1, 1, 1), copy=P), Degrees((1, P, 1))   # whole: a copy on each device
    shape = (1, S, D)
    classes = {
        0: (ENode("leaf", (), ("q",)),), 1: (ENode("leaf", (), ("k",)),), 2: (ENode("leaf", (), ("v",)),),
        3: (ENode("partition", (0,), (1, 0)),),                         # q's query blocks
        6: (ENode("causal_mask", (), (S,)),),
        7: (ENode("partition", (6,), (0, 0)),),                         # the mask's rows
        8: (ENode("attention_causal", (0, 1, 2), ("0.125",)),),
        5: (ENode("attention_masked", (3, 1, 2, 7), ("0.125",)), ENode("partition", (8,), (1, 0))),
    }
    shapes = {0: shape, 1: shape, 2: shape, 3: shape, 5: shape, 6: (S, S), 7: (S, S), 8: shape}
    degrees = {0: whole, 1: whole, 2: whole, 3: rows, 5: rows, 6: Degrees((1, 1)), 7: Degrees((P, 1)), 8: whole}
    return Snapshot(classes, shapes, degrees, {}, mesh=Mesh.of((P,), P)), 5


def _costs(snapshot: Snapshot, machine: Machine, rings: bool) -> dict:
    library = load_library()[0]
    pricer = Pricer(library, machine, snapshot.mesh)
    out = {}
    for cid, nodes in snapshot.classes.items():
        for index, node in enumerate(nodes):
            parallel = node.op == "partition"
            cost = pricer.price(node.op, node.attrs[:-1] if parallel else node.attrs, snapshot.shape[cid],
                                snapshot.degrees[cid], tuple(snapshot.shape[c] for c in node.children),
                                tuple(snapshot.degrees[c] for c in node.children),
                                tuple("input" if snapshot.classes[c][0].op == "leaf" else "" for c in node.children),
                                node.attrs[-1] if parallel else None,
                                ring=ring_form(snapshot, node) if rings else ())
            if rings and made_in_kernel(snapshot, node):
                cost = NodeCost()
            assert cost is not None, node
            out[(cid, index)] = cost
    return out


def test_extraction_prices_the_causal_ring_as_the_simulator_and_so_takes_it():
    """As extraction priced it before (the query block against every key, dense: what whole causal attention
    costs at p = 2; the [s, s] mask made, held and sliced) the ring loses to each rank's rows of whole causal
    attention; priced as the step simulator runs it (the last rank's (p - 1/2)/p of the row, `ring_work`, and
    the mask made in the kernel from the offset, `made_in_kernel`) the ring wins."""
    snapshot, out = _ring_snapshot()
    machine = Machine.preset("h100x8")
    assert ring_form(snapshot, snapshot.classes[out][0]) == pytest.approx(ring_work(P, True))
    assert ring_form(snapshot, snapshot.classes[out][1]) == ()
    dense, ringed = _costs(snapshot, machine, False), _costs(snapshot, machine, True)
    assert ringed[(out, 0)].forward_s < dense[(out, 0)].forward_s
    assert ringed[(out, 0)].backward_s < dense[(out, 0)].backward_s
    usable = lambda nid: True   # noqa: E731
    picked = {rings: bottom_up(snapshot, costs, usable)[0][out]
              for rings, costs in ((False, dense), (True, ringed))}
    assert picked == {False: 1, True: 0}
    assert math.isfinite(ringed[(out, 0)].time_s)
