"""Reading the JSON files users give parsat: a size cap, UTF-8, parsat's own errors.

Graph, plan and machine files are read as bytes with a size cap (a
multi-gigabyte file is refused, not parsed) and decoded as UTF-8 JSON;
nothing is ever unpickled. Every way a file can be unreadable raises the
caller's error class (GraphError, PlanError, MachineError) with a message
for the user; `validate` then checks the structure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# Largest JSON file parsat reads (bytes); override with PARSAT_MAX_INPUT_BYTES.
MAX_INPUT_BYTES = 64 * 2 ** 20


def max_input_bytes() -> int:
    """The size cap for input files (the environment may raise or lower it)."""
    try:
        return max(1, int(os.environ.get("PARSAT_MAX_INPUT_BYTES", MAX_INPUT_BYTES)))
    except ValueError:
        return MAX_INPUT_BYTES


def read_json_file(path: str | os.PathLike, error: type[Exception], what: str) -> Any:
    """Parse a JSON file, raising `error` for every way the file can be unreadable.

    Covers: missing/unreadable file, a folder, a file over the size cap,
    bytes that are not UTF-8, text that is not JSON, and nesting so deep
    that the JSON parser would overflow the stack.
    """
    limit = max_input_bytes()
    try:
        size = os.path.getsize(path)
        if size > limit:
            raise error(f"{path}: the {what} file is {size:,} bytes, over the limit of {limit:,} "
                        "(PARSAT_MAX_INPUT_BYTES)")
        raw = Path(path).read_bytes()
    except OSError as err:
        raise error(f"cannot read {path}: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path} is not a {what} JSON file: byte {err.start} is not UTF-8 text") from None
    return parse_json(text, error, f"{path} is not valid JSON")


def parse_json(text: str, error: type[Exception], prefix: str) -> Any:
    """json.loads with parsat's error for bad text and for pathologically deep nesting."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{prefix}: {err}") from None
    except RecursionError:
        raise error(f"{prefix}: it is nested too deeply") from None
    except ValueError as err:  # e.g. an integer literal with too many digits
        raise error(f"{prefix}: {err}") from None
