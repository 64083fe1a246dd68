"""Lifted instances replayed device by device on 2-D meshes (verifier.lifting, for issue 15)."""

from __future__ import annotations

import pytest

from parsat.dsl.checker import is_parallel_rule
from parsat.dsl.library import load_library
from parsat.dsl.parser import parse
from parsat.verifier.devices import Mesh
from parsat.verifier.lifting import replay_lifted

MESHES = [Mesh((("a", 2), ("b", 2))), Mesh((("a", 2), ("b", 3)))]


@pytest.fixture(scope="module")
def shipped():
    library, _ = load_library(None)
    return library


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("name", ["matmul_data_parallel", "matmul_reduction_parallel", "mlp_megatron_parallel",
                                  "softmax_partition_earlier_dim", "conv2d_input_channel_parallel",
                                  "matmul_chain_defers_reduce", "partition_features_of_linear"])
def test_shipped_rules_lift_on_2d_meshes(shipped, name, mesh):
    report = replay_lifted(shipped.rule(name), shipped.ops, mesh)
    assert report.ok, report.render()
    assert report.replayed > 0 and report.illegal > 0  # some pre-spreadings are legal, some are not


def test_every_way_of_arriving_is_tried(shipped):
    """matmul_data_parallel on 2x2: p on a or b; x and w each not spread, Replicate, Partial, Shard(0), Shard(1)."""
    report = replay_lifted(shipped.rule("matmul_data_parallel"), shipped.ops, MESHES[0])
    assert report.replayed + report.illegal == 2 * 5 * 5


def test_a_lifted_mismatch_is_reported(shipped):
    """A wrong rule mismatches in its lifted instances too, each named by its binding and pre-spreading."""
    rule = parse('rule r:\n  forall x: [m, n], p: degree\n  where m % p == 0\n'
                 '  relu(partition(x, 0, p)) => partition(exp(x), 0, p)\n').rules[0]
    report = replay_lifted(rule, shipped.ops, MESHES[1])
    assert not report.ok and "p on axis" in report.mismatches[0].case.describe()
    assert "the sides compute different values" in report.render()


def test_the_analysis_is_checked_on_lifted_spreads(shipped, monkeypatch):
    """With the window-tiling condition removed (the audit's bug), a batch-parallel pooling rule lifted onto
    rows split over the other axis is accepted by the analysis, and the devices show it wrong."""
    from parsat.dsl import spread

    rule = shipped.rule("avgpool2d_batch_parallel")
    assert replay_lifted(rule, shipped.ops, MESHES[0]).ok
    monkeypatch.setattr(spread, "block_tiling", lambda *args, **kwargs: ())
    rule = parse('rule r:\n  forall x: [n, c, h, w], p: degree\n  where n % p == 0, h >= 3, w >= 3\n'
                 '  avgpool2d(partition(x, 0, p), 3, 3) => partition(avgpool2d(x, 3, 3), 0, p)\n').rules[0]
    report = replay_lifted(rule, shipped.ops, MESHES[0], max_combinations=400)
    assert not report.ok, report.render()


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_every_shipped_parallel_rule_lifts(shipped, mesh):
    """Issue 15, item 2: every shipped parallel rule, every binding, every legal pre-spreading (both meshes about
    3 min, 230 MB on 2026-12-05; the 2x3 mesh had taken 13 GB and run out of memory on the batch-norm rules)."""
    replayed = 0
    for rule in shipped.rules:
        if not is_parallel_rule(rule):
            continue
        report = replay_lifted(rule, shipped.ops, mesh)
        assert report.ok, report.render()
        replayed += report.replayed
    assert replayed > 4000
