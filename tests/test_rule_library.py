"""The shipped rewrite-rule library: counts, checks, docs, round-trip."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from parsat.dsl.checker import check_paths, is_parallel_rule
from parsat.dsl.library import rule_files, shipped_rules_dir
from parsat.dsl.parser import parse, parse_file
from parsat.dsl.printer import format_module

RULES = shipped_rules_dir()
SHIPPED = [p.name for p in rule_files([RULES])]


@pytest.fixture(scope="module")
def report():
    return check_paths([RULES])


def test_library_checks_without_errors(report):
    assert report.ok, "\n".join(d.render() for d in report.diagnostics)


def test_library_counts(report):
    counts = report.counts()
    assert counts["algebraic"] >= 40
    assert counts["parallel"] >= 60
    assert counts["errors"] == 0


def test_each_rule_file_has_the_right_kind_of_rules(report):
    for rule in report.library.rules:
        if rule.span.file.endswith("algebraic.rule"):
            assert not is_parallel_rule(rule), rule.name
        if rule.span.file.endswith("parallel.rule"):
            assert is_parallel_rule(rule), rule.name


def test_cli_check_reports_zero_errors():
    done = subprocess.run([sys.executable, "-m", "parsat", "check", str(RULES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    match = re.search(r"\((\d+) algebraic, (\d+) parallel\), (\d+) errors", summary)
    assert match, summary
    algebraic, parallel, errors = map(int, match.groups())
    assert algebraic >= 40 and parallel >= 60 and errors == 0


def test_every_rule_has_a_one_line_doc(report):
    missing = [r.name for r in report.library.rules if not r.doc or not r.doc[-1].strip()]
    assert missing == []


def test_rule_names_are_unique_snake_case(report):
    names = [r.name for r in report.library.rules]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", n) for n in names), names


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_file_has_a_header(name):
    module = parse_file(str(RULES / name))
    assert module.header, f"{name} has no header comment block"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_file_round_trips(name):
    module = parse_file(str(RULES / name))
    text = format_module(module)
    assert parse(text, module.path) == module
    assert format_module(parse(text, module.path)) == text
