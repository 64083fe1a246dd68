"""Which parallelizations an operator's semantics allows, and which rules cover them.

For every operator (each group at length 1), the candidate one-step
parallelizations are: shard one index variable by a symbolic degree `p`
(every input dim it indexes is partitioned, the other inputs replicated),
or feed one input as a `p`-way partial sum (the others replicated). Which
of them are legal, and what spread the output gets, is decided by
`dsl.spread.infer_compute` (the same analysis the checker uses; nothing is
re-derived here). A shipped rule covers a parallelization when one of its
sides applies the operator with exactly that variable sharded (or that
input partial). `parsat verify` prints the legal ones no rule covers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.instantiate import InstantiationError, expanded, instantiate, op_groups
from parsat.dsl.spread import SymbolicDegrees, infer_compute
from parsat.dsl.symbolic import ONE, Poly
from parsat.dsl.typecheck import RuleInstance

DEGREE = Poly.sym("p")


@dataclass(frozen=True)
class Parallelization:
    """One legal way to run an op on `p` devices, and its output spread."""

    op: str
    kind: str  # "shard" (an index variable) or "partial" (an input)
    what: str  # the variable or input name
    output: str  # the output spread, as text

    def describe(self) -> str:
        if self.kind == "shard":
            return f"{self.op}: sharding index '{self.what}' over p devices gives {self.output}"
        return f"{self.op}: a p-way partial sum as input '{self.what}' gives {self.output}"


def _sample_instance(op: ast.OpDecl):
    groups = {g: 1 for g in op_groups(op)}
    shapes = []
    env: dict[str, Poly] = {}
    for param in op.tensor_params:
        shape = []
        for dim in param.type.dims:
            if isinstance(dim, ast.Variadic):
                name = expanded(dim.id, 0)
                shape.append(env.setdefault(name, Poly.sym(name.replace("#", ""))))
            elif isinstance(dim, ast.Name):
                shape.append(env.setdefault(dim.id, Poly.sym(dim.id)))
            else:
                return None
        shapes.append(shape)
    attrs = {p.name: Poly.sym(p.name) for p in op.attr_params if p.type.kind != "real"}
    for where in op.where:  # dim == len(a): fix the attribute from the group lengths
        if isinstance(where, ast.Compare) and where.op == "==" and isinstance(where.left, ast.Name):
            from parsat.dsl.conditions import NotAnInteger, to_poly
            try:
                attrs[where.left.id] = to_poly(where.right, {}, groups)
            except NotAnInteger:
                pass
    reals = {p.name: ast.Name(p.name) for p in op.attr_params if p.type.kind == "real"}
    try:
        return instantiate(op, shapes, attrs, reals, groups=groups)
    except (InstantiationError, Exception):
        return None


def _index_vars(instance) -> list[str]:
    found = list(instance.out_vars)
    for node in ast.walk(instance.body):
        if isinstance(node, ast.RANGE_BINDERS) and node.var not in found:
            found.append(node.var)
    return found


def legal_parallelizations(op: ast.OpDecl) -> list[Parallelization]:
    """The one-step parallelizations `infer_compute` accepts for `op`."""
    instance = _sample_instance(op)
    if instance is None:
        return []
    out: list[Parallelization] = []
    accesses = [n for n in ast.walk(instance.body) if isinstance(n, ast.Access)]
    for var in _index_vars(instance):
        spreads = []
        for name, shape in zip(instance.inputs, instance.input_shapes):
            dims = {k for a in accesses if a.tensor == name for k, i in enumerate(a.indices)
                    if isinstance(i, ast.Name) and i.id == var}
            shard = tuple(DEGREE if k in dims else ONE for k in range(len(shape)))
            spreads.append(SymbolicDegrees(shard, ONE if dims else DEGREE))
        if all(s.copy == DEGREE for s in spreads):
            continue  # the variable reads no input: nothing to shard
        result = infer_compute(instance, spreads)
        if result.legal:
            out.append(Parallelization(op.name, "shard", var.replace("#", ""), str(result.spread)))
    for position, name in enumerate(instance.inputs):
        spreads = [SymbolicDegrees(tuple(ONE for _ in shape), ONE if k == position else DEGREE, DEGREE if k == position else ONE)
                   for k, shape in enumerate(instance.input_shapes)]
        result = infer_compute(instance, spreads)
        if result.legal:
            out.append(Parallelization(op.name, "partial", name, str(result.spread)))
    return out


def covered(instances: Sequence[RuleInstance]) -> set[tuple[str, str, str]]:
    """(op, kind, what) triples that some rule side exercises."""
    found: set[tuple[str, str, str]] = set()
    for instance in instances:
        for side in (instance.lhs, instance.rhs):
            for term in side.walk():
                if term.kind != "op":
                    continue
                for var, degree in term.var_degrees.items():
                    if degree != ONE:
                        found.add((term.name, "shard", var.split("#")[0] + ("0" if "#" in var else "")))
                for name, arg in zip(term.instance.inputs, term.args):
                    if arg.spread.sum != ONE:
                        found.add((term.name, "partial", name))
    return found


def uncovered(ops: Mapping[str, ast.OpDecl], instances: Sequence[RuleInstance]) -> list[Parallelization]:
    """Legal parallelizations of `ops` that no rule instance exercises."""
    seen = covered(instances)
    return [p for op in ops.values() for p in legal_parallelizations(op) if (p.op, p.kind, p.what) not in seen]
