"""The degree model's pieces, simulated with numpy: what the spread analysis says each piece holds.

A parallel tensor is held as one array of shape `(*shard, copy, sum,
*local)`: entry `[b..., c, s]` is the piece in slot (blocks `b`, copy `c`,
sum index `s`) (docs/ARCHITECTURE.md). Parallel operators are reshapes of
that array; a compute operator fills each output piece from the input
pieces its index semantics reads, as `dsl.spread`'s analysis lays them out
(`_compute`), or runs each piece blindly when the analysis refuses the
spread (`_naive`).

This is NOT the verifier's ground truth (that is `verifier.devices`, which
runs every device on what it holds): it trusts the analysis's claim of
where each piece lives, which is what makes it fast. The rule generator
(`generate.enumerate`) fingerprints candidate terms with it (and every
rule it proposes is then verified); `observe` gives what a context sees;
`simulate(known=...)` reuses pieces the caller computed before.
"""

from __future__ import annotations

import itertools
from typing import Mapping

import numpy as np

from parsat.dsl.evaluate import EvaluationError, PieceSelection, evaluate_op
from parsat.dsl.instantiate import param_dim_names
from parsat.dsl.typecheck import TypedTerm


class Unsupported(Exception):
    """These sizes cannot be simulated (say why); the search moves on."""


def _whole(array: np.ndarray) -> np.ndarray:
    rank = array.ndim
    return array.reshape((1,) * rank + (1, 1) + array.shape)


def _partition(pieces: np.ndarray, rank: int, dim: int, n: int) -> np.ndarray:
    axis = rank + 2 + dim
    shape = pieces.shape
    if shape[axis] % n:
        raise Unsupported("partition into unequal blocks")
    split = pieces.reshape(shape[:axis] + (n, shape[axis] // n) + shape[axis + 1:])
    moved = np.moveaxis(split, axis, dim + 1)
    return moved.reshape(moved.shape[:dim] + (moved.shape[dim] * n,) + moved.shape[dim + 2:])


def _combine(pieces: np.ndarray, rank: int, dim: int, n: int) -> np.ndarray:
    axis = rank + 2 + dim
    shape = pieces.shape
    if shape[dim] % n:
        raise Unsupported("combine of a dim not sharded by a multiple of its degree")
    split = pieces.reshape(shape[:dim] + (shape[dim] // n, n) + shape[dim + 1:])
    moved = np.moveaxis(split, dim + 1, axis)
    return moved.reshape(moved.shape[:axis] + (moved.shape[axis] * moved.shape[axis + 1],) + moved.shape[axis + 2:])


def _replicate(pieces: np.ndarray, rank: int, n: int) -> np.ndarray:
    return np.repeat(pieces, n, axis=rank)


def _reduce(pieces: np.ndarray, rank: int, n: int) -> np.ndarray:
    axis = rank + 1
    shape = pieces.shape
    if shape[axis] % n:
        raise Unsupported("reduce degree does not divide the partial-sum degree")
    return pieces.reshape(shape[:axis] + (shape[axis] // n, n) + shape[axis + 1:]).sum(axis=axis + 1)


def assemble(pieces: np.ndarray, rank: int, copy: int = 0, sum_index: int | None = None) -> np.ndarray:
    """The logical tensor of one copy: pieces put back together.

    With `sum_index` None the partial pieces are added up (the observable
    value); otherwise the one partial piece is assembled.
    """
    chosen = pieces.sum(axis=rank + 1) if sum_index is None else pieces[(slice(None),) * rank + (slice(None), sum_index)]
    one = chosen[(slice(None),) * rank + (copy,)]
    order = [axis for k in range(rank) for axis in (k, rank + k)]
    shard, local = one.shape[:rank], one.shape[rank:]
    return one.transpose(order).reshape(tuple(d * l for d, l in zip(shard, local)))


def observe(pieces: np.ndarray, rank: int) -> np.ndarray:
    """What a context can see: each (block, copy)'s sum over sum indices."""
    return pieces.sum(axis=rank + 1)


# ------------------------------------------------------------- simulation


class PieceSimulator:
    """The pieces of a typed term at concrete sizes, inputs and reals (`run`)."""

    def __init__(self, sizes: Mapping[str, int], inputs: Mapping[str, np.ndarray], reals: Mapping[str, float],
                 known: Mapping[int, np.ndarray] | None = None):
        self.sizes = dict(sizes)
        self.inputs = inputs
        self.reals = reals
        self.known = known or {}

    def num(self, poly) -> int:
        return int(poly.evaluate(self.sizes))

    def run(self, term: TypedTerm) -> np.ndarray:
        known = self.known.get(id(term.node))
        if known is not None:
            return known
        rank = len(term.shape)
        if term.kind == "input":
            return _whole(np.asarray(self.inputs[term.name], dtype=np.float64))
        if term.kind == "parallel":
            source = self.run(term.args[0])
            degree = self.num(term.degree)
            if degree < 1:
                raise Unsupported("degree below 1")
            if term.name == "partition":
                return _partition(source, rank, term.dim, degree)
            if term.name == "combine":
                return _combine(source, rank, term.dim, degree)
            if term.name == "replicate":
                return _replicate(source, rank, degree)
            return _reduce(source, rank, degree)
        args = [self.run(a) for a in term.args]
        if term.problems:
            return self._naive(term, args)
        return self._compute(term, args)

    def _dims(self, term: TypedTerm) -> dict[str, int]:
        return {name: self.num(poly) for name, poly in term.instance.size_env().items()}

    def _compute(self, term: TypedTerm, args: list[np.ndarray]) -> np.ndarray:
        """Each output piece from the input pieces its index semantics reads."""
        instance = term.instance
        rank = len(term.shape)
        shard = tuple(self.num(d) for d in term.spread.shard)
        copy, total = self.num(term.spread.copy), self.num(term.spread.sum)
        shape = tuple(self.num(d) for d in term.shape)
        local = tuple(s // d for s, d in zip(shape, shard))
        degrees = {var: self.num(d) for var, d in term.var_degrees.items()}
        whole: dict[str, np.ndarray] = {}
        partial: dict[str, list[np.ndarray]] = {}
        for name, arg_term, pieces in zip(instance.inputs, term.args, args):
            arg_rank = len(arg_term.shape)
            count = pieces.shape[arg_rank + 1]
            if count > 1:
                partial[name] = [assemble(pieces, arg_rank, 0, s) for s in range(count)]
            else:
                whole[name] = assemble(pieces, arg_rank, 0, 0)
        out = np.zeros(shard + (copy, total) + local)
        dims = self._dims(term)
        for block in itertools.product(*(range(d) for d in shard)):
            ranges = {var: (b * l, (b + 1) * l) for var, b, l in zip(instance.out_vars, block, local)}
            for s in range(total):
                value = evaluate_op(instance, dims, whole, self.reals, ranges=ranges,
                                    pieces=PieceSelection(s, degrees, partial))
                out[block + (slice(None), s)] = value
        return out

    def _naive(self, term: TypedTerm, args: list[np.ndarray]) -> np.ndarray:
        """Device k runs the op on its own pieces, at local sizes."""
        instance = term.instance
        counts = {int(np.prod(p.shape[:len(t.shape) + 2])) for p, t in zip(args, term.args)}
        if len(counts) != 1:
            raise Unsupported(f"{instance.name}: the inputs are split into different numbers of pieces")
        devices = counts.pop()
        dims = self._dims(term)
        for names, arg_term in zip(param_dim_names(instance), term.args):
            for name, degree in zip(names, arg_term.spread.shard):
                d = self.num(degree)
                if name is not None and d > 1:
                    local = self.num(instance.size_env()[name]) // d
                    if dims.get(name, local) not in (local, self.num(instance.size_env()[name])):
                        raise Unsupported(f"{instance.name}: pieces disagree on the local size of '{name}'")
                    dims[name] = local
        rank = len(term.shape)
        shard = tuple(self.num(d) for d in term.spread.shard)
        copy, total = self.num(term.spread.copy), self.num(term.spread.sum)
        if int(np.prod(shard)) * copy * total != devices:
            raise Unsupported(f"{instance.name}: the output cannot be laid out on {devices} devices")
        flat = []
        for pieces, arg_term in zip(args, term.args):
            r = len(arg_term.shape)
            flat.append(pieces.reshape((-1,) + pieces.shape[r + 2:]))
        results = []
        for device in range(devices):
            try:
                results.append(evaluate_op(instance, dims, {n: f[device] for n, f in zip(instance.inputs, flat)},
                                           self.reals))
            except (EvaluationError, IndexError, ValueError) as err:
                raise Unsupported(f"{instance.name} cannot run on a local piece: {err}") from None
        local = tuple(self.num(d) // s for d, s in zip(term.shape, shard))
        stacked = np.stack(results)
        if stacked.shape[1:] != local:
            raise Unsupported(f"{instance.name}: a local piece has shape {list(stacked.shape[1:])}, "
                              f"the spread expects {list(local)}")
        return stacked.reshape(shard + (copy, total) + local)


def simulate(term: TypedTerm, sizes: Mapping[str, int], inputs: Mapping[str, np.ndarray],
             reals: Mapping[str, float] | None = None, known: Mapping[int, np.ndarray] | None = None) -> np.ndarray:
    """The pieces of `term` (shape `(*shard, copy, sum, *local)`).

    `known` maps `id(node)` of AST nodes whose pieces the caller computed
    before, at these sizes and inputs, to those pieces: a subterm found
    there is not simulated again (the rule generator evaluates thousands of
    terms that share their arguments).
    """
    try:
        return PieceSimulator(sizes, inputs, reals or {}, known).run(term)
    except (ZeroDivisionError, EvaluationError) as err:
        raise Unsupported(str(err)) from None


