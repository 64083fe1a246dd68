"""Proof of a rule instance for all sizes and degrees, with z3.

Both sides are lowered with the per-device (piece-wise) semantics of
docs/ARCHITECTURE.md into the normal form of `verifier.normal`: the value a
context observes at block `@b`, local index `@i` is the sum over sum
indices of the piece there. Sizes are symbolic; divisibility assumptions
(`m % p == 0`, from `where` or from the left side's partitions) are solved
by substitution (`m = p * m'`), so block extents stay polynomials and sum
bounds compare structurally. What the normal form leaves open (index
arithmetic, conditions, shape and spread equalities under the assumptions,
the right side's requirements) goes to z3 as one quantifier-free query per
goal, with sums as an uninterpreted `SUM(bound, lambda)` over canonically
named binders, and a max over a range as an uninterpreted `MAX(bound,
lambda)` (its lemmas are in the normal form: `verifier.normal`). A satisfiable query is only a *candidate*: the caller
replays its model concretely before saying REFUTED.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from fractions import Fraction

import z3

from parsat.dsl import ast
from parsat.dsl.conditions import Cond, Junction, Negation, Rel, symbolic_truth, to_poly
from parsat.dsl.symbolic import ONE, ZERO, Poly
from parsat.dsl.typecheck import RuleInstance, TypedTerm
from parsat.verifier import normal as nf
from parsat.verifier.limits import DEFAULT_RLIMIT, OutOfTime, budget_reason, check_deadline


MAX_CASE_SPLITS = 4
# The partial functions and the indicator of where each is undefined (a division is "?zero" of its divisor).
PARTIAL_FUNCTIONS = {"log": "?nonpos", "sqrt": "?neg"}


class Unprovable(Exception):
    """A construct the lowering does not handle (the verdict is UNKNOWN)."""


@dataclass(frozen=True)
class ProofResult:
    """`status` is "proved", "candidate" (z3 model to replay), "never" (it never applies) or "unknown"."""

    status: str
    reason: str = ""
    model: dict = field(default_factory=dict)  # original size symbols -> int
    assumptions: tuple[str, ...] = ()
    inputs: dict = field(default_factory=dict)  # a candidate's input values: name -> nested lists of Fractions
    reals: dict = field(default_factory=dict)   # and its real metavariables: name -> Fraction


# ---------------------------------------------------------- size algebra


@dataclass
class _Sizes:
    subst: dict  # original symbol -> Poly over fresh symbols
    kinds: dict  # every symbol in use -> "dim" | "degree" | "int"
    assumptions: list  # conditions left for z3

    def apply(self, poly: Poly) -> Poly:
        return poly.subst(self.subst) if poly.symbols() & set(self.subst) else poly


def _apply_cond(cond: Cond, fn) -> Cond:
    if isinstance(cond, Rel):
        return Rel(cond.op, fn(cond.left), fn(cond.right), cond.span, cond.reason)
    if isinstance(cond, Junction):
        return Junction(cond.op, tuple(_apply_cond(p, fn) for p in cond.parts), cond.span, cond.reason)
    return Negation(_apply_cond(cond.part, fn), cond.span, cond.reason)


def _cancel(num: Poly, den: Poly) -> tuple[Poly, Poly]:
    """Divide out a common monomial factor of two monomials."""
    if len(num.terms) != 1 or len(den.terms) != 1:
        return num, den
    (nm, nc), (dm, dc) = num.terms[0], den.terms[0]
    from math import gcd
    g = gcd(nc, dc) or 1
    npow, dpow = dict(nm), dict(dm)
    common = {a: min(e, dpow.get(a, 0)) for a, e in npow.items() if isinstance(a, str) and dpow.get(a, 0)}
    for a, e in common.items():
        npow[a] -= e
        dpow[a] -= e

    def build(powers, coeff):
        out = Poly.const(coeff)
        for a, e in powers.items():
            for _ in range(e):
                out = out * (Poly.sym(a) if isinstance(a, str) else Poly.atom(a))
        return out

    return build(npow, nc // g), build(dpow, dc // g)


def solve_sizes(instance: RuleInstance) -> _Sizes:
    """Substitute divisibility and equality assumptions away where possible."""
    sizes = _Sizes({}, dict(instance.symbols), [])
    pending = list(instance.where) + list(instance.lhs_requires)
    counter = 0
    progress = True
    while progress:
        progress = False
        rest = []
        for cond in pending:
            cond = _apply_cond(cond, sizes.apply)
            truth = symbolic_truth(cond)
            if truth is True:
                continue
            target = None
            if isinstance(cond, Rel) and cond.op == "==":
                for a, b in ((cond.left, cond.right), (cond.right, cond.left)):
                    if b == ZERO and len(a.terms) == 1 and a.terms[0][1] == 1 and len(a.terms[0][0]) == 1:
                        atom, exp = a.terms[0][0][0]
                        if not isinstance(atom, str) and atom[0] == "%" and exp == 1:
                            num, den = _cancel(atom[1], atom[2])
                            if den == ONE:
                                target = ("drop",)
                                break
                            name = num.as_symbol()
                            if name is not None and name not in den.symbols():
                                counter += 1
                                fresh = f"{name}_{counter}"
                                sizes.kinds[fresh] = "int" if sizes.kinds.get(name) == "int" else "dim"
                                target = (name, den * Poly.sym(fresh))
                                break
                    name = a.as_symbol()
                    if name is not None and name not in b.symbols() and not b.is_const:
                        target = (name, b)
                        break
            if target is None:
                rest.append(cond)
                continue
            if target[0] != "drop":
                name, value = target
                sizes.subst = {k: v.subst({name: value}) for k, v in sizes.subst.items()}
                sizes.subst[name] = value
            progress = True
        pending = rest
    sizes.assumptions = pending
    return sizes


# -------------------------------------------------------------- lowering


class _Lowering:
    """Lowers terms piece by piece into normal forms, and records every partial operation it meets (a
    division, a log, a square root) with where it is evaluated: the binders and `if` branches around it
    (`context`), so that `undefined` can say where a side is undefined, even when the value's normal form
    drops the operation (`0 * (1 / x)` is 0 as a value, undefined at x = 0)."""

    def __init__(self, sizes: _Sizes):
        self.sizes = sizes
        self.bounds: dict[str, Poly] = {}
        self.counter = 0
        self.context: list[tuple] = []   # ("sum", var, bound) or ("if", cond, truth), outermost first
        self.partials: list[tuple] = []  # (context, kind, argument NF): kind "?zero", "?nonpos" or "?neg"
        self.undefined_forms: tuple = ((), ())  # set by `lowered_sides`: where each side is undefined

    def inside(self, item: tuple, lower, *args):
        """`lower(*args)` with `item` (a binder or a branch) around it in the context."""
        self.context.append(item)
        try:
            return lower(*args)
        finally:
            self.context.pop()

    def partial(self, kind: str, argument: tuple) -> None:
        self.partials.append((tuple(self.context), kind, argument))

    def undefined(self, partials: list[tuple]) -> tuple:
        """How many partial operations are out of their domain (0 exactly where the side is defined): for
        each, the indicator `?zero(arg)` (or `?nonpos`, `?neg`) summed over its binders, under its branches.
        Every monomial is a count, never negative."""
        total: tuple = ()
        for context, kind, argument in partials:
            form = nf.factor(("fn", kind, (argument,)))
            for item in reversed(context):
                if item[0] == "sum":
                    form = nf.sum_over(item[1], item[2], form)
                else:
                    form = nf.if_then_else(item[1], form, ()) if item[2] else nf.if_then_else(item[1], (), form)
            total = nf.add(total, form)
        return total

    def P(self, poly: Poly) -> Poly:
        return self.sizes.apply(poly)

    def fresh(self, bound: Poly, hint: str = "v") -> str:
        self.counter += 1
        name = f"~{hint}{self.counter}"
        self.bounds[name] = bound
        return name

    def divmod(self, e: Poly, d: Poly) -> tuple[Poly, Poly]:
        return nf.divmod_poly(e, d, self.bounds)

    # ---------------------------------------------------------- terms
    def piece(self, term: TypedTerm, blocks: tuple, s: Poly, local: tuple) -> tuple:
        if term.kind == "input":
            return nf.factor(("in", term.name, tuple(local)))
        if term.kind == "parallel":
            return self._parallel(term, blocks, s, local)
        return self._compute(term, blocks, s, local)

    def _parallel(self, term: TypedTerm, blocks, s, local):
        arg = term.args[0]
        n = self.P(term.degree)
        if term.name == "replicate":
            return self.piece(arg, blocks, s, local)
        if term.name == "reduce":
            t = self.fresh(n, "t")
            piece = self.inside(("sum", t, n), self.piece, arg, blocks, s * n + Poly.sym(t), local)
            return nf.sum_over(t, n, piece)
        k = term.dim
        extent = self.P(term.shape[k]).floordiv(self.P(term.spread.shard[k]))
        blocks, local = list(blocks), list(local)
        if term.name == "partition":
            q, t = self.divmod(blocks[k], n)
            blocks[k], local[k] = q, nf.simplify(t * extent + local[k], self.bounds)
        else:
            src_extent = self.P(arg.shape[k]).floordiv(self.P(arg.spread.shard[k]))
            q, r = self.divmod(local[k], src_extent)
            blocks[k], local[k] = nf.simplify(blocks[k] * n + q, self.bounds), r
        return self.piece(arg, tuple(blocks), s, tuple(local))

    def _compute(self, term: TypedTerm, blocks, s, local):
        instance = term.instance
        env = {name: self.P(poly) for name, poly in instance.size_env().items()}
        degrees = {v: self.P(d) for v, d in term.var_degrees.items()}
        variables = {}
        for k, var in enumerate(instance.out_vars):
            degree = degrees.get(var, ONE)
            extent = self.P(term.shape[k]).floordiv(degree)
            variables[var] = (blocks[k], local[k], degree, blocks[k] * extent + local[k])
        args = dict(zip(instance.inputs, term.args))
        return _Body(self, instance, env, degrees, args).value(instance.body, s, variables)

    def observe(self, term: TypedTerm, free: tuple) -> tuple:
        """The sum over sum indices of the piece at free block/local variables."""
        total = self.P(term.spread.sum)
        s = self.fresh(total, "s")
        blocks = tuple(b for b, _ in free)
        local = tuple(i for _, i in free)
        return nf.sum_over(s, total, self.inside(("sum", s, total), self.piece, term, blocks, Poly.sym(s), local))


class _Body:
    """The index semantics of one op application, lowered at one piece."""

    def __init__(self, low: _Lowering, instance, env, degrees, args):
        self.low, self.instance, self.env, self.degrees, self.args = low, instance, env, degrees, args

    def index(self, expr: ast.Expr, variables) -> Poly:
        env = {**self.env, **{v: g for v, (_, _, _, g) in variables.items()}}
        return to_poly(expr, env, self.instance.groups)

    def cond(self, expr: ast.Expr, variables) -> tuple:
        if isinstance(expr, ast.Compare):
            return ("rel", expr.op, self.index(expr.left, variables), self.index(expr.right, variables))
        if isinstance(expr, ast.BoolOp):
            return (expr.op, self.cond(expr.left, variables), self.cond(expr.right, variables))
        if isinstance(expr, ast.Not):
            return ("not", self.cond(expr.operand, variables))
        raise Unprovable("unsupported condition")

    def value(self, expr: ast.Expr, s: Poly, variables) -> tuple:
        if isinstance(expr, ast.Num):
            return nf.const(Fraction(expr.value))
        if isinstance(expr, ast.Name):
            if expr.id in self.instance.real_attrs:
                attr = self.instance.real_attrs[expr.id]
                return nf.const(Fraction(attr.value)) if isinstance(attr, ast.Num) else nf.factor(("real", attr.id))
            return nf.size(self.index(expr, variables))
        if isinstance(expr, ast.Len):
            return nf.size(self.index(expr, variables))
        if isinstance(expr, ast.Access):
            return self.access(expr, s, variables)
        if isinstance(expr, ast.Neg):
            return nf.neg(self.value(expr.operand, s, variables))
        if isinstance(expr, ast.BinOp):
            left, right = self.value(expr.left, s, variables), self.value(expr.right, s, variables)
            if expr.op == "+":
                return nf.add(left, right)
            if expr.op == "-":
                return nf.add(left, nf.neg(right))
            if expr.op == "*":
                return nf.mul(left, right)
            if expr.op == "/":
                self.low.partial("?zero", right)
                return nf.mul(left, nf.recip(right))
            raise Unprovable(f"'{expr.op}' on values")
        if isinstance(expr, ast.Call):
            args = tuple(self.value(a, s, variables) for a in expr.args)
            if expr.func in PARTIAL_FUNCTIONS:
                self.low.partial(PARTIAL_FUNCTIONS[expr.func], args[0])
            return nf.factor(("fn", expr.func, args))
        if isinstance(expr, ast.IfThenElse):
            test = self.cond(expr.test, variables)
            then = self.low.inside(("if", test, True), self.value, expr.then, s, variables)
            orelse = self.low.inside(("if", test, False), self.value, expr.orelse, s, variables)
            return nf.if_then_else(test, then, orelse)
        if isinstance(expr, ast.Sum):
            bound = self.index(expr.bound, variables)
            degree = self.degrees.get(expr.var, ONE)
            if degree == ONE:
                var = self.low.fresh(bound, "l")
                inner = {**variables, expr.var: (ZERO, Poly.sym(var), ONE, Poly.sym(var))}
                return nf.sum_over(var, bound, self.low.inside(("sum", var, bound), self.value, expr.body, s, inner))
            extent = bound.floordiv(degree)
            inner_s, block = self.low.divmod(s, degree)
            var = self.low.fresh(extent, "l")
            glob = block * extent + Poly.sym(var)
            inner = {**variables, expr.var: (block, Poly.sym(var), degree, glob)}
            return nf.sum_over(var, extent, self.low.inside(("sum", var, extent), self.value, expr.body, inner_s,
                                                            inner))
        if isinstance(expr, ast.Max):
            if self.degrees.get(expr.var, ONE) != ONE:
                raise Unprovable(f"{self.instance.name}: a max over a sharded range (the spread analysis refuses it)")
            bound = self.index(expr.bound, variables)
            var = self.low.fresh(bound, "m")
            inner = {**variables, expr.var: (ZERO, Poly.sym(var), ONE, Poly.sym(var))}
            return nf.max_over(var, bound, self.low.inside(("sum", var, bound), self.value, expr.body, s, inner))
        raise Unprovable(f"cannot lower {type(expr).__name__}")

    def access(self, expr: ast.Access, s: Poly, variables) -> tuple:
        arg = self.args[expr.tensor]
        blocks, local = [], []
        for position, index in enumerate(expr.indices):
            degree = self.low.P(arg.spread.shard[position])
            if isinstance(index, ast.Name) and index.id in variables:
                block, loc, var_degree, glob = variables[index.id]
                if degree != ONE:
                    if var_degree != degree:
                        raise Unprovable(f"{self.instance.name}: '{expr.tensor}' read across blocks")
                    blocks.append(block)
                    local.append(loc)
                    continue
                blocks.append(ZERO)
                local.append(glob)
                continue
            glob = self.index(index, variables)
            if degree != ONE:
                # A block read (unflatten's j * k + r, flatten's j / n): the
                # spread analysis accepted it, so the global index falls in
                # one block; which one is the quotient by the block extent.
                extent = self.low.P(arg.shape[position]).floordiv(degree)
                block, loc = self.low.divmod(glob, extent)
                blocks.append(block)
                local.append(loc)
                continue
            blocks.append(ZERO)
            local.append(glob)
        partial = self.low.P(arg.spread.sum) != ONE
        return self.low.piece(arg, tuple(blocks), s if partial else ZERO, tuple(local))


# ------------------------------------------------------------------ z3


_UNDEFINED_WHERE = {"?zero": lambda v: v == 0, "?nonpos": lambda v: v <= 0, "?neg": lambda v: v < 0}


class Solving:
    """One rule's z3 work: a context of its own and the work budget of each query (`limits`).

    z3's count for a query depends on the terms its context already holds (the
    same query used 16k units first in a process, 26k after 30 other rules),
    so each rule gets a fresh context: its counts, and so its verdict, are then
    a function of the rule and the budget alone, whichever worker runs it.
    `most` is the largest count one query used, for the benchmark that sets the
    default (benchmarks/verify_rlimit.py)."""

    def __init__(self, rlimit: int = DEFAULT_RLIMIT):
        self.rlimit = rlimit
        self.ctx = z3.Context()
        self.most = 0
        self.last = 0      # the units the last query used
        self._count = 0

    def solver(self, deadline: float) -> z3.Solver:
        """A solver bounded by the budget; the wall clock's remaining time is only its safety valve."""
        solver = z3.Solver(ctx=self.ctx)
        solver.set("rlimit", self.rlimit)
        solver.set("timeout", max(1, min(2 ** 32 - 2, int((deadline - time.monotonic()) * 1000))))
        return solver

    def check(self, solver: z3.Solver, deadline: float, stage: str):
        """`solver.check()`: sat, unsat, or unknown when the budget ran out (`out_of_budget`) or z3 gave up;
        OutOfTime when the wall clock cut it (before or during the query)."""
        check_deadline(deadline, stage)
        result = solver.check()
        stats = solver.statistics()
        if "rlimit count" in stats.keys():  # the context's running count: this query's is the difference
            count = int(stats.get_key_value("rlimit count"))
            self.last, self._count = count - self._count, count
            self.most = max(self.most, self.last)
        if result == z3.unknown and not self.out_of_budget(solver) and time.monotonic() >= deadline:
            raise OutOfTime(stage)
        return result

    def out_of_budget(self, solver: z3.Solver) -> bool:
        """Whether the last query's unknown is the budget's: z3 says "max. resource limit exceeded", or
        "canceled" with the count at the budget (a tactic stopped by the limit says only that)."""
        reason = solver.reason_unknown()
        return "resource limit" in reason or (reason == "canceled" and self.last >= self.rlimit)


class _Z3:
    """Terms in one rule's context (`Solving`), built once per name."""

    def __init__(self, solving: Solving):
        self.solving = solving
        self.ctx = ctx = solving.ctx
        self.ints: dict[str, z3.ArithRef] = {}
        self.funcs: dict = {}
        self.applied: list[tuple] = []  # (function name, argument, application) of the uninterpreted functions
        ints, reals = z3.IntSort(ctx), z3.RealSort(ctx)
        self.sum = z3.Function("SUM", ints, z3.ArraySort(ints, reals), reals)
        # Uninterpreted: a proof may use only that equal bounds and equal bodies give equal maxima.
        self.max = z3.Function("MAX", ints, z3.ArraySort(ints, reals), reals)

    def int(self, name: str):
        if name not in self.ints:
            self.ints[name] = z3.Int(name, self.ctx)
        return self.ints[name]

    def real(self, value) -> z3.ArithRef:
        return z3.RealVal(value, self.ctx)

    def poly(self, p: Poly):
        total = z3.IntVal(0, self.ctx)
        for mono, coeff in p.terms:
            term = z3.IntVal(coeff, self.ctx)
            for atom, exp in mono:
                if isinstance(atom, str):
                    base = self.int(atom)
                else:
                    num, den = self.poly(atom[1]), self.poly(atom[2])
                    base = num / den if atom[0] == "//" else num % den
                for _ in range(exp):
                    term = term * base
            total = total + term
        return total

    def rel(self, op: str, a, b):
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b, "!=": a != b}[op]

    def cond(self, c):
        if isinstance(c, tuple):
            if c[0] == "rel":
                return self.rel(c[1], self.poly(c[2]), self.poly(c[3]))
            if c[0] == "not":
                return z3.Not(self.cond(c[1]))
            parts = (self.cond(c[1]), self.cond(c[2]))
            return z3.And(*parts) if c[0] == "and" else z3.Or(*parts)
        if isinstance(c, Rel):
            return self.rel(c.op, self.poly(c.left), self.poly(c.right))
        if isinstance(c, Junction):
            parts = [self.cond(p) for p in c.parts]
            return z3.And(*parts) if c.op == "and" else z3.Or(*parts)
        return z3.Not(self.cond(c.part))

    def tensor(self, name: str, rank: int):
        key = (name, rank)
        if key not in self.funcs:
            if rank == 0:
                self.funcs[key] = z3.Real(f"{name}[]", self.ctx)
            else:
                self.funcs[key] = z3.Function(name, *([z3.IntSort(self.ctx)] * rank), z3.RealSort(self.ctx))
        return self.funcs[key]

    def fn(self, name: str):
        key = ("fn", name)
        if key not in self.funcs:
            self.funcs[key] = z3.Function(f"fn_{name}", z3.RealSort(self.ctx), z3.RealSort(self.ctx))
        return self.funcs[key]

    def value(self, form: tuple):
        total = self.real(0)
        for coef, binders, factors in form:
            coef = Fraction(coef)
            body = self.real(coef.numerator) / self.real(coef.denominator) if coef.denominator != 1 \
                else self.real(coef.numerator)
            for f in factors:
                body = body * self.factor(f)
            for var, bound in reversed(binders):
                v, b = self.int(var), self.poly(bound)
                body = self.sum(b, z3.Lambda([v], z3.If(z3.And(v >= 0, v < b), body, self.real(0))))
            total = total + body
        return total

    def factor(self, f):
        kind = f[0]
        if kind == "in":
            func = self.tensor(f[1], len(f[2]))
            return func if not f[2] else func(*[self.poly(p) for p in f[2]])
        if kind == "size":
            return z3.ToReal(self.poly(f[1]))
        if kind == "real":
            return z3.Real(f[1], self.ctx)
        if kind == "recip":
            return 1 / self.value(f[1])
        if kind == "ind":
            test = self.cond(f[1])
            return z3.If(test if f[2] else z3.Not(test), self.real(1), self.real(0))
        if kind == "max":
            body = self.value(f[2])
            for var, bound in reversed(f[1]):
                v, b = self.int(var), self.poly(bound)
                body = self.max(b, z3.Lambda([v], z3.If(z3.And(v >= 0, v < b), body, self.real(0))))
            return body
        args = [self.value(a) for a in f[2]]
        if f[1] in _UNDEFINED_WHERE:  # 1 where the partial operation is out of its domain, else 0
            return z3.If(_UNDEFINED_WHERE[f[1]](args[0]), self.real(1), self.real(0))
        if f[1] == "max":
            return z3.If(args[0] >= args[1], args[0], args[1])
        if f[1] == "min":
            return z3.If(args[0] <= args[1], args[0], args[1])
        if f[1] == "abs":
            return z3.If(args[0] >= 0, args[0], -args[0])
        if f[1] == "step":
            return z3.If(args[0] > 0, self.real(1), self.real(0))
        applied = self.fn(f[1])(*args)
        self.applied.append((f[1], args[0], applied))
        return applied

    def lemmas(self) -> list:
        """What is true of the functions z3 otherwise knows nothing about, at every application met: an
        exponential is positive, a square root is not negative and squares back where it is defined."""
        found = []
        for name, arg, value in self.applied:
            if name == "exp":
                found.append(value > 0)
            elif name == "sqrt":
                found += [value >= 0, z3.Implies(arg >= 0, value * value == arg)]
        return found


# ----------------------------------------------------------------- proof


def _fmt_poly(p: Poly) -> str:
    text = str(p)
    return f"({text})" if " " in text else text


def describe_condition(c: Cond) -> str:
    """A condition as a person reads it (`p divides m` for a block divisibility)."""
    return _fmt_cond(c)


def _fmt_cond(c: Cond) -> str:
    """`p divides m` for block divisibility, the condition's own text otherwise."""
    if isinstance(c, Rel) and c.op == "==" and c.right == ZERO and len(c.left.terms) == 1:
        mono, coeff = c.left.terms[0]
        if coeff == 1 and len(mono) == 1 and not isinstance(mono[0][0], str) and mono[0][0][0] == "%":
            return f"{_fmt_poly(mono[0][0][2])} divides {_fmt_poly(mono[0][0][1])}"
    return str(c)


def _assumptions(instance: RuleInstance) -> tuple[str, ...]:
    kinds = {"dim": "sizes", "degree": "degrees", "int": "integers"}
    found = [f"{', '.join(sorted(n for n, k in instance.symbols.items() if k == kind))} "
             f"{'>= 1' if kind != 'int' else '>= 0'}" for kind in kinds if kind in instance.symbols.values()]
    for cond in instance.where + instance.lhs_requires:
        if symbolic_truth(cond) is True:
            continue
        text = _fmt_cond(cond)
        if text not in found:
            found.append(text)
    return tuple(found)


def _facts(instance: RuleInstance, solving: Solving) -> tuple[_Sizes, _Lowering, _Z3, list]:
    """The solved sizes, a lowering over them, and the z3 facts every query assumes."""
    sizes = solve_sizes(instance)
    low = _Lowering(sizes)
    zz = _Z3(solving)
    facts = []
    for name, kind in sizes.kinds.items():
        if name in sizes.subst:
            continue
        facts.append(zz.int(name) >= (0 if kind == "int" else 1))
    for name, value in sizes.subst.items():  # the substituted sizes keep their kinds
        low_bound = 0 if instance.symbols.get(name) == "int" else 1
        facts.append(zz.poly(value) >= low_bound)
    facts.extend(zz.cond(c) for c in sizes.assumptions)
    return sizes, low, zz, facts


def never_applies(instance: RuleInstance, timeout: float, solving: Solving | None = None) -> bool:
    """z3 shows the `where` and the left side's requirements contradictory (a proof would be empty)."""
    _sizes, _low, zz, facts = _facts(instance, solving or Solving())
    return _vacuous(zz, facts, time.monotonic() + timeout)


def forced_to_one(instance: RuleInstance, degree: str, timeout: float, solving: Solving | None = None) -> bool:
    """z3 shows that the rule's assumptions allow `degree` only at 1 (the rule parallelizes nothing).

    Asked twice: on the assumptions as written (z3 settles `h % p == 0, (h - 1) % p == 0` at once) and
    after the divisibility substitutions (which settle others). A query that runs out of its budget shows
    nothing (False).
    """
    solving = solving or Solving()
    deadline = time.monotonic() + timeout
    zz = _Z3(solving)
    raw = [zz.int(n) >= (0 if k == "int" else 1) for n, k in instance.symbols.items()]
    raw += [zz.cond(c) for c in instance.where + instance.lhs_requires]
    sizes, low, zs, facts = _facts(instance, solving)
    for z, given, value in ((zz, raw, Poly.sym(degree)), (zs, facts, low.P(Poly.sym(degree)))):
        solver = solving.solver(deadline)
        solver.add(*given)
        solver.add(z.poly(value) >= 2)
        if solving.check(solver, deadline, "the vacuity check (z3)") == z3.unsat:
            return True
    return False


def prove_instance(instance: RuleInstance, timeout: float, solving: Solving | None = None) -> ProofResult:
    """Prove one rank assignment; z3 models come back as candidates ("never": it never applies).

    Each query is bounded by `solving`'s budget (a fresh context and the default budget when None);
    OutOfTime when the wall clock passes `timeout` seconds."""
    deadline = time.monotonic() + timeout
    sizes, low, zz, facts = _facts(instance, solving or Solving())
    assumptions = _assumptions(instance)
    lhs, rhs = instance.lhs, instance.rhs

    if _vacuous(zz, facts, deadline):
        return ProofResult("never", "the rule never applies: its 'where' and the left-hand side's requirements "
                                    "cannot hold together", {}, assumptions)
    if len(lhs.shape) != len(rhs.shape):
        return ProofResult("candidate", "the sides have different ranks", {}, assumptions)
    for what, goal in _shape_goals(instance, low, zz):
        verdict = _check(zz, facts, goal, deadline)
        if verdict[0] != "proved":
            return _finish(verdict, what, instance, sizes, assumptions)

    left, right, ranges = lowered_sides(instance, low)
    for name, bound in ranges.items():
        facts += [zz.int(name) >= 0, zz.int(name) < zz.poly(bound)]
    undefined_left, undefined_right = low.undefined_forms
    for case, l2, r2 in _cases(undefined_left, undefined_right):
        extra = [zz.cond(c) if t else z3.Not(zz.cond(c)) for c, t in case]
        verdict = _defined_where_left_is(zz, facts + extra, l2, r2, deadline)
        if verdict[0] != "proved":
            return _finish(verdict, "the right-hand side is defined wherever the left-hand side is (no division by "
                                    "zero, log or square root out of its domain that the left side does not have)",
                           instance, sizes, assumptions, zz)
    facts = facts + [zz.value((m,)) == 0 for m in undefined_left]  # values must agree where the left is defined
    for case, l2, r2 in _cases(left, right):
        if l2 == r2:
            continue
        extra = [zz.cond(c) if t else z3.Not(zz.cond(c)) for c, t in case]
        verdict = _check(zz, facts + extra, zz.value(l2) == zz.value(r2), deadline)
        if verdict[0] != "proved":
            return _finish(verdict, "the two sides compute the same values", instance, sizes, assumptions, zz)
    return ProofResult("proved", "", {}, assumptions)


def _shape_goals(instance: RuleInstance, low: _Lowering, zz: _Z3) -> list[tuple[str, object]]:
    """What must hold besides the values: equal dims and spreads, the right side's requirements, legal
    spreads (windows that tile blocks, on both sides)."""
    lhs, rhs = instance.lhs, instance.rhs
    goals: list[tuple[str, object]] = []
    for k, (a, b) in enumerate(zip(lhs.shape, rhs.shape)):
        a, b = low.P(a), low.P(b)
        if a != b:
            goals.append((f"dim {k} of the two sides is equal ({a} vs {b})", zz.poly(a) == zz.poly(b)))
    for what, (a, b) in [(f"shard degree of dim {k}", pair) for k, pair in
                         enumerate(zip(lhs.spread.shard, rhs.spread.shard))] + \
            [("copy degree", (lhs.spread.copy, rhs.spread.copy)), ("sum degree", (lhs.spread.sum, rhs.spread.sum))]:
        a, b = low.P(a), low.P(b)
        if a != b:
            goals.append((f"the {what} of the two sides is equal ({a} vs {b})", zz.poly(a) == zz.poly(b)))
    for req in instance.rhs_requires:
        req2 = _apply_cond(req, low.P)
        if symbolic_truth(req2) is not True:
            goals.append((f"the right-hand side is defined: {req.reason or req}", zz.cond(req2)))
    for cond, _node in instance.legal_when:
        cond2 = _apply_cond(cond, low.P)
        if symbolic_truth(cond2) is not True:
            goals.append((f"the spreads are legal: {cond.reason or cond}", zz.cond(cond2)))
    return goals


def _cases(left: tuple, right: tuple) -> list[tuple[tuple, tuple, tuple]]:
    """(case, left, right) for every truth assignment of the conditions that mention no binder (at most
    `MAX_CASE_SPLITS` of them), each side normalized under it: a concat's `if` then falls on one side."""
    if left == right:
        return [((), left, right)]
    conditions = nf.free_conditions(left) + [c for c in nf.free_conditions(right) if c not in nf.free_conditions(left)]
    if not conditions or len(conditions) > MAX_CASE_SPLITS:
        return [((), left, right)]
    cases = []
    for truths in itertools.product((True, False), repeat=len(conditions)):
        l2, r2 = left, right
        for cond, truth in zip(conditions, truths):
            l2, r2 = nf.assume(l2, cond, truth), nf.assume(r2, cond, truth)
        cases.append((tuple(zip(conditions, truths)), _normalize(l2), _normalize(r2)))
    return cases


def lowered_sides(instance: RuleInstance, low: _Lowering) -> tuple[tuple, tuple, dict[str, Poly]]:
    """Both sides' normal forms at a free block `@b<k>` and local index `@i<k>` of the left side's spread,
    after the lemmas; and the ranges of those free variables (`verifier.crosscheck` evaluates the same)."""
    free, ranges = [], {}
    for k, (dim, degree) in enumerate(zip(instance.lhs.shape, instance.lhs.spread.shard)):
        dim, degree = low.P(dim), low.P(degree)
        extent = dim.floordiv(degree)
        block = ZERO
        if degree != ONE:
            block = Poly.sym(f"@b{k}")
            low.bounds[f"@b{k}"] = ranges[f"@b{k}"] = degree
        local = Poly.sym(f"@i{k}")
        low.bounds[f"@i{k}"] = ranges[f"@i{k}"] = extent
        free.append((block, local))
    free = tuple(free)
    sides, undefined = [], []
    for term in (instance.lhs, instance.rhs):
        low.partials = []
        sides.append(_normalize(low.observe(term, free)))
        undefined.append(_normalize(low.undefined(low.partials)))
    low.undefined_forms = tuple(undefined)
    return sides[0], sides[1], ranges


def _normalize(form: tuple) -> tuple:
    """Lemmas to a fixpoint: concat boundaries, block re-indexing, canonical names."""
    form = nf.canonical(form)
    for _ in range(4):
        again = nf.canonical(nf.merge_blocks(nf.split_boundaries(form)))
        if again == form:
            break
        form = again
    return form


def _defined_where_left_is(zz: _Z3, facts, left: tuple, right: tuple, deadline: float) -> tuple:
    """("proved", None) when the right side is defined wherever the left is, else what `_check` says.

    `left` and `right` count the partial operations out of their domain (`_Lowering.undefined`): a sum of
    monomials that are each never negative, so the left side is defined exactly where each of its monomials
    is 0. A monomial of the right that the left has too is 0 there; the others must follow from those facts.
    """
    residual = tuple(m for m in right if not any(m[1:] == n[1:] for n in left))
    if not residual:
        return ("proved", None)
    known = [zz.value((m,)) == 0 for m in left]
    return _check(zz, facts + known, z3.And(*[zz.value((m,)) == 0 for m in residual]), deadline)


def _vacuous(zz: _Z3, facts, deadline: float) -> bool:
    """True only when z3 shows the assumptions contradictory (a proof would be empty)."""
    solver = zz.solving.solver(deadline)
    solver.add(*facts)
    return zz.solving.check(solver, deadline, "the vacuity check (z3)") == z3.unsat


def _small_model(zz: _Z3, facts, goal, model, deadline: float):
    """A model with small sizes (descending bounds on their sum), so its replay is cheap and readable.

    z3.Optimize would refuse the lambdas of summations, so the solver is
    asked again with `sum(sizes) <= bound` for shrinking bounds, at most 8
    times, each query within the budget (one that runs out ends the descent).
    """
    sizes = [v for name, v in zz.ints.items() if not name.startswith(("@", "$", "~"))]
    if not sizes:
        return model
    total = z3.Sum(sizes)
    solver = zz.solving.solver(deadline)
    solver.add(*facts, *zz.lemmas())
    solver.add(z3.Not(goal))
    best = model
    for _ in range(8):
        current = best.eval(total, model_completion=True).as_long()
        for bound in (current // 2, current - 1):
            solver.push()
            solver.add(total <= bound)
            found = zz.solving.check(solver, deadline, "the search for a small model (z3)") == z3.sat
            if found:
                best = solver.model()
            solver.pop()
            if found:
                break
        else:
            break
    return best


def _check(zz: _Z3, facts, goal, deadline: float) -> tuple:
    """("proved", None), ("sat", a small model), ("budget", None) or ("unknown", z3's reason)."""
    solver = zz.solving.solver(deadline)
    solver.add(*facts, *zz.lemmas())
    solver.add(z3.Not(goal))
    result = zz.solving.check(solver, deadline, "the proof (z3)")
    if result == z3.unsat:
        return ("proved", None)
    if result == z3.sat:
        return ("sat", _small_model(zz, facts, goal, solver.model(), deadline))
    if zz.solving.out_of_budget(solver):
        return ("budget", zz.solving.rlimit)
    return ("unknown", solver.reason_unknown())


def _finish(verdict: tuple, what: str, instance: RuleInstance, sizes: _Sizes, assumptions,
            zz: _Z3 | None = None) -> ProofResult:
    status, payload = verdict
    if status == "proved":
        return ProofResult("proved", "", {}, assumptions)
    if status == "sat":
        model = _model_sizes(payload, instance, sizes)
        inputs, reals = _model_values(payload, instance, model, zz) if zz is not None else ({}, {})
        return ProofResult("candidate", f"z3 cannot show that {what}", model, assumptions, inputs, reals)
    if status == "budget":
        return ProofResult("unknown", budget_reason(payload, what), {}, assumptions)
    return ProofResult("unknown", f"z3 gave up proving that {what} ({payload})", {}, assumptions)


def _model_sizes(model, instance: RuleInstance, sizes: _Sizes) -> dict:
    values = {}
    for name, kind in sizes.kinds.items():
        decl = z3.Int(name, model.ctx)
        value = model.eval(decl, model_completion=True)
        try:
            values[name] = max(int(value.as_long()), 0 if kind == "int" else 1)
        except (AttributeError, z3.Z3Exception):
            values[name] = 1
    out = {}
    for name in instance.symbols:
        poly = sizes.subst.get(name)
        try:
            out[name] = poly.evaluate(values) if poly is not None else values.get(name, 1)
        except (KeyError, ZeroDivisionError):
            out[name] = values.get(name, 1)
    return out


MODEL_ELEMENTS = 100_000  # a model's input values are read for tensors up to this many elements (all of them)


def _rational(value) -> Fraction:
    """A z3 number as a Fraction (an irrational algebraic number: a close rational, which may not replay)."""
    if z3.is_rational_value(value):
        return Fraction(value.numerator_as_long(), value.denominator_as_long())
    if z3.is_algebraic_value(value):
        return Fraction(value.approx(20).as_fraction())
    return Fraction(0)


def _model_values(model, instance: RuleInstance, sizes: dict, zz: _Z3) -> tuple[dict, dict]:
    """The inputs and real metavariables of a z3 model at its sizes (nested lists of Fractions), for the
    devices to replay: a counterexample z3 finds at x = 1/2 or x = 4 is replayed there, not at random
    inputs. Tensors the query never read, or too large to list, are left out (the replay draws them)."""
    inputs = {}
    for name, shape in instance.tensors.items():
        func = zz.funcs.get((name, len(shape)))
        dims = [d.evaluate(sizes) for d in shape]
        if func is None or math.prod(dims) > MODEL_ELEMENTS:
            continue
        if not shape:
            inputs[name] = _rational(model.eval(func, model_completion=True))
            continue
        table = {}
        interp = model[func] if func in model.decls() else None
        default = _rational(interp.else_value()) if interp is not None else Fraction(0)
        if interp is not None:
            for k in range(interp.num_entries()):
                entry = interp.entry(k)
                key = tuple(entry.arg_value(j).as_long() for j in range(len(shape)))
                table[key] = _rational(entry.value())
        values = [table.get(index, default) for index in itertools.product(*(range(n) for n in dims))]
        inputs[name] = _nested(values, dims)
    reals = {name: _rational(model.eval(z3.Real(name, model.ctx), model_completion=True)) for name in instance.reals}
    return inputs, reals


def _nested(flat: list, dims: list[int]):
    if not dims:
        return flat[0]
    step = math.prod(dims[1:]) if len(dims) > 1 else 1
    return [_nested(flat[k * step:(k + 1) * step], dims[1:]) for k in range(dims[0])]
