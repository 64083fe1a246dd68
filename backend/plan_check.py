"""A plan must compute what its own graph computes, checked before any rank starts.

A plan file carries the graph it was made from and the PCG to run. Nothing
stops a hand edit (or a bug) from making them disagree: relu changed to
gelu, a weight turned into an input, an output renamed. `run` without
`--check` would then train the wrong model quietly. `plan_follows_graph`
refuses such a plan with every difference listed:

* leaves: the same names, roles and shapes in both;
* outputs: the same names, in order, with the same shapes;
* values: the PCG's logical semantics (parallel operators are the identity
  on values) equals the graph's on seeded leaves, in float64, within a
  relative tolerance: one single-process forward pass of each.
"""

from __future__ import annotations

import torch

from parsat.backend.executor import (ExecutionError, TrainConfig, compare_values, data_leaves, evaluate_graph,
                                     leaf_value)
from parsat.backend.torch_ops import apply_op
from parsat.ir.graph import Graph
from parsat.ir.pcg import PCG

RTOL = 1e-6  # float64 forward of a rewritten graph: reassociation errors are ~1e-15


def plan_follows_graph(pcg: PCG, graph: Graph, seed: int = 0) -> None:
    """Raise ExecutionError listing how the PCG departs from the graph (nothing when it does not)."""
    problems: list[str] = []
    graph_leaves = {leaf.name: (leaf.role, tuple(leaf.shape)) for leaf in graph.leaves}
    pcg_leaves: dict[str, tuple[str, tuple[int, ...]]] = {}
    for node in pcg.nodes:
        if node.kind == "leaf":
            pcg_leaves.setdefault(node.op, (node.role or "input", tuple(node.shape)))
    for name in sorted(set(graph_leaves) | set(pcg_leaves)):
        if name not in pcg_leaves:
            problems.append(f"the graph's {graph_leaves[name][0]} '{name}' is not a leaf of the plan")
        elif name not in graph_leaves:
            problems.append(f"the plan's leaf '{name}' is not in its graph")
        elif pcg_leaves[name] != graph_leaves[name]:
            (grole, gshape), (prole, pshape) = graph_leaves[name], pcg_leaves[name]
            problems.append(f"leaf '{name}' is a{'n' if grole[0] in 'aeiou' else ''} {grole} of shape {list(gshape)} "
                            f"in the graph but a{'n' if prole[0] in 'aeiou' else ''} {prole} of shape "
                            f"{list(pshape)} in the plan")
    names = tuple(pcg.output_names) or tuple(f"out{i}" for i in range(len(pcg.outputs)))
    if names != tuple(graph.outputs):
        problems.append(f"the plan's outputs {list(names)} are not the graph's {list(graph.outputs)}")
    shapes = graph.shapes()
    for ident, name in zip(pcg.outputs, names):
        if name in shapes and tuple(pcg.node(ident).shape) != tuple(shapes[name]):
            problems.append(f"output '{name}' has shape {list(pcg.node(ident).shape)} in the plan, "
                            f"{list(shapes[name])} in the graph")
    if not problems:
        problems += _values_differ(pcg, graph, names, seed)
    if problems:
        raise ExecutionError("the plan does not compute what its graph computes:\n  " + "\n  ".join(problems))


def _values_differ(pcg: PCG, graph: Graph, names, seed: int) -> list[str]:
    config = TrainConfig(seed=seed, dtype="float64")
    data = data_leaves([(n.name, n.op, n.inputs) for n in graph.nodes])
    with torch.no_grad():
        leaves = {leaf.name: leaf_value(leaf.name, leaf.shape, leaf.role, config, 0, data.get(leaf.name, ""))
                  for leaf in graph.leaves}
        expected = evaluate_graph(graph, dict(leaves))
        env: dict[int, torch.Tensor] = {}
        try:
            for node in pcg.nodes:
                if node.kind == "leaf":
                    env[node.id] = leaves[node.op]
                elif node.kind == "parallel":
                    env[node.id] = env[node.inputs[0]]
                else:
                    env[node.id] = apply_op(node.op, [env[i] for i in node.inputs], dict(node.attrs))
        except Exception as err:  # an operator the plan misapplies: say which, never a stack trace
            return [f"the plan's node {node.id} ({node.op}) cannot be evaluated: {type(err).__name__}: {err}"]
    out = []
    for ident, name in zip(pcg.outputs, names):
        got, want = env[ident].to(torch.float64), expected[name].to(torch.float64)
        same_gaps = bool((torch.isfinite(got) == torch.isfinite(want)).all()) and bool(
            (got[~torch.isfinite(got)].nan_to_num(0.0) == want[~torch.isfinite(want)].nan_to_num(0.0)).all())
        # the graph itself may make NaN or infinity on seeded data (sqrt of a negative): the plan must make the
        # same ones; the finite values are compared by relative difference
        found = compare_values([(f"output {name}", got.nan_to_num(0.0, 0.0, 0.0), want.nan_to_num(0.0, 0.0, 0.0))])
        if not same_gaps or found.max_rel > RTOL:
            out.append(f"output '{name}' differs from the graph's (relative difference {found.max_rel:.3g}, "
                       f"tolerance {RTOL:g}{'' if same_gaps else ', non-finite values in other places'}): a node of "
                       "the plan computes something its graph does not")
    return out
