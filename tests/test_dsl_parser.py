"""The parser: structure of what it reads, and positions of what it refuses."""

from __future__ import annotations

from fractions import Fraction

import pytest

from parsat.dsl import ast
from parsat.dsl.errors import DslError
from parsat.dsl.parser import parse


def test_op_declaration_structure():
    module = parse("op matmul(a: [m, k], b: [k, n]) -> [m, n]\n  out[i, j] = sum(l < k) a[i, l] * b[l, j]\n")
    (op,) = module.ops
    assert op.name == "matmul"
    assert [p.name for p in op.params] == ["a", "b"]
    assert isinstance(op.body, ast.Sum)
    # the sum's body extends over the product
    assert isinstance(op.body.body, ast.BinOp) and op.body.body.op == "*"


def test_sum_body_stops_at_plus():
    module = parse("op f(x: [n], b: [n]) -> [n]\n  out[i] = sum(l < n) x[l] * x[i] + b[i]\n")
    body = module.ops[0].body
    assert isinstance(body, ast.BinOp) and body.op == "+"
    assert isinstance(body.left, ast.Sum)


def test_rule_with_where_and_variadics():
    module = parse("""
rule r:
  forall x: [*a, n, *b], p: degree
  where n % p == 0, p >= 1
  relu(partition(x, len(a), p)) => partition(relu(x), len(a), p)
""")
    (rule,) = module.rules
    assert [b.name for b in rule.binders] == ["x", "p"]
    assert isinstance(rule.binders[0].type.dims[0], ast.Variadic)
    assert len(rule.where) == 2
    assert isinstance(rule.lhs.args[0].args[1], ast.Len)


def test_doc_comments_and_header():
    module = parse("# file header\n\n# what f is for\nop f(x: [n]) -> [n]\n  out[i] = x[i]\n")
    assert module.header == ("file header",)
    assert module.ops[0].doc == ("what f is for",)


def test_comment_without_blank_line_is_doc_not_header():
    module = parse("# what f is for\nop f(x: [n]) -> [n]\n  out[i] = x[i]\n")
    assert module.header == ()
    assert module.ops[0].doc == ("what f is for",)


def test_rewrite_arrow_is_not_assignment():
    # a lexer that reads 'w =>' as '=' '>' would fail here (the parser's lexer="basic")
    module = parse("rule r:\n  forall w: [n]\n  relu(w)=>relu(w)\n")
    assert module.rules[0].rhs == ast.Call("relu", (ast.Name("w"),))


def test_real_literals():
    module = parse("op f(x: [n]) -> [n]\n  out[i] = 0.5 * x[i] + 1e-5\n")
    body = module.ops[0].body
    assert body.right == ast.Num(Fraction("1e-5"))  # exact, as written


@pytest.mark.parametrize(
    "source, line, column, fragment",
    [
        ("op f(x: [m]) -> [m]\n  out[i] = x[i] +\n", 2, 18, "unexpected end of file"),
        ("rule r:\n  forall x: [m]\n  relu(x => x\n", 3, 10, "unexpected '=>'; expected one of ')', ','"),
        ("op f(x: [m]) -> [m] out[i] = x[i] @ 2\n", 1, 35, "unexpected character '@'"),
        ("rule 3r:\n", 1, 6, "unexpected '3'"),
        ("op f(x: [m]) -> [m]\n  out[i] = x[i]\nrule\n", 3, 5, "unexpected end of file; expected a name"),
        ("rule r:\n  forall x: [m]\n  where\n  relu(x) => x\n", 4, 11, "unexpected '=>'"),
    ],
)
def test_syntax_errors_have_position_line_and_caret(source, line, column, fragment):
    with pytest.raises(DslError) as caught:
        parse(source, "bad.rule")
    diagnostic = caught.value.first
    assert (diagnostic.span.line, diagnostic.span.column) == (line, column)
    assert fragment in diagnostic.message
    rendered = str(caught.value)
    assert rendered.startswith(f"bad.rule:{line}:{column}: error: ")
    caret_line = rendered.splitlines()[2]
    assert caret_line.index("^") == 2 + column - 1  # two spaces of indent, then the column


def test_keywords_named_in_messages():
    with pytest.raises(DslError) as caught:
        parse("rule r:\n  relu(x) => x\n", "bad.rule")
    assert "expected 'forall'" in caught.value.first.message
