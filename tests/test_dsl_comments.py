"""`parsat fmt` keeps every comment: in every shipped file, in every position, in generated placements (issue 20).

A comment is compared by its text, in file order (`comments.scan`): the
formatted file must hold the same sequence, format to itself again, and
parse to the same module (header, docs and the other comments' places
included in `Module.__eq__`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parsat.cli import main
from parsat.dsl.comments import scan
from parsat.dsl.library import rule_files, shipped_rules_dir
from parsat.dsl.parser import parse
from parsat.dsl.printer import format_module

ROOT = Path(__file__).resolve().parent.parent
# the generated files under benchmarks/ (~1,000 rules, 15 s) run with the slow tests
RULE_FILES = rule_files([shipped_rules_dir(), ROOT / "tests" / "wrong_rules", ROOT / "tests" / "rules_for_saturate"])
RULE_FILES += [pytest.param(path, marks=pytest.mark.slow) for path in rule_files([ROOT / "benchmarks"])]


def fmt(text: str) -> str:
    return format_module(parse(text))


def texts(text: str) -> list[str]:
    return [c.text for c in scan(text)]


def assert_keeps_comments(source: str) -> str:
    out = fmt(source)
    assert texts(out) == texts(source), f"comments changed:\n--- source\n{source}\n--- formatted\n{out}"
    assert fmt(out) == out, f"not a fixed point:\n{out}\n---\n{fmt(out)}"
    assert parse(out) == parse(source)
    return out


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: str(p.relative_to(ROOT)) if isinstance(p, Path) else None)
def test_fmt_write_keeps_every_comment_of_every_shipped_rule_file(path, tmp_path, capsys):
    copy = tmp_path / path.name
    shutil.copyfile(path, copy)
    before = copy.read_text(encoding="utf-8")
    assert main(["fmt", "--write", str(copy)]) == 0, capsys.readouterr().err
    after = copy.read_text(encoding="utf-8")
    assert scan(before), f"{path} has no comments: nothing is tested"
    assert texts(after) == texts(before)
    assert parse(after) == parse(before)
    assert main(["fmt", "--write", str(copy)]) == 0 and copy.read_text(encoding="utf-8") == after


EVERY_POSITION = '''\
# header line
#   indented header

import "ops.rule"  # trailing an import

# TODO: more rules
# rule old:
#   forall x: [n]
#   relu(x) => x

# doc of r
rule r:   # after the name
  # before forall
  forall x: [m, n]  # after the binders
  # before where
  where m > 0   # after the condition
  # before the body
  relu(x)   # after the left side
  # between the sides
  => relu(x)  # after the right side

#no space after the hash
op f(x: [n]) -> [n]  # after the signature

  # after a blank line, inside the op
  out[i] = x[i] # after the semantics
# the last comment of the file, right after a declaration'''


def test_a_file_with_comments_in_every_position_keeps_them_all():
    out = assert_keeps_comments(EVERY_POSITION)
    assert "#   indented header" in out and "#   forall x: [n]" in out       # their own spacing is kept
    assert out.rstrip().endswith("# the last comment of the file, right after a declaration")
    assert "  where m > 0  # after the condition" in out                   # a trailing comment stays trailing


def test_a_file_of_comments_only_keeps_them():
    for source in ("# only a comment", "# one\n\n# two\n", "#\n#\n", "# a\n\n\n"):
        assert_keeps_comments(source)


def test_fmt_does_not_write_a_file_it_cannot_parse(tmp_path, capsys):
    path = tmp_path / "bad.rule"
    path.write_text("# keep me\nrule r: forall x: [n] relu(x) =>\n", encoding="utf-8")
    assert main(["fmt", "--write", str(path)]) == 1
    assert path.read_text(encoding="utf-8") == "# keep me\nrule r: forall x: [n] relu(x) =>\n"


# ------------------------------------------------------------------ generated placements

# The source, one line per entry; comments and blank lines may go after any of them (and before the first).
LINES = [
    'import "ops.rule"',
    "rule r1:",
    "  forall x: [m, n], y: [m, n]",
    "  where m > 0",
    "  add(x,",
    "      y)",
    "  =>",
    "  add(y, x)",
    "op g(x: [n], c: int) -> [n]",
    "  where n > 0",
    '  out[i] = x[i] * c',
    "rule r2: forall x: [n] relu(relu(x)) => relu(x)",
]
EXAMPLES = int(os.environ.get("PARSAT_FUZZ_EXAMPLES", "150"))   # the nightly run sets 3000
COMMENT_TEXT = st.text(alphabet=st.characters(whitelist_categories=("L", "N", "P", "S"),
                                               whitelist_characters=" #\""), max_size=12)
GAP = st.lists(st.one_of(st.just(""), st.tuples(st.integers(0, 4), COMMENT_TEXT)), max_size=3)


@st.composite
def commented_files(draw) -> str:
    out: list[str] = []

    def gap() -> None:
        for item in draw(GAP):
            out.append("" if item == "" else " " * item[0] + "#" + item[1])

    gap()
    for line in LINES:
        trailing = draw(st.one_of(st.none(), COMMENT_TEXT))
        out.append(line if trailing is None else f"{line}  #{trailing}")
        gap()
    return "\n".join(out) + draw(st.sampled_from(["", "\n", "\n\n"]))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(commented_files())
def test_fmt_keeps_comments_wherever_they_are_placed(source):
    assert_keeps_comments(source)
