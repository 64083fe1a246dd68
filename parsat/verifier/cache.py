"""Verdicts cached by what they depend on, and checked again when read.

What a key covers: the verifier's version, a hash of the verifier's own
code and of the DSL code it runs (`code_hash`: every `.py` under
`verifier/` and `dsl/`, and the grammar), the work budget (`rlimit`: a
verdict is a function of the rule and its budget, so an entry is what a
fresh run under the same budget would say), the rule's canonical text and
the canonical text of every operator it uses (docs left out: a comment
never changes a verdict). Change any of them and the old entry is never
looked up again.

What a read checks (`validate`): the file parses, names the key it is
stored under, its checksum matches its content, its verdict is one of
the six words and has the evidence that word needs (PROVED: no
counterexample and no bound; BOUNDED: a bound, no counterexample;
VACUOUS, ILLEGAL and UNKNOWN: a reason, no counterexample on the first
two; REFUTED: a counterexample, which the caller
replays on the devices before trusting it, `api.verify_library`). An
entry that fails any check is ignored, reported, and recomputed.

What it trusts: a PROVED, BOUNDED or VACUOUS entry that passes those
checks is believed without proving again; that is what a cache is for.
The checksum catches corruption and hand edits of a field; it is not a
signature (anyone who can write the folder can write a consistent
entry), so the cache folder must be as trusted as the code. Use
`--no-cache` (or a fresh `PARSAT_CACHE_DIR`) when it is not. docs/CACHE.md
says the same for users.

One JSON file per key, written atomically, so parallel workers and
concurrent runs never see half a file. An UNKNOWN the wall clock cut is
never stored (`api.verify_library`); one reached under a shorter timeout
than the one asked for now is not reused.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from parsat.dsl import ast
from parsat.dsl.files import FileProblem, cache_dir, read_text_capped, write_atomic
from parsat.dsl.printer import format_decl
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.verifier.limits import DEFAULT_RLIMIT
from parsat.verifier.verdict import BOUNDED, ILLEGAL, PROVED, REFUTED, UNKNOWN, VACUOUS, VERDICTS, Verdict

FORMAT = 2


def default_dir() -> Path:
    """`$PARSAT_CACHE_DIR`, else `~/.cache/parsat` (`dsl.files.cache_dir`)."""
    return cache_dir()


@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """A hash of the code a verdict depends on: the verifier's and the DSL's sources."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for folder in ("verifier", "dsl"):
        for path in sorted((root / folder).glob("*")):
            if path.suffix in (".py", ".lark") and path.is_file():
                digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def used_ops(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl]) -> list[ast.OpDecl]:
    names = {n.func for side in (rule.lhs, rule.rhs) for n in ast.walk(side) if isinstance(n, ast.Call)}
    return [ops[n] for n in sorted(names) if n in ops and n not in PARALLEL_OPS]


def rule_key(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], version: str, rlimit: int = DEFAULT_RLIMIT) -> str:
    """The key of a rule's verdict under a work budget (what the module docstring lists)."""
    parts = [version, code_hash(), f"rlimit={rlimit}", format_decl(replace(rule, doc=()))]
    parts += [format_decl(replace(op, doc=())) for op in used_ops(rule, ops)]
    return hashlib.sha256("\n\0".join(parts).encode("utf-8")).hexdigest()


def _checksum(key: str, timeout: float, verdict: dict) -> str:
    text = json.dumps({"key": key, "timeout": timeout, "verdict": verdict}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def validate(verdict: Verdict) -> str:
    """Why this verdict cannot be what it says ('' when its word and evidence agree)."""
    if verdict.verdict not in VERDICTS:
        return f"unknown verdict word {verdict.verdict!r}"
    cex = verdict.counterexample
    if verdict.verdict in (PROVED, BOUNDED, VACUOUS, ILLEGAL) and cex is not None:
        return f"a {verdict.verdict} verdict with a counterexample"
    if verdict.verdict == PROVED and verdict.max_rank is not None:
        return "a PROVED verdict with a rank bound"
    if verdict.verdict == BOUNDED and not (isinstance(verdict.max_rank, int) and verdict.max_rank >= 0):
        return "a BOUNDED verdict without its rank bound"
    if verdict.verdict != BOUNDED and verdict.max_rank is not None:
        return f"a {verdict.verdict} verdict with a rank bound"
    if verdict.verdict in (VACUOUS, ILLEGAL, UNKNOWN, REFUTED) and not verdict.reason:
        return f"a {verdict.verdict} verdict without a reason"
    if verdict.verdict == REFUTED and (cex is None or not cex.reason):
        return "a REFUTED verdict without a counterexample"
    return ""


ENTRY_BYTES = 1 << 20   # the largest cache entry read (a verdict with its counterexample is a few KB)


class VerdictCache:
    """Get and put verdicts under a folder; `problems` lists the entries ignored on read."""

    def __init__(self, folder: Path | str | None = None):
        self.folder = Path(folder) if folder is not None else default_dir()
        self.problems: list[str] = []

    def _path(self, key: str) -> Path:
        return self.folder / "verify" / key[:2] / f"{key}.json"

    def get(self, key: str, timeout: float) -> Verdict | None:
        """The cached verdict if the entry is sound (else None; a bad entry is added to `problems`)."""
        try:  # an entry is a few KB; anything larger, or not a regular file, is not one parsat wrote
            text = read_text_capped(self._path(key), ENTRY_BYTES, "verdict cache")
        except (FileProblem, OSError):
            return None
        try:
            record = json.loads(text)
            if not isinstance(record, dict) or record.get("format") != FORMAT:
                raise ValueError("not a verdict record of this format")
            if record.get("key") != key:
                raise ValueError("stored under another key")
            if record.get("checksum") != _checksum(key, record["timeout"], record["verdict"]):
                raise ValueError("its checksum does not match its content (edited or corrupt)")
            verdict = Verdict.from_json(record["verdict"])
            problem = validate(verdict)
            if problem:
                raise ValueError(problem)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
            self.reject(key, str(err))
            return None
        cached = record.get("timeout") if isinstance(record, dict) else None
        if verdict.verdict == UNKNOWN and not (isinstance(cached, (int, float)) and cached >= timeout):
            return None
        return verdict

    def reject(self, key: str, why: str) -> None:
        """Report an entry that cannot be trusted, and remove it so that it is recomputed."""
        self.problems.append(f"ignored the cached verdict {self._path(key)}: {why}")
        try:
            self._path(key).unlink()
        except OSError:
            pass

    def put(self, key: str, verdict: Verdict, timeout: float) -> None:
        if validate(verdict) or not math.isfinite(timeout):
            return  # never store what could not be read back; NaN or infinity says under no timeout
        path = self._path(key)
        record = verdict.to_json()
        entry = {"format": FORMAT, "key": key, "timeout": timeout, "verdict": record,
                 "checksum": _checksum(key, timeout, record)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(entry))
        except (OSError, FileProblem):
            pass  # a cache that cannot be written only costs time
