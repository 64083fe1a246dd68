"""`.rule` library + graph -> an egglog text program; the e-graph read back.

This is the only module that imports egglog. It uses the low-level
`egglog.bindings.EGraph` with generated text (NOTES.md: fast, and the
e-graph is read back with `freeze()`; extraction is ours, in extract.py).

Encoding
--------
* One sort `T` of tensors. A leaf is `(Leaf "name")`; operator `op` is the
  constructor `Op_op` with the operator's parameters in declaration order
  (tensors `T`, integer attributes `i64`, real attributes `String`); the
  parallel operators are `P_partition x dim n`, `P_combine x dim n`,
  `P_replicate x n`, `P_reduce x n`.
* Analysis tables, one row per e-class: `Rank`, `Dim c i`, `Shard c i`,
  `Copy`, `Psum`, `Pieces`. An e-class is a logical value *with* a spread
  (the checker proves both sides of a rule have the same shape and spread),
  so these are well defined. The graph's rows are written by the program's
  `let`s; every rule action writes the rows of the terms it builds, from the
  shapes and spreads `dsl.typecheck` gave its right side.
* A rule is typed with whole (unsharded) metavariables, so it fires only on
  matches whose metavariables are whole; its right side's spreads are then
  exactly the typed ones. The ruleset `shape` derives, for every whole
  e-class, `Whole c = (S<rank> dim...)` from the rows above, and a rule
  binds a metavariable's dims with that one lookup (two atoms over small
  tables instead of `Pieces`, `Rank` and one `Dim` per dim over the big
  ones: egglog builds indexes per rule and per iteration, so the atoms a
  query has and the size of their tables are what saturation costs).
  Rank-polymorphic rules are instantiated at every group length the
  graph's ranks allow, and only where their left side can match an
  operator application the graph or a rule makes (`Signature`). `where`
  conditions and definedness requirements become `:when` facts.
* A degree free on the right (a rule that introduces parallelism) is bound
  at run time by the relation `Degree`, which holds the divisors >= 2 of the
  device count (one egglog rule per instance). Every term a rule
  builds must have at most `devices` pieces, dividing `devices`: the device
  budget. Because parallel terms are never whole, a rule never nests on its
  own output, so saturation of the parallel rules terminates.
* Placement: a rule is proved for values and spreads, but two terms with
  one spread can put their pieces on different devices
  (`replicate(partition(x, 0, p), q)` shards on the first mesh atom,
  `partition(replicate(x, q), 0, p)` on the second), and a compute operator
  whose inputs do not line up cannot run (`dsl.placement`). Each rule
  instance applies only at the degrees where its right side lays out as its
  left side does (`layout_guard`, a relation of the allowed degrees). The
  graph's terms lay out, and metavariables are whole, so every e-class then
  has one layout and every plan extracted from the e-graph can run.
"""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

from egglog import bindings

from parsat.dsl import ast
from parsat.dsl.conditions import Cond, Junction, Negation, Rel, symbolic_truth, to_poly
from parsat.dsl.library import Library
from parsat.dsl.placement import PlacementError, term_layout
from parsat.dsl.symbolic import Poly
from parsat.dsl.typecheck import RuleInstance, TypeCheckError, TypedTerm, group_assignments, type_rule
from parsat.saturate.graph import Graph
from parsat.saturate.pcg import PARALLEL, Layout

ANALYSES = ("Rank", "Dim", "Shard", "Copy", "Psum", "Pieces")
MAX_RANK = 8             # tensors a rule's metavariable can match have at most this rank
SHAPE_RULESET = "shape"  # derives `Whole` from the analysis rows; runs before every other ruleset
RULESETS = ("alg", "par")
CHUNK_RULES = 256        # egglog rules per chunk (see `RuleProgram.chunks`)
DEADLINE_NOTE = "compilation stopped by the seconds limit"
MADE_PREFIX = "Made_"    # Made_<constructor>(children..., attributes..., who): the rules (or the graph) that made an e-node
GRAPH_MADE = ""          # `who` for the input graph's own operators


class CompileError(Exception):
    """The rules or the graph cannot be turned into an egglog program."""


# ------------------------------------------------------------------ small helpers


def ctor(op: str) -> str:
    return f"P_{op}" if op in PARALLEL else f"Op_{op}"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def real_literal(value: float) -> str:
    """Real attributes are stored as their shortest repr, so equal reals are equal strings."""
    return _quote(repr(float(value)))


def made_row(constructor: str, args: Sequence[str], who: str) -> str:
    """The provenance row of the term `(constructor args...)`: `who` made it (a rule's name, or GRAPH_MADE).

    Rows are per e-node (constructor and canonical children), not per
    e-class, so after unions they still say which rule built each
    alternative; a plan's rules are the makers of the e-nodes it extracts.
    """
    return f"({MADE_PREFIX}{constructor} {' '.join(args)} {_quote(who)})"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _var(symbol: str) -> str:
    return "s_" + re.sub(r"[^A-Za-z0-9_]", "_", symbol)


def poly_expr(poly: Poly, names: Mapping[str, str]) -> str:
    """A `Poly` as an egglog i64 expression over the bound variables `names`."""

    def atom(a) -> str:
        if isinstance(a, str):
            if a not in names:
                raise KeyError(a)
            return names[a]
        op = "/" if a[0] == "//" else "%"
        return f"({op} {poly_expr(a[1], names)} {poly_expr(a[2], names)})"

    terms = []
    for mono, coeff in poly.terms:
        factors = [atom(a) for a, e in mono for _ in range(e)]
        if coeff != 1 or not factors:
            factors.insert(0, str(coeff))
        terms.append(_nest("*", factors))
    return _nest("+", terms) if terms else "0"


def _nest(op: str, items: list[str]) -> str:
    """egglog's i64 `+` and `*` are binary."""
    out = items[0]
    for item in items[1:]:
        out = f"({op} {out} {item})"
    return out


_NEGATE = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


def _dnf(cond: Cond, negate: bool = False) -> list[list[Rel]]:
    """A condition as a disjunction of conjunctions of relations."""
    if isinstance(cond, Rel):
        return [[Rel(_NEGATE[cond.op], cond.left, cond.right) if negate else cond]]
    if isinstance(cond, Negation):
        return _dnf(cond.part, not negate)
    parts = [_dnf(p, negate) for p in cond.parts]
    conj = (cond.op == "and") != negate
    if conj:
        out: list[list[Rel]] = [[]]
        for alternatives in parts:
            out = [a + b for a in out for b in alternatives]
        return out
    return [alt for alternatives in parts for alt in alternatives]


def rel_fact(rel: Rel, names: Mapping[str, str]) -> str:
    left, right = poly_expr(rel.left, names), poly_expr(rel.right, names)
    if rel.op == "==":
        return f"(= {left} {right})"
    return f"({rel.op} {left} {right})"


# ---------------------------------------------------------------- compiled rules


_PATTERN_VAR = re.compile(r"(?<![\w\"])([A-Za-z_]\w*)")


@dataclass(frozen=True)
class RuleBody:
    """One egglog rule before it is placed: the structural pattern, the other facts, the actions.

    It is written as two egglog rules (`text`). The first matches the pattern
    alone and records each match in a relation of its own; the second joins
    that relation with the analysis lookups and guards, then applies the
    actions. egglog plans a query's join by table size, and the shape table
    has a handful of rows, so one rule with several metavariables' `Whole`
    lookups started from the shapes and enumerated their cross product:
    `add_partial_matmuls` took ~50 s per iteration on 2,100 operators with
    no match at all. Matching the pattern first bounds the join by the
    matches. Both rules run in the same iteration (`Session.run`), on the
    same e-graph (the first adds only relation rows), so the semantics are
    one rule's.
    """

    pattern: str               # "(= root (...))"
    facts: tuple[str, ...]     # analysis lookups, degree choices, guards
    actions: str
    placements: tuple[tuple[str, ...], tuple[tuple[int, ...], ...]] | None = None   # (degree variables, the
    #                            degrees at which both sides lay out alike); None: every degree

    def variables(self) -> list[tuple[str, str]]:
        """The pattern's variables and their sorts, in order: tensors (root, m_*), reals (r_*), integers."""
        out: dict[str, str] = {}
        for name in _PATTERN_VAR.findall(self.pattern):
            if name.startswith(("Op_", "P_")) or name in out:
                continue
            out[name] = "T" if name == "root" or name.startswith("m_") else "String" if name.startswith("r_") else "i64"
        return list(out.items())

    def text(self, index: int, chunk: str, key: str) -> str:
        """The relation and the two rules; the second carries the rule's `key` as its name."""
        variables = self.variables()
        relation = f"Match{index}"
        row = f"({relation} {' '.join(v for v, _ in variables)})"
        facts = self.facts
        allowed = ""
        if self.placements is not None:
            names, tuples = self.placements
            placed = f"Placed{index}"
            allowed = (f"(relation {placed} ({' '.join('i64' for _ in names)}))\n"
                       + "".join(f"({placed} {' '.join(map(str, t))})\n" for t in tuples))
            facts = facts + (f"({placed} {' '.join(names)})",)
        return (f"(relation {relation} ({' '.join(sort for _, sort in variables)}))\n" + allowed +
                f"(rule ({self.pattern}) ({row}) :ruleset {match_ruleset(chunk)} :name {_quote(key + '/match')})\n"
                f"(rule ({' '.join((row,) + facts)})\n      ({self.actions})\n"
                f"      :ruleset {chunk} :name {_quote(key)})")


def match_ruleset(ruleset: str) -> str:
    """The ruleset of the pattern-matching halves of `ruleset`'s rules (see `RuleBody`)."""
    return ruleset + "_match"


@dataclass(frozen=True)
class CompiledRule:
    """One egglog rule: a rule of the library at one rank assignment and free degree."""

    name: str         # the library rule's name
    variant: str      # e.g. "a=0,b=1 p=2"
    ruleset: str      # "alg" or "par"
    body: RuleBody = field(repr=False)
    key: str = ""     # the egglog rule's :name, unique in the program
    chunk: str = ""   # the egglog ruleset that holds it: one chunk of `ruleset` (RuleProgram.chunks)
    text: str = ""    # the egglog text, once placed in a chunk (compile_rules)


@dataclass(frozen=True)
class SkippedRule:
    name: str
    reason: str


@dataclass
class _Builder:
    """Writes the query and actions of one rule instance."""

    instance: RuleInstance
    devices: int
    deferred: list[tuple[str, str, Poly]] = field(default_factory=list)  # (kind, variable, value it must equal)
    names: dict[str, str] = field(default_factory=dict)   # size symbol -> egglog variable
    counter: itertools.count = field(default_factory=itertools.count)

    def fresh(self, stem: str) -> str:
        return f"{stem}{next(self.counter)}"

    def int_arg(self, poly: Poly) -> str:
        """An integer position of a left-side constructor: literal, binder, or checked expression."""
        if poly.is_const:
            return str(poly.constant)
        symbol = _single_symbol(poly)
        if symbol is not None and symbol not in self.names:
            self.names[symbol] = _var(symbol)
            return self.names[symbol]
        var = self.fresh("k")
        self.deferred.append(("eq", var, poly))
        return var

    def pattern(self, term: TypedTerm, metas: dict[str, str]) -> str:
        if term.kind == "input":
            var = "m_" + term.name
            metas[term.name] = var
            return var
        if term.kind == "parallel":
            inner = self.pattern(term.args[0], metas)
            args = [inner] + ([str(term.dim)] if term.dim is not None else []) + [self.int_arg(term.degree)]
            return f"({ctor(term.name)} {' '.join(args)})"
        return f"({ctor(term.name)} {' '.join(self.op_args(term, metas, lhs=True))})"

    def op_args(self, term: TypedTerm, bound: dict[str, str], lhs: bool) -> list[str]:
        op = term.instance.op
        tensors = iter(term.args)
        out = []
        env = {s: Poly.sym(s) for s in self.instance.symbols}
        for param, arg in zip(op.params, term.node.args):
            if param.is_tensor:
                sub = next(tensors)
                out.append(self.pattern(sub, bound) if lhs else bound[id(sub)])
            elif param.type.kind == "real":
                if isinstance(arg, ast.Name):
                    out.append("r_" + arg.id)
                else:
                    value = arg.value if isinstance(arg, ast.Num) else -arg.operand.value
                    out.append(real_literal(value))
            else:
                poly = to_poly(arg, env, self.instance.groups)
                out.append(self.int_arg(poly) if lhs else self.rhs_int(poly))
        return out

    def rhs_int(self, poly: Poly) -> str:
        return poly_expr(poly, self.names)


def _typed_instances(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], ranks: set[int]) -> Iterable[RuleInstance]:
    """The rule typed at every group assignment whose metavariables all have one of `ranks` (typing is slow)."""
    top = max(ranks) if ranks else 0
    shapes = [b.type.dims for b in rule.binders if isinstance(b.type, ast.ShapeType)]
    for groups in group_assignments(rule, top):
        if any(sum(groups[d.id] if isinstance(d, ast.Variadic) else 1 for d in dims) not in ranks for dims in shapes):
            continue
        try:
            instance = type_rule(rule, ops, groups)
        except TypeCheckError:
            continue  # this rank assignment does not type
        if instance.problems or any(symbolic_truth(c) is False for c in instance.where):
            continue  # an illegal spread, or a `where` on lengths that fails here (a BOUNDED rule's rank limit)
        metas = [t for t in instance.lhs.walk() if t.kind == "input"]
        if all(len(t.shape) in ranks for t in metas):
            yield instance


def _free_degrees(instance: RuleInstance) -> list[str]:
    """Degrees a left-side match does not fix by itself: saturation enumerates them.

    A degree is bound when it stands alone as the degree of a left-side
    parallel operator; one that appears only on the right (a rule that
    introduces parallelism) or only inside an expression (`p * q`) is free.
    """
    bound = set()
    for term in instance.lhs.walk():
        if term.kind == "parallel" and term.degree is not None:
            symbol = _single_symbol(term.degree)
            if symbol is not None:
                bound.add(symbol)
        if term.kind == "op":
            for param, arg in zip(term.instance.op.params, term.node.args):
                if not param.is_tensor and isinstance(arg, ast.Name):
                    bound.add(arg.id)
    return [s for s, kind in instance.symbols.items() if kind == "degree" and s not in bound]


def compile_rule_instance(instance: RuleInstance, devices: int, parallel: bool,
                          placement: bool = True) -> tuple[list[CompiledRule], str]:
    """The egglog rules of one typed rule instance (several only when a guard is a disjunction).

    A degree the left side does not bind (a rule that introduces parallelism,
    or `p * q` on the left) is bound at run time by the `Degree` relation,
    which holds the divisors >= 2 of the device count: one egglog rule per
    instance, not one per choice of degrees (egglog's time per iteration grows
    with the number of rules, so this matters more than the extra join).
    With `placement`, the rule fires only at degrees that keep the device
    layout (`layout_guard`); without it, only values and spreads count (the
    rule generator's derivations ask what the rules imply, not what can run).
    """
    free = _free_degrees(instance)
    try:
        texts = _compile_one(instance, devices, free, placement)
    except _Skip as skip:
        return [], str(skip)
    note = ",".join(f"{g}={n}" for g, n in instance.groups.items())
    return [CompiledRule(instance.rule.name, note + (f" #{k}" if len(texts) > 1 else ""), "par" if parallel else "alg",
                         text) for k, text in enumerate(texts)], ""


class _Skip(Exception):
    pass


def _feasible(guards: Sequence[Cond], free: Sequence[str], devices: int) -> Cond | None:
    """None if some choice of the free degrees leaves every guard possible; else a guard that always fails."""
    failing: Cond | None = None
    for values in itertools.product([d for d in divisors(devices) if d >= 2], repeat=len(free)):
        env = {k: Poly.const(v) for k, v in zip(free, values)}
        blocked = next((c for c in guards if symbolic_truth(_subst_cond(c, env) if env else c) is False), None)
        if blocked is None:
            return None
        failing = failing or blocked
    return failing


def layout_guard(instance: RuleInstance, devices: int) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]] | None:
    """The degree symbols and the values (divisors >= 2 of `devices`) at which the right side lays out as the
    left side does (`dsl.placement.term_layout`, metavariables whole); None when that holds wherever the left
    side lays out (a left side that cannot be laid out is never in the e-graph). Raises `_Skip` when it holds
    nowhere."""
    if not any(t.kind == "parallel" for side in (instance.lhs, instance.rhs) for t in side.walk()):
        return None
    symbols = tuple(sorted(s for s, kind in instance.symbols.items() if kind == "degree"))
    considered, allowed = 0, []
    differ = ""
    for values in itertools.product([d for d in divisors(devices) if d >= 2], repeat=len(symbols)):
        degrees = dict(zip(symbols, values))
        try:
            left = term_layout(instance.lhs, devices, degrees)
        except (PlacementError, KeyError):
            continue
        considered += 1
        try:
            right = term_layout(instance.rhs, devices, degrees)
        except (PlacementError, KeyError) as err:
            differ = differ or f"at {_degree_text(degrees)} the right side cannot be laid out ({err})"
            continue
        if right == left:
            allowed.append(values)
        else:
            differ = differ or f"at {_degree_text(degrees)} its sides put their pieces on different devices"
    if len(allowed) == considered:
        return None
    if not allowed:
        raise _Skip(f"it changes where pieces live at every degree that fits {devices} devices ({differ})")
    return symbols, tuple(allowed)


def _degree_text(degrees: Mapping[str, int]) -> str:
    return ", ".join(f"{k} = {v}" for k, v in degrees.items()) or "its degrees"


def _compile_one(instance: RuleInstance, devices: int, free: Sequence[str], placement: bool = True) -> list[RuleBody]:
    """The rule's query and actions, one per alternative of its guards (`RuleBody.text` makes the egglog)."""
    placed = layout_guard(instance, devices) if placement else None
    b = _Builder(instance, devices)
    facts = []
    for symbol in free:
        b.names[symbol] = _var(symbol)
        facts.append(f"(Degree {b.names[symbol]})")
    metas: dict[str, str] = {}
    root = b.pattern(instance.lhs, metas)
    facts.insert(0, f"(= root {root})")
    for name, var in metas.items():
        shape = instance.tensors[name]
        if len(shape) > MAX_RANK:
            raise _Skip(f"metavariable '{name}' has rank {len(shape)} (at most {MAX_RANK} supported)")
        dims = []
        for dim in shape:
            symbol = _single_symbol(dim)
            if symbol is not None and symbol not in b.names:
                b.names[symbol] = _var(symbol)
                dims.append(b.names[symbol])
            else:
                d = b.fresh("d")
                dims.append(d)
                b.deferred.append(("eq", d, dim))
        facts.append(f"(= (Whole {var}) {_shape_term(dims)})")
    # Every size symbol the conditions or the right side use must be bound now.
    guards: list[Cond] = list(instance.where) + list(instance.lhs_requires) + list(instance.rhs_requires)
    rhs_terms = [t for t in instance.rhs.walk() if t.kind != "input"]
    for term in rhs_terms:
        pieces = term.spread.pieces
        guards.append(Rel("<=", pieces, Poly.const(devices)))
        guards.append(Rel("==", Poly.const(devices).mod(pieces), Poly.const(0)))
    blocked = _feasible(guards, free, devices)
    if blocked is not None:
        raise _Skip(f"condition {blocked} cannot hold with {devices} devices")
    concrete_guards = [cond for cond in guards if symbolic_truth(cond) is None]
    for kind, var, poly in b.deferred:
        facts.append(f"(= {var} {_expr(poly, b.names)})")
    alternatives = [[]]
    for cond in concrete_guards:
        options = _dnf(cond)
        alternatives = [a + o for a in alternatives for o in options]
    # Right side: one let per built term, then its analysis rows, then the union.
    actions: list[str] = []
    made: dict[int, str] = {}
    for term in _postorder(instance.rhs):
        if term.kind == "input":
            made[id(term)] = metas.get(term.name) or _raise(f"'{term.name}' is not bound by the left side")
            continue
        if term.kind == "parallel":
            args = [made[id(term.args[0])]] + ([str(term.dim)] if term.dim is not None else [])
            args.append(_expr(term.degree, b.names))
        else:
            args = b.op_args(term, made, lhs=False)
        var = b.fresh("t")
        made[id(term)] = var
        actions.append(f"(let {var} ({ctor(term.name)} {' '.join(args)}))")
        actions.append(made_row(ctor(term.name), args, instance.rule.name))
        actions.extend(_analysis_rows(var, term.shape, term.spread, b))
    actions.append(f"(union root {made[id(instance.rhs)]})")
    placements = None
    if placed is not None:
        symbols, allowed = placed
        placements = (tuple(b.names.get(s) or _raise(f"degree '{s}' is not bound") for s in symbols), allowed)
    texts = []
    for alt in alternatives:
        when = list(dict.fromkeys(facts[1:] + [rel_fact(r, b.names) if _bound(r, b.names) else _raise(f"unbound size in {r}")
                                               for r in alt]))
        texts.append(RuleBody(facts[0], tuple(when), " ".join(actions), placements))
    return texts


def _single_symbol(poly: Poly) -> str | None:
    """The symbol when `poly` is exactly one symbol (then a pattern can bind it)."""
    syms = poly.symbols()
    if len(syms) == 1:
        symbol = next(iter(syms))
        if poly == Poly.sym(symbol):
            return symbol
    return None


def _raise(message: str):
    raise _Skip(message)


def _bound(rel: Rel, names: Mapping[str, str]) -> bool:
    return (rel.left.symbols() | rel.right.symbols()) <= set(names)


def _expr(poly: Poly, names: Mapping[str, str]) -> str:
    try:
        return poly_expr(poly, names)
    except KeyError as err:
        raise _Skip(f"size '{err.args[0]}' is not bound by the left side") from None


def _subst_cond(cond: Cond, env: Mapping[str, Poly]) -> Cond:
    if isinstance(cond, Rel):
        return Rel(cond.op, cond.left.subst(env), cond.right.subst(env))
    if isinstance(cond, Junction):
        return Junction(cond.op, tuple(_subst_cond(p, env) for p in cond.parts))
    return Negation(_subst_cond(cond.part, env))


def _postorder(term: TypedTerm) -> list[TypedTerm]:
    out: list[TypedTerm] = []
    for arg in term.args:
        out.extend(_postorder(arg))
    out.append(term)
    return out


def _analysis_rows(var: str, shape: Sequence[Poly], spread, b: _Builder) -> list[str]:
    rows = [f"(set (Rank {var}) {len(shape)})"]
    for i, dim in enumerate(shape):
        rows.append(f"(set (Dim {var} {i}) {_expr(dim, b.names)})")
        rows.append(f"(set (Shard {var} {i}) {_expr(spread.shard[i], b.names)})")
    rows.append(f"(set (Copy {var}) {_expr(spread.copy, b.names)})")
    rows.append(f"(set (Psum {var}) {_expr(spread.sum, b.names)})")
    rows.append(f"(set (Pieces {var}) {_expr(spread.pieces, b.names)})")
    return rows


# ------------------------------------------------------------------- the program


@dataclass(frozen=True)
class RuleProgram:
    """The compiled rules: declarations, rules by ruleset, and what was left out and why."""

    declarations: str
    rules: tuple[CompiledRule, ...]
    skipped: tuple[SkippedRule, ...]
    unfinished: int = 0   # library rules not compiled because the deadline passed (skipped says which)

    def text(self) -> str:
        return self.declarations + "\n" + "\n".join(r.text for r in self.rules) + "\n"

    def count(self, ruleset: str) -> int:
        return sum(1 for r in self.rules if r.ruleset == ruleset)

    def chunks(self, ruleset: str) -> tuple[str, ...]:
        """The egglog rulesets `ruleset`'s rules are split into, in order (at least one, maybe empty).

        egglog cannot be interrupted inside a run, so a saturation with a
        time limit runs a large ruleset chunk by chunk and checks its limits
        in between. A ruleset of at most CHUNK_RULES rules is one chunk, so
        the usual programs keep egglog's semantics (every rule matches the
        same e-graph, then all apply); `ruleset` itself is egglog's combined
        ruleset of its chunks, which keeps them for callers that run it whole.
        """
        return tuple(dict.fromkeys(r.chunk for r in self.rules if r.ruleset == ruleset)) or (f"{ruleset}0",)


def declarations(ops: Mapping[str, ast.OpDecl], devices: int, free_degrees: Sequence[int] | None = None) -> str:
    """The sort of tensors, the analysis tables, and the degrees a rule may choose (`free_degrees`, by default
    the divisors >= 2 of `devices`)."""
    signatures = {ctor(op.name): ["T" if p.is_tensor else ("String" if p.type.kind == "real" else "i64")
                                  for p in op.params] for op in ops.values()}
    signatures.update({"P_partition": ["T", "i64", "i64"], "P_combine": ["T", "i64", "i64"],
                       "P_replicate": ["T", "i64"], "P_reduce": ["T", "i64"]})
    lines = ["(datatype T", "  (Leaf String)"]
    lines += [f"  ({name} {' '.join(sorts)})" for name, sorts in signatures.items()]
    lines[-1] += ")"
    lines += [f"(relation {MADE_PREFIX}{name} ({' '.join(sorts)} String))" for name, sorts in signatures.items()]
    for name in ANALYSES:
        key = "T i64" if name in ("Dim", "Shard") else "T"
        lines.append(f"(function {name} ({key}) i64 :merge (min old new))")
    lines.append("(datatype Shape " + " ".join(f"(S{r}{' i64' * r})" for r in range(MAX_RANK + 1)) + ")")
    lines.append("(function Whole (T) Shape :merge new)")
    lines.append("(relation Degree (i64))")
    chosen = free_degrees if free_degrees is not None else [d for d in divisors(devices) if d >= 2]
    lines += [f"(Degree {d})" for d in chosen]
    lines.append(f"(ruleset {SHAPE_RULESET})")
    for r in range(MAX_RANK + 1):
        dims = [f"d{i}" for i in range(r)]
        lookups = "".join(f" (= d{i} (Dim t {i}))" for i in range(r))
        lines.append(f"(rule ((= (Pieces t) 1) (= (Rank t) {r}){lookups}) ((set (Whole t) {_shape_term(dims)})) "
                     f":ruleset {SHAPE_RULESET})")
    return "\n".join(lines) + "\n"


def _shape_term(dims: Sequence[str]) -> str:
    return f"(S{len(dims)}{''.join(' ' + d for d in dims)})"


def _ruleset_declarations(program: RuleProgram) -> str:
    """Each chunk's ruleset, and "alg" / "par" as the combined ruleset of their chunks."""
    lines = []
    for ruleset in RULESETS:
        chunks = program.chunks(ruleset)
        for name in (lambda c: c, match_ruleset):
            lines += [f"(ruleset {name(chunk)})" for chunk in chunks]
            lines.append(f"(unstable-combined-ruleset {name(ruleset)} {' '.join(name(c) for c in chunks)})")
    return "\n".join(lines) + "\n"


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() >= deadline


def _ops_in(expr: ast.Expr) -> set[str]:
    return {n.func for n in ast.walk(expr) if isinstance(n, ast.Call) and n.func not in PARALLEL}


def reachable_rules(rules: Sequence[ast.RuleDecl], graph_ops: set[str]) -> list[ast.RuleDecl]:
    """Rules that can ever match: every operator on their left is in the graph or made by such a rule."""
    present = set(graph_ops)
    changed = True
    while changed:
        changed = False
        for rule in rules:
            if _ops_in(rule.lhs) <= present and not _ops_in(rule.rhs) <= present:
                present |= _ops_in(rule.rhs)
                changed = True
    return [r for r in rules if _ops_in(r.lhs) <= present]


Signature = tuple[str, tuple[int, ...], tuple]
"""An operator application as rules can match it: (operator, ranks of its tensor inputs, integer attributes).

A parallel operator's attribute is its dim (partition, combine); an
attribute a rule leaves symbolic (`unflatten(x, d, k)`) is None, which
matches any value.
"""


def _term_signature(term: TypedTerm) -> Signature:
    if term.kind == "parallel":
        return term.name, (len(term.shape),), (term.dim,) if term.dim is not None else ()
    instance = term.instance
    values = tuple(instance.attrs[p.name].constant if instance.attrs[p.name].is_const else None
                   for p in instance.op.attr_params if p.type.kind != "real")
    return term.name, tuple(len(s) for s in instance.input_shapes), values


def graph_signatures(graph: Graph, ops: Mapping[str, ast.OpDecl],
                     pins: Mapping[str, Layout] | None = None) -> set[Signature]:
    """The signatures of the graph's operators and of the parallel terms its pins add (see `graph_program`)."""
    shapes = graph.shapes()
    found: set[Signature] = set()
    for node in graph.nodes:
        attrs = dict(node.attrs)
        values = tuple(int(attrs[p.name]) for p in ops[node.op].attr_params if p.type.kind != "real")
        found.add((node.op, tuple(len(shapes[i]) for i in node.inputs), values))
    for name, layout in (pins or {}).items():
        rank = len(shapes[name])
        for dim, degree in enumerate(layout.shard):
            if degree > 1:
                found.add(("partition", (rank,), (dim,)))
        if layout.copy > 1:
            found.add(("replicate", (rank,), ()))
    return found


@dataclass(frozen=True)
class _Typed:
    """A typed rule instance with the signatures its left side needs and its right side builds."""

    instance: RuleInstance
    needs: tuple[Signature, ...]
    builds: tuple[Signature, ...]


def _typed(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], ranks: set[int], cache: dict) -> list[_Typed]:
    key = (rule, frozenset(ranks))
    if key not in cache:
        cache[key] = [_Typed(i, tuple(_term_signature(t) for t in i.lhs.walk() if t.kind != "input"),
                             tuple(_term_signature(t) for t in i.rhs.walk() if t.kind != "input"))
                      for i in _typed_instances(rule, ops, ranks)]
    return cache[key]


class _Present:
    """Signatures that can occur in the e-graph, indexed by (operator, input ranks)."""

    def __init__(self, signatures: Iterable[Signature]):
        self.by_head: dict[tuple, set[tuple]] = {}
        for sig in signatures:
            self.add(sig)

    def add(self, sig: Signature) -> bool:
        known = self.by_head.setdefault(sig[:2], set())
        if sig[2] in known:
            return False
        known.add(sig[2])
        return True

    def matches(self, sig: Signature) -> bool:
        return any(all(a is None or b is None or a == b for a, b in zip(sig[2], attrs))
                   for attrs in self.by_head.get(sig[:2], ()))


def _reachable_instances(typed: Sequence[_Typed], signatures: Iterable[Signature]) -> list[bool]:
    """Which instances can ever match: their left side's signatures occur in the graph or in what such instances build.

    A fixpoint, like `reachable_rules` but per rank assignment and attribute
    value: an instance typed for a transpose of dims (1, 2) of a rank-3
    tensor never matches a graph whose transposes are all of rank 4, so it
    is not compiled (egglog's time per iteration grows with every rule).
    """
    present = _Present(signatures)
    active = [False] * len(typed)
    changed = True
    while changed:
        changed = False
        for index, item in enumerate(typed):
            if not active[index] and all(present.matches(sig) for sig in item.needs):
                active[index] = changed = True
                for sig in item.builds:
                    present.add(sig)
    return active


_TYPING_CACHE: dict = {}
_COMPILED_CACHE: dict = {}


def compile_rules(library: Library, rules: Sequence[ast.RuleDecl], ranks: set[int], devices: int,
                  graph_ops: set[str] | None = None, typing_cache: dict | None = None,
                  signatures: set[Signature] | None = None, deadline: float | None = None,
                  free_degrees: Sequence[int] | None = None, compiled_cache: dict | None = None,
                  placement: bool = True) -> RuleProgram:
    """Every rule at every rank assignment the graph's `ranks` need, for `devices` devices.

    Rules whose left side needs an operator that neither the graph (`graph_ops`)
    nor any rule can produce are left out; with `signatures` (the graph's,
    `graph_signatures`), so is every rank assignment whose left side can never
    match (`_reachable_instances`). Typed instances and their egglog text are
    kept in module caches (keyed by rule, ranks and device count), so repeated
    searches (the baselines, benchmarks) do not type or compile twice. A
    caller that passes its own `typing_cache` (the rule generator, whose
    candidate rules are throwaway) gets neither module cache, so they do not grow.
    Once `deadline` (a `time.perf_counter()` value) passes, the rules not yet
    typed and compiled are left out (skipped, `DEADLINE_NOTE`; counted in
    `unfinished`): typing thousands of rules takes longer than a time limit.
    A caller may keep its own `compiled_cache` (keyed like the module's).
    `free_degrees` restricts the degrees a rule that introduces parallelism
    may choose (the rule generator's derivations need only the degree its
    instances use). `placement=False` drops the layout guards (see
    `compile_rule_instance`).
    """
    from parsat.dsl.checker import is_parallel_rule

    ops = library.ops
    compiled: list[CompiledRule] = []
    skipped: list[SkippedRule] = []
    usable = rules if graph_ops is None else reachable_rules(rules, graph_ops)
    cache = typing_cache if typing_cache is not None else _TYPING_CACHE
    if compiled_cache is None:
        compiled_cache = {} if typing_cache is not None else _COMPILED_CACHE
    for rule in rules:
        if rule not in usable:
            skipped.append(SkippedRule(rule.name, "its left side needs an operator the graph never contains"))
    typed: dict[ast.RuleDecl, list[_Typed]] = {}
    for rule in usable:
        if _past(deadline):
            break
        typed[rule] = _typed(rule, ops, ranks, cache)
    if signatures is not None:
        flat = [item for items in typed.values() for item in items]
        keep = {id(item) for item, ok in zip(flat, _reachable_instances(flat, signatures)) if ok}
    unfinished = 0
    for rule in usable:
        if rule not in typed or _past(deadline):
            skipped.append(SkippedRule(rule.name, DEADLINE_NOTE))
            unfinished += 1
            continue
        parallel = is_parallel_rule(rule)
        found = 0
        last_reason = "no rank assignment of its metavariables fits the graph's ranks"
        compile_reason = ""   # says more than a signature that does not match: kept when there is one
        for item in typed[rule]:
            if signatures is not None and id(item) not in keep:
                last_reason = "no rank assignment of its left side matches an operator the graph (or a rule) makes"
                continue
            key = (item.instance.rule, tuple(sorted(item.instance.groups.items())), devices, placement)
            if key not in compiled_cache:
                compiled_cache[key] = compile_rule_instance(item.instance, devices, parallel, placement)
            made, reason = compiled_cache[key]
            compiled.extend(made)
            found += len(made)
            compile_reason = reason or compile_reason
        if not found:
            skipped.append(SkippedRule(rule.name, compile_reason or last_reason))
    position = dict.fromkeys(RULESETS, 0)
    named = []
    for i, r in enumerate(compiled):
        chunk = f"{r.ruleset}{position[r.ruleset] // CHUNK_RULES}"
        position[r.ruleset] += 1
        key = f"{r.name}#{i}"
        named.append(replace(r, key=key, chunk=chunk, text=r.body.text(i, chunk, key)))
    program = RuleProgram("", tuple(named), tuple(skipped), unfinished)
    return replace(program, declarations=declarations(ops, devices, free_degrees) + _ruleset_declarations(program))


# ---------------------------------------------------------------- graph to egglog


def layout_chain(var: str, layout: Layout) -> list[tuple[str, str, Layout]]:
    """Parallel terms that bring a whole tensor to `layout` (partitions, then replicate)."""
    out = []
    current = Layout.whole(len(layout.shard))
    expr = var
    for dim, degree in enumerate(layout.shard):
        if degree > 1:
            current = Layout(tuple(d * degree if i == dim else d for i, d in enumerate(current.shard)), current.copy)
            expr = f"(P_partition {expr} {dim} {degree})"
            out.append((expr, "partition", current))
    if layout.copy > 1:
        current = Layout(current.shard, layout.copy)
        expr = f"(P_replicate {expr} {layout.copy})"
        out.append((expr, "replicate", current))
    return out


PIN_SUFFIX = "@pinned"


def graph_program(graph: Graph, ops: Mapping[str, ast.OpDecl],
                  pins: Mapping[str, Layout] | None = None) -> tuple[str, dict[str, str]]:
    """One `let` per leaf and per operator (a DAG, not a tree), with analysis rows.

    `pins` fixes layouts: for an output, the parallel terms that bring it to
    that layout are added and become the extraction root ("pin:NAME"); for a
    graph input, the input *arrives* in that layout: its parallel terms are
    unioned with a second leaf `Leaf "NAME@pinned"` (free), so the whole
    input is what costs a gather. Returns the text and, for each graph
    tensor (and each pin), the global variable naming its e-class.
    """
    lines: list[str] = []
    names: dict[str, str] = {}
    shapes = graph.shapes()
    inputs = {leaf.name for leaf in graph.leaves if leaf.role == "input"}

    def rows(var: str, shape: Sequence[int], layout: Layout) -> None:
        lines.append(f"(set (Rank {var}) {len(shape)})")
        for i, d in enumerate(shape):
            lines.append(f"(set (Dim {var} {i}) {d})")
            lines.append(f"(set (Shard {var} {i}) {layout.shard[i]})")
        lines.append(f"(set (Copy {var}) {layout.copy})")
        lines.append(f"(set (Psum {var}) {layout.sum})")
        lines.append(f"(set (Pieces {var}) {layout.pieces})")

    for index, leaf in enumerate(graph.leaves):
        var = f"$l{index}"
        names[leaf.name] = var
        lines.append(f"\n(let {var} (Leaf {_quote(leaf.name)}))")
        rows(var, leaf.shape, Layout.whole(len(leaf.shape)))
    for index, node in enumerate(graph.nodes):
        var = f"$n{index}"
        names[node.name] = var
        args = []
        tensors = iter(node.inputs)
        attrs = dict(node.attrs)
        for param in ops[node.op].params:
            if param.is_tensor:
                args.append(names[next(tensors)])
            elif param.type.kind == "real":
                args.append(real_literal(attrs[param.name]))
            else:
                args.append(str(int(attrs[param.name])))
        lines.append(f"\n(let {var} ({ctor(node.op)} {' '.join(args)}))")
        lines.append(made_row(ctor(node.op), args, GRAPH_MADE))
        rows(var, node.shape, Layout.whole(len(node.shape)))
    for pin_index, (name, layout) in enumerate((pins or {}).items()):
        base = names[name]
        var = base
        for step, (expr, _kind, current) in enumerate(layout_chain(base, layout)):
            var = f"$p{pin_index}_{step}"
            lines.append(f"\n(let {var} {expr})")
            rows(var, shapes[name], current)
        if name in inputs and var != base:
            lines.append(f"\n(union {var} (Leaf {_quote(name + PIN_SUFFIX)}))")
        names[f"pin:{name}"] = var
    return "\n".join(lines) + "\n", names


# ------------------------------------------------------------------ the e-graph


@dataclass(frozen=True)
class ENode:
    """One e-node of the snapshot: constructor (operator name, or "leaf"), children classes, attributes."""

    op: str
    children: tuple[int, ...]
    attrs: tuple  # values of the non-tensor positions, in order (ints, strings for reals, leaf name)


@dataclass(frozen=True)
class Snapshot:
    """The e-graph read back: e-classes with their e-nodes and their analysis."""

    classes: Mapping[int, tuple[ENode, ...]]
    shape: Mapping[int, tuple[int, ...]]
    layout: Mapping[int, Layout]
    lets: Mapping[str, int]
    made: Mapping[ENode, frozenset[str]] = field(default_factory=dict)  # who made an e-node (`made_row`)

    def makers(self, node: ENode) -> frozenset[str]:
        """The rules that made `node`; empty for the input graph's own e-nodes (and leaves and pins)."""
        who = self.made.get(node, frozenset())
        return frozenset() if GRAPH_MADE in who else who

    @property
    def enodes(self) -> int:
        return sum(len(v) for v in self.classes.values())


def _children_and_attrs(eg, sorts: Sequence[str], values: Sequence) -> tuple[tuple[int, ...], tuple]:
    """A row's tensor arguments (e-class ids) and its other arguments (ints, strings for reals and leaf names)."""
    children, attrs = [], []
    for sort, value in zip(sorts, values):
        if sort == "T":
            children.append(eg.value_to_i64(value))
        elif sort == "String":
            attrs.append(eg.value_to_string(value))
        else:
            attrs.append(eg.value_to_i64(value))
    return tuple(children), tuple(attrs)


class Session:
    """An egglog e-graph with the compiled rules and one graph loaded."""

    def __init__(self, program: RuleProgram, graph_text: str, deadline: float | None = None):
        """Once `deadline` (a `time.perf_counter()` value) passes, no more rules are loaded (`loaded` says how
        many were); the graph always is, so the e-graph stays whole."""
        self.egraph = bindings.EGraph()
        self.loaded = 0
        try:
            # One command batch per rule and per graph node: egglog 13.2 is far
            # slower on one large program (9 s against 0.4 s for 200 rules).
            self._run(program.declarations)
            self._constructors = frozenset(name for name, fn in self.egraph.freeze().functions.items()
                                           if fn.output_sort == "T" and not fn.is_let_binding)
            for rule in program.rules:
                if _past(deadline):
                    break
                self._run(rule.text)
                self.loaded += 1
            for chunk in graph_text.split("\n\n"):
                if chunk.strip():
                    self._run(chunk)
        except bindings.EggSmolError as err:
            raise CompileError(f"egglog rejected the generated program: {err}") from None

    def _run(self, text: str):
        return self.egraph.run_program(*self.egraph.parse_program(text))

    def extend(self, rules: Sequence[CompiledRule], tag: str, first_index: int) -> None:
        """Loads more compiled rules into rulesets of their own, `<tag>alg` and `<tag>par`.

        The rule generator adds the rules it keeps to an e-graph that already
        holds its candidates, batch by batch; `first_index` keeps the rules'
        match relations apart from the ones loaded before (`RuleBody.text`).
        """
        try:
            for ruleset in RULESETS:
                self._run(f"(ruleset {tag}{ruleset}) (ruleset {match_ruleset(tag + ruleset)})")
            for offset, rule in enumerate(rules):
                self._run(rule.body.text(first_index + offset, tag + rule.ruleset, f"{tag}{rule.name}#{offset}"))
        except bindings.EggSmolError as err:
            raise CompileError(f"egglog rejected the generated program: {err}") from None

    def push(self) -> None:
        """Saves the e-graph (egglog's push); `pop` brings it back."""
        self._run("(push)")

    def pop(self) -> None:
        self._run("(pop)")

    def load(self, text: str) -> None:
        """Runs program text that inserts terms or facts (a graph chunk)."""
        try:
            self._run(text)
        except bindings.EggSmolError as err:
            raise CompileError(f"egglog rejected the generated program: {err}") from None

    def combine_rulesets(self, name: str, parts: Sequence[str]) -> None:
        """Declares `name` (and its match half) as the combined ruleset of `parts` (and theirs)."""
        self._run(f"(unstable-combined-ruleset {name} {' '.join(parts)})\n"
                  f"(unstable-combined-ruleset {match_ruleset(name)} {' '.join(match_ruleset(p) for p in parts)})")

    def holds(self, left: str, right: str) -> bool:
        """Whether the e-graph already has `right` (an egglog term, not inserted) in `left`'s e-class."""
        try:
            self._run(f"(check (= {left} {right}))")
        except bindings.EggSmolError:
            return False
        return True

    def run(self, ruleset: str) -> tuple[bool, dict[str, int]]:
        """One iteration of `ruleset` (or of one of its chunks); (whether anything changed, matches per rule).

        The `Whole` rows of terms built since the last run are derived first, then the rules' patterns
        matched (`RuleBody`).
        """
        outputs = self._run(f"(run {SHAPE_RULESET} 1) (run {match_ruleset(ruleset)} 1) (run {ruleset} 1)")
        report = outputs[-1].report
        return bool(report.updated), dict(report.num_matches_per_rule)

    def size(self) -> int:
        """Number of e-nodes (constructor rows), from egglog's table sizes: cheap enough to check between chunks
        (freezing the e-graph to count them costs ~45 ms per 18k e-nodes, this ~0.3 ms)."""
        sizes = self._run("(print-size)")[-1].sizes
        return sum(count for name, count in sizes if name in self._constructors)

    def snapshot(self) -> Snapshot:
        eg = self.egraph
        frozen = eg.freeze()
        classes: dict[int, list[ENode]] = {}
        analysis: dict[str, dict] = {name: {} for name in ANALYSES}
        lets: dict[str, int] = {}
        made: dict[ENode, set[str]] = {}
        for name, fn in frozen.functions.items():
            if name.startswith(MADE_PREFIX):
                op = name[len(MADE_PREFIX):].split("_", 1)[1]
                for row in fn.rows:
                    node = ENode(op, *_children_and_attrs(eg, fn.input_sorts[:-1], row.inputs[:-1]))
                    made.setdefault(node, set()).add(eg.value_to_string(row.inputs[-1]))
                continue
            if fn.is_let_binding:
                if fn.output_sort == "T":
                    lets[name] = eg.value_to_i64(fn.rows[0].output)
                continue
            if name in analysis:
                table = analysis[name]
                for row in fn.rows:
                    key = tuple(eg.value_to_i64(v) for v in row.inputs)
                    table[key] = eg.value_to_i64(row.output)
                continue
            if fn.output_sort != "T":
                continue
            op = "leaf" if name == "Leaf" else name.split("_", 1)[1]
            for row in fn.rows:
                if row.subsumed:
                    continue
                classes.setdefault(eg.value_to_i64(row.output), []).append(
                    ENode(op, *_children_and_attrs(eg, fn.input_sorts, row.inputs)))
        shape: dict[int, tuple[int, ...]] = {}
        layout: dict[int, Layout] = {}
        for cid in classes:
            rank = analysis["Rank"].get((cid,))
            if rank is None:
                continue
            dims = tuple(analysis["Dim"].get((cid, i), 0) for i in range(rank))
            shard = tuple(analysis["Shard"].get((cid, i), 1) for i in range(rank))
            shape[cid] = dims
            layout[cid] = Layout(shard, analysis["Copy"].get((cid,), 1), analysis["Psum"].get((cid,), 1))
        return Snapshot({k: tuple(v) for k, v in classes.items()}, shape, layout, lets,
                        {node: frozenset(who) for node, who in made.items()})
