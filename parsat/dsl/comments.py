"""Every comment of a `.rule` file, placed where `parsat fmt` prints it again: none is ever dropped.

The canonical printer lays each declaration out on fixed lines (a rule:
`rule name:`, `forall ...`, `where ...`, `lhs => rhs`; an operator: its
signature, `where ...`, `out[...] = ...`), so a comment is kept by what it
belongs to, not by its line number:

* the file's header: the comment block that starts the file, followed by
  a blank line and by something more;
* a declaration's doc: the block directly above it;
* a loose block: any other block between declarations or at the end
  (a commented-out rule, a TODO, the last comment of a file); printed
  where it was, between the same two declarations;
* a comment inside a declaration: kept with the printed line it was
  written in (`LineNotes`): at the end of that line when it ended the
  line's source, otherwise on a line of its own just before it.

Printing that back and reading it again gives the same placement, so
`fmt` is a fixed point and `parse(format_module(m)) == m` covers comments.
A comment's text keeps its spaces (commented-out code stays indented);
only one space after `#` is the printer's own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from lark import Token, Tree

from parsat.dsl import ast

Position = tuple[int, int]   # (line, column), 1-based, as Lark counts


@dataclass(frozen=True)
class Comment:
    line: int
    column: int
    text: str        # after `#` and one space, trailing spaces dropped
    alone: bool      # nothing but spaces before it on its line

    @property
    def position(self) -> Position:
        return self.line, self.column


def comment_text(raw: str) -> str:
    """A comment's text as kept: what follows `#`, less one leading space and the trailing spaces."""
    raw = raw.rstrip()
    return raw[1:] if raw.startswith(" ") else raw


def render(text: str) -> str:
    """A kept comment as printed."""
    return f"# {text}" if text else "#"


def scan(text: str) -> list[Comment]:
    """Every comment in `text`: a `#` outside a quoted path, to the end of its line (the lexer's rules)."""
    found = []
    for number, line in enumerate(text.split("\n"), start=1):   # lines as the lexer counts them: "\n" only
        quoted = False
        for index, char in enumerate(line):
            if char == '"':
                quoted = not quoted
            elif char == "#" and not quoted:
                found.append(Comment(number, index + 1, comment_text(line[index + 1:]), not line[:index].strip()))
                break
    return found


def _span(node) -> tuple[Position, Position] | None:
    if isinstance(node, Token):
        return (node.line, node.column), (node.end_line or node.line, node.end_column or node.column + len(node))
    if isinstance(node, Tree) and not node.meta.empty:
        meta = node.meta
        return (meta.line, meta.column), (meta.end_line, meta.end_column)
    return None


def printed_lines(decl: Tree) -> list[tuple[Position, Position]]:
    """Where the source of each line the printer writes for `decl` starts and ends (`printer.code_lines`)."""
    children = decl.children
    groups: list[list] = []
    if decl.data == "rule_decl":   # rule NAME: | forall binders | where ... | lhs => rhs
        forall = next(i for i, c in enumerate(children) if isinstance(c, Token) and c.type == "FORALL")
        where = [i for i, c in enumerate(children) if isinstance(c, Tree) and c.data == "where_clause"]
        rewrite = next(i for i, c in enumerate(children) if isinstance(c, Token) and c.type == "REWRITE")
        binders_end = where[0] if where else rewrite - 1
        groups = [children[:forall], children[forall:binders_end]]
        if where:
            groups.append(children[where[0]:where[0] + 1])
        groups.append(children[rewrite - 1:])
    elif decl.data == "op_decl":   # op NAME(params) -> shape | where ... | out[...] = body
        where = [i for i, c in enumerate(children) if isinstance(c, Tree) and c.data == "where_clause"]
        semantics = len(children) - 1
        groups = [children[:where[0] if where else semantics]]
        if where:
            groups.append(children[where[0]:where[0] + 1])
        groups.append(children[semantics:])
    else:                          # import "path"
        groups = [children]
    lines = []
    for group in groups:
        spans = [s for s in (_span(c) for c in group) if s is not None]
        lines.append((min(s[0] for s in spans), max(s[1] for s in spans)))
    return lines


def attach(tree: Tree, text: str, decls: Sequence[ast.Decl]) -> tuple[tuple[str, ...], list[ast.Decl], ast.Notes]:
    """The header, the declarations with their docs, and every other comment's place."""
    comments = scan(text)
    layouts = [printed_lines(child) for child in tree.children]
    starts = [layout[0][0] for layout in layouts]
    inner: dict[int, list[Comment]] = {}
    outer: list[Comment] = []
    for comment in comments:
        owner = max((k for k, start in enumerate(starts) if start <= comment.position), default=None)
        end = layouts[owner][-1][1] if owner is not None else None
        if owner is not None and (comment.position <= end or comment.line == end[0]):
            inner.setdefault(owner, []).append(comment)
        else:
            outer.append(comment)
    header, docs, loose = _blocks(outer, starts, text.split("\n"))
    decls = [replace(decl, doc=docs.get(k, ())) for k, decl in enumerate(decls)]
    notes = ast.Notes(tuple(loose), tuple((k, _line_notes(inner[k], layouts[k])) for k in sorted(inner)))
    return header, decls, notes


def _line_notes(comments: list[Comment], layout: list[tuple[Position, Position]]) -> tuple[ast.LineNotes, ...]:
    """A declaration's inner comments by printed line: those written before a line's source, or inside it but
    not ending it, print before it; the one that ends the line's source prints at its end."""
    before: dict[int, list[str]] = {}
    inside: dict[int, list[Comment]] = {}
    for comment in comments:
        k = max(i for i, (start, _end) in enumerate(layout) if start <= comment.position)
        end = layout[k][1]
        if comment.position <= end or comment.line == end[0]:
            inside.setdefault(k, []).append(comment)
        else:   # after line k's source, before line k+1's
            before.setdefault(k + 1, []).append(comment.text)
    out = []
    for k in sorted(set(before) | set(inside)):
        lines, trailing = list(before.get(k, [])), None
        written = inside.get(k, [])
        if written and not written[-1].alone:
            trailing = written[-1].text
            written = written[:-1]
        lines += [c.text for c in written]
        out.append(ast.LineNotes(k, tuple(lines), trailing))
    return tuple(out)


def _blocks(comments: list[Comment], starts: list[Position], lines: list[str]):
    """Comments outside declarations as the header, docs (declaration index -> lines) and loose blocks."""
    blocks: list[list[Comment]] = []
    for comment in comments:
        if blocks and blocks[-1][-1].line == comment.line - 1:
            blocks[-1].append(comment)
        else:
            blocks.append([comment])
    header: tuple[str, ...] = ()
    docs: dict[int, tuple[str, ...]] = {}
    loose: list[tuple[int, tuple[str, ...]]] = []
    for index, block in enumerate(blocks):
        texts = tuple(c.text for c in block)
        after = next((k for k, start in enumerate(starts) if start[0] > block[-1].line), len(starts))
        if after < len(starts) and starts[after][0] == block[-1].line + 1 and after not in docs:
            docs[after] = texts
            continue
        first_thing = not any(line.strip() for line in lines[:block[0].line - 1])
        blank_after = block[-1].line < len(lines) and not lines[block[-1].line].strip()
        more = after < len(starts) or index + 1 < len(blocks)
        if index == 0 and first_thing and blank_after and more:
            header = texts
            continue
        loose.append((after, texts))
    return header, docs, loose


def with_notes(code: Sequence[str], notes: Sequence[ast.LineNotes], indent: str = "  ") -> list[str]:
    """A declaration's printed lines with its inner comments put back."""
    by_line = {n.line: n for n in notes}
    out = []
    for k, line in enumerate(code):
        note = by_line.get(k)
        if note is None:
            out.append(line)
            continue
        out += [indent + render(text) for text in note.before]
        out.append(f"{line}  {render(note.trailing)}" if note.trailing is not None else line)
    return out
