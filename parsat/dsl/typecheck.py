"""Typing a rule: shapes and spreads of both sides at concrete ranks.

A rule is checked once per assignment of lengths to its variadic groups
(`x: [*a, n, *b]`); each assignment gives a `RuleInstance` whose terms carry
their shape and spread (`TypedTerm`), and whose definedness requirements
(block divisibility, operator `where`s) are kept apart for the verifier:
the left side's requirements are assumptions, the right side's must follow.
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from parsat.dsl import ast
from parsat.dsl.conditions import Cond, NotAnInteger, divides, to_cond, to_poly
from parsat.dsl.instantiate import InstantiationError, OpInstance, instantiate
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.dsl.spread import SymbolicDegrees, DegreesError, apply_parallel, infer_compute
from parsat.dsl.symbolic import Poly


class TypeCheckError(Exception):
    """A problem in a rule, located at `node`; `kind` names the check."""

    def __init__(self, kind: str, message: str, node: ast.Expr | ast.Param | ast.RuleDecl | None):
        super().__init__(message)
        self.kind = kind
        self.node = node


@dataclass(frozen=True)
class TypedTerm:
    """A rule term with its logical shape and its spread."""

    node: ast.Expr
    kind: str  # "input", "op" or "parallel"
    name: str  # metavariable or operator name
    args: tuple["TypedTerm", ...]
    shape: tuple[Poly, ...]
    spread: SymbolicDegrees
    instance: OpInstance | None = None
    dim: int | None = None
    degree: Poly | None = None
    var_degrees: Mapping[str, Poly] = field(default_factory=dict, hash=False)
    problems: tuple[str, ...] = ()
    legal_when: tuple[Cond, ...] = ()  # the spread is legal only where these hold (`ComputeDegrees.legal_when`)
    to_dim: int | None = None          # all_to_all's second dim (`dsl.parallel_ops`)

    @property
    def dims(self) -> tuple[int, ...]:
        """A parallel term's dim arguments in call order: (), (dim,) or all_to_all's (dim, to_dim)."""
        return tuple(d for d in (self.dim, self.to_dim) if d is not None)

    def walk(self) -> Iterator["TypedTerm"]:
        yield self
        for arg in self.args:
            yield from arg.walk()


@dataclass(frozen=True)
class RuleInstance:
    """One rank assignment of a rule, typed."""

    rule: ast.RuleDecl
    groups: Mapping[str, int] = field(hash=False)
    symbols: Mapping[str, str] = field(hash=False)        # size symbol -> "dim" | "degree" | "int"
    reals: tuple[str, ...] = ()                           # real metavariables
    tensors: Mapping[str, tuple[Poly, ...]] = field(default_factory=dict, hash=False)
    where: tuple[Cond, ...] = ()
    lhs: TypedTerm | None = None
    rhs: TypedTerm | None = None
    lhs_requires: tuple[Cond, ...] = ()
    rhs_requires: tuple[Cond, ...] = ()

    @property
    def problems(self) -> list[tuple[str, ast.Expr]]:
        """Spreads an operator does not accept, on either side."""
        return [(p, t.node) for side in (self.lhs, self.rhs) for t in side.walk() for p in t.problems]

    @property
    def legal_when(self) -> list[tuple[Cond, ast.Expr]]:
        """Conditions on sizes under which the spreads of both sides are legal (windows that tile blocks)."""
        return [(c, t.node) for side in (self.lhs, self.rhs) for t in side.walk() for c in t.legal_when]


def rule_groups(rule: ast.RuleDecl) -> list[str]:
    seen: list[str] = []
    for binder in rule.binders:
        if isinstance(binder.type, ast.ShapeType):
            for dim in binder.type.dims:
                if isinstance(dim, ast.Variadic) and dim.id not in seen:
                    seen.append(dim.id)
    return seen


def group_assignments(rule: ast.RuleDecl, max_rank: int, max_group: int | None = None) -> list[dict[str, int]]:
    """All group lengths such that no tensor metavariable exceeds `max_rank`."""
    groups = rule_groups(rule)
    top = max_rank if max_group is None else min(max_group, max_rank)
    out = []
    for lengths in itertools.product(range(top + 1), repeat=len(groups)):
        assignment = dict(zip(groups, lengths))
        ranks = [sum(assignment[d.id] if isinstance(d, ast.Variadic) else 1 for d in b.type.dims)
                 for b in rule.binders if isinstance(b.type, ast.ShapeType)]
        if all(r <= max_rank for r in ranks):
            out.append(assignment)
    return out


def rank_bounded(rule: ast.RuleDecl, max_rank: int) -> ast.RuleDecl:
    """The rule with a `where` that keeps every metavariable at rank <= `max_rank`.

    A rule the verifier proved only up to a rank (BOUNDED) is applied only
    there: `len(a) + len(b) + 2 <= max_rank` for `x: [*a, n, *b, m]`. At
    longer groups the condition is false and the instance is never compiled.
    """
    from dataclasses import replace

    extra: list[ast.Expr] = []
    for binder in rule.binders:
        if not isinstance(binder.type, ast.ShapeType):
            continue
        groups = [d.id for d in binder.type.dims if isinstance(d, ast.Variadic)]
        if not groups:
            continue
        total: ast.Expr = ast.Num(len(binder.type.dims) - len(groups))
        for group in groups:
            total = ast.BinOp("+", total, ast.Len(group))
        extra.append(ast.Compare("<=", total, ast.Num(max_rank)))
    return replace(rule, where=tuple(rule.where) + tuple(extra))


def group_dim(group: str, position: int) -> str:
    """The size symbol of position `position` of a rule's dim group."""
    return f"{group}_{position}"


class _RuleTyper:
    def __init__(self, rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], groups: Mapping[str, int]):
        self.rule = rule
        self.ops = ops
        self.groups = dict(groups)
        self.symbols: dict[str, str] = {}
        self.reals: list[str] = []
        self.tensors: dict[str, tuple[Poly, ...]] = {}
        self.env: dict[str, Poly] = {}
        self.requires: list[Cond] = []
        self.known: Mapping[int, tuple[TypedTerm, tuple[Cond, ...]]] = {}   # see TermTyper
        self.input_spreads: dict[str, SymbolicDegrees] = {}  # metavariables that arrive spread (see type_rule)

    # ------------------------------------------------------------ binders
    def bind(self) -> None:
        seen: set[str] = set()
        for binder in self.rule.binders:
            if binder.name in seen:
                raise TypeCheckError("duplicate", f"metavariable '{binder.name}' is bound twice", binder)
            seen.add(binder.name)
            if isinstance(binder.type, ast.ScalarType):
                if binder.type.kind == "real":
                    self.reals.append(binder.name)
                else:
                    self.symbols[binder.name] = binder.type.kind
                    self.env[binder.name] = Poly.sym(binder.name)
        for binder in self.rule.binders:  # plain dim names first, so expressions may use any of them
            if isinstance(binder.type, ast.ShapeType):
                for dim in binder.type.dims:
                    if isinstance(dim, ast.Name) and dim.id not in self.env:
                        if dim.id in seen:
                            raise TypeCheckError("name", f"'{dim.id}' is a metavariable, not a size", dim)
                        self.symbols[dim.id] = "dim"
                        self.env[dim.id] = Poly.sym(dim.id)
                    elif isinstance(dim, ast.Variadic):
                        for k in range(self.groups[dim.id]):
                            name = group_dim(dim.id, k)
                            self.symbols[name] = "dim"
                            self.env[name] = Poly.sym(name)
        for binder in self.rule.binders:
            if isinstance(binder.type, ast.ShapeType):
                shape: list[Poly] = []
                for dim in binder.type.dims:
                    if isinstance(dim, ast.Variadic):
                        shape.extend(self.env[group_dim(dim.id, k)] for k in range(self.groups[dim.id]))
                    else:
                        shape.append(self._size(dim))
                self.tensors[binder.name] = tuple(shape)

    def _size(self, expr: ast.Expr) -> Poly:
        try:
            return to_poly(expr, self.env, self.groups)
        except NotAnInteger as err:
            raise TypeCheckError("size", str(err), err.node) from None

    # -------------------------------------------------------------- terms
    def term(self, expr: ast.Expr) -> TypedTerm:
        known = self.known.get(id(expr)) if self.known else None
        if known is not None and known[0].node is expr:
            self.requires.extend(known[1])
            return known[0]
        if isinstance(expr, ast.Name):
            if expr.id in self.tensors:
                shape = self.tensors[expr.id]
                return TypedTerm(expr, "input", expr.id, (), shape,
                                 self.input_spreads.get(expr.id) or SymbolicDegrees.whole(len(shape)))
            if expr.id in self.symbols or expr.id in self.reals:
                raise TypeCheckError("sort", f"'{expr.id}' is a {self.symbols.get(expr.id, 'real')}, not a tensor", expr)
            raise TypeCheckError("unbound", f"unknown metavariable '{expr.id}' (declare it after 'forall')", expr)
        if not isinstance(expr, ast.Call):
            raise TypeCheckError("sort", "expected an operator application or a tensor metavariable", expr)
        if expr.func in PARALLEL_OPS:
            return self._parallel(expr)
        op = self.ops.get(expr.func)
        if op is None:
            raise TypeCheckError("unknown-op", f"unknown operator '{expr.func}'{_suggest(expr.func, self.ops)}", expr)
        return self._compute(expr, op)

    def _parallel(self, expr: ast.Call) -> TypedTerm:
        kinds = PARALLEL_OPS[expr.func].params
        if len(expr.args) != len(kinds):
            names = {"tensor": "x", "dim": "dim", "to_dim": "to_dim", "degree": "n"}
            signature = ", ".join(names[k] for k in kinds)
            raise TypeCheckError("arity", f"{expr.func} takes {len(kinds)} arguments ({signature}), "
                                          f"got {len(expr.args)}", expr)
        source = self.term(expr.args[0])
        dims = []
        for arg in expr.args[1:-1]:
            dim_poly = self._size(arg)
            if not dim_poly.is_const:
                raise TypeCheckError("attribute", f"{expr.func}: the dim must be a constant or len(group), "
                                                  f"not {dim_poly}", arg)
            dims.append(dim_poly.constant)
        dim, to_dim = (dims + [None, None])[:2]
        if to_dim is not None and to_dim == dim:
            raise TypeCheckError("attribute", f"{expr.func}: the two dims must differ, both are {dim}", expr.args[2])
        degree = self._size(expr.args[-1])
        if degree.is_const and degree.constant < 1:
            raise TypeCheckError("attribute", f"{expr.func}: degree must be at least 1, got {degree.constant}",
                                 expr.args[-1])
        try:
            spread, needs = apply_parallel(expr.func, source.shape, source.spread, dim, degree, expr.span, to_dim)
        except DegreesError as err:
            raise TypeCheckError("attribute", str(err), expr.args[1]) from None
        self.requires.extend(needs)
        return TypedTerm(expr, "parallel", expr.func, (source,), source.shape, spread, dim=dim, degree=degree,
                         to_dim=to_dim)

    def _compute(self, expr: ast.Call, op: ast.OpDecl) -> TypedTerm:
        if len(expr.args) != len(op.params):
            signature = ", ".join(p.name for p in op.params)
            raise TypeCheckError("arity", f"{op.name} takes {len(op.params)} argument(s) ({signature}), "
                                          f"got {len(expr.args)}", expr)
        tensors: list[TypedTerm] = []
        attrs: dict[str, Poly] = {}
        reals: dict[str, ast.Expr] = {}
        for param, arg in zip(op.params, expr.args):
            if param.is_tensor:
                tensors.append(self.term(arg))
            elif param.type.kind == "real":
                reals[param.name] = self._real(arg, op, param)
            else:
                value = self._size(arg)
                if param.type.kind == "degree" and value.is_const and value.constant < 1:
                    raise TypeCheckError("attribute", f"{op.name}: '{param.name}' is a degree, at least 1", arg)
                attrs[param.name] = value
        try:
            instance = instantiate(op, [t.shape for t in tensors], attrs, reals)
        except InstantiationError as err:
            raise TypeCheckError("shape" if err.kind == "shape" else err.kind, str(err), expr) from None
        except NotAnInteger as err:
            raise TypeCheckError("size", f"{op.name}: {err}", expr) from None
        self.requires.extend(instance.requirements)
        inferred = infer_compute(instance, [t.spread for t in tensors])
        self.requires.extend(inferred.requires)
        return TypedTerm(expr, "op", op.name, tuple(tensors), instance.output_shape, inferred.spread,
                         instance=instance, var_degrees=inferred.var_degrees, problems=inferred.problems,
                         legal_when=inferred.legal_when)

    def _real(self, arg: ast.Expr, op: ast.OpDecl, param: ast.Param) -> ast.Expr:
        if isinstance(arg, ast.Num):
            return ast.Num(Fraction(arg.value), arg.span)  # exact rationals, never rounded to floats
        if isinstance(arg, ast.Neg) and isinstance(arg.operand, ast.Num):
            return ast.Num(-Fraction(arg.operand.value), arg.span)
        if isinstance(arg, ast.Name) and arg.id in self.reals:
            return arg
        raise TypeCheckError("attribute", f"{op.name}: '{param.name}' is real: give a number or a real metavariable",
                             arg)

    # -------------------------------------------------------------- where
    def conditions(self) -> tuple[Cond, ...]:
        out = []
        for cond in self.rule.where:
            try:
                out.append(to_cond(cond, self.env, self.groups))
            except NotAnInteger as err:
                raise TypeCheckError("where", str(err), err.node) from None
        return tuple(out)


def _suggest(name: str, known: Mapping[str, object]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(known) + list(PARALLEL_OPS), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def type_rule(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], groups: Mapping[str, int],
              input_spreads: Mapping[str, SymbolicDegrees] | None = None) -> RuleInstance:
    """Type both sides of `rule` for one assignment of group lengths.

    Metavariables are whole tensors, unless `input_spreads` says one
    arrives already spread (a lifted instance: the rule applied to tensors
    spread over other mesh axes, `verifier.lifting`); each of its shard
    degrees must then divide its dim, a condition added to `where`.
    """
    typer = _RuleTyper(rule, ops, groups)
    typer.bind()
    where = typer.conditions()
    if input_spreads:
        typer.input_spreads = dict(input_spreads)
        for name, spread in input_spreads.items():
            for dim, (size, degree) in enumerate(zip(typer.tensors[name], spread.shard)):
                if degree != Poly.const(1):
                    where += (divides(degree, size, None, f"'{name}' arrives split {degree} ways along dim {dim}"),)
    lhs = typer.term(rule.lhs)
    lhs_requires = tuple(typer.requires)
    typer.requires = []
    rhs = typer.term(rule.rhs)
    return RuleInstance(rule, dict(groups), dict(typer.symbols), tuple(typer.reals), dict(typer.tensors),
                        where, lhs, rhs, lhs_requires, tuple(typer.requires))


class TermTyper:
    """Types many terms over one fixed set of metavariables, reusing the typing of remembered subterms.

    The rule generator builds every term from terms it typed before; typing
    only the new top operator (instead of the whole term from its leaves)
    is what keeps enumeration linear in the number of terms. A remembered
    subterm is found by identity and must stay alive while remembered.
    """

    def __init__(self, binders: tuple[ast.Param, ...], ops: Mapping[str, ast.OpDecl],
                 groups: Mapping[str, int] | None = None):
        self._typer = _RuleTyper(ast.RuleDecl("term", binders, (), ast.Num(0), ast.Num(0)), ops, groups or {})
        self._typer.bind()
        self._known: dict[int, tuple[TypedTerm, tuple[Cond, ...]]] = {}
        self._typer.known = self._known

    def type(self, expr: ast.Expr) -> tuple[TypedTerm, tuple[Cond, ...]]:
        """The typed term and its definedness requirements (raises TypeCheckError)."""
        self._typer.requires = []
        term = self._typer.term(expr)
        return term, tuple(self._typer.requires)

    def remember(self, term: TypedTerm, requires: tuple[Cond, ...]) -> None:
        self._known[id(term.node)] = (term, requires)

    @property
    def symbols(self) -> Mapping[str, str]:
        return self._typer.symbols


# ------------------------------------------------------------- binding check


def _names_in(expr: ast.Expr) -> list[ast.Name]:
    return [n for n in ast.walk(expr) if isinstance(n, ast.Name)]


def check_rhs_bound(rule: ast.RuleDecl) -> None:
    """Every name on the right must be fixed by the left (FlexFlow's 112 bad rules).

    The one exception is a `degree` metavariable: a rule that introduces
    parallelism (`matmul(x, w) => combine(matmul(partition(x, 0, p), ...), 0, p)`)
    chooses its degree freely. It is proven for every degree, and saturation
    picks the values from the divisors of the device count.
    """
    binders = {b.name: b for b in rule.binders}
    bound: set[str] = {b.name for b in rule.binders
                       if isinstance(b.type, ast.ScalarType) and b.type.kind == "degree"}
    for name in _names_in(rule.lhs):
        bound.add(name.id)
        binder = binders.get(name.id)
        if binder is not None and isinstance(binder.type, ast.ShapeType):
            for dim in binder.type.dims:
                bound |= {n.id for n in _names_in(dim)} | ({dim.id} if isinstance(dim, ast.Variadic) else set())
    for node in ast.walk(rule.lhs):
        if isinstance(node, ast.Len):
            bound.add(node.group)
    for node in ast.walk(rule.rhs):
        if isinstance(node, ast.Name) and node.id not in bound:
            raise TypeCheckError("unbound-rhs", f"the right-hand side uses '{node.id}', which the left-hand side "
                                                "does not bind", node)
        if isinstance(node, ast.Len) and node.group not in bound:
            raise TypeCheckError("unbound-rhs", f"the right-hand side uses len({node.group}), which the left-hand "
                                                "side does not bind", node)
