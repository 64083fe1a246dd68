"""An egglog e-graph holding a compiled program and a graph: the only module that imports egglog.

It uses the low-level `egglog.bindings.EGraph` with generated text (fast,
and the e-graph is read back with `freeze()`; extraction is ours, in
`extract`). `run` runs one ruleset (or chunk) once and returns egglog's
report: whether anything changed, matches and seconds per rule. The loop
around it, with its limits, is `runner`.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from functools import cached_property
from itertools import repeat
from math import prod
from operator import attrgetter, call, itemgetter
from types import ModuleType
from typing import Mapping, Sequence

from parsat.ir.mesh import Mesh
from parsat.ir.pcg import Degrees
from parsat.ir.placement import Placement
from parsat.egraph.derivation import Template, applications, hashcons
from parsat.egraph.encoding import (ANALYSES, APPLIED_PREFIX, EQUATED, MADE_PREFIX, MATCH_SUFFIX, MAX_RANK, RULESETS,
                                    SHAPE_RULESET, applied_declaration, applied_relation, live_row, match_ruleset)
from parsat.egraph.loading import BOUND, GraphLoader, bound_names
from parsat.egraph.mesh_encoding import AXIS_SIZE, FOLD_MADE, at_relation, axis_sizes, fold_applications
from parsat.egraph.program import CompiledRule, RuleProgram, past
from parsat.egraph.snapshot import Application, ENode, Snapshot


def _egglog_bindings() -> ModuleType:
    """egglog's Rust extension, `egglog.bindings`, loaded without running the `egglog` package's `__init__`.

    `import egglog.bindings` first imports the package, and its `__init__`
    builds egglog's high-level Python API, which imports `black` (its pretty
    printer): 0.27 CPU s, of which parsat, using only the bindings,
    needs 0.04 (a third of `parsat optimize mlp`'s start). The extension is
    registered under its own name, so a later `import egglog` (a user's, in
    the same process) reuses it rather than initialising it twice; only the
    package attribute `egglog.bindings` is then missing (`from egglog import
    bindings` works). Where egglog is already imported, or its layout is not
    the one expected, the ordinary import is used.
    """
    name = "egglog.bindings"
    if name in sys.modules:
        return sys.modules[name]
    if "egglog" in sys.modules:
        from egglog import bindings as imported
        return imported
    try:
        package = importlib.util.find_spec("egglog")
        found = importlib.machinery.PathFinder.find_spec("bindings", list(package.submodule_search_locations or ()))
        if found is None or not isinstance(found.loader, importlib.machinery.ExtensionFileLoader):
            raise ImportError("egglog.bindings is not an extension module here")
        spec = importlib.util.spec_from_file_location(name, found.origin)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    except (ImportError, AttributeError, OSError, ValueError):
        sys.modules.pop(name, None)
        from egglog import bindings as imported
        return imported


bindings = _egglog_bindings()


@dataclass(frozen=True)
class StepReport:
    """What one run of a ruleset did, as egglog reports it: whether the e-graph changed, and the matches of
    each egglog rule (by its `:name`).

    egglog 13.2 also reports search-and-apply times per rule and per ruleset, but they read microseconds
    for runs that take seconds (1.2M matches of an associativity rule: 0.6 ms reported, 1.76 s measured),
    so they are not passed on; the runner times its steps itself.
    """

    changed: bool
    matches: Mapping[str, int]
    held: Mapping[str, int] = field(default_factory=dict)   # egglog rule held back by the match budget -> its matches
    # at most this many e-nodes were added by the run (`Session.run`); None where it is not known
    built: int | None = None


class CompileError(Exception):
    """The rules or the graph cannot be turned into an egglog program."""


class _RowReader:
    """Decodes the rows of one egglog table, each column as Python (a String column as a string, any other, an
    e-class id or an integer, as an int), and tells its tensor columns (e-class ids) from its other columns
    (ints, strings for reals and leaf names).

    Made once per table, not per row: a saturated e-graph of 44,000 e-nodes has twice as many provenance rows
    (`Provenance`), and deciding each column's decoder row by row (a Python call per value) took a third of
    reading them back; the decoders are chosen here and mapped over a row in C."""

    def __init__(self, eg, sorts: Sequence[str]) -> None:
        self._decoders = tuple(eg.value_to_string if sort == "String" else eg.value_to_i64 for sort in sorts)
        self._plain = eg.value_to_i64 if "String" not in sorts else None
        self._children = _picker([i for i, sort in enumerate(sorts) if sort == "T"])
        self._attrs = _picker([i for i, sort in enumerate(sorts) if sort != "T"])

    def values(self, row: Sequence) -> tuple:
        """Every column of `row`, decoded."""
        if self._plain is not None:
            return tuple(map(self._plain, row))
        return tuple(map(call, self._decoders, row))

    def enode(self, op: str, row: Sequence) -> ENode:
        """`row` (the table's columns, no more) as an e-node of `op`."""
        values = self.values(row)
        return ENode(op, self._children(values), self._attrs(values))


def _picker(indices: Sequence[int]):
    """A function taking the columns `indices` of a decoded row, as a tuple (also for one column, or none)."""
    if not indices:
        return lambda _values: ()
    if len(indices) == 1:
        only = indices[0]
        return lambda values: (values[only],)
    return itemgetter(*indices)


class _Decoded(dict):
    """egglog values -> Python, each distinct value decoded once (by `decode`, one of the e-graph's decoders)."""

    def __init__(self, decode) -> None:
        super().__init__()
        self._decode = decode

    def __missing__(self, value):
        found = self[value] = self._decode(value)
        return found


class _ProvenanceRows:
    """The provenance rows of one e-graph, decoded on first use (`load`): what `Provenance`, its `_Equated` and its
    `_Applied` all read. Held by each of them and holding none of them, so that they form no reference cycle:
    a snapshot's provenance is freed with the snapshot by reference counting, not left to the cyclic collector
    (`search.collector`: the three of them held 370,000 objects of llama-70b:64's search in cycles)."""

    def __init__(self, egraph, frozen, rules: Sequence[CompiledRule],
                 classes: Mapping[int, Sequence[ENode]] | None) -> None:
        self._egraph, self._frozen, self.rules = egraph, frozen, rules
        # (operator, columns) -> its makers: one maker as its string, several as a set, until `makers` asks for the
        # key (then its frozenset)
        self.rows: dict[tuple, str | set[str] | frozenset[str]] | None = None
        self.tensor_columns: dict[str, tuple[bool, ...]] = {}   # operator -> which columns of its rows are tensors
        self.equated: dict[int, frozenset[str]] = {}
        self._applied: list[tuple[list[int], list[tuple]]] = []   # per Applied_ table: its indices, its rows' rest
        self.classes = classes or {}

    def load(self) -> dict[tuple, str | set[str] | frozenset[str]]:
        """The rows, decoded once: (operator, the e-node's columns as egglog orders them) -> its makers (`makers`
        reads them). Keyed by the decoded columns rather than by an ENode: a 44,000 e-node e-graph has twice as many
        rows, and making and hashing an ENode for each took most of decoding them; an ENode asked for is turned
        into its key (`Provenance._key`), and iterating makes the ENodes.

        Each table is decoded a column at a time (`_columns`: a map in C per column, where a map per row made a
        tuple per row to slice again), and a key's makers are kept as the one maker's string until a second comes
        (most keys have one to three; a set per key, then a frozenset per key, was a third of the load) and made a
        frozenset when asked (`makers`: a plan asks for a few thousand of ~15,000 keys). The application rows are
        grouped by their rule's index only when a plan asks for a rule's applications (`applied_rows`). The same
        rows, the same makers per key, the same applications in the same order."""
        if self.rows is None:
            eg, made, equated = self._egraph, {}, {}
            found_of = made.get
            for name, fn in self._frozen.functions.items():
                if name.startswith(APPLIED_PREFIX):   # (index, the recorded match...): `encoding.applied_relation`
                    columns = self._columns(eg, fn)
                    if columns:
                        self._applied.append((columns[0], list(_tuples(columns[1:], len(columns[0])))))
                if name == EQUATED:
                    for row in fn.rows:
                        equated.setdefault(eg.value_to_i64(row.inputs[0]), set()).add(
                            eg.value_to_string(row.inputs[1]))
                if not name.startswith(MADE_PREFIX):
                    continue
                op = name[len(MADE_PREFIX):].split("_", 1)[1]
                self.tensor_columns[op] = tuple(sort == "T" for sort in fn.input_sorts[:-1])
                columns = self._columns(eg, fn)
                if not columns:
                    continue
                for key, who in zip(zip(repeat(op), _tuples(columns[:-1], len(columns[-1]))), columns[-1]):
                    found = found_of(key)
                    if found is None:
                        made[key] = who
                    elif found.__class__ is str:
                        made[key] = {found, who}   # a row is unique, so `who` is another maker
                    else:
                        found.add(who)
            self.rows = made
            self.equated = {cid: frozenset(who) for cid, who in equated.items()}
            self._egraph = self._frozen = None
        return self.rows

    @staticmethod
    def _columns(eg, fn) -> list[list]:
        """Each column of `fn`'s rows decoded (`_RowReader`'s decoders), as a list; none for a table of no rows."""
        decoders = _RowReader(eg, fn.input_sorts)._decoders   # holds `eg`: not kept past decoding
        return [list(map(decode, column)) for decode, column in zip(decoders, zip(*map(_INPUTS, fn.rows)))]

    def makers(self, key: tuple) -> frozenset[str]:
        """The makers of the row key `key` (`load`'s), as a frozenset, made once per key; KeyError where no row has it.
        Writing a key's value in place leaves the keys (and an iteration over them) as they are."""
        rows = self.load()
        who = rows[key]
        if who.__class__ is not frozenset:
            who = rows[key] = frozenset((who,)) if who.__class__ is str else frozenset(who)
        return who

    @cached_property
    def applied_rows(self) -> dict[int, list[tuple]]:
        """Rule index -> its recorded matches, in their table's order (`encoding.applied_relation`): worked out from
        the decoded tables when a plan first asks for a rule's applications (`_Applied`), not at each load."""
        self.load()
        applied: dict[int, list[tuple]] = {}
        for indices, matches in self._applied:
            for index, match in zip(indices, matches):
                found = applied.get(index)
                if found is None:
                    applied[index] = [match]
                else:
                    found.append(match)
        self._applied = []
        return applied


_INPUTS = attrgetter("inputs")   # a FrozenRow's columns (`_ProvenanceRows._columns`)


def _tuples(columns: Sequence[list], count: int):
    """The rows of `count` rows' `columns` (decoded), each as a tuple: () for each where there are no columns."""
    return zip(*columns) if columns else repeat((), count)


class Provenance(Mapping):
    """E-node -> the rules that made it (`encoding.made_row`), read from the e-graph on first use.

    Provenance rows outnumber e-nodes two to one and only the final plan's
    rules are ever asked for (`search.provenance.rules_used`), so they are decoded when
    a plan asks, not each time an e-graph is read back."""

    def __init__(self, egraph, frozen, rules: Sequence[CompiledRule] = (),
                 classes: Mapping[int, Sequence[ENode]] | None = None) -> None:
        """`rules` are the program's loaded rules, each recording its applications led by its index
        (`encoding.applied_relation`);
        `classes` the snapshot's, to find their e-nodes in (`derivation`)."""
        self._data = _ProvenanceRows(egraph, frozen, rules, classes)
        self.equated = _Equated(self._data)  # class -> the rules that equated it with a metavariable (`equated_row`)
        self.applied = _Applied(self._data)  # rule -> its applications (`derivation`)

    def _key(self, node: ENode) -> tuple:
        """`node`'s key in `_ProvenanceRows.load`'s rows: its children and attributes back in their table's column
        order."""
        tensor = self._data.tensor_columns.get(node.op)
        if tensor is None or len(tensor) != len(node.children) + len(node.attrs):
            return (node.op, None)   # no such table, or not its columns: no row
        children, attrs = iter(node.children), iter(node.attrs)
        return (node.op, tuple(next(children) if is_tensor else next(attrs) for is_tensor in tensor))

    def __getitem__(self, node: ENode) -> frozenset[str]:
        return self._data.makers(self._key(node))

    def __iter__(self):
        return (self._node(op, values) for op, values in self._data.load())

    def _node(self, op: str, values: tuple) -> ENode:
        """A row's key (`_ProvenanceRows.load`) as its e-node: the inverse of `_key`."""
        tensor = self._data.tensor_columns[op]
        return ENode(op, tuple(v for v, is_tensor in zip(values, tensor) if is_tensor),
                     tuple(v for v, is_tensor in zip(values, tensor) if not is_tensor))

    def __len__(self) -> int:
        return len(self._data.load())


class _Applied(Mapping):
    """Rule name -> its applications, each worked out (`derivation`) when a plan first asks for that rule.

    A recorded match the read-back cannot follow (it never should: the
    text is generated) leaves that compiled rule's applications out, and a
    plan's `rules_used` then names every maker of what they built rather
    than stopping the optimization at its end."""

    def __init__(self, provenance: _ProvenanceRows) -> None:
        self._provenance = provenance
        self._done: dict[str, tuple[Application, ...]] = {}
        self._hashcons: dict[tuple, tuple[int, ENode]] | None = None
        self._compiled: dict[str, list[CompiledRule]] = {FOLD_MADE: []}   # rule -> its compiled rules
        for compiled in provenance.rules:
            self._compiled.setdefault(compiled.name, []).append(compiled)

    def __getitem__(self, rule: str) -> tuple[Application, ...]:
        if rule not in self._compiled:
            raise KeyError(rule)
        if rule not in self._done:
            provenance = self._provenance
            provenance.load()
            if self._hashcons is None:
                self._hashcons = hashcons(provenance.classes)
            found: list[Application] = fold_applications(provenance.classes) if rule == FOLD_MADE else []
            for compiled in self._compiled[rule]:
                rows = provenance.applied_rows.get(compiled.index, ())
                try:
                    found.extend(applications(Template.of(rule, compiled.body), rows, self._hashcons))
                except (KeyError, ValueError):
                    continue
            self._done[rule] = tuple(found)
        return self._done[rule]

    def __iter__(self):
        return iter(self._compiled)

    def __len__(self) -> int:
        return len(self._compiled)


class _Equated(Mapping):
    """E-class -> the rules that equated it with one of their metavariables, loaded with the provenance rows."""

    def __init__(self, provenance: _ProvenanceRows) -> None:
        self._provenance = provenance

    def _table(self) -> dict[int, frozenset[str]]:
        self._provenance.load()
        return self._provenance.equated

    def __getitem__(self, cid: int) -> frozenset[str]:
        return self._table()[cid]

    def __iter__(self):
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


class LoadedRules:
    """A program's declarations and rules loaded into an egglog e-graph, with what a session reads of them.

    Loading is most of a session's set-up (a two-axis mesh's 641 rules: 0.49 of
    its 0.80 CPU s), and the meshes of one search often load the same text:
    meshes of one shape but other sizes read the sizes from the e-graph
    (`lifted_text.lifted_bodies`, `AxisSize`). So one search keeps each
    program it loaded whole (`take_loaded`), and a session on it pushes the
    e-graph (egglog's `push`: a copy kept aside), writes its mesh's sizes and
    its graph, saturates, and pops it back (`Session.close`) to the program
    alone. egglog's pop brings back the e-class counter too, so the session's
    e-graph, ids included, is the one a fresh load would give (tests:
    test_loaded_rules_shared.py)."""

    def __init__(self, program: RuleProgram, deadline: float | None) -> None:
        self.egraph = bindings.EGraph()
        self.loaded = 0
        self.applied = set(re.findall(rf"\(relation ({APPLIED_PREFIX}\S+) ", program.declarations))
        self.in_use = False
        # One command batch per rule, and the declarations in pieces: egglog 13.2 is far slower on one large
        # program (9 s against 0.4 s for 200 rules): egglog-python gives every
        # parsed node's span its own copy of the whole program text (`_pieces`).
        for piece in _pieces(program.declarations):
            self.run(piece)
        self.run(f"(function {BOUND} (String) T :merge old)")
        self.constructors = frozenset(name for name, fn in self.egraph.freeze().functions.items()
                                      if fn.output_sort == "T" and not fn.is_let_binding and name != BOUND)
        # what one match of a rule can build at most (`run`'s `built`): the shape rules' by the most of any,
        # each loaded rule's by its actions
        self.builds = {rule.key: terms_built(rule.body.actions) for rule in program.rules}
        self.shape_builds = max(map(terms_built, re.findall(rf"\(rule .*?:ruleset {SHAPE_RULESET}\)",
                                                            program.declarations, re.S)), default=0)
        for rule in program.rules:
            if past(deadline):
                break
            self.run(rule.text)
            self.loaded += 1

    def run(self, text: str):
        return self.egraph.run_program(*self.egraph.parse_program(text))


def take_loaded(shared: dict[bytes, LoadedRules], program: RuleProgram,
                deadline: float | None) -> tuple[LoadedRules, bool]:
    """`program` loaded, taken from `shared` (the programs one search loaded whole, by their text: the search's
    `MeshCaches.loaded`, so the e-graphs go with it) or loaded afresh and kept there; and whether it is kept
    there. A kept one is pushed for the taker, and marked in use until the taker's `Session.close` pops it: a
    session that ends otherwise (an error mid-load) leaves it marked, and the next session loads afresh
    rather than run on its leftovers."""
    key = hashlib.sha256(program.text().encode("utf-8")).digest()
    found = shared.get(key)
    if found is not None and not found.in_use:
        found.in_use = True
        found.run("(push)")
        return found, True
    loaded = LoadedRules(program, deadline)
    if found is not None or loaded.loaded < len(program.rules):
        return loaded, False
    shared[key] = loaded
    loaded.in_use = True
    loaded.run("(push)")
    return loaded, True


class Session:
    """An egglog e-graph with the compiled rules and one graph loaded."""

    def __init__(self, program: RuleProgram, graph_text: str, deadline: float | None = None,
                 mesh: Mesh | None = None, shared: dict[bytes, LoadedRules] | None = None):
        """Once `deadline` (a `time.perf_counter()` value) passes, no more rules are loaded (`loaded` says how
        many were); the graph always is, so the e-graph stays whole, unless the deadline passes while it is
        loaded (OptimizeError: there is no plan of part of a graph). With `mesh` the program is in the mesh
        encoding (`mesh_encoding`), and the snapshot reads placements. With `shared`, the program's rules are
        taken loaded from there when a session of this search loaded them before (`take_loaded`); `close`
        then gives them back."""
        self.mesh = mesh
        self._rules = program.rules   # each records its applications led by its index (`CompiledRule.index`)
        self._read: tuple | None = None   # `_frozen`'s copy of the e-graph, until the next command
        try:
            if shared is None:
                self._base, self._pushed = LoadedRules(program, deadline), False
            else:
                self._base, self._pushed = take_loaded(shared, program, deadline)
            base = self._base
            self.egraph, self.loaded, self._applied = base.egraph, base.loaded, base.applied
            self._constructors, self._builds, self._shape_builds = base.constructors, base.builds, base.shape_builds
            if mesh is not None and AXIS_SIZE in program.declarations:
                self._run(axis_sizes(mesh))
            self._load_graph(graph_text, program.declarations, deadline)
        except bindings.EggSmolError as err:
            raise CompileError(f"egglog rejected the generated program: {err}") from None

    def close(self) -> None:
        """Gives a shared program's e-graph back (`take_loaded`): popped to the program alone, free for the next
        session. The session's snapshot stays readable (it reads a frozen copy; egglog's pop keeps the strings
        it interned). Nothing to do for a session of its own."""
        if self._pushed:
            self._pushed = False
            self.pop()
            self._base.in_use = False

    def _load_graph(self, graph_text: str, declarations: str, deadline: float | None) -> None:
        """The graph's tensors: a command per term, the facts read in bulk (`loading`; a command per line took
        20 CPU s for a 100,001-tensor chain). The loader tells facts from terms by the relations `declarations`
        declare and the tensor constructors."""
        relations = frozenset(re.findall(r"\(relation ([^\s()]+)", declarations))
        GraphLoader(self._run, relations, self._constructors).load(graph_text, deadline)

    def _run(self, text: str):
        self._read = None
        return self.egraph.run_program(*self.egraph.parse_program(text))

    def _frozen(self) -> tuple:
        """The e-graph frozen and its tables (egglog builds `functions` afresh on every access, ~12 ms for a 2-axis
        mesh's 1,049 tables, and freezing costs as much), kept until the next command: `snapshot` and
        `match_rows`, read one after the other, read one copy."""
        if self._read is None:
            frozen = self.egraph.freeze()
            self._read = (frozen, frozen.functions)
        return self._read

    def extend(self, rules: Sequence[CompiledRule], tag: str, first_index: int) -> None:
        """Loads more compiled rules into rulesets of their own, `<tag>alg` and `<tag>par`.

        The rule generator adds the rules it keeps to an e-graph that already
        holds its candidates, batch by batch; `first_index` keeps the rules'
        match relations apart from the ones loaded before (`RuleBody.text`).
        """
        if self._pushed:
            raise CompileError("a session on a shared program takes no more rules (its e-graph is given back)")
        try:
            for ruleset in RULESETS:
                self._run(f"(ruleset {tag}{ruleset}) (ruleset {match_ruleset(tag + ruleset)})")
            for offset, rule in enumerate(rules):
                self._declare_applied(rule.body.applied_sorts())
                self._builds[f"{tag}{rule.name}#{offset}"] = terms_built(rule.body.actions)
                self._run(rule.body.text(first_index + offset, tag + rule.ruleset, f"{tag}{rule.name}#{offset}"))
        except bindings.EggSmolError as err:
            raise CompileError(f"egglog rejected the generated program: {err}") from None

    def _declare_applied(self, sorts: Sequence[str]) -> None:
        """Declares the `Applied` relation of `sorts` (`encoding.applied_relation`) unless the e-graph has it."""
        if applied_relation(sorts) not in self._applied:
            self._run(applied_declaration(sorts))
            self._applied.add(applied_relation(sorts))

    def push(self) -> None:
        """Saves the e-graph (egglog's push); `pop` brings it back."""
        self._run("(push)")

    def pop(self) -> None:
        self._run("(pop)")

    def load(self, text: str) -> None:
        """Runs program text that inserts terms or facts (a graph chunk)."""
        try:
            self._run(bound_names(text))
        except bindings.EggSmolError as err:
            raise CompileError(f"egglog rejected the generated program: {err}") from None

    def combine_rulesets(self, name: str, parts: Sequence[str]) -> None:
        """Declares `name` (and its match half) as the combined ruleset of `parts` (and theirs)."""
        self._run(f"(unstable-combined-ruleset {name} {' '.join(parts)})\n"
                  f"(unstable-combined-ruleset {match_ruleset(name)} {' '.join(match_ruleset(p) for p in parts)})")

    def holds(self, left: str, right: str) -> bool:
        """Whether the e-graph already has `right` (an egglog term, not inserted) in `left`'s e-class."""
        try:
            self._run(bound_names(f"(check (= {left} {right}))"))
        except bindings.EggSmolError:
            return False
        return True

    def run(self, ruleset: str, budget: int | None = None) -> StepReport:
        """One iteration of `ruleset` (or of one of its chunks), and egglog's report of it.

        The `Whole` rows of terms built since the last run are derived first (the shape ruleset, which on a mesh
        also unions each fused operator with its steps: new e-nodes), then the rules' patterns matched
        (`RuleBody`), then the rules applied. The matches are the applying halves' (a pattern half only records
        matches for its rule to join with its guards). `changed` is the shape run's `updated` or the applying
        run's: the e-graph changed in either, so the iteration has not reached a fixpoint, and the runner's
        limit checks must count the e-graph afresh (`runner._Steps.enodes`; a chunk whose shape run alone grew it
        was once reported unchanged). The pattern run's `updated` is left out: its `Match<i>` rows are read
        only by its own rules' applying halves, in this same call, so rows they could not apply leave the next
        round nothing new to join (a guard's facts turning true later is a change of their own).

        With a `budget`, a gated rule (`RuleBody.text`) whose pattern matched more than `budget` times is held
        back before anything is applied: its `Live` row is deleted, so it applies none of those matches and
        never runs again in this e-graph (`held` names it). This is egglog's back-off scheduler's idea as a
        work budget: associativity over commuted sums matched 1.7M times in one run of an imported LLaMA and
        grew the e-graph 18-fold, past every other limit, which are checked only between runs.
        """
        shape, matched, applied = f"(run {SHAPE_RULESET} 1)", f"(run {match_ruleset(ruleset)} 1)", f"(run {ruleset} 1)"
        if budget is None:
            shaped, _, report = (output.report for output in self._run(f"{shape} {matched} {applied}"))
            held = {}
        else:
            shaped, found = (output.report for output in self._run(f"{shape} {matched}"))
            held = {name.removesuffix(MATCH_SUFFIX): count for name, count in found.num_matches_per_rule.items()
                    if name.endswith(MATCH_SUFFIX) and count > budget}
            for key in held:
                self._run(f"(delete {live_row(key)})")
            report = self._run(applied)[-1].report
        matches = dict(report.num_matches_per_rule)
        return StepReport(shaped.updated or report.updated, matches, held, self._built(shaped, matches))

    def _built(self, shaped, matches: Mapping[str, int]) -> int | None:
        """At most how many e-nodes (constructor rows, `size`) a step's runs added: each match of a rule adds at
        most one row per constructor its actions apply (`terms_built`), and nothing else adds any (a pattern half
        adds `Match` rows, a relation's; a union or egglog's rebuild merges rows, never adds one). None where a
        rule that matched is not one this session loaded (its actions unknown). What the runner's e-node limit
        checks read instead of counting after every step (`runner._Steps.at_least`)."""
        shape = sum(shaped.num_matches_per_rule.values()) * self._shape_builds
        try:
            return shape + sum(count * self._builds[key] for key, count in matches.items() if count)
        except KeyError:
            return None

    def size(self) -> int:
        """Number of e-nodes (constructor rows), from egglog's table sizes: cheap enough to check between chunks
        (freezing the e-graph to count them costs ~45 ms per 18k e-nodes, this ~0.3 ms)."""
        sizes = self._run("(print-size)")[-1].sizes
        return sum(count for name, count in sizes if name in self._constructors)

    def match_rows(self) -> dict[str, list[tuple]] | None:
        """Every loaded rule's `Match<i>` rows (its pattern's matches, whatever its guard said: `RuleBody.text`;
        `i` is the number in its key, which a program less some rules keeps), decoded, by the rule's key: what
        `resize` evaluates the guards on. None where a class holds two `At` rows (a rule wrote another local
        shape or placement than the class had): the guards could then read either, and `resize`, which reads
        a class's one shape, would not evaluate them as egglog did."""
        eg, functions, rows = self.egraph, self._frozen()[1], {}
        if not _one_at_row(eg, functions, self.mesh):
            return None
        # each distinct egglog value decoded once: a value is a class id, an integer or a string, and the rows
        # repeat them (74,000 rows of a small gpt's e-graph hold 2,700 distinct values)
        numbers, strings = _Decoded(eg.value_to_i64), _Decoded(eg.value_to_string)
        for rule in self._rules[:self.loaded]:
            fn = functions.get(f"Match{rule.index}")
            table = fn.rows if fn is not None else ()
            if not table:
                continue
            if "String" in fn.input_sorts:
                getters = tuple((strings if sort == "String" else numbers).__getitem__ for sort in fn.input_sorts)
                rows[rule.key] = [tuple(map(call, getters, row.inputs)) for row in table]
            else:
                rows[rule.key] = [tuple(map(numbers.__getitem__, row.inputs)) for row in table]
        return rows

    def snapshot(self) -> Snapshot:
        eg = self.egraph
        frozen, functions = self._frozen()
        classes: dict[int, list[ENode]] = {}
        analysis: dict[str, dict] = {name: {} for name in ANALYSES}
        lets: dict[str, int] = {}
        for name, fn in functions.items():
            if name.startswith(MADE_PREFIX):
                continue
            if name == BOUND:
                lets.update((eg.value_to_string(row.inputs[0]), eg.value_to_i64(row.output)) for row in fn.rows)
                continue
            if fn.is_let_binding:
                if fn.output_sort == "T":
                    lets[name] = eg.value_to_i64(fn.rows[0].output)
                continue
            if name in analysis:
                table = analysis[name]
                for row in fn.rows:
                    key = tuple(eg.value_to_i64(v) for v in row.inputs)
                    table[key] = eg.value_to_i64(row.output)
                continue
            if fn.output_sort != "T":
                continue
            op = "leaf" if name == "Leaf" else name.split("_", 1)[1]
            reader, to_i64 = _RowReader(eg, fn.input_sorts), eg.value_to_i64
            for row in fn.rows:
                if row.subsumed:
                    continue
                classes.setdefault(to_i64(row.output), []).append(reader.enode(op, row.inputs))
        classes = {k: tuple(v) for k, v in classes.items()}
        made_by = Provenance(eg, frozen, self._rules[:self.loaded], classes)
        if self.mesh is not None:
            return _mesh_snapshot(eg, functions, classes, lets, made_by, self.mesh)
        shape: dict[int, tuple[int, ...]] = {}
        degrees: dict[int, Degrees] = {}
        for cid in classes:
            rank = analysis["Rank"].get((cid,))
            if rank is None:
                continue
            dims = tuple(analysis["Dim"].get((cid, i), 0) for i in range(rank))
            shard = tuple(analysis["Shard"].get((cid, i), 1) for i in range(rank))
            shape[cid] = dims
            degrees[cid] = Degrees(shard, analysis["Copy"].get((cid,), 1), analysis["Psum"].get((cid,), 1))
        return Snapshot(classes, shape, degrees, lets, made_by, equated=made_by.equated, applied=made_by.applied)


def terms_built(actions: str) -> int:
    """At most how many e-nodes one application of `actions` (egglog action text, or a whole rule's text: an
    over-count) inserts: one per constructor it applies, `(Op_...`, `(P_...` or `(Leaf ...` (`encoding.ctor`;
    every constructor of the encodings is named so, `Session._constructors`), whether or not the term is new."""
    return actions.count("(Op_") + actions.count("(P_") + actions.count("(Leaf ")


PIECE_CHARS = 1_000


def _pieces(text: str) -> list[str]:
    """`text` as runs of whole top-level forms of about `PIECE_CHARS` characters, in order, each run for one
    egglog command batch.

    egglog-python gives each parsed node's span its own copy of the whole text parsed with it, so one batch
    costs its nodes times its length: the declarations of bert-large:64's 2-axis meshes (42,658
    characters, most of them lift-table rows) took 0.66 CPU s and 550 MB in one batch the first time in a
    process (the first 2-axis session's extra seconds), 0.22 CPU s later (the freed memory reused), and
    0.06-0.11 CPU s and 7 MB in 1,000-character pieces (benchmarks/search_results.md). The generated text starts each form on a line of its own; a piece is
    only cut where its parentheses balance, so a form written over lines that start with one stays whole."""
    pieces: list[str] = []
    lines: list[str] = []
    size = depth = 0
    for line in re.split(r"\n(?=\()", text):
        if lines and depth == 0 and size + len(line) > PIECE_CHARS:
            pieces.append("\n".join(lines))
            lines, size = [], 0
        lines.append(line)
        size += len(line) + 1
        depth += line.count("(") - line.count(")")
    if lines:
        pieces.append("\n".join(lines))
    return pieces


def _one_at_row(eg, functions, mesh: Mesh | None) -> bool:
    """Whether every class holds at most one `At<rank>` row (`mesh_encoding`; always, without a mesh)."""
    if mesh is None:
        return True
    seen: set[int] = set()
    for rank in range(MAX_RANK + 1):
        fn = functions.get(at_relation(rank))
        for row in (fn.rows if fn is not None else ()):
            cid = eg.value_to_i64(row.inputs[0])
            if cid in seen:
                return False
            seen.add(cid)
    return True


def _mesh_snapshot(eg, functions, classes, lets, made, mesh: Mesh) -> Snapshot:
    """Placements and local shapes read from the `At<rank>` rows (`mesh_encoding`; `functions`, the frozen
    e-graph's tables); global shapes and degrees computed from them. A class has one row (a class is a value in
    one placement); were there two, the first read is kept."""
    axes = len(mesh)
    located: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for rank in range(MAX_RANK + 1):
        fn = functions.get(at_relation(rank))
        if fn is None:
            continue
        for row in fn.rows:
            values = tuple(map(eg.value_to_i64, row.inputs))
            located.setdefault(values[0], (values[1:1 + rank], values[1 + rank:1 + rank + axes]))
    shape: dict[int, tuple[int, ...]] = {}
    degrees: dict[int, Degrees] = {}
    placement: dict[int, Placement] = {}
    # most classes share their local shape and placement with others (every block's values alike): each pair's
    # global shape, placement and degrees are worked out once (equal values, immutable, shared)
    known: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple] = {}
    for cid in classes:
        found = located.get(cid)
        if found is None:
            continue
        worked = known.get(found)
        if worked is None:
            local, codes = found
            where = Placement(codes)
            dims = tuple(d * prod(mesh.size(a) for a in where.shard_axes(i)) for i, d in enumerate(local))
            worked = known[found] = (dims, where, Degrees.of_placement(where, mesh, len(dims)))
        shape[cid], placement[cid], degrees[cid] = worked
    return Snapshot(classes, shape, degrees, lets, made, placement, mesh, equated=made.equated, applied=made.applied)
