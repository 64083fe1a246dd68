"""The JSON schemas (names, versions) and the structural validation of what parsat reads: graphs, plans, machines.

Graph, plan and machine files come from users and other tools, so nothing
in them is trusted. The loaders (`Graph.from_dict`, `load_plan_dict`,
`Machine.from_dict`, `parsat explain`) call these checks *before* they
index into the data, so a malformed file is refused with parsat's own
error (GraphError, PlanError, MachineError) whose message names the field
path (`nodes[2].shape[0]`) and, where there is one, the node, instead of
surfacing as a KeyError/TypeError/RecursionError stack trace deep inside
the optimizer or on a rank. Semantics (operators, shape inference) stay
with the loaders; this module only guarantees the shapes of the data.

Files are read by `json_files` (a size cap, UTF-8, no unpickling) before
they reach these checks.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NoReturn

from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.ir.errors import GraphError, MachineError

# The schemas' names and versions: every writer stamps them, every reader checks them.
GRAPH_SCHEMA = "parsat.graph"
GRAPH_VERSION = 1
MACHINE_SCHEMA = "parsat.machine"
MACHINE_VERSION = 2             # 2: precision, peaks, efficiency, comm (ir.machine_profile)
PLAN_SCHEMA = "parsat.plan"
PLAN_VERSION = 2               # 2: each baseline carries its PCG (`baselines.NAME.pcg`)
READABLE_VERSIONS = (1, 2)     # plan versions read; version 1 lacks only the baselines' PCGs

# Largest tensor (elements): the cost model does float64 arithmetic on element
# counts and the backend indexes with int64, so beyond 2**53 numbers lose exactness.
MAX_ELEMENTS = 2 ** 53
MAX_DEVICES = 1 << 20
MAX_NUMBER = 2 ** 1000  # an integer beyond this has no float (OverflowError in the cost model and explain)
PLAN_KINDS = ("leaf", "op", "parallel")
PARALLEL_ATTRS = {name: op.attrs for name, op in PARALLEL_OPS.items()}   # a parallel node's `attrs` keys
EXPLAIN_TOTALS = ("time_s", "compute_s", "comm_s", "comm_elements", "comm_bytes", "peak_memory_bytes",
                  "grad_sync_elements")


# ----------------------------------------------------------------- primitives


class _Fields:
    """Type checks that raise `error` with the field path in the message."""

    def __init__(self, error: type[Exception], prefix: str = ""):
        self.error = error
        self.prefix = prefix

    def fail(self, path: str, message: str) -> NoReturn:
        where = f"{self.prefix}{path}" if path else (self.prefix.rstrip(".: ") or "the file")
        raise self.error(f"{where}: {message}")

    def obj(self, value: Any, path: str) -> Mapping:
        if not isinstance(value, Mapping):
            self.fail(path, f"must be a JSON object, got {_kind(value)}")
        return value

    def array(self, value: Any, path: str) -> list:
        if not isinstance(value, list):
            self.fail(path, f"must be a JSON array, got {_kind(value)}")
        return value

    def text(self, value: Any, path: str, empty: bool = False) -> str:
        if not isinstance(value, str):
            self.fail(path, f"must be a string, got {_kind(value)}")
        if not empty and not value:
            self.fail(path, "must not be empty")
        return value

    def integer(self, value: Any, path: str, low: int | None = None, high: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"must be an integer, got {_kind(value)}")
        if low is not None and value < low:
            self.fail(path, f"must be at least {low}, got {value}")
        if high is not None and value > high:
            self.fail(path, f"must be at most {high}, got {_short(value)}")
        return value

    def number(self, value: Any, path: str, nullable: bool = False) -> float | int | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(path, f"must be a number, got {_kind(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(path, f"must be a finite number, got {value}")
        if isinstance(value, int) and abs(value) > MAX_NUMBER:  # float(value) would overflow downstream
            self.fail(path, f"must be a finite number, got {_short(value)}")
        return value

    def shape(self, value: Any, path: str) -> tuple[int, ...]:
        dims = tuple(self.integer(d, f"{path}[{i}]", low=1, high=MAX_ELEMENTS)
                     for i, d in enumerate(self.array(value, path)))
        if math.prod(dims) > MAX_ELEMENTS:
            self.fail(path, f"{list(dims)} has {_short(math.prod(dims))} elements, more than parsat handles "
                            f"(2**53)")
        return dims

    def get(self, data: Mapping, key: str, path: str) -> Any:
        if key not in data:
            self.fail(path, f"the field '{key}' is missing")
        return data[key]


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    label = names.get(type(value), type(value).__name__)
    if isinstance(value, (bool, int, float)) or value is None:
        return f"{label} ({_short(value)})"
    if isinstance(value, str):
        return f"{label} ({_short(value)!r})" if len(value) <= 40 else label
    return label


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:20] + "..." + f" ({len(text)} digits)"


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


# ---------------------------------------------------------------------- graphs


def validate_graph_dict(data: Any, error: type[Exception] = GraphError, prefix: str = "") -> None:
    """Check a graph JSON object's structure (docs/graph-schema.md) before it is built.

    Refuses: a non-object, a wrong schema or version, fields of the wrong
    type, non-positive or overflowing dims, nodes whose inputs are never
    defined (dangling edges) or only defined later (cycles, or nodes out of
    topological order), and outputs that name nothing. Operators, arities
    and shapes are checked by the builder (dsl.instantiate).
    """
    f = _Fields(error, prefix)
    data = f.obj(data, "")
    if "schema" in data and data["schema"] != GRAPH_SCHEMA:
        f.fail("schema", f"not a parsat graph (schema {_short(data['schema'])!r}, expected {GRAPH_SCHEMA!r})")
    if "version" in data:
        version = data["version"]
        if isinstance(version, bool) or not isinstance(version, int):
            f.fail("version", f"must be the integer {GRAPH_VERSION}, got {_kind(version)}")
        if version != GRAPH_VERSION:
            f.fail("version", f"graph schema version {_short(version)} is not supported (this parsat reads "
                              f"{GRAPH_VERSION})")
    if "name" in data:
        f.text(data["name"], "name", empty=True)
    defined: set[str] = set()
    places: dict[str, str] = {}  # name -> where it is defined, for duplicate names
    for key in ("inputs", "weights"):
        for i, item in enumerate(f.array(data.get(key, []), key)):
            path = f"{key}[{i}]"
            item = f.obj(item, path)
            name = f.text(f.get(item, "name", path), f"{path}.name")
            f.shape(f.get(item, "shape", path), f"{path}.shape")
            if name in places:
                f.fail(f"{path}.name", f"the name '{name}' is used twice ({places[name]} and {path})")
            places[name] = path
            defined.add(name)
    nodes = f.array(data.get("nodes", []), "nodes")
    for i, item in enumerate(nodes):
        if isinstance(item, Mapping) and isinstance(item.get("name"), str):
            name = item["name"]
            if name in places:
                f.fail(f"nodes[{i}].name", f"the name '{name}' is used twice ({places[name]} and nodes[{i}])")
            places[name] = f"nodes[{i}]"
    all_names = set(places)
    for i, item in enumerate(nodes):
        path = f"nodes[{i}]"
        item = f.obj(item, path)
        name = item.get("name")
        if name is not None:
            f.text(name, f"{path}.name")
            path = f"{path} ('{name}')"
        f.text(f.get(item, "op", path), f"{path}.op")
        for j, ref in enumerate(f.array(item.get("inputs", []), f"{path}.inputs")):
            f.text(ref, f"{path}.inputs[{j}]")
            if ref not in defined:
                if ref in all_names:
                    f.fail(f"{path}.inputs[{j}]", f"'{ref}' is defined later in the file: nodes must be in "
                                                  "topological order (is there a cycle?)")
                f.fail(f"{path}.inputs[{j}]", f"'{ref}' is not an input, weight or node of the graph")
        attrs = f.obj(item.get("attrs", {}), f"{path}.attrs")
        for key, value in attrs.items():
            f.number(value, f"{path}.attrs.{key}")
        if "shape" in item:
            f.shape(item["shape"], f"{path}.shape")
        if name is not None:
            defined.add(name)
    outputs = f.array(data.get("outputs", []), "outputs")
    for i, ref in enumerate(outputs):
        f.text(ref, f"outputs[{i}]")


def check_graph_sizes(shapes: Mapping[str, tuple[int, ...]], error: type[Exception] = GraphError) -> None:
    """Refuse inferred shapes that overflow (a flatten or concat of large dims)."""
    for name, shape in shapes.items():
        if math.prod(shape) > MAX_ELEMENTS:
            raise error(f"node '{name}': its shape {list(shape)} has {_short(math.prod(shape))} elements, more "
                        "than parsat handles (2**53)")


# ---------------------------------------------------------------------- plans


def validate_plan_dict(data: Mapping, error: type[Exception], label: str) -> None:
    """The structure every plan reader needs (backend, explain, show): devices, graph, nodes, outputs.

    Node ids must be unique; every input id must name an *earlier* node
    (a later id is a cycle or an order error, an unknown id a dangling
    edge); spreads must match the node's rank.
    """
    f = _Fields(error, f"{label}: ")
    f.integer(f.get(data, "devices", ""), "devices", low=1, high=MAX_DEVICES)
    validate_graph_dict(f.get(data, "graph", ""), error, f"{label}: graph.")
    _check_pcg(f, data, "")
    for name, baseline in f.obj(data.get("baselines") or {}, "baselines").items():
        if isinstance(baseline, Mapping) and ("pcg" in baseline or "nodes" in baseline):
            source = baseline.get("pcg", baseline)
            at = f"baselines.{name}.pcg." if "pcg" in baseline else f"baselines.{name}."
            _check_pcg(f, f.obj(source, at.rstrip(".")), at)
    if "totals" in data and data["totals"] is not None:
        totals = f.obj(data["totals"], "totals")
        for key, value in totals.items():
            f.number(value, f"totals.{key}", nullable=True)


def _check_pcg(f: _Fields, data: Mapping, at: str) -> None:
    """Nodes and outputs of a PCG (the plan's, or a baseline's under `at`), as `validate_plan_dict` says."""
    where = at.rstrip(".")
    nodes = f.array(f.get(data, "nodes", where), f"{at}nodes")
    if not nodes:
        f.fail(f"{at}nodes", "the plan has no nodes")
    seen: dict[int, str] = {}
    all_ids = {n.get("id") for n in nodes if isinstance(n, Mapping) and isinstance(n.get("id"), int)}
    for i, node in enumerate(nodes):
        path = f"{at}nodes[{i}]"
        node = f.obj(node, path)
        ident = f.integer(f.get(node, "id", path), f"{path}.id", low=0)
        if ident in seen:
            f.fail(f"{path}.id", f"id {ident} is used twice")
        kind = f.text(f.get(node, "kind", path), f"{path}.kind")
        if kind not in PLAN_KINDS:
            f.fail(f"{path}.kind", f"must be one of {', '.join(PLAN_KINDS)}, got {kind!r}")
        op = f.text(f.get(node, "op", path), f"{path}.op")
        path = f"{path} (#{ident} {op})"
        inputs = f.array(f.get(node, "inputs", path), f"{path}.inputs")
        for j, ref in enumerate(inputs):
            f.integer(ref, f"{path}.inputs[{j}]")
            if ref not in seen:
                reason = ("is a later node: nodes must be in topological order (is there a cycle?)"
                          if ref in all_ids else "is not a node of the plan")
                f.fail(f"{path}.inputs[{j}]", f"node {ref} {reason}")
        if kind == "leaf" and inputs:
            f.fail(f"{path}.inputs", "a leaf has no inputs")
        if kind == "parallel":
            if op not in PARALLEL_ATTRS:
                f.fail(f"{path}.op", f"a parallel node must be one of {', '.join(PARALLEL_ATTRS)}, got {op!r}")
            if len(inputs) != 1:
                f.fail(f"{path}.inputs", f"{op} takes one input, got {len(inputs)}")
        attrs = f.obj(f.get(node, "attrs", path), f"{path}.attrs")
        for key, value in attrs.items():
            f.number(value, f"{path}.attrs.{key}")
        if kind == "parallel":
            for key in PARALLEL_ATTRS[op]:
                f.integer(f.get(attrs, key, f"{path}.attrs"), f"{path}.attrs.{key}",
                          low=1 if key == "degree" else 0)
        shape = f.shape(f.get(node, "shape", path), f"{path}.shape")
        spread = f.obj(f.get(node, "spread", path), f"{path}.spread")
        shard = f.array(f.get(spread, "shard", f"{path}.spread"), f"{path}.spread.shard")
        for j, degree in enumerate(shard):
            f.integer(degree, f"{path}.spread.shard[{j}]", low=1, high=MAX_DEVICES)
        if len(shard) != len(shape):
            f.fail(f"{path}.spread.shard", f"has {len(shard)} dims but the shape {list(shape)} has {len(shape)}")
        for key in ("copy", "sum"):
            if key in spread:
                f.integer(spread[key], f"{path}.spread.{key}", low=1, high=MAX_DEVICES)
        for key in ("role", "origin"):
            if key in node:
                f.text(node[key], f"{path}.{key}", empty=True)
        seen[ident] = op
    outputs = f.array(f.get(data, "outputs", where), f"{at}outputs")
    if not outputs:
        f.fail(f"{at}outputs", "the plan has no outputs")
    for i, out in enumerate(outputs):
        out = f.obj(out, f"{at}outputs[{i}]")
        f.text(f.get(out, "name", f"{at}outputs[{i}]"), f"{at}outputs[{i}].name")
        ref = f.integer(f.get(out, "node", f"{at}outputs[{i}]"), f"{at}outputs[{i}].node")
        if ref not in seen:
            f.fail(f"{at}outputs[{i}].node", f"node {ref} is not a node of the plan")


def validate_plan_report(data: Mapping, error: type[Exception], label: str) -> None:
    """What `explain` and `show` read on top of the structure: machine, totals, baselines, node costs."""
    f = _Fields(error, f"{label}: ")
    machine = f.obj(f.get(data, "machine", ""), "machine")
    f.text(f.get(machine, "name", "machine"), "machine.name", empty=True)
    f.integer(f.get(machine, "devices_per_node", "machine"), "machine.devices_per_node", low=1)
    totals = f.obj(f.get(data, "totals", ""), "totals")
    for key in EXPLAIN_TOTALS:
        f.number(f.get(totals, key, "totals"), f"totals.{key}")
    baselines = f.obj(data.get("baselines", {}), "baselines")
    for name, value in baselines.items():
        if value is not None:
            value = f.obj(value, f"baselines.{name}")
            for key in EXPLAIN_TOTALS:
                f.number(f.get(value, key, f"baselines.{name}"), f"baselines.{name}.{key}")
    for i, node in enumerate(data["nodes"]):
        path = f"nodes[{i}]"
        cost = f.obj(f.get(node, "cost", path), f"{path}.cost")
        for key in ("time_s", "comm_elements", "memory_bytes"):
            f.number(f.get(cost, key, f"{path}.cost"), f"{path}.cost.{key}")
        for j, item in enumerate(f.array(f.get(cost, "collectives", f"{path}.cost"), f"{path}.cost.collectives")):
            f.text(item, f"{path}.cost.collectives[{j}]", empty=True)
    pinned = f.obj(data.get("pinned_spreads", {}), "pinned_spreads")
    for name, spread in pinned.items():
        spread = f.obj(spread, f"pinned_spreads.{name}")
        for j, degree in enumerate(f.array(f.get(spread, "shard", f"pinned_spreads.{name}"),
                                           f"pinned_spreads.{name}.shard")):
            f.integer(degree, f"pinned_spreads.{name}.shard[{j}]", low=1)
        for key in ("copy", "sum"):
            if key in spread:
                f.integer(spread[key], f"pinned_spreads.{name}.{key}", low=1)
    for j, rule in enumerate(f.array(data.get("rules_used", []), "rules_used")):
        f.text(rule, f"rules_used[{j}]")
    sat = data.get("saturation") or {}
    sat = f.obj(sat, "saturation")
    for key in ("seconds", "compile_seconds"):
        if key in sat:
            f.number(sat[key], f"saturation.{key}")
    compiled = f.obj(sat.get("rules_compiled") or {}, "saturation.rules_compiled")
    for key, value in compiled.items():
        f.number(value, f"saturation.rules_compiled.{key}")
    ext = f.obj(data.get("extraction") or {}, "extraction")
    for key, value in f.obj(ext.get("candidates") or {}, "extraction.candidates").items():
        f.number(value, f"extraction.candidates.{key}", nullable=True)


# -------------------------------------------------------------------- machines


def validate_machine_dict(data: Any, fields: Mapping[str, type | str]) -> None:
    """A machine description: an object whose known fields have the right types (MachineError).

    `fields` maps field name to its type or its annotation text ("int").
    """
    f = _Fields(MachineError, "machine ")
    data = f.obj(data, "description")
    for key, kind in fields.items():
        kind = getattr(kind, "__name__", kind)
        if key not in data:
            continue
        if kind == "str":
            f.text(data[key], key, empty=True)
        elif kind == "int":
            f.integer(data[key], key)
        else:
            f.number(data[key], key)
