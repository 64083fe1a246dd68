"""Integer expressions and side conditions over symbolic sizes.

`to_poly` turns an index/size expression into a `Poly`; `to_cond` turns a
`where` condition into a small condition tree (`Rel`, `Junction`, `Negation`)
that the brute-force checker evaluates (`holds`) and the verifier hands to
z3. Both read names through one environment mapping a name to its `Poly`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Union

from parsat.dsl import ast
from parsat.dsl.printer import format_expr
from parsat.dsl.symbolic import Poly


class NotAnInteger(Exception):
    """An expression that is not integer arithmetic over known names."""

    def __init__(self, message: str, node: ast.Expr):
        super().__init__(message)
        self.node = node


def to_poly(expr: ast.Expr, env: Mapping[str, Poly], groups: Mapping[str, int] | None = None) -> Poly:
    """The polynomial of an integer expression; names are looked up in `env`."""
    if isinstance(expr, ast.Num):
        if not isinstance(expr.value, int):
            raise NotAnInteger(f"expected an integer, found the real number {format_expr(expr)}", expr)
        return Poly.const(expr.value)
    if isinstance(expr, ast.Name):
        if expr.id not in env:
            raise NotAnInteger(f"unknown name '{expr.id}'", expr)
        return env[expr.id]
    if isinstance(expr, ast.Len):
        if groups is None or expr.group not in groups:
            raise NotAnInteger(f"'{expr.group}' is not a group of dims (write *{expr.group} in a shape)", expr)
        return Poly.const(groups[expr.group])
    if isinstance(expr, ast.Neg):
        return -to_poly(expr.operand, env, groups)
    if isinstance(expr, ast.BinOp):
        left = to_poly(expr.left, env, groups)
        right = to_poly(expr.right, env, groups)
        if expr.op == "+":
            return left + right
        if expr.op == "-":
            return left - right
        if expr.op == "*":
            return left * right
        if expr.op == "/":
            if right.is_const and right.constant == 0:
                raise NotAnInteger("division by zero", expr)
            return left.floordiv(right)
        if expr.op == "%":
            if right.is_const and right.constant == 0:
                raise NotAnInteger("modulo by zero", expr)
            return left.mod(right)
    raise NotAnInteger("expected integer arithmetic on sizes", expr)


@dataclass(frozen=True)
class Rel:
    """`left op right` for op in < <= > >= == !=."""

    op: str
    left: Poly
    right: Poly
    span: ast.Span | None = field(default=None, compare=False)
    reason: str = field(default="", compare=False)

    def __str__(self) -> str:
        return f"{self.left} {self.op} {self.right}"


@dataclass(frozen=True)
class Junction:
    op: str  # "and" / "or"
    parts: tuple["Cond", ...]
    span: ast.Span | None = field(default=None, compare=False)
    reason: str = field(default="", compare=False)

    def __str__(self) -> str:
        return "(" + f" {self.op} ".join(str(p) for p in self.parts) + ")"


@dataclass(frozen=True)
class Negation:
    part: "Cond"
    span: ast.Span | None = field(default=None, compare=False)
    reason: str = field(default="", compare=False)

    def __str__(self) -> str:
        return f"not ({self.part})"


Cond = Union[Rel, Junction, Negation]


def divides(divisor: Poly, value: Poly, span: ast.Span | None, reason: str) -> Rel:
    """`value % divisor == 0`, as the requirement of a split into blocks."""
    return Rel("==", value.mod(divisor), Poly.const(0), span, reason)


def to_cond(expr: ast.Expr, env: Mapping[str, Poly], groups: Mapping[str, int] | None = None) -> Cond:
    """A `where` condition as a condition tree."""
    if isinstance(expr, ast.Compare):
        return Rel(expr.op, to_poly(expr.left, env, groups), to_poly(expr.right, env, groups), expr.span)
    if isinstance(expr, ast.BoolOp):
        return Junction(expr.op, (to_cond(expr.left, env, groups), to_cond(expr.right, env, groups)), expr.span)
    if isinstance(expr, ast.Not):
        return Negation(to_cond(expr.operand, env, groups), expr.span)
    raise NotAnInteger("expected a condition such as 'm % p == 0'", expr)


_RELATIONS = {
    "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
}


def holds(cond: Cond, values: Mapping[str, int]) -> bool:
    """Evaluate a condition for concrete sizes; a division by zero is false."""
    try:
        if isinstance(cond, Rel):
            return _RELATIONS[cond.op](cond.left.evaluate(values), cond.right.evaluate(values))
    except ZeroDivisionError:
        return False
    if isinstance(cond, Junction):
        results = (holds(part, values) for part in cond.parts)
        return all(results) if cond.op == "and" else any(results)
    return not holds(cond.part, values)


def symbolic_truth(cond: Cond) -> bool | None:
    """True/False when the condition is decided without knowing any size."""
    if isinstance(cond, Rel):
        diff = cond.left - cond.right
        if diff.is_const:
            return _RELATIONS[cond.op](diff.constant, 0)
        return None
    if isinstance(cond, Junction):
        parts = [symbolic_truth(p) for p in cond.parts]
        if cond.op == "and":
            return False if False in parts else (True if all(p is True for p in parts) else None)
        return True if True in parts else (False if all(p is False for p in parts) else None)
    inner = symbolic_truth(cond.part)
    return None if inner is None else not inner


def cond_symbols(cond: Cond) -> set[str]:
    if isinstance(cond, Rel):
        return cond.left.symbols() | cond.right.symbols()
    if isinstance(cond, Junction):
        out: set[str] = set()
        for part in cond.parts:
            out |= cond_symbols(part)
        return out
    return cond_symbols(cond.part)
