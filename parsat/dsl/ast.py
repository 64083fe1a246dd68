"""The syntax tree of `.rule` files.

Every node is a frozen dataclass. Source positions (`span`) are excluded from
equality so that `parse(print(tree)) == tree` holds for every file: the
printer cannot reproduce positions, only structure. One expression type
serves op semantics, `where` conditions and rule terms; the checker decides
which sort (index, value, tensor, condition) each node has in its context.
"""

from __future__ import annotations

from fractions import Fraction

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class Span:
    """Where a node came from: 1-based line and column, as editors count."""

    file: str
    line: int
    column: int
    end_line: int
    end_column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


def _span() -> Span | None:
    return field(default=None, compare=False, repr=False)


# ----------------------------------------------------------------- expressions


@dataclass(frozen=True)
class Num:
    """An integer or real literal."""

    value: int | float | Fraction  # a real literal is an exact Fraction (as written); ints stay ints
    span: Span | None = _span()


@dataclass(frozen=True)
class Name:
    """A name: a dim, an index variable, an attribute or a metavariable."""

    id: str
    span: Span | None = _span()


@dataclass(frozen=True)
class Variadic:
    """`*s`: a group of dims in a shape, or a group of indices."""

    id: str
    span: Span | None = _span()


@dataclass(frozen=True)
class Access:
    """`x[i, l]`: one element of a tensor operand in op semantics."""

    tensor: str
    indices: tuple["Expr", ...]
    span: Span | None = _span()


@dataclass(frozen=True)
class Call:
    """`f(a, b)`: a scalar function in semantics, an operator in rule terms."""

    func: str
    args: tuple["Expr", ...]
    span: Span | None = _span()


@dataclass(frozen=True)
class Len:
    """`len(s)`: the number of dims in the variadic group `s`."""

    group: str
    span: Span | None = _span()


@dataclass(frozen=True)
class BinOp:
    """Arithmetic: `+ - * / %`. On indices `/` is floor division."""

    op: str
    left: "Expr"
    right: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class Neg:
    operand: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class Compare:
    """`a < b` and friends; `==` and `!=` too."""

    op: str
    left: "Expr"
    right: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class BoolOp:
    """`a and b`, `a or b`."""

    op: str
    left: "Expr"
    right: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class Not:
    operand: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class IfThenElse:
    """`if c then a else b`, for concat-like and padded operators."""

    test: "Expr"
    then: "Expr"
    orelse: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class Sum:
    """`sum(var < bound) body`: a contraction over `0 <= var < bound`."""

    var: str
    bound: "Expr"
    body: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class Max:
    """`max(var < bound) body`: the largest value of `body` over `0 <= var < bound` (max pooling, the shift
    of a safe logsumexp). An empty range gives 0, as an empty `sum` does, so every operator is total; the
    operators that use it require a non-empty range where it matters. Not a partial sum: a device holding
    one block of the range holds the max of that block, which no parallel operator adds up, so the spread
    analysis refuses a max over a sharded range (`dsl.spread`)."""

    var: str
    bound: "Expr"
    body: "Expr"
    span: Span | None = _span()


# The constructs that bind an index variable over a range `0 <= var < bound`.
RANGE_BINDERS = (Sum, Max)


Expr = Union[Num, Name, Variadic, Access, Call, Len, BinOp, Neg, Compare, BoolOp, Not, IfThenElse, Sum, Max]


# ---------------------------------------------------------------------- types


@dataclass(frozen=True)
class ShapeType:
    """`[m, k]` or `[*a, n, *b]`: dims are expressions or variadic groups."""

    dims: tuple[Expr, ...]
    span: Span | None = _span()


@dataclass(frozen=True)
class ScalarType:
    """`int` (>= 0), `degree` (>= 1) or `real`."""

    kind: str
    span: Span | None = _span()


Type = Union[ShapeType, ScalarType]


@dataclass(frozen=True)
class Param:
    """An op parameter or a rule metavariable: `name: type`."""

    name: str
    type: Type
    span: Span | None = _span()

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.type, ShapeType)


# ---------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Import:
    path: str
    doc: tuple[str, ...] = ()
    span: Span | None = _span()


@dataclass(frozen=True)
class OpDecl:
    """An operator: signature, side conditions and index semantics.

    `out_indices` are `Name`s and `Variadic`s naming the output coordinates;
    `body` computes `out[out_indices]` from the tensor parameters.
    """

    name: str
    params: tuple[Param, ...]
    result: ShapeType
    where: tuple[Expr, ...]
    out_indices: tuple[Expr, ...]
    body: Expr
    doc: tuple[str, ...] = ()
    span: Span | None = _span()

    @property
    def tensor_params(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.is_tensor)

    @property
    def attr_params(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if not p.is_tensor)


@dataclass(frozen=True)
class RuleDecl:
    """A rewrite `lhs => rhs` for all values of its metavariables."""

    name: str
    binders: tuple[Param, ...]
    where: tuple[Expr, ...]
    lhs: Expr
    rhs: Expr
    doc: tuple[str, ...] = ()
    span: Span | None = _span()


Decl = Union[Import, OpDecl, RuleDecl]


@dataclass(frozen=True)
class LineNotes:
    """Comments kept with one printed line of a declaration (`dsl.comments`): full lines before it, one at its end."""

    line: int                        # the printed line: 0 is the first (`rule name:`, an op's signature)
    before: tuple[str, ...] = ()
    trailing: str | None = None


@dataclass(frozen=True)
class Notes:
    """A file's comments that are neither its header nor a declaration's doc, by where they are printed."""

    loose: tuple[tuple[int, tuple[str, ...]], ...] = ()            # (before item i; i == len(items): at the end)
    inner: tuple[tuple[int, tuple[LineNotes, ...]], ...] = ()      # (item i, its lines' comments)


@dataclass(frozen=True)
class Module:
    """One `.rule` file: its header comment, its declarations in order, and its other comments."""

    path: str
    header: tuple[str, ...]
    items: tuple[Decl, ...]
    notes: Notes = Notes()

    def __eq__(self, other: object) -> bool:  # path is where, not what
        return isinstance(other, Module) and (self.header, self.items, self.notes) == (other.header, other.items,
                                                                                       other.notes)

    def __hash__(self) -> int:
        return hash((self.header, self.items, self.notes))

    @property
    def ops(self) -> tuple[OpDecl, ...]:
        return tuple(d for d in self.items if isinstance(d, OpDecl))

    @property
    def rules(self) -> tuple[RuleDecl, ...]:
        return tuple(d for d in self.items if isinstance(d, RuleDecl))

    @property
    def imports(self) -> tuple[Import, ...]:
        return tuple(d for d in self.items if isinstance(d, Import))


def walk(expr: Expr):
    """Yield `expr` and every sub-expression, parents first."""
    yield expr
    for child in children(expr):
        yield from walk(child)


def children(expr: Expr) -> tuple[Expr, ...]:
    """The direct sub-expressions of a node, in source order."""
    if isinstance(expr, (Access,)):
        return expr.indices
    if isinstance(expr, Call):
        return expr.args
    if isinstance(expr, (BinOp, Compare, BoolOp)):
        return (expr.left, expr.right)
    if isinstance(expr, (Neg, Not)):
        return (expr.operand,)
    if isinstance(expr, IfThenElse):
        return (expr.test, expr.then, expr.orelse)
    if isinstance(expr, RANGE_BINDERS):
        return (expr.bound, expr.body)
    return ()
