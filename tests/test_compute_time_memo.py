"""`cost.model.compute_time`'s memo: spread inference kept for operators that read their inputs plainly (by a key
without sizes), and `op_time`'s per-instance facts kept by the instance's identity; the same times and problems."""

from __future__ import annotations

import itertools

import pytest

import parsat.cost.model as model
import parsat.cost.op_time as op_time_module
from parsat.cost.model import compute_time
from parsat.dsl.library import load_library, shipped_rules_dir
from parsat.dsl.spread import reads_plainly
from parsat.ir.graph import instance_for
from parsat.ir.machine import Machine
from parsat.ir.pcg import Degrees

OPS = load_library([shipped_rules_dir() / "ops.rule"])[0].ops
MACHINE = Machine.preset("h100x8")


def _instance(op, shapes, **attrs):
    return instance_for(OPS[op], shapes, attrs)


def _spreads(rank: int) -> list[Degrees]:
    """Whole, each dim sharded by 2 or 4, copied, partial: legal and illegal spreads alike."""
    out = [Degrees.whole(rank), Degrees((1,) * rank, 2, 1), Degrees((1,) * rank, 1, 2)]
    for dim, degree in itertools.product(range(rank), (2, 4)):
        out.append(Degrees(tuple(degree if d == dim else 1 for d in range(rank))))
    return out


# (op, its shapes at two sizes, attrs): the instances a search meets at other micro-batch sizes
CASES = [
    ("linear_nobias", [((8, 16, 32), (32, 64)), ((4, 16, 32), (32, 64))], {}),
    ("matmul", [((8, 32), (32, 16)), ((16, 32), (32, 16))], {}),
    ("add", [((8, 16), (8, 16)), ((24, 16), (24, 16))], {}),
    ("softmax", [((8, 16),), ((32, 16),)], {"dim": 1}),
    ("unflatten", [((8, 16),), ((4, 16),)], {"dim": 1, "k": 4}),
    ("flatten", [((8, 4, 16),), ((2, 4, 16),)], {"dim": 1}),
]


def test_plain_reads_are_told_apart():
    assert reads_plainly(_instance("linear_nobias", ((8, 16, 32), (32, 64))))
    assert reads_plainly(_instance("add", ((8, 16), (8, 16))))
    assert not reads_plainly(_instance("unflatten", ((8, 16),), dim=1, k=4))   # `j * k + r`: a block read
    assert not reads_plainly(_instance("flatten", ((8, 4, 16),), dim=1))       # `j / n`, `j % n`


def _outputs(instance, inputs):
    """Every output spread worth asking for: the one inference gives, and a wrong one (a problem appended)."""
    got = model._infer(instance, inputs)[0]
    return [got, Degrees.whole(len(got.shard))]


@pytest.mark.parametrize("op, shapes, attrs", CASES)
def test_the_memo_gives_what_computing_afresh_gives(op, shapes, attrs):
    memo: dict = {}
    for shape in shapes:
        instance = _instance(op, shape, **attrs)
        for inputs in itertools.product(*(_spreads(len(s)) for s in shape)):
            for output in _outputs(instance, inputs):
                fresh = compute_time(instance, inputs, output, MACHINE)
                assert compute_time(instance, inputs, output, MACHINE, memo) == fresh
                assert compute_time(instance, inputs, output, MACHINE, memo) == fresh   # and from the memo


def test_a_plain_operator_at_other_sizes_is_not_inferred_again(monkeypatch):
    calls = []
    real = model._infer
    monkeypatch.setattr(model, "_infer", lambda *a: calls.append(a) or real(*a))
    memo: dict = {}
    inputs = (Degrees((1, 2, 1)), Degrees((1, 1)))
    small = _instance("linear_nobias", ((8, 16, 32), (32, 64)))
    large = _instance("linear_nobias", ((4, 2048, 32), (32, 64)))
    first = compute_time(small, inputs, Degrees((1, 2, 1)), MACHINE, memo)
    second = compute_time(large, inputs, Degrees((1, 2, 1)), MACHINE, memo)
    assert len(calls) == 1
    assert second == compute_time(large, inputs, Degrees((1, 2, 1)), MACHINE)
    assert first != second                                  # the sizes still change the time


def test_a_block_read_is_inferred_afresh(monkeypatch):
    calls = []
    real = model._infer
    monkeypatch.setattr(model, "_infer", lambda *a: calls.append(a) or real(*a))
    memo: dict = {}
    inputs = (Degrees((2, 1)),)
    for rows in (8, 4):
        instance = _instance("unflatten", ((rows, 16),), dim=1, k=4)
        assert compute_time(instance, inputs, Degrees((2, 1, 1)), MACHINE, memo) == \
            compute_time(instance, inputs, Degrees((2, 1, 1)), MACHINE)
    assert len(calls) == 4                                  # twice per size: with the memo and without
    assert not any(key[0] == model._INFERRED for key in memo)


def test_op_time_works_out_an_instances_flops_once(monkeypatch):
    calls = []
    real = op_time_module.work
    monkeypatch.setattr(op_time_module, "work", lambda instance: calls.append(instance) or real(instance))
    memo: dict = {}
    instance = _instance("linear_nobias", ((8, 16, 32), (32, 64)))
    for shard in ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)):
        inputs = (Degrees(shard), Degrees((shard[2], 1)))
        output = model._infer(instance, inputs)[0]
        assert compute_time(instance, inputs, output, MACHINE, memo) == compute_time(instance, inputs, output, MACHINE)
    assert sum(1 for i in calls if i is instance) == 5     # once kept, four times afresh
