"""A saturated e-graph taken for another graph of the same structure and other sizes (docs/MESH.md, "One
saturation for every micro-batch count").

The micro-batch search builds the step's graph at several batch sizes and
saturates each on the same meshes; the graphs differ in their sizes and in
the loss's scale (a real) alone. What the e-graph and the rules read of a
size, by reading the encoding through (`mesh_encoding`, `lifted_text`):

* a constructor's integer arguments are the operators' integer attributes,
  dims and mesh axes, which rules copy from their matches or write as
  constants, except where a rule's right side reads a size
  (`unflatten(x, d, n / p)` of a vocabulary split): such an argument is
  evaluated beside the guards (`_built_sizes`) and must come out the same;
* sizes are in one relation, `At<rank>` (a class's local shape beside its
  placement), which the rules read in their guarding half only
  (`RuleBody`): an `At` atom binds a metavariable's local sizes, `(= v e)`
  equates a size with another or with a pattern's integer, and relations
  (`>=`, `(= (% n k) 0)`) compare them; the lift tables and placement codes
  read no size; an `AxisSize` lookup binds a mesh axis's size, which both
  graphs share (one mesh);
* a rule's actions write each built term's `At` row: the rule's typed shape
  of that term at the match's sizes, divided by the axes that shard it.

So two saturations, of graphs `like` and `graph` of the same structure
(leaves, operators, inputs, integer attributes, outputs), go step by step
alike as long as every guarding half, on every match of its pattern, holds
at `graph`'s sizes exactly where it holds at `like`'s: the patterns are
structural, so the same e-nodes give the same matches, the same guards let
the same matches through, and they build the same e-nodes (no size in them)
with `At` rows that are each term's shape at `graph`'s sizes. Reals are
strings no rule reads but by equality, so a one-to-one renaming of the
graph's reals that no rule writes as a literal changes nothing either.
`resized` checks exactly this on the saturated e-graph of `like`: the
matches of every rule's pattern are its `Match` rows (recorded for the
pattern's every match, whatever its guard said, `RuleBody.text`), each
class's shape at `graph`'s sizes is worked out bottom-up from the graph's
(`ir.instance.instance_for`, the operators' shape functions, checked to give
`like`'s snapshot back at `like`'s sizes), every shard must divide, and
every match's guards are evaluated at both sizes, placement codes and lift
tables read as egglog reads them; a match they let through must find the
terms it builds in the e-graph and write `At` rows equal to their classes'
local shapes at both sizes (`like`'s e-graph holding one `At` row per
class: `Session.match_rows`). Where any of it fails (a batch that no longer
divides among the data-parallel devices lets fewer rules through) it
returns None and the graph is saturated anew. Why that suffices (the
saturated e-graph is the least one closed under the rules): docs/MESH.md.
"""

from __future__ import annotations

import re
from dataclasses import replace
from math import prod
from types import MappingProxyType
from typing import Callable, Iterator, Mapping, Sequence

from parsat.dsl.library import Library
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.egraph.encoding import PIN_SUFFIX
from parsat.egraph.mesh_encoding import AXIS_SIZE
from parsat.egraph.program import RuleProgram
from parsat.egraph.snapshot import Application, ENode, Snapshot
from parsat.ir.graph import Graph
from parsat.ir.instance import instance_for

_TOKEN = re.compile(r"\(|\)|[^\s()]+")
_NUMBER = re.compile(r"-?[0-9]+")
_PIN = "pin:"


def structure(graph: Graph) -> tuple:
    """What a saturation reads of `graph` beside its sizes and reals: leaves (name, role, rank), operators (name,
    operator, inputs, rank, integer attributes, which attributes are reals), outputs."""
    return (tuple((leaf.name, leaf.role, len(leaf.shape)) for leaf in graph.leaves),
            tuple((n.name, n.op, n.inputs, len(n.shape),
                   tuple((k, v if isinstance(v, int) and not isinstance(v, bool) else float)
                         for k, v in n.attrs)) for n in graph.nodes),
            graph.outputs)


def _parse(text: str):
    """One egglog s-expression as nested tuples of tokens."""
    stack: list[list] = [[]]
    for token in _TOKEN.findall(text):
        if token == "(":
            stack.append([])
        elif token == ")":
            done = tuple(stack.pop())
            stack[-1].append(done)
        else:
            stack[-1].append(token)
    return stack[0][0]


class Unreadable(Exception):
    """A guard this module cannot evaluate as egglog would (a fact of a form it does not know, or an equality
    that binds its right side): no e-graph is taken on its word."""


def _compiled(expr):
    """An egglog i64 expression (`_parse`) with its numbers as ints; raises Unreadable on anything but the
    binary `+ - * / %` that `encoding.poly_expr` writes."""
    if isinstance(expr, str):
        return int(expr) if _NUMBER.fullmatch(expr) else expr
    op, *args = expr
    if op not in _ARITHMETIC or len(args) != 2:
        raise Unreadable(f"({op} ...) with {len(args)} arguments")
    return op, _compiled(args[0]), _compiled(args[1])


def _value(expr, env: Mapping[str, int]) -> int | None:
    """A `_compiled` expression's value as egglog's i64 arithmetic gives it (None where it reads an unbound
    variable or divides by 0)."""
    if type(expr) is int:
        return expr
    if type(expr) is str:
        return env.get(expr)
    op, a, b = expr
    a, b = _value(a, env), _value(b, env)
    if a is None or b is None:
        return None
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        return None
    quotient = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)   # Rust's i64 division truncates
    return quotient if op == "/" else a - b * quotient


_ARITHMETIC = frozenset({"+", "-", "*", "/", "%"})


_RELATIONS: Mapping[str, Callable[[int, int], bool]] = MappingProxyType({
    "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
    "!=": lambda a, b: a != b})


class _Guard:
    """One compiled rule's guarding half, parsed once, evaluated as egglog evaluates it on a match (sizes and
    placement codes), and what its actions build and write. Any fact of another form raises Unreadable."""

    def __init__(self, facts: Sequence[str], variables: Sequence[tuple[str, str]], actions: str,
                 tables: Mapping[str, Sequence[tuple[int, ...]]] = MappingProxyType({}), sizes: Sequence[int] = ()):
        """`sizes`: the mesh's axis sizes, which an `AxisSize` lookup binds (`mesh_encoding.axis_lookup`)."""
        self.variables = tuple(name for name, _ in variables)
        self.tensors = frozenset(name for name, sort in variables if sort == "T")
        self.built = tuple(map(_compiled, _built_sizes(actions, set(self.variables))))
        self.lets, self.writes = _actions(actions, self.tensors)
        self.facts = []
        for fact in facts:
            parsed = _parse(fact)
            head = parsed[0]
            if head.startswith("At") and head[2:].isdigit():
                rank = int(head[2:])
                names = parsed[2:2 + rank]
                if any(_NUMBER.fullmatch(name) for name in names) or parsed[1] not in self.tensors:
                    raise Unreadable(f"a constant size, or a class the pattern does not bind, in {fact}")
                self.facts.append(("at", parsed[1], (names, tuple(map(_compiled, parsed[2 + rank:])))))
            elif head == "=" and len(parsed) == 3 and isinstance(parsed[2], tuple) and parsed[2][0] == AXIS_SIZE:
                if not (_NUMBER.fullmatch(parsed[2][1]) and int(parsed[2][1]) < len(sizes)):
                    raise Unreadable(f"a size of an axis the mesh does not have in {fact}")
                self.facts.append(("=", parsed[1], sizes[int(parsed[2][1])]))
            elif (head == "=" or head in _RELATIONS) and len(parsed) == 3:
                self.facts.append((head, _compiled(parsed[1]), _compiled(parsed[2])))
            elif head.startswith("Lift_") and head in tables:
                self.facts.append(("lift", head, (tuple(map(_compiled, parsed[1:])), tables[head])))
            else:
                raise Unreadable(fact)

    def bound(self, row: Sequence, local: Callable[[int], tuple[int, ...] | None],
              codes: Callable[[int], tuple[int, ...] | None] | None = None) -> dict | None:
        """The variables the match `row` (the pattern's variables) binds, with the sizes its guards read
        (`local`: a class's local shape) and the placement codes (`codes`: a class's; None leaves the codes and
        the lift tables unread); None where its guards refuse it."""
        env = dict(zip(self.variables, row))
        for kind, left, right in self.facts:
            if kind == "at":
                if not _at_holds(env, local(env[left]), None if codes is None else codes(env[left]), *right):
                    return None
                continue
            if kind == "lift":
                if codes is not None and not _lift_holds(env, *right):
                    return None
                continue
            if kind == "=" and type(left) is str and left not in env:
                value = _value(right, env)
                if value is None:
                    raise Unreadable(f"(= {left} ...) reads an unbound variable")
                env[left] = value
                continue
            a, b = _value(left, env), _value(right, env)
            if a is None or b is None:
                raise Unreadable(f"({kind} ...) reads an unbound variable")
            if not (a == b if kind == "=" else _RELATIONS[kind](a, b)):
                return None
        return env

    def sizes(self, row: Sequence, local: Callable[[int], tuple[int, ...] | None]) -> tuple | None:
        """The integer arguments the match `row`'s built e-nodes take from its sizes; None where its guards
        refuse it."""
        env = self.bound(row, local)
        return None if env is None else tuple(_value(expr, env) for expr in self.built)

    def built_classes(self, env: Mapping, index: Mapping[ENode, int]) -> dict[str, int] | None:
        """The class of each term the actions build (`let` variable -> class), found in the e-graph `index`
        (e-node -> class); None where one is not there (the e-graph is not closed under the rule)."""
        classes: dict[str, int] = {}
        for var, op, args in self.lets:
            children, attrs = [], []
            for kind, arg in args:
                if kind == "term":
                    children.append(classes[arg] if arg in classes else env[arg])
                elif kind == "real":
                    attrs.append(arg[1:-1] if arg.startswith('"') else env[arg])
                else:
                    attrs.append(_value(arg, env))
            found = index.get(ENode(op, tuple(children), tuple(attrs)))
            if found is None:
                return None
            classes[var] = found
        return classes

    def writes_hold(self, env: Mapping, classes: Mapping[str, int],
                    local: Callable[[int], tuple[int, ...] | None]) -> bool:
        """Whether every `At` row the actions write (at the sizes `env` binds) is the local shape `local` gives
        the class it is written for: then applying the match adds no second row, at these sizes."""
        return all(tuple(_value(d, env) for d in dims) == local(classes[var]) for var, dims in self.writes)


def _at_holds(env: dict, dims: tuple[int, ...] | None, codes: tuple[int, ...] | None,
              names: Sequence[str], code_names: Sequence) -> bool:
    """Whether a class of local shape `dims` and placement `codes` (None: not read) is a row of an `At` atom
    binding `names` (variables) and `code_names` (variables or constants), binding them in `env`."""
    if dims is None or len(dims) != len(names):
        return False
    for name, value in zip(names, dims):
        if env.setdefault(name, value) != value:
            return False
    for name, value in zip(code_names, codes or ()):
        if name != value if type(name) is int else env.setdefault(name, value) != value:
            return False
    return True


def _lift_holds(env: dict, columns: Sequence, rows: Sequence[tuple[int, ...]]) -> bool:
    """Whether a lift table (a relation of placement codes, one row per combination of its bound columns:
    `lifting._table`) holds a row agreeing with `env` on its bound columns, binding the others in `env`."""
    for table_row in rows:
        if all(name == value if type(name) is int else env.get(name, value) == value
               for name, value in zip(columns, table_row)):
            env.update((name, value) for name, value in zip(columns, table_row) if type(name) is str)
            return True
    return False


def _actions(actions: str, tensors: frozenset[str]) -> tuple[tuple, tuple]:
    """The terms `actions` build, in order (`let` variable, e-node operator as the snapshot names it, arguments
    as (kind, value): "term" a tensor variable, "real" a string literal or variable, "int" a `_compiled`
    expression), and the `At` rows they write (variable, `_compiled` local sizes)."""
    lets, writes, terms = [], [], set(tensors)
    for form in _parse(f"({actions})"):
        if not isinstance(form, tuple) or not form:
            continue
        if form[0] == "let":
            term = form[2]
            args = tuple(("term", a) if isinstance(a, str) and a in terms
                         else ("real", a) if isinstance(a, str) and (a.startswith('"') or a.startswith("r_"))
                         else ("int", _compiled(a)) for a in term[1:])
            lets.append((form[1], term[0].split("_", 1)[1], args))
            terms.add(form[1])
        elif form[0].startswith("At") and form[0][2:].isdigit():
            writes.append((form[1], tuple(map(_compiled, form[2:2 + int(form[0][2:])]))))
    return tuple(lets), tuple(writes)


def _built_sizes(actions: str, bound: set[str]) -> tuple:
    """The integer arguments of the e-nodes `actions` build that read a variable the pattern does not bind (a
    size: `unflatten(x, d, n / p)` of a vocabulary split)."""
    out = []
    for form in _parse(f"({actions})"):
        if not (isinstance(form, tuple) and form and form[0] == "let"):
            continue
        for arg in form[2][1:]:
            names = set(_TOKEN.findall(" ".join(_flat(arg)))) - {"(", ")"}
            if any(re.fullmatch(r"[A-Za-z_]\w*", n) and n not in bound and not re.fullmatch(r"t\d+", n)
                   for n in names):
                out.append(arg)
    return tuple(out)


def _flat(expr) -> list[str]:
    return [expr] if isinstance(expr, str) else [t for part in expr for t in _flat(part)]


def _graph_shapes(graph: Graph, names: Mapping[str, int]) -> dict[int, tuple[int, ...]] | None:
    """The classes of `graph`'s tensors (and pins) with their shapes; None where two of them share a class at
    different shapes."""
    shapes = graph.shapes()
    out: dict[int, tuple[int, ...]] = {}
    for name, cid in names.items():
        shape = tuple(shapes[name.removeprefix(_PIN)])
        if out.setdefault(cid, shape) != shape:
            return None
    return out


def class_shapes(snapshot: Snapshot, graph: Graph, names: Mapping[str, int], library: Library,
                 memo: dict) -> dict[int, tuple[int, ...]] | None:
    """Every class's global shape at `graph`'s sizes, worked out bottom-up from the graph's tensors through the
    e-nodes (a parallel operator keeps its input's shape, a compute operator's is its instance's); None where
    a class gets two shapes, or none, or an e-node does not instantiate."""
    shape = _graph_shapes(graph, names)
    if shape is None:
        return None
    leaves = {leaf.name: tuple(leaf.shape) for leaf in graph.leaves}
    pending = list(shape)
    for cid, nodes in snapshot.classes.items():
        for node in nodes:
            if node.op == "leaf":
                found = leaves.get(str(node.attrs[0]).removesuffix(PIN_SUFFIX))
            elif not node.children:   # a constant made from sizes (`causal_mask`): its own shape function
                found = _node_shape(node, [], library, memo)
            else:
                continue
            if found is None or shape.setdefault(cid, found) != found:
                return None
            pending.append(cid)
    readers, kids = snapshot.readers, snapshot.kids
    while pending:
        for nid in readers.get(pending.pop(), ()):
            cid, index = nid
            if any(k not in shape for k in kids[nid]):
                continue
            node = snapshot.classes[cid][index]
            found = _node_shape(node, [shape[k] for k in node.children], library, memo)
            if found is None:
                return None
            known = shape.get(cid)
            if known is None:
                shape[cid] = found
                pending.append(cid)
            elif known != found:
                return None
    return shape if len(shape) == len(snapshot.classes) else None


def _node_shape(node: ENode, children: Sequence[tuple[int, ...]], library: Library,
                memo: dict) -> tuple[int, ...] | None:
    if node.op in PARALLEL_OPS:
        return children[0]   # a parallel operator changes the spread, never the value
    op = library.ops.get(node.op)
    if op is None:
        return None
    attrs = {p.name: float(v) if p.type.kind == "real" else int(v) for p, v in zip(op.attr_params, node.attrs)}
    try:
        instance = instance_for(op, children, attrs, memo)
    except Exception:   # noqa: BLE001 - an e-node that does not instantiate: no shape, no reuse
        return None
    return tuple(int(d.constant) for d in instance.output_shape)


def _locals(snapshot: Snapshot, shapes: Mapping[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]] | None:
    """Each class's local shape at `shapes` (its placement's shards dividing each dim); None where one does
    not divide."""
    mesh, out = snapshot.mesh, {}
    for cid, dims in shapes.items():
        where = snapshot.placement.get(cid)
        if where is None:
            continue
        local = []
        for i, d in enumerate(dims):
            factor = prod(mesh.size(a) for a in where.shard_axes(i))
            if d % factor:
                return None
            local.append(d // factor)
        out[cid] = tuple(local)
    return out


def real_renaming(like: Graph, graph: Graph, program: RuleProgram) -> dict[str, str] | None:
    """`like`'s reals -> `graph`'s, position by position (only those that differ); None where that is not
    one-to-one or moves a real a rule writes as a literal."""
    moved: dict[str, str] = {}
    for a, b in zip(like.nodes, graph.nodes):
        for (_, x), (_, y) in zip(a.attrs, b.attrs):
            if isinstance(x, float) or isinstance(y, float):
                x, y = repr(float(x)), repr(float(y))
                if moved.setdefault(x, y) != y:
                    return None
    moved = {x: y for x, y in moved.items() if x != y}
    if not moved:
        return moved
    kept = {repr(float(v)) for node in graph.nodes for _, v in node.attrs if isinstance(v, float)} - set(moved.values())
    literals = set(re.findall(r'"(-?[0-9][^"]*)"', program.text()))
    touched = set(moved) | set(moved.values())
    if len(set(moved.values())) != len(moved) or touched & literals or set(moved.values()) & (kept | set(moved)):
        return None
    return moved


def _renamed_node(node: ENode, names: Mapping[str, str]) -> ENode:
    if node.op == "leaf" or not any(isinstance(a, str) and a in names for a in node.attrs):
        return node
    return ENode(node.op, node.children, tuple(names.get(a, a) if isinstance(a, str) else a for a in node.attrs))


class _RenamedMade(Mapping):
    """Provenance rows looked up through a renaming of reals (the rows hold `like`'s)."""

    def __init__(self, made: Mapping[ENode, frozenset[str]], back: Mapping[str, str]):
        self._made, self._back = made, back

    def __getitem__(self, node: ENode) -> frozenset[str]:
        return self._made[_renamed_node(node, self._back)]

    def get(self, node, default=None):
        try:
            return self[node]
        except KeyError:
            return default

    def __iter__(self) -> Iterator[ENode]:
        forward = {b: a for a, b in self._back.items()}
        return (_renamed_node(node, forward) for node in self._made)

    def __len__(self) -> int:
        return len(self._made)


class _RenamedApplied(Mapping):
    """A rule's applications with their e-nodes' reals renamed, worked out when asked for."""

    def __init__(self, applied: Mapping[str, tuple[Application, ...]], names: Mapping[str, str]):
        self._applied, self._names, self._done = applied, names, {}

    def __getitem__(self, rule: str) -> tuple[Application, ...]:
        if rule not in self._done:
            rename = lambda nodes: tuple(_renamed_node(n, self._names) for n in nodes)   # noqa: E731
            self._done[rule] = tuple(Application(a.rule, rename(a.reads), rename(a.builds))
                                     for a in self._applied[rule])
        return self._done[rule]

    def __iter__(self):
        return iter(self._applied)

    def __len__(self) -> int:
        return len(self._applied)


def _alike(program: RuleProgram, matches: Mapping[str, list[tuple]], like: Mapping[int, tuple[int, ...]],
           other: Mapping[int, tuple[int, ...]], codes: Mapping[int, tuple[int, ...]],
           index: Mapping[ENode, int], sizes: Sequence[int]) -> bool:
    """Whether every rule's guards, on every match of its pattern, decide alike at the local shapes `like` and
    `other` (the placement `codes` the same at both), the e-nodes a passing match builds take the same
    arguments at both and are in the e-graph (`index`), and the `At` rows it writes are, at each, the local
    shapes of the classes it writes them for (raises Unreadable); `sizes` are the mesh's axes' (`AxisSize`, the
    same for both graphs). A match whose classes all keep their local
    shape reads the same sizes at both (the guards read sizes through `At` atoms of the match's classes alone)
    and builds classes that keep theirs, so only the others are evaluated (an integer of the match that
    happens to equal a moved class's id only costs an evaluation)."""
    moved = {cid for cid, shape in like.items() if other.get(cid) != shape}
    for rule in program.rules:
        rows = [row for row in matches.get(rule.key, ()) if not moved.isdisjoint(row)]
        if not rows:
            continue
        guard = _Guard(rule.body.facts, rule.body.variables(), rule.body.actions,
                       {name: table for name, _, table in rule.tables}, sizes)
        for row in rows:
            before, after = guard.bound(row, like.get, codes.get), guard.bound(row, other.get, codes.get)
            if before is None or after is None:
                if before is not after:
                    return False
                continue
            if any(_value(e, before) != _value(e, after) for e in guard.built):
                return False
            # egglog applied this match (its guards hold at `like`'s sizes), so what it builds is there
            classes = guard.built_classes(before, index)
            if classes is None or not (guard.writes_hold(before, classes, like.get)
                                       and guard.writes_hold(after, classes, other.get)):
                return False
    return True


def resized(snapshot: Snapshot, names: Mapping[str, int], program: RuleProgram,
            matches: Mapping[str, list[tuple]] | None, like: Graph, graph: Graph, library: Library,
            memo: dict | None = None) -> Snapshot | None:
    """The saturated e-graph `snapshot` of `like` (`names`: its tensors' classes; `matches`: every rule's pattern
    matches, `Session.match_rows`, None where they were not read) as `graph`'s saturation would leave it, or None
    where the module docstring's conditions do not all hold and `graph` must be saturated itself."""
    memo = {} if memo is None else memo
    if matches is None or structure(like) != structure(graph):
        return None
    reals = real_renaming(like, graph, program)
    if reals is None:
        return None
    before = class_shapes(snapshot, like, names, library, memo)
    if before != dict(snapshot.shape):
        return None   # the shape functions do not give the e-graph's own shapes back: nothing to rely on
    after = class_shapes(snapshot, graph, names, library, memo)
    local_like = _locals(snapshot, snapshot.shape)
    local_graph = after and _locals(snapshot, after)
    if local_like is None or local_graph is None:
        return None
    try:
        index = {node: cid for cid, nodes in snapshot.classes.items() for node in nodes}
        codes = {cid: where.codes for cid, where in snapshot.placement.items()}
        if not _alike(program, matches, local_like, local_graph, codes, index, snapshot.mesh.shape):
            return None
    except Unreadable:
        return None
    classes = snapshot.classes
    made, applied = snapshot.made, snapshot.applied
    if reals:
        classes = {cid: tuple(_renamed_node(n, reals) for n in nodes) for cid, nodes in classes.items()}
        made = _RenamedMade(made, {b: a for a, b in reals.items()})
        applied = _RenamedApplied(applied, reals)
    return replace(snapshot, classes=classes, shape=after, made=made, applied=applied)
