"""When a rule instance may apply: the degrees that keep the device layout and fit the device budget.

Placement: a rule is proved for values and spreads, but two terms with one
spread can put their pieces on different devices (`replicate(partition(x,
0, p), q)` shards on the first mesh atom, `partition(replicate(x, q), 0,
p)` on the second), and a compute operator whose inputs do not line up
cannot run (`ir.placement`). Each rule instance applies only at the degrees
where its right side lays out as its left side does (`layout_guard`, a
relation of the allowed degrees). The graph's terms lay out, and
metavariables are whole, so every e-class then has one layout and every
plan extracted from the e-graph can run (`ir.pcg_layout` checks it).

`feasible` refuses, before anything is written, an instance whose guards
fail at every degree the device count offers.
"""

from __future__ import annotations

import itertools
from typing import Mapping, Sequence

from parsat.dsl.conditions import Cond, Junction, Negation, Rel, symbolic_truth
from parsat.dsl.symbolic import Poly
from parsat.dsl.typecheck import RuleInstance
from parsat.ir.placement import PlacementError, term_layout
from parsat.saturate.encoding import SkipRule


def degree_choices(devices: int) -> list[int]:
    """The degrees a parallel operator can have on `devices` devices: its divisors >= 2."""
    return [d for d in range(2, devices + 1) if devices % d == 0]


def feasible(guards: Sequence[Cond], free: Sequence[str], devices: int) -> Cond | None:
    """None if some choice of the free degrees leaves every guard possible; else a guard that always fails."""
    failing: Cond | None = None
    for values in itertools.product(degree_choices(devices), repeat=len(free)):
        env = {k: Poly.const(v) for k, v in zip(free, values)}
        blocked = next((c for c in guards if symbolic_truth(_subst_cond(c, env) if env else c) is False), None)
        if blocked is None:
            return None
        failing = failing or blocked
    return failing


def layout_guard(instance: RuleInstance, devices: int) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]] | None:
    """The degree symbols and the values (divisors >= 2 of `devices`) at which the right side lays out as the
    left side does (`ir.placement.term_layout`, metavariables whole); None when that holds wherever the left
    side lays out (a left side that cannot be laid out is never in the e-graph). Raises `SkipRule` when it holds
    nowhere."""
    if not any(t.kind == "parallel" for side in (instance.lhs, instance.rhs) for t in side.walk()):
        return None
    symbols = tuple(sorted(s for s, kind in instance.symbols.items() if kind == "degree"))
    considered, allowed = 0, []
    differ = ""
    for values in itertools.product(degree_choices(devices), repeat=len(symbols)):
        degrees = dict(zip(symbols, values))
        try:
            left = term_layout(instance.lhs, devices, degrees)
        except (PlacementError, KeyError):
            continue
        considered += 1
        try:
            right = term_layout(instance.rhs, devices, degrees)
        except (PlacementError, KeyError) as err:
            differ = differ or f"at {_degree_text(degrees)} the right side cannot be laid out ({err})"
            continue
        if right == left:
            allowed.append(values)
        else:
            differ = differ or f"at {_degree_text(degrees)} its sides put their pieces on different devices"
    if len(allowed) == considered:
        return None
    if not allowed:
        raise SkipRule(f"it changes where pieces live at every degree that fits {devices} devices ({differ})")
    return symbols, tuple(allowed)


def _degree_text(degrees: Mapping[str, int]) -> str:
    return ", ".join(f"{k} = {v}" for k, v in degrees.items()) or "its degrees"


def _subst_cond(cond: Cond, env: Mapping[str, Poly]) -> Cond:
    if isinstance(cond, Rel):
        return Rel(cond.op, cond.left.subst(env), cond.right.subst(env))
    if isinstance(cond, Junction):
        return Junction(cond.op, tuple(_subst_cond(p, env) for p in cond.parts))
    return Negation(_subst_cond(cond.part, env))
