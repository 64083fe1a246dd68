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
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from parsat.dsl import ast
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


class VerdictCache:
    """Get and put verdicts under a folder."""

    def __init__(self, folder: Path | str | None = None):
        self.folder = Path(folder) if folder is not None else default_dir()

    def _path(self, key: str) -> Path:
        return self.folder / "verify" / key[:2] / f"{key}.json"

    def get(self, key: str, timeout: float) -> Verdict | None:
        try:
            record = json.loads(self._path(key).read_text(encoding="utf-8"))
            verdict = Verdict.from_json(record["verdict"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if verdict.verdict == UNKNOWN and record.get("timeout", 0) < timeout:
            return None
        return verdict

    def put(self, key: str, verdict: Verdict, timeout: float) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump({"timeout": timeout, "verdict": verdict.to_json()}, handle)
            os.replace(tmp, path)
        except OSError:
            pass  # a cache that cannot be written only costs time
