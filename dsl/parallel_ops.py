"""The four parallel operators, in the one table every stage reads.

They change how a tensor is spread over devices, never its value
(docs/LANGUAGE.md; the effects and collectives are in docs/ARCHITECTURE.md):
`partition(x, dim, n)` multiplies dim's shard degree by n, `combine(x, dim,
n)` divides it, `replicate(x, n)` multiplies the copy degree, `reduce(x,
n)` divides the partial-sum degree. The checker knows their signatures
from here, spread inference their effect, the e-graph their constructors,
the plan schema their attributes, the cost model and the backend their
collectives: each reads its names and parameters from this table rather
than spelling them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

PARTITION = "partition"
COMBINE = "combine"
REPLICATE = "replicate"
REDUCE = "reduce"


@dataclass(frozen=True)
class ParallelOp:
    """One parallel operator: its name and its parameter kinds in call order ("tensor", "dim", "degree")."""

    name: str
    params: tuple[str, ...]

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


PARALLEL_OPS: Mapping[str, ParallelOp] = {op.name: op for op in (
    ParallelOp(PARTITION, ("tensor", "dim", "degree")),
    ParallelOp(COMBINE, ("tensor", "dim", "degree")),
    ParallelOp(REPLICATE, ("tensor", "degree")),
    ParallelOp(REDUCE, ("tensor", "degree")),
)}


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
