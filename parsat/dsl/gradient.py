"""Which tensor operands of an operator pass no gradient: read only where the value is piecewise constant in them.

An operator's output depends on an operand x only through `step(...)`
(1 where its argument is positive) or a comparison (`if x[i] > 0 then ...`
tests x, and the branch taken does not move with x) is piecewise constant
in x: its derivative is zero almost everywhere, so autograd gives x no
gradient through it (the backend's implementation detaches such operands:
`importer.torch_ops._topk_onehot`). `topk_onehot` is the one shipped
operator of that kind (a mixture of experts' routing one-hot). Read from
the semantics, never listed by name, so a user's operator of the same kind
is known too.

Why it matters: a parallel operator whose input takes no gradient runs no
collective in backward (a mixture of experts' dispatch, made from the
data and the routing one-hot, sends nothing back), and the cost model
counts only what runs (`cost.pcg_tasks.needs_gradient`).
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from functools import lru_cache

from parsat.dsl import ast


@lru_cache(maxsize=None)
def gradient_free(op: ast.OpDecl) -> frozenset[str]:
    """The names of `op`'s tensor operands that get no gradient through it (module docstring): every read of them
    in the semantics sits inside a `step(...)` or a comparison. An operand never read is not listed."""
    reads: dict[str, list[bool]] = {}
    _walk(op.body, False, reads)
    return frozenset(name for name, constant in reads.items() if constant and all(constant))


def _walk(expr, constant: bool, reads: dict[str, list[bool]]) -> None:
    """Record, for each tensor read under `expr`, whether it sits where the value is piecewise constant in it."""
    if isinstance(expr, ast.Access):
        reads.setdefault(expr.tensor, []).append(constant)
    inner = constant or isinstance(expr, ast.Compare) or (isinstance(expr, ast.Call) and expr.func == "step")
    if isinstance(expr, ast.IfThenElse):   # the test is piecewise constant; the branches carry their values
        _walk(expr.test, True, reads)
        _walk(expr.then, constant, reads)
        _walk(expr.orelse, constant, reads)
        return
    if not is_dataclass(expr):
        return
    for f in fields(expr):
        value = getattr(expr, f.name)
        for item in value if isinstance(value, tuple) else (value,):
            if is_dataclass(item) and not isinstance(item, ast.Span):
                _walk(item, inner, reads)
