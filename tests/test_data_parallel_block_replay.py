"""The grid's data-parallel layouts made without placing every operator (issue 28): the alike blocks laid out as
the block before them was (`ir.data_parallel._Replay`, on `ir.block_replay.BlockReplay` as `ir.megatron._Repeats`):
the layout placed operator by operator, node for node."""

from __future__ import annotations

import itertools

import pytest

import parsat.ir.data_parallel as data_parallel
from parsat.dsl.checker import resolve_library
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
