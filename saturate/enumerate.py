"""Small terms over a few operators, and exact fingerprints of their values.

`parsat generate` looks for rewrite rules the way TASO and Unity did: build
every small term over the chosen operators (the four parallel ones
included) on a few symbolic input tensors, evaluate each on random
concrete inputs, and group terms whose values agree. A group is a set of
candidate equalities; only the verifier decides which are true.

Terms are rule-language ASTs (`ast.Call`/`ast.Name`), typed with the
checker's own typer (`dsl.typecheck.type_rule`), so shapes, spreads and
definedness requirements are exactly what the checker and verifier will
see later. Values come from the verifier's piece-wise replay
(`verifier.concrete.simulate`), which runs `dsl.evaluate` on every device's
piece: a fingerprint is the logical shape, the spread (shard, copy and sum
degrees) and, for every (block, copy) slot, the sum over the partial-sum
index (what a context can observe). Inputs are small integers and every
operator used keeps them integers, so values are exact integers (checked:
a non-integer or huge value makes the term "inexact" and it is left out
rather than grouped by a rounded value).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from parsat.dsl import ast
from parsat.dsl.conditions import holds
from parsat.dsl.spread import PARALLEL_OPS
from parsat.dsl.typecheck import RuleInstance, TypeCheckError, TypedTerm, type_rule
from parsat.verifier.concrete import Unsupported, observe, simulate

DEGREE = "p"
START = "s"      # split's start, an int symbol
SIZE = "z"       # split's size, an int symbol
EXACT_LIMIT = 2 ** 50


@dataclass(frozen=True)
class TensorVar:
    """A symbolic input: a metavariable name and its dims (size symbols)."""

    name: str
    dims: tuple[str, ...]


@dataclass(frozen=True)
class Term:
    """An enumerated term, typed, with the number of operators it applies."""

    expr: ast.Expr
    ops: int
    typed: TypedTerm = field(compare=False, hash=False)
    text: str = ""


@dataclass(frozen=True)
class Vocabulary:
    """What terms are built from: operators, their attribute choices, inputs."""

    ops: Mapping[str, ast.OpDecl] = field(hash=False)
    names: tuple[str, ...]                       # compute and parallel operators to use
    inputs: tuple[TensorVar, ...]
    dims: tuple[int, ...] = (0, 1)               # dims the parallel ops and dim attributes may name

    def binders(self) -> tuple[ast.Param, ...]:
        """All metavariables a term may use (a generated rule keeps the ones it uses)."""
        out = [ast.Param(v.name, ast.ShapeType(tuple(ast.Name(d) for d in v.dims))) for v in self.inputs]
        out += [ast.Param(DEGREE, ast.ScalarType("degree")), ast.Param(START, ast.ScalarType("int")),
                ast.Param(SIZE, ast.ScalarType("int"))]
        return tuple(out)

    def size_symbols(self) -> list[str]:
        return sorted({d for v in self.inputs for d in v.dims})


class VocabularyError(Exception):
    """The requested operators cannot be enumerated (the message says why)."""


def default_inputs(names: Sequence[str], ops: Mapping[str, ast.OpDecl]) -> tuple[TensorVar, ...]:
    """Rank-2 inputs: x, y of one shape (for elementwise ops and concat), w to multiply by.

    Rank 2 is what matmul needs and what the shipped parallel rules mostly
    talk about; a richer vocabulary costs combinatorially more terms.
    """
    binary = any(n not in PARALLEL_OPS and len(ops[n].tensor_params) >= 2 for n in names)
    out = [TensorVar("x", ("m", "k"))]
    if binary:
        out.append(TensorVar("y", ("m", "k")))
    if any(n in ("matmul", "bmm", "linear", "embedding") for n in names):
        out.append(TensorVar("w", ("k", "n")))
    return tuple(out)


def vocabulary(names: Sequence[str], ops: Mapping[str, ast.OpDecl]) -> Vocabulary:
    unknown = [n for n in names if n not in ops and n not in PARALLEL_OPS]
    if unknown:
        raise VocabularyError(f"unknown operator(s): {', '.join(unknown)} (known: "
                              f"{', '.join(sorted(list(ops) + list(PARALLEL_OPS)))})")
    return Vocabulary(ops, tuple(dict.fromkeys(names)), default_inputs(names, ops))


def _attr_choices(op: ast.OpDecl, dims: Sequence[int]) -> list[tuple[ast.Expr, ...]]:
    """Attribute values to try, per attribute parameter of `op`."""
    per: list[list[ast.Expr]] = []
    for param in op.attr_params:
        kind = param.type.kind
        if kind == "real":
            per.append([ast.Num(1.0)])
        elif kind == "degree":
            per.append([ast.Name(DEGREE)])
        elif param.name == "start":
            per.append([ast.Num(0), ast.Name(START)])
        elif param.name == "size":
            per.append([ast.Name(SIZE)])
        else:
            per.append([ast.Num(d) for d in dims])
    return [tuple(c) for c in itertools.product(*per)]


def _calls(vocab: Vocabulary, name: str, args: Sequence[Term]) -> Iterator[ast.Call]:
    tensors = tuple(a.expr for a in args)
    if name in PARALLEL_OPS:
        if PARALLEL_OPS[name][1] == "dim":
            for d in vocab.dims:
                yield ast.Call(name, tensors + (ast.Num(d), ast.Name(DEGREE)))
        else:
            yield ast.Call(name, tensors + (ast.Name(DEGREE),))
        return
    op = vocab.ops[name]
    for attrs in _attr_choices(op, vocab.dims):
        it_t, it_a = iter(tensors), iter(attrs)
        yield ast.Call(name, tuple(next(it_t) if p.is_tensor else next(it_a) for p in op.params))


def _arity(vocab: Vocabulary, name: str) -> int:
    return 1 if name in PARALLEL_OPS else len(vocab.ops[name].tensor_params)


# ------------------------------------------------------------------ environments


@dataclass(frozen=True)
class Environment:
    """Concrete sizes, degree and input values at which every term is evaluated."""

    sizes: Mapping[str, int] = field(hash=False)
    inputs: Mapping[str, np.ndarray] = field(hash=False)


def environments(vocab: Vocabulary, degrees: Sequence[int], count: int, seed: int = 0) -> list[Environment]:
    """`count` random environments, cycling through `degrees`.

    Dims are distinct multiples of p*p (so every partition of a partition
    divides, and no two dims coincide by accident, which would group terms
    of different shapes) and at least 8, so split's start + size fits.
    """
    rng = random.Random(seed)
    out = []
    symbols = vocab.size_symbols()
    for index in range(count):
        p = degrees[index % len(degrees)]
        factors = rng.sample(range(2, 2 + len(symbols) + 2), len(symbols))
        sizes = {s: p * p * f for s, f in zip(symbols, factors)}
        sizes.update({DEGREE: p, START: rng.randint(1, 3), SIZE: rng.randint(1, 4)})
        np_rng = np.random.default_rng(rng.randrange(2 ** 32))
        inputs = {v.name: np_rng.integers(-9, 10, size=tuple(sizes[d] for d in v.dims)).astype(np.float64)
                  for v in vocab.inputs}
        out.append(Environment(sizes, inputs))
    return out


# ------------------------------------------------------------------ typing and values


def type_term(vocab: Vocabulary, expr: ast.Expr) -> RuleInstance | None:
    """The term typed by the checker's typer (None: it does not type)."""
    rule = ast.RuleDecl("term", vocab.binders(), (), expr, expr)
    try:
        instance = type_rule(rule, vocab.ops, {})
    except TypeCheckError:
        return None
    if instance.problems:
        return None
    return instance


def fingerprint(instance: RuleInstance, envs: Sequence[Environment], max_pieces: int) -> str | None:
    """Shape, spread and observed values at every environment, hashed (None: skip this term).

    A term is skipped when it is undefined at some environment (a
    requirement fails, e.g. `combine` of a whole tensor), has more pieces
    than `max_pieces`, or its values are not exact integers.
    """
    term = instance.lhs
    digest = hashlib.blake2b(digest_size=16)
    for env in envs:
        sizes = env.sizes
        if not all(holds(c, sizes) for c in instance.lhs_requires):
            return None
        shape = tuple(d.evaluate(sizes) for d in term.shape)
        spread = (tuple(d.evaluate(sizes) for d in term.spread.shard), term.spread.copy.evaluate(sizes),
                  term.spread.sum.evaluate(sizes))
        if term.spread.pieces.evaluate(sizes) > max_pieces:
            return None
        try:
            pieces = simulate(term, sizes, env.inputs)
        except (Unsupported, IndexError, ValueError):
            return None
        seen = observe(pieces, len(shape))
        if not np.all(np.isfinite(seen)) or np.any(np.abs(seen) > EXACT_LIMIT) or np.any(seen != np.round(seen)):
            return None
        digest.update(repr((shape, spread, seen.shape)).encode())
        digest.update(np.ascontiguousarray(seen.astype(np.int64)).tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class Enumeration:
    """Terms by fingerprint, and how many were built."""

    groups: Mapping[str, tuple[Term, ...]] = field(hash=False)
    built: int = 0
    typed: int = 0
    stopped: str = ""    # "" or why enumeration stopped early ("seconds", "terms")


def enumerate_terms(vocab: Vocabulary, max_ops: int, envs: Sequence[Environment], max_pieces: int,
                    deadline: Callable[[], bool] = lambda: False, max_terms: int = 200_000,
                    progress: Callable[[str], None] | None = None) -> Enumeration:
    """Every well-typed term with at most `max_ops` operators, grouped by fingerprint.

    Built bottom-up by operator count: a term with c operators is an
    operator applied to terms whose counts add up to c - 1. A term that
    does not type, is undefined, or has too many pieces is neither grouped
    nor used as an argument.
    """
    from parsat.dsl.printer import format_expr

    by_count: dict[int, list[Term]] = {0: []}
    groups: dict[str, list[Term]] = {}
    built = typed = 0
    stopped = ""

    def add(expr: ast.Expr, count: int) -> None:
        nonlocal typed
        instance = type_term(vocab, expr)
        if instance is None:
            return
        key = fingerprint(instance, envs, max_pieces)
        if key is None:
            return
        typed += 1
        term = Term(expr, count, instance.lhs, format_expr(expr))
        by_count.setdefault(count, []).append(term)
        groups.setdefault(key, []).append(term)

    for var in vocab.inputs:
        add(ast.Name(var.name), 0)
    for count in range(1, max_ops + 1):
        for name in vocab.names:
            arity = _arity(vocab, name)
            for split in _compositions(count - 1, arity):
                pools = [by_count.get(c, []) for c in split]
                for args in itertools.product(*pools):
                    for expr in _calls(vocab, name, args):
                        built += 1
                        if built >= max_terms:
                            stopped = "terms"
                        elif built % 256 == 0 and deadline():
                            stopped = "seconds"
                        if stopped:
                            break
                        add(expr, count)
                    if stopped:
                        break
                if stopped:
                    break
            if stopped:
                break
        if progress is not None:
            progress(f"enumerate: {count} operator(s): {built} terms built, {typed} defined, {len(groups)} groups")
        if stopped:
            break
    return Enumeration({k: tuple(v) for k, v in groups.items()}, built, typed, stopped)


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Ordered ways to write `total` as `parts` non-negative counts."""
    if parts == 0:
        return [()] if total == 0 else []
    return [c for c in itertools.product(range(total + 1), repeat=parts) if sum(c) == total]
