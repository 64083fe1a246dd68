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
import re
from typing import Any, Mapping, NoReturn, Sequence

from parsat.dsl import ast
from parsat.dsl.bounds import figure
from parsat.dsl.instantiate import SCALAR_FUNCTIONS, InstantiationError
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.ir.errors import GraphError, MachineError
from parsat.ir.instance import instance_for
from parsat.ir.pcg import SHARDED_STATE_STAGES
from parsat.ir.recompute import POLICIES as RECOMPUTE_POLICIES

# The schemas' names and versions: every writer stamps them, every reader checks them.
GRAPH_SCHEMA = "parsat.graph"
GRAPH_VERSION = 1
MACHINE_SCHEMA = "parsat.machine"
MACHINE_VERSION = 2             # 2: precision, peaks, efficiency, comm (ir.machine_profile)
PLAN_SCHEMA = "parsat.plan"
PLAN_VERSION = 3               # 3: a device mesh, a placement per node, parallel operators on mesh axes
READABLE_VERSIONS = (3,)       # versions 1 and 2 predate device meshes: their plans say how many pieces, not where

# Largest tensor (elements): the cost model does float64 arithmetic on element
# counts and the backend indexes with int64, so beyond 2**53 numbers lose exactness.
MAX_ELEMENTS = 2 ** 53
MAX_DEVICES = 1 << 20
MAX_NUMBER = 2 ** 1000  # an integer beyond this has no float (OverflowError in the cost model and explain)
PLAN_KINDS = ("leaf", "op", "parallel")
LINE_BREAKS = ("\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")   # str.splitlines' line ends
_LINE_BREAK = re.compile("[" + re.escape("".join(LINE_BREAKS)) + "]")   # one scan, not one per mark: 100,001 names

PARALLEL_ATTRS = {name: op.plan_attrs for name, op in PARALLEL_OPS.items()}   # a parallel node's `attrs` keys
PLACEMENT = re.compile(r"^(Shard\((0|[1-9][0-9]{0,2})\)|Replicate\(\)|Partial\(\))$")
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
        if type(value) is not dict and not isinstance(value, Mapping):   # a dict skips the slow ABC check
            self.fail(path, f"must be a JSON object, got {_kind(value)}")
        return value

    def array(self, value: Any, path: str) -> list:
        if not isinstance(value, list):
            self.fail(path, f"must be a JSON array, got {_kind(value)}")
        return value

    def text(self, value: Any, path: str, empty: bool = False, lines: bool = False) -> str:
        """A string; one line unless `lines`: a name holding a line break printed a forged `parsat: error:`
        line wherever it was shown (other control characters are shown escaped, `parsat.terminal`)."""
        if not isinstance(value, str):
            self.fail(path, f"must be a string, got {_kind(value)}")
        if not empty and not value:
            self.fail(path, "must not be empty")
        if not lines and _LINE_BREAK.search(value):
            self.fail(path, f"must be one line, without line breaks, got {_short(value)!r}")
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
            if key == "inputs" and "constant" in item and not isinstance(item["constant"], bool):
                f.fail(f"{path}.constant", f"must be true or false, got {_kind(item['constant'])}")
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
    if "microbatches" in data:
        f.integer(data["microbatches"], "microbatches", low=1, high=1 << 20)
    if "example" in data:
        example = f.obj(data["example"], "example")
        f.text(f.get(example, "name", "example"), "example.name")
        for key, value in f.obj(example.get("sizes", {}), "example.sizes").items():
            f.integer(value, f"example.sizes.{key}", low=1, high=MAX_ELEMENTS)


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
    if data.get("pipeline") is not None:
        _check_pipeline(f, f.obj(data["pipeline"], "pipeline"), data)
    if "totals" in data and data["totals"] is not None:
        totals = f.obj(data["totals"], "totals")
        for key, value in totals.items():
            if key != "step":
                f.number(value, f"totals.{key}", nullable=True)
        check_simulated_step(f, totals, "totals")


def _check_pipeline(f: _Fields, pipeline: Mapping, data: Mapping) -> None:
    """A plan's `pipeline` object: every chunk on a stage, every node it names a node of the PCG, every crossing
    between chunks that exist, and the plan's devices the stages times each stage's."""
    degree = f.integer(f.get(pipeline, "degree", "pipeline"), "pipeline.degree", low=1, high=MAX_DEVICES)
    schedule = f.text(f.get(pipeline, "schedule", "pipeline"), "pipeline.schedule")
    if schedule not in ("gpipe", "1f1b", "interleaved"):
        f.fail("pipeline.schedule", f"must be gpipe, 1f1b or interleaved, got {_short(schedule)}")
    f.integer(f.get(pipeline, "microbatches", "pipeline"), "pipeline.microbatches", low=1)
    stage_devices = f.integer(f.get(pipeline, "stage_devices", "pipeline"), "pipeline.stage_devices", low=1,
                              high=MAX_DEVICES)
    if isinstance(data.get("devices"), int) and degree * stage_devices != data["devices"]:
        f.fail("pipeline.stage_devices", f"{degree} stages of {stage_devices} devices are not the plan's "
                                         f"{data['devices']} devices")
    layout = f.obj(f.get(pipeline, "layout", "pipeline"), "pipeline.layout")
    ids = {n.get("id") for n in data.get("nodes", []) if isinstance(n, Mapping)}
    chunks = f.array(f.get(layout, "chunks", "pipeline.layout"), "pipeline.layout.chunks")
    if not chunks:
        f.fail("pipeline.layout.chunks", "a pipeline has at least one chunk")
    for i, chunk in enumerate(chunks):
        at = f"pipeline.layout.chunks[{i}]"
        chunk = f.obj(chunk, at)
        f.integer(f.get(chunk, "stage", at), f"{at}.stage", low=0, high=degree - 1)
        f.array(f.get(chunk, "layers", at), f"{at}.layers")
        for j, ident in enumerate(f.array(f.get(chunk, "nodes", at), f"{at}.nodes")):
            if ident not in ids:
                f.fail(f"{at}.nodes[{j}]", f"{_short(ident)} is not a node of the plan")
    for i, crossing in enumerate(f.array(layout.get("crossings", []), "pipeline.layout.crossings")):
        at = f"pipeline.layout.crossings[{i}]"
        crossing = f.obj(crossing, at)
        for key in ("source", "target"):
            f.integer(f.get(crossing, key, at), f"{at}.{key}", low=0, high=len(chunks) - 1)
        f.integer(f.get(crossing, "piece_elements", at), f"{at}.piece_elements", low=0)
        if f.get(crossing, "node", at) not in ids:
            f.fail(f"{at}.node", f"{_short(crossing['node'])} is not a node of the plan")


def _check_pcg(f: _Fields, data: Mapping, at: str) -> None:
    """Nodes and outputs of a PCG (the plan's, or a baseline's under `at`), as `validate_plan_dict` says."""
    where = at.rstrip(".")
    axes = _check_mesh(f, f.get(data, "mesh", where), f"{at}mesh")
    nodes = f.array(f.get(data, "nodes", where), f"{at}nodes")
    if not nodes:
        f.fail(f"{at}nodes", "the plan has no nodes")
    seen: dict[int, str] = {}
    all_ids = {n.get("id") for n in nodes if isinstance(n, Mapping) and isinstance(n.get("id"), int)}
    for i, node in enumerate(nodes):
        ident, op = _check_pcg_node(f, node, f"{at}nodes[{i}]", axes, seen, all_ids)
        seen[ident] = op
    _check_pcg_outputs(f, data, at, seen)
    if "recompute" in data and data["recompute"] not in RECOMPUTE_POLICIES:
        f.fail(f"{at}recompute", f"'{_short(data['recompute'])}' is not a recomputation policy "
                                 f"({', '.join(RECOMPUTE_POLICIES)})")
    if "zero" in data and (isinstance(data["zero"], bool) or data["zero"] not in (0, *SHARDED_STATE_STAGES)):
        f.fail(f"{at}zero", f"'{_short(data['zero'])}' is not a ZeRO stage a plan states (0, 1 or 2; stage 3 is "
                            "the layout itself: weights stored split and all-gathered)")


def _check_pcg_node(f: _Fields, node: Any, path: str, axes: Sequence[str], seen: Mapping[int, str],
                    all_ids: set) -> tuple[int, str]:
    """One node of a PCG at `path` (`seen`: the earlier nodes' ids and ops, `all_ids`: every node's id); returns
    its id and op. Once the id and op are known, later messages name the node by them."""
    node = f.obj(node, path)
    ident = f.integer(f.get(node, "id", path), f"{path}.id", low=0)
    if ident in seen:
        f.fail(f"{path}.id", f"id {ident} is used twice")
    kind = f.text(f.get(node, "kind", path), f"{path}.kind")
    if kind not in PLAN_KINDS:
        f.fail(f"{path}.kind", f"must be one of {', '.join(PLAN_KINDS)}, got {kind!r}")
    op = f.text(f.get(node, "op", path), f"{path}.op")
    path = f"{path} (#{ident} {op})"
    _check_node_inputs(f, node, path, kind, op, seen, all_ids)
    _check_node_attrs(f, node, path, kind, op, axes)
    _check_node_layout(f, node, path, axes)
    for key in ("role", "origin"):
        if key in node:
            f.text(node[key], f"{path}.{key}", empty=True)
    for j, rule in enumerate(f.array(node.get("rules", []), f"{path}.rules")):
        f.text(rule, f"{path}.rules[{j}]")
    return ident, op


def _check_node_inputs(f: _Fields, node: Mapping, path: str, kind: str, op: str, seen: Mapping[int, str],
                       all_ids: set) -> None:
    """A node's `inputs`: each an earlier node (a later one is an order error or a cycle, an unknown one a
    dangling edge); none for a leaf, exactly one for a parallel operator (which must be one parsat knows)."""
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


def _check_node_attrs(f: _Fields, node: Mapping, path: str, kind: str, op: str, axes: Sequence[str]) -> None:
    """A node's `attrs`: numbers (a parallel node's axis a name); a parallel node has each attribute its operator
    needs, its axis one of the mesh's, its degree at least 1."""
    attrs = f.obj(f.get(node, "attrs", path), f"{path}.attrs")
    for key, value in attrs.items():
        if not (kind == "parallel" and key == "axis"):
            f.number(value, f"{path}.attrs.{key}")
    if kind == "parallel":
        for key in PARALLEL_ATTRS[op]:
            if key == "axis":
                axis = f.text(f.get(attrs, key, f"{path}.attrs"), f"{path}.attrs.axis")
                if axis not in axes:
                    f.fail(f"{path}.attrs.axis", f"'{axis}' is not an axis of the mesh ({', '.join(axes)})")
            else:
                f.integer(f.get(attrs, key, f"{path}.attrs"), f"{path}.attrs.{key}",
                          low=1 if key == "degree" else 0)


def _check_node_layout(f: _Fields, node: Mapping, path: str, axes: Sequence[str]) -> None:
    """Where a node's tensor lives: its shape, its spread (a degree per dim of the shape), its placement (an
    entry per mesh axis) and the mesh axes it is replicated on."""
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
    placement = f.array(f.get(node, "placement", path), f"{path}.placement")
    if len(placement) != len(axes):
        f.fail(f"{path}.placement", f"has {len(placement)} entries for a mesh of {len(axes)} axes")
    for j, entry in enumerate(placement):
        if not isinstance(entry, str) or not PLACEMENT.match(entry):
            f.fail(f"{path}.placement[{j}]", f"must be Shard(d), Replicate() or Partial(), got {_short(entry)}")
    for j, name in enumerate(f.array(node.get("replicated_on", []), f"{path}.replicated_on")):
        if name not in axes:
            f.fail(f"{path}.replicated_on[{j}]", f"'{_short(name)}' is not an axis of the mesh")


def _check_pcg_outputs(f: _Fields, data: Mapping, at: str, seen: Mapping[int, str]) -> None:
    """A PCG's `outputs`: at least one, each a name and a node of the PCG (`seen`)."""
    outputs = f.array(f.get(data, "outputs", at.rstrip(".")), f"{at}outputs")
    if not outputs:
        f.fail(f"{at}outputs", "the plan has no outputs")
    for i, out in enumerate(outputs):
        out = f.obj(out, f"{at}outputs[{i}]")
        f.text(f.get(out, "name", f"{at}outputs[{i}]"), f"{at}outputs[{i}].name")
        ref = f.integer(f.get(out, "node", f"{at}outputs[{i}]"), f"{at}outputs[{i}].node")
        if ref not in seen:
            f.fail(f"{at}outputs[{i}].node", f"node {ref} is not a node of the plan")


def _check_mesh(f: _Fields, value: Any, path: str) -> list[str]:
    """A mesh object (`{"axes": [{"name", "size"}], "devices_per_node"}`); returns its axis names."""
    mesh = f.obj(value, path)
    names: list[str] = []
    for i, axis in enumerate(f.array(f.get(mesh, "axes", path), f"{path}.axes")):
        axis = f.obj(axis, f"{path}.axes[{i}]")
        name = f.text(f.get(axis, "name", f"{path}.axes[{i}]"), f"{path}.axes[{i}].name")
        if name in names:
            f.fail(f"{path}.axes[{i}].name", f"axis '{name}' is named twice")
        names.append(name)
        f.integer(f.get(axis, "size", f"{path}.axes[{i}]"), f"{path}.axes[{i}].size", low=1, high=MAX_DEVICES)
    f.integer(f.get(mesh, "devices_per_node", path), f"{path}.devices_per_node", low=1, high=MAX_DEVICES)
    return names


def validate_plan_operators(data: Mapping, ops: Mapping[str, ast.OpDecl], error: type[Exception], label: str) -> None:
    """What a backend needs on top of the structure (`validate_plan_dict`, called first): every node means
    something in this library, before any rank starts.

    For the plan's PCG and each baseline's: a compute node names a compute
    operator of `ops` (not a parallel one), with exactly its attributes and
    tensor inputs, and the shape the operator gives at its inputs' shapes;
    a parallel node has exactly its operator's attributes, a dim inside the
    tensor and the shape of its input (a parallel operator moves data, it
    never changes the global shape); a leaf names an input or weight of the
    plan's graph, with its shape.
    """
    f = _Fields(error, f"{label}: ")
    graph = data["graph"]
    leaves = {item["name"]: tuple(item["shape"]) for key in ("inputs", "weights") for item in graph.get(key, [])}
    _check_pcg_operators(f, data, "", ops, leaves)
    for name, baseline in (data.get("baselines") or {}).items():
        if isinstance(baseline, Mapping) and ("pcg" in baseline or "nodes" in baseline):
            at = f"baselines.{name}.pcg." if "pcg" in baseline else f"baselines.{name}."
            _check_pcg_operators(f, baseline.get("pcg", baseline), at, ops, leaves)


def _check_pcg_operators(f: _Fields, data: Mapping, at: str, ops: Mapping[str, ast.OpDecl],
                         leaves: Mapping[str, tuple[int, ...]]) -> None:
    shapes: dict[int, tuple[int, ...]] = {}
    for i, node in enumerate(data["nodes"]):
        kind, op, shape = node["kind"], node["op"], tuple(node["shape"])
        path = f"{at}nodes[{i}] (#{node['id']} {op})"
        attrs, inputs = node["attrs"], [shapes[ref] for ref in node["inputs"]]
        if kind == "leaf":
            if op not in leaves:
                f.fail(f"{path}.op", f"a leaf must name an input or weight of the plan's graph, got {op!r}")
            expected = leaves[op]
        elif kind == "parallel":
            keys = set(PARALLEL_ATTRS[op])
            if set(attrs) != keys:
                f.fail(f"{path}.attrs", f"{op} takes the attributes {', '.join(sorted(keys))}, got "
                                        f"{', '.join(sorted(attrs)) or 'none'}")
            for key in ("dim", "to_dim"):
                if key in attrs and attrs[key] >= len(inputs[0]):
                    f.fail(f"{path}.attrs.{key}", f"{key} {attrs[key]} is not a dim of its input's shape "
                                                  f"{list(inputs[0])}")
            expected = inputs[0]
        else:
            if op in PARALLEL_ATTRS:
                f.fail(f"{path}.kind", f"{op} is a parallel operator: its node's kind must be 'parallel', not {kind!r}")
            decl = ops.get(op)
            if decl is None:
                f.fail(f"{path}.op", f"unknown operator {op!r} (not in the operator library)")
            if len(inputs) != len(decl.tensor_params):
                f.fail(f"{path}.inputs", f"{op} takes {len(decl.tensor_params)} tensor input(s), got {len(inputs)}")
            try:
                instance = instance_for(decl, inputs, attrs)
            except InstantiationError as err:
                given = ", ".join(str(list(s)) for s in inputs)
                f.fail(path, f"{op} of {given}: {err}")
            expected = tuple(int(d.evaluate({})) for d in instance.output_shape)
        if shape != expected:
            f.fail(f"{path}.shape", f"is {list(shape)}, but {op} gives {list(expected)}")
        shapes[node["id"]] = shape


STEP_TOTALS = ("compute_busy_s", "comm_busy_s", "exposed_comm_s", "overlap_s")   # with `step`: the simulated step
LANE_TEXT = re.compile(r"^[A-Za-z ^]{0,1000}$")


def check_simulated_step(f: _Fields, totals: Mapping, path: str) -> None:
    """A totals object's simulated step (docs/plan-schema.md), where it has one: the per-stream totals, the
    profile, the phases and the lanes `explain` draws (letters and spaces, the lanes of one length)."""
    if "node_sum_s" in totals:
        f.number(totals["node_sum_s"], f"{path}.node_sum_s", nullable=True)
    if "step" not in totals:
        return
    for key in STEP_TOTALS:
        f.number(f.get(totals, key, path), f"{path}.{key}")
    step = f.obj(totals["step"], f"{path}.step")
    f.text(f.get(step, "profile", f"{path}.step"), f"{path}.step.profile")
    f.integer(step.get("microbatches", 1), f"{path}.step.microbatches", low=1, high=MAX_ELEMENTS)
    f.number(f.get(step, "peak_memory_bytes", f"{path}.step"), f"{path}.step.peak_memory_bytes")
    for i, phase in enumerate(f.array(f.get(step, "phases", f"{path}.step"), f"{path}.step.phases")):
        where = f"{path}.step.phases[{i}]"
        phase = f.obj(phase, where)
        f.text(f.get(phase, "phase", where), f"{where}.phase")
        for key in ("start_s", "end_s", "compute_s", "comm_s"):
            f.number(f.get(phase, key, where), f"{where}.{key}")
    lanes = f.obj(f.get(step, "lanes", f"{path}.step"), f"{path}.step.lanes")
    for lane in ("compute", "comm", "overlap"):
        text = f.text(f.get(lanes, lane, f"{path}.step.lanes"), f"{path}.step.lanes.{lane}", empty=True,
                      lines=True)
        if not LANE_TEXT.match(text):
            f.fail(f"{path}.step.lanes.{lane}", "must be at most 1000 letters, spaces and carets")
    if len({len(lanes[lane]) for lane in ("compute", "comm", "overlap")}) != 1:
        f.fail(f"{path}.step.lanes", "the compute, comm and overlap lanes must be drawn at one width")


def validate_plan_report(data: Mapping, error: type[Exception], label: str) -> None:
    """What `explain` and `show` read on top of the structure: machine, totals, baselines, node costs."""
    f = _Fields(error, f"{label}: ")
    machine = f.obj(f.get(data, "machine", ""), "machine")
    f.text(f.get(machine, "name", "machine"), "machine.name", empty=True)
    f.integer(f.get(machine, "devices_per_node", "machine"), "machine.devices_per_node", low=1)
    check_machine_ranges(machine, _Fields(error, f"{label}: machine."))
    for section, check in (("efficiency", validate_efficiency_dict), ("comm", validate_comm_dict)):
        if section in machine:
            check(machine[section], error, f"{label}: machine.{section}")
    totals = f.obj(f.get(data, "totals", ""), "totals")
    for key in EXPLAIN_TOTALS:
        f.number(f.get(totals, key, "totals"), f"totals.{key}")
    check_simulated_step(f, totals, "totals")
    baselines = f.obj(data.get("baselines", {}), "baselines")
    for name, value in baselines.items():
        if value is not None:
            value = f.obj(value, f"baselines.{name}")
            for key in EXPLAIN_TOTALS:
                f.number(f.get(value, key, f"baselines.{name}"), f"baselines.{name}.{key}")
            check_simulated_step(f, value, f"baselines.{name}")
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
    for key in ("search_limit", "unspread", "scouted"):
        if key in sat:
            f.text(sat[key], f"saturation.{key}", lines=True)
    compiled = f.obj(sat.get("rules_compiled") or {}, "saturation.rules_compiled")
    for key, value in compiled.items():
        f.number(value, f"saturation.rules_compiled.{key}")
    ext = f.obj(data.get("extraction") or {}, "extraction")
    if "fallback" in ext:
        f.text(ext["fallback"], "extraction.fallback", lines=True)
    for key, value in f.obj(ext.get("candidates") or {}, "extraction.candidates").items():
        f.number(value, f"extraction.candidates.{key}", nullable=True)


# -------------------------------------------------------------------- machines


# The range of each machine field parsat accepts (low, high, unit): wide enough for any device, real or
# made up for a test, narrow enough that the cost model's arithmetic stays finite and meaningful (a
# negative latency made communication pay, a peak of 5e-324 FLOP/s gave steps of infinite seconds).
MACHINE_RANGES: Mapping[str, tuple[float, float, str]] = {
    "devices_per_node": (1, MAX_DEVICES, "devices"),
    "nodes": (1, MAX_DEVICES, "nodes"),
    "peak_flops": (1e3, 1e21, "FLOP/s per device"),
    "memory_bandwidth": (1, 1e18, "bytes/s"),
    "memory_capacity": (1, 1e18, "bytes"),
    "intra_bandwidth": (1, 1e18, "bytes/s"),
    "inter_bandwidth": (1, 1e18, "bytes/s"),
    "intra_latency": (0.0, 3600.0, "seconds"),
    "inter_latency": (0.0, 3600.0, "seconds"),
    "dtype_bytes": (1, 16, "bytes per element"),
}


# What a version-2 machine file holds beyond the flat fields (`ir.machine_profile`; docs/COSTMODEL.md): the
# peaks per precision, the operator efficiency record and the collective profile, each number held to a range
# as above (a negative dispatch cost made operators pay back time; a bucket of 0 bytes never fills).
PROFILE_SECTIONS = ("peaks", "efficiency", "comm", "oversubscribed")
OVERSUBSCRIBED_UNITS = ("cores", "gpus")   # what a calibration's ranks shared (`machine_profile.Oversubscribed`)
MAX_RANKS = 1 << 20
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")
LINK_KINDS = ("intra", "inter")
ELEMENTWISE_KINDS = ("unary", "binary", "broadcast")
"""The kinds of elementwise arithmetic `parsat calibrate` times and `cost.op_time.elementwise_kind` tells apart:
one tensor operand, two of the output's size, one of them broadcast (`OpEfficiency.elementwise_time`)."""
EFFICIENCY_RANGES: Mapping[str, tuple[float, float, str]] = {
    "dispatch_s": (0.0, 3600.0, "seconds"),
    "backward_dispatch_s": (0.0, 3600.0, "seconds"),
    "step_dispatch_s": (0.0, 3600.0, "seconds"),
    "step_backward_dispatch_s": (0.0, 3600.0, "seconds"),
    "step_parallel_s": (0.0, 3600.0, "seconds"),
    "step_node_s": (0.0, 3600.0, "seconds"),
    "step_loss_path_s": (0.0, 3600.0, "seconds"),
    "step_update_sgd_s": (0.0, 3600.0, "seconds"),
    "step_update_adam_s": (0.0, 3600.0, "seconds"),
    "dtensor_dispatch_s": (0.0, 3600.0, "seconds"),
    "dtensor_backward_dispatch_s": (0.0, 3600.0, "seconds"),
    "dtensor_all_reduce_s": (0.0, 3600.0, "seconds"),
    "dtensor_all_gather_s": (0.0, 3600.0, "seconds"),
    "dtensor_reduce_scatter_s": (0.0, 3600.0, "seconds"),
    "fsdp_all_gather_s": (0.0, 3600.0, "seconds"),
    "fsdp_reduce_scatter_s": (0.0, 3600.0, "seconds"),
    "fsdp_all_reduce_s": (0.0, 3600.0, "seconds"),
    "fsdp_forward_param_s": (0.0, 3600.0, "seconds"),
    "fsdp_backward_param_s": (0.0, 3600.0, "seconds"),
    "fsdp_forward_group_s": (0.0, 3600.0, "seconds"),
    "python_instruction_s": (0.0, 3600.0, "seconds"),
    "sequence_factor": (1.0, 100.0, "x an operator timed alone"),
    "fsdp_backward_group_s": (0.0, 3600.0, "seconds"),
    "gemm_half_m": (0.0, MAX_ELEMENTS, "elements"),
    "gemm_half_n": (0.0, MAX_ELEMENTS, "elements"),
    "gemm_half_k": (0.0, MAX_ELEMENTS, "elements"),
    "gemm_peak_fraction": (1e-6, 1.0, "of peak FLOP/s"),
    "memory_half_bytes": (0.0, 1e18, "bytes"),
    "cache_bytes": (0.0, 1e18, "bytes"),
    "cache_bandwidth": (0.0, 1e18, "bytes/s (0: no cache tier)"),
    "random_bandwidth": (0.0, 1e18, "bytes/s (0: not measured)"),
    "attention_efficiency": (1e-6, 1.0, "of peak FLOP/s"),
    "attention_half_flops": (0.0, 1e30, "FLOPs per call"),
    **{f"elementwise_{kind}_s": (0.0, 1e-3, "seconds per element (0: not measured)")
       for kind in ELEMENTWISE_KINDS},
    "loss_s": (0.0, 3600.0, "seconds (0: not measured)"),
    "loss_element_s": (0.0, 1e-3, "seconds per element"),
    "loss_backward_s": (0.0, 3600.0, "seconds"),
    "loss_backward_element_s": (0.0, 1e-3, "seconds per element"),
    **{f"gemm_{layout}_{key}": ranged for layout in ("nt", "tn") for key, ranged in (
        ("rate", (0.0, 1e3, "x peak FLOP/s (0: not measured)")), ("half_m", (0.0, MAX_ELEMENTS, "elements")),
        ("half_n", (0.0, MAX_ELEMENTS, "elements")), ("half_k", (0.0, MAX_ELEMENTS, "elements")))},
}
EFFICIENCY_FLAGS = ("async_dispatch",)
UPDATE_OPTIMIZERS = ("sgd", "adam")   # `update_points`: the optimizers `parsat calibrate` times
COMM_RANGES: Mapping[str, tuple[float, float, str]] = {
    "launch_s": (0.0, 3600.0, "seconds"),
    "tree_bandwidth_factor": (1e-6, 1.0, "of the ring's bus bandwidth"),
    "bucket_bytes": (1, 1e18, "bytes"),
    "first_bucket_bytes": (1, 1e18, "bytes"),
    "bucket_elements": (0, 1e18, "elements (0: bytes only)"),
    "bucket_elements_per_rank": (0, 1e18, "elements per rank of the group (0: bytes only)"),
    "sync_skew": (0.0, 1000.0, "x the compute between collectives"),
    "turn_s": (0.0, 3600.0, "seconds a collective waits for a peer's turn on a shared core"),
}
COMM_INTEGERS = ("bucket_bytes", "first_bucket_bytes", "bucket_elements", "bucket_elements_per_rank")
COMM_FLAGS = ("overlap_grad_reduce",)
POINT_RANGES: Mapping[str, tuple[float, float, str]] = {
    "group": (2, MAX_DEVICES, "devices"),
    "latency_s": (0.0, 3600.0, "seconds"),
    "bus_bandwidth": (1.0, 1e18, "bytes/s"),
}


def validate_machine_dict(data: Any, fields: Mapping[str, type | str], error: type[Exception] = MachineError,
                          prefix: str = "machine ") -> None:
    """A machine description: an object whose known fields have the right types and plausible values.

    `fields` maps a flat field's name to its type or its annotation text
    ("int"); numbers are also held to `MACHINE_RANGES`; the profile
    sections (`PROFILE_SECTIONS`), where present, to theirs.
    """
    f = _Fields(error, prefix)
    data = f.obj(data, "description")
    _known(f, data, ("schema", "version", *fields, *(k for k in (*PROFILE_SECTIONS, "dtype_bytes") if k not in fields)))
    for key, kind in fields.items():
        kind = getattr(kind, "__name__", kind)
        if key not in data or key in PROFILE_SECTIONS:
            continue
        if kind == "str":
            f.text(data[key], key, empty=True)
        elif kind == "int":
            f.integer(data[key], key)
        else:
            f.number(data[key], key)
    check_machine_ranges(data, f)
    if "peaks" in data:
        low, high, unit = MACHINE_RANGES["peak_flops"]
        for name, value in f.obj(data["peaks"], "peaks").items():
            _ranged(f, value, f"peaks.{name}", low, high, unit)
    if "efficiency" in data:
        validate_efficiency_dict(data["efficiency"], error, f"{prefix}efficiency")
    if "comm" in data:
        validate_comm_dict(data["comm"], error, f"{prefix}comm")
    if "oversubscribed" in data:
        validate_oversubscribed_dict(data["oversubscribed"], error, f"{prefix}oversubscribed")


def _ranged(f: _Fields, value: Any, path: str, low: float, high: float, unit: str) -> float:
    value = f.number(value, path)
    if not low <= value <= high:
        f.fail(path, f"{_short(value)} is outside the range parsat accepts, {low:g} to {high:g} {unit}")
    return value


def _known(f: _Fields, data: Mapping, known: Sequence[str]) -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        f.fail("", f"unknown field(s) {', '.join(map(str, unknown))} (known: {', '.join(known)})")


def validate_efficiency_dict(data: Any, error: type[Exception] = MachineError,
                             where: str = "machine efficiency") -> Mapping:
    """A machine file's `efficiency` object (`OpEfficiency`): known fields, numbers in `EFFICIENCY_RANGES`."""
    f = _Fields(error, f"{where}.")
    data = f.obj(data, "")
    _known(f, data, (*EFFICIENCY_RANGES, *EFFICIENCY_FLAGS, "update_points", "function_times", "gemm_grids"))
    for key, (low, high, unit) in EFFICIENCY_RANGES.items():
        if key in data:
            _ranged(f, data[key], key, low, high, unit)
    if "update_points" in data:
        _update_points(f, data["update_points"])
    if "function_times" in data:
        _function_times(f, data["function_times"])
    if "gemm_grids" in data:
        _gemm_grids(f, data["gemm_grids"])
    for key in EFFICIENCY_FLAGS:
        if key in data and not isinstance(data[key], bool):
            f.fail(key, f"must be true or false, got {_kind(data[key])}")
    return data


def _update_points(f: _Fields, data: Any) -> None:
    """`efficiency.update_points`: per optimizer of `UPDATE_OPTIMIZERS`, [elements, seconds] pairs with elements
    growing from 1, seconds in 0-3600."""
    points = f.obj(data, "update_points")
    _known(_Fields(f.error, f"{f.prefix}update_points."), points, UPDATE_OPTIMIZERS)
    for kind, rows in points.items():
        last = 0.0
        for i, row in enumerate(f.array(rows, f"update_points.{kind}")):
            path = f"update_points.{kind}[{i}]"
            pair = f.array(row, path)
            if len(pair) != 2:
                f.fail(path, f"must be [elements, seconds], got {len(pair)} number(s)")
            elements = _ranged(f, pair[0], path, 1.0, MAX_ELEMENTS, "elements")
            _ranged(f, pair[1], path, 0.0, 3600.0, "seconds")
            if elements <= last:
                f.fail(path, "elements must grow from one pair to the next")
            last = elements


GEMM_LAYOUTS = ("nn", "nt", "tn")   # `gemm_grids`: a forward product, and autograd's two backward ones


def _gemm_grids(f: _Fields, data: Any) -> None:
    """`efficiency.gemm_grids`: per layout of `GEMM_LAYOUTS`, the sizes `m`, `n`, `k` (at least two each, growing
    from 1) and one fraction of peak per grid point, each in (0, 1000] (`ir.gemm_grid.GemmGrid`)."""
    grids = f.obj(data, "gemm_grids")
    _known(_Fields(f.error, f"{f.prefix}gemm_grids."), grids, GEMM_LAYOUTS)
    for layout, grid in grids.items():
        path = f"gemm_grids.{layout}"
        grid = f.obj(grid, path)
        _known(_Fields(f.error, f"{f.prefix}{path}."), grid, ("m", "n", "k", "fractions"))
        points = 1
        for dim in "mnk":
            sizes = [_ranged(f, x, f"{path}.{dim}", 1.0, MAX_ELEMENTS, "elements")
                     for x in f.array(f.get(grid, dim, path), f"{path}.{dim}")]
            if len(sizes) < 2 or any(b <= a for a, b in zip(sizes, sizes[1:])):
                f.fail(f"{path}.{dim}", "must list at least two sizes, growing")
            points *= len(sizes)
        fractions = f.array(f.get(grid, "fractions", path), f"{path}.fractions")
        if len(fractions) != points:
            f.fail(f"{path}.fractions", f"must hold one fraction per grid point ({points}), got {len(fractions)}")
        for value in fractions:
            if _ranged(f, value, f"{path}.fractions", 0.0, 1e3, "of peak FLOP/s") <= 0:
                f.fail(f"{path}.fractions", "each fraction must be above 0")


def _function_times(f: _Fields, data: Any) -> None:
    """`efficiency.function_times`: per scalar function of the DSL (`SCALAR_FUNCTIONS`), [forward, backward]
    seconds per element, each in 0-1 ms."""
    times = f.obj(data, "function_times")
    _known(_Fields(f.error, f"{f.prefix}function_times."), times, tuple(SCALAR_FUNCTIONS))
    for name, pair in times.items():
        path = f"function_times.{name}"
        pair = f.array(pair, path)
        if len(pair) != 2:
            f.fail(path, f"must be [forward, backward] seconds per element, got {len(pair)} number(s)")
        for value in pair:
            _ranged(f, value, path, 0.0, 1e-3, "seconds per element")


def validate_oversubscribed_dict(data: Any, error: type[Exception] = MachineError,
                                 where: str = "machine oversubscribed") -> Mapping:
    """A machine file's `oversubscribed` object (`calibrate --oversubscribe`): `ranks` and the `cores` or
    `gpus` they shared, whole numbers with more ranks than what they shared (else it was not oversubscribed)."""
    f = _Fields(error, f"{where}.")
    data = f.obj(data, "")
    _known(f, data, ("ranks", *OVERSUBSCRIBED_UNITS))
    units = [key for key in OVERSUBSCRIBED_UNITS if key in data]
    if len(units) != 1:
        f.fail("", f"must give the ranks and one of {' or '.join(OVERSUBSCRIBED_UNITS)} they shared, e.g. "
                   '{"ranks": 8, "cores": 2}')
    ranks = f.integer(f.get(data, "ranks", ""), "ranks", 2, MAX_RANKS)
    if f.integer(data[units[0]], units[0], 1) >= ranks:
        f.fail(units[0], f"must be fewer than the {ranks} ranks (with one per rank nothing was oversubscribed), "
                         f"got {data[units[0]]}")
    return data


def validate_comm_dict(data: Any, error: type[Exception] = MachineError, where: str = "machine comm") -> Mapping:
    """A machine file's `comm` object (`CommProfile`): known fields, numbers in `COMM_RANGES`, and each
    measured point a known collective on a known link with its numbers in `POINT_RANGES`."""
    f = _Fields(error, f"{where}.")
    data = f.obj(data, "")
    _known(f, data, (*COMM_RANGES, *COMM_FLAGS, "points"))
    for key, (low, high, unit) in COMM_RANGES.items():
        if key in data:
            if key in COMM_INTEGERS:
                f.integer(data[key], key)
            _ranged(f, data[key], key, low, high, unit)
    for key in COMM_FLAGS:
        if key in data and not isinstance(data[key], bool):
            f.fail(key, f"must be true or false, got {_kind(data[key])}")
    for i, point in enumerate(f.array(data.get("points", []), "points")):
        path = f"points[{i}]"
        point = f.obj(point, path)
        _known(_Fields(error, f"{where}.{path}."), point, ("collective", "link", "samples", *POINT_RANGES))
        if f.get(point, "collective", path) not in COLLECTIVE_KINDS:
            f.fail(f"{path}.collective", f"must be one of {', '.join(COLLECTIVE_KINDS)}, "
                                         f"got {_kind(point['collective'])}")
        if f.get(point, "link", path) not in LINK_KINDS:
            f.fail(f"{path}.link", f"must be one of {', '.join(LINK_KINDS)}, got {_kind(point['link'])}")
        f.integer(f.get(point, "group", path), f"{path}.group")
        for key, (low, high, unit) in POINT_RANGES.items():
            _ranged(f, f.get(point, key, path), f"{path}.{key}", low, high, unit)
        _samples(f, point.get("samples", []), f"{path}.samples")
    return data


def _samples(f: "_Fields", samples: Any, path: str) -> None:
    """A point's measured (bytes, seconds) pairs (`CollectivePoint.samples`): bytes increasing and positive,
    seconds positive and not decreasing, so that the price between them is a time that grows with the buffer."""
    before = (0.0, 0.0)
    for i, pair in enumerate(f.array(samples, path)):
        if (not isinstance(pair, list) or len(pair) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in pair)):
            f.fail(f"{path}[{i}]", f"must be [bytes, seconds], got {_kind(pair)}")
        if pair[0] <= before[0] or pair[1] <= 0 or pair[1] < before[1]:
            f.fail(f"{path}[{i}]", f"must have more bytes than the one before and no fewer seconds, got {pair}")
        before = (float(pair[0]), float(pair[1]))


def machine_field(key: str) -> str:
    """A machine file's field as its user needs to write it: `peak_flops` (a number, 1000 to 1e+21 FLOP/s per
    device), for a message naming a missing or unknown field."""
    if key in MACHINE_RANGES:
        low, high, unit = MACHINE_RANGES[key]
        kind = "a whole number" if isinstance(low, int) and isinstance(high, int) else "a number"
        return f"{key} ({kind}, {figure(low)} to {figure(high)} {unit})"
    return f"{key} (text)" if key in ("name", "precision") else key


def check_machine_ranges(data: Mapping, f: _Fields) -> None:
    """Each field of `MACHINE_RANGES` that `data` has: a finite number within its range."""
    for key, (low, high, unit) in MACHINE_RANGES.items():
        if key in data:
            _ranged(f, data[key], key, low, high, unit)
