"""Parsed `.rule` files, remembered by their content, so a later load skips Lark.

Every `parsat optimize` loads the shipped library, and parsing its files
with Lark is most of a small model's start (1.5 CPU s of `parsat optimize
mlp`'s 4.3 on the 2-core box, where reading the parsed modules back takes
0.2). A file is parsed once per content: its module is kept under a key
made of its text, the name its diagnostics show, and the parser (every
`.py` and the grammar of `parsat/dsl`: `dsl_code_hash`), as a pickle under
`$PARSAT_CACHE_DIR/parsed` (default `~/.cache/parsat`), written atomically.

Why it can be trusted again: the module is a pure function of that key,
and an entry names its key inside, so a stale, renamed or edited entry is
only parsed again. An entry is read with an unpickler that builds nothing
but the AST's own classes (`parsat.dsl.ast`), `Fraction` and plain
containers: a planted file cannot run code. A file that does not parse is
never remembered (its diagnostics come from the parser every time), and
a folder that cannot be written only costs the parse.
"""

from __future__ import annotations

import functools
import hashlib
import io
import pickle
from pathlib import Path

from parsat.dsl import ast
from parsat.dsl.files import FileProblem, cache_dir, read_capped, write_atomic
from parsat.dsl.parser import parse

FORMAT = 1
ENTRY_BYTES = 64 * 2**20   # a parsed file's pickle is ~4x its text; the library's text is capped far below
_ALLOWED = {("fractions", "Fraction")}


@functools.lru_cache(maxsize=1)
def dsl_code_hash() -> str:
    """A hash of the code parsing and checking depend on: the dsl package's sources and grammar."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*")):
        if path.suffix in (".py", ".lark") and path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def parse_key(text: str, path: str) -> str:
    """What a parse of `text` shown as `path` is valid for: both, and the parser's code."""
    payload = f"{FORMAT}\0{dsl_code_hash()}\0{path}\0".encode() + text.encode("utf-8")
    return hashlib.sha256(payload).hexdigest()


class _AstUnpickler(pickle.Unpickler):
    """Builds only the AST's classes, `Fraction` and builtin containers (the module docstring)."""

    def find_class(self, module: str, name: str):
        if module == ast.__name__ or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a parsed .rule file")


def _entry(key: str, folder: Path | None) -> Path:
    return (folder or cache_dir()) / "parsed" / f"{key[:32]}.pickle"


def _read(key: str, path: Path) -> ast.Module | None:
    try:
        key_read, module = _AstUnpickler(io.BytesIO(read_capped(path, ENTRY_BYTES, "parse cache entry"))).load()
    except (FileProblem, OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, ImportError, MemoryError, RecursionError):
        return None
    return module if key_read == key and isinstance(module, ast.Module) else None


def parse_cached(text: str, path: str = "<string>", folder: Path | None = None) -> ast.Module:
    """`parser.parse(text, path)`, or the module a parse of the same text, name and parser left before.
    Raises `DslError` as `parse` does (a file that does not parse is parsed, and refused, every time)."""
    return _parse_once(text, path, folder or cache_dir())


@functools.lru_cache(maxsize=64)
def _parse_once(text: str, path: str, folder: Path) -> ast.Module:
    """The process remembers what it parsed or read back, by the same text, name and folder: every
    `optimize` loads the library again (a graph and a request each), and reading its modules back from
    the folder is ~0.1-0.2 CPU s of a small model's search. Safe to share: a module is frozen dataclasses."""
    key = parse_key(text, path)
    entry = _entry(key, folder)
    found = _read(key, entry)
    if found is not None:
        return found
    module = parse(text, path)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(entry, pickle.dumps((key, module), protocol=pickle.HIGHEST_PROTOCOL), durable=False)
    except (FileProblem, OSError, pickle.PicklingError, RecursionError):
        pass
    return module


__all__ = ["dsl_code_hash", "parse_cached", "parse_key"]
