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


# ------------------------------------------------------------------ what backward reads

@lru_cache(maxsize=None)
def backward_reads(op: ast.OpDecl, needs: frozenset[str] | None = None) -> frozenset[str]:
    """The names of `op`'s tensor operands whose values its backward reads, when the operands `needs` (default:
    every one) take a gradient: what autograd saves for it. Read from the semantics, never listed by name: the
    derivative of a sum or a difference reads nothing (`add`, `bias_add`, `scale`, a transpose), of a product
    the other factor (`linear` reads its input x for the weight's gradient and the weight for x's), of a quotient
    its divisor (and the dividend, for the divisor's), and of anything else (exp, tanh, erf, sqrt, max, a test)
    the operands inside it (`gelu_tanh`, `layernorm` read their input). An operator whose backward reads only
    its own output (torch's softmax, exp) is counted by its input, of the same size. Why: the memory a plan
    keeps for backward is these values, each once (`cost.saved`), not every operator's output."""
    wanted = frozenset(p.name for p in op.tensor_params) if needs is None else needs
    return frozenset(_reads(op.body, wanted))


def is_alias(op: ast.OpDecl) -> bool:
    """Whether `op`'s output is one operand's elements, re-indexed and nothing else (`transpose`, `flatten`,
    `unflatten`, `broadcast`, the identity `dropout`): a view of that operand, which keeps nothing of its own.
    What a reader's backward keeps of it is the operand's storage (`cost.saved`)."""
    return isinstance(op.body, ast.Access) and op.body.tensor in {p.name for p in op.tensor_params}


def _tensors(expr) -> set[str]:
    """Every tensor read under `expr`."""
    found: dict[str, list[bool]] = {}
    _walk(expr, False, found)
    return set(found)


def _reads(expr, needs: frozenset[str]) -> set[str]:
    """The tensors the derivative of `expr` with respect to the operands in `needs` reads (`backward_reads`)."""
    if isinstance(expr, ast.Access) or not is_dataclass(expr):
        return set()
    if isinstance(expr, ast.Neg):
        return _reads(expr.operand, needs)
    if isinstance(expr, ast.Sum):
        return _reads(expr.body, needs)
    if isinstance(expr, ast.IfThenElse):   # the branch taken is a mask of the test's operands
        return _tensors(expr.test) | _reads(expr.then, needs) | _reads(expr.orelse, needs)
    if isinstance(expr, ast.BinOp) and expr.op in "+-*/":
        left, right = _tensors(expr.left), _tensors(expr.right)
        out = _reads(expr.left, needs) | _reads(expr.right, needs)
        if expr.op == "*":
            out |= (right if left & needs else set()) | (left if right & needs else set())
        elif expr.op == "/":
            out |= (right if (left | right) & needs else set()) | (left if right & needs else set())
        return out
    if isinstance(expr, ast.Call) and expr.func == "step":   # piecewise constant: no gradient through it
        return set()
    inside = _tensors(expr)   # anything else is not linear: its derivative reads what it reads
    return inside if inside & needs else set()
