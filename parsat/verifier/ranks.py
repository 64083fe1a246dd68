"""Which rank assignments of a rule to search and prove, and whether they cover every rank.

A rank-polymorphic rule (`forall x: [*a, n, *b]`) stands for infinitely
many instances, one per length of each group. Enumerating lengths up to a
bound proves only those; this module gives the argument that covers the
rest, over the group, when the rule's structure allows it:

**Collapse.** Call a group *batch-like* when, in every tensor of both
sides, two adjacent dims of the group (`a_k`, `a_k+1`) sit next to each
other, are never split, and every operator only carries them through:
its output has them where its inputs do, each read is by the same two
plain index variables at those positions, and the variables (and the
sizes of those dims) appear nowhere else: no arithmetic, no condition,
no sum. Then reading the two dims as one dim of size `a_k * a_k+1`
(row-major) maps every tensor of the instance with the group at length
L + 1 to the instance at length L, commuting with every operator on both
sides; so the rule at length L + 1 and sizes S holds exactly when it
holds at length L with the merged size, which the proof at length L
covers (it is for all sizes). By induction every length >= 1 reduces to
length 1; length 0 is proved too. So a rule whose groups are all
batch-like is PROVED for every rank by proving each group at lengths 0
and 1.

That merging commutes needs two things, checked in this order:
* **Uniformity** (`verifier.uniform`, for every length at once): nothing
  depends on a group's length but the positions the group pushes along.
  The rule is typed symbolically, each shape a sequence of runs and
  single dims and every integer that mentions `len(g)` a polynomial in
  the lengths; a degree, a size, an amount, a `where` or an operator's
  semantics that mentions a length, a dim picked by `len(a) % 5`, or an
  operator group that takes part of a run, is not uniform. At every
  length each operator is then the same template over the same runs, so
  the instance at L + 1, merged, is the instance at L.
* **Plain carrying** (below): each operator reads the group's dims by
  plain index variables used nowhere else. It is checked on the typed
  instances, for each group at length 2 with every other group at 0 or
  1, and at length 3 (both adjacent pairs) with the others at 1; by
  uniformity every operator expands the group's indices the same way at
  every length, so what holds for a pair there holds for every pair at
  every length.

A rule with a group that is not batch-like is proved at every rank up to
`MAX_RANK` and is BOUNDED there (searched up to `SEARCH_MAX_RANK`).

`plan` also finds rank assignments where the left side types and the
right side does not: the rule would rewrite a term into nothing, which is
a counterexample, not a rank to skip silently.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Mapping

from parsat.dsl import ast
from parsat.dsl.symbolic import ONE, Poly
from parsat.dsl.typecheck import (RuleInstance, TypeCheckError, TypedTerm, check_rhs_bound, group_dim,
                                  rule_groups, type_rule)
from parsat.verifier.uniform import why_not_uniform

MAX_RANK = 5          # the bound for rules whose groups are not batch-like
SEARCH_MAX_RANK = 8   # ... which are still searched up to the largest rank the optimizer compiles
SEARCH_MAX_INSTANCES = 40
SEARCH_MAX_GROUP = 2  # batch-like groups: also searched with every group at this length (proved at 0 and 1)


@dataclass
class RankPlan:
    """The typed instances to search and to prove, and what they cover."""

    search: list[RuleInstance] = field(default_factory=list)   # smallest ranks first
    proof: list[RuleInstance] = field(default_factory=list)
    max_rank: int | None = None       # None: the proofs cover every rank
    why_bounded: str = ""             # the group that is not batch-like, and why
    rhs_untyped: list[tuple[dict, str]] = field(default_factory=list)  # (groups, error) where only the left types


def _ranks(rule: ast.RuleDecl, groups: Mapping[str, int]) -> list[int]:
    return [sum(groups[d.id] if isinstance(d, ast.Variadic) else 1 for d in b.type.dims)
            for b in rule.binders if isinstance(b.type, ast.ShapeType)]


def top_rank(rule: ast.RuleDecl, groups: Mapping[str, int]) -> int:
    """The largest rank of a tensor metavariable at these group lengths (0 without any)."""
    return max(_ranks(rule, groups), default=0)


def _assignments(rule: ast.RuleDecl, lengths: range | tuple, max_rank: int) -> list[dict[str, int]]:
    groups = rule_groups(rule)
    out = []
    for values in itertools.product(lengths, repeat=len(groups)):
        assignment = dict(zip(groups, values))
        if all(r <= max_rank for r in _ranks(rule, assignment)):
            out.append(assignment)
    return sorted(out, key=lambda g: (top_rank(rule, g), sum(g.values()), sorted(g.items())))


class _Typer:
    """Types a rule at group lengths, remembering the outcome (a rank error is None)."""

    def __init__(self, rule: ast.RuleDecl, ops):
        self.rule, self.ops = rule, ops
        self.left_only = replace(rule, rhs=rule.lhs)
        self.cache: dict[tuple, RuleInstance | None] = {}
        self.rhs_untyped: list[tuple[dict, str]] = []

    def __call__(self, groups: Mapping[str, int]) -> RuleInstance | None:
        key = tuple(sorted(groups.items()))
        if key in self.cache:
            return self.cache[key]
        try:
            typed = type_rule(self.rule, self.ops, groups)
        except TypeCheckError as err:
            if err.kind != "rank":
                raise
            typed = None
            try:
                type_rule(self.left_only, self.ops, groups)
            except TypeCheckError:
                pass  # the left side does not type either: the rule does not apply at these ranks
            else:
                self.rhs_untyped.append((dict(groups), str(err)))
        self.cache[key] = typed
        return typed


def plan(rule: ast.RuleDecl, ops) -> RankPlan:
    """The rank plan of a rule (raises TypeCheckError for a malformed rule)."""
    check_rhs_bound(rule)
    typer = _Typer(rule, ops)
    groups = rule_groups(rule)
    result = RankPlan()
    if not groups:
        typed = typer({})
        result.search = result.proof = [typed] if typed is not None else []
        result.rhs_untyped = typer.rhs_untyped
        return result
    why = _not_batch_like(rule, groups, typer)
    if why is None:
        proof = [typer(g) for g in _assignments(rule, (0, 1), 10 ** 6)]
        longer = typer({g: SEARCH_MAX_GROUP for g in groups})  # one longer instance, searched only
        search = proof + ([longer] if longer is not None else [])
    else:
        proof = [typer(g) for g in _assignments(rule, range(MAX_RANK + 1), MAX_RANK)]
        beyond = [g for g in _assignments(rule, range(SEARCH_MAX_RANK + 1), SEARCH_MAX_RANK)
                  if top_rank(rule, g) > MAX_RANK]
        search = proof + [typer(g) for g in beyond[:SEARCH_MAX_INSTANCES]]
        result.max_rank, result.why_bounded = MAX_RANK, why
    result.proof = [t for t in proof if t is not None]
    result.search = [t for t in search if t is not None]
    result.rhs_untyped = typer.rhs_untyped
    return result


# ---------------------------------------------------------------- batch-like groups


def _not_batch_like(rule: ast.RuleDecl, groups: list[str], typer: _Typer) -> str | None:
    """None when every group is batch-like (module docstring), else why one is not."""
    why = why_not_uniform(rule, typer.ops)
    if why is not None:
        return f"not uniform in the lengths of its groups: {why}"
    for g in groups:
        others = [h for h in groups if h != g]
        checks = [({**dict(zip(others, values)), g: 2}, (0,)) for values in itertools.product((0, 1),
                                                                                             repeat=len(others))]
        checks.append(({**{h: 1 for h in others}, g: 3}, (0, 1)))
        seen = 0
        for assignment, pairs in checks:
            typed = typer(assignment)
            if typed is None:
                continue
            seen += 1
            for k in pairs:
                problem = _pair_problem(typed, Poly.sym(group_dim(g, k)), Poly.sym(group_dim(g, k + 1)))
                if problem is not None:
                    return f"group *{g} is not batch-like: {problem}"
        if not seen:
            return f"group *{g} could not be checked: the rule does not type with it at length 2 or 3"
    return None


def _positions(shape: tuple[Poly, ...], first: Poly, second: Poly) -> tuple[int, int] | None | str:
    """(i, i + 1) where the pair sits, None when absent, or a problem."""
    names = first.symbols() | second.symbols()
    where_first = [i for i, d in enumerate(shape) if d == first]
    where_second = [i for i, d in enumerate(shape) if d == second]
    mixed = [i for i, d in enumerate(shape) if d.symbols() & names and d not in (first, second)]
    if mixed:
        return f"a dim of size {shape[mixed[0]]} mixes the group's sizes"
    if not where_first and not where_second:
        return None
    if len(where_first) != 1 or len(where_second) != 1 or where_second[0] != where_first[0] + 1:
        return ("a tensor does not hold two adjacent dims of the group side by side (an operator removes, "
                "moves or repeats one)")
    return where_first[0], where_second[0]


def _pair_problem(instance: RuleInstance, first: Poly, second: Poly) -> str | None:
    for side in (instance.lhs, instance.rhs):
        for term in side.walk():
            found = _positions(term.shape, first, second)
            if isinstance(found, str):
                return found
            if found is not None and any(term.spread.shard[i] != ONE for i in found):
                return "a dim of the group is split"
            if term.kind == "parallel" and found is not None and term.dim in found:
                return f"{term.name} acts on a dim of the group"
            if term.kind == "op":
                problem = _op_problem(term, found, first, second)
                if problem is not None:
                    return problem
    return None


def _op_problem(term: TypedTerm, out: tuple[int, int] | None, first: Poly, second: Poly) -> str | None:
    instance = term.instance
    name = instance.name
    group_symbols = first.symbols() | second.symbols()
    if any(isinstance(n, ast.Len) for n in ast.walk(instance.body)):
        return f"{name}'s semantics uses the length of a group as a value"
    for attr, value in instance.attrs.items():
        if value.symbols() & group_symbols:
            return f"{name}'s attribute '{attr}' depends on the group's sizes"
    out_vars = (instance.out_vars[out[0]], instance.out_vars[out[1]]) if out is not None else None
    allowed: set[int] = set()  # id() of the Name nodes that read the pair
    for param, arg in zip(instance.inputs, term.args):
        found = _positions(arg.shape, first, second)
        if isinstance(found, str):
            return found
        if found is None:
            continue
        if out_vars is None:
            return f"{name} reduces over the group's dims"
        for access in (n for n in ast.walk(instance.body) if isinstance(n, ast.Access) and n.tensor == param):
            for position, var in zip(found, out_vars):
                index = access.indices[position]
                if not (isinstance(index, ast.Name) and index.id == var):
                    return f"{name} reads the group's dims of '{param}' through something else than its output indices"
                allowed.add(id(index))
    if out_vars is not None:
        for node in ast.walk(instance.body):
            if isinstance(node, ast.Name) and node.id in out_vars and id(node) not in allowed:
                return f"{name} uses the group's index '{node.id.replace('#', '')}' in its arithmetic"
    sized = {n for n, v in instance.dims.items() if v in (first, second)}
    used = {n.id for n in ast.walk(instance.body) if isinstance(n, ast.Name)} | {
        n.id for s in ast.walk(instance.body) if isinstance(s, ast.RANGE_BINDERS) for n in ast.walk(s.bound)
        if isinstance(n, ast.Name)}
    if sized & used:
        return f"{name} uses the size of a dim of the group"
    return None
