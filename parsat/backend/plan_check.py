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

A plan whose step runs m micro-batches must also train what the step's
whole batch trains (`micro_batches_make_the_step`): gradient accumulation
with the 1/m scaling (parsat/backend/executor.py) is the whole batch's gradient
only when each output of the whole batch is its micro-batches' outputs put
together along its cut, or, for an output without one (a loss), their mean.
A batch norm's statistics, or a loss that sums over the batch instead of
averaging it, break that; such a plan is refused before any rank starts.
"""

from __future__ import annotations

import torch

from parsat.backend.executor import (ExecutionError, TrainConfig, compare_values, data_leaves, evaluate_graph,
                                     leaf_value, operator_library, seeded_weights, step_data)
from parsat.importer.torch_ops import apply_op
from parsat.ir.graph import Graph
from parsat.ir.microbatch import is_loss, step_batch
from parsat.ir.pcg import PCG

RTOL = 1e-6  # float64 forward of a rewritten graph: reassociation errors are ~1e-15
# Operators whose value mixes the samples of a batch (batch norm's statistics, over the batch dim): under
# micro-batches each would see its micro-batch only, which is not the step's batch.
BATCH_STATISTICS = frozenset({"bn_mean", "bn_var"})


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


def micro_batches_make_the_step(graph: Graph, seed: int = 0) -> None:
    """Raise ExecutionError when `graph`'s m micro-batches do not compute its step's whole batch (see the
    module docstring): an operator that mixes a batch's samples, or, where the whole batch's graph is known
    (`ir.microbatch.step_batch`), outputs that differ from it on seeded data at the starting weights (one
    float64 forward of each). Where it is not known, the step is m independent micro-batches by definition."""
    m = graph.microbatches
    if m == 1:
        return
    mixing = sorted({node.op for node in graph.nodes if node.op in BATCH_STATISTICS})
    if mixing:
        raise ExecutionError(f"the plan runs its step as {m} micro-batches, but its graph computes statistics of "
                             f"the batch ({', '.join(mixing)}: batch norm): each micro-batch would normalize with "
                             "its own statistics, which is not training on the step's batch; optimize it with "
                             "--microbatches 1")
    batch = step_batch(graph, operator_library())
    if batch.whole is None:
        return
    config = TrainConfig(seed=seed, dtype="float64")
    data = step_data(graph, batch, config, 0)
    weights = seeded_weights(graph, config)
    with torch.no_grad():
        whole = evaluate_graph(batch.whole, {**weights, **data.whole_inputs()})
        micro = [evaluate_graph(graph, {**weights, **data.inputs(k)}) for k in range(m)]
    shapes = graph.shapes()
    problems = []
    for name in graph.outputs:
        cut = batch.cut(name)
        if cut is not None:
            pairs, how = [(name, torch.cat([env[name] for env in micro], cut), whole[name])], "put together"
        elif is_loss(shapes[name]):
            pairs, how = [(name, sum(env[name] for env in micro) / m, whole[name])], "averaged"
        else:
            pairs, how = [(name, env[name], whole[name]) for env in micro], "each"
        found = compare_values(pairs)
        if not found.nonfinite and found.max_rel > RTOL:
            problems.append(f"output '{name}' of the whole batch is not its micro-batches' {how} (relative "
                            f"difference {found.max_rel:.3g})")
    if problems:
        raise ExecutionError(f"the plan's {m} micro-batches do not compute its step's whole batch, so accumulating "
                             "their gradients would not train it:\n  " + "\n  ".join(problems)
                             + "\n(a statistic over the batch, or a loss that sums over the batch rather than "
                             "averaging it); optimize it with --microbatches 1")
