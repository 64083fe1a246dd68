"""Layouts: which rank holds which slot, and the slot algebra of the four parallel operators."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from parsat.ir.placement import (  # noqa: E402
    Axis, Placement as Layout, PlacementError, compute_layout, group_ranks, holders, piece_index, world_atoms)
from parsat.backend.executor import operator_library  # noqa: E402
from parsat.ir.graph import instance_for  # noqa: E402

OPS = operator_library().ops


def test_world_atoms_are_prime_axes():
    assert world_atoms(12) == (Axis(6, 2), Axis(3, 2), Axis(1, 3))
    assert world_atoms(3) == (Axis(1, 3),)
    assert world_atoms(1) == ()


@pytest.mark.parametrize("world", [2, 3, 4, 6, 12])
def test_partition_refines_blocks_b_times_n_plus_t(world):
    """partition(x, dim, n): block b' = b*n + t; the parent slot is what every child rank held."""
    layout, _ = Layout.whole(2, world).partition(1, world)
    assert sorted(layout.slot(r).blocks[1] for r in range(world)) == list(range(world))
    if world % 2 == 0 and world > 2:
        first, _ = Layout.whole(2, world).partition(0, 2)
        second, taken = first.partition(0, world // 2)
        for r in range(world):
            b, b2 = first.slot(r).blocks[0], second.slot(r).blocks[0]
            assert b2 // (world // 2) == b  # b' = b*n + t
        assert holders(second) and len(holders(second)) == world


def test_combine_and_reduce_undo_the_last_split():
    layout, _ = Layout.whole(2, 6).partition(0, 2)
    layout, _ = layout.partition(0, 3)
    back, given = layout.combine(0, 3)
    assert back == Layout.whole(2, 6).partition(0, 2)[0] and [a.size for a in given] == [3]
    with pytest.raises(PlacementError, match="does not undo the last splits"):
        layout.combine(0, 4)
    partial = Layout(4, ((), ()), sum=world_atoms(4))
    reduced, given = partial.reduce(2)
    assert reduced.degrees == ((1, 1), 1, 2)
    for r in range(4):  # s' = s // n
        assert reduced.slot(r).sum == partial.slot(r).sum // 2


def test_replicate_copy_index_and_groups():
    layout, taken = Layout.whole(1, 6).replicate(3)
    assert layout.degrees == ((1,), 3, 1) and len(layout.free) == 1
    members = group_ranks(taken, 0)
    assert len(members) == 3 and [layout.slot(r).copy for r in members] == [0, 1, 2]


def test_fewer_pieces_than_ranks_are_held_redundantly():
    layout, _ = Layout.whole(2, 4).partition(0, 2)
    assert {slot.blocks: len(ranks) for slot, ranks in holders(layout).items()} == {(0, 0): 2, (1, 0): 2}
    assert piece_index(layout, 0, (8, 3)) == (slice(0, 4), slice(0, 3))


def test_too_many_pieces_is_refused():
    layout, _ = Layout.whole(2, 2).partition(0, 2)
    with pytest.raises(PlacementError, match="needs more devices"):
        layout.replicate(2)
    with pytest.raises(PlacementError, match="needs more devices"):
        Layout.whole(1, 6).partition(0, 4)


def test_compute_layout_megatron_and_misalignment():
    whole = Layout.whole(2, 2)
    x, _ = whole.replicate(2)
    w1, _ = whole.partition(1, 2)
    h = compute_layout(instance_for(OPS["matmul"], [(4, 6), (6, 8)], {}), [x, w1])
    assert h.degrees == ((1, 2), 1, 1)
    w2, _ = whole.partition(0, 2)
    y = compute_layout(instance_for(OPS["matmul"], [(4, 8), (8, 2)], {}), [h, w2])
    assert y.degrees == ((1, 1), 1, 2)
    # same degrees, different ranks: on 4 ranks the two splits take different atoms
    a, _ = Layout.whole(2, 4).partition(1, 2)
    b0, _ = Layout.whole(2, 4).replicate(2)
    b, _ = b0.partition(0, 2)
    a2, _ = a.replicate(2)
    with pytest.raises(PlacementError, match="different ranks"):
        compute_layout(instance_for(OPS["matmul"], [(4, 6), (6, 8)], {}), [a2, b])
    with pytest.raises(PlacementError, match="relu"):
        compute_layout(instance_for(OPS["relu"], [(4, 2)], {}), [y])
