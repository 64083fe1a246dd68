"""Pipeline stages: layouts, schedules, their simulation, the cut-point search and the pipeline search."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest

from parsat.ir.blocks import node_blocks
from parsat.ir.graph import GraphBuilder
from parsat.ir.machine import Machine
from parsat.ir.pipeline import (BACKWARD, FORWARD, GPIPE, INTERLEAVED, ONE_F_ONE_B, Action, LayerMap, PipelineError,
                                PipelinePlan,
                                free_nodes, in_flight_counts, lay_out_stages, pcg_layers, schedule_order, simulate_schedule)
from parsat.ir.plan import without_timing
from parsat.ir.validate import validate_plan_dict
from parsat.search.optimize import optimize
from parsat.ir.errors import OptimizeError
from parsat.cost.pipeline import balanced_starts, equal_starts, layer_costs, overlapped_reduce_end, pipelined
from parsat.report.explain import explain_plan

SIZES = {"blocks": 4, "batch": 8, "seq": 16, "hidden": 32, "heads": 2, "vocab": 64}


@pytest.fixture(scope="module")
def stage_plan():
    """A small gpt's plan on 2 devices with 4 micro-batches: the stage plan the pipeline tests cut."""
    return optimize("gpt", "cpu", devices=2, sizes=SIZES, microbatches=4,
                    pipeline=False, baselines=False)


@pytest.mark.parametrize("schedule,v,m", [(GPIPE, 1, 4), (ONE_F_ONE_B, 1, 3), (ONE_F_ONE_B, 1, 8),
                                          (INTERLEAVED, 2, 4), (INTERLEAVED, 3, 8)])
def test_every_stage_runs_each_action_once_forward_first(schedule, v, m):
    p = 4 if m % 4 == 0 else 2
    orders = schedule_order(schedule, p, v, m)
    for s, order in enumerate(orders):
        assert Counter((a.phase, a.microbatch, a.chunk) for a in order) == Counter(
            (phase, k, c) for phase in (FORWARD, BACKWARD) for k in range(m) for c in range(s, p * v, p))
        seen = set()
        for a in order:
            if a.phase == BACKWARD:
                assert (a.microbatch, a.chunk) in seen
            seen.add((a.microbatch, a.chunk))


def test_interleaving_needs_whole_rounds_of_micro_batches():
    with pytest.raises(PipelineError, match="multiple of the stages"):
        schedule_order(INTERLEAVED, 4, 2, 6)
    with pytest.raises(PipelineError, match="unknown schedule"):
        schedule_order("zigzag", 2, 1, 4)


def _chain_layout(p: int, v: int):
    """A layout of p * v chunks in a chain (each chunk reads the one before), no PCG needed."""
    from parsat.ir.pipeline import Chunk, Crossing, StageLayout
    n = p * v
    return StageLayout(p, v, tuple(Chunk(c, c % p, (c,), ()) for c in range(n)),
                       tuple(Crossing(c, c, c + 1, 1) for c in range(n - 1)), ())


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_one_f_one_b_bubble_is_p_minus_one_over_m_plus_p_minus_one(p, m):
    layout = _chain_layout(p, 1)
    run = simulate_schedule(layout, ONE_F_ONE_B, m, [1.0] * p, [2.0] * p, {}, [1] * p)
    assert run.time_s == pytest.approx((m + p - 1) * 3.0)
    assert run.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert run.in_flight == tuple(min(m, p - s) for s in range(p))       # 1F1B keeps at most p - s
    gpipe = simulate_schedule(layout, GPIPE, m, [1.0] * p, [2.0] * p, {}, [1] * p)
    assert gpipe.in_flight == (m,) * p and gpipe.time_s == pytest.approx(run.time_s)
    # known from the order alone, before any cut is priced (what the cut search bounds memory with)
    assert in_flight_counts(ONE_F_ONE_B, p, 1, m) == run.in_flight
    assert in_flight_counts(GPIPE, p, 1, m) == gpipe.in_flight


def test_interleaving_divides_the_bubble_by_the_chunks():
    p, v, m = 4, 2, 8
    one = simulate_schedule(_chain_layout(p, 1), ONE_F_ONE_B, m, [1.0] * p, [2.0] * p, {}, [1] * p)
    inter = simulate_schedule(_chain_layout(p, v), INTERLEAVED, m, [0.5] * (p * v), [1.0] * (p * v), {},
                              [1] * (p * v))
    busy = m * 3.0
    assert one.time_s - busy == pytest.approx((p - 1) * 3.0)
    assert inter.time_s - busy == pytest.approx((p - 1) * 3.0 / v)


def test_transfers_delay_the_next_stage():
    layout = _chain_layout(2, 1)
    run = simulate_schedule(layout, ONE_F_ONE_B, 1, [1.0, 1.0], [1.0, 1.0], {(0, 1): 0.5}, [1, 1])
    assert run.time_s == pytest.approx(1 + 0.5 + 1 + 1 + 0.5 + 1)


def test_layout_owns_each_value_once_and_recomputes_free_ones(stage_plan):
    pcg = stage_plan.pcg
    layers = pcg_layers(pcg)
    assert layers == (-1, 0, 1, 2, 3)
    layout = lay_out_stages(pcg, [-1, 1], 2)
    free = free_nodes(pcg)
    owned = [n for c in layout.chunks for n in c.nodes if n not in free]
    assert sorted(owned) == sorted(n.id for n in pcg.nodes if n.id not in free)      # each once
    blocks = node_blocks(pcg)
    for chunk in layout.chunks:
        assert all(blocks[n] in chunk.layers for n in chunk.nodes if n not in free)
    # the residual stream crosses once, forward; the tied embedding is held by both stages
    assert [(c.source, c.target) for c in layout.crossings] == [(0, 1)]
    wte = next(n.id for n in pcg.nodes if n.op == "wte")
    assert layout.shared_weights == ((wte, (0, 1)),)
    with pytest.raises(PipelineError, match="contiguous"):
        lay_out_stages(pcg, [0, 1], 2)
    with pytest.raises(PipelineError, match="evenly"):
        lay_out_stages(pcg, [-1, 1, 2], 2)


def _crossings_by_walk(layer_map: LayerMap, starts, degree) -> list:
    """The crossings of a cut as every node and reader walked gives them (what `lay_out` did before it read only
    `reader_layers`): each node of a chunk, each later chunk one of its readers is in."""
    from parsat.ir.pipeline import Crossing
    pcg, layers, free = layer_map.pcg, layer_map.layers, layer_map.free
    bounds = [layers.index(s) for s in starts] + [len(layers)]
    chunk_of_layer = {layers[i]: c for c in range(len(starts)) for i in range(bounds[c], bounds[c + 1])}
    owner = {n.id: chunk_of_layer[layer_map.blocks[n.id]] for n in pcg.nodes if n.id not in free}
    out = []
    for node in pcg.nodes:
        if node.id in owner:
            for target in sorted({owner[r.id] for r in pcg.readers_of.get(node.id, ()) if r.id in owner}
                                 - {owner[node.id]}):
                out.append(Crossing(node.id, owner[node.id], target, node.degrees.piece_elements(node.shape)))
    return out


def test_a_cut_s_crossings_are_those_every_node_s_readers_give(stage_plan):
    """`lay_out` reads only the nodes a node of another layer reads (`LayerMap.reader_layers`): for every cut of
    the stage plan into 2 to 4 chunks, in one or two chunks per stage, its crossings are the ones walking every
    node and its readers gives, in the same order, and some cut has crossings."""
    from itertools import combinations
    layer_map = LayerMap(stage_plan.pcg)
    layers = layer_map.layers
    assert layer_map.reader_layers and all(layer not in read for _n, layer, read, _e in layer_map.reader_layers)
    crossed = 0
    for chunks in (2, 3, 4):
        for rest in combinations(layers[1:], chunks - 1):
            starts = (layers[0],) + rest
            for degree in {chunks, chunks // 2} - {0}:
                if chunks % degree:
                    continue
                layout = layer_map.lay_out(starts, degree)
                assert list(layout.crossings) == _crossings_by_walk(layer_map, starts, degree)
                crossed += bool(layout.crossings)
    assert crossed


def test_a_cut_laid_out_from_kept_runs_of_layers_is_the_one_a_fresh_map_gives(stage_plan):
    """`LayerMap.chunk_nodes` keeps each run of layers' nodes: laying out every cut into 2 to 4 chunks with one map
    (runs found again) gives, cut for cut, the layout a fresh map gives (chunks' nodes in the PCG's order, crossings,
    shared weights), and each run's nodes are the union of its layers' members."""
    from itertools import combinations
    kept = LayerMap(stage_plan.pcg)
    layers = kept.layers
    cuts = 0
    for chunks in (2, 3, 4):
        for rest in combinations(layers[1:], chunks - 1):
            starts = (layers[0],) + rest
            for degree in {chunks, chunks // 2} - {0}:
                if not chunks % degree:
                    fresh = LayerMap(replace(stage_plan.pcg))   # a PCG of its own: no structure shared
                    assert kept.lay_out(starts, degree) == fresh.lay_out(starts, degree)
                    cuts += 1
    runs = kept.structure._runs
    assert cuts > len(runs) > 0   # runs were found again
    for (first, end), (nodes, ordered) in runs.items():
        assert nodes == frozenset().union(*(kept.layer_members[layer] for layer in layers[first:end]))
        assert list(ordered) == sorted(nodes, key=kept.position.__getitem__)


def test_a_pipelined_plan_round_trips_through_the_plan_json(stage_plan):
    plan = pipelined(stage_plan, 2, ONE_F_ONE_B, Machine.resolve("cpu").with_devices(4))
    data = json.loads(plan.to_json())
    validate_plan_dict(data, ValueError, "plan")
    assert data["devices"] == 4 and PipelinePlan.from_dict(data["pipeline"]) == plan.pipeline
    assert plan.pipeline.stages[0].in_flight == 2 and plan.pipeline.stages[1].in_flight == 1
    text = explain_plan(plan)
    assert "PP 2 inside a node" in text and "1F1B, 4 micro-batches" in text and "stage 1:" in text
    bad = dict(data, devices=6)
    with pytest.raises(ValueError, match="stages of 2 devices"):
        validate_plan_dict(bad, ValueError, "plan")


def _uneven(library=None):
    """Eight residual MLP blocks, blocks 0 and 1 eight times wider than the rest: layer counts cut badly."""
    g = GraphBuilder(library, name="uneven")
    rows, hidden = 4096, 512
    x = g.input("x", [rows, hidden])
    for i in range(8):
        width = 8 * 4 * hidden if i in (0, 1) else 4 * hidden
        w1 = g.weight(f"b{i}_w1", [hidden, width])
        w2 = g.weight(f"b{i}_w2", [width, hidden])
        h = g.op("relu", g.op("matmul", x, w1, name=f"b{i}_up"), name=f"b{i}_act")
        x = g.op("add", x, g.op("matmul", h, w2, name=f"b{i}_down"), name=f"b{i}_out")
    err = g.op("sub", x, g.input("target", [rows, hidden]), name="err")
    sq = g.op("reduce_sum", g.op("reduce_sum", g.op("mul", err, err, name="sq"), dim=1, name="rows"), dim=0,
              name="total")
    g.output(g.op("scale", sq, c=1.0 / (rows * hidden), name="loss"))
    return g.build()


def _balanced_by_loop(layers, cost, chunks, degree, schedule, microbatches, capacity):
    """The cut-point programme written as plain loops over (chunk, first layer, next start): what
    `balanced_starts` computes an array row at a time, kept here to check that it computes the same cut."""
    n, inf = len(layers), float("inf")
    if chunks > n:
        return None
    times, acts, states = [0.0], [0], [0]
    for layer in layers:
        c = cost[layer]
        times.append(times[-1] + (c.forward_s + c.backward_s) * microbatches + c.step_s)
        acts.append(acts[-1] + c.activation_bytes)
        states.append(states[-1] + c.state_bytes)
    transient = max((cost[layer].transient_bytes for layer in layers), default=0)
    held = in_flight_counts(schedule, degree, 1, microbatches) if schedule != INTERLEAVED else (1,) * degree
    best = [[(inf, -1)] * (n + 1) for _ in range(chunks + 1)]
    best[chunks][n] = (0.0, n)
    for k in range(chunks - 1, -1, -1):
        for i in range(n - (chunks - k) + 1):
            for j in range(i + 1, n - (chunks - k - 1) + 1):
                rest = best[k + 1][j][0]
                if rest == inf:
                    continue
                memory = states[j] - states[i] + held[k % degree] * (acts[j] - acts[i]) + transient
                if schedule != INTERLEAVED and memory > capacity:
                    continue
                value = max(rest, times[j] - times[i])
                if value < best[k][i][0]:
                    best[k][i] = (value, j)
    if best[0][0][0] == inf:
        return None
    starts, at = [], 0
    for k in range(chunks):
        starts.append(layers[at])
        at = best[k][at][1]
    return tuple(starts)


@pytest.mark.parametrize("seed", range(12))
def test_balanced_starts_is_the_plain_programme(seed):
    """The array form of the cut-point programme gives the cut the plain loops give, ties (equal layers, so many
    cuts are equally busy) and memory limits (tight, exact at a boundary, huge byte counts, float bytes)
    included."""
    import random

    from parsat.cost.pipeline import LayerCost

    rng = random.Random(seed)
    n = rng.randint(2, 24)
    layers = list(range(-1, n - 1)) if seed % 2 else list(range(n))
    scale = 2 ** 50 if seed % 4 == 3 else 1
    same = seed % 3 == 0     # identical layers: every cut of equal counts ties
    cost = {}
    for layer in layers:
        r = rng if not same else random.Random(0)
        act = r.randint(0, 1000) * scale
        state = r.randint(0, 5000) * scale
        cost[layer] = LayerCost(r.choice([0.5, 0.25, r.random()]), r.choice([1.0, r.random()]),
                                float(act) if seed == 5 else act, state, r.choice([0.0, r.random() / 10]),
                                r.randint(0, 300) * scale)
    for schedule in (ONE_F_ONE_B, GPIPE, INTERLEAVED):
        for degree in (1, 2, 3, 4):
            m = rng.choice([degree, 2 * degree, 8])
            chunks = degree * (2 if schedule == INTERLEAVED else 1)
            whole = sum(c.state_bytes + m * c.activation_bytes for c in cost.values())
            for capacity in (float("inf"), whole / degree, whole / (2 * degree), float(whole // degree), 0.0):
                args = (layers, cost, chunks, degree, schedule, m, capacity)
                assert balanced_starts(*args) == _balanced_by_loop(*args), (schedule, degree, m, capacity)


def test_cut_points_follow_the_cost_not_the_layer_count(uneven_stage):
    stage = uneven_stage   # the search this test made is the fixture's, read by the cut refinement's tests too
    machine = Machine.resolve("h100x8").with_devices(8)
    balanced = pipelined(stage, 4, ONE_F_ONE_B, machine)
    layers = pcg_layers(stage.pcg)
    equal = pipelined(stage, 4, ONE_F_ONE_B, machine, starts=equal_starts(layers, 4))
    assert [c.layers for c in equal.pipeline.layout.chunks] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # the wide blocks 0 and 1 get a stage each, where layer counts put them on one
    assert [c.layers for c in balanced.pipeline.layout.chunks][:2] == [(0,), (1,)]
    assert balanced.totals.time_s < equal.totals.time_s * 0.8
    slowest = max(s.forward_s + s.backward_s for s in balanced.pipeline.stages)
    assert slowest < max(s.forward_s + s.backward_s for s in equal.pipeline.stages)
    # memory is a limit of the cut: with room for little more than one wide block per stage the cut still fits
    costs = layer_costs(stage)
    wide = costs[0].state_bytes + 4 * costs[0].activation_bytes     # stage 0 holds 4 micro-batches (1F1B)
    starts = balanced_starts(layers, costs, 4, 4, ONE_F_ONE_B, 16, wide * 1.05)
    assert starts is not None and starts[:2] == (0, 1)
    assert balanced_starts(layers, costs, 4, 4, ONE_F_ONE_B, 16, costs[0].state_bytes * 0.5) is None


def test_the_search_pipelines_when_pinned_and_refuses_bad_pins():
    plan = optimize("gpt", "cpu", devices=4, sizes=SIZES, degrees={"pp": 2},
                    microbatches=4, schedule=ONE_F_ONE_B)
    assert plan.pipeline is not None and plan.pipeline.degree == 2 and plan.pipeline.schedule == ONE_F_ONE_B
    assert plan.devices == 4 and plan.pipeline.stage_devices == 2
    assert any(t.get("pp") == 2 for t in plan.saturation["pipeline_search"])
    grid = plan.baseline_plans.get("best_grid")
    assert grid is not None and grid.config.get("pp") == 2
    assert plan.extraction.get("chosen") != "best_grid"      # pinned: the grid is compared with, never taken
    tensor = optimize("gpt", "cpu", devices=4, sizes=SIZES, degrees={"pp": 2, "tp": 2},
                      microbatches=4, schedule=ONE_F_ONE_B)
    assert tensor.pcg.mesh.names == ("tp",) and tensor.pipeline.stage_devices == 2
    with pytest.raises(OptimizeError, match="does not divide"):
        optimize("gpt", "cpu", devices=4, sizes=SIZES, degrees={"pp": 3})
    with pytest.raises(OptimizeError, match="only a built-in example"):
        optimize("mlp", "cpu", devices=4, degrees={"pp": 2})
    with pytest.raises(OptimizeError, match="no-pipeline"):
        optimize("gpt", "cpu", devices=4, sizes=SIZES, degrees={"pp": 2}, pipeline=False)


def test_show_draws_the_schedule_and_refuses_an_unpipelined_plan(stage_plan, tmp_path, capsys):
    from parsat.cli import main
    plan = pipelined(stage_plan, 2, ONE_F_ONE_B, Machine.resolve("cpu").with_devices(4))
    path = tmp_path / "piped.json"
    plan.save(path)
    assert main(["show", str(path), "--schedule", "-o", str(tmp_path / "s.svg")]) == 0
    svg = (tmp_path / "s.svg").read_text()
    # one box per action: 2 stages x 4 micro-batches x forward and backward
    assert svg.startswith("<svg") and svg.count("<title>") == 16 and "1F1B, 2 stages, 4 micro-batches" in svg
    assert main(["show", str(path), "--schedule", "-o", str(tmp_path / "s.png")]) == 1
    flat = tmp_path / "flat.json"
    stage_plan.save(flat)
    assert main(["show", str(flat), "--schedule", "-o", str(tmp_path / "f.svg")]) == 1
    assert "not pipelined" in capsys.readouterr().err
    assert main(["explain", str(path)]) == 0
    lanes = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("stage 0 ")]
    assert lanes and set(lanes[0].split("|")[1]) <= set("FB.") and "F" in lanes[0] and "B" in lanes[0]


def test_degrees_start_where_a_stage_holds_its_weights_and_counts_divide_the_batch():
    from parsat.search.pipeline_search import microbatch_counts, pipeline_degrees
    a100 = Machine.resolve("a100x8")
    # GPT-3 175B: 2.8 TB of weights' state; 8 stages of 128 devices hold 44 GB each with TP 8, 4 stages 88 GB
    assert pipeline_degrees(1024, a100, 175_000_000_000, 97, None) == [8, 16]
    assert pipeline_degrees(64, a100, 1_300_000_000, 25, None) == [2, 4]
    assert pipeline_degrees(64, a100, 1_300_000_000, 25, 4) == [4]
    assert pipeline_degrees(8, a100, 1_300_000_000, 3, None) == [2]          # no more stages than layers
    h100 = Machine.resolve("h100x8")
    # 48 GPUs (Megatron-Core's 1.7B row): 2 stages of 24, never 4 of 12 or 8 of 6 (neither whole nodes nor a part dividing one)
    assert 4 not in pipeline_degrees(48, h100, 1_700_000_000, 24, None)
    assert all(48 // p % 8 == 0 or 8 % (48 // p) == 0 for p in pipeline_degrees(48, h100, 400_000_000_000, 24, None))
    # 1,536 GPUs (Megatron-Core's 177B row, run at 6 stages): a degree need not be a power of two
    assert pipeline_degrees(1536, h100, 177_000_000_000, 97, None) == [6, 8]
    assert pipeline_degrees(48, h100, 1_700_000_000, 24, None) == [2, 3]    # 3 stages of 16: whole nodes
    assert microbatch_counts(512, 8, None) == [32, 64]
    assert microbatch_counts(24, 4, None) == [24]                           # 16 and 32 do not divide 24
    assert microbatch_counts(512, 8, 12) == [12]
    assert microbatch_counts(None, 4, None) == [16, 32]   # an imported graph's step: one micro-batch's, any count


def _kept_degrees(example: str, sizes: dict, layers: int, devices: int, machine: str, batch: int):
    """`pipeline_degrees` as the optimizer calls it: the whole model's parameters and, per sample, its activations."""
    from parsat.cost.saved import graph_kept_bytes
    from parsat.dsl.library import load_library
    from parsat.ir.models import build_example
    from parsat.search.pipeline_search import parameters_of, pipeline_degrees
    graph, resolved = build_example(example, {**sizes, "batch": batch}), Machine.resolve(machine)
    kept = graph_kept_bytes(graph, load_library()[0], resolved) / batch
    return pipeline_degrees(devices, resolved, parameters_of(graph), layers + 1, None,
                            batch=batch, sample_bytes=kept)


def test_the_degree_below_joins_where_zero1_makes_its_stage_fit():
    """Megatron-Core's 314B row runs 8 stages of 384 H100s: unsharded, a device of a stage holds 72 GiB of weights'
    state (within 80 GiB, not within 80% of it, so the least degree without ZeRO is 12); with ZeRO-1 over the
    stage's 48 replicas 19 GiB, and 1F1B's first stage keeps one 4,096-token sample's activations of its layers for
    each of its 8 micro-batches in flight (37 GiB over tp 8): 56 GiB, in 80%. So 8 is searched, beside 12 and 16."""
    mcore_314b = {"blocks": 96, "hidden": 16384, "heads": 128, "seq": 4096, "vocab": 131072}
    assert _kept_degrees("gpt", mcore_314b, 96, 3072, "h100x8", 1536) == [8, 12, 16]
    from parsat.search.pipeline_search import pipeline_degrees
    assert pipeline_degrees(3072, Machine.resolve("h100x8"), 311_472_717_824, 97, None) == [12, 16]   # no batch
    # issue 28's rows search the pairs they searched: GPT-3 175B on 1,024 A100s at 4 stages would hold 81 GiB of
    # unsharded state, more than the device
    assert _kept_degrees("gpt-175b", {}, 96, 1024, "a100x8", 512) == [8, 16]
    # Llama 2 70B on 64 H100s: at 2 stages, 28 GiB of ZeRO-1 state (4 replicas) and the activations of 8 samples a
    # replica for each of 2 micro-batches in flight do not fit in 80%
    assert _kept_degrees("llama-70b", {}, 80, 64, "h100x8", 512) == [4, 8]


def test_the_last_cut_can_move_to_the_last_layer_and_no_further(stage_plan):
    machine = Machine.resolve("cpu").with_devices(8)
    # 4 chunks of 5 layers: the search moves cuts one layer at a time, the last one up to the last layer
    plan = pipelined(stage_plan, 4, ONE_F_ONE_B, machine)
    starts = [c.layers[0] for c in plan.pipeline.layout.chunks]
    assert starts == sorted(starts) and starts[-1] <= 3 and len(starts) == 4
    interleaved = pipelined(stage_plan, 2, INTERLEAVED, machine.with_devices(4), chunks_per_stage=2)
    assert [c.stage for c in interleaved.pipeline.layout.chunks] == [0, 1, 0, 1]


def test_a_pinned_pipeline_that_cannot_be_says_why():
    with pytest.raises(OptimizeError, match="interleaved needs a multiple of the stages"):
        optimize("gpt", "cpu", devices=4, sizes=SIZES, degrees={"pp": 4}, microbatches=2, schedule=INTERLEAVED)


def test_a_schedule_for_an_unpipelined_plan_is_said_not_fatal():
    said = []
    plan = optimize("gpt", "cpu", devices=2, sizes=SIZES, schedule=ONE_F_ONE_B,
                    baselines=False, progress=said.append)
    assert plan.pipeline is None and any("not pipelined" in m for m in said)


# a gpt whose stage plans keep too much for a 7 MiB device (`small_pipelined`)
SMALL_SIZES = {"blocks": 4, "batch": 16, "seq": 256, "hidden": 64, "heads": 4, "vocab": 128}


def _counting_where(left: list):
    """`CandidateSteps.where` that also appends to `left` the name of each candidate it leaves unsimulated; it
    returns what `where` returns, so a search counted is the search made without it."""
    from parsat.search.mesh import CandidateSteps

    where = CandidateSteps.where

    def counting(self, candidate, ranked):
        if candidate is not None and ranked is not None and not ranked(candidate):
            left.append(candidate.name)   # left unsimulated
        return where(self, candidate, ranked)
    return counting


@pytest.fixture(scope="module")
def small_pipelined():
    """`SMALL_SIZES`' gpt pinned to 2 stages over 4 cpu devices of 7 MiB, 4 micro-batches, searched once for the
    two tests that read it, and the candidates its stage steps left unsimulated (`CandidateSteps.where` counted
    during the search: the count returns what `where` returns, so the search is the one made without it)."""
    from parsat.search.mesh import CandidateSteps

    left: list = []
    small = replace(Machine.resolve("cpu"), memory_capacity=7 * 2 ** 20)   # 7 MiB, as the tests read it
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CandidateSteps, "where", _counting_where(left))
        plan = optimize("gpt", small, devices=4, sizes=SMALL_SIZES, degrees={"pp": 2}, microbatches=4)
    return plan, tuple(left)


def test_a_stage_plan_that_fits_no_schedule_is_searched_again_recomputing(small_pipelined):
    """llama-70b:64's regression, small: a stage plan keeping every activation passed the stage search's memory
    check (the whole plan, one micro-batch alive, against a device p times the size) and needed more than a
    device once cut and run in any schedule. The check is now the pricing's own figure (`StageFit`), so that plan
    is searched again recomputing blocks, and what comes back as fitting fits when priced again."""
    from parsat.cost.pipeline import StageFit
    from parsat.ir.costs import totals
    from parsat.ir.recompute import BLOCKS, NONE
    sizes = SMALL_SIZES
    cpu = Machine.resolve("cpu")
    small = replace(cpu, memory_capacity=7 * 2 ** 20)       # 7 MiB a device: between the two figures below
    p, m = 2, 4
    stage_machine = replace(small.with_devices(2), memory_capacity=small.memory_capacity * p)
    # optimized with room for its simulated peak (14.3 MiB, as `parsat run` holds it: what decides whether an
    # unstaged plan fits, `Totals.memory_bytes`), the same plan the stage machine's per-node bound admits (12.0 MiB)
    roomy = replace(stage_machine, memory_capacity=16 * 2 ** 20)
    keeping = optimize("gpt", roomy, devices=2, sizes=sizes, microbatches=m, pipeline=False,
                       baselines=False, recompute=NONE)
    assert totals(keeping.costs, stage_machine).fits(stage_machine)           # the old check: it fits...
    fit = StageFit(p, small.with_devices(4))
    assert not fit.fits(fit.peak_bytes(keeping))                              # ...the schedules' figure: it does not
    assert not any(pipelined(keeping, p, name, small.with_devices(4), chunks_per_stage=v).totals.fits(small)
                   for name, v in ((ONE_F_ONE_B, 1), (INTERLEAVED, 2), (GPIPE, 1)))

    plan, _ = small_pipelined   # optimize("gpt", small, devices=4, sizes=sizes, degrees={"pp": p}, microbatches=m)
    assert plan.pipeline is not None and plan.totals.fits(small)
    assert plan.pcg.recompute == BLOCKS                                       # searched again recomputing
    # priced again from its stage plan at its own cut: every stage within the device
    stage = replace(plan, machine=stage_machine, devices=plan.pipeline.stage_devices, pipeline=None)
    again = pipelined(stage, p, plan.pipeline.schedule, small.with_devices(4),
                      chunks_per_stage=plan.pipeline.layout.chunks_per_stage,
                      starts=[c.layers[0] for c in plan.pipeline.layout.chunks])
    assert again.totals.peak_memory_bytes == plan.totals.peak_memory_bytes <= small.memory_capacity
    assert all(s.memory_bytes <= small.memory_capacity for s in again.pipeline.stages)
    for tried in plan.saturation["pipeline_search"]:                          # every pipelined plan said to fit does
        if tried.get("fits"):
            assert tried["peak_memory_bytes"] <= small.memory_capacity


def _backwards(*spans):
    """A stage's busy list of backwards only: (chunk, micro-batch, start, end) each."""
    return [(Action(BACKWARD, k, c), start, end) for c, k, start, end in spans]


def test_a_gradient_reduction_runs_beside_the_last_backward_of_its_chunk():
    busy = _backwards((0, 0, 0.0, 1.0), (0, 1, 2.0, 3.0))
    # shorter than the last backward: done when it is (the last bucket waits for the last gradient)
    assert overlapped_reduce_end(busy, {0: 0.5}) == pytest.approx(3.0)
    # longer: from the last backward's start, not from the first one's, nor after the flush
    assert overlapped_reduce_end(busy, {0: 4.0}) == pytest.approx(6.0)
    assert overlapped_reduce_end(busy, {}) == 0.0


def test_interleaved_chunks_reduce_one_after_another_in_the_order_their_last_backwards_start():
    busy = _backwards((1, 0, 0.0, 1.0), (0, 0, 1.0, 2.0))
    # chunk 1 ends its backward first: its 3 s run 0-3, then chunk 0's 1 s after it, not beside it
    assert overlapped_reduce_end(busy, {0: 1.0, 1: 3.0}) == pytest.approx(4.0)
    assert overlapped_reduce_end(busy, {0: 1.0, 1: 0.5}) == pytest.approx(2.0)


def test_a_stage_overlaps_its_gradient_reductions_with_its_last_backwards():
    """The pipelined step with the reductions overlapped (and bucketed) is shorter than with all of them after
    the flush (and one collective a weight), and no shorter than with no synchronisation at all."""
    machine = Machine.resolve("cpu").with_devices(4)
    stage_plan = optimize("gpt", "cpu", devices=2, sizes=SIZES, microbatches=4, pipeline=False, baselines=False,
                          degrees={"dp": 2})
    reduce_s = sum(c.grad_reduce_s for c in stage_plan.costs.values() if c.weight_chain)
    assert reduce_s > 0   # the stage plan replicates weights: their gradients are reduced
    serial = replace(stage_plan, costs={i: replace(c, grad_reduce_s=0.0) for i, c in stage_plan.costs.items()})
    starts = equal_starts(LayerMap(stage_plan.pcg).layers, 2)
    overlapped = pipelined(stage_plan, 2, ONE_F_ONE_B, machine, starts=starts).totals.time_s
    after_flush = pipelined(serial, 2, ONE_F_ONE_B, machine, starts=starts).totals.time_s
    free = replace(stage_plan, costs={i: replace(c, grad_reduce_s=0.0, comm_s=0.0) if c.weight_chain else c
                                      for i, c in stage_plan.costs.items()})
    unsynced = pipelined(free, 2, ONE_F_ONE_B, machine, starts=starts).totals.time_s
    assert unsynced - 1e-12 <= overlapped < after_flush


def test_a_stage_reduces_after_its_last_backward_where_the_runtime_does_not_overlap():
    """`CommProfile.overlap_grad_reduce` off (Megatron-LM of 2021 all-reduced each stage's gradients after the
    pipeline's flush): on a GPU preset the pipelined step grows, by at most the stage plan's reductions."""
    overlapped = Machine.resolve("h100x8").with_devices(4)
    after = replace(overlapped, comm=replace(overlapped.comm, overlap_grad_reduce=False))
    stage_plan = optimize("gpt", "h100x8", devices=2, sizes=SIZES, microbatches=4, pipeline=False, baselines=False,
                          degrees={"dp": 2, "zero": 0})
    reduce_s = sum(c.grad_reduce_s for c in stage_plan.costs.values() if c.weight_chain)
    assert reduce_s > 0
    starts = equal_starts(LayerMap(stage_plan.pcg).layers, 2)
    on = pipelined(stage_plan, 2, ONE_F_ONE_B, overlapped, starts=starts).totals.time_s
    off = pipelined(stage_plan, 2, ONE_F_ONE_B, after, starts=starts).totals.time_s
    assert on < off <= on + reduce_s + 1e-12


def test_the_stage_memo_changes_no_price(stage_plan):
    """A pricer that reuses layer maps, layouts, chunk costs and stage syncs (`StageMemo`, one search's memo shared
    by plans with the same nodes) prices every cut, schedule and ZeRO stage exactly as a fresh pricer does, the
    memory checks included: what it reuses follows from the chunks' layers, whatever was priced before."""
    from itertools import combinations
    from parsat.cost.pipeline import StageFit, StageMemo, StagePricer
    machine = Machine.resolve("cpu").with_devices(4)
    zero1 = replace(stage_plan, pcg=replace(stage_plan.pcg, zero=1))   # the same nodes: one layer map for both
    memo = StageMemo(kept=1)
    shared = {id(plan): StagePricer(plan, machine, memo=memo) for plan in (stage_plan, zero1)}
    layers = pcg_layers(stage_plan.pcg)
    priced = 0
    for schedule, v in ((ONE_F_ONE_B, 1), (GPIPE, 1), (INTERLEAVED, 2)):
        for rest in combinations(layers[1:], 2 * v - 1):
            for plan in (stage_plan, zero1):
                cut = (layers[0],) + rest
                fresh = StagePricer(plan, machine).pipelined(2, schedule, v, starts=cut)
                again = shared[id(plan)].pipelined(2, schedule, v, starts=cut)
                assert again.to_json() == fresh.to_json(), (schedule, cut, plan.pcg.zero)
                priced += 1
    assert priced > 20
    fit, memory = StageFit(2, machine), StageFit(2, machine, memo=memo)
    assert memory == fit   # the memo is not part of the judgment
    for plan in (stage_plan, zero1, stage_plan):
        assert memory.peak_bytes(plan) == StageFit(2, machine).peak_bytes(plan)


def test_a_stage_pricer_shares_a_node_s_share_only_with_nodes_of_the_same_cost_object(stage_plan):
    """`StagePricer.shares`, worked out once per (cost object, in-node collective): each node's share is the one
    `node_share` gives it alone, and nodes share one only where they hold the same cost object and are alike on
    whether they are an in-node collective (a model of repeated blocks prices many nodes with one cost)."""
    from parsat.cost.pipeline import StagePricer, _in_node_collectives, node_share
    machine = Machine.resolve("cpu").with_devices(4)
    for plan in (stage_plan, replace(stage_plan, pcg=replace(stage_plan.pcg, zero=1))):
        pricer, in_node = StagePricer(plan, machine), _in_node_collectives(plan)
        mb = plan.graph.microbatches
        assert pricer.shares == {i: node_share(c, mb, i in in_node) for i, c in plan.costs.items()}
        for i, c in plan.costs.items():
            for j, d in plan.costs.items():
                if pricer.shares[i] is pricer.shares[j]:
                    assert c is d and (i in in_node) == (j in in_node)
        assert len({id(s) for s in pricer.shares.values()}) <= len({id(c) for c in plan.costs.values()}) * 2


def _laid_out_least_peak(pricer, degree, schedules):
    """`StagePricer.least_peak_bytes` as it was worked out before the layer sums: every start cut laid out, its
    chunks' costs summed node by node, each stage's memory from them."""
    from parsat.ir.pipeline import activation_peaks, schedule_order
    least = None
    for schedule, v in schedules:
        orders = schedule_order(schedule, degree, v, pricer.microbatches)
        for cut in pricer.start_cuts(degree, schedule, v):
            layout = pricer.layer_map.lay_out(cut, degree)
            per_chunk = pricer._chunk_costs(layout)
            busiest = max(pricer.stage_memory(layout, per_chunk,
                                              activation_peaks(orders, [c.activation_bytes for c in per_chunk])))
            least = busiest if least is None else min(least, busiest)
    return least


def test_a_cut_s_memory_from_its_layers_sums_is_the_laid_out_chunks(stage_plan):
    """The memory check reads each chunk's bytes from its layers' integer sums (`StagePricer._chunk_bytes`), without
    laying the cut out: for every cut, schedule and degree it equals the laid-out chunks' node-by-node sums (a free
    value two chunks of a stage read counted once, GPT's tied embedding on two stages, recomputed blocks' transient
    bytes), and the per-layer costs the balanced cut reads equal a one-chunk-per-layer layout's to the bit. A plan
    with a figure that is not an integer takes the node-by-node sums (`_chunk_bytes` is None) and gives the same."""
    from itertools import combinations
    from parsat.cost.pipeline import StagePricer, applicable_schedules
    from parsat.ir.pipeline import stage_comm_elements
    from parsat.search.recompute import recomputed_pcg_costs
    machine = Machine.resolve("cpu").with_devices(4)
    recomputing = replace(stage_plan.pcg, recompute="blocks")
    plans = [stage_plan, replace(stage_plan, pcg=replace(stage_plan.pcg, zero=1)),
             replace(stage_plan, pcg=recomputing, costs=recomputed_pcg_costs(recomputing, stage_plan.costs))]
    some = next(i for i, c in stage_plan.costs.items() if c.activation_bytes)
    fractional = replace(stage_plan, costs={**stage_plan.costs, some: replace(
        stage_plan.costs[some], activation_bytes=stage_plan.costs[some].activation_bytes + 0.5)})
    compared = 0
    for plan in plans + [fractional]:
        pricer = StagePricer(plan, machine)
        layers = pricer.layer_map.layers
        per_layer = pricer._chunk_costs(pricer.layer_map.lay_out(layers, len(layers)))
        assert pricer.layer_costs() == dict(zip(layers, per_layer))
        assert (pricer._layer_bytes is None) == (plan is fractional)
        if plan is fractional:
            assert pricer._chunk_bytes(layers[:2], 2) is None
        for degree in (2, 3):
            for chunks in (degree, 2 * degree):
                for rest in combinations(layers[1:], chunks - 1) if plan is not fractional else ():
                    cut = (layers[0],) + rest
                    layout = pricer.layer_map.lay_out(cut, degree)
                    laid = pricer._chunk_costs(layout)
                    assert pricer._chunk_bytes(cut, degree) == [(c.activation_bytes, c.state_bytes, c.transient_bytes)
                                                               for c in laid], (cut, degree)
                    # a stage's sums, kept by its chunks' layers, are the ones its nodes give in this layout
                    grads = stage_comm_elements(layout, plan.costs, "grad_sync_elements")
                    for s, (comm, grad) in enumerate(zip(stage_comm_elements(layout, plan.costs), grads)):
                        optimizer = sum(plan.costs[i].optimizer_s for i in layout.stage_nodes(s) if i in plan.costs)
                        assert pricer._stage_sums(layout, s) == (optimizer, comm, grad)
                    compared += 1
            schedules = applicable_schedules(None, degree, pricer.microbatches, pricer.layer_map.model_layers)
            assert pricer.least_peak_bytes(degree, schedules) == _laid_out_least_peak(pricer, degree, schedules)
    assert compared > 30
    assert any(c.transient_bytes for c in plans[2].costs.values())


@pytest.fixture(scope="module")
def uneven_stage():
    """`_uneven`'s plan on 2 devices with 16 micro-batches: a stage plan whose cuts the refinement moves."""
    return optimize(_uneven(), "h100x8", devices=2, limits={"enodes": 15000}, baselines=False, microbatches=16)


def _count_prices(monkeypatch, tag: str) -> Counter:
    """`StagePricer.price` patched to count its calls by the pricer's attribute `tag` (set on each pricer)."""
    from parsat.cost.pipeline import StagePricer
    calls: Counter = Counter()
    price = StagePricer.price

    def counted(self, layout, schedule):
        calls[getattr(self, tag)] += 1
        return price(self, layout, schedule)
    monkeypatch.setattr(StagePricer, "price", counted)
    return calls


@pytest.mark.parametrize("capacity", [None, 1])
def test_the_cut_refinement_s_floor_changes_no_plan_and_prunes_only_under_a_step_that_fits(
        stage_plan, uneven_stage, capacity, monkeypatch):
    """`StagePricer._busy_floor` is at or below the step `price` gives every cut, in every schedule; the
    refinement that leaves cuts above a fitting step's floor unpriced (`pipelined`) returns the plan the
    refinement pricing every cut returns, byte for byte, with fewer pricings on the uneven model. Where no cut
    fits (capacity 1 byte) a cut that fits would be better whatever its step, so nothing is left unpriced: the
    pricings are the same in number."""
    from itertools import combinations
    from parsat.cost.pipeline import StagePricer
    calls = _count_prices(monkeypatch, "floor_on")
    for plan, machine, degree in ((stage_plan, Machine.resolve("cpu").with_devices(4), 2),
                                  (uneven_stage, Machine.resolve("h100x8").with_devices(8), 4)):
        if capacity is not None:
            machine = replace(machine, memory_capacity=capacity)
        layers = pcg_layers(plan.pcg)
        for schedule, v in ((ONE_F_ONE_B, 1), (GPIPE, 1), (INTERLEAVED, 2)):
            if degree * v > len(layers):
                continue
            pruned = StagePricer(plan, machine)
            pruned.floor_on = True
            for rest in list(combinations(layers[1:], degree * v - 1))[:40]:
                cut = (layers[0],) + rest
                floor = pruned._busy_floor(cut, degree)
                assert floor <= pruned.price(pruned.layer_map.lay_out(cut, degree), schedule).totals.time_s
            calls.clear()
            pruned = StagePricer(plan, machine)
            pruned.floor_on = True
            unpruned = StagePricer(plan, machine)
            unpruned.floor_on = False
            unpruned._busy_floor = lambda starts, degree: -float("inf")
            assert pruned.pipelined(degree, schedule, v).to_json() == unpruned.pipelined(degree, schedule, v).to_json()
            assert calls[True] <= calls[False], schedule
            if capacity is not None:
                assert calls[True] == calls[False], schedule
            elif plan is uneven_stage and schedule == ONE_F_ONE_B:
                assert calls[True] < calls[False]


def test_the_cut_floor_counts_fill_and_drain_where_chunks_chain_and_prunes_more(uneven_stage, monkeypatch):
    """Where each chunk reads the one before it, a cut's floor (`StagePricer._busy_floor`) counts the stages'
    fill and drain: above the busiest stage's m micro-batches for some cut (1F1B on 2 and 4 stages of 16 micro-batches),
    never above the step `price` gives, and the refinement that leaves cuts above it unpriced returns the same plan
    with fewer pricings than the busiest stage's floor alone. Fails where the floor reads no fill or drain (no cut
    above, the same count) or counts a chunk twice (a floor above a price)."""
    from itertools import combinations
    from parsat.cost.pipeline import StagePricer
    machine = Machine.resolve("h100x8").with_devices(8)
    pricer = StagePricer(uneven_stage, machine)
    assert pricer._is_chained
    layers, busy, m = pricer.layer_map.layers, pricer._own_busy_s, pricer.microbatches
    index = {layer: k for k, layer in enumerate(layers)}
    above = 0
    for degree in (2, 4):
        for rest in list(combinations(layers[1:], degree - 1))[:40]:
            cut = (layers[0],) + rest
            bounds = [index[s] for s in cut] + [len(layers)]
            busiest = max(sum(busy[layers[i]] for i in range(bounds[c], bounds[c + 1])) for c in range(degree)) * m
            floor = pricer._busy_floor(cut, degree)
            assert floor <= pricer.price(pricer.layer_map.lay_out(cut, degree), ONE_F_ONE_B).totals.time_s
            above += floor > busiest * (1 + 1e-9)
    assert above > 0
    calls = _count_prices(monkeypatch, "kind")
    sharp, blunt = StagePricer(uneven_stage, machine), StagePricer(uneven_stage, machine)
    sharp.kind, blunt.kind = "sharp", "blunt"
    blunt._is_chained = False   # the busiest stage's floor alone
    assert sharp.pipelined(2, ONE_F_ONE_B).to_json() == blunt.pipelined(2, ONE_F_ONE_B).to_json()
    assert calls["sharp"] < calls["blunt"]


def test_a_stage_step_simulates_only_the_baselines_that_fit_and_the_plan_is_the_same(small_pipelined, monkeypatch):
    """A pipeline stage's step reads a baseline's simulated step only to rank it, and only where it fits
    (`step.step_read`): on 7 MiB devices the stage's data-parallel baseline does not fit, so it is left
    unsimulated, and the plan is field for field (but its timings) the one simulating every baseline gives."""
    import parsat.search.step as step_module
    from parsat.search.mesh import CandidateSteps

    small = replace(Machine.resolve("cpu"), memory_capacity=7 * 2 ** 20)
    left: list = []

    def plan(found) -> str:
        assert found.pipeline is not None
        return json.dumps(without_timing(json.loads(found.to_json())))

    found, left_by_the_search = small_pipelined   # the search, counted as below
    cut = plan(found)
    assert "data_parallel" in left_by_the_search
    monkeypatch.setattr(CandidateSteps, "where", _counting_where(left))
    monkeypatch.setattr(step_module, "step_read", lambda step: None)
    assert plan(optimize("gpt", small, devices=4, sizes=SMALL_SIZES, degrees={"pp": 2}, microbatches=4)) == cut
    assert not left
