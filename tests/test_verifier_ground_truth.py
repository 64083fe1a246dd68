"""The ground truth (verifier.devices): every device computes on what it holds, with local indices.

And the spread analysis and the z3 lowering checked against it over the
whole shipped library: a disagreement is a bug report.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from parsat.dsl.library import load_library
from parsat.verifier import concrete, devices, ranks
from parsat.verifier.crosscheck import lowering_disagrees
from parsat.verifier.devices import Mesh, MeshPlacement, distribute, gather


@pytest.fixture(scope="module")
def shipped():
    library, errors = load_library(None)
    assert not errors
    return library


def _small_instances(library, rules=None):
    """(rule, instance, smallest applicable sizes) for every proof instance of every rule."""
    for rule in rules or library.rules:
        for instance in ranks.plan(rule, library.ops).proof:
            for sizes in concrete.candidate_sizes(instance, random.Random(0), 10):
                if concrete.applies(instance, sizes):
                    yield rule, instance, sizes
                    break


@pytest.fixture(scope="module")
def small_instances(shipped):
    """`_small_instances` of the whole shipped library, built once for the two checks against the devices: typing
    every rank of every rule (`ranks.plan`) is more than half of their CPU, and the same list is checked by both.
    The instances are frozen dataclasses that neither check mutates, and the sizes are drawn from a seeded
    generator per instance, so each test sees exactly the list it built for itself before."""
    return list(_small_instances(shipped))


# ------------------------------------------------------------------ the mesh itself


def test_nested_sharding_earlier_axis_is_major():
    mesh = Mesh((("a", 2), ("b", 3)))
    x = np.arange(12.0).reshape(12, 1)
    placed = distribute(x, MeshPlacement(((("a", "b")), ())), mesh)
    # device (a=1, b=2) holds block 1 * 3 + 2 = 5 of 6
    assert placed.pieces[(1, 2)].ravel().tolist() == [10.0, 11.0]
    assert MeshPlacement((("a", "b"), ()), ).per_axis(mesh) == {"a": "Shard(0)", "b": "Shard(0)"}
    assert MeshPlacement(((), ()), ("a",), ("b",)).per_axis(mesh) == {"a": "Replicate", "b": "Partial"}
    assert np.array_equal(gather(placed, mesh)[0], x)


def test_collectives_round_trip_and_all_reduce():
    mesh = Mesh((("a", 2), ("b", 2)))
    x = np.arange(8.0).reshape(4, 2)
    whole = distribute(x, MeshPlacement.whole(2), mesh)
    split = devices.partition(whole, mesh, 0, ("a",))
    assert split.pieces[(1, 0)].tolist() == x[2:].tolist()
    back = devices.combine(split, mesh, 0, ("a",))
    assert all(np.array_equal(p, x) for p in back.pieces.values())
    partial = distribute(x, MeshPlacement(((), ()), (), ("b",)), mesh, np.random.default_rng(1))
    assert not np.array_equal(partial.pieces[(0, 0)], x)  # each device holds a summand
    reduced = devices.reduce(partial, mesh, ("b",))
    assert all(np.array_equal(p, x) for p in reduced.pieces.values())
    with pytest.raises(devices.DeviceError):
        devices.combine(split, mesh, 0, ("b",))  # b does not split dim 0


def test_a_device_reads_only_what_it_holds(shipped):
    """3x3 windows at stride 3 over rows 0-7 split in two: device 1 pools its own rows 4-6, not rows 3-5."""
    library = shipped
    from parsat.dsl import parser
    from parsat.dsl.typecheck import type_rule

    module = parser.parse("rule r:\n  forall x: [n, c, h, w], p: degree\n  where h % p == 0\n"
                          "  avgpool2d(partition(x, 2, p), 3, 3) => partition(avgpool2d(x, 3, 3), 2, p)\n")
    instance = type_rule(module.rules[0], library.ops, {})
    sizes = dict(n=1, c=1, h=8, w=3, p=2)
    x = np.arange(24.0).reshape(1, 1, 8, 3)
    sides = devices.RuleSides([instance.lhs], sizes)
    run = sides.run(instance.lhs, {"x": concrete._whole(x, sides.mesh)}, {})
    device1 = run.tensor.pieces[(1,)]
    assert np.isclose(device1[0, 0, 0, 0], x[0, 0, 4:7, 0:3].mean())  # its own rows 4-6
    assert not np.isclose(device1[0, 0, 0, 0], x[0, 0, 3:6, 0:3].mean())  # the true window, rows 3-5
    failure = concrete.trial(instance, sizes)
    assert failure is not None and failure.kind == "device" and "device (p=1)" in failure.counterexample.device


def test_the_spread_analysis_refuses_windows_that_do_not_tile(diagnostics):
    found = diagnostics("""
        rule r:
          forall x: [n, c, h, w], p: degree
          where h % p == 0, h >= 3, w >= 3
          avgpool2d(partition(x, 2, p), 3, 3) => partition(avgpool2d(x, 3, 3), 2, p)
        """)
    message = found[0].message
    assert len(found) == 1 and "must tile dim 2" in message and "h = 8" in message and "p = 2" in message
    assert diagnostics("""
        rule r:
          forall x: [n, c, h, w], p: degree
          where h % 3 == 0, h % p == 0, (h / 3) % p == 0, w >= 3
          avgpool2d(partition(x, 2, p), 3, 3) => partition(avgpool2d(x, 3, 3), 2, p)
        """) == []


# ------------------------------------------------- the analysis and the lowering, against the devices


def test_spread_analysis_agrees_with_the_devices_on_the_shipped_library(small_instances):
    """Every node the analysis accepts computes its global value on the devices, where the analysis says."""
    checked = 0
    for rule, instance, sizes in small_instances:
        notes: list[str] = []
        assert concrete.trial(instance, sizes, notes=notes) is None, rule.name
        assert notes == [], (rule.name, notes)
        checked += 1
    assert checked > 700


def test_z3_lowering_agrees_with_the_devices_on_the_shipped_library(small_instances):
    checked = 0
    for rule, instance, sizes in small_instances:
        assert lowering_disagrees(instance, sizes) is None, rule.name
        checked += 1
    assert checked > 700


def test_a_broken_lowering_is_caught(shipped, monkeypatch):
    """A reduce lowered as if it kept one partial piece: the devices disagree, so no proof is trusted."""
    from parsat.verifier import prove

    original = prove._Lowering._parallel

    def broken(self, term, blocks, s, local):
        if term.name == "reduce":
            return self.piece(term.args[0], blocks, s * self.P(term.degree), local)
        return original(self, term, blocks, s, local)

    monkeypatch.setattr(prove._Lowering, "_parallel", broken)
    rule = shipped.rule("matmul_reduction_parallel")
    instance = ranks.plan(rule, shipped.ops).proof[0]
    found = lowering_disagrees(instance, dict(m=1, k=2, n=1, p=2))
    assert found is not None and "the z3 lowering of the left side gives" in found


def test_a_broken_spread_analysis_is_caught_not_trusted(monkeypatch, write_rules):
    """Without the tiling condition (the audit's bug) the analysis accepts the window rule: the devices refute it
    and name the analysis as the culprit."""
    from parsat.dsl import spread
    from parsat.verifier.api import verify_paths

    monkeypatch.setattr(spread, "block_tiling", lambda *args, **kwargs: ())
    path = write_rules('import "ops.rule"\nrule r:\n  forall x: [n, c, h, w], p: degree\n'
                       '  where h % p == 0, h >= 3, w >= 3\n'
                       '  avgpool2d(partition(x, 2, p), 3, 3) => partition(avgpool2d(x, 3, 3), 2, p)\n')
    (verdict,) = verify_paths([path]).verdicts
    assert verdict.verdict == "REFUTED", verdict.render()
    assert "the spread analysis accepts it: a bug in parsat/dsl/spread.py" in verdict.reason
    assert any("spread analysis accepts a spread the devices cannot compute" in n for n in verdict.notes)
