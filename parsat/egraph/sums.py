"""Which associativity rules cannot pay off on a graph: sums whose terms come one after the other.

A transformer's residual stream is one long sum, `x + attn_1 + mlp_1 +
attn_2 + ...`, each term computed from the sum of the terms before it.
Associativity with commutativity (`add_assoc`, `add_commute`) writes such
a sum of n terms in every grouping: every one of its 2^n - n - 1 sub-sums
becomes a value, and the class of the whole sum holds 2^n - 2 e-nodes, in
every placement of every mesh. The three searched blocks of a GPT give a
sum of 7 terms: 126 `add` e-nodes in each placement of its classes,
30,920 of the 48,680 e-nodes of gpt-1.3b on the `node 8 x gpu 8` mesh, and
most of its saturation's work (docs/MESH.md, "Sequential sums").

No plan is made cheaper by those groupings. A later term is computed from
the sum of the earlier ones, so every prefix sum is a value the plan
computes anyway (it feeds the later term), and a grouping that adds a
later term to an earlier one before the prefix is complete computes one
more sum of pieces of the same placement, not fewer; the one thing a
grouping can save, a single reduction for several partial terms, needs
the partial terms to be pending at once, which a term computed from the
reduced sum of the one before it cannot be. Where terms are independent
(GPT-J's parallel block `x + attn(ln x) + mlp(ln x)`, a sum of weights),
the grouping can pay off and the rule stays. This argues from the work a
plan does; it is not a proof over the step simulator, so the plans of the
measured rows were compared with and without the cut (docs/MESH.md).

`sequential_cut` says, for a graph and the rules saturation may apply,
which associativity rules are left out and why: only when every sum of the
graph that association could regroup is such a chain, and no rule the
search may apply can make a sum elsewhere (a rule whose right side builds
a new sum, or writes a value as a sum where that value feeds a sum).
`saturate(..., cut_sums=True)`, what the optimizer's mesh searches ask for
(`search.mesh`), leaves them out of the compiled program before it is
loaded, and the result names them (`saturation.rules_cut` in a plan).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.checker import new_values
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.dsl.printer import format_type
from parsat.ir.graph import Graph

REASON = ("every sum of '{graph}' that it could regroup is sequential (each term is computed from the sum of "
          "the terms before it): its groupings make no plan cheaper (docs/MESH.md, \"Sequential sums\")")


def associativity_op(rule: ast.RuleDecl) -> str | None:
    """The operator `f` when `rule` is `f(f(x, y), z) => f(x, f(y, z))` or the other way round (three distinct
    metavariables, in the same order on both sides) on tensors of one shape, else None. One shape: every
    grouping then applies `f` as often to pieces of the same size (an elementwise sum or product), which is
    what the module's argument needs; a matrix product's groupings differ in work (a chain of matmuls is
    cheaper in one order), so its associativity is never cut."""
    lhs, rhs = rule.lhs, rule.rhs
    if not (isinstance(lhs, ast.Call) and isinstance(rhs, ast.Call) and lhs.func == rhs.func
            and lhs.func not in PARALLEL_OPS and len(lhs.args) == 2 and len(rhs.args) == 2):
        return None
    op = lhs.func
    left, right = _terms(lhs, op), _terms(rhs, op)
    if left is None or right is None or len(left) != 3 or left != right or len(set(left)) != 3:
        return None
    shapes = {param.name: param.type for param in rule.binders}
    if len({format_type(shapes[name]) if name in shapes else None for name in left}) != 1:
        return None
    return op if _shape(lhs, op) != _shape(rhs, op) else None


def _terms(term: ast.Expr, op: str) -> tuple[str, ...] | None:
    """The metavariables of a nest of `op`, left to right; None where something else is nested."""
    if isinstance(term, ast.Name):
        return (term.id,)
    if isinstance(term, ast.Call) and term.func == op and len(term.args) == 2:
        parts = [_terms(arg, op) for arg in term.args]
        return None if None in parts else parts[0] + parts[1]
    return None


def _shape(term: ast.Expr, op: str):
    """How a nest of `op` is grouped (the metavariables left out)."""
    return tuple(_shape(arg, op) for arg in term.args) if isinstance(term, ast.Call) else None


def sequential_cut(graph: Graph, rules: Sequence[ast.RuleDecl]) -> dict[str, str]:
    """The associativity rules of `rules` that cannot pay off on `graph` (module doc), each with why. `rules`
    are the ones that can match on the graph: those a rule program for it compiled (`program`: their left
    sides match an operator application the graph or a rule makes), which is what the other rules are checked
    against; an associativity rule of an operator the graph does not apply is kept (a rule may make one)."""
    cut: dict[str, str] = {}
    by_op: dict[str, list[str]] = {}
    ops = {node.op for node in graph.nodes}
    for rule in rules:
        op = associativity_op(rule)
        if op is not None and op in ops:
            by_op.setdefault(op, []).append(rule.name)
    for op, names in by_op.items():
        if _sequential_sums(graph, op) and not _makes_sums(graph, rules, op, set(names)):
            cut.update({name: REASON.format(graph=graph.name) for name in names})
    return cut


def _ops(term: ast.Expr) -> set[str]:
    """The operators a rule side applies, parallel operators left out."""
    return {t.func for t in ast.walk(term) if isinstance(t, ast.Call) and t.func not in PARALLEL_OPS}


def _root(term: ast.Expr) -> str | None:
    """The operator a rule side's value is computed by (parallel operators taken out), None for a metavariable."""
    while isinstance(term, ast.Call) and term.func in PARALLEL_OPS:
        term = term.args[0]
    return term.func if isinstance(term, ast.Call) else None


def _makes_sums(graph: Graph, rules: Iterable[ast.RuleDecl], op: str, own: set[str]) -> bool:
    """Whether a rule other than `op`'s associativity can put a sum where the graph shows none: one that can
    match (`_sum_patterns`) and builds a new value applying `op` (`mul_factor_add`'s `add(y, z)`), or writes a
    kind of value that feeds a sum as a sum itself (`g(...) => op(...)` where `g` feeds a sum). What can match
    is followed from the graph's sums (which operators feed them, which are applied to them) through every
    rule's right side, to a fixed point; a rule whose left side needs a sum in a context nothing makes
    (`mul(x, add(y, z))` where no product is ever taken of a sum) is taken not to match: this is where the
    check trusts the rules' left sides rather than the saturated e-graph (docs/MESH.md, "Sequential sums")."""
    others = [rule for rule in rules if rule.name not in own]
    feed, over = _operand_ops(graph, op), _user_ops(graph, op)
    grew = True
    while grew:
        grew = False
        for rule in others:
            if not _fits(_sum_patterns(rule.lhs, op), feed, over):
                continue
            feeds, users = _sum_patterns(rule.rhs, op)
            lroot, rroot = _root(rule.lhs), _root(rule.rhs)
            if rroot == op and lroot not in (op, None):
                users |= _user_ops(graph, lroot)   # the sum stands where a `g` value stood
            if lroot in feed and rroot is not None:
                feeds.add(rroot)                   # a value that feeds a sum, now also computed by `rroot`
            users |= _applied_to(rule.rhs, _maybe_sums(rule.lhs, over))
            if not (feeds <= feed and users <= over):
                feed, over, grew = feed | feeds, over | users, True
    for rule in others:
        if not _fits(_sum_patterns(rule.lhs, op), feed, over):
            continue
        if any(op in _ops(term) for term in new_values(rule)):
            return True
        lroot = _root(rule.lhs)
        if _root(rule.rhs) == op and lroot != op and (lroot is None or lroot in feed):
            return True
    return False


def _sum_patterns(term: ast.Expr, op: str) -> tuple[set[str], set[str]]:
    """Where a rule side has sums: the operators computing their terms, and the operators applied to them
    (parallel operators looked through; a metavariable names no operator)."""
    feeds: set[str] = set()
    users: set[str] = set()
    for call in (t for t in ast.walk(term) if isinstance(t, ast.Call) and t.func not in PARALLEL_OPS):
        roots = [_root(arg) for arg in call.args]
        if call.func == op:
            feeds |= {root for root in roots if root is not None}
        if op in roots:
            users.add(call.func)
    return feeds, users


def _maybe_sums(term: ast.Expr, over: set[str]) -> set[str]:
    """A left side's metavariables that may stand for a sum: those an operator in `over` is applied to."""
    return {arg.id for call in ast.walk(term) if isinstance(call, ast.Call) and call.func in over
            for arg in call.args if isinstance(arg, ast.Name)}


def _applied_to(term: ast.Expr, names: set[str]) -> set[str]:
    """The operators a right side applies to one of `names` (through parallel operators)."""
    def bare(arg: ast.Expr) -> ast.Expr:
        while isinstance(arg, ast.Call) and arg.func in PARALLEL_OPS:
            arg = arg.args[0]
        return arg
    return {call.func for call in ast.walk(term) if isinstance(call, ast.Call) and call.func not in PARALLEL_OPS
            and any(isinstance(bare(arg), ast.Name) and bare(arg).id in names for arg in call.args)}


def _fits(patterns: tuple[set[str], set[str]], feed: set[str], over: set[str]) -> bool:
    """Whether a left side's sums can be found: each in a context some sum has (`_sum_patterns`)."""
    feeds, users = patterns
    return feeds <= feed and users <= over


def _user_ops(graph: Graph, op: str) -> set[str]:
    """The operators the graph applies to a value an `op` node computes."""
    made = {node.name for node in graph.nodes if node.op == op}
    return {node.op for node in graph.nodes if any(name in made for name in node.inputs)}


def _operand_ops(graph: Graph, op: str) -> set[str]:
    """The operators of the graph's values that feed an `op` node (a leaf counts as "leaf")."""
    by_name = {node.name: node.op for node in graph.nodes}
    return {by_name.get(name, "leaf") for node in graph.nodes if node.op == op for name in node.inputs}


def _sequential_sums(graph: Graph, op: str) -> bool:
    """Whether the graph has a chain of `op` and every `op` node that has an `op` node as an operand is a link of
    one: its other operand is computed from that one (so from every term before it). `op` must be binary. A
    graph with no `op` node over another (BERT's two-term sums between post-norms) has nothing to regroup, and
    the rule is left in: taking it out would save nothing and only renumber egglog's classes, which moves
    extraction's ties and the recorded derivations (`search.provenance`)."""
    nodes = {node.name: node for node in graph.nodes}
    ancestors = _ancestors(graph)
    links = 0
    for node in graph.nodes:
        if node.op != op:
            continue
        if len(node.inputs) != 2:
            return False
        for at, operand in enumerate(node.inputs):
            if operand in nodes and nodes[operand].op == op:
                if not _depends(ancestors, node.inputs[1 - at], operand):
                    return False
                links += 1
    return links > 0


def _ancestors(graph: Graph) -> tuple[Mapping[str, int], Mapping[str, int]]:
    """Each value's strict ancestors as a bit set over the graph's values (leaves, then nodes, in order), and
    each value's bit."""
    index = {leaf.name: i for i, leaf in enumerate(graph.leaves)}
    index.update({node.name: len(graph.leaves) + i for i, node in enumerate(graph.nodes)})
    found = {leaf.name: 0 for leaf in graph.leaves}
    for node in graph.nodes:   # topological order
        bits = 0
        for name in node.inputs:
            bits |= found[name] | (1 << index[name])
        found[node.name] = bits
    return found, index


def _depends(ancestors: tuple[Mapping[str, int], Mapping[str, int]], value: str, on: str) -> bool:
    """Whether `value` is computed from `on`."""
    found, index = ancestors
    return bool(found[value] >> index[on] & 1)
