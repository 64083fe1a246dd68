"""A stage plan's tensor-parallel overlap read off excerpts of a few of its alike blocks (`cost.pipeline.tp_overlap`,
`ir.blocks.block_excerpt`): the same figures as the whole plan's simulation, up to float rounding, and the whole
plan simulated where the excerpts' figures are not on one line."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

import parsat.cost.pipeline as pipeline
from parsat.cost.pcg_tasks import DDP
from parsat.cost.pipeline import EXCERPT_COUNTS, _on_line, tp_overlap
from parsat.dsl.library import load_library, shipped_rules_dir
from parsat.ir.blocks import block_excerpt, node_blocks
from parsat.ir.machine import Machine
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import gpt
from parsat.ir.pcg import restated

LIB = load_library([shipped_rules_dir() / "ops.rule"])[0]
BLOCKS = 16                                        # more than the excerpts' 4 + 5 + 6 blocks together
FIGURES = ("forward", "backward", "saved_forward_s", "saved_backward_s")


@dataclass(frozen=True)
class _Stage:
    """What `tp_overlap` reads of a stage plan: its PCG and its stage machine."""

    pcg: object
    machine: Machine


@pytest.fixture(scope="module", params=[((1, 2), 0, "none"), ((2, 2), 1, "blocks")],
                ids=["tp2", "dp2-tp2-zero1-recompute"])
def stage(request):
    """A 16-block gpt in Megatron's tensor- and sequence-parallel layout (what the overlap pipelines), on tp 2 and
    on dp 2 x tp 2 with ZeRO-1 and blocks recomputed (gradient buckets and their reductions beside the backward's
    collectives, each block's forward run again in its backward)."""
    mesh, zero, recompute = request.param
    graph = gpt(blocks=BLOCKS, batch=8, seq=256, hidden=256, heads=4, vocab=1024, library=LIB)
    pcg = restated(megatron_pcg(graph, LIB, mesh, 8, sequence=True), zero, recompute)
    return _Stage(pcg, Machine.resolve("h100x8").with_devices(mesh[0] * mesh[1]))


def _close(a, b, rel=1e-9):
    return all(abs(getattr(a, f) - getattr(b, f)) <= rel * abs(getattr(b, f)) for f in FIGURES)


def test_the_excerpts_give_the_whole_plan_s_overlap_without_simulating_it(stage, monkeypatch):
    whole = tp_overlap(stage, LIB, DDP, 1e-3, counts=())
    assert whole.saved_forward_s > 0 and whole.saved_backward_s > 0
    simulated = []
    real = pipeline.simulate_pcg
    monkeypatch.setattr(pipeline, "simulate_pcg", lambda pcg, *a, **k: simulated.append(pcg) or real(pcg, *a, **k))
    found = tp_overlap(stage, LIB, DDP, 1e-3)
    assert _close(found, whole)
    # six excerpts simulated (three counts, with and without the overlap), never the whole plan
    assert len(simulated) == 6 and all(len(p.nodes) < len(stage.pcg.nodes) for p in simulated)
    assert sorted({max(node_blocks(p).values()) + 1 for p in simulated}) == list(EXCERPT_COUNTS)


def test_excerpts_whose_figures_are_not_on_a_line_fall_back_to_the_whole_plan(stage, monkeypatch):
    # the largest count's excerpt swapped for one block more: the figures at 4, 5 and "6" bend off their line, and
    # a line through them would miss the whole plan's extents by a period per block
    real = pipeline.block_excerpt
    monkeypatch.setattr(pipeline, "block_excerpt", lambda pcg, count: real(pcg, count + (count == 6)))
    found = tp_overlap(stage, LIB, DDP, 1e-3)
    assert found == tp_overlap(stage, LIB, DDP, 1e-3, counts=())


def test_a_stack_whose_middle_blocks_differ_gives_no_excerpt(stage):
    assert block_excerpt(stage.pcg, 4) is not None
    assert block_excerpt(stage.pcg, BLOCKS - 1) is None               # too few blocks left to drop
    blocks = node_blocks(stage.pcg)
    odd = next(n for n in stage.pcg.nodes if blocks[n.id] == 7 and n.kind == "op")
    nodes = tuple(replace(n, attrs=n.attrs + (("odd", 1),)) if n is odd else n for n in stage.pcg.nodes)
    assert block_excerpt(replace(stage.pcg, nodes=nodes), 4) is None


def test_the_line_refuses_bent_figures_and_streams_outgrowing_their_phase():
    def ends(forward, backward, other):
        return {("forward", "gpu:compute"): forward, ("backward", "gpu:compute"): backward,
                ("forward", "gpu:comm"): other}
    straight = [ends(1.0 + k, 3.0 + 3 * k, 0.5 + k) for k in (4, 5, 6)]
    assert _on_line((4, 5, 6), straight, 80) == (81.0, (3.0 + 240) - 81.0)
    bent = straight[:2] + [ends(7.0 + 1e-6, 21.0, 6.5)]
    assert _on_line((4, 5, 6), bent, 80) is None
    faster = [ends(1.0 + k, 3.0 + 3 * k, 0.5 + 1.5 * k - 3.0) for k in (4, 5, 6)]   # below, growing faster
    assert _on_line((4, 5, 6), faster, 80) is None
