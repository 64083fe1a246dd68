"""The parallel operators, in the one table every stage reads.

They change how a tensor is spread over devices, never its value
(docs/LANGUAGE.md; the effects and collectives are in docs/ARCHITECTURE.md):
`partition(x, dim, n)` multiplies dim's shard degree by n, `combine(x, dim,
n)` divides it, `replicate(x, n)` multiplies the copy degree, `reduce(x,
n)` divides the partial-sum degree. Two more are *fused*: each stands for
two of those four on the same devices, and is one collective where the
pair would be two (Megatron's sequence parallelism, ZeRO-3 / FSDP):
`reduce_scatter(x, dim, n)` = `partition(reduce(x, n), dim, n)` (a
reduce-scatter forward, an all-gather of the gradient backward) and
`all_gather(x, dim, n)` = `replicate(combine(x, dim, n), n)` (an all-gather
forward, a reduce-scatter of the gradient backward). The third,
`all_to_all(x, dim, to_dim, n)` = `partition(combine(x, dim, n), to_dim, n)`,
moves the shard of one dim to another on the same devices (DTensor's
`Shard(dim) -> Shard(to_dim)` redistribute): one all-to-all forward, the
reverse all-to-all backward; a mixture of experts' dispatch (tokens
sharded -> experts sharded) and combine (back). A fused operator's
meaning is its expansion (`steps`): the verifier proves rules with fused
operators expanded (`expand_fused`), spread inference and placements
apply the steps in turn. The checker knows their signatures from here, the
e-graph their constructors, the plan schema their attributes, the cost
model and the backend their collectives: each reads its names and
parameters from this table rather than spelling them again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from parsat.dsl import ast

PARTITION = "partition"
COMBINE = "combine"
REPLICATE = "replicate"
REDUCE = "reduce"
REDUCE_SCATTER = "reduce_scatter"
ALL_GATHER = "all_gather"
ALL_TO_ALL = "all_to_all"


@dataclass(frozen=True)
class ParallelOp:
    """One parallel operator: its name and its parameter kinds in call order ("tensor", "dim", "to_dim",
    "degree")."""

    name: str
    params: tuple[str, ...]
    steps: tuple[str, ...] = ()   # a fused operator: the elementary operators it stands for, innermost first
    step_dims: tuple[str | None, ...] = ()   # the dim parameter each step reads (None: a step without a dim)

    @property
    def attrs(self) -> tuple[str, ...]:
        """The non-tensor parameters, in call order: how a plan names them (`{"dim": 0, "degree": 2}`)."""
        return tuple(kind for kind in self.params if kind != "tensor")

    @property
    def plan_attrs(self) -> tuple[str, ...]:
        """How a plan on a device mesh names them: the dim (if any), the mesh `axis` it acts on (a name), and
        its `degree` (that axis's size)."""
        return tuple(k for k in self.attrs if k != "degree") + ("axis", "degree")

    @property
    def has_dim(self) -> bool:
        """Whether it acts on one dim (partition, combine) rather than on the whole tensor."""
        return "dim" in self.params

    @property
    def dim_params(self) -> tuple[str, ...]:
        """The dim parameters in call order: ("dim",), ("dim", "to_dim") for all_to_all, or ()."""
        return tuple(kind for kind in self.params if kind in ("dim", "to_dim"))


PARALLEL_OPS: Mapping[str, ParallelOp] = {op.name: op for op in (
    ParallelOp(PARTITION, ("tensor", "dim", "degree")),
    ParallelOp(COMBINE, ("tensor", "dim", "degree")),
    ParallelOp(REPLICATE, ("tensor", "degree")),
    ParallelOp(REDUCE, ("tensor", "degree")),
    ParallelOp(REDUCE_SCATTER, ("tensor", "dim", "degree"), (REDUCE, PARTITION), (None, "dim")),
    ParallelOp(ALL_GATHER, ("tensor", "dim", "degree"), (COMBINE, REPLICATE), ("dim", None)),
    ParallelOp(ALL_TO_ALL, ("tensor", "dim", "to_dim", "degree"), (COMBINE, PARTITION), ("dim", "to_dim")),
)}


def step_calls(name: str, dims: Mapping[str, object]) -> list[tuple[str, object]]:
    """A fused operator's steps, innermost first, each with the dim it acts on (None for a step without one),
    given the call's dims by parameter name (`{"dim": 1, "to_dim": 0}`): every stage expands through this."""
    op = PARALLEL_OPS[name]
    return [(step, dims.get(param) if param else None) for step, param in zip(op.steps, op.step_dims)]


def expand_fused(expr):
    """`expr` (a DSL expression, `dsl.ast`) with every fused parallel operator written as its steps, each step
    keeping the call's source span: what a fused operator means."""
    if isinstance(expr, ast.Call):
        args = tuple(expand_fused(a) for a in expr.args)
        op = PARALLEL_OPS.get(expr.func)
        if op is None or not op.steps:
            return ast.Call(expr.func, args, expr.span) if args != expr.args else expr
        source, degree = args[0], args[-1]
        dims = dict(zip(op.dim_params, args[1:-1]))
        for step, dim in step_calls(expr.func, dims):
            source = ast.Call(step, (source, dim, degree) if dim is not None else (source, degree), expr.span)
        return source
    return expr


def expand_fused_rule(rule):
    """A rule with both sides' fused operators expanded (`expand_fused`): the rule the verifier proves."""
    lhs, rhs = expand_fused(rule.lhs), expand_fused(rule.rhs)
    return rule if (lhs is rule.lhs and rhs is rule.rhs) else replace(rule, lhs=lhs, rhs=rhs)


def prime_factors(n: int) -> list[int]:
    """A degree's (or a device count's) prime factors, ascending, with multiplicity: the mesh atoms a
    parallel operator of that degree takes (`ir.placement`, `verifier.devices`)."""
    if n < 1:
        raise ValueError(f"a device count or degree must be >= 1, got {n}")
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    if n > 1:
        factors.append(n)
    return factors
