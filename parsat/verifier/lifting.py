"""Lifted instances of a rule, replayed device by device on a mesh (docs/ARCHITECTURE.md, and docs/VERIFIER.md).

A rule is proved for whole tensors. The optimizer also applies it to
tensors already spread over other mesh axes (data x tensor x sequence):
sound when every operator on both sides is SPMD-legal on the lifted
spreads and both sides place their pieces alike. `replay_lifted` checks
that concretely for one rule on one mesh:

* each degree symbol of the rule is bound to one mesh axis (every
  injective binding; its value is the axis's size);
* each metavariable arrives pre-spread over the *other* axes, in every
  way: per axis not spread, Replicate, Partial, or Shard(d) for each of its
  dims (a dim sharded on several axes nests them in mesh order, earlier
  axis major, as DTensor does);
* a combination is *legal* when the spread analysis accepts both lifted
  sides (`dsl.typecheck.type_rule` with `input_spreads`) and their pieces
  line up on the mesh; illegal ones are counted, not replayed;
* a legal one runs both sides on the devices (`verifier.devices`) at small
  sizes; a mismatch is a side whose devices do not assemble to its value,
  a device that cannot run an operator, sides placed differently, or the
  analysis naming another spread than the devices hold.

```python
from parsat.verifier.devices import Mesh
from parsat.verifier.lifting import replay_lifted
report = replay_lifted(library.rule("matmul_data_parallel"), library.ops, Mesh((("dp", 2), ("tp", 3))))
assert report.ok, report.render()
```

Only rank assignments with each group at length 0 or 1 are lifted (a
proved rule's batch-like groups add nothing at longer lengths).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import numpy as np

from parsat.dsl import ast
from parsat.dsl.conditions import holds
from parsat.dsl.evaluate import EvaluationError
from parsat.dsl.parallel_ops import expand_fused_rule
from parsat.dsl.spread import SymbolicDegrees
from parsat.dsl.symbolic import ONE, Poly
from parsat.dsl.typecheck import RuleInstance, TypeCheckError, type_rule
from parsat.verifier import concrete, ranks
from parsat.verifier.devices import (BoundAxes, DeviceError, Inconsistent, Mesh, MeshPlacement, NotPlaceable,
                                     RuleSides, distribute, gather, global_value)

ROLES = ("-", "Replicate", "Partial")  # then Shard(d) for each dim


@dataclass(frozen=True)
class LiftedCase:
    """One lifted instance: the binding of degrees to axes, how each metavariable arrives, and the sizes."""

    binding: Mapping[str, str]                          # degree symbol -> mesh axis
    arrives: Mapping[str, Mapping[str, str]]            # metavariable -> {other axis: role}
    groups: Mapping[str, int]
    sizes: Mapping[str, int]

    def describe(self) -> str:
        bound = ", ".join(f"{d} on axis {a}" for d, a in sorted(self.binding.items())) or "no degree"
        spread = "; ".join(f"{name}: " + ", ".join(f"{role} on {axis}" for axis, role in roles.items())
                           for name, roles in sorted(self.arrives.items()) if any(r != "-" for r in roles.values()))
        groups = ", ".join(f"len({g}) = {n}" for g, n in self.groups.items())
        sizes = ", ".join(f"{k} = {v}" for k, v in sorted(self.sizes.items()) if not k.startswith("@"))
        return f"{bound}; {spread or 'every metavariable whole'}; {groups + '; ' if groups else ''}sizes {sizes}"


@dataclass(frozen=True)
class LiftedMismatch:
    case: LiftedCase
    reason: str

    def render(self) -> str:
        return f"{self.case.describe()}:\n    {self.reason}"


@dataclass
class LiftReport:
    """What `replay_lifted` found for one rule on one mesh."""

    rule: str
    mesh: Mesh
    replayed: int = 0                                   # legal lifted instances run on the devices
    illegal: int = 0                                    # combinations the analysis or the mesh refuses
    mismatches: list[LiftedMismatch] = field(default_factory=list)
    note: str = ""                                      # why nothing was replayed, if so

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def render(self) -> str:
        head = (f"{self.rule} on mesh {self.mesh}: {self.replayed} lifted instances replayed, {self.illegal} "
                f"combinations not legal, {len(self.mismatches)} mismatches")
        if self.note:
            head += f" ({self.note})"
        return "\n".join([head] + ["  " + m.render() for m in self.mismatches[:10]])


def replay_lifted(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], mesh: Mesh, *, sizes_per_case: int = 1,
                  seed: int = 0, max_combinations: int | None = None) -> LiftReport:
    """Replay every legal lifted instance of `rule` on `mesh` device by device (module docstring).

    `sizes_per_case` small size assignments are tried per combination;
    `max_combinations` caps the combinations per binding and rank
    assignment (None: all of them).
    """
    rule = expand_fused_rule(rule)   # a fused operator means its steps
    report = LiftReport(rule.name, mesh)
    try:
        plan = ranks.plan(rule, ops)
    except TypeCheckError as err:
        report.note = f"the rule does not type: {err}"
        return report
    bases = [i for i in plan.proof if all(n <= 1 for n in i.groups.values())] or plan.proof
    for base in bases:
        degrees = sorted(s for s, k in base.symbols.items() if k == "degree")
        if len(degrees) > len(mesh.names):
            report.note = f"{len(degrees)} degrees but only {len(mesh.names)} mesh axes"
            continue
        for axes in itertools.permutations(mesh.names, len(degrees)):
            binding = dict(zip(degrees, axes))
            others = [a for a in mesh.names if a not in axes]
            combos = _combinations(base, others)
            if max_combinations is not None:
                combos = itertools.islice(combos, max_combinations)
            for arrives in combos:
                _replay_one(rule, ops, mesh, base, binding, others, arrives, sizes_per_case, seed, report)
    if not report.replayed and not report.note:
        report.note = "no legal lifted instance at the sizes tried"
    return report


def _combinations(base: RuleInstance, others: Sequence[str]) -> Iterator[dict[str, dict[str, str]]]:
    names = sorted(base.tensors)
    options = []
    for name in names:
        roles = list(ROLES) + [f"Shard({d})" for d in range(len(base.tensors[name]))]
        per_axis = [dict(zip(others, choice)) for choice in itertools.product(roles, repeat=len(others))]
        options.append(per_axis)
    for choice in itertools.product(*options):
        yield dict(zip(names, choice))


def _lifted_spreads(base: RuleInstance, mesh: Mesh, arrives) -> tuple[dict[str, SymbolicDegrees], dict[str, MeshPlacement]]:
    spreads, placements = {}, {}
    for name, roles in arrives.items():
        rank = len(base.tensors[name])
        shard: list[list[str]] = [[] for _ in range(rank)]
        copy, total = [], []
        for axis in mesh.names:  # mesh order: an earlier axis is the major part of a nested split
            role = roles.get(axis, "-")
            if role.startswith("Shard("):
                shard[int(role[6:-1])].append(axis)
            elif role == "Replicate":
                copy.append(axis)
            elif role == "Partial":
                total.append(axis)
        if not any(shard) and not copy and not total:
            continue

        def degree(axes: Sequence[str]) -> Poly:
            out = ONE
            for axis in axes:
                out = out * Poly.sym(f"@{axis}")
            return out

        spreads[name] = SymbolicDegrees(tuple(degree(d) for d in shard), degree(copy), degree(total))
        placements[name] = MeshPlacement(tuple(tuple(d) for d in shard), tuple(copy), tuple(total))
    return spreads, placements


def _replay_one(rule, ops, mesh: Mesh, base: RuleInstance, binding, others, arrives, sizes_per_case: int, seed: int,
                report: LiftReport) -> None:
    spreads, placements = _lifted_spreads(base, mesh, arrives)
    try:
        lifted = type_rule(rule, ops, base.groups, input_spreads=spreads)
    except TypeCheckError:
        report.illegal += 1
        return
    if lifted.problems:
        report.illegal += 1
        return
    fixed = {degree: mesh.axis_size(axis) for degree, axis in binding.items()}
    fixed.update({f"@{axis}": mesh.axis_size(axis) for axis in mesh.names})
    unit = math.lcm(*mesh.shape) if mesh.shape else 1
    tried = 0
    for sizes in _sizes(base, fixed, unit, seed):
        if tried >= sizes_per_case:
            break
        if not concrete.applies(lifted, sizes) or not all(holds(c, sizes) for c in lifted.rhs_requires):
            continue
        if not all(holds(c, sizes) for c, _ in lifted.legal_when):
            continue
        if concrete._elements(lifted, sizes) > concrete.MAX_ELEMENTS:   # as a replay of a z3 model is capped
            continue
        tried += 1
        case = LiftedCase(dict(binding), {n: {a: arrives[n].get(a, "-") for a in others} for n in arrives},
                          dict(base.groups), dict(sizes))
        outcome = "not finite"
        for attempt in range(FINITE_ATTEMPTS + 1):  # inputs where the values are finite: inf - inf says nothing
            outcome = _on_mesh(lifted, sizes, mesh, binding, placements, seed + attempt,
                               in_domain=attempt == FINITE_ATTEMPTS)
            if outcome != "not finite":
                break
        if outcome == "not finite":
            tried -= 1
            continue
        if outcome == "illegal":
            report.illegal += 1
            return
        report.replayed += 1
        if outcome:
            report.mismatches.append(LiftedMismatch(case, outcome))
    if not tried:
        report.illegal += 1  # no size where this lifted instance applies


FINITE_ATTEMPTS = 3   # draws from -3 to 3 tried at a size before one within the functions' domains (`_on_mesh`)


def _sizes(base: RuleInstance, fixed: Mapping[str, int], unit: int, seed: int) -> Iterator[dict[str, int]]:
    """Small sizes with the degrees fixed by the mesh and every dim a multiple of the mesh's sizes, the
    smallest first (by the product of the dims, then the order drawn): a combination replays the first that
    applies, and every dim is `unit` times a drawn one, so a rank-4 rule's random draws reached 96 per dim on
    the 2x3 mesh (96^4 float64 elements a tensor: the batch-norm rules, whose random variances make most draws
    not finite, walked every draw, took 13 GB and ran out of memory); a size whose tensors hold more than
    `concrete.MAX_ELEMENTS` is not replayed."""
    drawn = []
    for sizes in concrete.candidate_sizes(base, random.Random(seed), 24):
        out = dict(sizes)
        for name, kind in base.symbols.items():
            if kind == "dim":
                out[name] = sizes[name] * unit
        out.update(fixed)
        drawn.append(out)
    dims = [name for name, kind in base.symbols.items() if kind == "dim"]
    order = sorted(range(len(drawn)), key=lambda k: (math.prod(drawn[k][name] for name in dims), k))
    yield from (drawn[k] for k in order)


def _on_mesh(lifted: RuleInstance, sizes, mesh: Mesh, binding, placements, seed: int,
             in_domain: bool = False) -> str:
    """'' when both sides agree on the devices; 'illegal' when their pieces do not line up; 'not finite' when the
    semantics is not finite at these inputs; else the mismatch. `in_domain`: the inputs' magnitudes and the reals'
    magnitudes plus 1/2, so that a square root or a logarithm of an input plus a real (a batch norm's variance
    and epsilon) is defined: drawn from -3 to 3, c channels' variances were all in it once in 2^c draws, and
    on a 2x3 mesh (c a multiple of 6) the batch-norm rules replayed no instance."""
    rng = np.random.default_rng(seed)
    inputs = concrete.random_inputs(lifted, sizes, rng)
    reals = concrete.random_reals(lifted, rng)
    if in_domain:
        inputs = {name: np.abs(value) for name, value in inputs.items()}
        reals = {name: abs(value) + 0.5 for name, value in reals.items()}
    axes = BoundAxes(mesh, {d: (a,) for d, a in binding.items()}, sizes)
    try:
        sides = RuleSides([lifted.lhs, lifted.rhs], sizes, placements, axes=axes)
    except (NotPlaceable, DeviceError):
        return "illegal"
    placed = {name: distribute(value, placements.get(name, MeshPlacement.whole(value.ndim)), mesh, rng)
              for name, value in inputs.items()}
    held, values = [], []
    for which, term in (("left", lifted.lhs), ("right", lifted.rhs)):
        try:
            run = sides.run(term, placed, reals)
        except NotPlaceable:
            return "illegal"
        except DeviceError as err:
            return f"the {which} side cannot run on the devices: {err}"
        try:
            expected = global_value(term, sizes, inputs, reals)
            if not np.all(np.isfinite(expected.astype(float))):
                return "not finite"
            copies = gather(run.tensor, mesh)
        except Inconsistent as err:
            return f"the {which} side is inconsistent on the devices: {err}"
        except (EvaluationError, ValueError) as err:
            return f"the {which} side cannot be evaluated: {err}"
        for value in copies:
            spot = concrete.first_difference(expected, value)
            if value.shape != expected.shape or spot is not None:
                return (f"on the devices the {which} side computes something else than its semantics"
                        + (f" (at index {list(spot)}: {value[spot]:g} vs {expected[spot]:g})" if spot else ""))
        claimed = concrete._spread_values(term, sizes)
        if claimed != run.tensor.placement.degrees(mesh):
            return (f"the spread analysis says the {which} side is {concrete._fmt_spread(claimed)}, the devices hold "
                    f"{concrete._fmt_spread(run.tensor.placement.degrees(mesh))}: a bug in parsat/dsl/spread.py")
        held.append(run.tensor.placement)
        values.append(expected)
    if values[0].shape != values[1].shape or concrete.first_difference(values[0], values[1]) is not None:
        return "the sides compute different values (the rule itself is wrong)"
    left, right = held
    if left.shard != right.shard or set(left.copy) != set(right.copy) or set(left.sum) != set(right.sum):
        return (f"the sides place their pieces differently: left {left} ({_per_axis(left, mesh)}), right {right} "
                f"({_per_axis(right, mesh)})")
    return ""


def _per_axis(placement: MeshPlacement, mesh: Mesh) -> str:
    return ", ".join(f"{axis}: {role}" for axis, role in placement.per_axis(mesh).items())
