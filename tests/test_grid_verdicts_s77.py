"""A grid's excluded e-nodes decided once per group of points (`strategies.grid_excluded`, session 77 helper B).

`config_excluded` asked every e-node of an e-graph once per grid point; the points of one mesh differ in sequence
parallelism and ZeRO-3 alone, which an e-node's verdict reads at two places each. `grid_excluded` works the
verdicts out once per group and makes each point's set from the always-excluded e-nodes and the two conditional
groups. These tests hold each point's set to the set decided node by node as `config_excluded` did before (the
reference below is that function as written at 3308009, reading `sequence` and `zero3` itself), on a GPT and a
LLaMA saturated on two-axis and one-axis meshes, with and without the batch, split weights and shared weights.
"""

from __future__ import annotations

import pytest

from parsat.dsl.library import load_library
from parsat.dsl.parallel_ops import ALL_GATHER, ALL_TO_ALL, PARALLEL_OPS, PARTITION, REDUCE_SCATTER, REPLICATE
from parsat.egraph.runner import Limits
from parsat.egraph.saturate import saturate
from parsat.ir.megatron import contraction_weights
from parsat.ir.mesh import Mesh
from parsat.ir.microbatch import batch_dims
from parsat.ir.models import build_example
from parsat.ir.parallelism import along_sequence
from parsat.ir.pcg import STORED_ROLES, WEIGHT_ROLES
from parsat.ir.placement import FREE, shard_dim
from parsat.search import strategies
from parsat.search.extract import leaf_roles
from parsat.search.strategies import Config, config_excluded, grid, grid_excluded, shared_weights

SIZES = {"blocks": 2, "hidden": 64, "heads": 4, "batch": 8, "seq": 16, "vocab": 128}


def _as_before(snapshot, roles, config, batch=None, split=frozenset(), shared=None) -> frozenset:
    """`config_excluded`'s set as decided at 3308009: every e-node asked, the configuration read whole."""
    s = strategies
    samples = s._derived(snapshot, batch or {})
    stored_split = frozenset(s._derived(snapshot, dict.fromkeys(split, 0)))
    from_weights = s._weight_values(snapshot, roles, samples if batch else None) if config.data_axis is not None \
        else frozenset()
    constants = config.tensor_axis is not None and bool(batch)
    looked_up = s._constant_lookups(snapshot, roles, samples) if constants else frozenset()
    masks = s._constant_masks(snapshot, roles, samples) if constants else frozenset()
    one_dim = s._derived(snapshot, s._one_storage_dims(snapshot, shared, config.tensor_axis)) \
        if shared and config.tensor_axis is not None else {}

    def tensor_axis(node, dim, source) -> bool:
        child = node.children[0]
        if source == "input" and child in samples:
            return node.op != REPLICATE and not (node.op == PARTITION and dim != samples[child])
        if source == "input" and child in looked_up:
            return node.op != REPLICATE and not (node.op == PARTITION and dim == len(snapshot.shape[child]) - 1)
        if source == "input" and child in masks:
            return node.op not in (PARTITION, REPLICATE)
        if source == "input":
            return node.op != REPLICATE
        if source in WEIGHT_ROLES:
            if node.op == PARTITION and one_dim.get(child, dim) != dim:
                return True
            return node.op not in (PARTITION, REPLICATE) or (node.op == REPLICATE and child in stored_split)
        if node.op in (REDUCE_SCATTER, ALL_GATHER):
            return not config.sequence
        if node.op == PARTITION and along_sequence(snapshot.shape[child], dim):
            return not config.sequence
        return False

    def excluded(node) -> bool:
        if node.op == "leaf":
            return False
        if s._query_blocks_on_tensor_axis(node, snapshot, config):
            return True
        if samples and config.data_axis is not None and any(ch in samples for ch in node.children) and \
                s._reads_samples_whole(node, samples, snapshot, config.data_axis):
            return True
        if node.op not in PARALLEL_OPS and config.tensor_axis is not None and any(
                ch in stored_split and snapshot.placement[ch].codes[config.tensor_axis] == FREE
                for ch in node.children):
            return True
        if node.op not in PARALLEL_OPS:
            return config.data_axis is not None and any(
                roles.get(ch) in WEIGHT_ROLES and shard_dim(snapshot.placement[ch].codes[config.data_axis])
                is not None for ch in node.children)
        if node.op == ALL_TO_ALL:
            return True
        axis = node.attrs[-1]
        dim = node.attrs[0] if PARALLEL_OPS[node.op].has_dim else None
        source = roles.get(node.children[0], "")
        weight = source in WEIGHT_ROLES
        if axis == config.data_axis:
            if node.op == PARTITION:
                return not ((source == "input" and dim == 0) or (weight and config.zero3))
            if node.op == REPLICATE:
                if config.zero3_only and source in STORED_ROLES:
                    return True
                return not (weight or source == "input" or node.children[0] in from_weights)
            if node.op == ALL_GATHER:
                return not (weight and config.zero3)
            return node.op == REDUCE_SCATTER
        if axis == config.tensor_axis:
            return tensor_axis(node, dim, source)
        return not config.others_free

    return frozenset((cid, index) for cid, nodes in snapshot.classes.items()
                     for index, node in enumerate(nodes) if excluded(node))


def _configs(mesh: Mesh) -> list[Config]:
    """The mesh's grid, and its points pinned (`others_free`, `zero3_only`) or letting attention cut its queries."""
    points = grid(mesh)
    return points + [Config(c.data_axis, c.tensor_axis, c.sequence, c.zero3, others_free=True,
                            zero3_only=c.zero3) for c in points] + \
        [Config(c.data_axis, c.tensor_axis, c.sequence, c.zero3) for c in points]


@pytest.fixture(scope="module", params=[("gpt", (2, 2)), ("llama", (2, 2)), ("gpt", (4,))],
                ids=["gpt-2x2", "llama-2x2", "gpt-4"])
def saturated(request):
    library = load_library()[0]
    name, sizes = request.param
    graph = build_example(name, SIZES, library)
    mesh = Mesh.of(sizes, 2)
    result = saturate(graph, library, library.rules, mesh, Limits(iterations=4))
    return graph, library, mesh, result


def test_each_grid_point_excludes_what_it_excluded_node_by_node(saturated):
    """Each point's set, with nothing else given (`baselines.best_grid`'s ask) and with the batch, the split
    weights and the shared weights (a pinned configuration's, `mesh._pinned_out`), is the set decided node by
    node; through `config_excluded` and `grid_excluded` alike. The e-graph holds e-nodes of each verdict."""
    graph, library, mesh, result = saturated
    snap = result.snapshot
    roles = leaf_roles(snap, graph)
    batch = {result.classes[n]: d for n, d in batch_dims(graph, library).items() if n in result.classes}
    split = frozenset(result.classes[n] for n in contraction_weights(graph) if n in result.classes)
    shared = shared_weights(graph, result.classes)
    configs = _configs(mesh)
    sizes = set()
    for given in ((None, frozenset(), None), (batch, split, shared)):
        predicates = grid_excluded(snap, roles, configs, *given)
        assert len(predicates) == len(configs)
        for config, predicate in zip(configs, predicates):
            expected = _as_before(snap, roles, config, *given)
            assert predicate.__self__ == expected, config
            assert config_excluded(snap, roles, config, *given).__self__ == expected, config
            sizes.add(len(expected))
    assert len(sizes) > 3   # the points differ


def test_the_conditional_verdicts_are_met(saturated):
    """Some e-nodes are excluded unless ZeRO-3 (the data axis's weight partitions and gathers), and on a tensor
    axis some unless sequence parallelism, so the points' sets are made from the conditional groups."""
    graph, _, mesh, result = saturated
    snap = result.snapshot
    roles = leaf_roles(snap, graph)
    points = grid(mesh)
    common = {Config(c.data_axis, c.tensor_axis, query_blocks=False) for c in points}
    for config in common:
        always, unless_zero3, unless_sequence = strategies._verdicts(snap, roles, config, None, frozenset(), None)
        assert not (always & unless_zero3) and not (always & unless_sequence) and not (unless_zero3 & unless_sequence)
        assert bool(unless_zero3) == (config.data_axis is not None)
        assert bool(unless_sequence) == (config.tensor_axis is not None)
