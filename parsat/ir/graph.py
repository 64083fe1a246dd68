"""The computation graph parsat optimizes: leaves, operator nodes, outputs.

A graph is a DAG of operators from the `.rule` library applied to named
leaves (graph inputs and trainable weights). It is immutable (frozen
dataclasses); `GraphBuilder` makes one, `Graph.from_json` reads one.
Shapes are not trusted from the user: every node's shape is inferred by
instantiating its operator (`dsl.instantiate`), so an unknown operator, a
wrong arity or a shape mismatch is reported with the node's name before
anything is optimized. The JSON form is documented in docs/graph-schema.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.bounds import bound
from parsat.ir.collector import collection_paused
from parsat.dsl.files import write_atomic
from parsat.dsl.instantiate import InstantiationError
from parsat.dsl.library import Library, load_library
from parsat.ir.budget import GraphBudget
from parsat.ir.errors import GraphError
from parsat.ir.hashed import hash_once, state_without_hash
from parsat.ir.instance import instance_for  # noqa: F401 - re-exported: callers take it from the graph module
from parsat.ir.json_files import parse_json, read_json_file
from parsat.ir.validate import GRAPH_SCHEMA, GRAPH_VERSION, check_graph_sizes, validate_graph_dict

ROLES = ("input", "weight")
MAX_MICROBATCHES = int(bound("optimize", "--microbatches").high)   # one bound for the flag and the graph


@dataclass(frozen=True)
class Leaf:
    """A graph input (data, no gradient) or a weight (trained, has a gradient)."""

    name: str
    shape: tuple[int, ...]
    role: str = "input"


@dataclass(frozen=True)
class OpNode:
    """One operator application. `attrs` are the non-tensor parameters by name."""

    name: str
    op: str
    inputs: tuple[str, ...]
    attrs: tuple[tuple[str, int | float], ...] = ()
    shape: tuple[int, ...] = ()

    def attr(self, key: str) -> int | float:
        return dict(self.attrs)[key]


@dataclass(frozen=True)
class Graph:
    """Leaves, nodes in topological order, and the names of the outputs."""

    leaves: tuple[Leaf, ...]
    nodes: tuple[OpNode, ...]
    outputs: tuple[str, ...]
    name: str = "graph"
    meta: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    # A training step runs the graph this many times, one micro-batch each, accumulating gradients and
    # synchronising them once (`ir.costs.NodeCost.per_step`); the graph's shapes are one micro-batch's.
    microbatches: int = 1
    # The built-in example and the sizes it was built with (`ir.models.build_example`), when it was: what lets
    # the backend build the same model at a step's whole batch (`ir.microbatch.step_batch`). Not part of the
    # graph's identity: a graph read from a file without it is the same graph.
    example: tuple[str, tuple[tuple[str, int], ...]] | None = field(default=None, compare=False)
    # Inputs that are the same for every batch (made from positions and buffers, not from the user's data: T5's
    # relative-position one-hots, Swin's relative-position gathers): they carry no batch, so a data-parallel
    # axis holds them whole on every rank as it holds the weights (`ir.microbatch.batch_dims`,
    # `ir.data_parallel`). The importer names them; a graph that names none treats every input as batch data.
    constants: frozenset[str] = frozenset()

    # hashed once and kept (`ir.hashed`): the search keys memos by the step's graph
    __hash__ = hash_once
    __getstate__ = state_without_hash

    # ------------------------------------------------------------- queries
    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes()[name]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        found = {leaf.name: leaf.shape for leaf in self.leaves}
        found.update({node.name: node.shape for node in self.nodes})
        return found

    def leaf(self, name: str) -> Leaf | None:
        for leaf in self.leaves:
            if leaf.name == name:
                return leaf
        return None

    @property
    def weights(self) -> tuple[Leaf, ...]:
        return tuple(l for l in self.leaves if l.role == "weight")

    def ranks(self) -> set[int]:
        return {len(s) for s in self.shapes().values()}

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        with collection_paused():   # 100,001 nodes' dicts, all kept (`ir.collector`)
            return self._to_dict()

    def _to_dict(self) -> dict:
        return {
            "schema": GRAPH_SCHEMA, "version": GRAPH_VERSION, "name": self.name,
            "inputs": [{"name": l.name, "shape": list(l.shape), **({"constant": True} if l.name in self.constants
                                                                    else {})}
                       for l in self.leaves if l.role == "input"],
            "weights": [{"name": l.name, "shape": list(l.shape)} for l in self.leaves if l.role == "weight"],
            "nodes": [{"name": n.name, "op": n.op, "inputs": list(n.inputs), "attrs": dict(n.attrs),
                       "shape": list(n.shape)} for n in self.nodes],
            "outputs": list(self.outputs),
            **({"microbatches": self.microbatches} if self.microbatches != 1 else {}),
            **({"example": {"name": self.example[0], "sizes": dict(self.example[1])}} if self.example else {}),
        }

    def from_example(self, name: str, sizes: Mapping[str, int]) -> "Graph":
        """The same graph, recorded as built-in example `name` built with `sizes` (the sizes given, not the
        defaults)."""
        return replace(self, example=(name, tuple(sorted(sizes.items()))))

    def with_microbatches(self, microbatches: int) -> "Graph":
        """The same graph as one of `microbatches` micro-batches of a step."""
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or not 1 <= microbatches <= MAX_MICROBATCHES:
            raise GraphError(f"microbatches must be an integer from 1 to {MAX_MICROBATCHES}, got {microbatches!r}")
        return replace(self, microbatches=microbatches)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        """Write the graph JSON atomically (raises FileProblem)."""
        write_atomic(path, self.to_json() + "\n")

    @staticmethod
    def from_dict(data: Mapping, library: Library | None = None, budget: GraphBudget | None = None) -> "Graph":
        """Read and validate a graph; node shapes in the file are checked, not trusted.

        With a `budget`, a graph with more tensors than it allows is refused
        before anything is built, and building stops at its deadline."""
        if budget is not None and isinstance(data, Mapping):
            budget.check_count(sum(len(data[k]) for k in ("inputs", "weights", "nodes")
                                   if isinstance(data.get(k), list)))
        validate_graph_dict(data)  # structure and types first: the code below may then index freely
        if not isinstance(data, Mapping):
            raise GraphError("a graph must be a JSON object")
        if data.get("schema", GRAPH_SCHEMA) != GRAPH_SCHEMA:
            raise GraphError(f"not a parsat graph (schema {data.get('schema')!r}, expected {GRAPH_SCHEMA!r})")
        version = data.get("version", GRAPH_VERSION)
        if version != GRAPH_VERSION:
            raise GraphError(f"graph schema version {version} is not supported (this parsat reads {GRAPH_VERSION})")
        builder = GraphBuilder(library, name=str(data.get("name", "graph")), budget=budget)
        with collection_paused():   # a node's objects all live on (`ir.collector`)
            _add_from_dict(builder, data)
        graph = builder.build()
        check_graph_sizes(graph.shapes())
        example = data.get("example")
        if example is not None:
            graph = graph.from_example(example["name"], example.get("sizes", {}))
        constants = frozenset(item["name"] for item in data.get("inputs", []) if item.get("constant"))
        if constants:
            graph = replace(graph, constants=constants)
        return graph.with_microbatches(data.get("microbatches", 1))

    @staticmethod
    def from_json(text: str, library: Library | None = None) -> "Graph":
        return Graph.from_dict(parse_json(text, GraphError, "graph JSON is not valid JSON"), library)

    @staticmethod
    def load(path: str | Path, library: Library | None = None, budget: GraphBudget | None = None) -> "Graph":
        return Graph.from_dict(read_json_file(path, GraphError, "graph"), library, budget)


@dataclass(frozen=True)
class Tensor:
    """A handle to a leaf or node of a graph under construction."""

    name: str


def _add_from_dict(builder: "GraphBuilder", data: Mapping) -> None:
    """A validated graph dict's leaves, nodes (shapes checked against the file's) and outputs, added."""
    try:
        for role, key in (("input", "inputs"), ("weight", "weights")):
            for item in data.get(key, []):
                builder.leaf(item["name"], item["shape"], role)
        for item in data.get("nodes", []):
            handles = []
            for ref in item.get("inputs", []):
                if ref not in builder._shapes:
                    raise GraphError(f"node '{item.get('name')}': input '{ref}' is not defined before it")
                handles.append(Tensor(ref))
            made = builder.op(item["op"], *handles, name=item.get("name"), **dict(item.get("attrs", {})))
            if "shape" in item and tuple(item["shape"]) != builder._shapes[made.name]:
                raise GraphError(f"node '{made.name}': the file says shape {list(item['shape'])}, "
                                 f"but {item['op']} gives {list(builder._shapes[made.name])}")
        for ref in data.get("outputs", []):
            if ref not in builder._shapes:
                raise GraphError(f"output '{ref}' is not a node or leaf of the graph")
            builder.output(Tensor(ref))
    except KeyError as err:
        raise GraphError(f"graph JSON is missing the field {err}") from None


def _library(library: Library | None) -> Library:
    if library is not None:
        return library
    return load_library()[0]


class GraphBuilder:
    """Builds a `Graph`, inferring and checking every shape as it goes.

    `g.op("matmul", x, w)`: tensor arguments in the operator's order; integer
    and real attributes by keyword (`g.op("softmax", s, dim=2)`) or
    positionally where the operator's signature puts them.
    """

    def __init__(self, library: Library | None = None, name: str = "graph", budget: GraphBudget | None = None):
        self.library = _library(library)
        self.name = name
        self.budget = budget
        # (operator, input shapes, attributes) -> output shape: a model repeats the same block, and
        # instantiating an operator is most of the cost of building one (a 96-block GPT builds in a
        # fraction of a second with it, ~1 s without).
        self._instances: dict[tuple, tuple[int, ...]] = {}
        # operator name -> its attribute parameters' names, in declaration order: `OpDecl.attr_params` walks the
        # parameters anew on each read, and `op` read it twice per node (a llama-70b build adds ~3,200 nodes,
        # and a search builds its graph at several sizes)
        self._attr_names: dict[str, tuple[str, ...]] = {}
        self._leaves: list[Leaf] = []
        self._nodes: list[OpNode] = []
        self._outputs: list[str] = []
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._counter = 0

    def leaf(self, name: str, shape: Sequence[int], role: str) -> Tensor:
        if role not in ROLES:
            raise GraphError(f"leaf '{name}': role must be one of {', '.join(ROLES)}, not {role!r}")
        if name in self._shapes:
            raise GraphError(f"the name '{name}' is used twice")
        dims = tuple(int(d) for d in shape)
        if any(d < 1 for d in dims):
            raise GraphError(f"{role} '{name}': every dim must be at least 1, got {list(dims)}")
        check_graph_sizes({name: dims})   # 2**53 elements at most (the cost model's floats, torch's int64)
        self._grow()
        self._leaves.append(Leaf(name, dims, role))
        self._shapes[name] = dims
        return Tensor(name)

    def input(self, name: str, shape: Sequence[int]) -> Tensor:
        return self.leaf(name, shape, "input")

    def weight(self, name: str, shape: Sequence[int]) -> Tensor:
        return self.leaf(name, shape, "weight")

    def op(self, op_name: str, *args: Tensor | int | float, name: str | None = None, **attrs: int | float) -> Tensor:
        op = self.library.ops.get(op_name)
        if name is None:
            self._counter += 1
            name = f"{op_name}_{self._counter}"
            while name in self._shapes:
                self._counter += 1
                name = f"{op_name}_{self._counter}"
        if op is None:
            import difflib

            close = difflib.get_close_matches(op_name, list(self.library.ops), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise GraphError(f"node '{name}': unknown operator '{op_name}'{hint}")
        if name in self._shapes:
            raise GraphError(f"the name '{name}' is used twice")
        names = self._attr_names.get(op_name)
        if names is None:
            names = self._attr_names[op_name] = tuple(p.name for p in op.attr_params)
        tensors = [a for a in args if isinstance(a, Tensor)]
        if len(tensors) < len(args):   # attributes given positionally, in the declaration's order
            scalars = [a for a in args if not isinstance(a, Tensor)]
            attr_params = [p for p in names if p not in attrs]
            if len(scalars) > len(attr_params):
                raise GraphError(f"node '{name}': {op_name} takes {len(names)} attribute(s), "
                                 f"got {len(scalars) + len(attrs)}")
            attrs = {**dict(zip(attr_params, scalars)), **attrs}
        for t in tensors:
            if t.name not in self._shapes:
                raise GraphError(f"node '{name}': input '{t.name}' is not defined")
        shapes = [self._shapes[t.name] for t in tensors]
        self._grow()
        key = (op_name, tuple(shapes), tuple(sorted((k, type(v).__name__, v) for k, v in attrs.items())))
        shape = self._instances.get(key)
        if shape is None:  # repeated layers instantiate an operator at the same shapes: once is enough
            try:
                instance = instance_for(op, shapes, attrs)
            except InstantiationError as err:
                given = ", ".join(f"{t.name}{list(s)}" for t, s in zip(tensors, shapes))
                raise GraphError(f"node '{name}' ({op_name} of {given}): {err}") from None
            shape = tuple(int(d.evaluate({})) for d in instance.output_shape)
            check_graph_sizes({name: shape})
            self._instances[key] = shape
        ordered = tuple((p, attrs[p]) for p in names)
        self._nodes.append(OpNode(name, op_name, tuple(t.name for t in tensors), ordered, shape))
        self._shapes[name] = shape
        return Tensor(name)

    def _grow(self) -> None:
        """One more tensor: within the budget's count and deadline, if there is a budget."""
        if self.budget is not None:
            count = len(self._leaves) + len(self._nodes) + 1
            self.budget.check_count(count, f"graph '{self.name}'", growing=True)
            if count % 256 == 0:   # a small graph always builds (well under a second)
                self.budget.check_time(count)

    def output(self, *tensors: Tensor) -> None:
        for t in tensors:
            if t.name not in self._shapes:
                raise GraphError(f"output '{t.name}' is not defined")
            if t.name not in self._outputs:
                self._outputs.append(t.name)

    def shape(self, t: Tensor) -> tuple[int, ...]:
        return self._shapes[t.name]

    def build(self) -> Graph:
        if not self._outputs:
            raise GraphError(f"graph '{self.name}' has no outputs (call output(...))")
        return Graph(tuple(self._leaves), tuple(self._nodes), tuple(self._outputs), self.name)
