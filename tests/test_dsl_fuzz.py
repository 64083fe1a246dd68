"""Hostile `.rule` input: parsat answers with its own positioned error, or accepts.

Never another exception, a hang, or a stack trace. Valid files are
generated from a small grammar, then mutated (truncated, tokens replaced,
bytes inserted); pathological files (deep nesting, huge numbers, unicode,
empty, self and cyclic imports) are tried directly.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parsat.dsl.checker import check_paths
from parsat.dsl.errors import DslError
from parsat.dsl.parser import parse

NAMES = ["x", "w", "y", "m", "k", "n", "p", "a"]
OPS = ["relu", "matmul", "add", "softmax", "partition", "combine", "replicate", "reduce", "transpose", "concat"]
TOKENS = ["(", ")", "[", "]", ",", ":", "=>", "->", "=", "==", "<", "*", "/", "%", "+", "-", "rule", "op",
          "forall", "where", "out", "sum", "if", "then", "else", "len", "degree", "int", "real", "0", "1",
          "99999999999999999999999", "é", "\u2028", "\x00", "#", '"', "import", "\t", "\n"]


@st.composite
def terms(draw, depth=0):
    if depth > 3 or draw(st.booleans()):
        return draw(st.sampled_from(["x", "w", "y"]))
    op = draw(st.sampled_from(OPS))
    arity = draw(st.integers(1, 3))
    args = [draw(terms(depth + 1))] + [draw(st.sampled_from(["0", "1", "p", "len(a)", "k"])) for _ in range(arity - 1)]
    return f"{op}({', '.join(args)})"


@st.composite
def rule_files(draw):
    rules = []
    for index in range(draw(st.integers(0, 3))):
        shape = draw(st.sampled_from(["[m, k]", "[k, n]", "[*a, n]", "[m]", "[]"]))
        where = draw(st.sampled_from(["", "  where m % p == 0\n", "  where p > m, m > p\n", "  where n >= 1\n"]))
        rules.append(f"rule r{index}:\n  forall x: {shape}, w: [k, n], y: [m, k], p: degree\n{where}"
                     f"  {draw(terms())} => {draw(terms())}\n")
    return 'import "ops.rule"\n\n' + "\n".join(rules)


def mutate(text: str, rng: random.Random) -> str:
    choice = rng.randrange(4)
    if choice == 0 and text:
        return text[: rng.randrange(len(text))]
    if choice == 1:
        position = rng.randrange(len(text) + 1)
        return text[:position] + rng.choice(TOKENS) + text[position:]
    if choice == 2 and text:
        position = rng.randrange(len(text))
        return text[:position] + text[position + 1:]
    return text


def _check_text(tmp_path, text: str) -> None:
    path = tmp_path / "fuzz.rule"
    path.write_text(text, encoding="utf-8")
    report = check_paths([path])  # must not raise
    for diagnostic in report.diagnostics:
        rendered = diagnostic.render()
        assert "Traceback" not in rendered
        if diagnostic.span is not None:
            assert rendered.startswith(f"{diagnostic.span.file}:{diagnostic.span.line}:{diagnostic.span.column}: ")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=rule_files(), seed=st.integers(0, 2**32 - 1), rounds=st.integers(0, 3))
def test_generated_and_mutated_files_never_crash(tmp_path, text, seed, rounds):
    rng = random.Random(seed)
    for _ in range(rounds):
        text = mutate(text, rng)
    _check_text(tmp_path, text)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.sampled_from(TOKENS + NAMES + OPS), max_size=40))
def test_token_soup_parses_or_fails_with_a_position(tokens):
    text = " ".join(tokens)
    try:
        parse(text, "soup.rule")
    except DslError as err:
        span = err.first.span
        assert span is not None and span.line >= 1 and span.column >= 1


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n\n",
        "# only a comment",
        "rule",
        "op f(x: [99999999999999999999999999]) -> [99999999999999999999999999]\n  out[i] = x[i]\n",
        'import "ops.rule"\nrule r:\n  forall x: [m, n], p: degree\n  relu(partition(x, 99999999999999999999, p)) => relu(x)\n',
        'import "ops.rule"\nrule r:\n  forall x: [m, n]\n  softmax(x, 99999999999999999999) => softmax(x, 0)\n',
        "rule r\u00e9:\n  forall x: [m]\n  relu(x) => x\n",
        "op f(x: [n]) -> [n]\n  out[i] = x[i] \u2264 0\n",
        "op f(x: [n]) -> [n]\n  out[i] = x[i] / 0\n",
        "op f(x: [n]) -> [n / 0]\n  out[i] = x[i]\n",
        "op f(x: [n], y: [n % 0]) -> [n]\n  out[i] = x[i]\n",
        'import "fuzz.rule"\n',
        "op f(x: [n]) -> [n]\n  out[i] = " + "(" * 3000 + "x[i]" + ")" * 3000 + "\n",
        "op f(x: [n]) -> [n]\n  out[i] = " + "-" * 3000 + "x[i]\n",
        "op f(x: [n]) -> [n]\n  out[i] = x[i]" + " + x[i]" * 3000 + "\n",
        'import "ops.rule"\nrule r:\n  forall x: [m]\n  ' + "relu(" * 2000 + "x" + ")" * 2000 + " => x\n",
    ],
    ids=lambda t: repr(t[:30]),
)
def test_pathological_files(tmp_path, text):
    _check_text(tmp_path, text)


def test_import_cycle_between_three_files(tmp_path):
    (tmp_path / "a.rule").write_text('import "b.rule"\n')
    (tmp_path / "b.rule").write_text('import "c.rule"\n')
    (tmp_path / "c.rule").write_text('import "a.rule"\n')
    report = check_paths([tmp_path])
    assert any("import cycle: a.rule -> b.rule -> c.rule -> a.rule" in d.message for d in report.diagnostics)


def test_deep_but_allowed_nesting_checks_cleanly(tmp_path):
    from parsat.dsl.parser import MAX_NESTING

    depth = MAX_NESTING - 10
    text = 'import "ops.rule"\nrule r:\n  forall x: [m]\n  ' + "relu(" * depth + "x" + ")" * depth + \
           " => " + "relu(" * depth + "x" + ")" * depth + "\n"
    path = tmp_path / "deep.rule"
    path.write_text(text)
    assert check_paths([path]).diagnostics == []


def test_too_deep_nesting_is_a_positioned_error():
    with pytest.raises(DslError) as caught:
        parse("op f(x: [n]) -> [n]\n  out[i] = " + "-" * 500 + "x[i]\n", "deep.rule")
    assert caught.value.first.kind == "nesting"
    assert str(caught.value).startswith("deep.rule:2:")
