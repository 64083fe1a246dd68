"""A layout's blocks laid out as the block before them was (`ir.megatron._Repeats`): every node of a model's
repeated blocks but the first two is a renamed copy, and the layout is the one placed operator by operator."""

from __future__ import annotations

import pytest

import parsat.ir.megatron as megatron
from parsat.dsl.checker import resolve_library
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import build_example

SIZES = {"blocks": 5, "batch": 8, "seq": 16, "hidden": 32, "heads": 4, "vocab": 64}
OPTIONS = [dict(sequence=s, zero=z, reduce_at_once=r, vocabulary_loss=v)
           for s in (False, True) for z in (0, 3) for r, v in ((False, True), (True, False))]


def _placed(monkeypatch, replay: bool, *args, **options):
    """The layout and how many graph operators the builder placed one by one (with block replay, or without)."""
    placed = []
    real = megatron._MegatronBuilder.place_graph_node
    monkeypatch.setattr(megatron._MegatronBuilder, "place_graph_node",
                        lambda self, gnode: placed.append(gnode.name) or real(self, gnode))
    if not replay:
        monkeypatch.setattr(megatron._Repeats, "replayed", lambda self, block, run: False)
    pcg = megatron_pcg(*args, **options)
    monkeypatch.undo()
    return pcg, placed


@pytest.mark.parametrize("name", ["llama", "gpt"])
@pytest.mark.parametrize("mesh", [(2, 2), (1, 4), (4, 1)])
def test_blocks_replayed_give_the_layout_placed_operator_by_operator(monkeypatch, name, mesh):
    library = resolve_library(None)
    graph = build_example(name, SIZES, library).with_microbatches(2)
    for options in OPTIONS:
        cache: dict = {}   # shared, as the grid shares it: ZeRO-3 then derived from the ZeRO-0 build's chains
        replayed = [_placed(monkeypatch, True, graph, library, mesh, 2, cache=cache, heads_ordered=True,
                            **{**options, "zero": zero}) for zero in (0, options["zero"])]
        alone = _placed(monkeypatch, False, graph, library, mesh, 2, heads_ordered=True, **options)
        assert alone[0] is not None and replayed[-1][0] == alone[0]
        if mesh[1] > 1:   # a tensor axis: the builder's own layout (data parallelism is `ir.data_parallel`'s)
            blocks = {n.split("_")[0] for n in replayed[0][1] if n.startswith("b")}
            assert blocks == {"b0", "b1"}, blocks   # the blocks after the second replayed
            assert len(replayed[0][1]) < len(alone[1])
