"""Derivability by saturation: does a set of proven rules already imply a rule?

A rule `lhs => rhs` is derivable from a rule set when saturating its left
side, at concrete sizes, with that set puts its right side in the left
side's e-class. This is directional, as the optimizer is: the right side
is looked up after saturation, never inserted before it, so a rule set that
only rewrites the other way does not count.

Two tools use it:

- `Deriver`: a fixed rule set, many rules to test at once (one e-graph
  holds every left side, each over leaves of its own). The generator's
  final minimisation and the benchmark that checks which shipped rules the
  generated ones derive use it.
- `CandidateGraph`: an e-graph holding the left sides of many candidate
  rules, to which rules are added batch by batch as the generator keeps
  them (Ruler, OOPSLA'21: candidates that the kept rules already derive
  are dropped before anyone proves them).

Sharing an e-graph is sound for derivability: every equality in it follows
from the rule set, whichever terms it went through.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.conditions import holds, to_poly
from parsat.dsl.library import Library
from parsat.dsl.printer import format_expr
from parsat.dsl.symbolic import Poly
from parsat.dsl.typecheck import RuleInstance, TypeCheckError, TypedTerm, type_rule
from parsat.egraph.encoding import RULESETS, ctor, real_literal
from parsat.egraph.program import RuleProgram, compile_rules
from parsat.egraph.runner import Limits, run
from parsat.egraph.session import CompileError, Session

REAL_VALUE = 0.5   # the value a real metavariable (scale's c, layernorm's eps) takes in a concrete instance
FREE_DEGREES = (2,)   # instances use degree 2 (`instance_sizes`): a rule that introduces parallelism picks 2 too


def instance_sizes(instance: RuleInstance, devices: int, seed: int = 0) -> dict[str, int] | None:
    """Concrete sizes at which the rule applies and both sides are defined (None: none found).

    Degrees are 2 (a product of two then divides `devices` = 4), dims
    distinct multiples of 4, ints small; drawn until every condition holds
    and every term fits the device budget.
    """
    rng = random.Random(seed)
    names = sorted(instance.symbols)
    conds = list(instance.where) + list(instance.lhs_requires) + list(instance.rhs_requires)
    n_dims = sum(1 for n in names if instance.symbols[n] == "dim")
    pool = [4 * k for k in range(1, max(8, n_dims) + 1)]
    # each term's piece count, a product of its degrees, built once: it was most of the cost of the draws
    counts = [t.spread.pieces for side in (instance.lhs, instance.rhs) for t in side.walk()]
    for attempt in range(400):
        sizes = {}
        it = iter(rng.sample(pool, k=n_dims))
        for n in names:
            kind = instance.symbols[n]
            if kind == "degree":
                sizes[n] = 2
            elif kind == "dim":
                sizes[n] = next(it)
            else:
                sizes[n] = rng.randint(0, 6) if attempt > 20 else rng.choice((1, 2, 3))
        if all(holds(c, sizes) for c in conds):
            pieces = [count.evaluate(sizes) for count in counts]
            if all(p <= devices and devices % p == 0 for p in pieces):
                return sizes
    return None


@dataclass
class TermWriter:
    """Ground terms of one rule instance in egglog: `let`s with their analysis rows, or plain expressions."""

    instance: RuleInstance
    sizes: Mapping[str, int]
    prefix: str = "g"
    lines: list[str] = field(default_factory=list)
    made: dict = field(default_factory=dict)

    def num(self, poly: Poly) -> int:
        return int(poly.evaluate(self.sizes))

    def _body(self, term: TypedTerm, child) -> str:
        if term.kind == "input":
            return f'(Leaf "{self.prefix}{term.name}")'
        if term.kind == "parallel":
            args = [child(term.args[0])] + [str(d) for d in term.dims]
            return f"({ctor(term.name)} {' '.join(args + [str(self.num(term.degree))])})"
        env = {s: Poly.sym(s) for s in self.instance.symbols}
        tensors = iter(term.args)
        args = []
        for param, arg in zip(term.instance.op.params, term.node.args):
            if param.is_tensor:
                args.append(child(next(tensors)))
            elif param.type.kind == "real":
                if isinstance(arg, ast.Num):
                    args.append(real_literal(arg.value))
                elif isinstance(arg, ast.Neg) and isinstance(arg.operand, ast.Num):
                    args.append(real_literal(-arg.operand.value))
                else:
                    args.append(real_literal(REAL_VALUE))
            else:
                args.append(str(self.num(to_poly(arg, env, self.instance.groups))))
        return f"({ctor(term.name)} {' '.join(args)})"

    def expr(self, term: TypedTerm) -> str:
        """The term as one egglog expression (to look up, not to insert)."""
        return self._body(term, self.expr)

    def term(self, term: TypedTerm) -> str:
        """A `let` per operator, with the rows of `egraph.encoding.graph_program`; the variable of the root."""
        key = format_expr(term.node)
        if key in self.made:
            return self.made[key]
        body = self._body(term, self.term)
        var = f"${self.prefix}{len(self.made)}"
        self.made[key] = var
        rows = [f"(let {var} {body})", f"(set (Rank {var}) {len(term.shape)})"]
        for i, dim in enumerate(term.shape):
            rows.append(f"(set (Dim {var} {i}) {self.num(dim)})")
            rows.append(f"(set (Shard {var} {i}) {self.num(term.spread.shard[i])})")
        rows.append(f"(set (Copy {var}) {self.num(term.spread.copy)})")
        rows.append(f"(set (Psum {var}) {self.num(term.spread.sum)})")
        rows.append(f"(set (Pieces {var}) {self.num(term.spread.pieces)})")
        self.lines.append("\n".join(rows))
        return var


def write_instance(instance: RuleInstance, devices: int, prefix: str) -> tuple[TermWriter, str, str] | None:
    """The instance's left side as `let`s and its right side as an expression, at sizes that fit
    `devices`; None when no such sizes exist or the sides cannot be written at them."""
    sizes = instance_sizes(instance, devices)
    if sizes is None:
        return None
    writer = TermWriter(instance, sizes, prefix=prefix)
    try:
        return writer, writer.term(instance.lhs), writer.expr(instance.rhs)
    except (ZeroDivisionError, KeyError):
        return None


def derivation_program(library: Library, rules: Sequence[ast.RuleDecl], ranks: set[int], devices: int,
                       typing_cache: dict, compiled_cache: dict | None = None) -> RuleProgram:
    """`rules` compiled for derivations: instances pick degree 2 (`FREE_DEGREES`); the degree encoding asks what
    the rules imply about values and spreads, not which plans can run."""
    return compile_rules(library, list(rules), ranks, devices, None, typing_cache, free_degrees=FREE_DEGREES,
                         compiled_cache=compiled_cache)


def ranks_of(instance: RuleInstance) -> set[int]:
    return {len(t.shape) for side in (instance.lhs, instance.rhs) for t in side.walk()}


DERIVE_LIMITS = Limits(iterations=6, enodes=20_000, seconds=3.0)   # a derivability test stops here (`Deriver`)


def _saturate(session: Session, rulesets: Sequence[str], limits: Limits) -> int:
    """Runs `rulesets` with the optimizer's runner until nothing changes or a limit is reached; the iterations run."""
    return run(session, rulesets, limits, time.perf_counter() + limits.seconds).iterations


@dataclass
class Deriver:
    """Saturates rules' left sides with a fixed rule set and checks their right sides are reached.

    The rule program is compiled once per set of ranks; each check builds a
    fresh e-graph from it.
    """

    library: Library
    rules: list[ast.RuleDecl]
    devices: int = 4
    limits: Limits = DERIVE_LIMITS
    typing_cache: dict = field(default_factory=dict)     # shareable between derivers over the same library
    compiled_cache: dict = field(default_factory=dict)
    _programs: dict = field(default_factory=dict)

    def add(self, rule: ast.RuleDecl) -> None:
        self.rules.append(rule)
        self._programs.clear()

    def program(self, ranks: frozenset[int]) -> RuleProgram:
        if ranks not in self._programs:
            self._programs[ranks] = derivation_program(self.library, self.rules, set(ranks), self.devices,
                                                       self.typing_cache, self.compiled_cache)
        return self._programs[ranks]

    def derives(self, instance: RuleInstance, sizes: Mapping[str, int] | None = None) -> bool:
        """Whether saturating the left side (at concrete sizes) reaches the right side."""
        return self.derives_many([instance], [sizes])[0]

    def derives_many(self, instances: Sequence[RuleInstance],
                     sizes: Sequence[Mapping[str, int] | None] | None = None) -> list[bool]:
        """`derives` for many rules in one e-graph: every left side is loaded, saturated once, then every
        right side is looked up. Each rule's terms get their own leaves (`c<i>_x`) at their own sizes."""
        out = [False] * len(instances)
        if not self.rules or not instances:
            return out
        sizes = list(sizes) if sizes is not None else [None] * len(instances)
        writers: list[tuple[int, TermWriter, str]] = []
        ranks: set[int] = set()
        for index, (instance, given) in enumerate(zip(instances, sizes)):
            concrete = given if given is not None else instance_sizes(instance, self.devices)
            if concrete is None:
                continue
            writer = TermWriter(instance, concrete, prefix=f"c{index}_")
            try:
                left = writer.term(instance.lhs)
            except (ZeroDivisionError, KeyError):
                continue
            writers.append((index, writer, left))
            ranks |= ranks_of(instance)
        if not writers:
            return out
        try:
            session = Session(self.program(frozenset(ranks)),
                              "\n\n".join(chunk for _, w, _ in writers for chunk in w.lines))
        except CompileError:
            return out
        program = self.program(frozenset(ranks))
        chunks = [chunk for ruleset in RULESETS for chunk in program.chunks(ruleset)]
        _saturate(session, chunks, self.limits)
        for index, writer, left in writers:
            try:
                right = writer.expr(writer.instance.rhs)
            except (ZeroDivisionError, KeyError):
                continue
            out[index] = session.holds(left, right)
        return out


@dataclass
class _Pending:
    left: str       # the `let` variable of the left side
    right: str      # the right side as an egglog expression


class CandidateGraph:
    """The left sides of many candidate rules in one e-graph, and the kept rules added to it in batches.

    `derived()` says which candidates the rules added so far derive. Rules
    are compiled for the ranks the candidates have; a candidate whose sizes
    cannot be made concrete is never derived (it is proved instead).
    """

    def __init__(self, library: Library, instances: Sequence[RuleInstance], devices: int = 4,
                 limits: Limits = Limits(iterations=4, enodes=60_000, seconds=20.0), typing_cache: dict | None = None):
        self.library = library
        self.devices = devices
        self.limits = limits
        self._typing = typing_cache if typing_cache is not None else {}
        self._pending: dict[int, _Pending] = {}
        self._ranks: set[int] = set()
        self._tags: list[str] = []
        self._loaded = 0
        chunks: list[str] = []
        for index, instance in enumerate(instances):
            written = write_instance(instance, devices, prefix=f"c{index}_")
            if written is None:
                continue
            writer, left, right = written
            chunks.extend(writer.lines)
            self._pending[index] = _Pending(left, right)
            self._ranks |= ranks_of(instance)
        empty = derivation_program(library, [], self._ranks or {2}, devices, self._typing)
        self.session = Session(empty, "\n\n".join(chunks))

    def add_rules(self, rules: Sequence[ast.RuleDecl]) -> None:
        """Loads `rules` (proved) into the e-graph; the next `saturate` applies them with those before.

        Rules that introduce parallelism (a degree only their right side
        has) are left out: they fire on every operator of their kind, at
        every dim, and were most of the e-graph's growth, while a candidate
        they would derive is only proved again (and merged with its twin by
        its key once widened).
        """
        rules = [r for r in rules if not introduces_parallelism(r)]
        if not rules:
            return
        program = derivation_program(self.library, rules, self._ranks or {2}, self.devices, self._typing)
        tag = f"k{len(self._tags)}"
        self.session.extend(program.rules, tag, 10_000_000 + self._loaded)
        self._loaded += len(program.rules)
        self._tags.append(tag)
        for ruleset in RULESETS:
            self.session.combine_rulesets(f"upto{len(self._tags)}{ruleset}", [t + ruleset for t in self._tags])

    def saturate(self) -> int:
        """Runs every rule added so far; the iterations run."""
        if not self._tags:
            return 0
        return _saturate(self.session, [f"upto{len(self._tags)}{r}" for r in RULESETS], self.limits)

    def derived(self, indices: Sequence[int]) -> list[bool]:
        """Whether each candidate's right side is already in its left side's e-class."""
        out = []
        for index in indices:
            pending = self._pending.get(index)
            out.append(pending is not None and self.session.holds(pending.left, pending.right))
        return out

    def size(self) -> int:
        return self.session.size()


class Minimiser:
    """Tests whether the other rules of a set derive some of its rules; drops the ones they do.

    Every rule is loaded once, into rulesets of its own, in one e-graph.
    A test of some rules saturates, from a saved empty state (egglog's
    push/pop), their instances with the combined ruleset of the rules still
    kept but those, then looks their right sides up. A test sees nothing of
    the tests before it; testing several rules at once is sound (each is
    derived without any of them) and costs one saturation.
    """

    def __init__(self, library: Library, rules: Sequence[ast.RuleDecl], instances: Sequence[Sequence[RuleInstance]],
                 devices: int = 4, limits: Limits = Limits(iterations=4, enodes=20_000, seconds=5.0),
                 typing_cache: dict | None = None):
        self.library = library
        self.devices = devices
        self.limits = limits
        self.instances = [list(found) for found in instances]
        self.alive = set(range(len(rules)))
        ranks = {r for found in self.instances for instance in found for r in ranks_of(instance)} or {2}
        typing = typing_cache if typing_cache is not None else {}
        program = derivation_program(library, rules, ranks, devices, typing)
        self.session = Session(replace(program, rules=()), "")
        by_name: dict[str, list] = {}
        for compiled in program.rules:
            by_name.setdefault(compiled.name, []).append(compiled)
        names = [rule.name for rule in rules]
        unique = len(set(names)) == len(names)
        loaded = 0
        for index, rule in enumerate(rules):
            if unique:
                mine = by_name.get(rule.name, [])
            else:
                mine = list(derivation_program(library, [rule], ranks, devices, typing).rules)
            self.session.extend(mine, f"r{index}_", 20_000_000 + loaded)
            loaded += len(mine)
        self._tests = 0

    def derived(self, indices: Sequence[int]) -> list[bool]:
        """For each rule of `indices`: do the kept rules outside `indices` derive all its instances?"""
        excluded = set(indices)
        others = [f"r{i}_" for i in sorted(self.alive - excluded)]
        out = [False] * len(indices)
        if not others:
            return out
        self._tests += 1
        name = f"without{self._tests}_"
        for ruleset in RULESETS:
            self.session.combine_rulesets(name + ruleset, [o + ruleset for o in others])
        self.session.push()
        try:
            checks: list[tuple[int, str, str]] = []
            for slot, index in enumerate(indices):
                found = self.instances[index]
                written = []
                for k, instance in enumerate(found):
                    one = write_instance(instance, self.devices, prefix=f"t{self._tests}_{index}_{k}_")
                    if one is None:
                        break
                    written.append(one)
                if not found or len(written) < len(found):
                    continue      # an instance that cannot be written is never derived
                for writer, left, right in written:
                    for chunk in writer.lines:
                        self.session.load(chunk)
                    checks.append((slot, left, right))
            if not checks:
                return out
            _saturate(self.session, [name + r for r in RULESETS], self.limits)
            slots = {slot for slot, _, _ in checks}
            for slot in slots:
                out[slot] = True
            for slot, left, right in checks:
                if out[slot] and not self.session.holds(left, right):
                    out[slot] = False
            return out
        finally:
            self.session.pop()

    def drop(self, index: int) -> None:
        self.alive.discard(index)


def introduces_parallelism(rule: ast.RuleDecl) -> bool:
    """A degree metavariable on the right side only (`matmul(x, w) => combine(matmul(partition(x, 0, p), ...))`)."""
    left = {n.id for n in ast.walk(rule.lhs) if isinstance(n, ast.Name)}
    right = {n.id for n in ast.walk(rule.rhs) if isinstance(n, ast.Name)}
    degrees = {b.name for b in rule.binders if not b.is_tensor and b.type.kind == "degree"}
    return bool((right - left) & degrees)


def typed(rule: ast.RuleDecl, library: Library) -> RuleInstance:
    """The rule typed with every variadic group empty (generated rules have fixed ranks)."""
    from parsat.dsl.typecheck import rule_groups

    return type_rule(rule, library.ops, {g: 0 for g in rule_groups(rule)})


def safe_typed(rule: ast.RuleDecl, library: Library) -> RuleInstance | None:
    try:
        return typed(rule, library)
    except TypeCheckError:
        return None
