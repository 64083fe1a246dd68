"""Text on its way to the terminal: control characters are shown, never obeyed.

Names in graphs, plans, machines and `.rule` files come from users; a name
holding ANSI escape codes (`\\x1b[2J`, a fake prompt, a hyperlink) or a
bidirectional override would act on the user's terminal when `explain`,
an error message or a progress line prints it. The CLI writes everything
through `PrintableStream`, which spells such characters as escapes
(`\\x1b`), so the one boundary where text leaves parsat is covered,
whatever printed it. Newlines and tabs pass unchanged; JSON output (whose
encoder already escapes control characters) is unaffected.
"""

from __future__ import annotations

import sys
import unicodedata
from contextlib import contextmanager
from typing import Iterator, TextIO

_KEEP = {"\n", "\t"}
# Characters that reorder or hide text in a terminal without being control characters (Trojan Source).
_INVISIBLE = [chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C)]


def _table() -> dict[int, str]:
    controls = [chr(c) for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0))]
    return {ord(c): (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
            for c in controls + _INVISIBLE if c not in _KEEP}


_ESCAPES = _table()


def printable(text: str) -> str:
    """`text` with every control character (but newline and tab) and bidi override written as an escape."""
    escaped = text.translate(_ESCAPES)
    if escaped.isascii():
        return escaped
    return "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) in ("Cc", "Cf") and c not in _KEEP else c
                   for c in escaped)


class PrintableStream:
    """A text stream that writes `printable(text)`; every other attribute is the wrapped stream's."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(printable(text))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextmanager
def printable_output() -> Iterator[None]:
    """Route sys.stdout and sys.stderr through `PrintableStream` for the duration."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = PrintableStream(out), PrintableStream(err)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err
