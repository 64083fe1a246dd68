"""The z3 lowering checked against the devices: what the prover reasons about is what the devices compute.

The prover never runs anything: it lowers both sides to the normal form of
`verifier.normal` (the value at a free block and local index, after the
sum lemmas) and asks z3 about it. A wrong lowering or a wrong lemma would
prove wrong rules. `lowering_disagrees` evaluates those very normal forms
at concrete sizes, every block and local index, on random inputs, and
compares them with the pieces the devices compute (`verifier.devices`);
a disagreement is a bug report on the lowering, never a verdict on the
rule. The verifier runs it on every instance it proves (`core`), at the
smallest sizes where the rule applies.

`devices_disagree` is the second, independent check: before a rule is
PROVED (or BOUNDED) it runs random instances far from the ones the proof
and the search looked at, at ranks up to `LARGE_MAX_RANK` (8, the largest
the optimizer compiles) and with dims up to `LARGE_MAX_SIZE` (12), both
sides device by device (`concrete.trial`). A rank-polymorphic rule is
proved at a few lengths and generalized by an argument (`ranks`); a wrong
argument, or a wrong lemma that happens to hold at small sizes, shows up
here as a disagreement, which is a bug report: the verdict becomes
UNKNOWN, never PROVED.
"""

from __future__ import annotations

import itertools
import math
import random
import zlib
from typing import Iterator, Mapping

import numpy as np

from parsat.dsl import ast
from parsat.dsl.evaluate import EvaluationError
from parsat.dsl.symbolic import Poly
from parsat.dsl.typecheck import RuleInstance, TypeCheckError, group_assignments, type_rule
from parsat.verifier import concrete, prove
from parsat.verifier.limits import check_deadline
from parsat.verifier.ranks import top_rank
from parsat.verifier.devices import DeviceError, NotPlaceable, RuleSides, gather

MAX_POINTS = 4096  # (block, local index) points evaluated per side
LARGE_MAX_RANK = 8     # the independent check's instances reach this rank ...
LARGE_MAX_SIZE = 12    # ... and dims (and integer sizes) this large
LARGE_TRIALS = 4       # instances run per rule (those that apply and fit LARGE_MAX_ELEMENTS)
LARGE_MAX_ELEMENTS = 1_536  # in all the tensors: a dim of 12 beside seven of 2 fits
LARGE_DRAWS = 60       # draws made to find them


class CannotEvaluate(Exception):
    """The normal form reads outside an input, or uses what it cannot evaluate (itself a finding)."""


_FUNCTIONS = {"exp": math.exp, "log": math.log, "sqrt": math.sqrt, "tanh": math.tanh, "erf": math.erf,
              "sin": math.sin, "cos": math.cos,
              "abs": abs, "max": max, "min": min, "step": lambda v: 1.0 if v > 0 else 0.0}


def evaluate_form(form: tuple, env: Mapping[str, int], inputs: Mapping[str, np.ndarray],
                  reals: Mapping[str, float]) -> float:
    """The value of a normal form with every free symbol given in `env`."""
    total = 0.0
    for coef, binders, factors in form:
        names = [v for v, _ in binders]
        ranges = [range(int(b.evaluate(env))) for _, b in binders]
        for values in itertools.product(*ranges):
            inner = {**env, **dict(zip(names, values))}
            total += float(coef) * _product(factors, inner, inputs, reals)
    return total


def _product(factors, env, inputs, reals) -> float:
    for f in factors:  # indicators first: a read guarded by a false condition is never made
        if f[0] == "ind" and _cond(f[1], env) != f[2]:
            return 0.0
    out = 1.0
    for f in factors:
        if f[0] != "ind":
            out *= _factor(f, env, inputs, reals)
    return out


def _factor(f, env, inputs, reals) -> float:
    kind = f[0]
    if kind == "in":
        array = inputs[f[1]]
        index = tuple(int(p.evaluate(env)) for p in f[2])
        if len(index) != array.ndim or any(not 0 <= i < n for i, n in zip(index, array.shape)):
            raise CannotEvaluate(f"it reads {f[1]}{list(index)}, outside its shape {list(array.shape)}")
        return float(array[index])
    if kind == "size":
        return float(f[1].evaluate(env))
    if kind == "real":
        return float(reals[f[1]])
    if kind == "recip":
        return 1.0 / evaluate_form(f[1], env, inputs, reals)
    if kind == "fn":
        args = [evaluate_form(a, env, inputs, reals) for a in f[2]]
        return float(_FUNCTIONS[f[1]](*args))
    if kind == "max":  # the largest value over the binders' rectangle, 0 when it is empty
        names = [v for v, _ in f[1]]
        ranges = [range(int(b.evaluate(env))) for _, b in f[1]]
        values = [evaluate_form(f[2], {**env, **dict(zip(names, point))}, inputs, reals)
                  for point in itertools.product(*ranges)]
        return max(values) if values else 0.0
    raise CannotEvaluate(f"unknown factor {kind}")


def _cond(cond, env) -> bool:
    if cond[0] == "rel":
        a, b = cond[2].evaluate(env), cond[3].evaluate(env)
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b, "!=": a != b}[cond[1]]
    if cond[0] == "not":
        return not _cond(cond[1], env)
    left, right = _cond(cond[1], env), _cond(cond[2], env)
    return (left and right) if cond[0] == "and" else (left or right)


def _fresh_values(sizes: prove._Sizes, given: Mapping[str, int]) -> dict[str, int] | None:
    """Values of the prover's fresh symbols (`m = p * m_1`) at the given sizes; None when they do not fit."""
    env = dict(given)
    pending = dict(sizes.subst)
    for _ in range(len(pending) + 1):
        for name, poly in list(pending.items()):
            if name not in env:
                continue  # a fresh symbol substituted again: solved once its own value is known
            unknown = poly.symbols() - set(env)
            if not unknown:
                pending.pop(name)
                continue
            if len(unknown) != 1:
                continue
            (fresh,) = unknown
            factor = poly.exact_div(Poly.sym(fresh))
            if factor is None or factor.symbols() - set(env):
                continue
            den = factor.evaluate(env)
            if den == 0 or env[name] % den:
                return None
            env[fresh] = env[name] // den
            pending.pop(name)
    if pending:
        return None
    if any(poly.evaluate(env) != env[name] for name, poly in sizes.subst.items()):
        return None
    return env


def lowering_disagrees(instance: RuleInstance, sizes: Mapping[str, int], seed: int = 0) -> str | None:
    """Where the normal forms the prover reasons about differ from the devices (None: they agree here)."""
    if not concrete.applies(instance, sizes):
        return None
    solved = prove.solve_sizes(instance)
    env = _fresh_values(solved, sizes)
    if env is None:
        return None
    low = prove._Lowering(solved)
    left, right, ranges = prove.lowered_sides(instance, low)
    rng = np.random.default_rng(seed)
    inputs = concrete.random_inputs(instance, sizes, rng)
    reals = concrete.random_reals(instance, rng)
    try:
        sides = RuleSides([instance.lhs, instance.rhs], sizes)
    except (DeviceError, NotPlaceable):
        return None
    placed = {name: concrete._whole(value, sides.mesh) for name, value in inputs.items()}
    shard = [int(d.evaluate(sizes)) for d in instance.lhs.spread.shard]
    shape = [int(d.evaluate(sizes)) for d in instance.lhs.shape]
    extents = [s // d for s, d in zip(shape, shard)]
    names = sorted(ranges)
    points = list(itertools.product(*(range(int(ranges[n].evaluate(env))) for n in names)))
    if len(points) > MAX_POINTS:
        random.Random(seed).shuffle(points)
        points = points[:MAX_POINTS]
    for which, term, form in (("left", instance.lhs, left), ("right", instance.rhs, right)):
        try:
            value = gather(sides.run(term, placed, reals).tensor, sides.mesh)[0]
        except (DeviceError, NotPlaceable, EvaluationError, ValueError, IndexError):
            return None  # the devices cannot run it here: the concrete search reports that, not this check
        for point in points:
            at = dict(zip(names, point))
            index = tuple(at.get(f"@b{k}", 0) * extents[k] + at[f"@i{k}"] for k in range(len(shape)))
            try:
                lowered = evaluate_form(form, {**env, **at}, inputs, reals)
            except CannotEvaluate as err:
                return f"the z3 lowering of the {which} side cannot be evaluated at {_where(sizes, index)}: {err}"
            except (ZeroDivisionError, ValueError, OverflowError):
                continue
            device = float(value[index]) if value.dtype != object else float(value[index])
            if math.isnan(device):
                continue  # the side is undefined here (a division by zero): a normal form may have dropped it
            if not math.isclose(lowered, device, rel_tol=1e-6, abs_tol=1e-8):
                return (f"the z3 lowering of the {which} side gives {lowered:g} at {_where(sizes, index)}, "
                        f"the devices {device:g}")
    return None


def _where(sizes: Mapping[str, int], index) -> str:
    return f"index {list(index)} (sizes {', '.join(f'{k} = {v}' for k, v in sorted(sizes.items()))})"


# ---------------------------------------------------------------- random instances, large ranks and sizes


def devices_disagree(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], max_rank: int | None = None,
                     deadline: float | None = None, notes: list[str] | None = None) -> str:
    """A disagreement of the two sides on the devices at a random large instance ('' when every one agrees).

    `max_rank` is the rank the verdict claims up to (None: every rank, checked up to LARGE_MAX_RANK).
    The draws are seeded by the rule's name, so a verdict is reproducible; past `deadline` (the wall
    clock's safety valve) OutOfTime, never a shorter check."""
    for instance, sizes, seed in large_instances(rule, ops, max_rank, deadline):
        try:
            failure = concrete.trial(instance, sizes, seed=seed, notes=notes)
        except concrete.Unsupported:
            continue
        if failure is not None:
            lengths = ", ".join(f"len({g}) = {n}" for g, n in instance.groups.items())
            shown = ", ".join(f"{k} = {v}" for k, v in sorted(sizes.items()))
            return (f"at a random instance ({lengths + '; ' if lengths else ''}{shown}) the devices refute it: "
                    f"{failure.reason}")
    return ""


def large_instances(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], max_rank: int | None = None,
                    deadline: float | None = None) -> Iterator[tuple[RuleInstance, dict[str, int], int]]:
    """Up to LARGE_TRIALS (instance, sizes, seed) where the rule applies and fits: half at group lengths
    drawn among those of the largest rank, half at lengths drawn among all (typing a rank-8 instance costs
    more than running it, so each drawn instance is run at several sizes from `large_sizes`)."""
    rng = random.Random(zlib.crc32(rule.name.encode()))
    top = LARGE_MAX_RANK if max_rank is None else min(max_rank, LARGE_MAX_RANK)
    assignments = group_assignments(rule, top) or [{}]
    highest = max(top_rank(rule, a) for a in assignments)
    tall = [a for a in assignments if top_rank(rule, a) == highest]
    per_instance = LARGE_TRIALS // 2
    for pool in (tall, assignments):
        try:
            instance = type_rule(rule, ops, rng.choice(pool))
        except TypeCheckError:
            continue  # does not type at these lengths
        if instance.problems:
            continue  # no parallel program to run here
        found = 0
        for draw in range(LARGE_DRAWS // 2):
            if found >= per_instance:
                break
            check_deadline(deadline, "the cross-check at random large instances")
            sizes = large_sizes(instance, rng)
            if sizes is not None and concrete.applies(instance, sizes):
                found += 1
                yield instance, sizes, draw


def _elements(instance: RuleInstance, sizes: dict[str, int]) -> int | None:
    """The tensors' elements at `sizes`; None where a shape divides by a size of 0."""
    try:
        return concrete._elements(instance, sizes)
    except ZeroDivisionError:
        return None


def large_sizes(instance: RuleInstance, rng: random.Random) -> dict[str, int] | None:
    """Random sizes with one dim (or integer) at LARGE_MAX_SIZE or the largest multiple of the degrees below
    it, the others anywhere from their least value up to it, lowered (largest first, never the big one) until
    the tensors hold at most `LARGE_MAX_ELEMENTS` elements; None when even that does not fit, or when a shape
    is undefined at the sizes drawn (`c / groups` with an int `groups` of 0, which the rule's `where` excludes)."""
    kinds = instance.symbols
    sizes = {n: rng.choice((1, 2, 2, 3, 4)) for n, k in kinds.items() if k == "degree"}
    unit = math.lcm(*sizes.values()) if sizes else 1
    multiples = [unit * j for j in range(1, LARGE_MAX_SIZE // unit + 1)] or [unit]
    free = sorted(n for n, k in kinds.items() if k != "degree")
    for n in free:
        low = 0 if kinds[n] == "int" else 1
        sizes[n] = rng.choice(multiples) if rng.random() < 0.5 else rng.randint(low, LARGE_MAX_SIZE)
    if free:
        big = rng.choice(free)
        sizes[big] = max(multiples) if rng.random() < 0.5 else LARGE_MAX_SIZE
        while (elements := _elements(instance, sizes)) is None or elements > LARGE_MAX_ELEMENTS:
            if elements is None:
                return None
            shrinkable = [n for n in free if n != big and sizes[n] > 1]
            if not shrinkable:
                return None
            name = max(shrinkable, key=lambda n: (sizes[n], n))  # every step lowers a size: it ends
            sizes[name] = unit if sizes[name] > unit else 1
    return sizes

