"""A training step of m micro-batches: how its batch is cut, and the graph of the whole batch.

A graph with `microbatches` m > 1 is one micro-batch of a step: the step
runs it m times and accumulates the gradients (`ir.costs.NodeCost.per_step`
prices it so). What the step trains on is one batch of m micro-batches, and
running it needs to know how that batch is laid out:

* an input that carries the batch is cut into m equal blocks along its
  batch dim, and micro-batch k reads block k (its *cut*); an input without
  the batch (a position table, rotary tables) is the same for every
  micro-batch;
* an output likewise: one with a cut is the k-th block of the whole
  batch's output; one without (a loss scalar) must be the same function of
  every micro-batch, so that the whole batch's is their mean.

Which dim carries the batch is known where the whole batch's graph can be
built: a built-in example (`Graph.example`) whose `batch` size
(`ir.models.BATCH`) was divided by m (`search.optimize.optimize`). Its graph
at batch x m is built and compared with the micro-batch graph tensor by
tensor: a dim that is m times larger is the cut, a dim that is equal is
not, anything else (two cut dims, another ratio, other weights) is an
error. For any other graph the whole batch is not known (`whole` is None):
the step's batch is then m independent micro-batches, as if stacked along
a new leading dim.

The backend draws a step's data at the whole batch's shapes and gives
micro-batch k its block, so a plan with m micro-batches and one with none
train on the same data; `--check` compares with the whole batch's graph
(parsat/backend/executor.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from parsat.dsl.library import Library
from parsat.ir.budget import GraphBudget
from parsat.ir.errors import GraphError
from parsat.ir.graph import Graph
from parsat.ir.models import BATCH, EXAMPLES, build_example


def is_loss(shape) -> bool:
    """Whether an output of this shape is the graph's loss: a scalar (0-d), which training minimizes as it
    is (the mean over its micro-batch: the step's loss is the mean of its micro-batches'). Any other output
    is trained against a target (parsat/backend/executor.py `objective`)."""
    return len(tuple(shape)) == 0


@dataclass(frozen=True)
class StepBatch:
    """How one step's batch is cut into `microbatches` micro-batches (see the module docstring)."""

    microbatches: int = 1
    cuts: tuple[tuple[str, int], ...] = ()   # input or output name -> the dim cut into m blocks
    whole: Graph | None = None               # the whole batch's graph; None where it is not known

    def cut(self, name: str) -> int | None:
        """The dim of `name` cut into micro-batches; None: the same for every micro-batch (or not known)."""
        return dict(self.cuts).get(name)

    def block(self, shape, name: str, k: int) -> tuple[slice, ...]:
        """The index of micro-batch `k`'s block in a whole-batch tensor `name` of `shape`."""
        dim = self.cut(name)
        if dim is None:
            return tuple(slice(None) for _ in shape)
        size = shape[dim] // self.microbatches
        return tuple(slice(k * size, (k + 1) * size) if d == dim else slice(None) for d in range(len(shape)))


def step_batch(graph: Graph, library: Library | None = None) -> StepBatch:
    """The step `graph` is one micro-batch of (GraphError when its example's whole batch does not match it)."""
    m = graph.microbatches
    if m == 1:
        return StepBatch(1, (), graph)
    whole = whole_batch_graph(graph, library)
    if whole is None:
        return StepBatch(m)
    return StepBatch(m, tuple(sorted(_cuts(graph, whole, m).items())), whole)


def whole_batch_graph(graph: Graph, library: Library | None = None) -> Graph | None:
    """The graph of the whole batch of `graph`'s step: its example rebuilt at `microbatches` x its batch.
    None for a graph that is not (or no longer) the example it records, or an example without a batch."""
    if graph.example is None or graph.example[0] not in EXAMPLES:
        return None
    name, sizes = graph.example[0], dict(graph.example[1])
    batch = {**EXAMPLES[name].defaults(), **sizes}.get(BATCH)
    if batch is None:
        return None
    if _structure(build_example(name, sizes, library)) != _structure(graph):
        return None   # edited since it was built: its example says nothing about it
    return build_example(name, {**sizes, BATCH: batch * graph.microbatches}, library)


def _structure(graph: Graph) -> dict:
    data = graph.to_dict()
    return {key: data[key] for key in ("inputs", "weights", "nodes", "outputs")}


def _cuts(micro: Graph, whole: Graph, m: int) -> dict[str, int]:
    """Input and output name -> the dim that is m times larger in `whole` (none: equal shapes)."""
    small, big = micro.shapes(), whole.shapes()
    roles: Mapping[str, str] = {leaf.name: leaf.role for leaf in micro.leaves}
    if roles != {leaf.name: leaf.role for leaf in whole.leaves} or micro.outputs != whole.outputs:
        raise GraphError(f"the whole batch of '{micro.name}' has other inputs, weights or outputs than its "
                         "micro-batch")
    names = list(roles) + list(micro.outputs)
    cuts: dict[str, int] = {}
    for name in names:
        a, b = small[name], big[name]
        differ = [d for d in range(len(a)) if len(a) != len(b) or a[d] != b[d]]
        if len(a) != len(b) or len(differ) > 1 or any(b[d] != m * a[d] for d in differ) \
                or (differ and roles.get(name) == "weight"):
            raise GraphError(f"'{name}' of '{micro.name}' has shape {list(a)} in a micro-batch and {list(b)} in "
                             f"the whole batch of {m} micro-batches: it is not cut along one dim into {m} blocks")
        if differ:
            cuts[name] = differ[0]
    return cuts


def batch_dims(graph: Graph, library: Library | None = None, built: dict | None = None) -> dict[str, int]:
    """Input name -> the dim that carries the batch, for the inputs that carry one (a position or rotary table
    does not): what a data-parallel axis splits. For a built-in example, the dims that double when its example
    is built at twice its batch (`_cuts`); for any other graph (an imported module, a graph file), the leading
    dim of every input, which is where torch and the data loaders put the batch, except the inputs the graph
    names constant (`Graph.constants`: the same for every batch, such as T5's relative-position one-hots).

    `built`: a dict the calls for one library may share (`ir.megatron._Kin`: a step's graph at several
    micro-batch counts), which keeps each example built here by its name and the sizes given (`built_example`):
    `build_example` is a function of these and the library, so a build kept is the build made again.
    llama-70b:64's grids asked this of seven graphs, each building its example twice (80 blocks, ~0.05 CPU s a
    build); the graph at m micro-batches is built at twice its batch where the graph at m / 2 is built at its
    own (the builds are kept, not their structures: those are read again, ~0.015 CPU s, rather than held)."""
    if graph.example is not None and graph.example[0] in EXAMPLES:
        name, sizes = graph.example[0], dict(graph.example[1])
        batch = {**EXAMPLES[name].defaults(), **sizes}.get(BATCH)
        if batch is not None and _structure(built_example(name, sizes, library, built)) == _structure(graph):
            doubled = built_example(name, {**sizes, BATCH: 2 * batch}, library, built)
            inputs = {leaf.name for leaf in graph.leaves if leaf.role == "input"}
            return {k: v for k, v in _cuts(graph.with_microbatches(1), doubled, 2).items() if k in inputs}
    return {leaf.name: 0 for leaf in graph.leaves if leaf.role == "input" and leaf.shape
            and leaf.name not in graph.constants}


def built_example(name: str, sizes: Mapping[str, int], library: Library | None, built: dict | None,
                  budget: GraphBudget | None = None) -> Graph:
    """`build_example(name, sizes, library, budget)`, kept in `built` (where given) by the name and sizes, so that
    it is built once per dict: a call's steps and its grids' `batch_dims` share one (`SearchRequest.examples`,
    `ir.megatron._Kin`). A build kept is the build made again (`build_example` is a function of the name, sizes
    and library; the budget only refuses), so it is taken; within a `budget`, a kept build is still checked against
    its tensor count (the budget's deadline bounds building, and nothing is built)."""
    key = (name, tuple(sorted(sizes.items())), id(library))
    found = built.get(key) if built is not None else None
    if found is not None and found[0] is library:
        if budget is not None:
            budget.check_count(len(found[1].leaves) + len(found[1].nodes), f"graph '{name}'")
        return found[1]
    found = (library, build_example(name, sizes, library, budget))   # the library beside its id: the id stays its own
    if built is not None:
        built[key] = found
        while len(built) > EXAMPLES_KEPT:   # the oldest first
            del built[next(iter(built))]
    return found[1]


EXAMPLES_KEPT = 16  # `built_example`: builds kept per dict (a llama-70b graph holds ~1-2 MiB; llama-70b:64's
                    # call builds 9 distinct sizes: its steps' graphs and `batch_dims`' doubles)


def batch_wide_constants(graph: Graph, batch: Mapping[str, int]) -> frozenset[str]:
    """The constants the import found in the forward (`Graph.constants`) whose leading dim is the batch's size (a
    size the batch-carrying inputs of `batch`, `batch_dims`, have along it): BERT's attention mask of ones and its
    token-type one-hots, which the module builds at its batch's shape. Each data-parallel rank's forward builds
    them at its local batch, so a plan may split them along dim 0 with the batch."""
    sizes = {leaf.shape[batch[leaf.name]] for leaf in graph.leaves if leaf.name in batch}
    return frozenset(leaf.name for leaf in graph.leaves
                     if leaf.name in graph.constants and leaf.shape and leaf.shape[0] in sizes)
