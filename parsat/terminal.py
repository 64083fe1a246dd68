"""Text on its way to the terminal: control characters are shown, never obeyed.

Names in graphs, plans, machines and `.rule` files come from users; a name
holding ANSI escape codes (`\\x1b[2J`, a fake prompt, a hyperlink) or a
bidirectional override would act on the user's terminal when `explain`,
an error message or a progress line prints it. The CLI writes everything
through `PrintableStream`, which spells such characters as escapes
(`\\x1b`), so the one boundary where text leaves parsat is covered,
whatever printed it. Newlines and tabs pass unchanged here, since the
lines of a message are parsat's own; a name or path cannot bring one in
(a name holding a line break is refused where it is read, `ir.validate`,
and a file's path is escaped whole where a message names it,
`dsl.errors.printable`), so no name prints a forged `parsat: error:` line.
JSON output (whose encoder already escapes control characters) is
unaffected.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator, TextIO

from parsat.dsl.errors import printable as _escaped


def printable(text: str) -> str:
    """`text` with every control character (but newline and tab) and bidi override written as an escape."""
    return _escaped(text, lines=True)


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
