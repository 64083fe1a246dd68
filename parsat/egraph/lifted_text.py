"""One rule instance, lifted onto a mesh (`lifting`), written as egglog rules (`rule_text.RuleBody`).

The pattern is the left side with each parallel operator's mesh axis as a
constant. The facts bind each metavariable's local sizes and placement
with one `At<rank>` atom (`mesh_encoding`; 0, free, written on the axes
the rule acts on), look
up each other axis's lift table with the metavariables' codes there (which
binds the codes of every term the right side builds), and check the rule's
conditions on the local sizes with the degrees replaced by the axes'
sizes. The actions build the right side, give each built term its local
shape (the rule-level shape divided by the target axes that shard it) and
its placement (constants on the target axes, table columns elsewhere), and
union it with the match.
"""

from __future__ import annotations

import itertools
from math import prod
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.conditions import Cond, symbolic_truth, to_poly
from parsat.dsl.symbolic import Poly
from parsat.dsl.typecheck import TypedTerm
from parsat.ir.mesh import Mesh
from parsat.egraph.encoding import SkipRule, ctor, equated_row, made_row, poly_expr, real_literal, rel_fact
from parsat.egraph.guards import subst_cond
from parsat.egraph.lifting import LiftedInstance, postorder
from parsat.egraph.mesh_encoding import at_fact, at_sizes, axes_read, axis_lookup, axis_var, table_name
from parsat.egraph.rule_text import RuleBody, bind_shape, dnf, symbol_var


@dataclass
class _Writer:
    lifted: LiftedInstance
    mesh: Mesh
    names: dict[str, str] = field(default_factory=dict)          # size symbol -> egglog variable or constant
    deferred: list[tuple[str, Poly]] = field(default_factory=list)
    counter: itertools.count = field(default_factory=itertools.count)

    def fresh(self, stem: str) -> str:
        return f"{stem}{next(self.counter)}"

    def expr(self, poly: Poly) -> str:
        try:
            return poly_expr(poly, self.names)
        except KeyError as err:
            raise SkipRule(f"size '{err.args[0]}' is not bound by the left side") from None

    def int_arg(self, poly: Poly) -> str:
        """An integer position of a left-side constructor: literal, binder, or checked expression."""
        if poly.is_const:
            return str(poly.constant)
        symbol = poly.as_symbol()
        if symbol is not None and symbol not in self.names:
            self.names[symbol] = symbol_var(symbol)
            return self.names[symbol]
        var = self.fresh("k")
        self.deferred.append((var, poly))
        return var

    def axis_of(self, term: TypedTerm) -> int:
        return self.lifted.sigma[term.degree.as_symbol()]

    def pattern(self, term: TypedTerm) -> str:
        if term.kind == "input":
            return "m_" + term.name
        if term.kind == "parallel":
            args = [self.pattern(term.args[0])] + [str(d) for d in term.dims]
            return f"({ctor(term.name)} {' '.join(args + [str(self.axis_of(term))])})"
        return f"({ctor(term.name)} {' '.join(self.op_args(term, None))})"

    def op_args(self, term: TypedTerm, made: Mapping[int, str] | None) -> list[str]:
        """A compute term's arguments; `made` None on the left (a pattern), else the built terms' variables."""
        instance = self.lifted.instance
        env = {s: Poly.sym(s) for s in instance.symbols}
        tensors = iter(term.args)
        out = []
        for param, arg in zip(term.instance.op.params, term.node.args):
            if param.is_tensor:
                sub = next(tensors)
                out.append(self.pattern(sub) if made is None else made[id(sub)])
            elif param.type.kind == "real":
                if isinstance(arg, ast.Name):
                    out.append("r_" + arg.id)
                else:
                    value = arg.value if isinstance(arg, ast.Num) else -arg.operand.value
                    out.append(real_literal(value))
            else:
                poly = to_poly(arg, env, instance.groups)
                out.append(self.int_arg(poly) if made is None else self.expr(poly))
        return out


def lifted_bodies(lifted: LiftedInstance, mesh: Mesh) -> tuple[list[RuleBody], dict[str, tuple]]:
    """The egglog rule(s) of a lifted instance (one per alternative of a disjunctive condition) and the lift
    tables they use (name -> (width, rows)); raises SkipRule.

    Each rule reads the axes' sizes from the e-graph (`AxisSize`, bound to
    `axis_var`s by lookups it starts with) where that writes the same rule:
    the body written with the sizes as variables is kept when, with every
    variable replaced by its axis's size (`at_sizes`), it is the body written
    with the sizes as numbers, character for character; else the numbers
    stay. The kept rule then matches, guards and builds exactly as the
    written-out one on this mesh, and meshes of one shape but other sizes
    (2 x 8, 4 x 4, 8 x 2) get the same text, so one loaded program serves them
    all (`Session`: loading a two-axis mesh's 641 rules took most of its
    session's set-up). A guard that folds sizes together (`n % (p * q)`
    written `n % 16`) or a block count of two axes keeps its number."""
    numbers, tables = _bodies(lifted, mesh, sized=False)
    variables, _ = _bodies(lifted, mesh, sized=True)
    if len(variables) != len(numbers):
        return numbers, tables
    return [kept if _written_out(kept, mesh.shape) == body else body
            for kept, body in zip(variables, numbers)], tables


def _written_out(body: RuleBody, sizes: Sequence[int]) -> RuleBody:
    """`body` with its size lookups left out and its size variables written as the sizes (`at_sizes`)."""
    lookups = {axis_lookup(axis) for axis in range(len(sizes))}
    return RuleBody(at_sizes(body.pattern, sizes),
                    tuple(at_sizes(fact, sizes) for fact in body.facts if fact not in lookups),
                    at_sizes(body.actions, sizes))


def _bodies(lifted: LiftedInstance, mesh: Mesh, sized: bool) -> tuple[list[RuleBody], dict[str, tuple]]:
    """`lifted_bodies`'s rules with the axes' sizes written as numbers, or (`sized`) as the variables of
    `axis_var`, each looked up first in the rule's facts; conditions are decided at the sizes either way."""
    instance = lifted.instance
    w = _Writer(lifted, mesh)
    degree_values = {s: mesh.size(a) for s, a in lifted.sigma.items()}
    for symbol, value in degree_values.items():
        w.names[symbol] = axis_var(lifted.sigma[symbol]) if sized else str(value)
    root = w.pattern(instance.lhs)
    targets = set(lifted.sigma.values())
    facts: list[str] = []
    for name in lifted.metas:
        dims, deferred = bind_shape(name, instance.tensors[name], w.names, w.fresh)
        w.deferred.extend(deferred)
        codes = ["0" if axis in targets else f"c_{name}_{axis}" for axis in range(len(mesh))]
        facts.append(at_fact(f"m_{name}", dims, codes))
    for var, poly in w.deferred:
        facts.append(f"(= {var} {w.expr(poly)})")
    tables: dict[str, tuple] = {}
    built = lifted.built
    for axis, table in lifted.others.items():
        width = len(lifted.metas) + len(built)
        name = table_name(table.rows, width)
        tables[name] = (width, table.rows)
        columns = [f"c_{m}_{axis}" for m in lifted.metas] + [f"o_{i}_{axis}" for i in range(len(built))]
        facts.append(f"({name} {' '.join(columns)})")
    # the rule's conditions, on local sizes, at the axes' sizes
    values = {s: Poly.const(v) for s, v in degree_values.items()}
    conditions: list[Cond] = []
    for cond in list(instance.where) + list(instance.lhs_requires) + list(instance.rhs_requires):
        at_values = subst_cond(cond, values)
        truth = symbolic_truth(at_values)
        if truth is False:
            raise SkipRule(f"condition {at_values} cannot hold on a mesh of {mesh.shape}")
        if truth is None:
            conditions.append(cond if sized else at_values)
    alternatives: list[list] = [[]]
    for cond in conditions:
        alternatives = [a + o for a in alternatives for o in dnf(cond)]
    # the right side
    actions: list[str] = []
    made: dict[int, str] = {}
    for term in postorder(instance.rhs):
        if term.kind == "input":
            made[id(term)] = "m_" + term.name
            continue
        if term.kind == "parallel":
            args = [made[id(term.args[0])]] + [str(d) for d in term.dims]
            args.append(str(w.axis_of(term)))
        else:
            args = w.op_args(term, made)
        var = w.fresh("t")
        made[id(term)] = var
        position = next(i for i, t in enumerate(built) if t is term)
        actions.append(f"(let {var} ({ctor(term.name)} {' '.join(args)}))")
        actions.append(made_row(ctor(term.name), args, instance.rule.name))
        local = []
        for dim, size in enumerate(term.shape):
            axes = lifted.local_axes(term, dim)
            factor = prod(mesh.size(axis) for axis in axes)
            divisor = axis_var(axes[0]) if sized and len(axes) == 1 else str(factor)
            local.append(w.expr(size) if factor == 1 else f"(/ {w.expr(size)} {divisor})")
        codes = [str(lifted.target_codes[axis][id(term)]) if axis in targets else f"o_{position}_{axis}"
                 for axis in range(len(mesh))]
        actions.append(at_fact(var, local, codes))
    if instance.rhs.kind == "input":
        actions.append(equated_row("root", instance.rule.name))
    actions.append(f"(union root {made[id(instance.rhs)]})")
    bodies = []
    for alternative in alternatives:
        guards = []
        for rel in alternative:
            if not (rel.left.symbols() | rel.right.symbols()) <= set(w.names):
                raise SkipRule(f"condition {rel} uses a size the left side does not bind")
            guards.append(rel_fact(rel, w.names))
        read = tuple(dict.fromkeys(facts + guards))
        lookups = [axis_lookup(axis) for axis in axes_read(" ".join(read + tuple(actions)))] if sized else []
        bodies.append(RuleBody(f"(= root {root})", tuple(lookups) + read, " ".join(actions)))
    return bodies, tables

