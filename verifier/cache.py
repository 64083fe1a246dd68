"""Verdicts cached by what they depend on, so a warm `parsat verify` is instant.

The key hashes the verifier's version, the rule's canonical text and the
canonical text of every operator it uses (docs left out: a comment never
changes a verdict). One JSON file per key, written atomically, so parallel
workers and concurrent runs never see half a file. An UNKNOWN reached under
a shorter timeout than the one asked for now is not reused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from parsat.dsl import ast
from parsat.dsl.files import FileProblem, read_text_capped, write_atomic
from parsat.dsl.printer import format_decl
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.verifier.verdict import UNKNOWN, Verdict


def default_dir() -> Path:
    """`$PARSAT_CACHE_DIR`, else `~/.cache/parsat`."""
    env = os.environ.get("PARSAT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "parsat"


def used_ops(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl]) -> list[ast.OpDecl]:
    names = {n.func for side in (rule.lhs, rule.rhs) for n in ast.walk(side) if isinstance(n, ast.Call)}
    return [ops[n] for n in sorted(names) if n in ops and n not in PARALLEL_OPS]


def rule_key(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], version: str) -> str:
    parts = [version, format_decl(replace(rule, doc=()))]
    parts += [format_decl(replace(op, doc=())) for op in used_ops(rule, ops)]
    return hashlib.sha256("\n\0".join(parts).encode("utf-8")).hexdigest()


ENTRY_BYTES = 1 << 20   # the largest cache entry read (a verdict with its counterexample is a few KB)


class VerdictCache:
    """Get and put verdicts under a folder."""

    def __init__(self, folder: Path | str | None = None):
        self.folder = Path(folder) if folder is not None else default_dir()

    def _path(self, key: str) -> Path:
        return self.folder / "verify" / key[:2] / f"{key}.json"

    def get(self, key: str, timeout: float) -> Verdict | None:
        try:  # an entry is a few KB; anything larger, or not a regular file, is not one parsat wrote
            record = json.loads(read_text_capped(self._path(key), ENTRY_BYTES, "verdict cache"))
            verdict = Verdict.from_json(record["verdict"])
        except (FileProblem, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None
        cached = record.get("timeout") if isinstance(record, dict) else None
        if verdict.verdict == UNKNOWN and not (isinstance(cached, (int, float)) and cached >= timeout):
            return None
        return verdict

    def put(self, key: str, verdict: Verdict, timeout: float) -> None:
        if not math.isfinite(timeout):
            return  # an entry says under which timeout it was reached; NaN or infinity says nothing
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps({"timeout": timeout, "verdict": verdict.to_json()}))
        except (OSError, FileProblem):
            pass  # a cache that cannot be written only costs time
