"""Lifting a typed rule instance onto a device mesh (docs/MESH.md).

A rule is typed with whole metavariables and symbolic degrees. On a mesh,
each of its degrees is bound to a mesh axis (a *target* axis; the degree is
that axis's size), and the rule may match metavariables already spread
over the other axes. This module decides, at compile time and without the
e-graph, everything such an instance needs:

* which assignments of degrees to axes make sense (distinct axes; a degree
  written as a product, `p * q`, is not one axis and is refused);
* the placement code of every term on every target axis (metavariables
  free there), and that both sides end alike;
* for every other axis, the table of metavariable codes for which every
  operator on both sides accepts its inputs and both sides end alike, with
  the code of every term the right side builds (`OtherAxisTable`).

Placements are propagated axis by axis with `ir.placement`'s single-axis
functions, the same ones the plan checker and the backend use.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping, Sequence

from parsat.dsl.typecheck import RuleInstance, TypedTerm
from parsat.ir.placement import FREE, axis_compute, axis_parallel, codes_for_rank, shard


class NotLiftable(Exception):
    """The instance cannot act on this mesh (the message says why)."""


def degree_symbols(instance: RuleInstance) -> tuple[str, ...]:
    """The rule's degrees, in order of first use by a parallel operator (raises NotLiftable)."""
    found: list[str] = []
    for side in (instance.lhs, instance.rhs):
        for term in side.walk():
            if term.kind != "parallel":
                continue
            symbol = term.degree.as_symbol()
            if symbol is None:
                raise NotLiftable(f"degree {term.degree} is not one mesh axis (each parallel operator acts on "
                                  "one axis; nesting over axes comes from lifting)")
            if symbol not in found:
                found.append(symbol)
    unused = [s for s, kind in instance.symbols.items() if kind == "degree" and s not in found]
    if unused:
        raise NotLiftable(f"degree {', '.join(unused)} is on no parallel operator")
    return tuple(found)


def assignments(instance: RuleInstance, axes: int) -> list[dict[str, int]]:
    """Every injective assignment of the rule's degrees to mesh axes."""
    degrees = degree_symbols(instance)
    return [dict(zip(degrees, targets)) for targets in itertools.permutations(range(axes), len(degrees))]


def term_codes(term: TypedTerm, axis: int, sigma: Mapping[str, int], metas: Mapping[str, int],
               cache: dict, out: dict[int, int | None]) -> int | None:
    """The code of `term` (and, in `out`, of every subterm by id) on one axis; None where an operator refuses."""
    if id(term) in out:
        return out[id(term)]
    if term.kind == "input":
        code = metas[term.name]
    else:
        args = [term_codes(a, axis, sigma, metas, cache, out) for a in term.args]
        if any(a is None for a in args):
            code = None
        elif term.kind == "parallel":
            on = sigma[term.degree.as_symbol()]
            code = axis_parallel(term.name, args[0], term.dim, on == axis, axis < on, term.to_dim)
        else:
            code = axis_compute(term.instance, args, cache)[0]
    out[id(term)] = code
    return code


@dataclass(frozen=True)
class OtherAxisTable:
    """For one axis the instance does not act on: the legal metavariable codes and the codes of the built terms.

    Each row is (code of each metavariable, in `LiftedInstance.metas`
    order) + (code of each right-side built term, in
    `LiftedInstance.built` order). The table depends on the axis only
    through whether it comes before each target axis in the mesh, so it is
    shared by every axis in the same position.
    """

    rows: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class LiftedInstance:
    instance: RuleInstance
    sigma: Mapping[str, int]                       # degree -> target axis
    metas: tuple[str, ...]                         # metavariable names, in first-use order
    built: tuple[TypedTerm, ...]                   # right-side terms that are not metavariables, children first
    target_codes: Mapping[int, Mapping[int, int]]  # target axis -> id(term) -> code, every term of both sides
    others: Mapping[int, OtherAxisTable]           # other axis -> its table

    def local_axes(self, term: TypedTerm, dim: int) -> tuple[int, ...]:
        """The target axes that cut `dim` of a built term into blocks (its local size divides by their sizes)."""
        return tuple(axis for axis, codes in self.target_codes.items() if codes[id(term)] == shard(dim))


def postorder(term: TypedTerm) -> list[TypedTerm]:
    out: list[TypedTerm] = []
    for arg in term.args:
        out.extend(postorder(arg))
    out.append(term)
    return out


def lift(instance: RuleInstance, axes: int, sigma: Mapping[str, int], cache: dict) -> LiftedInstance:
    """The instance with degrees on the axes `sigma` of a mesh of `axes` axes (raises NotLiftable)."""
    metas: list[str] = []
    for term in instance.lhs.walk():
        if term.kind == "input" and term.name not in metas:
            metas.append(term.name)
    built = tuple(t for t in postorder(instance.rhs) if t.kind != "input")
    targets = sorted(set(sigma.values()))
    target_codes: dict[int, dict[int, int]] = {}
    free = {m: FREE for m in metas}
    for axis in targets:
        codes: dict[int, int | None] = {}
        left = term_codes(instance.lhs, axis, sigma, free, cache, codes)
        right = term_codes(instance.rhs, axis, sigma, free, cache, codes)
        if left is None or right is None:
            raise NotLiftable(f"an operator does not accept its inputs on the axis of degree "
                              f"{_degree_on(sigma, axis)}")
        if left != right:
            raise NotLiftable("its sides end in different placements")
        target_codes[axis] = codes  # type: ignore[assignment]
    shapes = {t.name: len(t.shape) for t in instance.lhs.walk() if t.kind == "input"}
    others: dict[int, OtherAxisTable] = {}
    tables: dict[tuple[bool, ...], OtherAxisTable] = {}
    for axis in range(axes):
        if axis in sigma.values():
            continue
        position = tuple(axis < on for on in sigma.values())
        if position not in tables:
            tables[position] = _table(instance, metas, built, shapes, axis, sigma, cache)
        if not tables[position].rows:
            raise NotLiftable(f"no placement on mesh axis {axis} lets both sides end alike")
        others[axis] = tables[position]
    return LiftedInstance(instance, dict(sigma), tuple(metas), built, target_codes, others)


def _table(instance: RuleInstance, metas: Sequence[str], built: Sequence[TypedTerm], shapes: Mapping[str, int],
           axis: int, sigma: Mapping[str, int], cache: dict) -> OtherAxisTable:
    rows = []
    for combo in itertools.product(*[codes_for_rank(shapes[m]) for m in metas]):
        assign = dict(zip(metas, combo))
        codes: dict[int, int | None] = {}
        left = term_codes(instance.lhs, axis, sigma, assign, cache, codes)
        if left is None:
            continue
        right = term_codes(instance.rhs, axis, sigma, assign, cache, codes)
        if right is None or right != left:
            continue
        row = [codes[id(t)] for t in built]
        if any(c is None for c in row):
            continue
        rows.append(tuple(combo) + tuple(row))   # type: ignore[arg-type]
    return OtherAxisTable(tuple(rows))


def _degree_on(sigma: Mapping[str, int], axis: int) -> str:
    return next((s for s, a in sigma.items() if a == axis), "?")
