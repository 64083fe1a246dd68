"""Shared fixtures: helpers to write .rule files and check them."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from parsat.dsl.checker import check_paths


@pytest.fixture
def write_rules(tmp_path: Path):
    """Write a .rule file (dedented) and return its path."""

    def write(text: str, name: str = "t.rule") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
        return path

    return write


@pytest.fixture
def diagnostics(write_rules):
    """Check a snippet (with the shipped operators imported) and return its diagnostics."""

    def run(text: str):
        path = write_rules('import "ops.rule"\n' + textwrap.dedent(text).lstrip("\n"))
        return check_paths([path]).diagnostics

    return run
