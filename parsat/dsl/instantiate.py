"""An operator applied at concrete ranks: shapes, dims and expanded semantics.

Rank-polymorphic signatures (`[*a, n, *b]`) are resolved by choosing each
group's length; the index semantics is then rewritten with every variadic
index `*i` expanded into scalar index variables `i#0, i#1, ...`. Everything
downstream (spread inference, the numpy evaluator, the z3 lowering, the cost
model's FLOP count) works on this rank-concrete `OpInstance`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.conditions import Cond, NotAnInteger, symbolic_truth, to_cond, to_poly
from parsat.dsl.symbolic import Poly

MAX_GROUP_RANK = 8

SCALAR_FUNCTIONS = {"max": 2, "min": 2, "exp": 1, "log": 1, "sqrt": 1, "tanh": 1, "erf": 1, "abs": 1, "sin": 1,
                    "cos": 1, "step": 1}


class InstantiationError(Exception):
    """An application that does not fit the operator's signature."""

    def __init__(self, kind: str, message: str, node: ast.Expr | None = None):
        super().__init__(message)
        self.kind = kind
        self.node = node


def expanded(name: str, position: int) -> str:
    """The scalar name of position `position` of the group `name`."""
    return f"{name}#{position}"


@dataclass(frozen=True)
class OpInstance:
    """One application of an operator, with every rank fixed.

    `dims` maps the op's own dim names (and expanded group dims) to the
    caller's sizes; `attrs` maps integer attributes to their values and
    `real_attrs` real attributes to the caller's expressions.
    """

    op: ast.OpDecl
    groups: Mapping[str, int] = field(hash=False)
    dims: Mapping[str, Poly] = field(hash=False)
    attrs: Mapping[str, Poly] = field(hash=False)
    real_attrs: Mapping[str, ast.Expr] = field(hash=False)
    input_shapes: tuple[tuple[Poly, ...], ...]
    output_shape: tuple[Poly, ...]
    out_vars: tuple[str, ...]
    body: ast.Expr
    requirements: tuple[Cond, ...]

    @property
    def name(self) -> str:
        return self.op.name

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.op.tensor_params)

    def size_env(self) -> dict[str, Poly]:
        """Every integer name the semantics may mention, as polynomials."""
        return {**self.dims, **self.attrs}


def _shape_groups(shape: ast.ShapeType) -> list[str]:
    return [d.id for d in shape.dims if isinstance(d, ast.Variadic)]


def op_groups(op: ast.OpDecl) -> list[str]:
    """The op's variadic groups, in order of first appearance."""
    seen: list[str] = []
    for param in op.tensor_params:
        for group in _shape_groups(param.type):
            if group not in seen:
                seen.append(group)
    for group in _shape_groups(op.result):
        if group not in seen:
            seen.append(group)
    return seen


def _rank(shape: ast.ShapeType, groups: Mapping[str, int]) -> int:
    return sum(groups[d.id] if isinstance(d, ast.Variadic) else 1 for d in shape.dims)


def _where_on_lengths(op: ast.OpDecl, groups: Mapping[str, int], attrs: Mapping[str, Poly]) -> bool:
    """False when a `where` that can be decided from lengths and attributes fails."""
    env = dict(attrs)
    for cond in op.where:
        try:
            rel = to_cond(cond, env, groups)
        except NotAnInteger:
            continue  # mentions sizes: decided later, or symbolically
        if symbolic_truth(rel) is False:
            return False
    return True


def solve_groups(op: ast.OpDecl, ranks: Sequence[int], attrs: Mapping[str, Poly]) -> list[dict[str, int]]:
    """Every assignment of group lengths that fits the argument ranks."""
    groups = op_groups(op)
    params = op.tensor_params
    top = max(list(ranks) + [0])
    solutions = []
    for lengths in itertools.product(range(min(top, MAX_GROUP_RANK) + 1), repeat=len(groups)):
        assignment = dict(zip(groups, lengths))
        if all(_rank(p.type, assignment) == r for p, r in zip(params, ranks)) and _where_on_lengths(op, assignment, attrs):
            solutions.append(assignment)
    return solutions


def _fmt_shape(shape: Sequence[Poly]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _bind_shape(pattern: ast.ShapeType, actual: Sequence[Poly], groups: Mapping[str, int],
                env: dict[str, Poly], what: str) -> None:
    position = 0
    for dim in pattern.dims:
        if isinstance(dim, ast.Variadic):
            for k in range(groups[dim.id]):
                _bind_dim(expanded(dim.id, k), None, actual, position, env, what, pattern)
                position += 1
            continue
        _bind_dim(dim.id if isinstance(dim, ast.Name) else None, dim, actual, position, env, what, pattern)
        position += 1


def _bind_dim(name: str | None, expr: ast.Expr | None, actual: Sequence[Poly], position: int,
              env: dict[str, Poly], what: str, pattern: ast.ShapeType) -> None:
    value = actual[position]
    if name is not None and name not in env:
        env[name] = value
        return
    expected = env[name] if name is not None else to_poly(expr, env)
    if expected != value:
        raise InstantiationError(
            "shape", f"{what} has shape {_fmt_shape(actual)}: dim {position} is {value}, expected {expected}")


def instantiate(op: ast.OpDecl, arg_shapes: Sequence[Sequence[Poly]], attrs: Mapping[str, Poly],
                real_attrs: Mapping[str, ast.Expr] | None = None,
                groups: Mapping[str, int] | None = None) -> OpInstance:
    """Apply `op` to arguments of the given shapes and attribute values.

    Group lengths are solved from the ranks and the op's `where` unless
    given (the checker gives them to try a declaration on fresh sizes).
    """
    params = op.tensor_params
    if len(arg_shapes) != len(params):
        raise InstantiationError("arity", f"{op.name} takes {len(params)} tensor(s), got {len(arg_shapes)}")
    solutions = [dict(groups)] if groups is not None else solve_groups(op, [len(s) for s in arg_shapes], attrs)
    if not solutions:
        ranks = ", ".join(str(len(s)) for s in arg_shapes)
        raise InstantiationError("rank", f"{op.name} cannot take arguments of rank {ranks} with these attributes")
    if len(solutions) > 1:
        raise InstantiationError(
            "rank", f"{op.name}: the ranks of the arguments do not determine the groups "
                    f"{', '.join('*' + g for g in op_groups(op))}; give the attribute that fixes them as a constant")
    groups = solutions[0]
    env: dict[str, Poly] = dict(attrs)
    for index, (param, shape) in enumerate(zip(params, arg_shapes)):
        _bind_shape(param.type, shape, groups, env, f"argument '{param.name}' of {op.name}")
    dims = {k: v for k, v in env.items() if k not in attrs}
    output_shape = _expand_shape(op.result, groups, env)
    requirements = []
    for cond in op.where:
        rel = to_cond(cond, env, groups)
        truth = symbolic_truth(rel)
        if truth is False:
            raise InstantiationError("where", f"{op.name} requires {_source(cond)}, which fails here ({rel})", cond)
        if truth is None:
            requirements.append(rel)
    index_groups = _index_groups(op, groups)
    out_vars = _expand_indices(op.out_indices, index_groups)
    body = _expand_body(op.body, index_groups)
    return OpInstance(op, groups, dims, dict(attrs), dict(real_attrs or {}),
                      tuple(tuple(s) for s in arg_shapes), tuple(output_shape), tuple(out_vars), body,
                      tuple(requirements))


def _source(expr: ast.Expr) -> str:
    from parsat.dsl.printer import format_expr
    return format_expr(expr)


def _expand_shape(shape: ast.ShapeType, groups: Mapping[str, int], env: Mapping[str, Poly]) -> list[Poly]:
    out: list[Poly] = []
    for dim in shape.dims:
        if isinstance(dim, ast.Variadic):
            out.extend(env[expanded(dim.id, k)] for k in range(groups[dim.id]))
        else:
            out.append(to_poly(dim, env, groups))
    return out


def _index_groups(op: ast.OpDecl, groups: Mapping[str, int]) -> dict[str, int]:
    """Length of each variadic index group, from its place in `out[...]`."""
    result: dict[str, int] = {}
    for index, shape_dim in zip(op.out_indices, op.result.dims):
        if isinstance(index, ast.Variadic) and isinstance(shape_dim, ast.Variadic):
            result[index.id] = groups[shape_dim.id]
    return result


def _expand_indices(indices: Sequence[ast.Expr], index_groups: Mapping[str, int]) -> list[str]:
    names: list[str] = []
    for index in indices:
        if isinstance(index, ast.Variadic):
            names.extend(expanded(index.id, k) for k in range(index_groups.get(index.id, 0)))
        else:
            names.append(index.id)
    return names


def _expand_args(args: Sequence[ast.Expr], index_groups: Mapping[str, int]) -> tuple[ast.Expr, ...]:
    out: list[ast.Expr] = []
    for arg in args:
        if isinstance(arg, ast.Variadic) and arg.id in index_groups:
            out.extend(ast.Name(expanded(arg.id, k), arg.span) for k in range(index_groups[arg.id]))
        else:
            out.append(_expand_body(arg, index_groups))
    return tuple(out)


def _expand_body(expr: ast.Expr, index_groups: Mapping[str, int]) -> ast.Expr:
    """Rewrite `x[*i, j]` into `x[i#0, i#1, j]` everywhere in `expr`."""
    from dataclasses import replace

    if isinstance(expr, ast.Access):
        return replace(expr, indices=_expand_args(expr.indices, index_groups))
    if isinstance(expr, ast.Call):
        return replace(expr, args=tuple(_expand_body(a, index_groups) for a in expr.args))
    if isinstance(expr, (ast.BinOp, ast.Compare, ast.BoolOp)):
        return replace(expr, left=_expand_body(expr.left, index_groups), right=_expand_body(expr.right, index_groups))
    if isinstance(expr, (ast.Neg, ast.Not)):
        return replace(expr, operand=_expand_body(expr.operand, index_groups))
    if isinstance(expr, ast.IfThenElse):
        return replace(expr, test=_expand_body(expr.test, index_groups),
                       then=_expand_body(expr.then, index_groups), orelse=_expand_body(expr.orelse, index_groups))
    if isinstance(expr, ast.RANGE_BINDERS):
        return replace(expr, bound=_expand_body(expr.bound, index_groups), body=_expand_body(expr.body, index_groups))
    return expr


def param_dim_names(instance: OpInstance) -> tuple[tuple[str | None, ...], ...]:
    """For each tensor input, the op's name of each dim (None for an expression)."""
    result = []
    for param in instance.op.tensor_params:
        names: list[str | None] = []
        for dim in param.type.dims:
            if isinstance(dim, ast.Variadic):
                names.extend(expanded(dim.id, k) for k in range(instance.groups[dim.id]))
            else:
                names.append(dim.id if isinstance(dim, ast.Name) else None)
        result.append(tuple(names))
    return tuple(result)


def index_bounds(instance: OpInstance) -> dict[str, Poly]:
    """The range of every index variable: output indices, summation and max indices."""
    bounds = dict(zip(instance.out_vars, instance.output_shape))
    _range_bounds(instance.body, instance.size_env(), bounds)
    return bounds


def _range_bounds(expr: ast.Expr, env, bounds: dict[str, Poly]) -> None:
    """Every range binder's bound in `expr` into `bounds`. A recursion at module level, not a nested function
    calling itself: such a function and its closure's cell hold each other, a reference cycle that every call left
    to the cyclic collector with what the closure holds (issue 28: on llama-70b:64 this, `dsl.work`'s walks and
    what they held were ~80% of the million objects a search left for the collector)."""
    if isinstance(expr, ast.RANGE_BINDERS):
        bounds[expr.var] = to_poly(expr.bound, env)
    for child in ast.children(expr):
        _range_bounds(child, env, bounds)
