"""Libraries that checked clean, remembered by their content, so a later load skips the semantic check.

Checking the shipped library (every rule typed at sampled ranks, each side's
degrees inferred: `checker.check_library`) takes about two CPU seconds, and
every `parsat optimize` loads the library. A library whose files (names and
text, `SourceCache.digest`) and whose checker (every `.py` and the grammar
of `parsat/dsl`) are those of a library that checked clean before is parsed
and used without checking again; anything else is checked, and remembered
when clean. An entry is a small JSON file named by its key under
`$PARSAT_CACHE_DIR/checked` (default `~/.cache/parsat`), written atomically;
it holds nothing but its key, so a stale or edited entry can only make a
library be checked again. A folder that cannot be written only costs the
check.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from parsat.dsl.files import FileProblem, cache_dir, read_text_capped, write_atomic
from parsat.dsl.library import Library
from parsat.dsl.parse_cache import dsl_code_hash as checker_hash   # the checker is the dsl package too

FORMAT = 1
ENTRY_BYTES = 4096


def library_key(library: Library) -> str:
    """What a clean check of `library` is valid for: its files' names and text, and the checker."""
    return hashlib.sha256(f"{FORMAT}\0{checker_hash()}\0{library.sources.digest()}".encode()).hexdigest()


def _entry(key: str, folder: Path | None) -> Path:
    return (folder or cache_dir()) / "checked" / f"{key[:32]}.json"


def known_clean(library: Library, folder: Path | None = None) -> bool:
    """Whether `library` checked clean before (an entry under its key that names that key)."""
    key = library_key(library)
    path = _entry(key, folder)
    try:
        data = json.loads(read_text_capped(path, ENTRY_BYTES, "check cache entry"))
    except (FileProblem, OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("key") == key and data.get("clean") is True


def remember_clean(library: Library, folder: Path | None = None) -> None:
    """Record that `library` checked clean; a folder that cannot be written is passed over."""
    key = library_key(library)
    path = _entry(key, folder)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"key": key, "clean": True}) + "\n", durable=False)
    except (FileProblem, OSError):
        pass
