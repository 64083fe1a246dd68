"""One typed rule instance written as egglog rules: its pattern, its guards, its actions.

* A rule is typed with whole (unsharded) metavariables, so it fires only on
  matches whose metavariables are whole; its right side's spreads are then
  exactly the typed ones. A rule binds a metavariable's dims with one
  `Whole` lookup (two atoms over small tables instead of `Pieces`, `Rank`
  and one `Dim` per dim over the big ones: egglog builds indexes per rule
  and per iteration, so the atoms a query has and the size of their tables
  are what saturation costs). `where` conditions and definedness
  requirements become `:when` facts.
* A degree free on the right (a rule that introduces parallelism) is bound
  at run time by the relation `Degree`, which holds the divisors >= 2 of the
  device count (one egglog rule per instance). Every term a rule builds must
  have at most `devices` pieces, dividing `devices`: the device budget.
  Because parallel terms are never whole, a rule never nests on its own
  output, so saturation of the parallel rules terminates.
* The degrees at which the rule keeps the devices' placements (`guards`) become a
  relation the rule joins with.

Which instances are written is `instances`' choice; `program` assembles them.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.conditions import Cond, Negation, Rel, symbolic_truth, to_poly
from parsat.dsl.symbolic import Poly
from parsat.dsl.typecheck import RuleInstance, TypedTerm
from parsat.egraph import guards
from parsat.egraph.encoding import (MATCH_SUFFIX, MAX_RANK, SkipRule, applied_relation, ctor, equated_row, live_row,
                                    made_row, match_ruleset, poly_expr, quote, real_literal, rel_fact, shape_term)


def symbol_var(symbol: str) -> str:
    """The egglog variable of a size symbol."""
    return "s_" + re.sub(r"[^A-Za-z0-9_]", "_", symbol)


def bind_shape(name: str, shape: Sequence[Poly], names: dict[str, str], fresh) -> tuple[list[str], list[tuple[str, Poly]]]:
    """Egglog variables for a metavariable's dims: a dim that is one size symbol not yet bound binds it
    (`names` gains it); any other dim gets a fresh variable, returned with the polynomial it must equal
    (a fact to add once every symbol is bound). Raises SkipRule past MAX_RANK."""
    if len(shape) > MAX_RANK:
        raise SkipRule(f"metavariable '{name}' has rank {len(shape)} (at most {MAX_RANK} supported)")
    dims, deferred = [], []
    for dim in shape:
        symbol = dim.as_symbol()
        if symbol is not None and symbol not in names:
            names[symbol] = symbol_var(symbol)
            dims.append(names[symbol])
        else:
            var = fresh("d")
            dims.append(var)
            deferred.append((var, dim))
    return dims, deferred


_NEGATE = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


def dnf(cond: Cond, negate: bool = False) -> list[list[Rel]]:
    """A condition as a disjunction of conjunctions of relations."""
    if isinstance(cond, Rel):
        return [[Rel(_NEGATE[cond.op], cond.left, cond.right) if negate else cond]]
    if isinstance(cond, Negation):
        return dnf(cond.part, not negate)
    parts = [dnf(p, negate) for p in cond.parts]
    conj = (cond.op == "and") != negate
    if conj:
        out: list[list[Rel]] = [[]]
        for alternatives in parts:
            out = [a + b for a in out for b in alternatives]
        return out
    return [alt for alternatives in parts for alt in alternatives]


_PATTERN_VAR = re.compile(r"(?<![\w\"])([A-Za-z_]\w*)")


def _let_terms(actions: str) -> list[str]:
    """The terms of the actions' `(let VAR TERM)`s, as text."""
    out = []
    for found in re.finditer(r"\(let \S+ ", actions):
        depth, start = 0, found.end()
        for end in range(start, len(actions)):
            depth += {"(": 1, ")": -1}.get(actions[end], 0)
            if depth == 0:
                out.append(actions[start:end + 1])
                break
    return out


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

    def variables(self) -> list[tuple[str, str]]:
        """The pattern's variables and their sorts, in order: tensors (root, m_*), reals (r_*), integers."""
        out: dict[str, str] = {}
        for name in _PATTERN_VAR.findall(self.pattern):
            if name.startswith(("Op_", "P_")) or name in out:
                continue
            out[name] = "T" if name == "root" or name.startswith("m_") else "String" if name.startswith("r_") else "i64"
        return list(out.items())

    def applied_variables(self) -> list[tuple[str, str]]:
        """The columns of the rule's `Applied` row: the pattern's variables, then the ones the guards bind
        (sizes looked up, degrees chosen) that the built terms use, so the row fixes every e-node the
        application built (`derivation`)."""
        out = dict(self.variables())
        for term in _let_terms(self.actions):
            for name in _PATTERN_VAR.findall(term):
                if name not in out and name != "let" and not name.startswith(("Op_", "P_", "t")):
                    out[name] = "String" if name.startswith("r_") else "i64"
        return list(out.items())

    def applied_sorts(self) -> tuple[str, ...]:
        """The sorts of the `Applied` row's columns after the index: its relation (`encoding.applied_relation`)."""
        return tuple(sort for _, sort in self.applied_variables())

    def text(self, index: int, chunk: str, key: str, gated: bool = False) -> str:
        """The relation and the two rules; the second carries the rule's `key` as its name.

        A `gated` rule's halves also join its `Live` row, inserted here: a
        rule that makes new values can then be held back by deleting the row
        once its pattern matches past the run's budget (`Session.run`), before
        any of those matches is applied; a one-row join costs nothing else.

        The applying half also records the match it applied, `index` first, in the relation of its columns'
        sorts (`encoding.applied_relation`, declared by the program, not here): what the application read and
        built is worked out from it (`derivation`), so a plan can name the rules that built the terms its rules
        matched, not only the makers of its own e-nodes."""
        variables = self.variables()
        relation = f"Match{index}"
        row = f"({relation} {' '.join(v for v, _ in variables)})"
        recorded = self.applied_variables()
        applied = f"({applied_relation([sort for _, sort in recorded])} {index} {' '.join(v for v, _ in recorded)})"
        gate = (live_row(key),) if gated else ()
        facts = gate + self.facts
        return (f"(relation {relation} ({' '.join(sort for _, sort in variables)}))\n" +
                f"(rule ({' '.join((self.pattern,) + gate)}) ({row}) :ruleset {match_ruleset(chunk)} "
                f":name {quote(key + MATCH_SUFFIX)})\n"
                f"(rule ({' '.join((row,) + facts)})\n      ({self.actions} {applied})\n"
                f"      :ruleset {chunk} :name {quote(key)})" + "".join(f"\n{g}" for g in gate))


@dataclass(frozen=True)
class CompiledRule:
    """One egglog rule: a rule of the library at one rank assignment and free degree."""

    name: str         # the library rule's name
    variant: str      # e.g. "a=0,b=1 p=2"
    ruleset: str      # "alg" or "par"
    body: RuleBody = field(repr=False)
    phase: str = ""   # on a mesh: GROW (it makes new values) or PLACE (it places values); `runner.run_generations`
    key: str = ""     # the egglog rule's :name, unique in the program
    chunk: str = ""   # the egglog ruleset that holds it: one chunk of `ruleset` (RuleProgram.chunks)
    text: str = ""    # the egglog text, once placed in a chunk (compile_rules)
    tables: tuple[tuple[str, int, tuple[tuple[int, ...], ...]], ...] = ()   # lift tables it joins (name, width,
    #                   rows): declared once per program (mesh encoding only, `lifted_text`)

    @property
    def index(self) -> int:
        """The number in its match relation's name (`Match<i>`) and in its `Applied` rows (`RuleBody.text`),
        its place in the program it was compiled into, kept in `key`. Not its place in `RuleProgram.rules`: a
        program less some rules (`RuleProgram.without`) keeps the others' texts, so every later place moves
        while the names stay (a 2x2 gpt's associativity cut moved them by two, and 3,427 of 5,288 recorded
        applications were read with the wrong rule's pattern)."""
        return int(self.key.rsplit("#", 1)[1])


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
        symbol = poly.as_symbol()
        if symbol is not None and symbol not in self.names:
            self.names[symbol] = symbol_var(symbol)
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
            args = [inner] + [str(d) for d in term.dims] + [self.int_arg(term.degree)]
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


def _free_degrees(instance: RuleInstance) -> list[str]:
    """Degrees a left-side match does not fix by itself: saturation enumerates them.

    A degree is bound when it stands alone as the degree of a left-side
    parallel operator; one that appears only on the right (a rule that
    introduces parallelism) or only inside an expression (`p * q`) is free.
    """
    bound = set()
    for term in instance.lhs.walk():
        if term.kind == "parallel" and term.degree is not None:
            symbol = term.degree.as_symbol()
            if symbol is not None:
                bound.add(symbol)
        if term.kind == "op":
            for param, arg in zip(term.instance.op.params, term.node.args):
                if not param.is_tensor and isinstance(arg, ast.Name):
                    bound.add(arg.id)
    return [s for s, kind in instance.symbols.items() if kind == "degree" and s not in bound]


def compile_rule_instance(instance: RuleInstance, devices: int, parallel: bool,
                          ) -> tuple[list[CompiledRule], str]:
    """The egglog rules of one typed rule instance (several only when a guard is a disjunction).

    A degree the left side does not bind (a rule that introduces parallelism,
    or `p * q` on the left) is bound at run time by the `Degree` relation,
    which holds the divisors >= 2 of the device count: one egglog rule per
    instance, not one per choice of degrees (egglog's time per iteration grows
    with the number of rules, so this matters more than the extra join).
    Only values and spreads count: the rule generator's derivations ask what
    the rules imply, not where pieces live (that is the mesh encoding's
    job: `lifted_text`).
    """
    free = _free_degrees(instance)
    try:
        texts = _compile_one(instance, devices, free)
    except SkipRule as skip:
        return [], str(skip)
    note = ",".join(f"{g}={n}" for g, n in instance.groups.items())
    return [CompiledRule(instance.rule.name, note + (f" #{k}" if len(texts) > 1 else ""), "par" if parallel else "alg",
                         text) for k, text in enumerate(texts)], ""


def _compile_one(instance: RuleInstance, devices: int, free: Sequence[str]) -> list[RuleBody]:
    """The rule's query and actions, one per alternative of its guards (`RuleBody.text` makes the egglog)."""
    b = _Builder(instance, devices)
    facts = []
    for symbol in free:
        b.names[symbol] = symbol_var(symbol)
        facts.append(f"(Degree {b.names[symbol]})")
    metas: dict[str, str] = {}
    root = b.pattern(instance.lhs, metas)
    facts.insert(0, f"(= root {root})")
    for name, var in metas.items():
        dims, deferred = bind_shape(name, instance.tensors[name], b.names, b.fresh)
        b.deferred.extend(("eq", var, dim) for var, dim in deferred)
        facts.append(f"(= (Whole {var}) {shape_term(dims)})")
    # Every size symbol the conditions or the right side use must be bound now.
    conditions: list[Cond] = list(instance.where) + list(instance.lhs_requires) + list(instance.rhs_requires)
    rhs_terms = [t for t in instance.rhs.walk() if t.kind != "input"]
    for term in rhs_terms:
        pieces = term.spread.pieces
        conditions.append(Rel("<=", pieces, Poly.const(devices)))
        conditions.append(Rel("==", Poly.const(devices).mod(pieces), Poly.const(0)))
    blocked = guards.feasible(conditions, free, devices)
    if blocked is not None:
        raise SkipRule(f"condition {blocked} cannot hold with {devices} devices")
    concrete_guards = [cond for cond in conditions if symbolic_truth(cond) is None]
    for kind, var, poly in b.deferred:
        facts.append(f"(= {var} {_expr(poly, b.names)})")
    alternatives = [[]]
    for cond in concrete_guards:
        options = dnf(cond)
        alternatives = [a + o for a in alternatives for o in options]
    # Right side: one let per built term, then its analysis rows, then the union.
    actions: list[str] = []
    made: dict[int, str] = {}
    for term in _postorder(instance.rhs):
        if term.kind == "input":
            made[id(term)] = metas.get(term.name) or _raise(f"'{term.name}' is not bound by the left side")
            continue
        if term.kind == "parallel":
            args = [made[id(term.args[0])]] + [str(d) for d in term.dims]
            args.append(_expr(term.degree, b.names))
        else:
            args = b.op_args(term, made, lhs=False)
        var = b.fresh("t")
        made[id(term)] = var
        actions.append(f"(let {var} ({ctor(term.name)} {' '.join(args)}))")
        actions.append(made_row(ctor(term.name), args, instance.rule.name))
        actions.extend(_analysis_rows(var, term.shape, term.spread, b))
    if instance.rhs.kind == "input":
        actions.append(equated_row("root", instance.rule.name))
    actions.append(f"(union root {made[id(instance.rhs)]})")
    texts = []
    for alt in alternatives:
        when = list(dict.fromkeys(facts[1:] + [rel_fact(r, b.names) if _bound(r, b.names) else _raise(f"unbound size in {r}")
                                               for r in alt]))
        texts.append(RuleBody(facts[0], tuple(when), " ".join(actions)))
    return texts


def _raise(message: str):
    raise SkipRule(message)


def _bound(rel: Rel, names: Mapping[str, str]) -> bool:
    return (rel.left.symbols() | rel.right.symbols()) <= set(names)


def _expr(poly: Poly, names: Mapping[str, str]) -> str:
    try:
        return poly_expr(poly, names)
    except KeyError as err:
        raise SkipRule(f"size '{err.args[0]}' is not bound by the left side") from None


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
