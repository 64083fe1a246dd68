"""When a degree-encoded rule instance may apply (the rule generator's derivations): degrees that fit the
device count.

`feasible` refuses, before anything is written, an instance whose guards
fail at every degree the device count offers; `subst_cond` puts values
into a condition. On a device mesh, where the optimizer works, the degrees
are the axes' sizes and placements are compared axis by axis instead
(`lifting`).
"""

from __future__ import annotations

import itertools
from typing import Mapping, Sequence

from parsat.dsl.conditions import Cond, Junction, Negation, Rel, symbolic_truth
from parsat.dsl.symbolic import Poly
from parsat.dsl.typecheck import RuleInstance


def degree_choices(devices: int) -> list[int]:
    """The degrees a parallel operator can have on `devices` devices: its divisors >= 2."""
    return [d for d in range(2, devices + 1) if devices % d == 0]


def feasible(guards: Sequence[Cond], free: Sequence[str], devices: int) -> Cond | None:
    """None if some choice of the free degrees leaves every guard possible; else a guard that always fails."""
    failing: Cond | None = None
    for values in itertools.product(degree_choices(devices), repeat=len(free)):
        env = {k: Poly.const(v) for k, v in zip(free, values)}
        blocked = next((c for c in guards if symbolic_truth(subst_cond(c, env) if env else c) is False), None)
        if blocked is None:
            return None
        failing = failing or blocked
    return failing


def subst_cond(cond: Cond, env: Mapping[str, Poly]) -> Cond:
    if isinstance(cond, Rel):
        return Rel(cond.op, cond.left.subst(env), cond.right.subst(env))
    if isinstance(cond, Junction):
        return Junction(cond.op, tuple(subst_cond(p, env) for p in cond.parts))
    return Negation(subst_cond(cond.part, env))
