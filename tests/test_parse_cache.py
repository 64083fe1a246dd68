"""The parse cache (`dsl.parse_cache`): a file's module read back equals a fresh parse, an entry that is not
a parse of the same text and name is parsed again, a planted pickle runs nothing, a syntax error is never kept."""

from __future__ import annotations

import os
import pickle

import pytest

from parsat.dsl.errors import DslError
from parsat.dsl.parse_cache import _entry, parse_cached, parse_key
from parsat.dsl.parser import parse

TEXT = """op twice(a: [n]) -> [n]
  out[i] = a[i] + a[i]
"""


def test_a_module_read_back_equals_a_fresh_parse(tmp_path):
    first = parse_cached(TEXT, "a.rule", tmp_path)
    assert _entry(parse_key(TEXT, "a.rule"), tmp_path).is_file()
    again = parse_cached(TEXT, "a.rule", tmp_path)
    assert again == first == parse(TEXT, "a.rule")


def test_the_name_diagnostics_show_is_part_of_the_key(tmp_path):
    parse_cached(TEXT, "a.rule", tmp_path)
    other = parse_cached(TEXT, "b.rule", tmp_path)
    assert other.path == "b.rule"


def test_an_entry_of_another_key_is_parsed_again(tmp_path):
    key = parse_key(TEXT, "a.rule")
    entry = _entry(key, tmp_path)
    entry.parent.mkdir(parents=True)
    stale = parse("op once(a: [n]) -> [n]\n  out[i] = a[i]\n", "a.rule")
    entry.write_bytes(pickle.dumps(("another key", stale)))
    assert parse_cached(TEXT, "a.rule", tmp_path) == parse(TEXT, "a.rule")


class _Planted:
    def __reduce__(self):
        return (os.system, ("touch planted_ran",))


def test_a_planted_pickle_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    key = parse_key(TEXT, "a.rule")
    entry = _entry(key, tmp_path)
    entry.parent.mkdir(parents=True)
    entry.write_bytes(pickle.dumps((key, _Planted())))
    assert parse_cached(TEXT, "a.rule", tmp_path) == parse(TEXT, "a.rule")
    assert not (tmp_path / "planted_ran").exists()


def test_a_syntax_error_is_never_kept(tmp_path):
    bad = "op twice(a: [n]) -> [n]\n  out[i] = a[i] +\n"
    for _ in range(2):
        with pytest.raises(DslError):
            parse_cached(bad, "bad.rule", tmp_path)
    assert not (tmp_path / "parsed").exists() or not any((tmp_path / "parsed").iterdir())
