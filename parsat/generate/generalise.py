"""Widening a proved rule: independent sizes, then any rank.

Enumeration works at a few fixed shapes, so a rule it finds is narrower
than what is true. Two widenings, each tried variant by variant:

- **Sizes** (`widen_sizes`): inputs of one kind share dims (x and y are
  both `[m, k]`) and split attributes use the enumeration's symbols, so
  `concat(relu(x), relu(y), 0)` is found with equal row counts though it
  holds for any. Every occurrence of a size symbol (a dim of a tensor
  binder, or a token of the rule) is a slot; a subset of a symbol's slots
  (never its first) is renamed to a fresh symbol, smallest subsets first.
- **Ranks** (`lift_ranks`): a rule found on `x: [m, k]` usually holds with
  dims in between and around (`x: [*a, m, *b, k, *c]`), its dim attributes
  shifted by the groups before them (`partition(x, 0, p)` becomes
  `partition(x, len(a), p)`). Groups are inserted at chosen gaps of chosen
  binders (shared by gap index, so `bmm`'s two operands keep one batch
  prefix); every dim attribute is re-derived by typing the lifted term at
  groups of length one. Then each dim that only one binder has and nothing
  else mentions is folded with its neighbouring groups into one group
  (`[*a, n, *b, k, *c]` -> `[*a, n, *b]`): the shipped library's style.

A variant is kept when it type-checks at every rank and the verifier's
concrete search finds no counterexample; only the final rule is proved
(one proof per rule instead of one per variant), and if that proof fails
the rule stays as it was (it is already proved).
"""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.errors import DslError
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.dsl.printer import format_expr
from parsat.dsl.symbolic import Poly
from parsat.dsl.typecheck import TermTyper, TypeCheckError
from parsat.generate.candidates import binder_text, make_rule
from parsat.generate.enumerate import dim_attributes

Prover = Callable[[ast.RuleDecl], bool]      # True when the verifier PROVES the rule
GROUP_NAMES = "abcdefgh"
MAX_GAPS = 4                                  # gaps 0..3: lifting rules of rank up to 3


def plausible(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl]) -> bool:
    """Type-checks at every rank the verifier proves, and no counterexample turns up concretely."""
    from parsat.dsl.checker import check_rule
    from parsat.verifier.core import RuleError, refuted_concretely

    try:
        check_rule(rule, ops)
        return not refuted_concretely(rule, ops)
    except (TypeCheckError, RuleError, ZeroDivisionError, KeyError):
        return False


def _parse_rule(name: str, binders: Sequence[str], body: str, doc_from: ast.RuleDecl) -> ast.RuleDecl | None:
    from parsat.dsl.parser import parse

    where = ("  where " + ", ".join(format_expr(w) for w in doc_from.where) + "\n") if doc_from.where else ""
    try:
        parsed = parse(f"rule {name}:\n  forall {', '.join(binders)}\n{where}  {body}\n", "<generalise>").items[0]
    except (DslError, IndexError):
        return None
    return parsed


# ------------------------------------------------------------------ sizes


@dataclass(frozen=True)
class _Slot:
    """One occurrence of a size symbol: a dim of a tensor binder, or a token of the rule's text."""

    tensor: str = ""      # binder name ("" for a text token)
    pos: int = -1         # dim position in the binder, or character offset in the text


def _slots(symbol: str, tensors: Mapping[str, list[str]], body: str) -> list[_Slot]:
    out = [_Slot(name, i) for name, dims in tensors.items() for i, d in enumerate(dims) if d == symbol]
    out += [_Slot("", m.start()) for m in re.finditer(rf"\b{re.escape(symbol)}\b", body)]
    return out


def _rename(tensors: Mapping[str, list[str]], body: str, slots: Iterable[_Slot], old: str,
            new: str) -> tuple[dict[str, list[str]], str]:
    out = {name: list(dims) for name, dims in tensors.items()}
    offsets = sorted((s.pos for s in slots if not s.tensor), reverse=True)
    for slot in slots:
        if slot.tensor:
            out[slot.tensor][slot.pos] = new
    for offset in offsets:
        body = body[:offset] + new + body[offset + len(old):]
    return out, body


def _late(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() >= deadline


def widen_sizes(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], max_tries: int = 40,
                deadline: float | None = None) -> ast.RuleDecl:
    """The rule with as many size symbols made independent as stay plausible (not yet proved).

    Greedy, at most `max_tries` plausible-checks per rule, none after `deadline` (`time.perf_counter()`).
    """
    tensors = {b.name: [format_expr(d) for d in b.type.dims] for b in rule.binders if b.is_tensor}
    if any(isinstance(d, ast.Variadic) for b in rule.binders if b.is_tensor for d in b.type.dims):
        return rule
    scalars = [b for b in rule.binders if not b.is_tensor]
    body = format_expr(rule.lhs) + " => " + format_expr(rule.rhs)
    symbols = list(dict.fromkeys([d for dims in tensors.values() for d in dims]
                                 + [b.name for b in scalars if b.type.kind == "int"]))
    tries = 0
    fresh = 0
    work = list(symbols)
    current = rule
    while work and tries < max_tries and not _late(deadline):
        symbol = work.pop(0)
        if not re.fullmatch(r"[A-Za-z_]\w*", symbol):
            continue
        slots = _slots(symbol, tensors, body)
        found = True
        while found and len(slots) > 1 and tries < max_tries:
            found = False
            rest = slots[1:]
            for size in range(1, len(rest) + 1):
                for subset in itertools.combinations(rest, size):
                    fresh += 1
                    new = f"{symbol}{fresh}"
                    trial_tensors, trial_body = _rename(tensors, body, subset, symbol, new)
                    dims = {d for ds in trial_tensors.values() for d in ds}
                    ints = [b for b in scalars if b.name != symbol or symbol in trial_body]
                    if new not in dims:
                        ints.append(ast.Param(new, ast.ScalarType("int")))
                    binders = [f"{n}: [{', '.join(ds)}]" for n, ds in trial_tensors.items()]
                    binders += [binder_text(b) for b in ints]
                    parsed = _parse_rule("r", binders, trial_body, ast.RuleDecl("r", (), (), rule.lhs, rule.rhs))
                    if parsed is None:
                        continue
                    general = make_rule(ops, parsed.binders, parsed.lhs, parsed.rhs, rule.name)
                    if general is None:
                        continue
                    tries += 1
                    if plausible(general, ops):
                        tensors, body, current = trial_tensors, trial_body, general
                        scalars = [b for b in general.binders if not b.is_tensor]
                        work.append(new)
                        slots = _slots(symbol, tensors, body)
                        found = True
                        break
                    if tries >= max_tries or _late(deadline):
                        break
                if found or tries >= max_tries or _late(deadline):
                    break
    return current


# ------------------------------------------------------------------ ranks


class _LiftError(Exception):
    pass


def _dims_text(dims: Sequence[ast.Expr]) -> list[str]:
    return [f"*{d.id}" if isinstance(d, ast.Variadic) else format_expr(d) for d in dims]


@dataclass
class _Lifter:
    """Rewrites a rule's terms for lifted binders: every dim attribute re-derived from the lifted shapes."""

    rule: ast.RuleDecl
    ops: Mapping[str, ast.OpDecl]
    lifted: tuple[ast.Param, ...]
    groups: tuple[str, ...]

    def __post_init__(self) -> None:
        self.base = TermTyper(self.rule.binders, self.ops)
        self.wide = TermTyper(self.lifted, self.ops, {g: 1 for g in self.groups})
        self.group_dims = {f"{g}_0": g for g in self.groups}

    def _index(self, base_arg: ast.Expr, wide_arg: ast.Expr, index: int) -> ast.Expr:
        """The lifted form of dim `index` of `base_arg`: len(groups before it) + base dims before it."""
        try:
            base_shape = self.base.type(base_arg)[0].shape
            wide_shape = self.wide.type(wide_arg)[0].shape
        except TypeCheckError as err:
            raise _LiftError(str(err)) from None
        positions = []
        for pos, dim in enumerate(wide_shape):
            symbols = dim.symbols()
            grouped = symbols & set(self.group_dims)
            if grouped:
                if len(grouped) != 1 or dim != Poly.sym(next(iter(grouped))):
                    raise _LiftError("a group dim is mixed with another dim")
                continue
            positions.append(pos)
        if len(positions) != len(base_shape) or [wide_shape[p] for p in positions] != list(base_shape):
            raise _LiftError("the lifted shape does not keep the base dims in order")
        target = positions[index]
        before = [self.group_dims[next(iter(wide_shape[p].symbols()))] for p in range(target)
                  if p not in positions]
        expr: ast.Expr | None = None
        for group in before:
            expr = ast.Len(group) if expr is None else ast.BinOp("+", expr, ast.Len(group))
        plain = index
        if expr is None:
            return ast.Num(plain)
        return ast.BinOp("+", expr, ast.Num(plain)) if plain else expr

    def term(self, expr: ast.Expr) -> ast.Expr:
        if not isinstance(expr, ast.Call):
            return expr
        args = list(expr.args)
        new_args = [self.term(a) if _is_tensor_arg(expr, i, self.ops) else a for i, a in enumerate(args)]
        if expr.func in PARALLEL_OPS:
            if PARALLEL_OPS[expr.func].has_dim:
                new_args[1] = self._index(args[0], new_args[0], _const(args[1]))
            return ast.Call(expr.func, tuple(new_args))
        op = self.ops[expr.func]
        named = dim_attributes(op)
        first_tensor = next(i for i, p in enumerate(op.params) if p.is_tensor)
        for i, param in enumerate(op.params):
            if param.name in named:
                new_args[i] = self._index(args[first_tensor], new_args[first_tensor], _const(args[i]))
        return ast.Call(expr.func, tuple(new_args))


def _const(expr: ast.Expr) -> int:
    if isinstance(expr, ast.Num) and isinstance(expr.value, int):
        return expr.value
    raise _LiftError(f"dim attribute {format_expr(expr)} is not a constant")


def _is_tensor_arg(call: ast.Call, index: int, ops: Mapping[str, ast.OpDecl]) -> bool:
    if call.func in PARALLEL_OPS:
        return index == 0
    return ops[call.func].params[index].is_tensor


def _lifted_binders(rule: ast.RuleDecl, lift: Sequence[str], gaps: Sequence[int],
                    names: Sequence[str]) -> tuple[ast.Param, ...]:
    out = []
    for binder in rule.binders:
        if not binder.is_tensor or binder.name not in lift:
            out.append(binder)
            continue
        dims: list[ast.Expr] = []
        base = list(binder.type.dims)
        for gap in range(len(base) + 1):
            if gap in gaps:
                dims.append(ast.Variadic(names[gap]))
            if gap < len(base):
                dims.append(base[gap])
        out.append(ast.Param(binder.name, ast.ShapeType(tuple(dims))))
    return tuple(out)


def _lift(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], lift: Sequence[str], gaps: Sequence[int],
          names: Sequence[str]) -> ast.RuleDecl | None:
    binders = _lifted_binders(rule, lift, gaps, names)
    used = tuple(dict.fromkeys(d.id for b in binders if b.is_tensor for d in b.type.dims
                               if isinstance(d, ast.Variadic)))
    try:
        lifter = _Lifter(rule, ops, binders, used)
        lhs, rhs = lifter.term(rule.lhs), lifter.term(rule.rhs)
    except (_LiftError, TypeCheckError, KeyError, StopIteration):
        return None
    where = [format_expr(w) for w in rule.where]
    lifted = make_rule(ops, binders, lhs, rhs, rule.name, where)
    if lifted is None:
        return None
    from parsat.dsl.checker import compare_sides
    from parsat.dsl.typecheck import type_rule

    try:   # one typing at groups of length one rules out most lifts before the full check
        instance = type_rule(lifted, ops, {g: 1 for g in used})
    except (TypeCheckError, KeyError, ZeroDivisionError):
        return None
    if instance.problems or compare_sides(instance) is not None:
        return None
    return lifted


def _indexed_dims(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl]) -> set[str] | None:
    """The dim symbols that some dim attribute points at (typed at groups of length one; None: no typing)."""
    from parsat.dsl.typecheck import rule_groups, type_rule

    try:
        instance = type_rule(rule, ops, {g: 1 for g in rule_groups(rule)})
    except (TypeCheckError, KeyError, ZeroDivisionError):
        return None
    out: set[str] = set()
    for side in (instance.lhs, instance.rhs):
        for term in side.walk():
            positions: list[tuple[tuple[Poly, ...], int]] = []
            if term.kind == "parallel" and term.dim is not None:
                positions.append((term.args[0].shape, term.dim))
            elif term.kind == "op":
                named = dim_attributes(term.instance.op)
                for name, value in term.instance.attrs.items():
                    if name in named and value.is_const and term.args:
                        positions.append((term.args[0].shape, value.constant))
            for shape, index in positions:
                if 0 <= index < len(shape):
                    out |= shape[index].symbols()
    return out


def _free_dims(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl]) -> list[tuple[tuple[str, ...], str]]:
    """(binders, dim) for dims that nothing but binders of one identical shape mention, once each, and that
    no dim attribute points at."""
    body = format_expr(rule.lhs) + " " + format_expr(rule.rhs) + " " + " ".join(format_expr(w) for w in rule.where)
    mentioned = set(re.findall(r"[A-Za-z_]\w*", body))
    indexed = _indexed_dims(rule, ops)
    if indexed is None:
        return []
    mentioned |= indexed
    tensors = [b for b in rule.binders if b.is_tensor]
    out = []
    seen: set[str] = set()
    for binder in tensors:
        for dim in binder.type.dims:
            if not isinstance(dim, ast.Name) or dim.id in mentioned or dim.id in seen:
                continue
            seen.add(dim.id)
            holders = [b for b in tensors if any(isinstance(d, ast.Name) and d.id == dim.id for d in b.type.dims)]
            if all(h.type.dims == binder.type.dims for h in holders) and \
                    sum(1 for d in binder.type.dims if isinstance(d, ast.Name) and d.id == dim.id) == 1:
                out.append((tuple(h.name for h in holders), dim.id))
    return out


def _fold(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], holders: Sequence[str], dim: str) -> ast.RuleDecl | None:
    """`[*b, k, *c]` with k free becomes `[*b]` (one group for all three) in every holder, when nothing else
    uses `c`."""
    binders = []
    dropped: set[str] = set()
    for binder in rule.binders:
        if binder.name not in holders:
            binders.append(binder)
            continue
        dims = list(binder.type.dims)
        pos = next(i for i, d in enumerate(dims) if isinstance(d, ast.Name) and d.id == dim)
        left = pos - 1 if pos > 0 and isinstance(dims[pos - 1], ast.Variadic) else None
        right = pos + 1 if pos + 1 < len(dims) and isinstance(dims[pos + 1], ast.Variadic) else None
        if left is None and right is None:
            return None
        keep = dims[left] if left is not None else dims[right]
        for index in (left, right):
            if index is not None and dims[index] is not keep:
                dropped.add(dims[index].id)
        lo = left if left is not None else pos
        hi = right if right is not None else pos
        dims[lo:hi + 1] = [keep]
        binders.append(ast.Param(binder.name, ast.ShapeType(tuple(dims))))
    others = [b for b in binders if b.name not in holders and b.is_tensor]
    if any(isinstance(d, ast.Variadic) and d.id in dropped for b in others for d in b.type.dims):
        return None
    lhs, rhs = _drop_lengths(rule.lhs, dropped), _drop_lengths(rule.rhs, dropped)
    return make_rule(ops, tuple(binders), lhs, rhs, rule.name, [format_expr(w) for w in rule.where])


def _sum_terms(expr: ast.Expr) -> list[ast.Expr]:
    if isinstance(expr, ast.BinOp) and expr.op == "+":
        return _sum_terms(expr.left) + _sum_terms(expr.right)
    return [expr]


def _drop_lengths(expr: ast.Expr, dropped: set[str]) -> ast.Expr:
    """Dim attributes after a folded region: `len(a) + len(b) + 1` -> `len(a)` when `*a, m, *b` became `*a`.

    An index that counts the dropped group counts the folded dim too, so
    both go. Whether the result still means the same dim is for the
    plausibility check and the proof to say.
    """
    if isinstance(expr, ast.Call):
        return ast.Call(expr.func, tuple(_drop_lengths(a, dropped) for a in expr.args))
    terms = _sum_terms(expr)
    gone = [t for t in terms if isinstance(t, ast.Len) and t.group in dropped]
    if not gone:
        return expr
    rest = [t for t in terms if t not in gone]
    constant = sum(t.value for t in rest if isinstance(t, ast.Num)) - len(gone)
    out: ast.Expr | None = None
    for term in [t for t in rest if not isinstance(t, ast.Num)] + ([ast.Num(constant)] if constant else []):
        out = term if out is None else ast.BinOp("+", out, term)
    return out if out is not None else ast.Num(0)


def _choices(rule: ast.RuleDecl) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """(binders to lift, gaps) pairs, most general first."""
    tensors = [b for b in rule.binders if b.is_tensor]
    top = min(MAX_GAPS, max((len(b.type.dims) for b in tensors), default=0) + 1)
    out = []
    for k in range(len(tensors), 0, -1):
        for lift in itertools.combinations([b.name for b in tensors], k):
            for size in range(top, 0, -1):
                for gaps in itertools.combinations(range(top), size):
                    reach = sum(1 for b in tensors if b.name in lift for g in gaps if g <= len(b.type.dims))
                    out.append((lift, gaps, reach))
    out.sort(key=lambda c: -c[2])
    return [(lift, gaps) for lift, gaps, _ in out]


def lift_ranks(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], max_tries: int = 12,
               deadline: float | None = None) -> list[ast.RuleDecl]:
    """The most general plausible rank-polymorphic form of a fixed-rank rule: dims folded, then unfolded
    ([] when none is plausible)."""
    if any(isinstance(d, ast.Variadic) for b in rule.binders if b.is_tensor for d in b.type.dims):
        return []
    taken = {format_expr(d) for b in rule.binders if b.is_tensor for d in b.type.dims}
    taken |= {b.name for b in rule.binders}
    names = [g for g in GROUP_NAMES if g not in taken][:MAX_GAPS]
    if len(names) < MAX_GAPS:
        return []
    tries = 0
    for lift, gaps in _choices(rule):
        if _late(deadline):
            break
        candidate = _lift(rule, ops, lift, gaps, names)
        if candidate is None:
            continue
        tries += 1
        if plausible(candidate, ops):
            folded = fold_free_dims(candidate, ops, deadline)
            return [folded, candidate] if folded is not candidate else [candidate]
        if tries >= max_tries:
            break
    return []


def fold_free_dims(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl],
                   deadline: float | None = None) -> ast.RuleDecl:
    """Folds free dims into a neighbouring group while the rule stays plausible (until `deadline`)."""
    changed = True
    while changed and not _late(deadline):
        changed = False
        for holders, dim in _free_dims(rule, ops):
            folded = _fold(rule, ops, holders, dim)
            if folded is not None and plausible(folded, ops):
                rule, changed = folded, True
                break
    return rule


def widen(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], prove: Prover, ranks: bool = True,
          sizes: bool = True, deadline: float | None = None) -> ast.RuleDecl:
    """Sizes widened, then ranks lifted; proved once at the end, else the next narrower form, else `rule`.

    Past `deadline` (`time.perf_counter()`) no more variants are tried: the run's time limit holds
    inside a worker too, and a rule is kept in the widest form found by then.
    """
    sized = widen_sizes(rule, ops, deadline=deadline) if sizes else rule
    forms = lift_ranks(sized, ops, deadline=deadline) if ranks else []
    if sized is not rule:
        forms.append(sized)
    for form in forms:
        if prove(form):
            return form
    return rule
