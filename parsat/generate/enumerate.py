"""Small terms over a few operators, and exact fingerprints of their values.

`parsat generate` looks for rewrite rules the way TASO and Unity did: build
every small term over the chosen operators (the four parallel ones
included) on a few symbolic input tensors, evaluate each on random
concrete inputs, and group terms whose values agree. A group is a set of
candidate equalities; only the verifier decides which are true.

The vocabulary is generic, not tuned to any rule:

- Inputs are a small typed pool built from dim symbols: same-shape tensors
  `x, y, u: [m, k]` (enough for the associativity of a binary operator) and,
  when a contraction (matmul) is asked for, a chain `w, v: [k, n]`,
  `t: [n, r]`.
- Spread (split) inputs are leaves: a parallel operator applied directly to an input
  (`partition(x, 0, p)`, `replicate(w, p * q)`) is an input that arrives
  already spread over devices, as in Unity's parallel tensors, and does not
  count toward the operator budget. Without this, a data-, column- or
  reduction-parallel matmul (four operators on one side) is out of reach at
  three operators per side, however the budget is spent elsewhere.
- Two degree symbols `p` and `q`: operators take `p` or `q`, spread leaves
  `p` or `p * q`, so nested degrees (`partition(partition(x, 0, p), 0, q)`)
  are found too.
- `split`'s start and size are drawn from `0`, two int symbols `s`, `z`, the
  symbols of the split dim's extent (`m` of a `concat` of extent `2 * m`)
  and the rest of the extent (`extent - start`), so cutting a concat back
  apart and splitting a whole dim are in the vocabulary.

Enumeration is bottom-up by operator count over *representatives* only
(observational equivalence, as in bottom-up program synthesis): a term whose
value equals an earlier term's joins that term's group but is not used as an
argument again, since any term built from it equals, by congruence, one
built from the representative. Arguments are indexed by their type (shape
and spread), and a type combination an operator rejects once is never tried
again.

Terms are rule-language ASTs (`ast.Call`/`ast.Name`), typed with the
checker's own typer (`dsl.typecheck.type_rule`), so shapes, spreads and
definedness requirements are exactly what the checker and verifier will
see later. Values come from the verifier's piece-wise replay
(`verifier.concrete`), which runs `dsl.evaluate` on every device's piece,
with the pieces of representatives remembered so that a new term costs one
operator application: a fingerprint is the logical shape, the spread (shard,
copy and sum degrees) and, for every (block, copy) slot, the sum over the
partial-sum index (what a context can observe). Inputs are small integers
and every operator used keeps them integers, so values are exact integers
(checked: a non-integer or huge value makes the term "inexact" and it is
left out rather than grouped by a rounded value).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from parsat.dsl import ast
from parsat.dsl.conditions import holds
from parsat.dsl.evaluate import EvaluationError
from parsat.dsl.parallel_ops import PARALLEL_OPS, PARTITION, REPLICATE
from parsat.dsl.symbolic import Poly
from parsat.dsl.typecheck import RuleInstance, TermTyper, TypeCheckError, TypedTerm, type_rule
from parsat.verifier.concrete import Unsupported, observe, simulate

DEGREE = "p"
DEGREE2 = "q"
START = "s"      # split's start, an int symbol
SIZE = "z"       # split's size, an int symbol
FACTOR = "f"     # an int attribute that divides a dim (unflatten's k), an int symbol
REAL = "c"       # a real attribute (scale's c, layernorm's eps), a real metavariable
FACTOR_VALUE = 2
REAL_VALUE = 3.0
EXACT_LIMIT = 2 ** 50
ROUNDED_BITS = 30  # mantissa bits a non-integer value keeps in a fingerprint
CONTRACTIONS = ("matmul", "bmm", "linear", "embedding")
DIM_NAMES = ("m", "k", "n", "r", "h", "d", "e", "g", "i", "j")
TENSOR_NAMES = ("x", "w", "b", "y", "v", "t")


@dataclass(frozen=True)
class TensorVar:
    """A symbolic input: a metavariable name and its dims (size symbols)."""

    name: str
    dims: tuple[str, ...]


@dataclass(frozen=True)
class Term:
    """An enumerated term, typed, with the number of operators it applies (spread leaves count 0)."""

    expr: ast.Expr
    ops: int
    typed: TypedTerm = field(compare=False, hash=False)
    text: str = ""


def _degree(text: str) -> ast.Expr:
    if text == f"{DEGREE}*{DEGREE2}":
        return ast.BinOp("*", ast.Name(DEGREE), ast.Name(DEGREE2))
    return ast.Name(text)


@dataclass(frozen=True)
class Vocabulary:
    """What terms are built from: operators, their attribute choices, inputs, degrees."""

    ops: Mapping[str, ast.OpDecl] = field(hash=False)
    names: tuple[str, ...]                       # compute and parallel operators to use
    inputs: tuple[TensorVar, ...]
    dims: tuple[int, ...] = (0, 1)               # dims the parallel ops and dim attributes may name
    op_degrees: tuple[str, ...] = (DEGREE, DEGREE2)
    leaf_degrees: tuple[str, ...] = (DEGREE, f"{DEGREE}*{DEGREE2}")
    spread_leaves: bool = True
    small: bool = False                          # small environments (per-operator vocabularies, rank 3)
    label: str = "joint"                         # what the vocabulary is for, in progress lines
    own: str = ""                                # a per-operator vocabulary's operator (its rules must use it)

    def binders(self) -> tuple[ast.Param, ...]:
        """All metavariables a term may use (a generated rule keeps the ones it uses)."""
        out = [ast.Param(v.name, ast.ShapeType(tuple(ast.Name(d) for d in v.dims))) for v in self.inputs]
        out += [ast.Param(DEGREE, ast.ScalarType("degree")), ast.Param(DEGREE2, ast.ScalarType("degree")),
                ast.Param(START, ast.ScalarType("int")), ast.Param(SIZE, ast.ScalarType("int")),
                ast.Param(FACTOR, ast.ScalarType("int")), ast.Param(REAL, ast.ScalarType("real"))]
        return tuple(out)

    def size_symbols(self) -> list[str]:
        return sorted({d for v in self.inputs for d in v.dims})

    def degrees_used(self) -> bool:
        return any(n in PARALLEL_OPS for n in self.names)


class VocabularyError(Exception):
    """The requested operators cannot be enumerated (the message says why)."""


def default_inputs(names: Sequence[str], ops: Mapping[str, ast.OpDecl]) -> tuple[TensorVar, ...]:
    """Rank-2 inputs: x, y, u of one shape (for elementwise ops and concat), a chain w, v, t to multiply by.

    Three tensors of one shape are what the associativity of a binary
    operator needs; two of the multiplier's shape what distributing a
    contraction over a binary operator needs; `t` continues the chain
    (`matmul(matmul(x, w), t)`). Rank 2 is what matmul needs and what the
    shipped parallel rules talk about; a richer vocabulary costs
    combinatorially more terms.
    """
    arities = [len(ops[n].tensor_params) for n in names if n not in PARALLEL_OPS]
    widest = max(arities, default=1)
    same = ["x", "y", "u"][: 1 if widest < 2 else widest + 1]
    out = [TensorVar(name, ("m", "k")) for name in same]
    if any(n in CONTRACTIONS for n in names):
        out += [TensorVar("w", ("k", "n")), TensorVar("v", ("k", "n")), TensorVar("t", ("n", "r"))]
    return tuple(out)


def vocabulary(names: Sequence[str], ops: Mapping[str, ast.OpDecl], spread_leaves: bool = True) -> Vocabulary:
    """The joint vocabulary: every named operator over one rank-2 pool (see `default_inputs`)."""
    unknown = [n for n in names if n not in ops and n not in PARALLEL_OPS]
    if unknown:
        raise VocabularyError(f"unknown operator(s): {', '.join(unknown)} (known: "
                              f"{', '.join(sorted(list(ops) + list(PARALLEL_OPS)))})")
    return Vocabulary(ops, tuple(dict.fromkeys(names)), default_inputs(names, ops), spread_leaves=spread_leaves)


def algebraic_vocabulary(names: Sequence[str], ops: Mapping[str, ast.OpDecl]) -> Vocabulary | None:
    """The joint pool over the compute operators alone (None: there are no parallel ones to leave out).

    The parallel operators, spread leaves and degrees multiply the joint
    vocabulary's terms: over matmul, add, relu, concat and split with the
    four parallel operators, its third operator level is cut by the term
    limit long before it ends, and with it every three-operator algebraic
    rule (fusing two matmuls that share an input, pushing relu through a
    concat). Without them the same level has some 20,000 terms.
    """
    compute = [n for n in dict.fromkeys(names) if n not in PARALLEL_OPS]
    if not compute or len(compute) == len(set(names)):
        return None
    return replace(vocabulary(compute, ops, spread_leaves=False), label="algebraic")


def _signature_groups(op: ast.OpDecl) -> list[str]:
    out: list[str] = []
    for param in op.tensor_params:
        for dim in param.type.dims:
            if isinstance(dim, ast.Variadic) and dim.id not in out:
                out.append(dim.id)
    return out


def operator_vocabularies(names: Sequence[str], ops: Mapping[str, ast.OpDecl], max_rank: int = 3,
                          spread_leaves: bool = True) -> list[Vocabulary]:
    """One vocabulary per compute operator and rank: the operator's own parameters as inputs.

    The joint pool (`default_inputs`) is rank 2 and has no vectors, so it
    cannot type `linear` (a bias), `layernorm` (a gain) or `bmm` with a
    batch dim, and its cost grows with every operator added. Here each
    compute operator gets vocabularies of its own: its signature with every
    dim group of length 0 or 1 (inputs up to `max_rank`), dims and tensors
    renamed apart from the vocabulary's symbols, with the parallel operators
    of `names`. These find an operator's parallelization rules, which
    `generalise.lift_ranks` then makes rank-polymorphic.
    """
    parallel = tuple(n for n in names if n in PARALLEL_OPS)
    out = []
    seen: set[tuple] = set()
    for name in dict.fromkeys(names):
        if name in PARALLEL_OPS:
            continue
        op = ops[name]
        groups = _signature_groups(op)
        for lengths in itertools.product((0, 1), repeat=len(groups)):
            assignment = dict(zip(groups, lengths))
            inputs = _instantiate_params(op, assignment)
            if inputs is None or not inputs or max(len(v.dims) for v in inputs) > max_rank:
                continue
            if min(len(v.dims) for v in inputs if v.dims is not None) == 0:
                continue
            rank = max(len(v.dims) for v in inputs)
            if (name, inputs) in seen:
                continue      # another group assignment with the same inputs (dim attributes vary anyway)
            seen.add((name, inputs))
            out.append(Vocabulary(ops, (name,) + parallel, inputs, dims=tuple(range(rank)),
                                  spread_leaves=spread_leaves, small=True, own=name,
                                  label=f"{name} at ranks {'/'.join(str(len(v.dims)) for v in inputs)}"))
    return out


def _instantiate_params(op: ast.OpDecl, groups: Mapping[str, int]) -> tuple[TensorVar, ...] | None:
    """The operator's tensor parameters at group lengths `groups`, dims and names fresh (None: a dim is an
    expression, not a name)."""
    renamed: dict[str, str] = {}
    fresh = iter(DIM_NAMES)
    out = []
    for index, param in enumerate(op.tensor_params):
        dims: list[str] = []
        for dim in param.type.dims:
            if isinstance(dim, ast.Variadic):
                for k in range(groups[dim.id]):
                    key = f"*{dim.id}{k}"
                    renamed.setdefault(key, next(fresh))
                    dims.append(renamed[key])
            elif isinstance(dim, ast.Name):
                renamed.setdefault(dim.id, next(fresh))
                dims.append(renamed[dim.id])
            else:
                return None
        out.append(TensorVar(TENSOR_NAMES[index], tuple(dims)))
    return tuple(out)


# ------------------------------------------------------------------ attributes


def poly_expr(poly: Poly) -> ast.Expr | None:
    """A linear polynomial with integer coefficients as a rule expression (None: not linear)."""
    out: ast.Expr | None = None
    for mono, coeff in sorted(poly.terms, key=lambda t: (-t[1], repr(t[0]))):
        if len(mono) > 1 or (mono and (mono[0][1] != 1 or not isinstance(mono[0][0], str))):
            return None
        atom: ast.Expr = ast.Name(mono[0][0]) if mono else ast.Num(abs(coeff))
        if mono and abs(coeff) != 1:
            atom = ast.BinOp("*", ast.Num(abs(coeff)), atom)
        if out is None:
            out = atom if coeff > 0 else ast.Neg(atom)
        else:
            out = ast.BinOp("+" if coeff > 0 else "-", out, atom)
    return out if out is not None else ast.Num(0)


def _split_choices(extent: Poly) -> list[tuple[ast.Expr, ast.Expr]]:
    """(start, size) pairs for a split of a dim of `extent` (see the module docstring)."""
    parts = [s for s in sorted(extent.symbols()) if Poly.sym(s) != extent]
    starts = [Poly.const(0), Poly.sym(START)] + [Poly.sym(s) for s in parts]
    out = []
    for start in starts:
        sizes = [Poly.sym(SIZE), Poly.sym(START), extent - start] + [Poly.sym(s) for s in parts]
        for size in dict.fromkeys(sizes):
            if size == Poly.const(0) or (start == Poly.sym(START) and size == Poly.sym(START)):
                continue
            a, b = poly_expr(start), poly_expr(size)
            if a is not None and b is not None:
                out.append((a, b))
    return out


def dim_attributes(op: ast.OpDecl) -> set[str]:
    """The int attributes that name a dim of the first tensor (`where dim == len(a)` and the like)."""
    out = set()
    for cond in op.where:
        if (isinstance(cond, ast.Compare) and cond.op == "==" and isinstance(cond.left, ast.Name)
                and any(isinstance(n, ast.Len) for n in ast.walk(cond.right))):
            out.add(cond.left.id)
    return out


def _attr_choices(op: ast.OpDecl, dims: Sequence[int], args: Sequence["Term"],
                  degrees: Sequence[str]) -> list[tuple[ast.Expr, ...]]:
    """Attribute values to try, one tuple per call (in the order of `op`'s attribute parameters).

    Reals are the real metavariable `c`; degrees `p` or `q`; dim attributes
    the vocabulary's dims; split's start and size come from the split dim's
    extent; any other int (unflatten's factor) is the int symbol `f`.
    """
    names = [p.name for p in op.attr_params]
    named_dims = dim_attributes(op)
    per: list[list[ast.Expr]] = []
    for param in op.attr_params:
        kind = param.type.kind
        if kind == "real":
            per.append([ast.Name(REAL)])
        elif kind == "degree":
            per.append([_degree(d) for d in degrees])
        elif param.name in ("start", "size"):
            per.append([ast.Num(0)])      # filled in below from the split dim's extent
        elif param.name in named_dims:
            per.append([ast.Num(d) for d in dims])
        else:
            per.append([ast.Name(FACTOR)])
    plain = [tuple(c) for c in itertools.product(*per)]
    if "start" not in names or "size" not in names or not args:
        return plain
    i_start, i_size = names.index("start"), names.index("size")
    i_dim = next((i for i, n in enumerate(names) if n == "dim"), None)
    out = []
    for combo in plain:
        dim = combo[i_dim].value if i_dim is not None else 0
        shape = args[0].typed.shape
        if not isinstance(dim, int) or dim >= len(shape):
            continue
        for start, size in _split_choices(shape[dim]):
            values = list(combo)
            values[i_start], values[i_size] = start, size
            out.append(tuple(values))
    return out


def _calls(vocab: Vocabulary, name: str, args: Sequence[Term]) -> Iterator[ast.Call]:
    tensors = tuple(a.expr for a in args)
    if name in PARALLEL_OPS:
        for degree in vocab.op_degrees:
            if PARALLEL_OPS[name].has_dim:
                for d in vocab.dims:
                    yield ast.Call(name, tensors + (ast.Num(d), _degree(degree)))
            else:
                yield ast.Call(name, tensors + (_degree(degree),))
        return
    op = vocab.ops[name]
    for attrs in _attr_choices(op, vocab.dims, args, vocab.op_degrees):
        it_t, it_a = iter(tensors), iter(attrs)
        yield ast.Call(name, tuple(next(it_t) if p.is_tensor else next(it_a) for p in op.params))


def leaves(vocab: Vocabulary) -> list[ast.Expr]:
    """Inputs, then spread inputs (a parallel operator on an input; they count as no operator)."""
    out: list[ast.Expr] = [ast.Name(v.name) for v in vocab.inputs]
    if not vocab.spread_leaves:
        return out
    for var in vocab.inputs:
        for degree in vocab.leaf_degrees:
            if PARTITION in vocab.names:
                out += [ast.Call(PARTITION, (ast.Name(var.name), ast.Num(d), _degree(degree)))
                        for d in vocab.dims if d < len(var.dims)]
            if REPLICATE in vocab.names:
                out.append(ast.Call(REPLICATE, (ast.Name(var.name), _degree(degree))))
    return out


# ------------------------------------------------------------------ environments


@dataclass(frozen=True)
class Environment:
    """Concrete sizes, degrees, reals and input values at which every term is evaluated."""

    sizes: Mapping[str, int] = field(hash=False)
    inputs: Mapping[str, np.ndarray] = field(hash=False)
    reals: Mapping[str, float] = field(default_factory=dict, hash=False)


def _uses_factor(vocab: Vocabulary) -> bool:
    for name in vocab.names:
        if name in PARALLEL_OPS:
            continue
        op = vocab.ops[name]
        named = dim_attributes(op)
        if any(p.type.kind == "int" and p.name not in named and p.name not in ("start", "size")
               for p in op.attr_params):
            return True
    return False


def environments(vocab: Vocabulary, degrees: Sequence[int], count: int, seed: int = 0) -> list[Environment]:
    """`count` random environments, cycling through `degrees` for p (q the next one in the list).

    Dims are distinct multiples of p * q * f (so a partition by p, q or
    p * q divides, so does unflatten's factor f, and no two dims coincide by
    accident, which would group terms of different shapes) and at least
    2 * p * q, so split's start + size fits. A small vocabulary (rank 3)
    uses the first two degrees and smaller multiples.
    """
    rng = random.Random(seed)
    out = []
    symbols = vocab.size_symbols()
    if vocab.small:
        degrees = tuple(degrees[:2])
    for index in range(count):
        p = degrees[index % len(degrees)]
        q = degrees[(index + 1) % len(degrees)]
        low = 1 if vocab.small else 2
        factors = rng.sample(range(low, low + len(symbols) + 2), len(symbols))
        unit = p * q * (FACTOR_VALUE if _uses_factor(vocab) else 1)
        sizes = {s: unit * f for s, f in zip(symbols, factors)}
        sizes.update({DEGREE: p, DEGREE2: q, START: rng.randint(1, 3), SIZE: rng.randint(1, 4),
                      FACTOR: FACTOR_VALUE})
        np_rng = np.random.default_rng(rng.randrange(2 ** 32))
        inputs = {v.name: np_rng.integers(-9, 10, size=tuple(sizes[d] for d in v.dims)).astype(np.float64)
                  for v in vocab.inputs}
        out.append(Environment(sizes, inputs, {REAL: REAL_VALUE}))
    return out


# ------------------------------------------------------------------ typing and values


def type_term(vocab: Vocabulary, expr: ast.Expr) -> RuleInstance | None:
    """The term typed by the checker's typer (None: it does not type)."""
    rule = ast.RuleDecl("term", vocab.binders(), (), expr, ast.Name(vocab.inputs[0].name))  # rhs: type lhs once
    try:
        instance = type_rule(rule, vocab.ops, {})
    except TypeCheckError:
        return None
    if instance.problems:
        return None
    return instance


@dataclass
class Evaluator:
    """Fingerprints terms at fixed environments, remembering the pieces of terms kept as arguments."""

    envs: Sequence[Environment]
    max_pieces: int
    memos: list[dict[int, np.ndarray]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.memos = [{} for _ in self.envs]

    def fingerprint(self, term: TypedTerm, requires: Sequence) -> tuple[str, list[np.ndarray]] | None:
        """Shape, spread and observed values at every environment, hashed, and the pieces (None: skip it).

        A term is skipped when it is undefined at some environment (one of
        its `requires` fails, e.g. `combine` of a whole tensor), has more
        pieces than `max_pieces`, or its values are not exact integers.
        """
        digest = hashlib.blake2b(digest_size=16)
        all_pieces = []
        for env, memo in zip(self.envs, self.memos):
            sizes = env.sizes
            if not all(holds(c, sizes) for c in requires):
                return None
            if term.spread.pieces.evaluate(sizes) > self.max_pieces:
                return None
            shape = tuple(d.evaluate(sizes) for d in term.shape)
            spread = (tuple(d.evaluate(sizes) for d in term.spread.shard), term.spread.copy.evaluate(sizes),
                      term.spread.sum.evaluate(sizes))
            try:
                pieces = simulate(term, env.sizes, env.inputs, env.reals, known=memo)
            except (Unsupported, EvaluationError, ZeroDivisionError, IndexError, ValueError):
                return None
            seen = observe(pieces, len(shape))
            if not np.all(np.isfinite(seen)) or np.any(np.abs(seen) > EXACT_LIMIT):
                return None
            digest.update(repr((shape, spread, seen.shape)).encode())
            digest.update(_value_bytes(seen))
            all_pieces.append(pieces)
        return digest.hexdigest(), all_pieces

    def remember(self, expr: ast.Expr, pieces: Sequence[np.ndarray]) -> None:
        for memo, value in zip(self.memos, pieces):
            memo[id(expr)] = value


def _value_bytes(values: np.ndarray) -> bytes:
    """Exact integers as they are; other values (softmax, layernorm, gelu) by a rounded mantissa.

    Integer inputs keep sums, products and the parallel operators exact, so
    those fingerprints cannot collide by rounding. Operators with division,
    roots or exponentials leave the integers; two equal terms computed in
    another order then differ in the last bits, so their values are kept to
    ROUNDED_BITS mantissa bits (a term on the edge of a rounding step can
    miss its group: a candidate lost, never a wrong rule, which only the
    verifier could let through and it proves every rule).
    """
    if np.all(values == np.round(values)):
        return b"i" + np.ascontiguousarray(values.astype(np.int64)).tobytes()
    mantissa, exponent = np.frexp(values)
    rounded = np.round(mantissa * 2.0 ** ROUNDED_BITS).astype(np.int64)
    return b"r" + np.ascontiguousarray(rounded).tobytes() + np.ascontiguousarray(exponent).tobytes()


def fingerprint(instance: RuleInstance, envs: Sequence[Environment], max_pieces: int) -> str | None:
    """The fingerprint of one term, a typed rule's left side (no memory of other terms)."""
    found = Evaluator(envs, max_pieces).fingerprint(instance.lhs, instance.lhs_requires)
    return None if found is None else found[0]


@dataclass(frozen=True)
class Enumeration:
    """Terms by fingerprint, and how many were built."""

    groups: Mapping[str, tuple[Term, ...]] = field(hash=False)
    built: int = 0
    typed: int = 0
    stopped: str = ""    # "" or why enumeration stopped early ("seconds", "terms")


def _signature(term: Term) -> tuple:
    return (term.typed.shape, term.typed.spread)


class _Stop(Exception):
    pass


@dataclass
class _TermBuilder:
    """One enumeration's working state, shared by the step that adds a term and the steps that build a level:
    the typer and evaluator (which remember representatives), the representatives by operator count and
    signature, the groups by fingerprint, and the counts the term limit and the progress lines read."""

    vocab: Vocabulary
    max_ops: int
    evaluator: Evaluator
    typer: TermTyper
    deadline: Callable[[], bool]
    max_terms: int
    show: Callable[[ast.Expr], str]                                       # a term's text
    reps: dict[int, dict[tuple, list[Term]]] = field(default_factory=dict)  # count -> signature -> representatives
    groups: dict[str, list[Term]] = field(default_factory=dict)
    built: int = 0
    typed: int = 0

    def add(self, expr: ast.Expr, count: int) -> bool:
        """Type and evaluate `expr`; False when it does not type."""
        self.built += 1
        if self.built >= self.max_terms:
            raise _Stop("terms")
        if self.built % 256 == 0 and self.deadline():
            raise _Stop("seconds")
        try:
            typed, requires = self.typer.type(expr)
        except TypeCheckError:
            return False
        if typed.problems:
            return False
        found = self.evaluator.fingerprint(typed, requires)
        if found is None:
            return True
        digest, pieces = found
        self.typed += 1
        term = Term(expr, count, typed, self.show(expr))
        members = self.groups.setdefault(digest, [])
        members.append(term)
        if len(members) == 1 and count < self.max_ops:
            self.evaluator.remember(expr, pieces)
            self.typer.remember(typed, requires)
            self.reps.setdefault(count, {}).setdefault(_signature(term), []).append(term)
        return True

    def level(self, name: str, count: int) -> Iterator[None]:
        """Every term with `name` on top and `count` operators; yields after each one, so that the top
        operators of a level can take turns."""
        positions = _tensor_positions(self.vocab, name)
        for split in _compositions(count - 1, len(positions)):
            buckets = [list(self.reps.get(c, {}).items()) for c in split]
            for sig_combo in itertools.product(*buckets):
                pools = [members for _, members in sig_combo]
                for probe in _calls(self.vocab, name, [pool[0] for pool in pools]):
                    # one type check per (attributes, argument types): the rest share its outcome
                    first = True
                    for args in itertools.product(*pools):
                        expr = _with_tensors(probe, positions, [a.expr for a in args])
                        typed = self.add(expr, count)
                        yield
                        if not typed and first:
                            break
                        first = False

    def build_level(self, count: int) -> None:
        """Every term with `count` operators, the top operators taking turns (one term each), so that a level
        cut short by a limit has some terms of each; the last level of 3 or more skips unary tops."""
        running = [self.level(name, count) for name in self.vocab.names
                   if not (count == self.max_ops >= 3 and len(_tensor_positions(self.vocab, name)) < 2)]
        while running:
            for gen in list(running):
                try:
                    next(gen)
                except StopIteration:
                    running.remove(gen)


def enumerate_terms(vocab: Vocabulary, max_ops: int, envs: Sequence[Environment], max_pieces: int,
                    deadline: Callable[[], bool] = lambda: False, max_terms: int = 200_000,
                    progress: Callable[[str], None] | None = None) -> Enumeration:
    """Every well-typed term with at most `max_ops` operators over representatives, grouped by fingerprint.

    Built bottom-up by operator count: a term with c operators is an
    operator applied to representatives whose counts add up to c - 1. A
    term that does not type, is undefined, or has too many pieces is
    neither grouped nor used as an argument; nor is a term whose value an
    earlier term already has (it joins that term's group).

    Within a level the top operators take turns (one term each), so a level
    cut short by a limit has terms of every operator. At 3 or more
    operators the last level applies only operators with two or more tensor
    inputs (add, concat, matmul, ...): a unary operator on top
    of a term of the size below mostly moves through it (`relu`, `split`,
    `partition` of an `add`), which the rules one level down already do,
    and the unary tops were two thirds of the terms of that level.
    """
    from parsat.dsl.printer import format_expr

    builder = _TermBuilder(vocab, max_ops, Evaluator(envs, max_pieces), TermTyper(vocab.binders(), vocab.ops),
                           deadline, max_terms, format_expr)
    stopped = ""
    try:
        for leaf in leaves(vocab):
            builder.add(leaf, 0)
        for count in range(1, max_ops + 1):
            builder.build_level(count)
            if progress is not None:
                progress(f"enumerate: {count} operator(s): {builder.built} terms built, {builder.typed} defined, "
                         f"{len(builder.groups)} groups")
    except _Stop as stop:
        stopped = str(stop)
    return Enumeration({k: tuple(v) for k, v in builder.groups.items()}, builder.built, builder.typed, stopped)


def _tensor_positions(vocab: Vocabulary, name: str) -> tuple[int, ...]:
    if name in PARALLEL_OPS:
        return (0,)
    return tuple(i for i, p in enumerate(vocab.ops[name].params) if p.is_tensor)


def _with_tensors(call: ast.Call, positions: Sequence[int], tensors: Sequence[ast.Expr]) -> ast.Call:
    """`call` with its tensor arguments replaced (attributes kept)."""
    args = list(call.args)
    for pos, tensor in zip(positions, tensors):
        args[pos] = tensor
    return ast.Call(call.func, tuple(args))


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Ordered ways to write `total` as `parts` non-negative counts."""
    if parts == 0:
        return [()] if total == 0 else []
    return [c for c in itertools.product(range(total + 1), repeat=parts) if sum(c) == total]
