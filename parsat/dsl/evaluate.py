"""Numpy evaluation of an operator's index semantics at concrete sizes.

The verifier replays rules on concrete pieces with it, backend tests use it
as the reference, and a rule generator can use it to compare candidates.
Evaluation is vectorized: every index variable is an integer grid that
broadcasts along its own axis (output indices first, then one axis per
nesting level of `sum`); `if` is `np.where` with out-of-range indices
clipped (the branch not taken may read anywhere); a `sum` broadcasts its
body along its axis and adds it up, a `max` takes its largest value (0 over
an empty range, and a range whose bound is negative is empty, as
docs/LANGUAGE.md defines it).

Partial operations: values are reals, and `a / b` is undefined where
`b == 0`, `log(a)` where `a <= 0`, `sqrt(a)` where `a < 0`. An undefined
value is NaN here, and NaN spreads through everything that uses it (sums,
maxima, functions) except the branch of an `if` that is not taken; float
infinities are never produced for them (`1 / 0` is NaN, not inf), so a
`0 * (1 / 0)` stays undefined as the semantics says. The verifier reads
NaN as "undefined" (`verifier.concrete`).

`evaluate` is the whole-tensor entry point. `evaluate_op` exposes what the
piece-wise simulation of a parallel op needs: index ranges restricted to a
block (`ranges`) and, for partial sums, which block of a sharded summation
variable and which partial piece of an input a given sum index selects
(`PieceSelection`).
"""

from __future__ import annotations

import math
from fractions import Fraction
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from parsat.dsl import ast
from parsat.dsl.conditions import to_poly
from parsat.dsl.instantiate import OpInstance, expanded
from parsat.dsl.symbolic import Poly


class EvaluationError(Exception):
    """Inputs or sizes that do not fit the operator instance."""


@dataclass(frozen=True)
class PieceSelection:
    """Which partial-sum piece is being computed (see `dsl.spread`).

    A sum index `s` decodes along the semantics exactly as the spread
    analysis composes partial degrees: at a `sum` over a variable of degree
    `d > 1`, the block is `s % d` and the body sees `s // d`; a partial
    input is read at the sum index that reaches it.
    """

    sum_index: int
    var_degrees: Mapping[str, int] = field(default_factory=dict)
    partial_inputs: Mapping[str, Sequence[np.ndarray]] = field(default_factory=dict)


def _log(x):
    """log, undefined (NaN) at and below 0 (numpy gives -inf at 0)."""
    x = np.asarray(x, dtype=np.float64)
    return np.where(x > 0, np.log(np.where(x > 0, x, 1.0)), np.nan)


def _divide(left, right):
    """`left / right`, undefined (NaN) where `right == 0`, for floats and exact rationals alike."""
    left, right = np.asarray(left), np.asarray(right)
    zero = right == 0
    if not np.any(zero):
        return np.divide(left, right)
    return np.where(zero, np.nan, np.divide(left, np.where(zero, 1, right)))


def undefined(values) -> np.ndarray:
    """Where a value is undefined (NaN), for float and exact (object) arrays."""
    values = np.asarray(values)
    if values.dtype != object:
        return np.isnan(values)
    return np.vectorize(lambda v: isinstance(v, float) and v != v, otypes=[bool])(values) if values.size \
        else np.zeros(values.shape, dtype=bool)


_FUNCTIONS = {
    "exp": np.exp, "log": _log, "sqrt": np.sqrt, "tanh": np.tanh, "abs": np.abs, "sin": np.sin, "cos": np.cos,
    "erf": np.vectorize(math.erf, otypes=[float]),
    "max": np.maximum, "min": np.minimum,
    "step": lambda v: _step(np.asarray(v)),
}
_EXACT_FUNCTIONS = {"max", "min", "abs", "step"}  # the others leave the rationals (object arrays of floats)


def _step(v: np.ndarray) -> np.ndarray:
    """1 where v > 0, else 0 (the Heaviside step, 0 at 0): Python ints for exact (object) arrays."""
    out = np.where(v > 0, 1, 0)
    return out.astype(object) if v.dtype == object else out.astype(np.float64)


def evaluate(instance: OpInstance, sizes: Mapping[str, int], inputs: Mapping[str, np.ndarray],
             reals: Mapping[str, float] | None = None) -> np.ndarray:
    """`out` of `instance` for the caller's concrete sizes and input arrays.

    `sizes` gives every symbol the instance's dims and attributes mention
    (the caller's names, e.g. a rule's `m`, `p`); `reals` gives the real
    metavariables its real attributes mention.
    """
    dims = {name: poly.evaluate(sizes) for name, poly in instance.size_env().items()}
    return evaluate_op(instance, dims, inputs, reals)


def evaluate_op(instance: OpInstance, dims: Mapping[str, int], inputs: Mapping[str, np.ndarray],
                reals: Mapping[str, float] | None = None, *,
                ranges: Mapping[str, tuple[int, int]] | None = None,
                pieces: PieceSelection | None = None) -> np.ndarray:
    """`out` with the op's own size names bound to `dims`.

    `ranges` restricts index variables to `[start, stop)` (a block of the
    output, or of a summation); the result then has the restricted extents.
    """
    return _Evaluator(instance, dims, inputs, reals or {}, ranges or {}, pieces).run()


_DEPTHS: dict[int, tuple[ast.Expr, int]] = {}


def _depth(expr: ast.Expr) -> int:
    """How deeply `sum`s nest in `expr` (memoized per body: the evaluator is called often on few bodies)."""
    hit = _DEPTHS.get(id(expr))
    if hit is not None and hit[0] is expr:
        return hit[1]
    depth = _depth_of(expr)
    if len(_DEPTHS) > 20000:
        _DEPTHS.clear()
    _DEPTHS[id(expr)] = (expr, depth)
    return depth


def _depth_of(expr: ast.Expr) -> int:
    below = max((_depth_of(c) for c in ast.children(expr)), default=0)
    return below + 1 if isinstance(expr, ast.RANGE_BINDERS) else below


class _Evaluator:
    def __init__(self, instance: OpInstance, dims: Mapping[str, int], inputs: Mapping[str, np.ndarray],
                 reals: Mapping[str, float], ranges: Mapping[str, tuple[int, int]],
                 pieces: PieceSelection | None):
        # Exact arithmetic when an input holds Python Fractions (object arrays): literals are then
        # Fractions too, so 1e-400 * x is not 0 (functions such as exp fall back to floats).
        arrays = list(inputs.values()) + [a for ps in (pieces.partial_inputs.values() if pieces else ())
                                          for a in ps]
        self.exact = any(np.asarray(a).dtype == object for a in arrays)
        self.dtype = object if self.exact else np.float64
        self.instance = instance
        self.dims = dict(dims)
        self.inputs = inputs
        self.reals = reals
        self.ranges = ranges
        self.pieces = pieces
        self.rank = len(instance.out_vars)
        self.ndim = self.rank + _depth(instance.body)
        for name in instance.inputs:
            if name not in inputs and not (pieces and name in pieces.partial_inputs):
                raise EvaluationError(f"{instance.name}: no value for input '{name}'")

    def _number(self, value):
        return Fraction(value) if self.exact else float(value)

    def _grid(self, axis: int, start: int, stop: int) -> np.ndarray:
        shape = [1] * self.ndim
        shape[axis] = stop - start
        return np.arange(start, stop, dtype=np.int64).reshape(shape)

    def run(self) -> np.ndarray:
        env: dict[str, np.ndarray | int] = {}
        extents = []
        for axis, (var, full) in enumerate(zip(self.instance.out_vars, self._out_extents())):
            start, stop = self.ranges.get(var, (0, full))
            env[var] = self._grid(axis, start, stop)
            extents.append(stop - start)
        s = self.pieces.sum_index if self.pieces else 0
        with np.errstate(all="ignore"):
            value = np.asarray(self._value(self.instance.body, env, self.rank, s), dtype=self.dtype)
        value = value.reshape(value.shape + (1,) * (self.ndim - value.ndim)) if value.ndim < self.ndim else value
        value = value.reshape(value.shape[:self.rank]) if self.ndim > self.rank else value
        return np.array(np.broadcast_to(value, tuple(extents)), dtype=self.dtype)

    def _out_extents(self) -> list[int]:
        """Output sizes from the op's own result type and `dims` (op-level names)."""
        env = {name: Poly.const(int(v)) for name, v in self.dims.items()}
        out: list[int] = []
        for dim in self.instance.op.result.dims:
            if isinstance(dim, ast.Variadic):
                out.extend(int(self.dims[expanded(dim.id, k)]) for k in range(self.instance.groups[dim.id]))
            else:
                out.append(to_poly(dim, env, self.instance.groups).evaluate({}))
        return out

    # ----------------------------------------------------------- integers
    def _int(self, expr: ast.Expr, env: Mapping[str, np.ndarray | int]):
        if isinstance(expr, ast.Num):
            return int(expr.value)
        if isinstance(expr, ast.Name):
            if expr.id in env:
                return env[expr.id]
            if expr.id in self.dims:
                return self.dims[expr.id]
            raise EvaluationError(f"{self.instance.name}: unknown name '{expr.id}'")
        if isinstance(expr, ast.Len):
            return self.instance.groups[expr.group]
        if isinstance(expr, ast.Neg):
            return -self._int(expr.operand, env)
        if isinstance(expr, ast.BinOp):
            left, right = self._int(expr.left, env), self._int(expr.right, env)
            if expr.op == "+":
                return left + right
            if expr.op == "-":
                return left - right
            if expr.op == "*":
                return left * right
            if expr.op == "/":
                return np.floor_divide(left, np.where(np.equal(right, 0), 1, right))
            if expr.op == "%":
                return np.mod(left, np.where(np.equal(right, 0), 1, right))
        raise EvaluationError(f"{self.instance.name}: not an integer expression")

    def _test(self, expr: ast.Expr, env):
        if isinstance(expr, ast.Compare):
            left, right = self._int(expr.left, env), self._int(expr.right, env)
            return {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal,
                    "==": np.equal, "!=": np.not_equal}[expr.op](left, right)
        if isinstance(expr, ast.BoolOp):
            left, right = self._test(expr.left, env), self._test(expr.right, env)
            return np.logical_and(left, right) if expr.op == "and" else np.logical_or(left, right)
        if isinstance(expr, ast.Not):
            return np.logical_not(self._test(expr.operand, env))
        raise EvaluationError(f"{self.instance.name}: not a condition")

    # ------------------------------------------------------------- values
    def _tensor(self, name: str, s: int) -> np.ndarray:
        if self.pieces and name in self.pieces.partial_inputs:
            return self.pieces.partial_inputs[name][s]
        return self.inputs[name]

    def _value(self, expr: ast.Expr, env, depth: int, s: int):
        if isinstance(expr, ast.Num):
            return self._number(expr.value)
        if isinstance(expr, ast.Name):
            if expr.id in self.instance.real_attrs:
                attr = self.instance.real_attrs[expr.id]
                if isinstance(attr, ast.Num):
                    return self._number(attr.value)
                if attr.id not in self.reals:
                    raise EvaluationError(f"no value for real '{attr.id}'")
                return self._number(self.reals[attr.id])
            integer = self._int(expr, env)
            return np.asarray(integer, dtype=object) if self.exact else np.asarray(integer, dtype=np.float64)
        if isinstance(expr, ast.Len):
            return self._number(self.instance.groups[expr.group])
        if isinstance(expr, ast.Access):
            array = np.asarray(self._tensor(expr.tensor, s), dtype=self.dtype)
            if array.ndim != len(expr.indices):
                raise EvaluationError(f"{self.instance.name}: '{expr.tensor}' has rank {array.ndim}, "
                                      f"read with {len(expr.indices)} indices")
            index = tuple(np.clip(np.asarray(self._int(i, env)), 0, max(n - 1, 0))
                          for i, n in zip(expr.indices, array.shape))
            if any(n == 0 for n in array.shape):
                return np.zeros(np.broadcast_shapes(*(np.shape(i) for i in index)) if index else ())
            return array[index] if index else array[()]
        if isinstance(expr, ast.Call):
            args = [self._value(a, env, depth, s) for a in expr.args]
            if self.exact and expr.func not in _EXACT_FUNCTIONS:
                args = [np.asarray(a, dtype=object).astype(np.float64) for a in args]
            return _FUNCTIONS[expr.func](*args)
        if isinstance(expr, ast.Neg):
            return -self._value(expr.operand, env, depth, s)
        if isinstance(expr, ast.BinOp):
            left = self._value(expr.left, env, depth, s)
            right = self._value(expr.right, env, depth, s)
            if expr.op == "+":
                return left + right
            if expr.op == "-":
                return left - right
            if expr.op == "*":
                return left * right
            if expr.op == "/":
                return _divide(left, right)
            raise EvaluationError(f"{self.instance.name}: '{expr.op}' on values")
        if isinstance(expr, ast.IfThenElse):
            test = self._test(expr.test, env)
            return np.where(test, self._value(expr.then, env, depth, s), self._value(expr.orelse, env, depth, s))
        if isinstance(expr, ast.Sum):
            bound = int(self._int(expr.bound, env))
            degree = self.pieces.var_degrees.get(expr.var, 1) if self.pieces else 1
            start, stop = self.ranges.get(expr.var, (0, bound))
            inner_s = s
            if degree > 1:
                extent = bound // degree
                block, inner_s = s % degree, s // degree
                start, stop = block * extent, (block + 1) * extent
            stop = max(start, stop)  # a negative bound is an empty range
            grid = self._grid(depth, start, stop)
            body = np.asarray(self._value(expr.body, {**env, expr.var: grid}, depth + 1, inner_s), dtype=self.dtype)
            body = body.reshape(body.shape + (1,) * (self.ndim - body.ndim))
            target = list(body.shape)
            target[depth] = stop - start
            return np.broadcast_to(body, tuple(target)).sum(axis=depth, keepdims=True)
        if isinstance(expr, ast.Max):
            return self._max(expr, env, depth, s)
        raise EvaluationError(f"{self.instance.name}: cannot evaluate {type(expr).__name__}")

    def _max(self, expr: ast.Max, env, depth: int, s: int):
        """`max(var < bound) body`: 0 over an empty range, undefined when a term is."""
        if self.pieces and self.pieces.var_degrees.get(expr.var, 1) > 1:
            raise EvaluationError(f"{self.instance.name}: a max over '{expr.var}', a sharded range, has no "
                                  "partial pieces (a local max is not a summand)")
        bound = int(self._int(expr.bound, env))
        start, stop = self.ranges.get(expr.var, (0, bound))
        stop = max(start, stop)  # a negative bound is an empty range
        grid = self._grid(depth, start, stop)
        body = np.asarray(self._value(expr.body, {**env, expr.var: grid}, depth + 1, s), dtype=self.dtype)
        body = body.reshape(body.shape + (1,) * (self.ndim - body.ndim))
        target = list(body.shape)
        target[depth] = stop - start
        if stop <= start:  # an empty range: 0, as an empty sum
            target[depth] = 1
            return np.zeros(tuple(target), dtype=self.dtype)
        spread = np.broadcast_to(body, tuple(target))
        largest = spread.max(axis=depth, keepdims=True)
        if self.exact:  # Python's max may skip a NaN among rationals: an undefined term stays undefined
            largest = np.where(undefined(spread).any(axis=depth, keepdims=True), np.nan, largest)
        return largest
