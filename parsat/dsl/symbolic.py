"""Symbolic integers for shapes and degrees: canonical polynomials.

A `Poly` is a sum of monomials with integer coefficients over atoms. An atom
is a symbol (a dim such as `m`, a degree such as `p`) or an opaque floor
division / modulo that could not be simplified. Canonical form makes
structural equality decide `m * p == p * m` and `(h + 2*pad - r)/s + 1`
against itself; equalities that hold only under a rule's `where` are left to
the verifier, which has z3.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Mapping, Union

Atom = Union[str, tuple]  # "m", or ("//", num, den) / ("%", num, den) with Poly parts
Monomial = tuple  # sorted tuple of (atom, exponent)


def _atom_key(atom: Atom) -> str:
    return atom if isinstance(atom, str) else repr(atom)


def _mono_mul(a: Monomial, b: Monomial) -> Monomial:
    powers: dict = dict(a)
    for atom, exp in b:
        powers[atom] = powers.get(atom, 0) + exp
    return tuple(sorted(powers.items(), key=lambda kv: _atom_key(kv[0])))


@dataclass(frozen=True)
class Poly:
    """An integer polynomial in canonical form (terms sorted, no zeros)."""

    terms: tuple  # tuple of (Monomial, int coefficient)

    # ---------------------------------------------------------------- build
    @staticmethod
    def const(value: int) -> "Poly":
        return Poly(((((), int(value)),) if value else ()))

    @staticmethod
    def sym(name: str) -> "Poly":
        return Poly(((((name, 1),), 1),))

    @staticmethod
    def _from_dict(coeffs: dict) -> "Poly":
        items = [(m, c) for m, c in coeffs.items() if c]
        items.sort(key=lambda mc: repr(mc[0]))
        return Poly(tuple(items))

    # ------------------------------------------------------------ arithmetic
    def __add__(self, other: "Poly | int") -> "Poly":
        other = _lift(other)
        coeffs = dict(self.terms)
        for mono, coeff in other.terms:
            coeffs[mono] = coeffs.get(mono, 0) + coeff
        return Poly._from_dict(coeffs)

    __radd__ = __add__

    def __neg__(self) -> "Poly":
        return Poly(tuple((m, -c) for m, c in self.terms))

    def __sub__(self, other: "Poly | int") -> "Poly":
        return self + (-_lift(other))

    def __rsub__(self, other: int) -> "Poly":
        return _lift(other) - self

    def __mul__(self, other: "Poly | int") -> "Poly":
        other = _lift(other)
        coeffs: dict = {}
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                mono = _mono_mul(m1, m2)
                coeffs[mono] = coeffs.get(mono, 0) + c1 * c2
        return Poly._from_dict(coeffs)

    __rmul__ = __mul__

    def exact_div(self, other: "Poly | int") -> "Poly | None":
        """`self / other` when `other` is a monomial dividing every term."""
        other = _lift(other)
        if len(other.terms) != 1:
            return Poly.const(1) if other == self else None
        (dmono, dcoeff), = other.terms
        dpow = dict(dmono)
        out: dict = {}
        for mono, coeff in self.terms:
            if coeff % dcoeff:
                return None
            powers = dict(mono)
            for atom, exp in dpow.items():
                if powers.get(atom, 0) < exp:
                    return None
                powers[atom] -= exp
            key = tuple(sorted(((a, e) for a, e in powers.items() if e), key=lambda kv: _atom_key(kv[0])))
            out[key] = out.get(key, 0) + coeff // dcoeff
        return Poly._from_dict(out)

    def floordiv(self, other: "Poly | int") -> "Poly":
        other = _lift(other)
        exact = self.exact_div(other)
        if exact is not None:
            return exact
        if self.is_const and other.is_const and other.constant != 0:
            return Poly.const(self.constant // other.constant)
        split = self._split_constant(other)
        if split is not None:  # (A*d + c) // d = A + c // d for integer A
            multiple, rest = split
            return multiple + rest // other.constant
        return Poly.atom(("//", self, other))

    def mod(self, other: "Poly | int") -> "Poly":
        other = _lift(other)
        if self.exact_div(other) is not None:
            return Poly.const(0)
        if self.is_const and other.is_const and other.constant != 0:
            return Poly.const(self.constant % other.constant)
        split = self._split_constant(other)
        if split is not None:  # (A*d + c) % d = c % d
            return Poly.const(split[1] % other.constant)
        return Poly.atom(("%", self, other))

    def _split_constant(self, other: "Poly") -> tuple["Poly", int] | None:
        """(A, c) with self == A*d + c, for a constant d > 0 dividing every non-constant coefficient."""
        if not other.is_const or other.constant <= 0:
            return None
        d, rest, terms = other.constant, 0, {}
        for mono, coeff in self.terms:
            if not mono:
                rest = coeff
            elif coeff % d:
                return None
            else:
                terms[mono] = coeff // d
        return Poly._from_dict(terms), rest

    @staticmethod
    def atom(atom: Atom) -> "Poly":
        return Poly((((((atom, 1),)), 1),))

    # ----------------------------------------------------------------- query
    @property
    def is_const(self) -> bool:
        return all(not mono for mono, _ in self.terms)

    @property
    def constant(self) -> int:
        return sum(c for m, c in self.terms if not m)

    def as_symbol(self) -> str | None:
        """The symbol when this polynomial is exactly one symbol (then a pattern can bind it), else None."""
        if len(self.terms) == 1:
            mono, coeff = self.terms[0]
            if coeff == 1 and len(mono) == 1 and isinstance(mono[0][0], str) and mono[0][1] == 1:
                return mono[0][0]
        return None

    def symbols(self) -> set[str]:
        found: set[str] = set()
        for mono, _ in self.terms:
            for atom, _exp in mono:
                if isinstance(atom, str):
                    found.add(atom)
                else:
                    found |= atom[1].symbols() | atom[2].symbols()
        return found

    def evaluate(self, env: Mapping[str, int]) -> int:
        """The value for concrete symbols; floor division as Python's `//`."""
        total = 0
        for mono, coeff in self.terms:
            value = coeff
            for atom, exp in mono:
                value *= _eval_atom(atom, env) ** exp
            total += value
        return total

    def subst(self, env: Mapping[str, "Poly"]) -> "Poly":
        """Replace symbols by polynomials (and re-canonicalise)."""
        total = Poly.const(0)
        for mono, coeff in self.terms:
            value = Poly.const(coeff)
            for atom, exp in mono:
                if isinstance(atom, str):
                    base = env.get(atom, Poly.sym(atom))
                else:
                    num, den = atom[1].subst(env), atom[2].subst(env)
                    base = num.floordiv(den) if atom[0] == "//" else num.mod(den)
                for _ in range(exp):
                    value = value * base
            total = total + value
        return total

    def content(self) -> int:
        """gcd of the coefficients (0 for the zero polynomial)."""
        result = 0
        for _, coeff in self.terms:
            result = gcd(result, coeff)
        return result

    # ------------------------------------------------------------- printing
    def __str__(self) -> str:
        if not self.terms:
            return "0"
        parts = []
        for index, (mono, coeff) in enumerate(sorted(self.terms, key=_print_order)):
            factors = []
            for atom, exp in mono:
                text = atom if isinstance(atom, str) else f"({atom[1]}){'/' if atom[0] == '//' else '%'}({atom[2]})"
                factors.extend([text] * exp)
            body = "*".join(factors)
            magnitude = abs(coeff)
            if not body:
                term = str(magnitude)
            elif magnitude == 1:
                term = body
            else:
                term = f"{magnitude}*{body}"
            if index == 0:
                parts.append(term if coeff > 0 else f"-{term}")
            else:
                parts.append(("+ " if coeff > 0 else "- ") + term)
        return " ".join(parts)

    def __repr__(self) -> str:
        return f"Poly({self})"


def _print_order(term) -> tuple:
    mono, _ = term
    return (-sum(e for _, e in mono), repr(mono))


def _lift(value: "Poly | int") -> Poly:
    return value if isinstance(value, Poly) else Poly.const(value)


def _eval_atom(atom: Atom, env: Mapping[str, int]) -> int:
    if isinstance(atom, str):
        if atom not in env:
            raise KeyError(atom)
        return int(env[atom])
    num, den = atom[1].evaluate(env), atom[2].evaluate(env)
    if den == 0:
        raise ZeroDivisionError(f"division by zero in {atom[1]} {atom[0]} {atom[2]}")
    return num // den if atom[0] == "//" else num % den


ONE = Poly.const(1)
ZERO = Poly.const(0)
