"""Errors a user sees: `file:line:col: message`, the source line, a caret.

Every error that originates in a `.rule` file carries a `Span`; `render()`
produces the message the CLI prints. No stack trace is ever the message.
"""

from __future__ import annotations

import hashlib
import unicodedata

from dataclasses import dataclass

from parsat.dsl.ast import Span


SHOWN_COLUMNS = 160   # the most of a source line an error quotes

# Characters that reorder or hide text in a terminal without being control characters (Trojan Source).
_INVISIBLE = [chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C)]
_CONTROLS = [chr(c) for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0))] + _INVISIBLE
_ESCAPES = {ord(c): (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}") for c in _CONTROLS}
_LAYOUT = {"\n", "\t"}
_ESCAPES_IN_TEXT = {k: v for k, v in _ESCAPES.items() if chr(k) not in _LAYOUT}


def printable(text: str, lines: bool = False) -> str:
    """`text` with every control character and bidi override written as an escape (`\\x1b`, `\\n`).

    A name or a path comes from a user's file or folder and is one line of a
    message: escaped whole, a newline in it cannot start a forged
    `parsat: error:` line. With `lines`, newlines and tabs pass: the CLI's
    streams (`parsat.terminal`) write whole messages, whose lines are ours."""
    escaped = text.translate(_ESCAPES_IN_TEXT if lines else _ESCAPES)
    if escaped.isascii():
        return escaped
    keep = _LAYOUT if lines else set()
    return "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) in ("Cc", "Cf") and c not in keep else c
                   for c in escaped)


@dataclass(frozen=True)
class Diagnostic:
    """One problem at one place. `kind` groups them for tests and tools."""

    kind: str
    message: str
    span: Span | None
    source_line: str | None = None

    def render(self) -> str:
        if self.span is None:
            return f"error: {self.message}"
        head = f"{printable(str(self.span))}: error: {self.message}"
        if self.source_line is None:
            return head
        line = self.source_line.rstrip("\n").expandtabs(1)
        column = self.span.column
        width = 1
        if self.span.end_line == self.span.line and self.span.end_column > self.span.column:
            width = self.span.end_column - self.span.column
        width = min(width, max(1, len(line) - column + 1), SHOWN_COLUMNS // 2)
        if len(line) > SHOWN_COLUMNS:  # a window around the place: a generated file can have a 10 MB line
            start = max(0, min(column - 1 - SHOWN_COLUMNS // 4, len(line) - SHOWN_COLUMNS))
            line = ("..." if start else "") + line[start:start + SHOWN_COLUMNS] + \
                ("..." if start + SHOWN_COLUMNS < len(line) else "")
            column = column - start + (3 if start else 0)
        caret = " " * (column - 1) + "^" + "~" * (width - 1)
        return f"{head}\n  {line}\n  {caret}"


class DslError(Exception):
    """One or more diagnostics; `str()` is the full user-facing message."""

    def __init__(self, diagnostics: list[Diagnostic] | Diagnostic):
        if isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics = list(diagnostics)
        super().__init__("\n".join(d.render() for d in self.diagnostics))

    @property
    def first(self) -> Diagnostic:
        return self.diagnostics[0]


class SourceCache:
    """Source text by file name, so diagnostics can quote the line."""

    def __init__(self) -> None:
        self._text: dict[str, list[str]] = {}

    def add(self, path: str, text: str) -> None:
        self._text[path] = text.splitlines()

    def digest(self) -> str:
        """A hash of every file's name and text: what a library is, for caches keyed by content."""
        found = hashlib.sha256()
        for path in sorted(self._text):
            found.update(path.encode("utf-8") + b"\0" + "\n".join(self._text[path]).encode("utf-8") + b"\0")
        return found.hexdigest()

    def line(self, span: Span | None) -> str | None:
        if span is None:
            return None
        lines = self._text.get(span.file)
        if lines is None or not 1 <= span.line <= len(lines):
            return None
        return lines[span.line - 1]

    def diagnostic(self, kind: str, message: str, span: Span | None) -> Diagnostic:
        return Diagnostic(kind, message, span, self.line(span))
