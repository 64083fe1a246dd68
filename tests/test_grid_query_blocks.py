"""The grid restricted to an e-graph never cuts attention's queries on its tensor axis (`strategies.grid`).

Megatron-LM's tensor axis splits attention along its heads. The e-graph also holds attention computed as blocks of
its queries on an axis (context parallelism: the ring, `attention_causal_query_parallel`), which the grid's tensor
axis admitted before: the best grid point of a LLaMA (2 blocks, 4 heads, 16,384 tokens) on 8 H100s was tp 8 with
the causal ring (7.474 ms) with that rule in the search and dp 2 x tp 4 (8.963 ms) without it, so the baseline
moved with the rules the search may use (benchmarks/search_results.md, session 65 helper D). A pin's tensor axis
(`pinned_meshes`) is unchanged: it may still take the ring.
"""

from __future__ import annotations

import pytest

from parsat.dsl.library import load_library
from parsat.egraph.runner import Limits
from parsat.egraph.saturate import saturate
from parsat.ir.graph import GraphBuilder
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example
from parsat.ir.parallelism import FUSED_ATTENTION
from parsat.ir.placement import Placement, shard, shard_dim
from parsat.search.extract import leaf_roles
from parsat.search.optimize import optimize
from parsat.search.strategies import Config, config_excluded, grid

RING = "attention_causal_query_parallel"


def test_the_grid_s_tensor_axis_excludes_query_blocks_and_keeps_heads():
    """Causal attention of q, k, v [1, 2, 8, 4] on 2 devices, its output pinned split along the sequence: the
    e-graph holds the causal ring's query block (`attention_masked` reading q cut along dim 2) and attention split
    on its heads (dim 1). Every grid configuration with a tensor axis excludes the first and not the second; a
    pinned tensor axis (`Config`'s default) excludes neither."""
    library = load_library()[0]
    g = GraphBuilder(library, name="causal")
    q, k, v = (g.input(name, [1, 2, 8, 4]) for name in "qkv")
    g.output(g.op("attention_causal", q, k, v, 0.5, name="y"))
    graph = g.build()
    result = saturate(graph, library, library.rules, 2, Limits(iterations=4), pins={"y": Placement((shard(2),))})
    snap = result.snapshot
    by_query_dim = {}
    for cid, nodes in snap.classes.items():
        for index, node in enumerate(nodes):
            if node.op in FUSED_ATTENTION:
                by_query_dim.setdefault(shard_dim(snap.placement[node.children[0]].codes[0]), []).append((cid, index))
    assert {1, 2} <= set(by_query_dim), by_query_dim   # heads-split and query blocks are both in the e-graph
    roles = leaf_roles(snap, graph)
    configs = [c for c in grid(Mesh.of((2,), 8)) if c.tensor_axis is not None]
    assert configs
    for config in configs:
        excluded = config_excluded(snap, roles, config)
        assert all(excluded(e) for e in by_query_dim[2]), config
        assert not any(excluded(e) for e in by_query_dim[1]), config
    pinned = config_excluded(snap, roles, Config(None, 0, True))
    assert not any(pinned(e) for e in by_query_dim[1] + by_query_dim[2])


@pytest.mark.slow
def test_the_best_grid_point_does_not_move_with_the_causal_ring_s_rule():
    """The LLaMA above, searched with and without the causal ring's rule: the plans differ (the ring, Ulysses),
    the best grid point is the same layout (dp 2 x tp 4, sequence parallelism) with the same nodes and
    placements; its step is compared to 1e-6 (the simulator's list schedule follows the PCG's node order,
    which the e-graph's class ids set: 7e-8 apart here). Predictions: no GPU."""
    library = load_library()[0]
    sizes = {"blocks": 2, "batch": 1, "seq": 16384, "hidden": 1024, "heads": 4, "vocab": 8192}
    graph = build_example("llama", sizes, library)
    plans = [optimize(graph, machine="h100x8", devices=8, rules=library, without_rules=without)
             for without in ([], [RING])]
    assert RING in plans[0].rules_used and RING not in plans[1].rules_used   # the plans differ: the ring, Ulysses
    grids = [plan.baseline_plans["best_grid"] for plan in plans]
    assert dict(grids[0].config) == dict(grids[1].config), [g.config for g in grids]
    assert sorted(map(_node_key, grids[0].pcg.nodes)) == sorted(map(_node_key, grids[1].pcg.nodes))
    assert plans[0].baselines["best_grid"].time_s == pytest.approx(plans[1].baselines["best_grid"].time_s, rel=1e-6)


def _node_key(node) -> tuple:
    return node.op, tuple(node.shape), node.placement.codes, tuple(sorted(map(str, node.attrs)))
