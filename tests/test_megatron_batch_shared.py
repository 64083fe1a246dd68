"""The grid's layouts of a step's graph at several micro-batch counts share what the batch dims of each are
worked out from (`ir.megatron._Kin.memo`, `ir.microbatch.batch_dims`' `built`): each example built once per
call, an equal graph's batch dims taken as they are; the layouts and batch dims are those worked out alone."""

from __future__ import annotations

import parsat.ir.microbatch as microbatch
from parsat.dsl.checker import resolve_library
from parsat.ir.megatron import _Kin, megatron_pcg
from parsat.ir.microbatch import batch_dims
from parsat.ir.models import build_example

SIZES = {"blocks": 2, "batch": 8, "seq": 16, "hidden": 32, "heads": 4, "vocab": 64}


def _step_graph(library, m: int):
    """The step's graph at `m` micro-batches as the search makes it: its example built at the batch over m."""
    return build_example("llama", {**SIZES, "batch": SIZES["batch"] // m}, library).with_microbatches(m)


def test_layouts_of_several_counts_build_each_example_once_and_lay_out_as_alone(monkeypatch):
    library = resolve_library(None)
    built = []
    real = microbatch.build_example
    monkeypatch.setattr(microbatch, "build_example",
                        lambda name, sizes=None, lib=None, budget=None: built.append(dict(sizes or {}))
                        or real(name, sizes, lib, budget))
    graphs = [_step_graph(library, m) for m in (1, 2, 4)] + [_step_graph(library, 4)]   # the last: made again
    assert graphs[2] == graphs[3] and graphs[2] is not graphs[3]
    kin: dict = {}
    shared = [megatron_pcg(g, library, (2, 2), 2, sequence=True, kin=kin) for g in graphs]
    # batch 8 and its doubled 16; 4 (its double, 8, built); 2 (4 built); the equal graph builds nothing
    assert [s["batch"] for s in built] == [8, 16, 4, 2]
    memos = _Kin.of(kin, library).memos
    for g, pcg in zip(graphs, shared):
        assert memos[id(g)].batch == batch_dims(g, library)   # alone: its examples built anew
        assert pcg == megatron_pcg(g, library, (2, 2), 2, sequence=True)
