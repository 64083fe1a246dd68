"""The checker: one test per kind of error, each with message and line:col.

Snippets are checked with the shipped operators imported (line 1 is the
import, so a snippet's first line is line 2 of the file).
"""

from __future__ import annotations

import pytest

from parsat.dsl.checker import check_paths


def only(diagnostics):
    assert len(diagnostics) == 1, [d.render() for d in diagnostics]
    return diagnostics[0]


def at(diagnostic) -> tuple[int, int]:
    return diagnostic.span.line, diagnostic.span.column


def test_correct_rules_have_no_diagnostics(diagnostics):
    assert diagnostics("""
        rule matmul_row_parallel:
          forall x: [m, k], w: [k, n], p: degree
          where m % p == 0
          matmul(partition(x, 0, p), replicate(w, p)) => partition(matmul(x, w), 0, p)

        rule relu_partition_any_dim:
          forall x: [*a, n, *b], p: degree
          where n % p == 0
          relu(partition(x, len(a), p)) => partition(relu(x), len(a), p)

        rule matmul_introduce_row_parallel:
          forall x: [m, k], w: [k, n], p: degree
          where m % p == 0
          matmul(x, w) => combine(matmul(partition(x, 0, p), replicate(w, p)), 0, p)
    """) == []


def test_unknown_operator_suggests_a_name(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, n]
          rellu(x) => relu(x)
    """))
    assert d.kind == "unknown-op"
    assert "unknown operator 'rellu'; did you mean 'relu'?" in d.message
    assert at(d) == (4, 3)


def test_unknown_attribute_type(write_rules):
    path = write_rules("op f(x: [n], k: integer) -> [n]\n  out[i] = x[i]\n")
    d = check_paths([path]).diagnostics[0]
    assert d.kind == "syntax" and at(d) == (1, 17)
    assert "unexpected 'integer'" in d.message


def test_unknown_name_in_semantics(write_rules):
    path = write_rules("op f(x: [n]) -> [n]\n  out[i] = x[i] * scale\n")
    d = only(check_paths([path]).diagnostics)
    assert d.kind == "name" and "unknown name 'scale'" in d.message
    assert at(d) == (2, 19)


def test_wrong_arity(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, n]
          relu(x, x) => relu(x)
    """))
    assert d.kind == "arity"
    assert "relu takes 1 argument(s) (x), got 2" in d.message
    assert at(d) == (4, 3)


def test_wrong_arity_of_parallel_operator(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, n], p: degree
          relu(partition(x, p)) => relu(x)
    """))
    assert d.kind == "arity" and "partition takes 3 arguments (x, dim, n), got 2" in d.message
    assert at(d) == (4, 8)


def test_tensor_indexed_with_wrong_rank(write_rules):
    path = write_rules("op f(x: [m, n]) -> [m]\n  out[i] = x[i]\n")
    d = only(check_paths([path]).diagnostics)
    assert d.kind == "arity" and "'x' has 2 dims here but is read with 1 indices" in d.message
    assert at(d) == (2, 12)


def test_argument_shape_mismatch(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, k], w: [k, n]
          matmul(x, w) => matmul(w, x)
    """))
    assert d.kind == "shape"
    assert "argument 'b' of matmul has shape [m, k]: dim 0 is m, expected n" in d.message
    assert at(d) == (4, 19)


def test_sides_with_different_shapes(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, n]
          relu(x) => transpose(x, 0, 1)
    """))
    assert d.kind == "shape-mismatch"
    assert "left [m, n], right [n, m]" in d.message
    assert at(d) == (4, 14)


def test_relu_of_a_partial_sum_is_refused(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, k], w: [k, n], p: degree
          where k % p == 0
          relu(reduce(matmul(partition(x, 1, p), partition(w, 0, p)), p)) => reduce(relu(matmul(partition(x, 1, p), partition(w, 0, p))), p)
    """))
    assert d.kind == "illegal-spread"
    assert "relu: applies max to a partial sum" in d.message
    assert at(d) == (5, 77)


def test_softmax_sharded_along_its_own_dim_is_refused(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, n], p: degree
          where n % p == 0
          softmax(partition(x, 1, p), 1) => partition(softmax(x, 1), 1, p)
    """))
    assert d.kind == "illegal-spread" and "softmax: divides by a partial sum" in d.message


def test_mean_sharded_along_the_reduced_dim_is_refused(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, n], p: degree
          where n % p == 0
          reduce(mean(partition(x, 1, p), 1), p) => mean(x, 1)
    """))
    assert d.kind == "illegal-spread" and "size 'n' belongs to a sharded dim" in d.message


def test_sides_spread_differently(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, n], p: degree, q: degree
          where m % p == 0
          combine(partition(x, 0, p), 0, q) => x
    """))
    assert d.kind == "spread-mismatch"
    assert "left shard [(p)/(q), 1], right shard [1, 1]" in d.message


def test_right_hand_tensor_not_bound_on_the_left(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, n], y: [m, n]
          relu(x) => relu(y)
    """))
    assert d.kind == "unbound-rhs"
    assert "the right-hand side uses 'y', which the left-hand side does not bind" in d.message
    assert at(d) == (4, 19)


def test_right_hand_size_not_bound_on_the_left(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, n], y: [k, n], s: int
          split(x, 0, 0, m) => split(x, 0, 0, k)
    """))
    assert d.kind == "unbound-rhs" and "uses 'k'" in d.message


def test_duplicate_rule_names(diagnostics):
    d = only(diagnostics("""
        rule twice:
          forall x: [m, n]
          relu(relu(x)) => relu(x)

        rule twice:
          forall x: [m, n]
          relu(relu(x)) => relu(x)
    """))
    assert d.kind == "duplicate"
    assert "rule 'twice' is already declared at" in d.message and ":2:6" in d.message
    assert at(d) == (6, 6)


def test_duplicate_operator_names(write_rules):
    path = write_rules('import "ops.rule"\nop relu(x: [n]) -> [n]\n  out[i] = x[i]\n')
    d = only(check_paths([path]).diagnostics)
    assert d.kind == "duplicate" and "operator 'relu' is already declared at" in d.message
    assert at(d) == (2, 4)


def test_where_that_can_never_hold(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, k], p: degree
          where p > m, m > p
          relu(x) => relu(x)
    """))
    assert d.kind == "never" and "can never hold" in d.message
    assert at(d) == (4, 9)


def test_rule_whose_left_side_can_never_be_defined(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, 3], p: degree
          where p == 2
          relu(partition(x, 1, p)) => partition(relu(x), 1, p)
    """))
    assert d.kind == "never" and "can never apply" in d.message


def test_dim_out_of_range(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, n], p: degree
          relu(partition(x, 2, p)) => relu(x)
    """))
    assert d.kind == "attribute" and "dim 2 is out of range for a tensor of rank 2" in d.message


def test_attribute_dim_must_fit_the_rank(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, n]
          softmax(x, 5) => softmax(x, 5)
    """))
    assert d.kind == "rank" and "softmax cannot take arguments of rank 2" in d.message


def test_scalar_metavariable_used_as_tensor(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, n], p: degree
          relu(p) => relu(p)
    """))
    assert d.kind == "sort" and "'p' is a degree, not a tensor" in d.message


def test_left_side_must_be_an_application(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, n]
          x => relu(x)
    """))
    assert d.kind == "lhs"


def test_rank_polymorphic_rule_errors_name_the_group_lengths(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [*a, n], p: degree
          where n % p == 0
          softmax(partition(x, len(a), p), len(a)) => partition(softmax(x, len(a)), len(a), p)
    """))
    assert d.kind == "illegal-spread" and "(when len(a) = 0)" in d.message


def test_import_cycle_is_reported(write_rules):
    write_rules('import "b.rule"\n', "a.rule")
    path_b = write_rules('import "a.rule"\n', "b.rule")
    d = only(check_paths([path_b]).diagnostics)
    assert d.kind == "import" and "import cycle: b.rule -> a.rule -> b.rule" in d.message


def test_self_import_is_a_cycle(write_rules):
    path = write_rules('import "self.rule"\n', "self.rule")
    d = only(check_paths([path]).diagnostics)
    assert "import cycle: self.rule -> self.rule" in d.message
    assert at(d) == (1, 1)


def test_missing_import_is_named(write_rules):
    path = write_rules('import "nowhere.rule"\n')
    d = only(check_paths([path]).diagnostics)
    assert "cannot find 'nowhere.rule'" in d.message and at(d) == (1, 1)


def test_op_result_group_must_come_from_a_parameter(write_rules):
    path = write_rules("op f(x: [n]) -> [*s]\n  out[*i] = x[0]\n")
    d = only(check_paths([path]).diagnostics)
    assert "the result uses *s, which no parameter has" in d.message and at(d) == (1, 18)


def test_condition_outside_if_is_refused(write_rules):
    path = write_rules("op f(x: [n]) -> [n]\n  out[i] = x[i] < 0\n")
    d = only(check_paths([path]).diagnostics)
    assert d.kind == "sort" and "a condition is only allowed after 'if'" in d.message


def test_unknown_scalar_function(write_rules):
    path = write_rules("op f(x: [n]) -> [n]\n  out[i] = cosh(x[i])\n")
    d = only(check_paths([path]).diagnostics)
    assert d.kind == "unknown-function" and "unknown function 'cosh'" in d.message and at(d) == (2, 12)


def test_rule_that_only_applies_at_degree_one_is_refused(diagnostics):
    d = only(diagnostics("""
        rule r:
          forall x: [m, n], p: degree
          where m % p == 0
          relu(combine(x, 0, p)) => combine(relu(x), 0, p)
    """))
    assert d.kind == "degenerate" and "only applies when p = 1" in d.message
    assert at(d) == (2, 6)
