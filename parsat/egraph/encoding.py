"""The egglog encoding of tensors and parallel terms, and the input graph written in it.

The encoding is shared by everything that writes egglog text (`rule_text`
for the rules, `graph_program` here for the graph, the rule generator's
ground terms) and read back by `session`:

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
* The ruleset `shape` derives, for every whole e-class, `Whole c =
  (S<rank> dim...)` from the rows above, so a rule binds a metavariable's
  dims with one lookup (`rule_text`).
* Provenance: every e-node has a row `Made_<constructor>(args..., who)`
  naming the rule that built it (or GRAPH_MADE for the input graph's own
  operators), so a plan can say which rules made it; and every rule
  application writes `(Applied_<sorts> index match...)` (`rule_text.RuleBody`),
  one relation for every rule whose recorded columns have those sorts
  (`applied_relation`), so a plan can follow what each application read
  back to the graph (`derivation`, `search.provenance`).

Real attributes are written as strings (their shortest repr), so equal
reals are equal constants.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.conditions import Rel
from parsat.dsl.parallel_ops import PARALLEL_OPS, PARTITION, REPLICATE
from parsat.dsl.symbolic import Poly
from parsat.ir.graph import Graph, OpNode
from parsat.ir.pcg import Degrees

ANALYSES = ("Rank", "Dim", "Shard", "Copy", "Psum", "Pieces")
MAX_RANK = 8             # tensors a rule's metavariable can match have at most this rank
SHAPE_RULESET = "shape"  # derives `Whole` from the analysis rows; runs before every other ruleset
RULESETS = ("alg", "par")
RULESET_NAMES = {"alg": "algebraic", "par": "parallel"}   # as the plan JSON names them (`saturation.rules_compiled`)
MADE_PREFIX = "Made_"    # Made_<constructor>(children..., attributes..., who): the rules (or the graph) that made an e-node
GRAPH_MADE = ""          # `who` for the input graph's own operators
EQUATED = "Equated"      # Equated(class, who): a rule whose right side is a metavariable equated this class with it
APPLIED_PREFIX = "Applied_"  # Applied_<sorts>(index, recorded match...): the matches rule <index> applied
MATCH_SUFFIX = "/match"  # a rule's pattern half is named after the rule with this suffix (`rule_text.RuleBody`)
LIVE = "Live"            # Live(key): a gated rule runs while its row is there (`Session.run`'s match budget)


class SkipRule(Exception):
    """A rule instance with no egglog form here (a guard that never holds, a size the left side does not bind,
    a rank beyond MAX_RANK); the message is the reason `rules_skipped` reports."""


def ctor(op: str) -> str:
    return f"P_{op}" if op in PARALLEL_OPS else f"Op_{op}"


def quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def applied_relation(sorts: Sequence[str]) -> str:
    """The relation the rules whose recorded match (`rule_text.RuleBody.applied_variables`) has the column sorts
    `sorts` write their applications in, each row led by the rule's index (`CompiledRule.index`).

    One relation per rule (`Applied<index>`) made the program's tables and names grow with its rules, and
    egglog pays for both: it copies its map of every declared name for each rule it compiles (the shadowing
    check; half of loading a 2-axis program), and rebuilds, counts (`print-size`) and freezes every table.
    llama-70b:64's 2-axis meshes' 641 rules share 16 such relations. Nothing reads them but the read-back
    (`derivation`): no rule joins them, and writing a relation row allocates no e-class id, so the e-graph,
    its ids and every rule's matches are those of one relation per rule, and so are each rule's rows, as a
    multiset: egglog's rebuild may leave a rule's rows in another order in a shared table than in a table of
    its own (tests/test_applied_relations.py; benchmarks/search_results.md, session 71, helper E)."""
    return APPLIED_PREFIX + "_".join(sorts)


def applied_declaration(sorts: Sequence[str]) -> str:
    return f"(relation {applied_relation(sorts)} (i64 {' '.join(sorts)}))"


def live_row(key: str) -> str:
    """The row a gated rule's two halves join with (`rule_text.RuleBody.text`): deleting it holds the rule back."""
    return f"({LIVE} {quote(key)})"


def real_literal(value: float) -> str:
    """Real attributes are stored as their shortest repr, so equal reals are equal strings."""
    return quote(repr(float(value)))


def made_row(constructor: str, args: Sequence[str], who: str) -> str:
    """The provenance row of the term `(constructor args...)`: `who` made it (a rule's name, or GRAPH_MADE).

    Rows are per e-node (constructor and canonical children), not per
    e-class, so after unions they still say which rule built each
    alternative; a plan's rules are the makers of the e-nodes it extracts.
    """
    return f"({MADE_PREFIX}{constructor} {' '.join(args)} {quote(who)})"


def equated_row(root: str, who: str) -> str:
    """The provenance row of a rule that builds nothing (`combine(partition(x, d, p), d, p) => x`): it only
    equates its match's class with a class that already exists, so no e-node names it; this row names it on
    the class (rows follow their class through later unions)."""
    return f"({EQUATED} {root} {quote(who)})"


def equated_relation() -> str:
    return f"(relation {EQUATED} (T String))"


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


def rel_fact(rel: Rel, names: Mapping[str, str]) -> str:
    left, right = poly_expr(rel.left, names), poly_expr(rel.right, names)
    if rel.op == "==":
        return f"(= {left} {right})"
    return f"({rel.op} {left} {right})"


def match_ruleset(ruleset: str) -> str:
    """The ruleset of the pattern-matching halves of `ruleset`'s rules (see `RuleBody`)."""
    return ruleset + "_match"


def shape_term(dims: Sequence[str]) -> str:
    return f"(S{len(dims)}{''.join(' ' + d for d in dims)})"


def layout_chain(var: str, degrees: Degrees) -> list[tuple[str, str, Degrees]]:
    """Parallel terms that bring a whole tensor to `degrees` (partitions, then replicate)."""
    out = []
    current = Degrees.whole(len(degrees.shard))
    expr = var
    for dim, degree in enumerate(degrees.shard):
        if degree > 1:
            current = Degrees(tuple(d * degree if i == dim else d for i, d in enumerate(current.shard)), current.copy)
            expr = f"({ctor(PARTITION)} {expr} {dim} {degree})"
            out.append((expr, PARTITION, current))
    if degrees.copy > 1:
        current = Degrees(current.shard, degrees.copy)
        expr = f"({ctor(REPLICATE)} {expr} {degrees.copy})"
        out.append((expr, REPLICATE, current))
    return out


PIN_SUFFIX = "@pinned"


def node_arguments(op: ast.OpDecl, node: OpNode, names: Mapping[str, str]) -> list[str]:
    """A graph node's constructor arguments in the operator's parameter order: its tensors by their egglog
    variables in `names`, its attributes as literals."""
    args = []
    tensors = iter(node.inputs)
    attrs = dict(node.attrs)
    for param in op.params:
        if param.is_tensor:
            args.append(names[next(tensors)])
        elif param.type.kind == "real":
            args.append(real_literal(attrs[param.name]))
        else:
            args.append(str(int(attrs[param.name])))
    return args


def graph_program(graph: Graph, ops: Mapping[str, ast.OpDecl],
                  pins: Mapping[str, Degrees] | None = None) -> tuple[str, dict[str, str]]:
    """One `let` per leaf and per operator (a DAG, not a tree), with analysis rows.

    `pins` fixes placements: for an output, the parallel terms that bring it to
    that placement are added and become the extraction root ("pin:NAME"); for a
    graph input, the input *arrives* in that layout: its parallel terms are
    unioned with a second leaf `Leaf "NAME@pinned"` (free), so the whole
    input is what costs a gather. Returns the text and, for each graph
    tensor (and each pin), the global variable naming its e-class.
    """
    lines: list[str] = []
    names: dict[str, str] = {}
    shapes = graph.shapes()
    inputs = {leaf.name for leaf in graph.leaves if leaf.role == "input"}

    def rows(var: str, shape: Sequence[int], degrees: Degrees) -> None:
        lines.append(f"(set (Rank {var}) {len(shape)})")
        for i, d in enumerate(shape):
            lines.append(f"(set (Dim {var} {i}) {d})")
            lines.append(f"(set (Shard {var} {i}) {degrees.shard[i]})")
        lines.append(f"(set (Copy {var}) {degrees.copy})")
        lines.append(f"(set (Psum {var}) {degrees.sum})")
        lines.append(f"(set (Pieces {var}) {degrees.pieces})")

    for index, leaf in enumerate(graph.leaves):
        var = f"$l{index}"
        names[leaf.name] = var
        lines.append(f"\n(let {var} (Leaf {quote(leaf.name)}))")
        rows(var, leaf.shape, Degrees.whole(len(leaf.shape)))
    for index, node in enumerate(graph.nodes):
        var = f"$n{index}"
        names[node.name] = var
        args = node_arguments(ops[node.op], node, names)
        lines.append(f"\n(let {var} ({ctor(node.op)} {' '.join(args)}))")
        lines.append(made_row(ctor(node.op), args, GRAPH_MADE))
        rows(var, node.shape, Degrees.whole(len(node.shape)))
    for pin_index, (name, degrees) in enumerate((pins or {}).items()):
        base = names[name]
        var = base
        for step, (expr, _kind, current) in enumerate(layout_chain(base, degrees)):
            var = f"$p{pin_index}_{step}"
            lines.append(f"\n(let {var} {expr})")
            rows(var, shapes[name], current)
        if name in inputs and var != base:
            lines.append(f"\n(union {var} (Leaf {quote(name + PIN_SUFFIX)}))")
        names[f"pin:{name}"] = var
    return "\n".join(lines) + "\n", names
