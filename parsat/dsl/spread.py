"""How a tensor is spread over devices, and how operators change it.

A parallel tensor is a logical tensor plus a `SymbolicDegrees`: a shard degree per
dim, a copy degree and a partial-sum degree (FlexFlow's parallel tensor
shape, OneFlow's SBP, DTensor's Shard/Replicate/Partial). It has
`prod(shard) * copy * sum` pieces, one per device.

The four parallel operators change the spread and never the logical value.
A compute operator runs on local pieces; which spreads it accepts, and the
spread of its output, follow from its index semantics (`infer_compute`):

* an index variable that indexes a sharded dim of an input takes that
  dim's degree; every dim it indexes must have the same degree, and it may
  only appear as a plain tensor index (no arithmetic, no conditions);
* an output dim is sharded by the degree of its index variable;
* a sharded summation variable makes a partial sum, and so does a partial
  input; the output must be linear in every partial quantity (the
  "partial degree" analysis below), else the op does not accept the spread;
* a `max` over a sharded range is refused (a block's max is not a partial
  sum, and there is no partial-max spread), and so is a max of a partial sum;
* all inputs have the same number of pieces; the output's copy degree is
  what is left: pieces / (prod(out shard) * out sum).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from parsat.dsl import ast
from parsat.dsl.conditions import Cond, Junction, NotAnInteger, Rel, divides, symbolic_truth, to_poly
from parsat.dsl.instantiate import OpInstance, index_bounds, param_dim_names
from parsat.dsl.parallel_ops import COMBINE, PARALLEL_OPS, PARTITION, REDUCE, REPLICATE, step_calls
from parsat.dsl.printer import format_expr
from parsat.dsl.symbolic import ONE, ZERO, Poly

@dataclass(frozen=True)
class SymbolicDegrees:
    """Per-dim shard degrees, copy degree, partial-sum degree."""

    shard: tuple[Poly, ...]
    copy: Poly = ONE
    sum: Poly = ONE

    @staticmethod
    def whole(rank: int) -> "SymbolicDegrees":
        return SymbolicDegrees(tuple(ONE for _ in range(rank)))

    @property
    def pieces(self) -> Poly:
        total = self.copy * self.sum
        for degree in self.shard:
            total = total * degree
        return total

    @property
    def is_whole(self) -> bool:
        return self.pieces == ONE

    def __str__(self) -> str:
        parts = [f"shard [{', '.join(str(d) for d in self.shard)}]"]
        if self.copy != ONE:
            parts.append(f"copy {self.copy}")
        if self.sum != ONE:
            parts.append(f"sum {self.sum}")
        return ", ".join(parts)


class DegreesError(Exception):
    """An operator applied to a spread it does not accept."""

    def __init__(self, message: str, node: ast.Expr | None = None):
        super().__init__(message)
        self.node = node


# ------------------------------------------------------------ parallel operators


def apply_parallel(name: str, shape: Sequence[Poly], spread: SymbolicDegrees, dim: int | None, degree: Poly,
                   span: ast.Span | None, to_dim: int | None = None) -> tuple[SymbolicDegrees, list[Cond]]:
    """The spread after a parallel operator, and what it requires to be defined (a fused operator: its steps,
    `dsl.parallel_ops`, in turn; `to_dim` is all_to_all's second dim)."""
    if name in PARALLEL_OPS and PARALLEL_OPS[name].steps:
        needs: list[Cond] = []
        for step, step_dim in step_calls(name, {"dim": dim, "to_dim": to_dim}):
            spread, need = apply_parallel(step, shape, spread, step_dim, degree, span)
            needs += need
        return spread, needs
    if name in (PARTITION, COMBINE):
        if dim is None or not 0 <= dim < len(shape):
            raise DegreesError(f"{name}: dim {dim} is out of range for a tensor of rank {len(shape)}")
        shard = list(spread.shard)
        if name == PARTITION:
            shard[dim] = shard[dim] * degree
            need = [divides(shard[dim], shape[dim], span,
                            f"partition: dim {dim} (size {shape[dim]}) must split into {shard[dim]} equal blocks")]
        else:
            need = [divides(degree, shard[dim], span,
                            f"combine: degree {degree} must divide the shard degree {shard[dim]} of dim {dim}")]
            shard[dim] = shard[dim].floordiv(degree)
        return SymbolicDegrees(tuple(shard), spread.copy, spread.sum), need
    if name == REPLICATE:
        return SymbolicDegrees(spread.shard, spread.copy * degree, spread.sum), []
    if name == REDUCE:
        need = [divides(degree, spread.sum, span,
                        f"reduce: degree {degree} must divide the partial-sum degree {spread.sum}")]
        return SymbolicDegrees(spread.shard, spread.copy, spread.sum.floordiv(degree)), need
    raise KeyError(name)


# ------------------------------------------------------------- compute operators


@dataclass(frozen=True)
class ComputeDegrees:
    """The result of spread inference for one compute operator."""

    spread: SymbolicDegrees
    var_degrees: dict = field(hash=False)  # index variable -> degree (Poly)
    problems: tuple[str, ...] = ()          # non-empty: the op does not accept the spread
    requires: tuple[Cond, ...] = ()         # each sharded index range splits into equal blocks
    legal_when: tuple[Cond, ...] = ()       # the spread is legal only at sizes where these hold

    @property
    def legal(self) -> bool:
        return not self.problems


class _NotLinear(Exception):
    """The value is not linear in a partial quantity; `naive` is the partial degree a run that ignored it
    would claim (what the verifier's devices are then checked against), when there is one."""

    def __init__(self, message: str, naive: Poly | None = None):
        super().__init__(message)
        self.naive = naive


_ZERO_MARK = "zero"  # a literal 0: compatible with any partial degree


@dataclass(frozen=True)
class _IndexReads:
    """What the op's tensor reads say about its index variables, gathered in one pass over its accesses so
    the later checks need not walk them again."""

    constraints: dict = field(hash=False)  # index variable -> [(degree of a dim it indexes, which dim)]
    block_reads: frozenset[int]            # id() of the index expressions read block by block, and of the
                                           # comparisons that only keep such a window inside its dim
    legal_when: tuple[Cond, ...]           # the block reads tile their sharded dims only where these hold


def infer_compute(instance: OpInstance, inputs: Sequence[SymbolicDegrees]) -> ComputeDegrees:
    """Output spread of a compute op on inputs with the given spreads.

    Problems are collected rather than raised, so that the verifier can
    still run the op piece by piece and show *why* a spread is illegal.
    """
    problems: list[str] = []
    by_name = dict(zip(instance.inputs, inputs))
    bounds_vars = set(instance.out_vars) | _sum_vars(instance.body)
    bounds = index_bounds(instance)
    reads = _read_indices(instance, by_name, bounds_vars, bounds, problems)
    degrees = _index_degrees(instance, reads.constraints, bounds_vars, problems)
    _check_local_view(instance, inputs, degrees, bounds_vars, reads.block_reads, problems)
    partial = _output_partial_degree(instance, by_name, inputs, degrees, problems)
    spread = _output_spread(instance, inputs, degrees, partial, problems)
    requires = tuple(divides(degree, bounds[var], None, f"{instance.name}: index '{_pretty(var)}' (range "
                                                     f"{bounds[var]}) must split into {degree} equal blocks")
                     for var, degree in degrees.items() if degree != ONE and var in bounds)
    return ComputeDegrees(spread, degrees, tuple(problems), requires, reads.legal_when)


def reads_plainly(instance: OpInstance) -> bool:
    """Whether every tensor access of the op indexes by plain index variables (`x[i, j]`: a name that an output
    index, a `sum` or a `max` binds; no expression, constant or size). Then `infer_compute`'s `spread`,
    `var_degrees` and `problems` read no size value, so instances of the op at any sizes (with the same group
    lengths) get the same ones from the same input spreads (`cost.model.compute_time` keeps them so):

    * `_read_indices` takes its first branch for every index (degree and dim number from the spreads), never
      `block_read` / `block_tiling` / `_strided` (the only readers of sizes in it), and finds no windows, so
      no block reads and no `legal_when`;
    * `_index_degrees` reads those constraints; `_check_local_view` compares index and size NAMES
      (`param_dim_names`: the op's dims and its group lengths); `_output_partial_degree` reads the body and
      the spreads' partial degrees; `_output_spread` multiplies and divides the spreads' pieces and degrees;
    * only `requires` reads sizes (`index_bounds`), and the messages of what reads it.

    Stricter than `_read_indices` (which skips accesses of non-inputs): a stricter test only computes afresh."""
    bound = set(instance.out_vars) | _sum_vars(instance.body)
    return all(isinstance(index, ast.Name) and index.id in bound
               for access in _accesses(instance.body) for index in access.indices)


def _read_indices(instance: OpInstance, by_name: dict, bounds_vars: set[str], bounds: dict,
                  problems: list[str]) -> _IndexReads:
    """The degree each index variable meets at each dim of an input it reads, plain or block by block;
    appends to `problems` a sharded dim read through an expression, or whose blocks do not tile it."""
    constraints: dict[str, list[tuple[Poly, str]]] = {}
    block_reads: set[int] = set()
    legal_when: list[Cond] = []
    windows: list[tuple[ast.Expr, Poly]] = []  # the windows of sharded dims, with the dim's size
    for access in _accesses(instance.body):
        spread = by_name.get(access.tensor)
        if spread is None:
            continue
        for position, index in enumerate(access.indices):
            degree = spread.shard[position] if position < len(spread.shard) else ONE
            where = f"dim {position} of '{access.tensor}'"
            if isinstance(index, ast.Name) and index.id in bounds_vars:
                constraints.setdefault(index.id, []).append((degree, where))
                continue
            pattern = block_read(access, position, spread, instance, bounds)
            if pattern is not None:
                leading, others = pattern
                block_reads.add(id(index))
                strided = _strided(index, instance.size_env()) if degree != ONE else None
                if strided is not None:
                    windows.append((strided[3], instance.input_shapes[instance.inputs.index(access.tensor)][position]))
                for tiling in block_tiling(access, position, instance, bounds) if degree != ONE else ():
                    truth = symbolic_truth(tiling)
                    if truth is False:
                        problems.append(f"{instance.name}: {where} is sharded ({degree}) but the blocks of "
                                        f"'{_pretty(leading)}' do not tile it: {tiling.reason}")
                    elif truth is None:  # only a split dim must be tiled: at degree 1 it holds every window
                        legal_when.append(Junction("or", (Rel("==", degree, ONE), tiling), None, tiling.reason))
                constraints.setdefault(leading, []).append((degree, where))
                for var in others:
                    constraints.setdefault(var, []).append((ONE, where))
            elif degree != ONE:
                problems.append(f"{instance.name}: {where} is sharded ({degree}) but is read at "
                                f"{_pretty(format_expr(index))}, an expression whose reads the analysis cannot place "
                                "in one block, so a local piece may not hold what the op reads")
    return _IndexReads(constraints, frozenset(block_reads | _window_guards(instance, windows)), tuple(legal_when))


def _index_degrees(instance: OpInstance, constraints: dict, bounds_vars: set[str],
                   problems: list[str]) -> dict[str, Poly]:
    """Each index variable's degree: the first its reads give it (1 if it reads nothing sharded); appends to
    `problems` a variable whose reads disagree, since one variable has one degree."""
    degrees: dict[str, Poly] = {}
    for var, seen in constraints.items():
        distinct = {d for d, _ in seen}
        if len(distinct) > 1:
            listing = ", ".join(f"{w} has degree {d}" for d, w in seen)
            problems.append(f"{instance.name}: index '{_pretty(var)}' reads dims sharded differently ({listing})")
        degrees[var] = seen[0][0]
    for var in bounds_vars:
        degrees.setdefault(var, ONE)
    return degrees


def _check_local_view(instance: OpInstance, inputs: Sequence[SymbolicDegrees], degrees: dict, bounds_vars: set[str],
                      block_reads: frozenset[int], problems: list[str]) -> None:
    """Appends to `problems` every use of a sharded index or size as a value: a local piece sees local
    positions and sizes there, not the global ones the semantics means."""
    plain_uses: set[str] = set()
    _collect_plain_uses(instance.body, bounds_vars, plain_uses, block_reads)
    for var, degree in degrees.items():
        if degree != ONE and var in plain_uses:
            problems.append(f"{instance.name}: index '{_pretty(var)}' is sharded ({degree}) but is used in "
                            "arithmetic or a condition, which would see local instead of global positions")

    sharded_sizes = {name for names, spread in zip(param_dim_names(instance), inputs)
                     for name, degree in zip(names, spread.shard) if name is not None and degree != ONE}
    for name in sorted(_sizes_used_as_values(instance.body, block_reads) & sharded_sizes):
        problems.append(f"{instance.name}: size '{_pretty(name)}' belongs to a sharded dim but the semantics uses "
                        "its value, which a local piece would see as its local size")


def _output_partial_degree(instance: OpInstance, by_name: dict, inputs: Sequence[SymbolicDegrees], degrees: dict,
                           problems: list[str]) -> Poly:
    """The output's partial-sum degree; when the op is not linear in a partial quantity, appends that to
    `problems` and returns the degree a naive piece-by-piece run would claim, for the verifier to replay."""
    try:
        partial = _partial_degree(instance.body, by_name, degrees)
    except _NotLinear as err:
        problems.append(f"{instance.name}: {err}")
        # What a naive SPMD run produces: each partial piece processed on its own (a max over a sharded
        # range: each block's max, taken for a summand).
        partial = err.naive if err.naive is not None else next((s.sum for s in inputs if s.sum != ONE), ONE)
    if partial == _ZERO_MARK:
        partial = ONE
    return partial


def _output_spread(instance: OpInstance, inputs: Sequence[SymbolicDegrees], degrees: dict, partial: Poly,
                   problems: list[str]) -> SymbolicDegrees:
    """The output's spread: sharded by its index variables' degrees, with the copy degree what the inputs'
    pieces leave; appends to `problems` inputs in different numbers of pieces, or pieces the output cannot
    fill evenly."""
    pieces = [s.pieces for s in inputs]
    if pieces and any(p != pieces[0] for p in pieces[1:]):
        listing = ", ".join(f"'{n}' has {p}" for n, p in zip(instance.inputs, pieces))
        problems.append(f"{instance.name}: inputs are split into different numbers of pieces ({listing})")
    total = pieces[0] if pieces else ONE
    shard = tuple(degrees.get(v, ONE) for v in instance.out_vars)
    used = partial
    for degree in shard:
        used = used * degree
    copy = total.exact_div(used)
    if copy is None:
        problems.append(f"{instance.name}: {total} pieces cannot hold an output sharded "
                        f"[{', '.join(str(d) for d in shard)}] with partial-sum degree {partial}")
        copy = total.floordiv(used)
    return SymbolicDegrees(shard, copy, partial)


def block_read(access: ast.Access, position: int, spread: SymbolicDegrees, instance: OpInstance,
                   bounds: dict) -> tuple[str, tuple[str, ...]] | None:
    """The leading index of a dim read block by block through an expression.

    Two shapes keep every block of an output index inside one block of the
    input dim, so a local piece holds what the op reads and local sizes
    give the same answer:
      `j * k + r` with `0 <= r < R`, `R <= k` (a dim split in two, as in
                                       unflatten, R == k; or a strided window
                                       no wider than its stride: pooling at
                                       stride 3 over 2 positions, a 1x1
                                       window at stride 2)
      `j / n`, `j % n` on this dim and the next, the next of size n and
      unsharded                        (two dims merged: flatten)
    Returns (leading index, indices that must stay unsharded), or None.
    Whether the windows of a sharded dim really tile its blocks (R <= k, and
    no leftover positions) is `block_tiling`'s to say.
    """
    index = access.indices[position]
    env = instance.size_env()
    strided = _strided(index, env)
    if strided is not None:
        lead, rest, _factor, _window = strided
        if lead in bounds and rest in bounds and lead != rest:
            return lead, (rest,)
    if (isinstance(index, ast.BinOp) and index.op == "/" and isinstance(index.left, ast.Name)
            and position + 1 < len(access.indices)):
        following = access.indices[position + 1]
        lead, size = index.left.id, _size_of(index.right, env)
        if (lead in bounds and isinstance(following, ast.BinOp) and following.op == "%"
                and isinstance(following.left, ast.Name) and following.left.id == lead
                and size is not None and _size_of(following.right, env) == size
                and position + 1 < len(spread.shard) and spread.shard[position + 1] == ONE
                and instance.input_shapes[instance.inputs.index(access.tensor)][position + 1] == size):
            return lead, ()
    return None


def block_tiling(access: ast.Access, position: int, instance: OpInstance, bounds: dict) -> tuple[Rel, ...]:
    """When a block read `j * k + r` (0 <= r < R) keeps each block of `j` inside one block of the input dim.

    Block b of `j` (extent J/p) reads input positions [b*(J/p)*k, (b+1)*(J/p)*k - k + R);
    block b of the input dim (extent m/p) holds [b*m/p, (b+1)*m/p). They
    coincide for every b only when the windows fit their stride (R <= k,
    so a block's last window ends inside it) and the strides tile the dim
    exactly (m == J*k, so block b starts where its first window does). A
    strided window wider than its stride, or a dim with leftover rows,
    breaks it: 3x3 windows at stride 3 over h = 8 rows on 2 devices: device 1
    holds rows 4-7, its output row reads rows 3-5. Unflatten's `m % k == 0`
    makes it hold (R == k); so does max pooling at stride 3 over 2 rows with
    h a multiple of 3, or a 1x1 window at any stride that divides h.
    `j / n` (flatten) reads whole rows by construction: no condition.
    """
    strided = _strided(access.indices[position], instance.size_env())
    if strided is None:
        return ()
    lead, rest, factor, _window = strided
    if lead not in bounds or rest not in bounds:
        return ()
    size = instance.input_shapes[instance.inputs.index(access.tensor)][position]
    reach = Rel("<=", bounds[rest], factor, None,
                f"{instance.name}: the windows of '{_pretty(lead)}' ({bounds[rest]} positions of '{_pretty(rest)}') "
                f"must be no wider than their stride {factor}, so that no window reaches into the next block")
    tiles = Rel("==", size, bounds[lead] * factor, None,
                f"{instance.name}: the reads of '{_pretty(lead)}' (range {bounds[lead]}, {factor} positions each) must "
                f"tile dim {position} of '{access.tensor}' (size {size}) exactly, so that each device holds whole "
                "windows")
    return (reach, tiles)


def _strided(index: ast.Expr, env: dict) -> tuple[str, str, Poly, ast.Expr] | None:
    """(j, r, k, the window `j * k + r`) when `index` is `j * k + r`, or `j * k + r - pad` with a padding of 0
    at this instance (a convolution without padding reads its windows so)."""
    if isinstance(index, ast.BinOp) and index.op == "-" and _size_of(index.right, env) == ZERO:
        index = index.left
    if (isinstance(index, ast.BinOp) and index.op == "+" and isinstance(index.right, ast.Name)
            and isinstance(index.left, ast.BinOp) and index.left.op == "*" and isinstance(index.left.left, ast.Name)):
        factor = _size_of(index.left.right, env)
        if factor is not None:
            return index.left.left.id, index.right.id, factor, index
    return None


def _window_guards(instance: OpInstance, windows: list[tuple[ast.Expr, Poly]]) -> set[int]:
    """id() of the comparisons that only say a window `w = j * k + r` of a sharded dim of size m lies inside
    it: `w >= c` with c == 0, `w < e` with e == m. Where the windows tile the dim (`block_tiling`), both
    hold at every position, globally and on every device's block alike, so the comparison is no use of `j`
    (a convolution without padding guards its reads so)."""
    env = instance.size_env()
    guards = set()
    for node in ast.walk(instance.body):
        if not isinstance(node, ast.Compare):
            continue
        bound = _size_of(node.right, env)
        for window, size in windows:
            if node.left == window and ((node.op == ">=" and bound == ZERO) or (node.op == "<" and bound == size)):
                guards.add(id(node))
    return guards


def _size_of(expr: ast.Expr, env: dict) -> Poly | None:
    try:
        return to_poly(expr, env)
    except NotAnInteger:
        return None


def _pretty(var: str) -> str:
    return var.replace("#", "")


def _sum_vars(expr: ast.Expr) -> set[str]:
    """Every index variable a `sum` or a `max` binds."""
    return {node.var for node in ast.walk(expr) if isinstance(node, ast.RANGE_BINDERS)}


def _accesses(expr: ast.Expr) -> list[ast.Access]:
    return [node for node in ast.walk(expr) if isinstance(node, ast.Access)]


def _sizes_used_as_values(expr: ast.Expr, guards: frozenset[int] = frozenset()) -> set[str]:
    """Names read anywhere except as the bound of a `sum`, or in a window's guard (`_window_guards`)."""
    if isinstance(expr, ast.Name):
        return {expr.id}
    if isinstance(expr, ast.Compare) and id(expr) in guards:
        return set()
    if isinstance(expr, ast.RANGE_BINDERS):
        inner = _sizes_used_as_values(expr.body, guards)
        return inner if isinstance(expr.bound, ast.Name) else inner | _sizes_used_as_values(expr.bound, guards)
    found: set[str] = set()
    for child in ast.children(expr):
        found |= _sizes_used_as_values(child, guards)
    return found


def _collect_plain_uses(expr: ast.Expr, index_vars: set[str], out: set[str], block_reads: set[int]) -> None:
    """Index variables used anywhere but as a whole tensor index, a block read or a window's guard."""
    if isinstance(expr, ast.Compare) and id(expr) in block_reads:
        return
    if isinstance(expr, ast.Access):
        for position, index in enumerate(expr.indices):
            if isinstance(index, ast.Name) or id(index) in block_reads:
                continue
            if position > 0 and id(expr.indices[position - 1]) in block_reads and _is_mod_of(index, expr.indices[position - 1]):
                continue
            _collect_plain_uses(index, index_vars, out, block_reads)
        return
    if isinstance(expr, ast.Name):
        if expr.id in index_vars:
            out.add(expr.id)
        return
    for child in ast.children(expr):
        _collect_plain_uses(child, index_vars, out, block_reads)


def _is_mod_of(index: ast.Expr, previous: ast.Expr) -> bool:
    """`j % n` following the block read `j / n` (flatten's second index)."""
    return (isinstance(index, ast.BinOp) and index.op == "%" and isinstance(previous, ast.BinOp)
            and previous.op == "/" and index.left == previous.left)


def _partial_degree(expr: ast.Expr, inputs: dict, degrees: dict) -> Poly | str:
    """The partial-sum degree of a value expression, or _NotLinear.

    Sums of pieces are only meaningful where the expression is linear in
    every partial quantity: each product has at most one partial factor,
    added terms agree on their degree, and no function sees a partial sum.
    """
    if isinstance(expr, ast.Access):
        spread = inputs.get(expr.tensor)
        return spread.sum if spread is not None else ONE
    if isinstance(expr, ast.Num):
        return _ZERO_MARK if expr.value == 0 else ONE
    if isinstance(expr, (ast.Name, ast.Len)):
        return ONE
    if isinstance(expr, ast.Neg):
        return _partial_degree(expr.operand, inputs, degrees)
    if isinstance(expr, ast.BinOp):
        left = _partial_degree(expr.left, inputs, degrees)
        right = _partial_degree(expr.right, inputs, degrees)
        if expr.op in "+-":
            return _join(left, right, "adds a partial sum to a value that is not a partial sum of the same degree")
        if expr.op == "*":
            if _ZERO_MARK in (left, right):
                return _ZERO_MARK
            if left != ONE and right != ONE:
                raise _NotLinear("multiplies two partial sums")
            return left if left != ONE else right
        if expr.op == "/":
            if right not in (ONE,):
                raise _NotLinear("divides by a partial sum")
            return left
        raise _NotLinear(f"applies '{expr.op}' to values")
    if isinstance(expr, ast.Call):
        for arg in expr.args:
            if _partial_degree(arg, inputs, degrees) not in (ONE, _ZERO_MARK):
                raise _NotLinear(f"applies {expr.func} to a partial sum, which is not linear")
        return ONE
    if isinstance(expr, ast.IfThenElse):
        return _join(_partial_degree(expr.then, inputs, degrees), _partial_degree(expr.orelse, inputs, degrees),
                     "selects between values with different partial-sum degrees")
    if isinstance(expr, ast.Sum):
        body = _partial_degree(expr.body, inputs, degrees)
        degree = degrees.get(expr.var, ONE)
        if body == _ZERO_MARK:
            return _ZERO_MARK
        return body * degree
    if isinstance(expr, ast.Max):
        # A device holding one block of the range computes the max of that block: not a summand of the
        # global max (max(a, b) != a + b), and no parallel operator combines maxima of blocks. So a max
        # over a sharded range is refused; a vocabulary-wide max gathers the blocks' maxima instead
        # (`combine`) and takes their max (rules/parallel_layers.rule, logsumexp).
        if degrees.get(expr.var, ONE) != ONE:
            raise _NotLinear(f"takes a max over '{_pretty(expr.var)}', a sharded range: each device would hold "
                             "the max of its own block, which is not a partial sum (gather the blocks' maxima "
                             "with combine instead)", naive=degrees[expr.var])
        if _partial_degree(expr.body, inputs, degrees) not in (ONE, _ZERO_MARK):
            raise _NotLinear("takes a max of a partial sum, which is not linear")
        return ONE
    raise _NotLinear("uses a construct the spread analysis does not know")


def _join(left: Poly | str, right: Poly | str, message: str) -> Poly | str:
    if left == _ZERO_MARK:
        return right
    if right == _ZERO_MARK or left == right:
        return left
    raise _NotLinear(message)
