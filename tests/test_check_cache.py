"""A library that checked clean is remembered by its content: the next load parses it and skips the check."""

from __future__ import annotations

import pytest

from parsat.dsl import checker
from parsat.dsl.check_cache import known_clean, library_key
from parsat.dsl.errors import DslError
from parsat.dsl.library import load_library

RULES = '''import "ops.rule"

rule relu_twice:
  forall x: [n]
  relu(relu(x)) => relu(x)
'''


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """Every semantic check counted; the cache in a folder of the test's own."""
    monkeypatch.setenv("PARSAT_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = checker.check_library

    def counting(library, progress=None):
        calls.append(library)
        return real(library, progress)

    monkeypatch.setattr(checker, "check_library", counting)
    return calls


def test_a_clean_library_is_checked_once_then_read_from_the_cache(counted, tmp_path):
    path = tmp_path / "mine.rule"
    path.write_text(RULES, encoding="utf-8")
    first = checker.load_checked([path])
    assert len(counted) == 1 and known_clean(first)
    second = checker.load_checked([path])
    assert len(counted) == 1                           # not checked again
    assert [r.name for r in second.rules] == [r.name for r in first.rules]


def test_an_edited_file_or_a_broken_one_is_checked_again(counted, tmp_path):
    path = tmp_path / "mine.rule"
    path.write_text(RULES, encoding="utf-8")
    before = library_key(load_library([path])[0])
    checker.load_checked([path])
    path.write_text(RULES.replace("relu(relu(x)) => relu(x)", "relu(relu(x)) => relu(relu(relu(x)))"),
                    encoding="utf-8")
    assert library_key(load_library([path])[0]) != before
    checker.load_checked([path])
    assert len(counted) == 2                           # new content: checked
    path.write_text(RULES.replace("relu(relu(x)) => relu(x)", "relu(x) => sigmoid(y)"), encoding="utf-8")
    for _ in range(2):                                 # an error is never remembered as clean
        with pytest.raises(DslError):
            checker.load_checked([path])
    assert len(counted) == 4


def test_a_cache_folder_that_cannot_be_written_only_costs_the_check(counted, tmp_path, monkeypatch):
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("x", encoding="utf-8")
    monkeypatch.setenv("PARSAT_CACHE_DIR", str(blocked))
    path = tmp_path / "mine.rule"
    path.write_text(RULES, encoding="utf-8")
    checker.load_checked([path])
    checker.load_checked([path])
    assert len(counted) == 2
