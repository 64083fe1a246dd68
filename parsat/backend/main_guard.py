"""Whether a job is being started from the launching script's unguarded top level, told before any rank starts.

multiprocessing's spawn starts each rank by running the launching script's top level again (as `__mp_main__`),
so a script that starts a job outside `if __name__ == "__main__":` would start it again in every rank, after
redoing whatever that top level does first (an `optimize` of minutes, per rank). `launch` asks
`unguarded_call_site` before it spawns and refuses such a call at once, naming the script's line; where this
cannot be told from the source (the code was `exec`-ed, the file is gone), the ranks' own check in `launch`
(`_reimporting_the_script`) still ends the job with the same advice.

The rule of when spawn re-runs the main module is multiprocessing's (`spawn.get_preparation_data` and
`_fixup_main_from_name` / `_fixup_main_from_path`): by module name unless it is a package's `__main__`
(`python -m parsat`), else by path unless there is none (the REPL, `python -c`, notebooks).
"""

from __future__ import annotations

import ast
import os
import sys
from types import FrameType, ModuleType


def unguarded_call_site(frame: FrameType | None = None) -> tuple[str, int] | None:
    """`(script, line)` of the launching script's top-level statement that (directly or through calls) started
    this job outside a `__name__ == "__main__"` guard, where spawn would run that statement again in every rank;
    None where the call is guarded, where spawn re-runs nothing, or where the source cannot tell."""
    main = sys.modules.get("__main__")
    path = _rerun_path(main)
    if main is None or path is None:
        return None
    frame = frame if frame is not None else sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None or not _same_file(frame.f_code.co_filename, path):
        return None
    try:
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read(), filename=path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    line = frame.f_lineno
    if any(first <= line <= last for first, last in _guarded_lines(tree)):
        return None
    return path, line


def _rerun_path(main: ModuleType | None) -> str | None:
    """The file spawn runs again in each child before its target, or None where it runs none."""
    if main is None:
        return None
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if name is not None and (name == "__main__" or name.endswith(".__main__")):
        return None
    path = getattr(main, "__file__", None)
    if not path or os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None
    return path


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _guarded_lines(tree: ast.Module) -> list[tuple[int, int]]:
    """The line spans of the bodies of every `if __name__ == "__main__":` in the module (either operand order)."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.body:
            spans.append((node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno))
    return spans


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = (test.left, test.comparators[0])
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    values = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(values) == 1
