"""Candidate rules from groups of equal terms: pairs, canonical forms, names, typed rule declarations.

A value group of the enumeration (`generate.enumerate`) is a set of terms
that agree on every random input; any two members make a candidate rule,
which only the verifier can confirm. This module turns groups into
candidates and candidates into rule declarations the checker accepts.

Two candidates that differ only by which metavariable of a kind they use,
or by the order of a commutative operator's arguments, are one rule: the
canonical key (`Canon.key`) renames metavariables in order of appearance and
takes the smallest text over the argument orders of the operators the
enumeration found commutative. The generator keeps one candidate per key.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.conditions import symbolic_truth
from parsat.dsl.errors import DslError
from parsat.dsl.parallel_ops import COMBINE, PARALLEL_OPS, REDUCE
from parsat.dsl.printer import format_expr
from parsat.dsl.typecheck import RuleInstance, TypeCheckError, check_rhs_bound, type_rule
from parsat.generate.enumerate import Enumeration, Vocabulary

COLLECTIVES = (COMBINE, REDUCE)   # all-gather and all-reduce in the forward pass
DEGREE_NAMES = ("p", "q")             # the enumeration's degree symbols (generate.enumerate)
MAX_COMMUTED = 4                      # commutative nodes whose argument orders a key tries (2**4 texts)


@dataclass(frozen=True)
class Candidate:
    """A candidate rule and what it is worth."""

    rule: ast.RuleDecl
    size: int                        # operators on both sides (spread leaves included)
    score: tuple[int, int, int]      # (collectives removed, parallel ops removed, operators removed)
    key: str                         # canonical text (see the module docstring)
    generality: int = 0              # see `generality`

    @property
    def order(self) -> tuple:
        """Small first, then general, then most useful: the order rules are decided in.

        A general rule decided first makes its instances derivable, so they
        are never proved.
        """
        return (self.size, -self.generality, [-s for s in self.score], self.key)


def generality(lhs: ast.Expr, rhs: ast.Expr) -> int:
    """Distinct names a rule uses, less two per product of names (`p * q` is an instance of `p`).

    `add(x, y)` is more general than `add(x, x)`, `partition(replicate(x, p), 0, q)`
    than `partition(replicate(x, p), 0, p)`, and `partition(x, 0, p)` than
    `partition(x, 0, p * q)`.
    """
    names = names_used(lhs) | names_used(rhs)
    products = sum(1 for side in (lhs, rhs) for n in ast.walk(side)
                   if isinstance(n, ast.BinOp) and n.op == "*" and isinstance(n.left, ast.Name))
    return len(names) - 2 * products


def ops_of(expr: ast.Expr) -> list[str]:
    return [n.func for n in ast.walk(expr) if isinstance(n, ast.Call)]


def names_used(expr: ast.Expr) -> set[str]:
    return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}


def score(lhs: ast.Expr, rhs: ast.Expr) -> tuple[int, int, int]:
    """How much applying lhs => rhs saves: collectives, then parallel ops, then operators."""
    left, right = ops_of(lhs), ops_of(rhs)

    def count(ops, names):
        return sum(1 for o in ops if o in names)

    return (count(left, COLLECTIVES) - count(right, COLLECTIVES),
            count(left, PARALLEL_OPS) - count(right, PARALLEL_OPS), len(left) - len(right))


# ------------------------------------------------------------------ canonical keys


def commutative_ops(enumeration: Enumeration) -> frozenset[str]:
    """Operators whose first two tensor arguments commute, as the fingerprints show.

    `f(a, b, attrs)` and `f(b, a, attrs)` over two distinct inputs landing in
    one value group is the evidence (exact fingerprints at several random
    environments; a wrong guess only merges two keys, it never makes a rule
    true: every kept rule is proved).
    """
    found: set[str] = set()
    for members in enumeration.groups.values():
        texts = {t.text for t in members}
        for term in members:
            expr = term.expr
            if not isinstance(expr, ast.Call) or expr.func in found or len(expr.args) < 2:
                continue
            a, b = expr.args[0], expr.args[1]
            if isinstance(a, ast.Name) and isinstance(b, ast.Name) and a.id != b.id:
                swapped = ast.Call(expr.func, (b, a) + expr.args[2:])
                if format_expr(swapped) in texts:
                    found.add(expr.func)
    return frozenset(found)


def _orders(expr: ast.Expr, commutative: frozenset[str], budget: list[int]) -> list[ast.Expr]:
    """`expr` with the arguments of commutative calls in both orders (at most MAX_COMMUTED nodes flipped)."""
    if not isinstance(expr, ast.Call):
        return [expr]
    choices = [_orders(arg, commutative, budget) for arg in expr.args]
    out = []
    for args in itertools.product(*choices):
        out.append(ast.Call(expr.func, tuple(args)))
        if expr.func in commutative and len(args) >= 2 and budget[0] > 0:
            out.append(ast.Call(expr.func, (args[1], args[0]) + tuple(args[2:])))
    if expr.func in commutative:
        budget[0] -= 1
    return out


_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?!\w)(?!\()")


def alpha_text(text: str, shapes: Mapping[str, Sequence[str]], tail: Sequence[str] = ()) -> str:
    """`text` (a rule's `lhs => rhs`) with every name renamed in order of first appearance.

    Tensors become t0, t1, ...; every other name (dims, groups, degrees,
    ints, reals) s0, s1, ...; a tensor's dims are numbered when the tensor
    first appears. The tensors' shapes and the `tail` texts (conditions) are
    renamed the same way and appended, sorted, so two rules that differ only
    by their names get one text.
    """
    tensors: dict[str, str] = {}
    others: dict[str, str] = {}

    def other(name: str) -> str:
        return others.setdefault(name, f"s{len(others)}")

    for token in _TOKEN.findall(text):
        if token in shapes:
            if token not in tensors:
                tensors[token] = f"t{len(tensors)}"
                for dim in shapes[token]:
                    other(dim)
        else:
            other(token)
    rename = lambda m: tensors.get(m.group(0)) or other(m.group(0))  # noqa: E731
    body = _TOKEN.sub(rename, text)
    tags = [f"{tensors[t]}:[{','.join(other(d) for d in shapes[t])}]" for t in tensors]
    conds = sorted(_TOKEN.sub(rename, c) for c in tail)
    return body + " | " + " ".join(tags) + (" | " + ", ".join(conds) if conds else "")


_PRODUCT = re.compile(r"\b(s\d+) \* (s\d+)\b")


def _sorted_products(text: str) -> str:
    return _PRODUCT.sub(lambda m: " * ".join(sorted((m.group(1), m.group(2)))), text)


_NAME_PRODUCT = re.compile(r"\b([A-Za-z_]\w*) \* ([A-Za-z_]\w*)\b(?!\()")


def _degree_orders(text: str, degrees: Sequence[str]) -> list[str]:
    """`text` under every permutation of its degree names (p and q play the same part), each also with the
    factors of its products of two names swapped.

    Names are numbered by first appearance (`alpha_text`), so `p * q` and
    `q * p` number p and q differently though the product commutes:
    without the swapped texts, `combine(partition(partition(x, 0, p * q), 1, p), 1, p)` and the same rule
    with `q` in the outer two places got two identities.
    """
    texts = [text]
    if len(degrees) >= 2:
        texts = []
        for perm in itertools.permutations(degrees):
            mapping = dict(zip(degrees, perm))
            texts.append(re.sub(r"[A-Za-z_]\w*", lambda m: mapping.get(m.group(0), m.group(0)), text))
    out = []
    for variant in texts:
        out.append(variant)
        swapped = _NAME_PRODUCT.sub(lambda m: f"{m.group(2)} * {m.group(1)}", variant)
        if swapped != variant:
            out.append(swapped)
    return out


def rule_identity(rule: ast.RuleDecl, commutative: frozenset[str] = frozenset()) -> str:
    """What a rule says, up to the names of its metavariables, sizes, groups and degrees, and the order of
    the arguments of `commutative` operators."""
    shapes = {b.name: [d.id if isinstance(d, ast.Variadic) else format_expr(d) for d in b.type.dims]
              for b in rule.binders if b.is_tensor}
    degrees = [b.name for b in rule.binders if not b.is_tensor and b.type.kind == "degree"]
    where = [format_expr(w) for w in rule.where]
    keys = []
    budget = [MAX_COMMUTED]
    for left in _orders(rule.lhs, commutative, budget):
        for right in _orders(rule.rhs, commutative, [MAX_COMMUTED]):
            if left == right and (left, right) != (rule.lhs, rule.rhs):
                continue   # a commutation rule keeps its own text
            text = format_expr(left) + " => " + format_expr(right)
            for variant in _degree_orders(text + " ;; " + " ;; ".join(where), degrees):
                body, *conds = variant.split(" ;; ")
                keys.append(_sorted_products(alpha_text(body, shapes, [c for c in conds if c])))
    return min(keys)


@dataclass(frozen=True)
class Canon:
    """Canonical keys of candidate rules over one vocabulary."""

    shapes: Mapping[str, tuple[str, ...]]     # input name -> dims
    commutative: frozenset[str] = frozenset()

    @classmethod
    def of(cls, vocab: Vocabulary, commutative: Iterable[str] = ()) -> "Canon":
        return cls({v.name: v.dims for v in vocab.inputs}, frozenset(commutative))

    def _renamed(self, text: str) -> str:
        return min(_sorted_products(alpha_text(t, self.shapes)) for t in _degree_orders(text, DEGREE_NAMES))

    def key(self, lhs: ast.Expr, rhs: ast.Expr) -> str:
        """The smallest renamed text over the argument orders of commutative operators.

        A rule that only commutes arguments (`add(x, y) => add(y, x)`) keeps
        its own key: its sides would otherwise collapse into one.
        """
        plain = self._renamed(format_expr(lhs) + " => " + format_expr(rhs))
        if not self.commutative:
            return plain
        lefts = _orders(lhs, self.commutative, [MAX_COMMUTED])
        rights = _orders(rhs, self.commutative, [MAX_COMMUTED])
        best = None
        for left in lefts:
            for right in rights:
                if left == right:
                    return plain  # a commutation rule
                text = self._renamed(format_expr(left) + " => " + format_expr(right))
                best = text if best is None or text < best else best
        return best or plain


# ------------------------------------------------------------------ pairs


def compute_ops(expr: ast.Expr) -> list[str]:
    return [o for o in ops_of(expr) if o not in PARALLEL_OPS]


def worth_expanding(small: ast.Expr, large: ast.Expr) -> bool:
    """Whether `small => large` (away from a group's smallest member) can be worth a rule.

    It is when it distributes or factors (the large side applies no
    operator the small one does not: `matmul(x, add(w, v))` =>
    `add(matmul(x, w), matmul(x, v))`) or introduces parallelism (more
    parallel operators, no new compute operator). A large side with an
    operator of its own (`split(x, 0, 0, z)` => `split(concat(x, x, 0), 0, 0, z)`)
    only grows the e-graph, and so does one that merely wraps the small side
    (`relu(x)` => `relu(relu(x))`).
    """
    if any(node == small for node in ast.walk(large)):
        return False
    return set(compute_ops(large)) <= set(compute_ops(small))


def pairs(enumeration: Enumeration, canon: Canon) -> list[tuple[ast.Expr, ast.Expr, str]]:
    """(lhs, rhs, key) per group member and the group's smallest member, both directions, one per key.

    Towards the small member a rule simplifies; away from it, it distributes
    or introduces parallelism (`worth_expanding`). Between members that
    apply as many operators, neither is smaller (the head is only first by
    text), so both directions are lateral rewrites, fusions among them
    (`add(matmul(x, w), matmul(y, v))` => `matmul(concat(x, y, 1), concat(w, v, 0))`).
    """
    out: list[tuple[ast.Expr, ast.Expr, str]] = []
    seen: set[str] = set()
    for members in enumeration.groups.values():
        if len(members) < 2:
            continue
        ordered = sorted(members, key=lambda t: (t.ops, len(t.text), t.text))
        head = ordered[0]
        for other in ordered[1:]:
            for lhs, rhs in ((other.expr, head.expr), (head.expr, other.expr)):
                if not isinstance(lhs, ast.Call):
                    continue
                if lhs is head.expr and other.ops > head.ops and not worth_expanding(lhs, rhs):
                    continue
                key = canon.key(lhs, rhs)
                if key in seen:
                    continue
                seen.add(key)
                out.append((lhs, rhs, key))
    return out


# ------------------------------------------------------------------ rule declarations


def requirements(instance: RuleInstance) -> list[str]:
    """The right side's requirements that the left side does not state (as text): the rule's `where`."""
    given = set(instance.lhs_requires) | set(instance.where)
    out = []
    for cond in instance.rhs_requires:
        if cond not in given and symbolic_truth(cond) is not True and str(cond) not in out:
            out.append(str(cond))
    return out


def rule_name(lhs: ast.Expr, rhs: ast.Expr, taken: set[str], prefix: str = "gen") -> str:
    """`PREFIX_LEFTOPS__to__RIGHTOPS`, numbered when taken (`--prefix` keeps two generated files apart)."""
    left = "_".join(dict.fromkeys(ops_of(lhs))) or "x"
    right = "_".join(dict.fromkeys(ops_of(rhs))) or "id"
    stem = f"{prefix}_{left}__to__{right}"
    name, k = stem, 2
    while name in taken:
        name, k = f"{stem}_{k}", k + 1
    taken.add(name)
    return name


def binder_text(binder: ast.Param) -> str:
    if binder.is_tensor:
        dims = ", ".join(f"*{d.id}" if isinstance(d, ast.Variadic) else format_expr(d) for d in binder.type.dims)
        return f"{binder.name}: [{dims}]"
    return f"{binder.name}: {binder.type.kind}"


def make_rule(ops: Mapping[str, ast.OpDecl], binders: Sequence[ast.Param], lhs: ast.Expr, rhs: ast.Expr,
              name: str, where: Sequence[str] = ()) -> ast.RuleDecl | None:
    """The rule `lhs => rhs` over the `binders` it uses, with the `where` its right side needs, parsed back.

    None when it does not type. The comment says what the rule does.
    """
    from parsat.dsl.parser import parse

    used = names_used(lhs) | names_used(rhs)
    for binder in binders:
        if binder.is_tensor and binder.name in used:
            used |= {d.id for d in binder.type.dims if isinstance(d, ast.Variadic)}
    binders = [b for b in binders if b.name in used]
    draft = ast.RuleDecl(name, tuple(binders), (), lhs, rhs)
    try:
        check_rhs_bound(draft)
        instance = type_rule(draft, ops, _zero_groups(draft))
    except (TypeCheckError, KeyError, ZeroDivisionError):
        return None
    conditions = list(where) + [c for c in requirements(instance) if c not in where]
    removed = score(lhs, rhs)
    doc = f"Generated: {format_expr(lhs)} equals {format_expr(rhs)}"
    if removed[0] > 0 or removed[1] > 0:
        doc += f" (removes {removed[0]} collective(s), {removed[1]} parallel op(s))."
    else:
        doc += "."
    lines = [f"# {doc}", f"rule {name}:", "  forall " + ", ".join(binder_text(b) for b in binders)]
    if conditions:
        lines.append("  where " + ", ".join(conditions))
    lines.append(f"  {format_expr(lhs)} => {format_expr(rhs)}")
    try:
        module = parse("\n".join(lines) + "\n", "<generated>")
    except DslError:
        return None
    rules = [d for d in module.items if isinstance(d, ast.RuleDecl)]
    if not rules:
        return None
    unique = {format_expr(w): w for w in rules[0].where}      # the same condition from two sources, once
    return replace(rules[0], where=tuple(unique.values()))


def _zero_groups(rule: ast.RuleDecl) -> dict[str, int]:
    from parsat.dsl.typecheck import rule_groups

    return {g: 0 for g in rule_groups(rule)}


def candidate(ops: Mapping[str, ast.OpDecl], vocab: Vocabulary, lhs: ast.Expr, rhs: ast.Expr, key: str,
              taken: set[str], prefix: str = "gen") -> Candidate | None:
    """The typed candidate for a pair (None: it does not type or the checker refuses it)."""
    from parsat.dsl.checker import check_rule

    rule = make_rule(ops, vocab.binders(), lhs, rhs, rule_name(lhs, rhs, taken, prefix))
    if rule is None:
        return None
    try:
        check_rule(rule, ops)
    except TypeCheckError:
        return None
    return Candidate(rule, len(ops_of(lhs)) + len(ops_of(rhs)), score(lhs, rhs), key, generality(lhs, rhs))
