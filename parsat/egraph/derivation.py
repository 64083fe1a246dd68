"""What one rule application read and built, worked out from the match it recorded.

Every applying half of a rule records the match it applied, `Applied<index>(variables...)`
(`rule_text.RuleBody.text`), with the pattern's variables: the root class, the metavariables' classes, the
attributes it bound. The e-graph is hash-consed, so those values fix the application's e-nodes: walking the
pattern bottom-up, each constructor over known children and attributes is one e-node of the snapshot (what
the match READ); walking the actions' `let`s in order, each is one e-node (what it BUILT). A plan's
`rules_used` follows these back from the plan's e-nodes to the input graph's (`search.provenance`).

The generated text is small and regular (`rule_text`, `lifted_text`): constructors `Op_*`, `P_*` and
`Leaf`, variables (`root`, `m_*` tensors, `r_*` reals, the rest integers), integer and string literals, and
on the right i64 expressions over `+ - * / %`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from parsat.egraph.rule_text import RuleBody
from parsat.egraph.snapshot import Application, ENode

_TOKEN = re.compile(r'\s*(?:(\()|(\))|("(?:[^"\\]|\\.)*")|([^\s()"]+))')
_ARITH = {"+", "-", "*", "/", "%"}


@dataclass(frozen=True)
class Literal:
    """A string constant of the generated text (a real attribute, a leaf's name), unquoted."""

    text: str


def parse(text: str) -> list:
    """The s-expressions of `text`: nested lists of symbols (str), ints and `Literal`s."""
    stack: list[list] = [[]]
    for opening, closing, string, atom in _TOKEN.findall(text):
        if opening:
            stack.append([])
        elif closing:
            done = stack.pop()
            stack[-1].append(done)
        elif string:
            stack[-1].append(Literal(re.sub(r"\\(.)", r"\1", string[1:-1])))
        elif atom:
            stack[-1].append(int(atom) if re.fullmatch(r"-?\d+", atom) else atom)
    return stack[0]


def op_of(constructor: str) -> str:
    """The snapshot's operator name of an egglog constructor (`Op_matmul` -> matmul, `Leaf` -> leaf)."""
    return "leaf" if constructor == "Leaf" else constructor.split("_", 1)[1]


def _is_tensor(name: str) -> bool:
    return name == "root" or name.startswith(("m_", "t"))


@dataclass(frozen=True)
class Template:
    """A compiled rule's pattern and the terms its actions build, parsed once."""

    rule: str
    variables: tuple[str, ...]   # the columns of `Applied<index>`, in order
    pattern: list   # the constructor term matched at `root`
    lets: tuple[tuple[str, list], ...]   # (variable, constructor term) in the actions' order

    @staticmethod
    def of(rule: str, body: RuleBody) -> "Template":
        """A compiled rule's body: its pattern is `(= root TERM)`, its actions the applying half's."""
        (_eq, _root, term), = parse(body.pattern)
        lets = tuple((form[1], form[2]) for form in parse(body.actions) if form and form[0] == "let")
        return Template(rule, tuple(name for name, _sort in body.applied_variables()), term, lets)

    def application(self, values: Mapping[str, object], classes: Mapping[ENode, int]) -> Application | None:
        """The application of this rule to the match `values` (variable -> value), or None when one of its
        e-nodes is not in the snapshot (`classes`, e-node -> class)."""
        reads: list[ENode] = []
        found = dict(values)
        if _walk(self.pattern, found, classes, reads) != values.get("root"):
            return None
        builds: list[ENode] = []
        for var, term in self.lets:
            cid = _walk(term, found, classes, builds, top_only=True)
            if cid is None:
                return None
            found[var] = cid
        return Application(self.rule, tuple(dict.fromkeys(reads)), tuple(dict.fromkeys(builds)))


def _walk(term: list, values: dict, classes: Mapping[ENode, int], out: list[ENode],
          top_only: bool = False) -> int | None:
    """The class of constructor `term` under `values`, its e-nodes appended to `out` (children first); a
    nested list is a sub-pattern, or with `top_only` (the right side, whose terms are `let`s) an i64
    expression."""
    children: list[int] = []
    attrs: list = []
    for arg in term[1:]:
        if isinstance(arg, list) and not top_only:
            child = _walk(arg, values, classes, out)
            if child is None:
                return None
            children.append(child)
        elif isinstance(arg, list):
            attrs.append(evaluate(arg, values))
        elif isinstance(arg, Literal):
            attrs.append(arg.text)
        elif isinstance(arg, int):
            attrs.append(arg)
        elif _is_tensor(arg):
            children.append(values[arg])
        else:
            attrs.append(values[arg])
    node = ENode(op_of(term[0]), tuple(children), tuple(attrs))
    cid = classes.get(node)
    if cid is not None:
        out.append(node)
    return cid


def evaluate(expr, values: Mapping[str, object]) -> int:
    """An i64 expression of the generated text, as egglog computes it (division and remainder truncate
    toward zero, as Rust's do)."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, str):
        return int(values[expr])
    op, *args = expr
    if op not in _ARITH:
        raise ValueError(f"not an i64 expression: {expr}")
    left, *rest = (evaluate(a, values) for a in args)
    if op == "-" and not rest:
        return -left
    for right in rest:
        if op == "+":
            left += right
        elif op == "-":
            left -= right
        elif op == "*":
            left *= right
        else:
            quotient = abs(left) // abs(right) * (1 if (left >= 0) == (right >= 0) else -1)
            left = quotient if op == "/" else left - quotient * right
    return left


def applications(template: Template, rows: Sequence[Sequence[object]],
                 classes: Mapping[ENode, int]) -> list[Application]:
    """The applications of one compiled rule, one per recorded match (its `Applied` row's values, in the
    template's `variables` order) whose e-nodes the snapshot holds."""
    out = []
    for row in rows:
        found = template.application(dict(zip(template.variables, row)), classes)
        if found is not None:
            out.append(found)
    return out
