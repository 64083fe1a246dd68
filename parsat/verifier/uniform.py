"""Which rules are uniform in the lengths of their groups: every place a length can appear, read symbolically.

A rank-polymorphic rule is proved for every rank from lengths 0 and 1 only
when merging two adjacent dims of a group commutes with everything on both
sides (`verifier.ranks`). Merging changes the group's length, so it commutes
only where nothing depends on that length except the positions the group
itself pushes along. This module checks that, for all lengths at once, by
typing the rule's *skeleton*: every tensor's shape as a sequence of runs
(`*a`, of symbolic length `len(a)`) and single dims, with every integer
that mentions a length kept as a polynomial in the symbols `len(a)`.

A rule is uniform when:
* its `where` and the shapes of its metavariables never mention a length;
* every degree, and every attribute an operator uses as a value (a split's
  `start` and `size`, an unflatten's `k`, a user op's roll amount: any
  attribute that appears in the semantics, a shape or a condition other
  than a group-length equation), is free of lengths;
* every other attribute is a *selector*: the operator mentions it only in
  equations `attr == len(A) + ... + c` that fix the lengths of its own
  groups (softmax's `dim == len(a)`); the rule's value for it must be
  linear in the lengths (`len(a) + len(b) + 1`, never `len(a) % 5`,
  `len(a) / 3` or `2 * len(a)` unless that is exactly where a group ends),
  and the operator's groups must then fit the argument skeletons in
  exactly one way, with every run inside one of the operator's groups
  (never split, never taken for a single dim) and the equations holding
  as polynomial identities, so for every length at once;
* a `partition` or `combine` dim is, as a polynomial, the position of a
  single dim of the skeleton (so it never lands inside a run, at any
  length);
* no operator's semantics, shapes or other conditions mention a length.

Then at every length assignment each operator is the same template with
each of its groups bound to the same runs: merging two adjacent dims of a
run shortens one operator group by one and moves every selector and
every partition dim after it by exactly one, which is what the instance
at the shorter length has. `verifier.ranks` adds the instance-level check
that each operator carries the group's dims as plain indices.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Iterator, Mapping

from parsat.dsl import ast
from parsat.dsl.conditions import NotAnInteger, to_poly
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.dsl.printer import format_expr
from parsat.dsl.symbolic import ONE, ZERO, Poly

RUN = "run"
DIM = ("dim",)
_LEN = "len#"   # the symbol of len(g) in the polynomials below


class NotUniform(Exception):
    """Where a length is used in a way that is not the same at every length, and why."""


# ------------------------------------------------------------- lengths as symbols


def _lens_named(expr: ast.Expr) -> ast.Expr:
    """`expr` with every `len(g)` written as the name `len#g` (integer arithmetic only)."""
    if isinstance(expr, ast.Len):
        return ast.Name(_LEN + expr.group, expr.span)
    if isinstance(expr, ast.BinOp):
        return replace(expr, left=_lens_named(expr.left), right=_lens_named(expr.right))
    if isinstance(expr, ast.Neg):
        return replace(expr, operand=_lens_named(expr.operand))
    return expr


def length_poly(expr: ast.Expr) -> Poly | None:
    """An integer expression as a polynomial over its names, `len(g)` as the symbol `len#g` (None if it is
    not integer arithmetic)."""
    named = _lens_named(expr)
    names = {n.id for n in ast.walk(named) if isinstance(n, ast.Name)}
    try:
        return to_poly(named, {n: Poly.sym(n) for n in names})
    except NotAnInteger:
        return None


def mentions_length(expr: ast.Expr) -> bool:
    return any(isinstance(n, ast.Len) for n in ast.walk(expr))


def _linear_in_lengths(poly: Poly) -> bool:
    """Integer constants plus integer multiples of `len#g` symbols, nothing else."""
    for mono, _coeff in poly.terms:
        if len(mono) > 1 or (mono and (mono[0][1] != 1 or not isinstance(mono[0][0], str)
                                       or not mono[0][0].startswith(_LEN))):
            return False
    return True


def _length(run: tuple) -> Poly:
    """The symbolic length of a skeleton (a sequence of runs and single dims)."""
    total = ZERO
    for element in run:
        total = total + (ONE if element == DIM else Poly.sym(_LEN + element[1]))
    return total


def _pretty_lengths(text: str) -> str:
    out, rest = "", text
    while _LEN in rest:
        before, after = rest.split(_LEN, 1)
        name = "".join(itertools.takewhile(lambda c: c.isalnum() or c == "_", after))
        out += f"{before}len({name})"
        rest = after[len(name):]
    return out + rest


# ------------------------------------------------------------- operators


@dataclass(frozen=True)
class _OpProfile:
    """What an operator does with lengths: '' or why it is not uniform, its selector attributes and the
    equations that fix its groups' lengths."""

    problem: str
    selectors: frozenset[str]
    equations: tuple[tuple[str, Poly], ...]   # (attribute, polynomial over len#A of its own groups)


def _selector_equation(cond: ast.Expr, attrs: set[str]) -> tuple[str, Poly] | None:
    """`attr == E` (either way round) with E linear in the operator's lengths, else None."""
    if not (isinstance(cond, ast.Compare) and cond.op == "=="):
        return None
    for name, other in ((cond.left, cond.right), (cond.right, cond.left)):
        if isinstance(name, ast.Name) and name.id in attrs and mentions_length(other):
            poly = length_poly(other)
            if poly is not None and _linear_in_lengths(poly):
                return name.id, poly
    return None


@lru_cache(maxsize=512)
def _profile(op: ast.OpDecl) -> _OpProfile:
    """The operator's use of lengths (cached: operators are frozen)."""
    attrs = {p.name for p in op.attr_params if p.type.kind == "int"}
    shapes = [d for p in op.tensor_params for d in p.type.dims] + list(op.result.dims)
    if mentions_length(op.body):
        return _OpProfile(f"{op.name}'s semantics uses the length of a group as a value", frozenset(), ())
    if any(mentions_length(d) for d in shapes if not isinstance(d, ast.Variadic)):
        return _OpProfile(f"{op.name}'s shapes use the length of a group as a size", frozenset(), ())
    equations, others = [], []
    for cond in op.where:
        found = _selector_equation(cond, attrs)
        if found is not None:
            equations.append(found)
        elif mentions_length(cond):
            return _OpProfile(f"{op.name}'s condition '{format_expr(cond)}' depends on the length of a group",
                              frozenset(), ())
        else:
            others.append(cond)
    used = {n.id for e in [op.body, *others, *shapes] for n in ast.walk(e) if isinstance(n, ast.Name)}
    selectors = frozenset(a for a, _ in equations if a not in used)
    return _OpProfile("", selectors, tuple(equations))


def _fit(pattern: tuple, skeleton: tuple, bound: Mapping[str, tuple]) -> Iterator[dict]:
    """Every binding of the operator's groups that makes `pattern` (("group", A) and DIM items) read
    `skeleton`, extending `bound`; a run fits only inside a group."""
    if not pattern:
        if not skeleton:
            yield dict(bound)
        return
    head, rest = pattern[0], pattern[1:]
    if head == DIM:
        if skeleton and skeleton[0] == DIM:
            yield from _fit(rest, skeleton[1:], bound)
        return
    group = head[1]
    if group in bound:
        n = len(bound[group])
        if tuple(skeleton[:n]) == bound[group]:
            yield from _fit(rest, skeleton[n:], bound)
        return
    for n in range(len(skeleton) + 1):
        yield from _fit(rest, skeleton[n:], {**bound, group: tuple(skeleton[:n])})


def _pattern(shape: ast.ShapeType) -> tuple:
    return tuple(("group", d.id) if isinstance(d, ast.Variadic) else DIM for d in shape.dims)


def _apply_op(op: ast.OpDecl, args: list[tuple], attrs: Mapping[str, Poly]) -> tuple:
    """The skeleton of an operator's result, when its groups bind the same runs at every length (else
    NotUniform)."""
    profile = _profile(op)
    if profile.problem:
        raise NotUniform(profile.problem)
    bindings = [{}]
    for param, skeleton in zip(op.tensor_params, args):
        bindings = [b for old in bindings for b in _fit(_pattern(param.type), skeleton, old)]
    fitting = []
    for binding in bindings:
        lengths = {_LEN + g: _length(run) for g, run in binding.items()}
        if all(attr in attrs and not (poly.symbols() - set(lengths))
               and attrs[attr] == poly.subst(lengths) for attr, poly in profile.equations):
            if binding not in fitting:
                fitting.append(binding)
    if len(fitting) != 1:
        how = "in no way" if not fitting else "in several ways"
        shown = ", ".join(f"{a} = {_pretty_lengths(str(v))}" for a, v in attrs.items())
        raise NotUniform(f"{op.name}'s groups fit its arguments {how} that holds at every length of the rule's "
                         f"groups{' (' + shown + ')' if shown else ''}")
    out: list = []
    for dim in op.result.dims:
        if isinstance(dim, ast.Variadic):
            if dim.id not in fitting[0]:
                raise NotUniform(f"{op.name}'s result group *{dim.id} is fixed by no argument")
            out.extend(fitting[0][dim.id])
        else:
            out.append(DIM)
    return tuple(out)


# ------------------------------------------------------------- rules


class _Skeletons:
    """Types the terms of one rule as skeletons."""

    def __init__(self, rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl]):
        self.ops = ops
        self.binders: dict[str, tuple] = {}
        for binder in rule.binders:
            if isinstance(binder.type, ast.ShapeType):
                self.binders[binder.name] = tuple((RUN, d.id) if isinstance(d, ast.Variadic) else DIM
                                                  for d in binder.type.dims)

    def term(self, expr: ast.Expr) -> tuple:
        if isinstance(expr, ast.Name):
            return self.binders.get(expr.id, ())
        if not isinstance(expr, ast.Call):
            return ()
        if expr.func in PARALLEL_OPS:
            return self._parallel(expr)
        op = self.ops.get(expr.func)
        if op is None:
            return ()
        profile = _profile(op)
        tensors, attrs = [], {}
        for param, arg in zip(op.params, expr.args):
            if param.is_tensor:
                tensors.append(self.term(arg))
            elif param.type.kind != "real":
                attrs[param.name] = self._attribute(op.name, param.name, arg,
                                                    selector=param.name in profile.selectors)
        return _apply_op(op, tensors, attrs)

    def _attribute(self, where: str, name: str, arg: ast.Expr, selector: bool) -> Poly:
        if not mentions_length(arg):
            return length_poly(arg) or ZERO
        text = format_expr(arg)
        if not selector:
            raise NotUniform(f"{where}'s '{name}' is {text}: a length used as a value (a size, an amount, a "
                             "degree) changes what the operator computes at each length")
        poly = length_poly(arg)
        if poly is None or not _linear_in_lengths(poly):
            raise NotUniform(f"{where}'s '{name}' is {text}, which is not linear in the lengths of the groups, so "
                             "it picks a different dim at some length")
        return poly

    def _parallel(self, expr: ast.Call) -> tuple:
        spec = PARALLEL_OPS[expr.func]
        skeleton = self.term(expr.args[0])
        if mentions_length(expr.args[-1]):
            raise NotUniform(f"{expr.func}'s degree is {format_expr(expr.args[-1])}: a degree that grows with "
                             "a group's length is a different parallelization at each length")
        if spec.has_dim:
            dim = self._attribute(expr.func, "dim", expr.args[1], selector=True)
            starts = [_length(skeleton[:k]) for k, element in enumerate(skeleton) if element == DIM]
            if dim not in starts:
                raise NotUniform(f"{expr.func}'s dim {format_expr(expr.args[1])} is not the same single dim of "
                                 "its argument at every length of its groups (it lands inside a group)")
        return skeleton


def why_not_uniform(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl]) -> str | None:
    """None when the rule uses lengths only uniformly (module docstring), else the first place it does not."""
    if any(mentions_length(cond) for cond in rule.where):
        return "its 'where' mentions the length of a group"
    for binder in rule.binders:
        if isinstance(binder.type, ast.ShapeType) and any(
                mentions_length(d) for d in binder.type.dims if not isinstance(d, ast.Variadic)):
            return f"the shape of '{binder.name}' uses the length of a group as a size"
    skeletons = _Skeletons(rule, ops)
    try:
        for side in (rule.lhs, rule.rhs):
            skeletons.term(side)
    except NotUniform as err:
        return str(err)
    return None
