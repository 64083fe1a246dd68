"""The printer gives canonical source that parses back to the same tree."""

from __future__ import annotations

import pytest

from parsat.dsl import ast
from parsat.dsl.library import rule_files, shipped_rules_dir
from parsat.dsl.parser import parse, parse_file
from parsat.dsl.printer import format_expr, format_module


@pytest.mark.parametrize("path", rule_files([shipped_rules_dir()]), ids=lambda p: p.name)
def test_every_shipped_file_round_trips(path):
    module = parse_file(str(path))
    text = format_module(module)
    assert parse(text, str(path)) == module
    assert format_module(parse(text)) == text  # canonical: printing is a fixed point


def _expr(source: str) -> ast.Expr:
    return parse(f"op f(x: [n], y: [n]) -> [n]\n  out[i] = {source}\n").ops[0].body


@pytest.mark.parametrize(
    "source",
    [
        "(sum(l < n) x[l]) * y[i]",        # a sum that ends a left operand of '*' keeps its parentheses
        "sum(l < n) x[l] * y[i]",
        "-(sum(l < n) x[l]) / n",
        "x[i] - (y[i] - x[i])",
        "x[i] / (y[i] * x[i])",
        "(if i < 2 then x[i] else 0) * y[i]",
        "if i < 2 and not i == 0 or i > 3 then x[i] else -y[n - 1 - i]",
        "max(x[i], 0) + exp(-x[i]) * 0.5 + 1e-05",
        "x[(i + 1) % n] * 2",
        "sum(l < n) sum(r < n) x[l] * y[r]",
    ],
)
def test_expressions_round_trip(source):
    tree = _expr(source)
    printed = format_expr(tree)
    assert _expr(printed) == tree, printed


def test_parenthesized_sum_is_not_swallowed():
    tree = _expr("(sum(l < n) x[l]) * y[i]")
    assert isinstance(tree, ast.BinOp) and isinstance(tree.left, ast.Sum)
    assert format_expr(tree) == "(sum(l < n) x[l]) * y[i]"


def test_module_layout_is_canonical():
    source = "#  head\n\n#doc\nrule   r :  forall x:[m,n] where m>0 relu( x )=>relu(x)\n"
    text = format_module(parse(source))
    # a comment keeps its own spacing after the printer's one space ("#  head"); "#doc" gains that space
    assert text == "#  head\n\n# doc\nrule r:\n  forall x: [m, n]\n  where m > 0\n  relu(x) => relu(x)\n"
