"""The step floor (`cost.pcg_tasks.step_floor`) where tensor-parallel collectives are pipelined with their products
(`Pipeline`, sequence parallelism on a GPU's profile): a pipelined product runs as `parts` chunk tasks, each at
least the launch floor, and the floor counts them where they surely run (`_Builder._piped_floor`,
`_backward_floor`). What the branch and bound rests on: the floor is below the step of every point of the
independent grid, and below what each pipelined product issues, and it leaves out the layouts it can while never
the fastest."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.cost.pcg_tasks import DDP, _Builder, mesh_groups, simulate_pcg
from parsat.ir.recompute import BLOCKS
from parsat.search.baselines import independent_grid
from parsat.search.mesh import CandidateSteps, best
from parsat.search.request import resolve_request, step_context

# two nodes of 8 (tp 2, 4, 8 inside a node, so every tensor-parallel collective can be pipelined), small enough
# per micro-batch that the tp 8 chunks run near the launch floor, as bert-large's stage grids do at 32
MODELS = {"gpt": ({"blocks": 2, "hidden": 1024, "heads": 16, "batch": 64, "seq": 1024, "vocab": 2048}, 8),
          "bert": ({"blocks": 2, "hidden": 1024, "heads": 16, "batch": 64, "seq": 512}, 16)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def grid(request):
    """A model's micro-batch step on 16 devices, every point of its independent grid, and one pricer."""
    sizes, microbatches = MODELS[request.param]
    resolved = resolve_request(request.param, "h100x8", None, None, 16, sizes=sizes)
    step = step_context(resolved, microbatches)
    points = independent_grid(step.graph, resolved.library, step.machine, True, step.devices, lambda point: True)
    return resolved, step, points, CandidateSteps(resolved.library, step.machine, microbatches)


def _compute_busy(result) -> float:
    return sum(seconds for stream, seconds in result.busy_s.items() if stream.endswith("compute"))


def test_the_floor_is_below_every_grid_point_s_compute_and_step(grid):
    """Every point (data x tensor parallelism, sequence parallelism or not, ZeRO 0, 1 and 3) and each recomputing
    its blocks: the layout's floor (`plan=False`) <= the point's floor <= the compute stream's busy time <= the
    step. The sequence-parallel points run their products in chunks."""
    resolved, step, points, steps = grid
    assert any(p.config["sp"] for p in points) and any(not p.config["sp"] for p in points)
    for point in points:
        for pcg in (point.pcg, replace(point.pcg, recompute=BLOCKS)):
            simulated = simulate_pcg(pcg, resolved.library, step.machine, DDP, times=steps.times,
                                     microbatches=steps.microbatches)
            chunked = any(s.name.endswith(f"[1/{point.config['tp']}]") for s in simulated.result.spans)
            assert chunked == point.config["sp"]
            floor = steps.floor(pcg)
            assert steps.floor(pcg, plan=False) <= floor <= _compute_busy(simulated.result) <= simulated.step_s


def _tasks_of(spans, node, recompute: bool = False) -> tuple[float, float]:
    """Seconds of the compute tasks `node` issued: (forward, backward), or (its forward run again, 0) with
    `recompute`; a product fused with its siblings issues them under its own name (`_compute_forward`)."""
    base = ("recompute " if recompute else "") + f"{node.label} #{node.id}"
    forward = backward = 0.0
    for span in spans:
        if span.stream.kind != "compute":
            continue
        name = span.name
        if span.phase == ("backward" if recompute else "forward") and (
                name == base or name.startswith((base + " [", base + " + #"))):
            forward += span.end - span.start
        elif not recompute and span.phase == "backward" and (
                name == base + " backward" or name.startswith((base + " backward [", base + " backward ("))):
            backward += span.end - span.start
    return forward, backward


def test_each_pipelined_product_s_floor_is_below_what_it_issues(grid):
    """The argument itself, product by product, at the tp 8 sequence-parallel point (every collective pipelined)
    and recomputing its blocks: over the micro-batches, each pipelined product's forward, backward and
    recomputed forward floor (`_Builder._node_floor`) is at most the compute tasks it issued. The chunks are
    counted where they surely run, and the floor is then their sum: the forward of every product is within its
    saved copy and fused siblings of what it ran."""
    resolved, step, points, steps = grid
    point = next(p for p in points if p.config["tp"] == 8 and p.config["sp"] and p.config["zero"] == 0)
    m = steps.microbatches
    for pcg in (point.pcg, replace(point.pcg, recompute=BLOCKS)):
        spans = simulate_pcg(pcg, resolved.library, step.machine, DDP, times=steps.times, microbatches=m).result.spans
        builder = _Builder(pcg, step.machine, DDP, mesh_groups(pcg), steps.times)
        reached = builder._gradient_reached()
        fused = {i for pipe in builder.pipes.values() for i in pipe.siblings}
        runs = {i for c in builder.checkpoints.values() for i in c.runs}
        products = {pipe.product for pipe in builder.pipes.values()}
        assert len(products) >= 4 * 2    # per block: QKV and the attention projection, the MLP's two linears
        for ident in sorted(products):
            node = builder.by_id[ident]
            forward, backward, again = builder._node_floor(node, fused, reached)
            issued, issued_backward = _tasks_of(spans, node)
            assert 0 < m * forward <= issued * (1 + 1e-12) and issued_backward > 0
            assert m * backward <= issued_backward * (1 + 1e-12) and ident in reached
            if ident in runs:
                assert m * again <= _tasks_of(spans, node, recompute=True)[0] * (1 + 1e-12)
            if builder.pipes[ident].product_first(False):   # a reduce-scatter's: only its saved copy beyond
                assert m * forward >= 0.99 * issued


def test_the_floor_leaves_out_the_chunked_layout_and_never_the_fastest(grid):
    """Branch and bound with this floor keeps the best point simulating every point gives (it must not prune
    the fastest), and the tp 8 sequence-parallel layout, whose products run as 8 chunks at about the launch
    floor each, is left out whole by its floor (`CandidateSteps.beyond`): a floor counting each product's group
    once, whole, was below the bar there."""
    resolved, step, points, steps = grid
    every = CandidateSteps(resolved.library, step.machine, steps.microbatches)
    simulated = [every(p) for p in points]
    fastest = best(simulated, step.memory)
    kept, bar = steps.fastest(points, step.memory.fits)
    chosen = best([kept[i] for i in sorted(kept)], step.memory)
    assert (chosen.config, chosen.totals) == (fastest.config, fastest.totals)
    assert bar == round(fastest.totals.time_s, 12) and steps.skipped > 0
    assert not steps.beyond(fastest.pcg, bar)
    chunked = next(p for p in points if p.config["tp"] == 8 and p.config["sp"] and p.config["zero"] == 0)
    assert steps.beyond(chunked.pcg, bar)
