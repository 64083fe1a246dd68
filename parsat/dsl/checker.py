"""Everything that can be wrong in `.rule` files before anything runs.

`check_library` returns diagnostics, each `file:line:col: message` with the
line and a caret: unknown operators and attributes, arity, shapes that do
not fit, spreads an operator does not accept, the two sides of a rule with
different shapes or spreads, right-hand names the left does not bind,
duplicate names, and `where` conditions that can never hold. Rank-
polymorphic rules are checked for every length of their groups up to
`CHECK_MAX_GROUP`.

Diagnostic kinds that the verifier can turn into a concrete counterexample
(the rule is well-formed but wrong) are listed in `SEMANTIC_KINDS`.
"""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass, field
from typing import Callable, Mapping

from parsat.dsl import ast
from parsat.dsl.conditions import Negation, NotAnInteger, Rel, holds, to_cond, to_poly
from parsat.dsl.errors import Diagnostic, DslError, SourceCache
from parsat.dsl.instantiate import SCALAR_FUNCTIONS, InstantiationError, expanded, instantiate, op_groups
from parsat.dsl.library import Library
from parsat.dsl.printer import format_expr
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.dsl.symbolic import Poly
from parsat.dsl.typecheck import RuleInstance, TypeCheckError, check_rhs_bound, group_assignments, type_rule

CHECK_MAX_GROUP = 2
CHECK_MAX_RANK = 4
SEMANTIC_KINDS = frozenset({"shape-mismatch", "spread-mismatch", "illegal-spread"})


@dataclass
class CheckReport:
    """The outcome of checking a library: diagnostics and counts."""

    library: Library
    diagnostics: list[Diagnostic] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.diagnostics

    def counts(self) -> dict[str, int]:
        rules = self.library.rules
        parallel = sum(1 for r in rules if is_parallel_rule(r))
        return {"files": len(self.library.modules), "operators": len(self.library.ops), "rules": len(rules),
                "algebraic": len(rules) - parallel, "parallel": parallel, "errors": len(self.diagnostics)}


def is_parallel_rule(rule: ast.RuleDecl) -> bool:
    """A rule that mentions a parallel operator on either side."""
    return any(isinstance(n, ast.Call) and n.func in PARALLEL_OPS
               for side in (rule.lhs, rule.rhs) for n in ast.walk(side))


def new_values(rule: ast.RuleDecl) -> tuple[ast.Call, ...]:
    """The right side's terms, below its root, whose value no term of the left side computes.

    A term's value is the term with its parallel operators taken out (a
    parallel operator changes where the pieces are, never the value), so
    `partition(relu(x))` and `relu(partition(x))` compute one value, and
    `add(x, add(y, z))` from `add(add(x, y), z)` computes a new one,
    `add(y, z)`. The root is left out: it is made equal to the left side.
    A rule with new values grows the set of values an e-graph holds; one
    without only places values it already holds (`egraph.runner` schedules
    the two kinds apart, docs/MESH.md "Saturation")."""
    known = {_value(term) for term in ast.walk(rule.lhs) if isinstance(term, (ast.Call, ast.Name))}
    below_root = [term for arg in _tensor_args(rule.rhs) for term in ast.walk(arg) if isinstance(term, ast.Call)]
    return tuple(term for term in below_root if _value(term) not in known)


def creates_values(rule: ast.RuleDecl) -> bool:
    """Whether the rule's right side computes a value its left side does not (`new_values`)."""
    return bool(new_values(rule))


def _tensor_args(term: ast.Expr) -> tuple[ast.Expr, ...]:
    return term.args if isinstance(term, ast.Call) else ()


def _value(term: ast.Expr):
    """What a term computes, as a hashable key: parallel operators are taken out; an attribute is its text."""
    if isinstance(term, ast.Call):
        if term.func in PARALLEL_OPS:
            return _value(term.args[0])
        return (term.func,) + tuple(_value(arg) for arg in term.args)
    if isinstance(term, ast.Name):
        return ("name", term.id)
    return ("attr", format_expr(term))


# ------------------------------------------------------------------- operators


class _OpError(Exception):
    def __init__(self, kind: str, message: str, node):
        super().__init__(message)
        self.kind, self.node = kind, node


def check_op(op: ast.OpDecl) -> None:
    """Raise `_OpError` for the first problem in an operator declaration."""
    names: dict[str, str] = {}
    for param in op.params:
        if param.name in names:
            raise _OpError("duplicate", f"parameter '{param.name}' is declared twice", param)
        names[param.name] = "tensor" if param.is_tensor else param.type.kind
    if op.name in PARALLEL_OPS:
        raise _OpError("duplicate", f"'{op.name}' is a built-in parallel operator", op)
    dims: set[str] = set()
    groups = op_groups(op)
    for param in op.tensor_params:
        for dim in param.type.dims:
            if isinstance(dim, ast.Name):
                if dim.id in names:
                    raise _OpError("name", f"'{dim.id}' is a parameter, not a size", dim)
                dims.add(dim.id)
    sizes = dims | {p.name for p in op.attr_params if p.type.kind != "real"}
    for param in op.tensor_params:
        for dim in param.type.dims:
            if not isinstance(dim, (ast.Name, ast.Variadic)):
                _check_size_expr(dim, sizes, groups)
    param_groups = {d.id for p in op.tensor_params for d in p.type.dims if isinstance(d, ast.Variadic)}
    for dim in op.result.dims:
        if isinstance(dim, ast.Variadic):
            if dim.id not in param_groups:
                raise _OpError("name", f"the result uses *{dim.id}, which no parameter has", dim)
        else:
            _check_size_expr(dim, sizes, groups)
    for cond in op.where:
        try:
            to_cond(cond, {s: Poly.sym(s) for s in sizes}, {g: 1 for g in groups})
        except NotAnInteger as err:
            raise _OpError("where", str(err), err.node) from None
    if len(op.out_indices) != len(op.result.dims):
        raise _OpError("arity", f"out[...] has {len(op.out_indices)} indices but the result has "
                                f"{len(op.result.dims)} dims", op)
    seen_index: set[str] = set()
    for index, dim in zip(op.out_indices, op.result.dims):
        if isinstance(index, ast.Variadic) != isinstance(dim, ast.Variadic):
            raise _OpError("shape", "out[...] must use *i exactly where the result has a group *s", index)
        if index.id in seen_index or index.id in names or index.id in sizes:
            raise _OpError("name", f"index '{index.id}' clashes with another name", index)
        seen_index.add(index.id)
    for lengths in ({g: 1 for g in groups}, {g: 2 for g in groups}):
        _trial(op, lengths, sizes)


def _check_size_expr(expr: ast.Expr, sizes: set[str], groups: list[str]) -> None:
    try:
        to_poly(expr, {s: Poly.sym(s) for s in sizes}, {g: 1 for g in groups})
    except NotAnInteger as err:
        raise _OpError("name", str(err), err.node) from None


def _trial(op: ast.OpDecl, groups: Mapping[str, int], sizes: set[str]) -> None:
    """Instantiate on fresh sizes and check every name and access in the body."""
    env: dict[str, Poly] = {}
    shapes = []
    for param in op.tensor_params:
        shape = []
        for dim in param.type.dims:
            if isinstance(dim, ast.Variadic):
                shape.extend(env.setdefault(expanded(dim.id, k), Poly.sym(expanded(dim.id, k)))
                             for k in range(groups[dim.id]))
            elif isinstance(dim, ast.Name):
                shape.append(env.setdefault(dim.id, Poly.sym(dim.id)))
            else:
                shape.append(to_poly(dim, {**env, **{a.name: Poly.sym(a.name) for a in op.attr_params}}, groups))
        shapes.append(shape)
    attrs = {p.name: Poly.sym(p.name) for p in op.attr_params if p.type.kind != "real"}
    reals = {p.name: ast.Name(p.name) for p in op.attr_params if p.type.kind == "real"}
    try:
        instance = instantiate(op, shapes, attrs, reals, groups=groups)
    except InstantiationError as err:
        raise _OpError(err.kind, str(err), err.node or op) from None
    except NotAnInteger as err:
        raise _OpError("name", str(err), err.node) from None
    ranks = dict(zip(instance.inputs, (len(s) for s in instance.input_shapes)))
    _check_body(instance.body, set(instance.out_vars), set(instance.size_env()) | set(sizes), set(reals), ranks,
                set(groups), value=True)


def _check_body(expr: ast.Expr, indices: set[str], sizes: set[str], reals: set[str], tensors: Mapping[str, int],
                groups: set[str], value: bool) -> None:
    """Names resolve, tensors are indexed with their rank, sorts fit."""
    def again(e, v=value, idx=indices):
        _check_body(e, idx, sizes, reals, tensors, groups, v)

    if isinstance(expr, ast.Num):
        if not isinstance(expr.value, int) and not value:
            raise _OpError("sort", "a real number cannot be an index or a size", expr)
        return
    if isinstance(expr, ast.Name):
        if expr.id in tensors:
            raise _OpError("sort", f"'{expr.id}' is a tensor: read an element, as {expr.id}[...]", expr)
        if expr.id in reals:
            if not value:
                raise _OpError("sort", f"'{expr.id}' is real and cannot be an index", expr)
            return
        if expr.id not in indices and expr.id not in sizes:
            raise _OpError("name", f"unknown name '{expr.id}'", expr)
        return
    if isinstance(expr, ast.Len):
        if expr.group not in groups:
            raise _OpError("name", f"'{expr.group}' is not a group of dims", expr)
        return
    if isinstance(expr, ast.Variadic):
        raise _OpError("name", f"*{expr.id} is not an index group of out[...]", expr)
    if isinstance(expr, ast.Access):
        if not value:
            raise _OpError("sort", "a tensor element cannot be an index or a size", expr)
        if expr.tensor not in tensors:
            raise _OpError("name", f"'{expr.tensor}' is not a tensor parameter", expr)
        if len(expr.indices) != tensors[expr.tensor]:
            raise _OpError("arity", f"'{expr.tensor}' has {tensors[expr.tensor]} dims here but is read with "
                                    f"{len(expr.indices)} indices", expr)
        for index in expr.indices:
            again(index, False)
        return
    if isinstance(expr, ast.Call):
        if not value:
            raise _OpError("sort", f"{expr.func}(...) is a value, not an index", expr)
        if expr.func not in SCALAR_FUNCTIONS:
            raise _OpError("unknown-function", f"unknown function '{expr.func}' "
                                               f"(known: {', '.join(sorted(SCALAR_FUNCTIONS))})", expr)
        if len(expr.args) != SCALAR_FUNCTIONS[expr.func]:
            raise _OpError("arity", f"{expr.func} takes {SCALAR_FUNCTIONS[expr.func]} argument(s)", expr)
        for arg in expr.args:
            again(arg)
        return
    if isinstance(expr, ast.BinOp):
        again(expr.left)
        again(expr.right)
        return
    if isinstance(expr, ast.Neg):
        again(expr.operand)
        return
    if isinstance(expr, ast.IfThenElse):
        _check_condition(expr.test, indices, sizes, reals, tensors, groups)
        again(expr.then)
        again(expr.orelse)
        return
    if isinstance(expr, ast.RANGE_BINDERS):
        if not value:
            raise _OpError("sort", "a reduction is a value, not an index", expr)
        if expr.var in indices or expr.var in sizes:
            kind = "sum" if isinstance(expr, ast.Sum) else "max"
            raise _OpError("name", f"{kind} index '{expr.var}' clashes with another name", expr)
        again(expr.bound, False)
        again(expr.body, value, indices | {expr.var})
        return
    raise _OpError("sort", "a condition is only allowed after 'if' or in 'where'", expr)


def _check_condition(expr, indices, sizes, reals, tensors, groups) -> None:
    if isinstance(expr, (ast.Compare, ast.BoolOp)):
        for part in (expr.left, expr.right):
            if isinstance(expr, ast.BoolOp):
                _check_condition(part, indices, sizes, reals, tensors, groups)
            else:
                _check_body(part, indices, sizes, reals, tensors, groups, value=False)
        return
    if isinstance(expr, ast.Not):
        _check_condition(expr.operand, indices, sizes, reals, tensors, groups)
        return
    raise _OpError("sort", "expected a condition on indices, such as 'j < n'", expr)


# ----------------------------------------------------------------------- rules


def rule_instances(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], max_rank: int = CHECK_MAX_RANK,
                   max_group: int | None = CHECK_MAX_GROUP) -> list[RuleInstance]:
    """The rule typed at every group length (raises `TypeCheckError`)."""
    return [type_rule(rule, ops, groups) for groups in group_assignments(rule, max_rank, max_group)]


def _groups_note(instance: RuleInstance) -> str:
    if not instance.groups:
        return ""
    return " (when " + ", ".join(f"len({g}) = {n}" for g, n in instance.groups.items()) + ")"


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def compare_sides(instance: RuleInstance) -> TypeCheckError | None:
    """Different shapes or spreads on the two sides, or an illegal spread."""
    lhs, rhs = instance.lhs, instance.rhs
    note = _groups_note(instance)
    for problem, node in instance.problems:
        return TypeCheckError("illegal-spread", problem + note, node)
    if lhs.shape != rhs.shape:
        return TypeCheckError("shape-mismatch", f"the two sides have different shapes: left {_fmt_shape(lhs.shape)}, "
                                                f"right {_fmt_shape(rhs.shape)}{note}", instance.rule.rhs)
    if lhs.spread != rhs.spread:
        return TypeCheckError("spread-mismatch", f"the two sides are spread differently: left {lhs.spread}, "
                                                 f"right {rhs.spread}{note}", instance.rule.rhs)
    return None


def _sample_assignments(symbols: Mapping[str, str], rng: random.Random):
    names = sorted(symbols)
    low = {n: 0 if symbols[n] == "int" else 1 for n in names}
    for _ in range(300):  # witnesses are usually small and plentiful: try those first
        yield {n: rng.randint(low[n], 8) for n in names}
    if len(names) <= 5:
        for values in itertools.product(range(0, 9), repeat=len(names)):
            if all(v >= low[n] for n, v in zip(names, values)):
                yield dict(zip(names, values))
    for _ in range(3000):
        yield {n: rng.randint(low[n], 64) for n in names}


def witness(conds, symbols: Mapping[str, str]) -> dict[str, int] | None:
    """Sizes up to 64 that satisfy every condition, or None (a search, not a proof)."""
    rng = random.Random(0)
    return next((values for values in _sample_assignments(symbols, rng) if all(holds(c, values) for c in conds)),
                None)


def satisfiable(conds, symbols: Mapping[str, str]) -> bool:
    """Some sizes up to 64 satisfy every condition (a search, not a proof)."""
    return witness(conds, symbols) is not None


def check_rule(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl]) -> None:
    """Raise `TypeCheckError` for the first problem in a rule."""
    if not isinstance(rule.lhs, ast.Call):
        raise TypeCheckError("lhs", "the left-hand side must be an operator application", rule.lhs)
    for binder in rule.binders:
        if isinstance(binder.type, ast.ScalarType) and binder.type.kind not in ("int", "degree", "real"):
            raise TypeCheckError("sort", f"unknown type '{binder.type.kind}'", binder)
    check_rhs_bound(rule)
    for instance in rule_instances(rule, ops):
        problem = compare_sides(instance)
        if problem is not None:
            raise problem
        if instance.where and not satisfiable(instance.where, instance.symbols):
            raise TypeCheckError("never", "this condition can never hold (no sizes up to 64 satisfy it)",
                                 rule.where[0])
        assumptions = instance.where + instance.lhs_requires
        if not satisfiable(assumptions, instance.symbols):
            raise TypeCheckError("never", "this rule can never apply: no sizes up to 64 satisfy its 'where' and "
                                          "the left-hand side's requirements" + _groups_note(instance), rule)
        for cond, node in instance.legal_when:
            found = witness(assumptions + (Negation(cond),), instance.symbols)
            if found is not None:
                shown = ", ".join(f"{k} = {v}" for k, v in sorted(found.items()))
                raise TypeCheckError("illegal-spread", f"{cond.reason}; it fails at {shown}"
                                     + _groups_note(instance), node)
        for degree in sorted(s for s, kind in instance.symbols.items() if kind == "degree"):
            at_least_two = Rel(">=", Poly.sym(degree), Poly.const(2))
            if not satisfiable(assumptions + (at_least_two,), instance.symbols):
                raise TypeCheckError(
                    "degenerate", f"this rule only applies when {degree} = 1: metavariables are whole tensors, "
                                  f"so e.g. combine(x, 0, {degree}) needs {degree} to divide 1"
                                  + _groups_note(instance), rule)


# --------------------------------------------------------------------- library


def _node_span(node) -> ast.Span | None:
    return getattr(node, "span", None)


def check_library(library: Library, progress: Callable[[int, int], None] | None = None) -> list[Diagnostic]:
    """Every diagnostic for the operators and rules of a library; `progress(rules checked, rules)` after each."""
    sources: SourceCache = library.sources
    out: list[Diagnostic] = []
    seen_ops: dict[str, ast.OpDecl] = {}
    seen_rules: dict[str, ast.RuleDecl] = {}
    for module in library.modules:
        for op in module.ops:
            if op.name in seen_ops:
                out.append(sources.diagnostic("duplicate", f"operator '{op.name}' is already declared at "
                                                           f"{seen_ops[op.name].span}", op.span))
                continue
            seen_ops[op.name] = op
            try:
                check_op(op)
            except _OpError as err:
                out.append(sources.diagnostic(err.kind, f"op {op.name}: {err}", _node_span(err.node) or op.span))
    ops = library.ops
    total = len(library.rules)
    for module in library.modules:
        for rule in module.rules:
            if progress is not None:
                progress(len(seen_rules), total)
            if rule.name in seen_rules:
                out.append(sources.diagnostic("duplicate", f"rule '{rule.name}' is already declared at "
                                                           f"{seen_rules[rule.name].span}", rule.span))
                continue
            seen_rules[rule.name] = rule
            try:
                check_rule(rule, ops)
            except TypeCheckError as err:
                out.append(sources.diagnostic(err.kind, f"rule {rule.name}: {err}", _node_span(err.node) or rule.span))
    return out


def check_paths(paths=None, progress: Callable[[int, int], None] | None = None) -> CheckReport:
    """Load and check files or folders (default: the shipped library)."""
    from parsat.dsl.library import load_library

    library, load_errors = load_library(paths, strict=False)
    return CheckReport(library, load_errors + check_library(library, progress))


def load_checked(paths=None) -> Library:
    """A library with no diagnostics, or `DslError` listing them all. A library that checked clean before (its
    files and the checker unchanged, `check_cache`) is parsed and not checked again."""
    from parsat.dsl.check_cache import known_clean, remember_clean
    from parsat.dsl.library import load_library

    library, load_errors = load_library(paths, strict=False)
    if not load_errors and known_clean(library):
        return library
    report = CheckReport(library, load_errors + check_library(library))
    if not report.ok:
        raise DslError(report.diagnostics)
    remember_clean(library)
    return report.library


def resolve_library(rules) -> Library:
    """A `Library`, paths of `.rule` files/folders, or None for the shipped rules."""
    if isinstance(rules, Library):
        return rules
    if rules is None:
        return load_checked(None)
    if isinstance(rules, (str, os.PathLike)):
        rules = [rules]
    return load_checked(list(rules))
