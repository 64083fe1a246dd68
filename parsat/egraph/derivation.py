"""What one rule application read and built, worked out from the match it recorded.

Every applying half of a rule records the match it applied, `(Applied_<sorts> index variables...)`
(`rule_text.RuleBody.text`, `encoding.applied_relation`), with the pattern's variables: the root class, the
metavariables' classes, the attributes it bound. The e-graph is hash-consed, so those values fix the
application's e-nodes: walking the pattern bottom-up, each constructor over known children and attributes is
one e-node of the snapshot (what the match READ); walking the actions' `let`s in order, each is one e-node
(what it BUILT). A plan's `rules_used` follows these back from the plan's e-nodes to the input graph's
(`search.provenance`).

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
    return name == "root" or name.startswith(("m_", "t", "_"))


CHILD, VARIABLE, CONSTANT, EXPRESSION = range(4)   # how a step finds one argument
Step = tuple[str, tuple[tuple[int, object], ...], str]   # (operator, arguments, variable its class is kept in)


@dataclass(frozen=True)
class Template:
    """A compiled rule's pattern and the terms its actions build, parsed once into steps: the pattern's
    constructors bottom-up (`reads` of them), then the actions' `let`s in order."""

    rule: str
    variables: tuple[str, ...]   # the columns of its `Applied` rows after the index, in order
    steps: tuple[Step, ...]
    reads: int

    @staticmethod
    def of(rule: str, body: RuleBody) -> "Template":
        """A compiled rule's body: its pattern is `(= root TERM)`, its actions the applying half's."""
        (_eq, _root, term), = parse(body.pattern)
        steps: list[Step] = []
        _pattern_steps(term, steps, "_top")
        reads = len(steps)
        for form in parse(body.actions):
            if form and form[0] == "let":
                steps.append((op_of(form[2][0]), tuple(_argument(arg, True) for arg in form[2][1:]), form[1]))
        return Template(rule, tuple(name for name, _sort in body.applied_variables()), tuple(steps), reads)

    def application(self, values: Mapping[str, object], classes: Mapping[tuple, tuple[int, ENode]]) -> Application | None:
        """The application of this rule to the match `values` (variable -> value), or None when one of its
        e-nodes is not in the snapshot (`classes`: `hashcons`)."""
        found = dict(values)
        nodes: list[ENode] = []
        for op, args, target in self.steps:
            children, attrs = [], []
            for kind, arg in args:
                if kind == CHILD:
                    children.append(found[arg])
                elif kind == VARIABLE:
                    attrs.append(found[arg])
                elif kind == CONSTANT:
                    attrs.append(arg)
                else:
                    attrs.append(evaluate(arg, found))
            held = classes.get((op, tuple(children), tuple(attrs)))
            if held is None:
                return None
            found[target], node = held
            nodes.append(node)
        if found["_top"] != values.get("root"):
            return None
        return Application(self.rule, tuple(dict.fromkeys(nodes[:self.reads])),
                           tuple(dict.fromkeys(nodes[self.reads:])))


def _pattern_steps(term: list, steps: list[Step], target: str) -> None:
    """The steps of a pattern term, children first; its class is kept in `target`."""
    args = []
    for arg in term[1:]:
        if isinstance(arg, list):
            inner = f"_p{len(steps)}_{len(args)}"
            _pattern_steps(arg, steps, inner)
            args.append((CHILD, inner))
        else:
            args.append(_argument(arg, False))
    steps.append((op_of(term[0]), tuple(args), target))


def _argument(arg, built: bool) -> tuple[int, object]:
    """How a step finds one argument: a tensor variable, another variable, a literal, or (on the right side,
    `built`) an i64 expression."""
    if isinstance(arg, list):
        if not built:
            raise ValueError(f"a nested pattern term here: {arg}")
        return EXPRESSION, arg
    if isinstance(arg, Literal):
        return CONSTANT, arg.text
    if isinstance(arg, int):
        return CONSTANT, arg
    return (CHILD if _is_tensor(arg) else VARIABLE), arg


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


def hashcons(classes: Mapping[int, Sequence[ENode]]) -> dict[tuple, tuple[int, ENode]]:
    """(operator, children, attributes) -> the e-node's class and the snapshot's own e-node: applications
    are found as plain tuples (cheap to hash) and hold the snapshot's e-nodes (cheap to compare)."""
    return {(node.op, node.children, node.attrs): (cid, node) for cid, nodes in classes.items() for node in nodes}


def applications(template: Template, rows: Sequence[Sequence[object]],
                 classes: Mapping[tuple, tuple[int, ENode]]) -> list[Application]:
    """The applications of one compiled rule, one per recorded match (its `Applied` row's values, in the
    template's `variables` order) whose e-nodes the snapshot holds."""
    out = []
    for row in rows:
        found = template.application(dict(zip(template.variables, row)), classes)
        if found is not None:
            out.append(found)
    return out
