"""Which rule instances saturation needs: typed at the graph's ranks, and able to match something.

Rank-polymorphic rules are instantiated at every group length the graph's
ranks allow, and only where their left side can match an operator
application the graph or a rule makes (`Signature`): egglog's time per
iteration grows with every rule, so an instance that can never fire is
never compiled. Rules whose left side needs an operator nothing makes are
left out whole (`reachable_rules`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.conditions import symbolic_truth
from parsat.dsl.parallel_ops import PARALLEL_OPS, PARTITION, REPLICATE
from parsat.dsl.typecheck import RuleInstance, TypeCheckError, TypedTerm, group_assignments, type_rule
from parsat.ir.graph import Graph
from parsat.ir.placement import Placement


def _instances_at(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], ranks: set[int]) -> Iterable[RuleInstance]:
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


def _ops_in(expr: ast.Expr) -> set[str]:
    return {n.func for n in ast.walk(expr) if isinstance(n, ast.Call) and n.func not in PARALLEL_OPS}


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
        return term.name, (len(term.shape),), term.dims
    instance = term.instance
    values = tuple(instance.attrs[p.name].constant if instance.attrs[p.name].is_const else None
                   for p in instance.op.attr_params if p.type.kind != "real")
    return term.name, tuple(len(s) for s in instance.input_shapes), values


def graph_signatures(graph: Graph, ops: Mapping[str, ast.OpDecl],
                     pins: Mapping[str, Placement] | None = None) -> set[Signature]:
    """The signatures of the graph's operators and of the parallel terms its pins add
    (`mesh_encoding.mesh_graph_program`)."""
    shapes = graph.shapes()
    found: set[Signature] = set()
    for node in graph.nodes:
        attrs = dict(node.attrs)
        values = tuple(int(attrs[p.name]) for p in ops[node.op].attr_params if p.type.kind != "real")
        found.add((node.op, tuple(len(shapes[i]) for i in node.inputs), values))
    for name, placement in (pins or {}).items():
        rank = len(shapes[name])
        for dim in range(rank):
            if placement.shard_axes(dim):
                found.add((PARTITION, (rank,), (dim,)))
        if placement.replica_axes:
            found.add((REPLICATE, (rank,), ()))
    return found


@dataclass(frozen=True)
class TypedInstance:
    """A typed rule instance with the signatures its left side needs and its right side builds."""

    instance: RuleInstance
    needs: tuple[Signature, ...]
    builds: tuple[Signature, ...]


def typed_instances(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], ranks: set[int], cache: dict) -> list[TypedInstance]:
    key = (rule, frozenset(ranks))
    if key not in cache:
        cache[key] = [TypedInstance(i, tuple(_term_signature(t) for t in i.lhs.walk() if t.kind != "input"),
                             tuple(_term_signature(t) for t in i.rhs.walk() if t.kind != "input"))
                      for i in _instances_at(rule, ops, ranks)]
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


def reachable_instances(typed: Sequence[TypedInstance], signatures: Iterable[Signature]) -> list[bool]:
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
