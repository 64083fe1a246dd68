"""Sum-of-products normal form of index-level values, and its sum and max lemmas.

A value is a sum of monomials; a monomial is a rational coefficient, a set
of summation binders `(var, bound)` and a product of factors (input
elements, sizes, named functions, reciprocals, conditionals). Sums over
sizes are rectangular, so binders commute; linearity is built in (a sum of
an addition is an addition of sums, factors that do not mention a binder
sit outside it by construction).

The lemmas the verifier instantiates itself:
* a sum of bound 1 is its body at 0, a sum whose body ignores its binder
  is a multiplication by the bound, guarded by `[bound >= 0]` unless the
  bound is evidently non-negative (a negative bound is an empty range,
  whose sum is 0: docs/LANGUAGE.md);
* block re-indexing: `sum(q < p) sum(r < K) f(q*K + r) = sum(l < p*K) f(l)`
  (`merge_blocks`), which is what a reduce over sharded contractions needs;
* canonical binder names (by nesting depth, the order that gives the
  smallest text), so alpha-equivalent sums are identical.

A max over a range (`max(l < n) body`) is one opaque factor
`("max", binders, body)`: the largest value of `body` over the rectangle
of its binders, 0 when it is empty (the language's convention, so that the
lemmas below hold for every size). z3 sees it as an uninterpreted function
of the bound and the body (`prove._Z3`), so a proof uses nothing about max
beyond congruence, and the normal form only applies rewrites that are true
of max over a rectangle with that convention:
* a max of bound 1 is its body at 0; nested maxes form one rectangle
  (`max(q < p) max(r < K) f = max over (q, r)`: both are 0 exactly when the
  rectangle is empty, else the same set of values);
* block re-indexing: `(q, r) -> q*K + r` maps the rectangle [0,p) x [0,K)
  onto [0, p*K) one to one, so the max over either is the same
  (`merge_blocks`, the gathered maxima of a vocabulary's blocks);
* canonical binder names, as for sums.
Everything is plain tuples of `Poly`s: hashable, comparable, no z3.
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from typing import Callable

from parsat.dsl.symbolic import ONE, ZERO, Poly

# factor:   ("in", name, (Poly, ...)) | ("size", Poly) | ("real", name) | ("fn", name, (NF, ...))
#           | ("recip", NF) | ("ind", cond, polarity)   (an indicator: 1 where cond == polarity, else 0)
#           | ("max", ((var, bound Poly), ...), NF)      (the max of NF over the binders' rectangle; 0 if empty)
# cond:     ("rel", op, Poly, Poly) | ("and", c, c) | ("or", c, c) | ("not", c)
# monomial: (Fraction, ((var, bound Poly), ...), (factor, ...))
# NF:       tuple of monomials

MAX_PERMUTE = 5


def const(value) -> tuple:
    value = Fraction(value)
    return ((value, (), ()),) if value else ()


def factor(item: tuple) -> tuple:
    return ((Fraction(1), (), (item,)),)


def size(poly: Poly) -> tuple:
    if poly.is_const:
        return const(poly.constant)
    return factor(("size", poly))


def add(a: tuple, b: tuple) -> tuple:
    return a + b


def neg(a: tuple) -> tuple:
    return tuple((-c, bs, fs) for c, bs, fs in a)


def mul(a: tuple, b: tuple) -> tuple:
    out = []
    for ca, ba, fa in a:
        taken = {v for v, _ in ba}
        for cb, bb, fb in b:
            renames = {}
            for v, _ in bb:
                if v in taken:
                    renames[v] = _fresh_like(v, taken)
                    taken.add(renames[v])
            if renames:
                cb, bb, fb = rename_mono((cb, bb, fb), renames)
            out.append((ca * cb, ba + bb, fa + fb))
    return tuple(out)


def _fresh_like(v: str, taken: set) -> str:
    k = 1
    while f"{v}'{k}" in taken:
        k += 1
    return f"{v}'{k}"


def if_then_else(cond: tuple, then: tuple, orelse: tuple) -> tuple:
    """`[c] * then + [not c] * orelse`: conditionals become indicator factors."""
    truth = decide(cond, {})
    if truth is not None:
        return then if truth else orelse
    return add(mul(factor(("ind", cond, True)), then), mul(factor(("ind", cond, False)), orelse))


def decide(cond: tuple, bounds: dict) -> bool | None:
    """Truth of an index condition from binder ranges `0 <= v < bounds[v]`, if evident."""
    if cond[0] != "rel":
        return None
    op, a, b = cond[1], cond[2], cond[3]
    if op in (">", "<="):
        a, b, op = b, a, "<" if op == ">" else ">="
    if op not in ("<", ">="):
        diff = a - b
        return (diff == ZERO) == (op == "==") if diff.is_const else None
    diff = a - b  # decide diff < 0
    result = None
    if diff.is_const:
        result = diff.constant < 0
    else:
        for var, bound in bounds.items():
            rest = diff - Poly.sym(var)
            if var in rest.symbols():
                continue
            if rest == ZERO or (rest.is_const and rest.constant >= 0):
                result = False  # v + c with c >= 0 is never negative
            elif rest == -bound:
                result = True  # v - bound < 0
            if result is not None:
                break
    if result is None:
        return None
    return result if op == "<" else not result


def max_over(var: str, bound: Poly, body: tuple) -> tuple:
    """`max(var < bound) body`: one max factor (nested maxes joined into one rectangle)."""
    if bound == ONE:
        return subst(body, {var: ZERO})
    if len(body) == 1 and body[0][0] == 1 and not body[0][1] and len(body[0][2]) == 1 \
            and body[0][2][0][0] == "max":
        _, binders, inner = body[0][2][0]
        return factor(("max", ((var, bound),) + binders, inner))
    return factor(("max", ((var, bound),), body))


def recip(a: tuple) -> tuple:
    if len(a) == 1 and not a[0][1] and not a[0][2]:
        return const(1 / a[0][0])
    return factor(("recip", a))


def sum_over(var: str, bound: Poly, body: tuple) -> tuple:
    """`sum(var < bound) body`, distributed over the monomials. A body that ignores `var` is multiplied by the
    number of terms, which is `bound` only when the bound is not negative (an empty range is 0, however
    negative its bound): `[bound >= 0] * bound` unless the bound is evidently non-negative."""
    if bound == ONE:
        return subst(body, {var: ZERO})
    out = []
    for c, bs, fs in body:
        if var in _mono_symbols(fs):
            out.append((c, bs + ((var, bound),), fs))
        elif bound.is_const:
            if bound.constant > 0:
                out.append((c * bound.constant, bs, fs))
        elif nonnegative(bound):
            out.append((c, bs, fs + (("size", bound),)))
        else:
            out.append((c, bs, fs + (("ind", ("rel", ">=", bound, ZERO), True), ("size", bound))))
    return tuple(out)


def nonnegative(p: Poly) -> bool:
    """Evidently >= 0: non-negative coefficients over sizes, degrees, integers and index variables (all >= 0),
    and quotients and remainders of such."""
    for mono, coeff in p.terms:
        if coeff < 0:
            return False
        for atom, _exp in mono:
            if not isinstance(atom, str) and not (nonnegative(atom[1]) and nonnegative(atom[2])):
                return False
    return True


# ------------------------------------------------------------- traversal


def map_polys(nf: tuple, fn: Callable[[Poly], Poly]) -> tuple:
    return tuple(_map_mono(m, fn) for m in nf)


def _map_mono(mono, fn):
    c, bs, fs = mono
    return (c, tuple((v, fn(b)) for v, b in bs), tuple(_map_factor(f, fn) for f in fs))


def _map_factor(f, fn):
    kind = f[0]
    if kind == "in":
        return ("in", f[1], tuple(fn(p) for p in f[2]))
    if kind == "size":
        return ("size", fn(f[1]))
    if kind == "real":
        return f
    if kind == "fn":
        return ("fn", f[1], tuple(map_polys(a, fn) for a in f[2]))
    if kind == "recip":
        return ("recip", map_polys(f[1], fn))
    if kind == "ind":
        return ("ind", map_cond(f[1], fn), f[2])
    if kind == "max":
        return ("max", tuple((v, fn(b)) for v, b in f[1]), map_polys(f[2], fn))
    raise TypeError(f"unknown factor {kind}")


def map_cond(cond, fn):
    if cond[0] == "rel":
        return ("rel", cond[1], fn(cond[2]), fn(cond[3]))
    if cond[0] == "not":
        return ("not", map_cond(cond[1], fn))
    return (cond[0], map_cond(cond[1], fn), map_cond(cond[2], fn))


def polys_of(nf: tuple) -> list[Poly]:
    found: list[Poly] = []

    def grab(p: Poly) -> Poly:
        found.append(p)
        return p

    map_polys(nf, grab)
    return found


def _mono_symbols(factors) -> set:
    found: set = set()
    for p in polys_of(((Fraction(1), (), factors),)):
        found |= p.symbols()
    return found


def subst(nf: tuple, env: dict) -> tuple:
    return map_polys(nf, lambda p: p.subst(env) if p.symbols() & set(env) else p)


def rename_mono(mono, renames: dict):
    env = {old: Poly.sym(new) for old, new in renames.items()}
    c, bs, fs = mono
    fs2 = tuple(_map_factor(f, lambda p: p.subst(env) if p.symbols() & set(env) else p) for f in fs)
    return (c, tuple((renames.get(v, v), b) for v, b in bs), fs2)


# ----------------------------------------------------- block re-indexing


def _top_symbols(p: Poly) -> set:
    return {atom for mono, _ in p.terms for atom, _ in mono if isinstance(atom, str)}


def _merge_poly(p: Poly, q: str, r: str, stride: Poly, merged: str) -> Poly | None:
    """`p` with `q*stride + r` replaced by `merged`; None if q or r is left over."""
    names = {q, r}
    if not names & p.symbols():
        return p
    if names & _top_symbols(p):
        p = p - (Poly.sym(q) * stride + Poly.sym(r)) + Poly.sym(merged)
        if names & _top_symbols(p):
            return None
    out = Poly.const(0)
    for mono, coeff in p.terms:
        term = Poly.const(coeff)
        for atom, exp in mono:
            if isinstance(atom, str):
                base = Poly.sym(atom)
            else:
                num = _merge_poly(atom[1], q, r, stride, merged)
                den = _merge_poly(atom[2], q, r, stride, merged)
                if num is None or den is None:
                    return None
                base = num.floordiv(den) if atom[0] == "//" else num.mod(den)
            for _ in range(exp):
                term = term * base
        out = out + term
    if names & out.symbols():
        return None
    return out


def merge_blocks(nf: tuple) -> tuple:
    """Apply block re-indexing to every monomial until nothing merges, inside function arguments and
    reciprocals too (a vocabulary-parallel logsumexp sums blocks inside its log)."""
    return tuple(_merge_mono(m) for m in nf)


def _merge_inside(f):
    if f[0] == "fn":
        return ("fn", f[1], tuple(merge_blocks(a) for a in f[2]))
    if f[0] == "recip":
        return ("recip", merge_blocks(f[1]))
    if f[0] == "max":
        binders, body = _merge_binders(f[1], merge_blocks(f[2]), map_polys)
        return ("max", binders, body)
    return f


def _merge_mono(mono):
    c, bs, fs = mono
    fs = tuple(_merge_inside(f) for f in fs)
    bs, fs = _merge_binders(bs, fs, lambda factors, fn: tuple(_map_factor(f, fn) for f in factors))
    return (c, bs, fs)


def _merge_binders(bs: tuple, scope, mapper):
    """Merge pairs of binders `(q, r)` read only as `q*K + r` into one of bound `p*K`, in `scope` (a
    monomial's factors, or a max's body) until none merges; `mapper(scope, fn)` maps every Poly in it."""
    changed = True
    while changed and len(bs) >= 2:
        changed = False
        for (q, bq), (r, br) in itertools.permutations(bs, 2):
            if not (nonnegative(bq) and nonnegative(br)):
                continue  # two empty ranges of negative bounds are not one range of bound bq * br > 0
            merged = f"{q}&{r}"
            failed = []

            def fn(p: Poly) -> Poly:
                out = _merge_poly(p, q, r, br, merged)
                if out is None:
                    failed.append(p)
                    return p
                return out

            new_scope = mapper(scope, fn)
            if failed:
                continue
            bs = tuple(b for b in bs if b[0] not in (q, r)) + ((merged, bq * br),)
            ranges = dict(bs)
            scope = mapper(new_scope, lambda p: simplify(p, ranges))
            changed = True
            break
    return bs, scope


# ------------------------------------------------------ canonical form


def canonical(nf: tuple, depth: int = 0) -> tuple:
    """Binders renamed by depth, factors and monomials sorted, like terms added."""
    collected: dict = {}
    for mono in nf:
        c, bs, fs = _canon_mono(mono, depth)
        key = (bs, fs)
        collected[key] = collected.get(key, Fraction(0)) + c
    out = [(c, bs, fs) for (bs, fs), c in collected.items() if c != 0]
    out.sort(key=lambda m: repr((m[1], m[2], m[0])))
    return tuple(out)


def _canon_factor(f, depth: int):
    kind = f[0]
    if kind == "fn":
        return ("fn", f[1], tuple(canonical(a, depth + 1) for a in f[2]))
    if kind == "max":
        return _canon_max(f, depth)
    if kind == "recip":
        inner = canonical(f[1], depth + 1)
        if len(inner) == 1 and not inner[0][1] and not inner[0][2]:
            return None if inner[0][0] == 0 else ("const", 1 / inner[0][0])
        return ("recip", inner)
    return f


def _canon_max(f, depth: int):
    """A max factor with its binders named `$<depth+1>.<k>` in the order that gives the smallest text (its
    body's own sums are named one level deeper); a max whose body is a constant is that constant when its
    rectangle is evidently non-empty (every bound a positive constant)."""
    _, binders, body = f
    names = [v for v, _ in binders]
    best = None
    perms = itertools.permutations(range(len(names))) if len(names) <= MAX_PERMUTE else [range(len(names))]
    for perm in perms:
        renames = {names[i]: f"${depth + 1}.{k}" for k, i in enumerate(perm)}
        env = {old: Poly.sym(new) for old, new in renames.items()}
        renamed = map_polys(body, lambda p: p.subst(env) if p.symbols() & set(env) else p)
        bs2 = tuple(sorted(((renames[v], b) for v, b in binders), key=lambda b: b[0]))
        candidate = ("max", bs2, canonical(renamed, depth + 2))
        if best is None or repr(candidate) < repr(best):
            best = candidate
    _, bs2, body2 = best
    used = set()
    for p in polys_of(body2):
        used |= p.symbols()
    if not used & {v for v, _ in bs2} and all(b.is_const and b.constant >= 1 for _, b in bs2):
        if not body2:
            return ("const", Fraction(0))  # the monomial is 0: `canonical` drops it
        if len(body2) == 1 and not body2[0][1] and not body2[0][2]:
            return ("const", body2[0][0])
    return best


def split_boundaries(form: tuple) -> tuple:
    """Splitting at concat boundaries: `sum(l < B) [l < N] f(l) = sum(l < N) f(l)` and
    `sum(l < B) [not l < N] f(l) = sum(l < B - N) f(l + N)` when `B - N >= 0` evidently."""
    out = []
    queue = list(form)
    while queue:
        mono = queue.pop()
        c, bs, fs = mono
        bounds = dict(bs)
        done = False
        for index, f in enumerate(fs):
            if f[0] != "ind":
                continue
            truth = decide(f[1], bounds)
            if truth is not None:
                if truth == f[2]:
                    queue.append((c, bs, fs[:index] + fs[index + 1:]))
                done = True
                break
            cond = f[1]
            if cond[0] != "rel" or cond[1] != "<":
                continue
            var = _single_var(cond[2])
            if var is None or var not in bounds or var in cond[3].symbols():
                continue
            limit, bound = cond[3], bounds[var]
            rest = bound - limit
            if any(coeff < 0 for _, coeff in rest.terms + limit.terms) or not _plain(rest) or not _plain(limit):
                continue  # only evident 0 <= limit <= bound
            others = fs[:index] + fs[index + 1:]
            if f[2]:
                new_bs = tuple((v, limit if v == var else b) for v, b in bs)
                queue.append((c, new_bs, others))
            else:
                new_bs = tuple((v, rest if v == var else b) for v, b in bs)
                env = {var: Poly.sym(var) + limit}
                fs2 = tuple(_map_factor(g, lambda p: p.subst(env) if var in p.symbols() else p) for g in others)
                queue.append((c, new_bs, fs2))
            done = True
            break
        if not done:
            out.append(mono)
    return tuple(out)


def _plain(p: Poly) -> bool:
    """Sizes only (no `//`, `%`, no index variables): non-negative when the coefficients are."""
    return all(isinstance(a, str) and not a.startswith(("$", "@", "~")) for mono, _ in p.terms for a, _ in mono)


def _single_var(p: Poly) -> str | None:
    if len(p.terms) == 1:
        mono, coeff = p.terms[0]
        if coeff == 1 and len(mono) == 1 and isinstance(mono[0][0], str) and mono[0][1] == 1:
            return mono[0][0]
    return None


def _canon_mono(mono, depth: int):
    c, bs, fs = mono
    inds = [f for f in fs if f[0] == "ind"]
    if inds:
        seen = {}
        for f in inds:
            if seen.get(f[1], f[2]) != f[2]:
                return (Fraction(0), (), ())
            seen[f[1]] = f[2]
        fs = tuple(f for f in fs if f[0] != "ind") + tuple(("ind", k, v) for k, v in seen.items())
    names = [v for v, _ in bs]
    best = None
    perms = itertools.permutations(range(len(names))) if len(names) <= MAX_PERMUTE else [range(len(names))]
    for perm in perms:
        renames = {names[i]: f"${depth}.{k}" for k, i in enumerate(perm)}
        _, bs2, fs2 = rename_mono((c, bs, fs), renames)
        bs2 = tuple(sorted(bs2, key=lambda b: b[0]))
        coef = c
        factors = []
        for f in fs2:
            g = _canon_factor(f, depth)
            if g is not None and g[0] == "const":
                coef = coef * g[1]
                continue
            factors.append(g)
        factors.sort(key=repr)
        candidate = (coef, bs2, tuple(factors))
        if best is None or repr(candidate[1:]) < repr(best[1:]):
            best = candidate
    return best


# ------------------------------------------------------ index arithmetic


def upper(e: Poly, bounds: dict) -> Poly | None:
    """A structural strict upper bound of a non-negative index, if evident."""
    name = _single_var(e)
    if name is not None:
        return bounds.get(name)
    if len(e.terms) == 1:
        mono, coeff = e.terms[0]
        if coeff == 1 and len(mono) == 1 and mono[0][1] == 1 and not isinstance(mono[0][0], str):
            kind, num, den = mono[0][0]
            if kind == "%":
                return den
            top = upper(num, bounds)
            if top is not None:
                return top.exact_div(den)
    if len(e.terms) > 1:  # mixed radix: X*c + Y with Y < c and X < U is below U*c
        for mono, coeff in e.terms:
            term = Poly(((mono, coeff),))
            low = upper(e - term, bounds)
            if low is None:
                continue
            high = term.exact_div(low)
            top = upper(high, bounds) if high is not None else None
            if top is not None:
                return top * low
            if low.is_const and 0 < low.constant <= coeff:  # a window no wider than its stride: Y < low <= c
                top = upper(Poly(((mono, 1),)), bounds)
                if top is not None:
                    return top * coeff
    return None


def divmod_poly(e: Poly, d: Poly, bounds: dict) -> tuple[Poly, Poly]:
    """`(e // d, e % d)` for `e >= 0`, simplified by the ranges in `bounds`.

    `e = A*d + r` with `0 <= r < d` evident gives `(A, r)`; otherwise the
    quotient and remainder stay opaque atoms for z3.
    """
    if d == ONE:
        return e, ZERO
    quotient, rest = ZERO, ZERO
    for mono, coeff in e.terms:
        term = Poly(((mono, coeff),))
        exact = term.exact_div(d) if len(d.terms) == 1 else None
        if exact is not None:
            quotient = quotient + exact
        else:
            rest = rest + term
    if rest == ZERO:
        return quotient, ZERO
    if upper(rest, bounds) == d:
        return quotient, rest
    if rest.is_const and quotient == ZERO and d.is_const and 0 <= rest.constant < d.constant:
        return ZERO, rest
    return e.floordiv(d), e.mod(d)


def simplify(p: Poly, bounds: dict) -> Poly:
    """Re-evaluate `//` and `%` atoms with `divmod_poly`, then fold `(e//d)*d + e%d` into `e`."""
    if all(isinstance(atom, str) for mono, _ in p.terms for atom, _ in mono):
        return p
    out = ZERO
    for mono, coeff in p.terms:
        term = Poly.const(coeff)
        for atom, exp in mono:
            if isinstance(atom, str):
                base = Poly.sym(atom)
            else:
                num, den = simplify(atom[1], bounds), simplify(atom[2], bounds)
                q, r = divmod_poly(num, den, bounds)
                base = q if atom[0] == "//" else r
            for _ in range(exp):
                term = term * base
        out = out + term
    return _euclid(out)


def _euclid(p: Poly) -> Poly:
    for mono, coeff in p.terms:
        if len(mono) == 1 and mono[0][1] == 1 and not isinstance(mono[0][0], str) and mono[0][0][0] == "%":
            _, num, den = mono[0][0]
            pair = Poly.atom(("//", num, den)) * den * coeff
            rest = p - Poly(((mono, coeff),)) - pair
            if len(rest.terms) == len(p.terms) - 1 - len(pair.terms):
                return _euclid(rest + num * coeff)
    return p


# ------------------------------------------------------------ case splits


def free_conditions(form: tuple) -> list:
    """Conditions of indicators that mention no summation binder (canonical `$` names)."""
    found: list = []

    def visit(nf_: tuple) -> None:
        for _, _, fs in nf_:
            for f in fs:
                if f[0] == "ind":
                    names = set()
                    map_cond(f[1], lambda p: names.update(p.symbols()) or p)
                    if not any(n.startswith("$") for n in names) and f[1] not in found:
                        found.append(f[1])
                elif f[0] == "fn":
                    for a in f[2]:
                        visit(a)
                elif f[0] == "recip":
                    visit(f[1])
                elif f[0] == "max":
                    visit(f[2])

    visit(form)
    return found


def assume(form: tuple, cond: tuple, truth: bool) -> tuple:
    """`form` where the indicator of `cond` is known to be `truth`."""
    out = []
    for c, bs, fs in form:
        kept = []
        alive = True
        for f in fs:
            if f[0] == "ind" and f[1] == cond:
                if f[2] != truth:
                    alive = False
                    break
                continue
            if f[0] == "fn":
                f = ("fn", f[1], tuple(assume(a, cond, truth) for a in f[2]))
            elif f[0] == "recip":
                f = ("recip", assume(f[1], cond, truth))
            elif f[0] == "max":
                f = ("max", f[1], assume(f[2], cond, truth))
            kept.append(f)
        if alive:
            out.append((c, bs, tuple(kept)))
    return tuple(out)
