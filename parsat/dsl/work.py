"""How much work one operator application does: FLOPs and elements touched, from its index semantics.

The cost model prices compute nodes with it (`parsat/cost/model.py`), and
`parsat calibrate` fits a machine's speeds against the same count
(`parsat/backend/calibrate.py`), so both read one definition of an operator's work.
"""

from __future__ import annotations

from math import prod

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
    env = instance.size_env()
    seen: dict[ast.Expr, frozenset[str]] = {}

    def free(expr: ast.Expr) -> frozenset[str]:
        if expr in seen:
            return seen[expr]
        if isinstance(expr, ast.Name):
            out = frozenset({expr.id}) & frozenset(bounds)
        elif isinstance(expr, ast.RANGE_BINDERS):
            out = free(expr.body) - {expr.var}
        else:
            out = frozenset()
            for child in ast.children(expr):
                out |= free(child)
        seen[expr] = out
        return out

    flops = 0
    counted: set[ast.Expr] = set()

    def visit(expr: ast.Expr) -> None:
        nonlocal flops
        if expr in counted:
            return
        counted.add(expr)
        vars_ = free(expr)
        reps = prod(bounds[v] for v in vars_)
        if isinstance(expr, ast.RANGE_BINDERS):  # an add (sum) or a comparison (max) per value of the range
            flops += reps * int(to_poly(expr.bound, env).evaluate({}))
            visit(expr.body)
            return
        if isinstance(expr, (ast.BinOp, ast.Neg, ast.Call, ast.Compare, ast.BoolOp, ast.Not, ast.IfThenElse)):
            flops += reps
        if isinstance(expr, ast.Access):
            return  # index arithmetic is addressing, not FLOPs
        for child in ast.children(expr):
            visit(child)

    visit(instance.body)
    elements = sum(prod(int(d.evaluate({})) for d in s) for s in instance.input_shapes)
    elements += prod(int(d.evaluate({})) for d in instance.output_shape)
    return flops, elements


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
    bounds = index_bounds(instance)

    def names(expr: ast.Expr) -> set[str]:
        if isinstance(expr, ast.Name):
            return {expr.id} & set(bounds)
        found: set[str] = set()
        for child in ast.children(expr):
            found |= names(child)
        return found

    def operand(expr: ast.Expr) -> ast.Access | None:
        """An operand access, seen through a padding guard (`if inside then x[...] else 0`)."""
        if isinstance(expr, ast.IfThenElse):
            expr = expr.then
        return expr if isinstance(expr, ast.Access) else None

    def find(expr: ast.Expr, summed: tuple[str, ...]):
        if isinstance(expr, ast.Sum):
            return find(expr.body, summed + (expr.var,))
        if summed and isinstance(expr, ast.BinOp) and expr.op == "*":
            left, right = operand(expr.left), operand(expr.right)
            if left is not None and right is not None and left.tensor != right.tensor:
                a = set().union(*(names(i) for i in left.indices)) - set(summed)
                b = set().union(*(names(i) for i in right.indices)) - set(summed)
                order = list(bounds)
                pick = lambda s: tuple(v for v in order if v in s)  # noqa: E731 - the index order of the semantics
                return pick(a & b), pick(a - b), pick(b - a), summed
        for child in ast.children(expr):
            found = find(child, summed)
            if found is not None:
                return found
        return None

    return find(instance.body, ())
