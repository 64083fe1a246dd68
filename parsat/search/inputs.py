"""What `optimize` is given, resolved and checked before anything is saturated.

A library (or `.rule` paths, or the shipped rules), a graph (or a graph
JSON path, or a built-in example), the device count and the pinned
degrees: each turned into the data model's form, or refused with a message
that names what is wrong, so saturation never starts on input it cannot use.
"""

from __future__ import annotations

import os
from typing import Mapping

from parsat.dsl.library import Library
from parsat.ir.budget import GraphBudget
from parsat.ir.errors import GraphError
from parsat.ir.graph import Graph
from parsat.ir.microbatch import built_example
from parsat.ir.models import EXAMPLES, check_example
from parsat.ir.mesh import Mesh, factorisations
from parsat.ir.pcg import Degrees
from parsat.ir.placement import Placement, placement_for_degrees
from parsat.ir.errors import OptimizeError
from parsat.egraph.guards import degree_choices
from parsat.search.strategies import Config, PinError, pinned_meshes


def check_graph_source(graph, sizes: Mapping[str, int] | None = None) -> None:
    """Refuse a graph that is neither a Graph, a built-in example (its `sizes` checked: `ir.models.check_example`)
    nor an existing file, or `sizes` given for a graph that is not an example: GraphError. Needs no library, so
    `resolve_request` says it before the rules load."""
    if isinstance(graph, Graph):
        return
    if isinstance(graph, str) and graph in EXAMPLES:
        check_example(graph, sizes)
        return
    if sizes:
        raise GraphError("--set sizes only apply to built-in examples")
    if isinstance(graph, (str, os.PathLike)) and os.path.exists(graph):
        return
    raise GraphError(f"'{graph}' is neither a graph JSON file nor a built-in example "
                     f"(examples: {', '.join(EXAMPLES)})")


def resolve_graph(graph, library: Library, sizes: Mapping[str, int] | None = None,
                  budget: GraphBudget | None = None, built: dict | None = None) -> Graph:
    """A Graph, a graph JSON path, or a built-in example name; within `budget` (tensors, building time). `built`:
    the call's examples built by name and sizes (`SearchRequest.examples`, `ir.microbatch.built_example`)."""
    check_graph_source(graph, sizes)
    if isinstance(graph, Graph):
        if budget is not None:
            budget.check_count(len(graph.leaves) + len(graph.nodes), f"graph '{graph.name}'")
        return graph
    if isinstance(graph, str) and graph in EXAMPLES:
        return built_example(graph, sizes or {}, library, built, budget)
    return Graph.load(graph, library, budget)


def check_devices(graph: Graph, devices: int) -> None:
    """Refuse a device count the graph cannot use: nothing divides by any of its divisors."""
    if devices < 1:
        raise OptimizeError(f"the device count must be at least 1, got {devices}")
    if devices == 1:
        return
    degrees = degree_choices(devices)
    if not any(dim % d == 0 for shape in graph.shapes().values() for dim in shape for d in degrees):
        raise OptimizeError(f"'{graph.name}' cannot use {devices} devices: no dim of any tensor is divisible by "
                            f"{' or '.join(map(str, degrees[:6]))}, so nothing can be split across them")


def pinned_layouts(dims: Mapping[str, int], devices: int, devices_per_node: int,
                   zero: int | str = "auto", sequence: bool | None = None) -> list[tuple[Mesh, Config]]:
    """`strategies.pinned_meshes` for one stage of `devices` devices, its PinError said as the OptimizeError a
    user reads (`--degrees: ...`). `resolve_request` calls it before the rules load, the search again for each
    stage."""
    try:
        return pinned_meshes(dims, devices, devices_per_node, zero, sequence)
    except PinError as err:
        raise OptimizeError(f"--degrees: {err}") from None


def check_pins(graph: Graph, outputs: Mapping[str, Degrees | Mapping] | None, inputs: Mapping[str, Degrees | Mapping] | None,
          devices: int) -> dict[str, Degrees]:
    """Pinned degrees by tensor name, checked: outputs the plan must produce, inputs as they arrive."""
    out: dict[str, Degrees] = {}
    input_names = [l.name for l in graph.leaves if l.role == "input"]
    for kind, spreads, allowed in (("output", outputs, graph.outputs), ("input", inputs, input_names)):
        for name, value in (spreads or {}).items():
            if name not in allowed:
                raise OptimizeError(f"cannot pin '{name}': it is not an {kind} of the graph ({', '.join(allowed)})")
            try:
                degrees = value if isinstance(value, Degrees) else Degrees.from_dict(dict(value))
            except (KeyError, TypeError, ValueError):
                raise OptimizeError(f"pinned spread of '{name}' must look like "
                                    "{'shard': [...], 'copy': 1}") from None
            shape = graph.shape(name)
            if len(degrees.shard) != len(shape):
                raise OptimizeError(f"pinned spread of '{name}' has {len(degrees.shard)} dims, the tensor has "
                                    f"{len(shape)}")
            if degrees.sum != 1:
                raise OptimizeError(f"an {kind} cannot be pinned as a partial sum ('{name}')")
            if degrees.pieces > devices or devices % degrees.pieces:
                raise OptimizeError(f"pinned spread of '{name}' has {degrees.pieces} pieces, which {devices} devices "
                                    "cannot hold")
            for dim, degree in zip(shape, degrees.shard):
                if dim % degree:
                    raise OptimizeError(f"pinned spread of '{name}': dim of size {dim} does not split into {degree}")
            if not degrees.is_whole:
                out[name] = degrees
    return out


def search_meshes(devices: int, devices_per_node: int, max_axes: int = 2) -> list[Mesh]:
    """The meshes the search tries for `devices` devices (`ir.mesh.factorisations`: one axis, and every split
    into two whose minor axis fits in a node), named by their topology."""
    return [Mesh.of(shape, devices_per_node) for shape in factorisations(devices, devices_per_node, max_axes)]


def pins_on(pins: Mapping[str, Degrees], mesh: Mesh) -> dict[str, Placement] | None:
    """The pinned degrees as placements on `mesh` (each dim on the earliest axes whose sizes make its degree);
    None when the mesh cannot realise one of them."""
    out: dict[str, Placement] = {}
    for name, degrees in pins.items():
        placement = placement_for_degrees(degrees.shard, degrees.copy, mesh.shape)
        if placement is None:
            return None
        out[name] = placement
    return out
