"""`max(l < n) body`, the max over a range, through every stage that reads semantics.

Parser and printer, the numpy evaluator, the spread analysis (a max over a
sharded range is refused: a block's max is no partial sum), the work count,
the normal form and its lemmas, and the verifier's honesty: a lowering of
max that disagrees with the devices is caught, never PROVED.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from parsat.dsl import ast
from parsat.dsl.evaluate import evaluate
from parsat.dsl.library import load_library
from parsat.dsl.parser import parse
from parsat.dsl.printer import format_module
from parsat.dsl.spread import SymbolicDegrees, infer_compute
from parsat.dsl.symbolic import ONE, Poly
from parsat.dsl.work import work
from parsat.ir.graph import instance_for
from parsat.verifier import normal as nf
from parsat.verifier.api import verify_library

OPS = textwrap.dedent("""
    op amax_test(x: [*a, n]) -> [*a]
      out[*i] = max(l < n) x[*i, l]

    op relu_test(x: [*s]) -> [*s]
      out[*i] = max(x[*i], 0)

    op pool_test(x: [n, c, h, w], size: int, stride: int) -> [n, c, (h - size) / stride + 1, (w - size) / stride + 1]
      where size >= 1, stride >= 1, h >= size, w >= size
      out[b, f, y, z] = max(dy < size) max(dx < size) x[b, f, y * stride + dy, z * stride + dx] * 2 + 1
""")


def _ops():
    module = parse(OPS)
    return {op.name: op for op in module.ops}


def test_max_over_a_range_parses_prints_and_leaves_binary_max_alone():
    module = parse(OPS)
    ops = {op.name: op for op in module.ops}
    assert isinstance(ops["amax_test"].body, ast.Max)
    assert isinstance(ops["relu_test"].body, ast.Call) and ops["relu_test"].body.func == "max"
    body = ops["pool_test"].body  # the max's body extends over `*` and stops at `+`
    assert isinstance(body, ast.BinOp) and body.op == "+" and isinstance(body.left, ast.Max)
    assert parse(format_module(module)) == module


def test_a_max_in_an_index_position_is_an_error():
    bad = "op f(x: [n]) -> [n]\n  out[i] = x[max(l < n) l]\n"
    from parsat.dsl.checker import check_op
    with pytest.raises(Exception) as err:
        check_op(parse(bad).ops[0])
    assert "a reduction is a value, not an index" in str(err.value)


def test_evaluator_takes_the_max_and_an_empty_range_gives_zero():
    ops = _ops()
    x = np.array([[1.0, -3.0, 2.5], [-1.0, -2.0, -0.5]])
    inst = instance_for(ops["amax_test"], [(2, 3)], {})
    assert np.array_equal(evaluate(inst, {}, {"x": x}), [2.5, -0.5])
    empty = instance_for(ops["amax_test"], [(2, 0)], {})
    assert np.array_equal(evaluate(empty, {}, {"x": np.zeros((2, 0))}), [0.0, 0.0])
    pool = instance_for(ops["pool_test"], [(1, 1, 4, 4)], {"size": 2, "stride": 2})
    image = np.arange(16.0).reshape(1, 1, 4, 4)
    assert np.array_equal(evaluate(pool, {}, {"x": image}), 2 * np.array([[[[5.0, 7.0], [13.0, 15.0]]]]) + 1)


def test_a_max_over_a_sharded_range_is_refused_and_leading_dims_are_not():
    inst = instance_for(_ops()["amax_test"], [(4, 6)], {})
    two = Poly.const(2)
    over_range = infer_compute(inst, [SymbolicDegrees((ONE, two))])
    assert not over_range.legal and "sharded range" in over_range.problems[0]
    rows = infer_compute(inst, [SymbolicDegrees((two, ONE))])
    assert rows.legal and rows.spread.shard == (two,) and rows.spread.sum == ONE


def test_work_counts_a_comparison_per_element_of_the_range():
    inst = instance_for(_ops()["amax_test"], [(4, 6)], {})
    flops, elements = work(inst)
    assert flops == 4 * 6 and elements == 4 * 6 + 4


def test_normal_form_joins_nested_maxima_and_merges_blocks():
    q, r, p, k = "q", "r", Poly.sym("p"), Poly.sym("k")
    read = nf.factor(("in", "x", (Poly.sym(q) * k + Poly.sym(r),)))
    nested = nf.max_over(q, p, nf.max_over(r, k, read))
    (_c, _b, (factor,)), = nested
    assert factor[0] == "max" and [v for v, _ in factor[1]] == [q, r]  # one rectangle
    merged = nf.canonical(nf.merge_blocks(nested))
    whole = nf.canonical(nf.max_over("l", p * k, nf.factor(("in", "x", (Poly.sym("l"),)))))
    assert merged == whole
    assert nf.max_over("l", ONE, read) == nf.subst(read, {"l": Poly.const(0)})


def _write(tmp_path, text: str):
    path = tmp_path / "max.rule"
    path.write_text('import "ops.rule"\n\n' + textwrap.dedent(text), encoding="utf-8")
    library, errors = load_library([str(path)])
    assert not errors
    return library, {str(path)}


VOCAB_MAX = """
    rule vocabulary_max:
      forall x: [*a, n], p: degree
      where n % p == 0
      amax(x) => amax(combine(amax(unflatten(partition(x, len(a), p), len(a), n / p)), len(a), p))
"""


def test_a_vocabulary_max_from_gathered_block_maxima_is_proved(tmp_path):
    library, files = _write(tmp_path, VOCAB_MAX)
    (verdict,) = verify_library(library, timeout=20, only_files=files).verdicts
    assert verdict.verdict == "PROVED", verdict


def test_a_wrong_lowering_of_max_is_caught_by_the_devices_not_proved(tmp_path, monkeypatch):
    """The z3 lowering is evaluated against the devices at sizes where a max has several terms: a lowering
    that took the min instead would agree at size 1 only."""
    from parsat.verifier import crosscheck

    original = crosscheck._factor

    def wrong(f, env, inputs, reals):
        if f[0] == "max":
            return -original(("max", f[1], nf.neg(f[2])), env, inputs, reals)  # the min
        return original(f, env, inputs, reals)

    monkeypatch.setattr(crosscheck, "_factor", wrong)
    library, files = _write(tmp_path, VOCAB_MAX)
    (verdict,) = verify_library(library, timeout=20, only_files=files).verdicts
    assert verdict.verdict == "UNKNOWN" and "cannot be trusted" in verdict.reason, verdict


def test_shards_maxima_added_as_partial_sums_is_illegal_not_proved(tmp_path):
    """Each device's max of its own block is no partial sum: the spread analysis refuses the left side at
    every rank, so the verdict is ILLEGAL, naming the read it refuses (issue 29: distinct from REFUTED with
    values), never PROVED."""
    library, files = _write(tmp_path, """
        rule shards_maxima_added:
          forall x: [*a, n], p: degree
          where n % p == 0
          reduce(amax(partition(x, len(a), p)), p) => amax(x)
    """)
    (verdict,) = verify_library(library, timeout=20, only_files=files).verdicts
    assert verdict.verdict == "ILLEGAL" and "each device would hold the max of its own block" in verdict.reason, \
        verdict
