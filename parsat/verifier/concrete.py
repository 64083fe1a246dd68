"""Concrete replay of a rule, judged device by device: the verifier's ground truth.

`trial` runs a rule instance at concrete sizes on random small-integer
inputs and says whether it fails there, and how:
* the right side is undefined where the left is defined ("undefined");
* the sides' global values differ in shape or value ("shape", "value"),
  parallel operators being the identity on values;
* the sides are spread differently ("spread"), as the rule states them;
* on the devices (`verifier.devices`), a side does not compute its own
  global value: a device cannot run an operator on what it holds, devices
  holding the same piece disagree, or the assembled pieces differ from
  the semantics ("device"). The device and index are reported, and the
  first node where the devices go wrong.

`search` draws degenerate, then small, then random sizes (dims often
multiples of the degrees, so that divisibility holds without rejection),
plus any witnesses the caller passes. `shrink` lowers sizes while the
failure stays; every step it takes lowers the sum of all sizes, so it
ends. Both are bounded by counts; past an optional wall-clock deadline
they raise `limits.OutOfTime` (a safety valve: stopping early would make
the answer depend on the machine's speed). Literals that a float cannot hold exactly
(`1e-400`) are replayed in exact rational arithmetic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Iterable, Iterator, Mapping

import numpy as np

from parsat.dsl import ast
from parsat.dsl.conditions import holds
from parsat.dsl.evaluate import EvaluationError, undefined
from parsat.dsl.printer import format_expr
from parsat.dsl.typecheck import RuleInstance, TypedTerm
from parsat.verifier.devices import (DeviceError, DeviceTensor, Inconsistent, Mesh, MeshPlacement, NotPlaceable,
                                     RuleSides, gather, global_value)
from parsat.verifier.limits import check_deadline
from parsat.verifier.pieces import PieceSimulator, Unsupported, assemble, observe, simulate  # noqa: F401 (public)
from parsat.verifier.verdict import Counterexample

RTOL = 1e-6
ATOL = 1e-8
MAX_ELEMENTS = 200_000       # a replay (a z3 model, a cached counterexample) may be this large
SEARCH_MAX_ELEMENTS = 4_096  # the search skips larger draws: small counterexamples are found first, and fast



@dataclass(frozen=True)
class Failure:
    """The two sides differ (or the right one is undefined) at these sizes."""

    kind: str  # "undefined", "shape", "value", "spread", "device"
    reason: str
    sizes: Mapping[str, int]
    counterexample: Counterexample


# ------------------------------------------------------------------- values


def applies(instance: RuleInstance, sizes: Mapping[str, int]) -> bool:
    """The rule's `where` and the left side's requirements hold."""
    return all(sizes[n] >= (0 if k == "int" else 1) for n, k in instance.symbols.items()) and all(
        holds(c, sizes) for c in instance.where + instance.lhs_requires)


def needs_exact(instance: RuleInstance) -> bool:
    """A real literal that a float cannot hold exactly (1e-400, 0.1 is fine as both sides round alike)."""
    for side in (instance.lhs, instance.rhs):
        for term in side.walk():
            if term.instance is None:
                continue
            for attr in term.instance.real_attrs.values():
                if isinstance(attr, ast.Num) and Fraction(attr.value) != Fraction(float(attr.value)):
                    return True
    return False


def random_inputs(instance: RuleInstance, sizes: Mapping[str, int], rng: np.random.Generator,
                  exact: bool = False, halves: bool = False) -> dict[str, np.ndarray]:
    """Small integers (as float64, or as Fractions when exact): sums and products stay exact. With `halves`,
    multiples of 1/2 from -3 to 3 instead, still exact in a float: a denominator such as `x - 0.5` has its
    root among them."""
    out = {}
    for name, shape in instance.tensors.items():
        dims = tuple(d.evaluate(sizes) for d in shape)
        values = rng.integers(-6, 7, size=dims) if halves else rng.integers(-3, 4, size=dims)
        scale = Fraction(1, 2) if halves else Fraction(1)
        out[name] = _exact(values, scale) if exact else values.astype(np.float64) * float(scale)
    return out


def _exact(values: np.ndarray, scale: Fraction = Fraction(1)) -> np.ndarray:
    out = np.empty(values.shape, dtype=object)
    for index, v in np.ndenumerate(values):
        out[index] = Fraction(int(v)) * scale
    return out


# real metavariables: small integers, and non-integers (exact in a float) a rule about integers could miss
REAL_VALUES = (-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 0.5, -0.5, 1.5, -2.5, 0.25)


def random_reals(instance: RuleInstance, rng: np.random.Generator) -> dict[str, float]:
    return {name: float(REAL_VALUES[int(rng.integers(len(REAL_VALUES)))]) for name in instance.reals}


def _elements(instance: RuleInstance, sizes: Mapping[str, int]) -> int:
    return sum(math.prod(d.evaluate(sizes) for d in shape) for shape in instance.tensors.values())


def _spread_values(term: TypedTerm, sizes: Mapping[str, int]) -> tuple:
    s = term.spread
    return (tuple(d.evaluate(sizes) for d in s.shard), s.copy.evaluate(sizes), s.sum.evaluate(sizes))


def _fmt_spread(values: tuple) -> str:
    shard, copy, total = values
    text = f"shard {list(shard)}"
    if copy != 1:
        text += f", copy {copy}"
    if total != 1:
        text += f", sum {total}"
    return text


def _agrees(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Elementwise refinement: where `reference` is undefined (NaN) anything agrees; elsewhere `candidate` must be
    defined and equal (exactly for rationals, within RTOL/ATOL for floats)."""
    loose = undefined(reference)
    missing = undefined(candidate) & ~loose
    if reference.dtype == object or candidate.dtype == object:
        flat = [True if lo else False if mi else
                (x == y if isinstance(x, Fraction) and isinstance(y, Fraction)
                 else bool(np.isclose(float(x), float(y), rtol=RTOL, atol=ATOL)))
                for x, y, lo, mi in zip(reference.flat, candidate.flat, loose.flat, missing.flat)]
        return np.array(flat, dtype=bool).reshape(reference.shape)
    return loose | (~missing & np.isclose(reference, candidate, rtol=RTOL, atol=ATOL, equal_nan=True))


def first_difference(reference: np.ndarray, candidate: np.ndarray) -> tuple[int, ...] | None:
    """The first index where `candidate` does not refine `reference` (None: it does everywhere)."""
    if reference.shape != candidate.shape:
        return None
    bad = np.argwhere(~_agrees(reference, candidate))
    return tuple(int(v) for v in bad[0]) if len(bad) else None


def _num(value) -> str:
    if isinstance(value, Fraction):
        if value.denominator == 1:
            return str(value.numerator)
        if Fraction(float(value)) == value or (abs(value.numerator) < 10 ** 6 and value.denominator < 10 ** 6):
            return f"{float(value):g}" if Fraction(float(value)) == value else str(value)
        return format(Decimal(value.numerator) / Decimal(value.denominator), ".6g")
    return f"{float(value):g}"


def _listed(value: np.ndarray, exact_text: bool = False):
    """Nested lists for JSON: floats, "undefined" for an undefined element (NaN is not JSON), and exact
    rationals a float cannot hold as their decimal text (as `p/q` with `exact_text`: an input, replayed)."""
    if value.dtype == object or (value.size and undefined(value).any()):
        def one(v):
            if isinstance(v, float) and v != v:
                return "undefined"
            if isinstance(v, Fraction) and Fraction(float(v)) != v:
                return str(v) if exact_text else _num(v)
            return float(v)
        with np.errstate(all="ignore"):
            return np.vectorize(one, otypes=[object])(value.astype(object)).tolist() if value.size else value.tolist()
    return value.tolist()


# --------------------------------------------------------------------- trial


def trial(instance: RuleInstance, sizes: Mapping[str, int], seed: int = 0,
          inputs: Mapping[str, np.ndarray] | None = None,
          reals: Mapping[str, float] | None = None, notes: list[str] | None = None) -> Failure | None:
    """Compare both sides at these sizes (None: they agree, or the rule does not apply here).

    Where the spread analysis and the devices disagree on a node the
    analysis accepts, a bug report is appended to `notes`.
    """
    if not applies(instance, sizes):
        return None
    if _elements(instance, sizes) > MAX_ELEMENTS:
        raise Unsupported("sizes too large to simulate")
    rng = np.random.default_rng(seed)
    exact = needs_exact(instance)
    inputs = dict(inputs) if inputs is not None else random_inputs(instance, sizes, rng, exact, halves=seed % 3 == 2)
    reals = dict(reals) if reals is not None else random_reals(instance, rng)
    lhs, rhs = instance.lhs, instance.rhs
    base = dict(groups=dict(instance.groups), sizes=dict(sorted(sizes.items())),
                reals={k: float(v) if Fraction(float(v)) == v else str(Fraction(v)) for k, v in reals.items()},
                inputs={k: _listed(np.asarray(v), exact_text=True) for k, v in inputs.items()},
                lhs_text=format_expr(instance.rule.lhs), rhs_text=format_expr(instance.rule.rhs))
    memo: dict = {}
    try:
        left = global_value(lhs, sizes, inputs, reals, memo)
    except (EvaluationError, ZeroDivisionError, IndexError, ValueError) as err:
        raise Unsupported(f"the left side cannot be evaluated here: {err}") from None

    def failure(kind: str, reason: str, right, device: str = "", **extra) -> Failure:
        cex = Counterexample(reason, lhs=_listed(left), rhs=right, device=device, **extra, **base)
        return Failure(kind, reason, dict(sizes), cex)

    for req in instance.rhs_requires:
        if not holds(req, sizes):
            return failure("undefined", f"the right-hand side is undefined here: {req.reason or req}", "undefined")
    try:
        right = global_value(rhs, sizes, inputs, reals, memo)
    except (EvaluationError, ZeroDivisionError, IndexError, ValueError) as err:
        return failure("undefined", f"the right-hand side cannot be evaluated here: {err}", "undefined")
    lspread, rspread = _spread_values(lhs, sizes), _spread_values(rhs, sizes)
    spreads = dict(lhs_spread=_fmt_spread(lspread), rhs_spread=_fmt_spread(rspread))
    if left.shape != right.shape:
        return failure("shape", f"the sides have different shapes: left {list(left.shape)}, right "
                                f"{list(right.shape)}", _listed(right), **spreads)
    spot = first_difference(left, right)
    if spot is not None and undefined(right[spot]):
        return failure("undefined", f"the right-hand side is undefined at index {list(spot)} (a division by zero, "
                                    f"or a log or square root out of its domain) where the left-hand side is "
                                    f"defined ({_num(left[spot])})", _listed(right), **spreads)
    if spot is not None:
        return failure("value", f"the sides compute different values (at index {list(spot)}: "
                                f"{_num(left[spot])} vs {_num(right[spot])})", _listed(right), **spreads)
    trusted = not instance.problems  # the analysis's spread of an illegal term is no claim at all
    if trusted and lspread != rspread:
        return failure("spread", f"the sides are spread differently: left {_fmt_spread(lspread)}, right "
                                 f"{_fmt_spread(rspread)}", _listed(right), **spreads)
    problem, placed = on_devices(instance, sizes, inputs, reals, memo, notes)
    if problem is not None:
        which, reason, device = problem
        return failure("device", f"on the devices, the {which} side {reason}", _listed(right), device, **spreads)
    if placed[0] != placed[1]:
        shown = dict(lhs_spread=_fmt_spread(placed[0]), rhs_spread=_fmt_spread(placed[1]))
        return failure("spread", f"on the devices, the sides are spread differently: left {shown['lhs_spread']}, "
                                 f"right {shown['rhs_spread']}", _listed(right), **shown)
    return None


def on_devices(instance: RuleInstance, sizes: Mapping[str, int], inputs: Mapping[str, np.ndarray],
               reals: Mapping[str, float], memo: dict | None = None,
               notes: list[str] | None = None) -> tuple[tuple[str, str, str] | None, tuple]:
    """Both sides run device by device: ((side, what goes wrong, where) or None, the sides' spreads there).

    Each side must compute its own global value on the devices; the
    spreads are (shard degrees, copy, sum) of the placements they end in.

    Raises Unsupported when the sides cannot be laid out on a mesh at
    these degrees (a combine by a factor no axis holds, too many devices).
    """
    memo = {} if memo is None else memo
    try:
        sides = RuleSides([instance.lhs, instance.rhs], sizes)
    except (NotPlaceable, DeviceError) as err:
        raise Unsupported(f"no mesh for these degrees: {err}") from None
    mesh = sides.mesh
    placed = {name: _whole(np.asarray(value), mesh) for name, value in inputs.items()}
    spreads = []
    for which, term in (("left", instance.lhs), ("right", instance.rhs)):
        try:
            run = sides.run(term, placed, reals)
        except DeviceError as err:
            return (which, f"cannot run: {err}", ""), ()
        except NotPlaceable as err:
            raise Unsupported(str(err)) from None
        if notes is not None:
            notes.extend(_analysis_disagrees(run.nodes, sizes, mesh))
        found = _side_problem(run.tensor, global_value(term, sizes, inputs, reals, memo), mesh)
        if found is not None:
            reason, device = found
            culprit = _culprit(run.nodes, sizes, inputs, reals, memo, mesh)
            if notes is not None and "a bug in parsat/dsl/spread.py" in culprit:
                notes.append(f"the spread analysis accepts a spread the devices cannot compute{culprit[1:]}")
            return (which, reason + culprit, device), ()
        spreads.append(run.tensor.placement.degrees(mesh))
    return None, tuple(spreads)


def _whole(value: np.ndarray, mesh: Mesh) -> DeviceTensor:
    return DeviceTensor(tuple(value.shape), MeshPlacement.whole(value.ndim), {d: value for d in mesh.devices()})


def _side_problem(tensor: DeviceTensor, expected: np.ndarray, mesh: Mesh) -> tuple[str, str] | None:
    """What is wrong with the devices' pieces of one node, and the device/index where it shows."""
    try:
        copies = gather(tensor, mesh)
    except Inconsistent as err:
        return f"is inconsistent: {err}", ""
    for c, value in enumerate(copies):
        if value.shape != expected.shape:
            return f"assembles to shape {list(value.shape)}, not {list(expected.shape)}", ""
        spot = first_difference(expected, value)
        if spot is None:
            continue
        holders = _holders(tensor, mesh, spot, c)
        where = (f"at index {list(spot)}{f' of copy {c}' if len(copies) > 1 else ''}, held by device "
                 f"{holders}: the devices give {_num(value[spot])}, the semantics {_num(expected[spot])}")
        return f"computes something else than its semantics ({where})", where
    return None


def _holders(tensor: DeviceTensor, mesh: Mesh, spot: tuple[int, ...], copy: int) -> str:
    shard, _, _ = tensor.placement.degrees(mesh)
    local = [s // d for s, d in zip(tensor.shape, shard)]
    block = tuple(i // n for i, n in zip(spot, local))
    local_index = [i % n for i, n in zip(spot, local)]
    found = [d for d in mesh.devices() if tensor.placement.slot(mesh, d)[0] == block
             and tensor.placement.slot(mesh, d)[1] == copy]
    shown = mesh.describe(found[0]) if found else "?"
    return f"{shown} (local index {local_index}, on mesh {mesh})"


def _analysis_disagrees(nodes, sizes, mesh: Mesh) -> list[str]:
    """Nodes the spread analysis accepts whose claimed spread is not where the devices put the pieces."""
    found = []
    for term, tensor, problems in nodes:
        if term.kind != "op" or term.problems or problems or not all(holds(c, sizes) for c in term.legal_when):
            continue
        claimed = _spread_values(term, sizes)
        held = tensor.placement.degrees(mesh)
        if claimed != held:
            found.append(f"at {format_expr(term.node)} the spread analysis says {_fmt_spread(claimed)}, the devices "
                         f"hold {_fmt_spread(held)} (sizes {dict(sorted(sizes.items()))}): a bug in parsat/dsl/spread.py")
    return found


def _culprit(nodes, sizes, inputs, reals, memo, mesh: Mesh) -> str:
    """The first operator whose devices go wrong, and whether the spread analysis accepted it."""
    for term, tensor, problems in nodes:
        if term.kind != "op":
            continue
        found = _side_problem(tensor, global_value(term, sizes, inputs, reals, memo), mesh)
        if found is None:
            continue
        text = f"; it first goes wrong at {format_expr(term.node)}"
        failing = [c for c in term.legal_when if not holds(c, sizes)]
        if term.problems:
            text += f" (the spread analysis refuses it: {term.problems[0]})"
        elif failing:
            text += f" (illegal at these sizes: {failing[0].reason})"
        else:
            text += " (the spread analysis accepts it: a bug in parsat/dsl/spread.py, please report it)"
        if problems:
            text += f"; its inputs do not line up: {problems[0]}"
        return text
    return ""


# -------------------------------------------------------------------- search


def _lcm(values) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def candidate_sizes(instance: RuleInstance, rng: random.Random, count: int) -> Iterator[dict[str, int]]:
    """Degenerate sizes first (all ones, all twos), then `count` more: boundary sizes (every dim at a degree,
    one below and one above it, integers at 0 and 1), small ones one symbol at a time, interleaved with random
    ones.

    Dims are often drawn as multiples of the degrees, so that divisibility
    requirements hold without rejection.
    """
    names = sorted(instance.symbols)
    kinds = instance.symbols

    def low(name: str) -> int:
        return 0 if kinds[name] == "int" else 1

    for fixed in (1, 2):
        yield {n: max(low(n), fixed) if kinds[n] != "int" else fixed - 1 for n in names}
    yield {n: (2 if kinds[n] == "degree" else 4 if kinds[n] == "dim" else 1) for n in names}
    yield {n: (2 if kinds[n] == "degree" else 2 if kinds[n] == "dim" else 0) for n in names}
    base = {n: (2 if kinds[n] == "degree" else 2 if kinds[n] == "dim" else 1) for n in names}
    boundary = [{n: (degree if kinds[n] == "degree" else degree + step if kinds[n] == "dim" else max(0, step))
                 for n in names} for degree in (3, 2) for step in (-1, 1, 0)] if "degree" in kinds.values() else []
    sweep = boundary + [{**base, n: value} for n in names  # the degree and one off it, then one symbol from the base
                        for value in ((1, 3, 4, 6, 8) if kinds[n] != "int" else (0, 2, 3))]
    drawn = _random_sizes(names, kinds, rng)
    for k in range(count):  # the sweep and random draws, interleaved
        if k % 2 == 0 and k // 2 < len(sweep):
            yield sweep[k // 2]
        else:
            yield next(drawn)


def _random_sizes(names, kinds, rng: random.Random) -> Iterator[dict[str, int]]:
    while True:
        sizes = {}
        for n in names:
            if kinds[n] == "degree":
                sizes[n] = rng.choice((1, 2, 2, 2, 3, 4))
        unit = _lcm(sizes.values()) if sizes else 1
        mode = rng.random()
        for n in names:
            if kinds[n] == "dim":
                sizes[n] = unit * rng.randint(1, 2) if mode < 0.5 else rng.randint(1, 6)
                if mode > 0.85:
                    sizes[n] = unit * min(unit, 4) * rng.randint(1, 2)
            elif kinds[n] == "int":
                sizes[n] = rng.randint(0, 4)
        yield sizes


def search(instance: RuleInstance, count: int = 60, seed: int = 0, shrink_failure: bool = True,
           deadline: float | None = None, extra: Iterable[Mapping[str, int]] = (),
           notes: list[str] | None = None) -> tuple[Failure | None, int, str]:
    """The first failing sizes found (shrunk unless `shrink_failure` is False), trials run, last skip reason.

    `extra` sizes (witnesses from the checker or z3) are tried first. Raises OutOfTime past `deadline`
    (a `time.monotonic()` value).
    """
    rng = random.Random(seed)
    ran, skipped = 0, ""
    seen: set[tuple] = set()
    candidates = list(extra) + list(candidate_sizes(instance, rng, count))
    for k, sizes in enumerate(candidates):
        check_deadline(deadline, "the concrete search")
        key = tuple(sorted(sizes.items()))
        if key in seen:
            continue
        seen.add(key)
        if k >= len(extra) and applies(instance, sizes) and _elements(instance, sizes) > SEARCH_MAX_ELEMENTS:
            continue
        try:
            failure = trial(instance, sizes, seed=k, notes=notes)
        except Unsupported as err:
            skipped = str(err)
            continue
        if applies(instance, sizes):
            ran += 1
        if failure is not None:
            return (shrink(instance, failure, deadline) if shrink_failure else failure), ran, skipped
    return None, ran, skipped


def replay(instance: RuleInstance, sizes: Mapping[str, int], seeds: int = 3) -> Failure | None:
    """The failure at these sizes with the first of a few seeds that shows one (None: none does)."""
    for seed in range(seeds):
        try:
            failure = trial(instance, sizes, seed)
        except Unsupported:
            return None
        if failure is not None:
            return failure
    return None


_fails = replay  # older name


def replay_model(instance: RuleInstance, sizes: Mapping[str, int], inputs: Mapping[str, object],
                 reals: Mapping[str, Fraction]) -> Failure | None:
    """The failure at a solver's model: its sizes, and its input values and reals where it has them (exact
    rationals: a root such as x = 1/3 of a denominator stays one); tensors and reals it leaves out are drawn.
    None: the model does not fail on the devices (z3 reasons with uninterpreted sums, so it may be spurious)."""
    if not applies(instance, sizes):
        return None
    rng = np.random.default_rng(0)
    drawn = random_inputs(instance, sizes, rng, exact=True)
    values = {}
    for name, array in drawn.items():
        given = np.array(inputs[name], dtype=object) if name in inputs else None
        values[name] = given if given is not None and given.shape == array.shape else array
    chosen = {**random_reals(instance, rng), **reals}
    chosen = {k: float(v) if Fraction(float(v)) == v else Fraction(v) for k, v in chosen.items()}
    try:
        return trial(instance, sizes, inputs=exact_inputs(values, needs_exact(instance)), reals=chosen)
    except Unsupported:
        return None


def _measure(sizes: Mapping[str, int]) -> int:
    return sum(sizes.values())


def _smaller(value: int, floor: int) -> list[int]:
    return sorted(v for v in {floor, value // 2, value - 1} if floor <= v < value)


def shrink(instance: RuleInstance, failure: Failure, deadline: float | None = None) -> Failure:
    """Lower sizes while the rule still fails; every accepted step lowers the sum of sizes, so it ends
    (OutOfTime past `deadline`)."""
    best = failure
    floors = {n: (0 if instance.symbols.get(n) == "int" else 1) for n in best.sizes}
    changed = True
    while changed:
        changed = False
        options = []
        for name in sorted(best.sizes, key=lambda n: -best.sizes[n]):
            options += [{**best.sizes, name: v} for v in _smaller(best.sizes[name], floors[name])]
        names = sorted(best.sizes)
        for i, a in enumerate(names):  # a dim together with the degree that must divide it
            for b in names[i + 1:]:
                options.append({**best.sizes, a: max(floors[a], best.sizes[a] // 2),
                                b: max(floors[b], best.sizes[b] // 2)})
        for sizes in options:
            if _measure(sizes) >= _measure(best.sizes):
                continue
            check_deadline(deadline, "shrinking the counterexample")
            smaller = replay(instance, sizes)
            if smaller is not None:
                best, changed = smaller, True
                break
    return best


def _rational(value) -> Fraction:
    """A recorded number: a float (exact), or the text of a rational ("1/3") a float could not hold."""
    return Fraction(value) if isinstance(value, str) else Fraction(float(value))


def exact_inputs(values: Mapping[str, np.ndarray], exact: bool) -> dict[str, np.ndarray]:
    """Input arrays of rationals (object arrays of Fractions) as the evaluator takes them: float64 when every
    value is a float exactly and `exact` is not asked for, else Fractions (so a root such as 1/3 stays one)."""
    floats = not exact and all(Fraction(float(v)) == v for array in values.values() for v in array.flat)
    return {name: np.array(array, dtype=np.float64) if floats else array for name, array in values.items()}


def replay_counterexample(instance: RuleInstance, cex: Counterexample) -> Failure | None:
    """Run a recorded counterexample again (its sizes, inputs and reals): the failure, or None."""
    parsed = {}
    if set(cex.inputs) != set(instance.tensors) or any(k not in cex.sizes for k in instance.symbols):
        return None
    try:
        for name, value in cex.inputs.items():
            array = np.asarray(value, dtype=object)
            if array.shape != tuple(d.evaluate(cex.sizes) for d in instance.tensors[name]):
                return None
            parsed[name] = np.vectorize(_rational, otypes=[object])(array) if array.size else array
        reals = {name: _rational(v) for name, v in cex.reals.items()}
        reals = {name: float(v) if Fraction(float(v)) == v else v for name, v in reals.items()}
        return trial(instance, cex.sizes, inputs=exact_inputs(parsed, needs_exact(instance)), reals=reals)
    except (Unsupported, KeyError, ValueError, TypeError, ZeroDivisionError):
        return None
