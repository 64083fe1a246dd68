"""Reading the JSON files users give parsat: a size cap, UTF-8, parsat's own errors.

Graph, plan and machine files are read through `dsl.files.read_capped`
(at most the cap is read, whatever the file is: a multi-gigabyte file,
`/dev/zero` and named pipes are refused, not parsed) and decoded as UTF-8 JSON;
nothing is ever unpickled. Every way a file can be unreadable raises the
caller's error class (GraphError, PlanError, MachineError) with a message
for the user; `validate` then checks the structure.
"""

from __future__ import annotations

import json
import os
from typing import Any

from parsat.ir.collector import collection_paused
from parsat.dsl.files import FileProblem, max_input_bytes, read_text_capped


def read_json_file(path: str | os.PathLike, error: type[Exception], what: str) -> Any:
    """Parse a JSON file, raising `error` for every way the file can be unreadable.

    Covers: missing/unreadable file, a folder, a named pipe or device
    (`/dev/zero`), a file over the size cap (counted as read, not as the
    file system reports it), bytes that are not UTF-8, text that is not
    JSON, and nesting so deep that the JSON parser would overflow the stack.
    """
    try:
        text = read_text_capped(path, max_input_bytes(), what)
    except FileProblem as err:
        raise error(str(err)) from None
    return parse_json(text, error, f"{os.fspath(path)} is not valid JSON")


def parse_json(text: str, error: type[Exception], prefix: str) -> Any:
    """json.loads with parsat's error for bad text and for pathologically deep nesting."""
    try:
        with collection_paused():   # a large file's objects all live on (`ir.collector`)
            return json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{prefix}: {err}") from None
    except RecursionError:
        raise error(f"{prefix}: it is nested too deeply") from None
    except ValueError as err:  # e.g. an integer literal with too many digits
        raise error(f"{prefix}: {err}") from None
