"""How much work one operator application does: FLOPs and elements touched, from its index semantics.

The cost model prices compute nodes with it (`parsat/cost/model.py`), and
`parsat calibrate` fits a machine's speeds against the same count
(`parsat/backend/calibrate.py`), so both read one definition of an operator's work.
"""

from __future__ import annotations

from math import prod
from typing import Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.conditions import to_poly
from parsat.dsl.instantiate import OpInstance, index_bounds


def work(instance: OpInstance) -> tuple[int, int]:
    """Global (FLOPs, elements touched) of one forward application, from the semantics.

    Every distinct subexpression of the body is evaluated once per value of
    the index variables it depends on (loop-invariant code is hoisted, as a
    compiler would): its cost is its own arithmetic times the product of the
    ranges of its free index variables. A `sum` adds `bound` values per
    evaluation, a `max` compares as many. Elements touched = all inputs + the output.
    """
    bounds = {k: int(v.evaluate({})) for k, v in index_bounds(instance).items()}
    flops = _flops(instance.body, bounds, instance.size_env(), {}, set())
    elements = sum(prod(int(d.evaluate({})) for d in s) for s in instance.input_shapes)
    elements += prod(int(d.evaluate({})) for d in instance.output_shape)
    return flops, elements


def _free(expr: ast.Expr, bounds: Mapping[str, int], seen: dict[ast.Expr, frozenset[str]]) -> frozenset[str]:
    """The index variables of `bounds` free in `expr`, kept in `seen` per subexpression. This module's walks are
    recursions at module level with their state passed in, not nested functions calling themselves: such a
    function and its closure's cell hold each other, a reference cycle that every call left to the cyclic
    collector with all the closure held (`dsl.instantiate._range_bounds`)."""
    found = seen.get(expr)
    if found is not None:
        return found
    if isinstance(expr, ast.Name):
        out = frozenset({expr.id}) & frozenset(bounds)
    elif isinstance(expr, ast.RANGE_BINDERS):
        out = _free(expr.body, bounds, seen) - {expr.var}
    else:
        out = frozenset()
        for child in ast.children(expr):
            out |= _free(child, bounds, seen)
    seen[expr] = out
    return out


def _flops(expr: ast.Expr, bounds: Mapping[str, int], env, seen: dict, counted: set[ast.Expr]) -> int:
    """`work`'s FLOPs of `expr`, each distinct subexpression not yet in `counted` counted once (and added to it):
    which subexpressions are counted does not depend on the order they are met in, so neither does the sum."""
    if expr in counted:
        return 0
    counted.add(expr)
    reps = prod(bounds[v] for v in _free(expr, bounds, seen))
    if isinstance(expr, ast.RANGE_BINDERS):  # an add (sum) or a comparison (max) per value of the range
        return reps * int(to_poly(expr.bound, env).evaluate({})) + _flops(expr.body, bounds, env, seen, counted)
    flops = reps if isinstance(expr, _ARITHMETIC) else 0
    if isinstance(expr, ast.Access):
        return flops  # index arithmetic is addressing, not FLOPs
    for child in ast.children(expr):
        flops += _flops(child, bounds, env, seen, counted)
    return flops


_ARITHMETIC = (ast.BinOp, ast.Neg, ast.Call, ast.Compare, ast.BoolOp, ast.Not, ast.IfThenElse)


Names = tuple[str, ...]


def contraction(instance: OpInstance) -> tuple[Names, Names, Names, Names] | None:
    """The index variables of the operator's matrix product, if it has one: (batch, m, n, k).

    A product is a `sum` (possibly nested) whose body multiplies an access
    of one operand by an access of another. Its summation variables are k;
    the other index variables of the first access only are m, of the second
    only n, of both the batch. A convolution is an implicit GEMM this way
    (k = channels x kernel window; m = batch x output pixels; n = output
    channels). The cost model prices such an operator at the GEMM efficiency
    of its local (m, n, k) (`cost.op_time`); None: not a product.
    """
    return _product(instance.body, (), tuple(index_bounds(instance)))


def _names(expr: ast.Expr, bounds: Sequence[str]) -> set[str]:
    """The index variables of `bounds` that `expr` reads."""
    if isinstance(expr, ast.Name):
        return {expr.id} & set(bounds)
    found: set[str] = set()
    for child in ast.children(expr):
        found |= _names(child, bounds)
    return found


def _operand(expr: ast.Expr) -> ast.Access | None:
    """An operand access, seen through a padding guard (`if inside then x[...] else 0`)."""
    if isinstance(expr, ast.IfThenElse):
        expr = expr.then
    return expr if isinstance(expr, ast.Access) else None


def _product(expr: ast.Expr, summed: tuple[str, ...], order: tuple[str, ...]
             ) -> tuple[Names, Names, Names, Names] | None:
    """`contraction`'s (batch, m, n, k) of the first product under `expr` summed over `summed` (and its own sums);
    `order`: the semantics' index variables in their order."""
    if isinstance(expr, ast.Sum):
        return _product(expr.body, summed + (expr.var,), order)
    if summed and isinstance(expr, ast.BinOp) and expr.op == "*":
        left, right = _operand(expr.left), _operand(expr.right)
        if left is not None and right is not None and left.tensor != right.tensor:
            a = set().union(*(_names(i, order) for i in left.indices)) - set(summed)
            b = set().union(*(_names(i, order) for i in right.indices)) - set(summed)
            pick = lambda s: tuple(v for v in order if v in s)  # noqa: E731 - the index order of the semantics
            return pick(a & b), pick(a - b), pick(b - a), summed
    for child in ast.children(expr):
        found = _product(child, summed, order)
        if found is not None:
            return found
    return None
