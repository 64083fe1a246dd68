"""Which graph inputs carry data of a particular form, and which values are made of their elements.

An embedding's ids and a cross-entropy's targets are graph inputs one-hot
over the vocabulary (`embedding(onehot: [*s, v], ...)`, `nll_sum(..., y)`),
an attention's mask a 0/1 input. Who needs to know: the CPU runtime draws
such inputs in their form (`backend.training_data.leaf_value`), and the
cost model prices a one-hot input as a GPU framework holds it, integer ids
without the vocabulary dim (`cost.pcg_tasks.ExecutionProfile.integer_ids`).
Both read it from here.
"""

from __future__ import annotations

from typing import Sequence

from parsat.dsl.parallel_ops import PARALLEL_OPS

ONEHOT, MASK = "onehot", "mask"
# Operators that only move elements: a one-hot tensor stays one-hot through them.
MOVES_ELEMENTS = tuple(PARALLEL_OPS) + ("split", "concat", "transpose", "flatten", "unflatten", "broadcast")
# (operator, argument) -> the data it must read: one-hot rows (embedding ids, cross-entropy targets) or a
# 0/1 mask (attention's, of which every row keeps an entry).
DATA_ARGS = {("embedding", 0): ONEHOT, ("embedding_padded", 0): ONEHOT, ("nll_sum", 2): ONEHOT,
             ("softmax_masked", 1): MASK}

Nodes = Sequence[tuple[str, str, Sequence[str]]]


def element_sources(nodes: Nodes) -> dict[str, str]:
    """Value -> the tensor its elements come from, for the values made by operators that only move elements
    (`MOVES_ELEMENTS`), followed back to the first value that is not. `nodes` are (name, op, inputs) in
    order."""
    source: dict[str, str] = {}
    for name, op, inputs in nodes:
        if op in MOVES_ELEMENTS and inputs:
            source[name] = source.get(inputs[0], inputs[0])
    return source


DATA_OPS = frozenset(op for op, _position in DATA_ARGS)   # the operators some argument of which is in DATA_ARGS


def data_leaves(nodes: Nodes, source: dict[str, str] | None = None) -> dict[str, str]:
    """Leaves whose data must have a form, and which (ONEHOT or MASK): read, through operators that only
    move elements (parallel operators, reshapes, slices), as an embedding's ids, a cross-entropy's targets
    or a masked softmax's mask. `source`: `element_sources(nodes)`, where the caller has it."""
    source = element_sources(nodes) if source is None else source
    found: dict[str, str] = {}
    for _name, op, inputs in nodes:
        if op not in DATA_OPS:   # most operators: no argument to look up (a whole model's PCG asks per node)
            continue
        for position, ref in enumerate(inputs):
            kind = DATA_ARGS.get((op, position))
            if kind is not None:
                found[source.get(ref, ref)] = kind
    return found


def onehot_values(nodes: Nodes) -> frozenset[str]:
    """The one-hot inputs (`data_leaves`) and every value made of their elements alone (`element_sources`):
    what a framework reading integer ids never holds as [*s, v]."""
    source = element_sources(nodes)
    leaves = {name for name, kind in data_leaves(nodes, source).items() if kind == ONEHOT}
    return frozenset(leaves | {name for name, src in source.items() if src in leaves})


__all__ = ["DATA_ARGS", "MASK", "MOVES_ELEMENTS", "ONEHOT", "data_leaves", "element_sources", "onehot_values"]
