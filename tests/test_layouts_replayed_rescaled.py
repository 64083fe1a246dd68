"""The grid's layouts made without placing every operator (issue 28): data parallelism's alike blocks laid out as
the block before them was (`ir.data_parallel._Replay`, on `ir.block_replay.BlockReplay` as `ir.megatron._Repeats`),
and a layout taken from one on a mesh whose data axis alone has another size (`ir.megatron._Kin.on_other_meshes`):
each is the layout placed operator by operator, node for node."""

from __future__ import annotations

import itertools

import pytest

import parsat.ir.data_parallel as data_parallel
import parsat.ir.megatron as megatron
from parsat.dsl.checker import resolve_library
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import build_example

SMALL = {"blocks": 5, "batch": 8, "seq": 16, "hidden": 32, "heads": 4, "vocab": 64}


@pytest.fixture(scope="module")
def library():
    return resolve_library(None)


@pytest.mark.parametrize("name", ["llama", "gpt", "bert"])
def test_data_parallel_blocks_replayed_give_the_layout_placed_operator_by_operator(monkeypatch, library, name):
    graph = build_example(name, SMALL, library)
    real = data_parallel._DataParallelBuilder.place_operator
    for devices, zero3 in itertools.product((2, 4), (False, True)):
        placed: list[str] = []
        monkeypatch.setattr(data_parallel._DataParallelBuilder, "place_operator",
                            lambda self, gnode, op, cache: placed.append(gnode.name) or real(self, gnode, op, cache))
        replayed = data_parallel.data_parallel_pcg(graph, library, devices, 2, zero3=zero3)
        blocks = {n.split("_")[0] for n in placed if n.startswith("b")}
        monkeypatch.setattr(data_parallel._Replay, "replayed", lambda self, block, run: False)
        alone = data_parallel.data_parallel_pcg(graph, library, devices, 2, zero3=zero3)
        monkeypatch.undo()
        assert alone is not None and replayed == alone
        assert blocks == {"b0", "b1"}, blocks   # the blocks after the second replayed


def _meshes_pcgs(library, name: str, t: int, **options):
    """The layout of a graph at batch 16 on (4, t), taken by kin from the layout of the same model at batch 32 on
    (8, t) (whether it was: `_on_mesh` asked), and the layout built alone."""
    sizes = {"blocks": 4, "seq": 16, "hidden": 512, "heads": 16, "vocab": 64}
    big, small = (build_example(name, {**sizes, "batch": b}, library) for b in (32, 16))
    kin: dict = {}
    megatron_pcg(big, library, (8, t), 2, kin=kin, vocabulary_loss=True, heads_ordered=True, **options)
    taken = megatron_pcg(small, library, (4, t), 2, kin=kin, vocabulary_loss=True, heads_ordered=True, **options)
    alone = megatron_pcg(small, library, (4, t), 2, vocabulary_loss=True, heads_ordered=True, **options)
    return taken, alone


@pytest.mark.parametrize("name", ["llama", "gpt"])
@pytest.mark.parametrize("t", [1, 2])
def test_a_layout_taken_from_another_mesh_is_the_layout_built(monkeypatch, library, name, t):
    asked = []
    real = megatron._on_mesh
    monkeypatch.setattr(megatron, "_on_mesh", lambda pcg, mesh: asked.append(mesh) or real(pcg, mesh))
    for sequence, zero, at_once in itertools.product((False, True), (0, 3), (False, True)):
        asked.clear()
        taken, alone = _meshes_pcgs(library, name, t, sequence=sequence, zero=zero, reduce_at_once=at_once)
        assert asked, "the layout was built, not taken from the other mesh"
        assert alone is not None and taken == alone   # node for node: degrees, degree attributes, mesh
        assert taken.mesh.shape == ((4, t) if t > 1 else (4,))


def test_a_layout_is_not_taken_from_a_mesh_where_a_dim_splits_otherwise(monkeypatch, library):
    """A head's rotary half (4 wide) splits into 4 on the data axis of (4, 2) but not into 8 on both axes, and
    into 2 and into 4 on (2, 2): the graphs are not alike on the two meshes (`_splits_alike`), so it is built."""
    asked = []
    real = megatron._on_mesh
    monkeypatch.setattr(megatron, "_on_mesh", lambda pcg, mesh: asked.append(mesh) or real(pcg, mesh))
    big, small = (build_example("llama", {**SMALL, "batch": b}, library) for b in (16, 8))
    kin: dict = {}
    megatron_pcg(big, library, (4, 2), 2, kin=kin, vocabulary_loss=True)
    taken = megatron_pcg(small, library, (2, 2), 2, kin=kin, vocabulary_loss=True)
    assert not asked and taken == megatron_pcg(small, library, (2, 2), 2, vocabulary_loss=True)
