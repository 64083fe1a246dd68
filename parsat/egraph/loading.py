"""A graph's egglog text loaded into the e-graph in few egglog commands, the e-graph the same.

egglog 13.2 spends 40-50 us on every top-level command, whatever it does
(the round trip of the parsed command through Python, type checking, a
one-off rule that runs the action), and the text of a graph (`encoding.graph_program`,
`mesh_encoding.mesh_graph_program`, the rule generator's terms) has four to
ten commands per tensor: its `let`, its provenance row, its shape and
placement rows. 100,001 tensors took 20 CPU s, the rest of `optimize` 8.
Here the text becomes:

* one command per tensor term, in the text's order, so e-classes are made in
  the same order as before (their ids, and every tie an extraction breaks by
  them, stay as they were); a tensor that only the next one uses is written
  inside that one's term (`(Op_relu (Op_relu (Bound "$n3")))`, up to NEST
  deep), so a chain of n tensors takes n / NEST commands;
* the facts (every `(set (F args) value)` and relation row whose arguments
  are tensors and literals) become rows of one table per form, read by
  egglog's `input` from an in-memory file, and one egglog rule per form
  writes them, its tensors looked up in `Bound`; a nested tensor's own
  `Bound` row is found by a rule too (its term, looked up);
* two rule runs write them all (`graph_find`, one iteration per level of
  nesting, then `graph_facts`): a rule run matches in bulk, where a command
  costs as much for one row as a rule run for thousands.

The 100,001-tensor chain now loads in about 4 CPU s (3,126 commands and
two files of 100,001 rows). A chunk of the text this does not read (a
pin's `union`, a nested term, a fact whose strings `input` cannot read
back) runs as it is, in its place, after the facts before it are written.
egglog-python's spans are why commands go a few at a time (`batch`): every
parsed node carries its own copy of the whole program text.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Sequence

from parsat.ir.collector import collection_paused
from parsat.egraph.encoding import quote
from parsat.egraph.program import past
from parsat.ir.errors import OptimizeError

BOUND = "Bound"
"""The table that holds the graph's named tensors: `(Bound "$n5")` is the e-class of tensor `$n5`."""

FIND_RULESET, FACT_RULESET = "graph_find", "graph_facts"   # nested tensors found first, then facts written
ROWS_PREFIX = "GraphRows_"   # the tables of facts read from files (relations of strings and i64s)
NEST = 32                    # tensors written inside one term at most: egglog's parser and checker recurse
TENSORS_PER_CHECK = 256      # tensors loaded between two looks at the deadline

_GRAPH_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|\(let (\$[A-Za-z0-9_]+) |\$[A-Za-z0-9_]+')


def bound_names(text: str) -> str:
    """Graph text with its `let`s as rows of the `Bound` table: `(let $n5 (Op_relu $n4))` becomes
    `(set (Bound "$n5") (Op_relu (Bound "$n4")))`; quoted strings (leaf names) are left as they are.

    egglog 13.2 makes each global `let` a table of its own, and every command
    then visits every table: a graph of n tensors loaded in n commands cost
    n**2 (100,001 tensors: 7,168 loaded in the old default limit). One table
    of names keeps each command's cost flat. The encoders (`encoding`,
    `mesh_encoding`, the rule generator's terms) keep writing `let`s; this
    pass turns the ones `GraphLoader` does not read itself into rows."""
    def row(match: re.Match) -> str:
        token = match.group(0)
        if token.startswith('"'):
            return token
        if match.group(1):
            return f'(set ({BOUND} "{match.group(1)}") '
        return f'({BOUND} "{token}")'

    return _GRAPH_TOKENS.sub(row, text)


# A chunk's template: its text with each literal replaced by a mark of its kind (string, tensor, integer),
# so every tensor of one operator, shape and placement shares one template, read once.
STRING, TENSOR, INTEGER = "\x01", "\x02", "\x03"
_LITERALS = re.compile(r'("(?:[^"\\]|\\.)*"|\$[A-Za-z0-9_]+|(?<= )-?\d+(?=[ )\n]))')
_KINDS = str.maketrans({'"': STRING, "$": TENSOR, "-": INTEGER, **{digit: INTEGER for digit in "0123456789"}})
_MARK = f"[{STRING}{TENSOR}{INTEGER}]"
_ARGS = f"((?: {_MARK})*)"
_LET = re.compile(rf"\(let {TENSOR} (\(\w+{_ARGS}\))\)")
_SET = re.compile(rf"\(set \(\w+{_ARGS}\) (?:{_MARK}|\((\w+){_ARGS}\))\)")
_ROW = re.compile(rf"\((\w+){_ARGS}\)")


def split_literals(chunk: str) -> tuple[tuple[str, str], list[str]]:
    """A chunk's template key and its literals, in one regex pass: the key is the text between the literals
    and the literals' kinds, so chunks alike but for their literals' values share it (and their template)."""
    parts = _LITERALS.split(chunk)
    literals = parts[1::2]
    return ("\x00".join(parts[0::2]), "".join([literal[0] for literal in literals]).translate(_KINDS)), literals


def template(key: tuple[str, str]) -> str:
    """The template a key stands for: the chunk's text with each literal replaced by its kind's mark."""
    pieces, kinds = key[0].split("\x00"), key[1]
    return "".join(piece + kind for piece, kind in zip(pieces, kinds)) + pieces[-1]


@functools.lru_cache(maxsize=4096)
def _pieces(pattern: str) -> list[str]:
    return re.split(_MARK, pattern)


def _fill(pattern: str, values: Sequence[str]) -> str:
    """`pattern` (a template's text) with its marks replaced by `values`, in order."""
    pieces = _pieces(pattern)
    out = [pieces[0]]
    for value, piece in zip(values, pieces[1:]):
        out += (value, piece)
    return "".join(out)


def _picker(positions: Sequence[int]) -> Callable[[Sequence[str]], tuple[str, ...]]:
    """A function that takes the literals at `positions` from a chunk's literals (at C speed: itemgetter)."""
    if not positions:
        return lambda literals: ()
    if len(positions) == 1:
        index = positions[0]
        return lambda literals: (literals[index],)
    return operator.itemgetter(*positions)


@dataclass(frozen=True)
class Let:
    """A `let` of a chunk's template: its literals are the chunk's `literals[start:end]` (the first names the
    tensor), `body` the template of its term."""

    start: int
    end: int
    body: str


@dataclass(frozen=True)
class Template:
    """A chunk's template read: its `let`s, its facts (one `facts` pattern of all of them, `fact_literals` its
    literals), the tensors it makes (`made`) and needs made before (`needs`), the tensors named where a command
    runs (`uses`: a `let`'s arguments) and the strings of its facts (`strings`: `input` reads them)."""

    lets: tuple[Let, ...]
    facts: str
    fact_literals: Callable[[Sequence[str]], tuple[str, ...]]
    made: Callable[[Sequence[str]], tuple[str, ...]]
    needs: Callable[[Sequence[str]], tuple[str, ...]]
    uses: Callable[[Sequence[str]], tuple[str, ...]]
    strings: Callable[[Sequence[str]], tuple[str, ...]]


def read_template(text: str, relations: frozenset[str], constructors: frozenset[str]) -> Template | None:
    """A chunk's template read, or None when one of its lines is neither a `let` of one term of literals nor a
    fact: a `set` of a function (its value a literal or a term of another sort than tensors: those are made
    only by `let`s, in order) or a row of a relation."""
    lets, facts, at = [], [], 0
    found: dict[str, list[int]] = {"fact_literals": [], "made": [], "needs": [], "uses": [], "strings": []}
    for line in text.strip().split("\n"):
        marks = re.findall(_MARK, line)
        let, fact, row = _LET.fullmatch(line), _SET.fullmatch(line), _ROW.fullmatch(line)
        if let:
            lets.append(Let(at, at + len(marks), let.group(1)))
            found["made"].append(at)
        elif (fact and fact.group(2) not in constructors) or (row and row.group(1) in relations):
            facts.append(line)
            found["fact_literals"] += range(at, at + len(marks))
        else:
            return None
        first = 1 if let else 0   # a let's first literal names the tensor it makes
        for index, mark in enumerate(marks[first:], start=at + first):
            if mark == TENSOR:
                found["needs"].append(index)
                if let:
                    found["uses"].append(index)
            elif mark == STRING and not let:
                found["strings"].append(index)
        at += len(marks)
    return Template(tuple(lets), " ".join(facts), **{name: _picker(positions) for name, positions in found.items()})


_SAFE_STRING = re.compile(r'"(?:[^\s"\\](?:[^"\\\t\n\r]*[^\s"\\])?)?"')
"""A string literal egglog's `input` reads back the same: no escapes, tabs or line breaks, nothing `trim`s."""


def _tsv_row(literals: Sequence[str]) -> str:
    """Literals as a row for `input` (tab-separated; strings, all `_SAFE_STRING`s, without their quotes)."""
    return "\t".join(literals).replace('"', "")


@contextlib.contextmanager
def row_file(rows: Sequence[str]) -> Iterator[str]:
    """A path egglog's `input` can read `rows` from: an in-memory file where Linux has them (nothing left on
    disk, whatever ends the process), else a temporary file, removed when the block ends."""
    data = ("\n".join(rows) + "\n").encode()
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("parsat-rows", getattr(os, "MFD_CLOEXEC", 0))
        try:
            with open(fd, "wb", closefd=False) as out:
                out.write(data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.NamedTemporaryFile(prefix="parsat-rows-", suffix=".tsv") as out:
        out.write(data)
        out.flush()
        yield out.name


def table_text(name: str, pattern: str, find: bool) -> str:
    """The relation of a form's rows and the rule that writes them: a chunk's facts (`find` False: `pattern`
    is the facts) or the `Bound` rows of nested tensors (`find`: `pattern` is the tensor's term, the first
    column its name). A tensor column holds a `Bound` name, looked up; a literal column holds the literal."""
    kinds = ([TENSOR] if find else []) + re.findall(_MARK, pattern)
    columns = [f"c{i}" for i in range(len(kinds))]
    values = [f"v{i}" if kind == TENSOR else f"c{i}" for i, kind in enumerate(kinds)]
    sorts = " ".join("i64" if kind == INTEGER else "String" for kind in kinds)
    query = [f"({name} {' '.join(columns)})"]
    query += [f"(= v{i} ({BOUND} c{i}))" for i, kind in enumerate(kinds) if kind == TENSOR and not (find and i == 0)]
    if find:
        query.append(f"(= t {_fill(pattern, values[1:])})")
        action = f"(set ({BOUND} c0) t)"
    else:
        action = _fill(pattern, values)
    return (f"(relation {name} ({sorts}))\n"
            f"(rule ({' '.join(query)}) ({action}) :ruleset {FIND_RULESET if find else FACT_RULESET})\n")


@dataclass
class _Term:
    """A tensor's term not yet sent: its `Bound` name, its egglog expression, how many terms it holds nested,
    and the form and row that find it once it is nested in the next term (no form: it must be sent itself)."""

    name: str
    expr: str
    depth: int
    find: str
    row: str


class _Chunk(NamedTuple):
    text: str
    template: Template | None    # None: run as text
    literals: list[str]


class GraphLoader:
    """Loads graph text into an e-graph through `run` (egglog program text in): the module's way, one loader per
    e-graph (it remembers the tables it declared).

    `relations` and `constructors` (of tensors) name the e-graph's relations and the constructors that make
    e-classes, so a fact is told from a term. `batch` commands go to egglog per call."""

    def __init__(self, run: Callable[[str], object], relations: frozenset[str], constructors: frozenset[str],
                 batch: int = 8) -> None:
        self._run = run
        self._relations, self._constructors = relations, constructors
        self._batch = batch
        self._templates: dict[tuple[str, str], Template | None] = {}
        self._tables: dict[tuple[str, bool], str] = {}     # (pattern, find) -> the relation of its rows
        self._rows: dict[tuple[str, bool], list[str]] = {}  # rows not yet read, tab-separated
        self._commands: list[str] = []

    def load(self, text: str, deadline: float | None = None) -> None:
        """Loads `text` (chunks separated by blank lines, a tensor each); OptimizeError once `deadline` (a
        `time.perf_counter()` value) passes: there is no plan of part of a graph."""
        with collection_paused():
            self._load(text, deadline)   # its chunks are freed before the collector is back: not walked once more

    def _load(self, text: str, deadline: float | None) -> None:
        chunks, uses = self._read(text)
        pending: _Term | None = None
        for index, chunk in enumerate(chunks):
            # small graphs (< TENSORS_PER_CHECK tensors, < 0.05 s) always load
            if index and index % TENSORS_PER_CHECK == 0 and past(deadline):
                raise OptimizeError(f"loading the graph into the e-graph ran past the time limit (--limit "
                                    f"seconds): {index:,} of {len(chunks):,} tensors loaded; raise the limit")
            if chunk.template is None:
                self._send(pending)
                pending = None
                self._flush()
                self._run(bound_names(chunk.text))
                continue
            for let in chunk.template.lets:
                pending = self._term(let, chunk.literals, pending, uses)
            if chunk.template.facts:
                self._rows.setdefault((chunk.template.facts, False), []).append(
                    _tsv_row(chunk.template.fact_literals(chunk.literals)))
        self._send(pending)
        self._flush()

    def _read(self, text: str) -> tuple[list[_Chunk], Counter]:
        """The chunks of `text`, each read through its template (once per template) or left as text: so is a
        chunk that names a tensor not made before it, or whose facts hold a string `input` cannot read. And
        how many times each tensor is named where a command runs (`let`s, chunks left as text); facts are
        written after all terms, so they do not count."""
        chunks: list[_Chunk] = []
        defined: set[str] = set()
        named: list[str] = []
        for part in text.split("\n\n"):
            if not part.strip():
                continue
            key, literals = split_literals(part)
            if key not in self._templates:
                self._templates[key] = read_template(template(key), self._relations, self._constructors)
            found = self._templates[key]
            if found is not None and _readable(found, literals, defined):
                named += found.uses(literals)
                chunks.append(_Chunk(part, found, literals))
                continue
            defined.update(m.group(1) for m in _GRAPH_TOKENS.finditer(part) if m.group(1))
            named += (m.group(0) for m in _GRAPH_TOKENS.finditer(part) if m.group(0).startswith("$"))
            chunks.append(_Chunk(part, None, []))
        return chunks, Counter(named)

    def _term(self, let: Let, literals: list[str], pending: _Term | None, uses: Counter) -> _Term:
        """The term of `let`, `pending` written inside it when it is that term's only use (then found by a
        row), else sent first."""
        values, depth = [], 1
        for arg in literals[let.start + 1:let.end]:
            if pending and arg == pending.name and pending.find and uses[arg] == 1 and pending.depth < NEST:
                values.append(pending.expr)
                depth = pending.depth + 1
                self._rows.setdefault((pending.find, True), []).append(pending.row)
                pending = None
            else:
                values.append(f"({BOUND} {quote(arg)})" if arg.startswith("$") else arg)
        self._send(pending)
        own = literals[let.start:let.end]
        findable = all(_SAFE_STRING.fullmatch(atom) for atom in own if atom.startswith('"'))
        return _Term(own[0], _fill(let.body, values), depth, let.body if findable else "", _tsv_row(own))

    def _send(self, term: _Term | None) -> None:
        if term is not None:
            self._commands.append(f"(set ({BOUND} {quote(term.name)}) {term.expr})")
            if len(self._commands) >= self._batch:
                self._drain()

    def _drain(self) -> None:
        if self._commands:
            self._run("\n".join(self._commands))
            self._commands.clear()

    def _flush(self) -> None:
        """Sends the terms waiting, then reads the rows waiting into their tables and runs the rules that write
        them: the nested tensors' `Bound` rows (an iteration per level of nesting), then the facts."""
        self._drain()
        if not self._rows:
            return
        finds = sum(len(rows) for (_pattern, find), rows in self._rows.items() if find)
        for key, rows in self._rows.items():
            with row_file(rows) as path:
                self._run(f"(input {self._table(key)} {quote(path)})")
        self._rows.clear()
        self._run(f"(run {FIND_RULESET} {finds + 1})")
        self._run(f"(run {FACT_RULESET} 1)")

    def _table(self, key: tuple[str, bool]) -> str:
        """The relation that holds the rows of a form (declared, with its rule, on first use)."""
        if key not in self._tables:
            if not self._tables:
                self._run(f"(ruleset {FIND_RULESET}) (ruleset {FACT_RULESET})")
            name = self._tables[key] = f"{ROWS_PREFIX}{len(self._tables)}"
            self._run(table_text(name, *key))
        return self._tables[key]


def _readable(found: Template, literals: Sequence[str], defined: set[str]) -> bool:
    """Whether a chunk names only tensors made before it (or by its own `let`s) and its facts only strings
    `input` reads back the same; if so, its tensors join `defined`."""
    made = found.made(literals)
    needs = found.needs(literals)
    if not defined.issuperset(needs) and not set(needs).difference(defined).issubset(made):   # its own tensors
        return False
    if not all(map(_SAFE_STRING.fullmatch, found.strings(literals))):
        return False
    defined.update(made)
    return True
