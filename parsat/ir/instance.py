"""An operator of the library at concrete shapes and attributes: the one place graphs, plans and costs get it.

`Graph`'s builder infers every node's shape with it, `validate` checks a
plan's compute nodes with it (so a plan with an unknown attribute or a
wrong shape is refused before a rank starts), and the cost model and the
layout read the instance's work and index maps.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.conditions import holds
from parsat.dsl.instantiate import InstantiationError, OpInstance, instantiate
from parsat.dsl.symbolic import Poly


def instance_for(op: ast.OpDecl, shapes: Sequence[Sequence[int]], attrs: Mapping[str, int | float],
                 memo: dict | None = None) -> OpInstance:
    """The operator at concrete shapes and attributes (raises InstantiationError). `memo`, a dict the caller
    keeps for the operators of one library, holds the instances made and the refusals: a model of repeated
    blocks asks for each one once per block, and instantiating is most of what laying out or checking a node
    costs."""
    if memo is not None:
        key = (op.name, tuple(tuple(s) for s in shapes), tuple(sorted(attrs.items())))
        found = memo.get(key)
        if found is None:
            try:
                found = memo[key] = instance_for(op, shapes, attrs)
            except InstantiationError as err:
                found = memo[key] = err
        if isinstance(found, InstantiationError):
            raise found.with_traceback(None)   # the same refusal, without the tracebacks of earlier raises
        return found
    int_attrs: dict[str, Poly] = {}
    real_attrs: dict[str, ast.Expr] = {}
    for param in op.attr_params:
        if param.name not in attrs:
            raise InstantiationError("arity", f"{op.name} needs the attribute '{param.name}'")
        value = attrs[param.name]
        if param.type.kind == "real":
            real_attrs[param.name] = ast.Num(float(value))
        else:
            if isinstance(value, bool) or not isinstance(value, int) and not float(value).is_integer():
                raise InstantiationError("attribute", f"{op.name}: '{param.name}' must be an integer, got {value!r}")
            int_attrs[param.name] = Poly.const(int(value))
    extra = set(attrs) - {p.name for p in op.attr_params}
    if extra:
        raise InstantiationError("attribute", f"{op.name} has no attribute(s) {', '.join(sorted(extra))}")
    instance = instantiate(op, [[Poly.const(d) for d in s] for s in shapes], int_attrs, real_attrs)
    for cond in instance.requirements:
        if not holds(cond, {}):
            raise InstantiationError("where", f"{op.name} requires {cond}")
    return instance
