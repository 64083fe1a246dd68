"""A fused projection read apart (HF GPT-2's `c_attn`) written as Megatron-LM's head-ordered layout.

HF GPT-2 computes q, k and v with one `Conv1D` weight [h, 3h] and bias [3h], views the [rows, 3h] product as
[batch, seq, 3h] and cuts it into three [batch, seq, h] blocks. A contiguous column split of the weight gives a
tensor-parallel rank all of q and half of k, so the grid (`ir.megatron`) gathered the product before the cut
and ran the attention whole on every rank. Megatron-LM stores its fused QKV weight head by head, so each rank
holds its heads' q, k and v columns: a strided block of the one weight, which is a contiguous block of a *view*
of it ([h, 3h] as [h, h, 3], split along its middle dim; torch's `_StridedShard(1, split_factor=3)`).

`heads_ordered` writes each such cut as the proved rules have it, so that a layout can store the weight as the
partition of that view (`ir.pcg.weight_storage` follows views that start with an unflatten):

* `split_of_unflatten_later_dim`: the cut of the [batch, seq, 3h] view is the view of the [rows, 3h] cut;
* `split_linear_features`: that cut is the product of the weight's and the bias's column blocks;
* `split_columns_as_view_column`, `split_entries_as_view_column`: each block is one column of the view
  `transpose(unflatten(w, 1, h), 1, 2)` ([h, h, 3]; the bias's [h, 3]), `flatten(split(view, 2, i, 1), 1)`.

The view nodes are made of the weights alone, so the grid's builder makes them where they are read: the view
whole, partitioned along its middle dim on the tensor axis (the weight's storage), and each block sliced from
the rank's piece, column-parallel without a collective (`ir.megatron`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from parsat.ir.graph import Graph, OpNode

RULES = ("split_of_unflatten_later_dim", "split_linear_features", "split_columns_as_view_column",
         "split_entries_as_view_column")
"""The proved rules (parsat/rules/algebraic.rule) whose rewrites `heads_ordered` applies, in that order."""

@dataclass(frozen=True)
class FusedProjection:
    """A `linear` whose [rows, n] product is viewed (`unflatten` of its rows) and read only as `parts` equal
    blocks of its last dim (`split`s, each a block `size` wide at a multiple of it): `cuts[i]` is block i's."""

    product: OpNode
    view: OpNode
    cuts: tuple[OpNode, ...]

    @property
    def size(self) -> int:
        return int(self.cuts[0].attr("size"))


def fused_projections(graph: Graph) -> tuple[FusedProjection, ...]:
    """The graph's fused projections read apart: a `linear` of a weight and a bias read by nothing else, its only
    reader an `unflatten` of its rows, every reader of that a `split` of the last dim into blocks of one width
    that cover it, one block each (at least two)."""
    readers: dict[str, list[OpNode]] = {}
    for node in graph.nodes:
        for name in node.inputs:
            readers.setdefault(name, []).append(node)
    weights = {w.name for w in graph.weights}
    found = []
    for node in graph.nodes:
        if node.op != "linear" or len(node.inputs) != 3 or len(node.shape) != 2:
            continue
        weight, bias = node.inputs[1:]
        views = readers.get(node.name, [])
        if not {weight, bias} <= weights or weight == bias or any(len(readers[w]) != 1 for w in (weight, bias)) \
                or len(views) != 1 or views[0].op != "unflatten" or views[0].attr("dim") != 0:
            continue
        view, width = views[0], node.shape[-1]
        cuts = readers.get(view.name, [])
        last = len(view.shape) - 1
        if len(cuts) < 2 or any(c.op != "split" or c.attr("dim") != last for c in cuts):
            continue
        size = int(cuts[0].attr("size"))
        starts = sorted(int(c.attr("start")) for c in cuts)
        if any(int(c.attr("size")) != size for c in cuts) or starts != list(range(0, width, size)):
            continue
        found.append(FusedProjection(node, view, tuple(sorted(cuts, key=lambda c: c.attr("start")))))
    return tuple(found)


def heads_ordered(graph: Graph) -> tuple[Graph, dict[str, tuple[str, ...]]] | None:
    """`graph` with each fused projection read apart (`fused_projections`) written as one product per block, each
    block's weight and bias a column of the weight's and bias's view (the module docstring), and the names of
    the nodes it made -> the rules that made them (`RULES`; the cut's own name is kept for the block's view).
    None where the graph has none."""
    fused = {f.product.name: f for f in fused_projections(graph)}
    if not fused:
        return None
    nodes: list[OpNode] = []
    made: dict[str, tuple[str, ...]] = {}
    dropped = {name for f in fused.values() for name in (f.view.name, *(c.name for c in f.cuts))}
    for node in graph.nodes:
        if node.name in dropped:
            continue
        projection = fused.get(node.name)
        if projection is None:
            nodes.append(node)
            continue
        new = _blocks(projection, graph.shape(node.inputs[1]))
        nodes += new
        made.update({n.name: RULES for n in new})
    return replace(graph, nodes=tuple(nodes)), made


def _blocks(f: FusedProjection, weight_shape: tuple[int, ...]) -> list[OpNode]:
    """The nodes of `heads_ordered` for one fused projection: the weight's and bias's views, then per block its
    columns, its product and that product's view under the cut's name."""
    x, weight, bias = f.product.inputs
    z, (k, n), rows = f.size, weight_shape, f.product.shape[0]
    blocks = n // z
    w_view, b_view = f"{weight}__by_column", f"{bias}__by_column"
    nodes = [OpNode(f"{w_view}_unflat", "unflatten", (weight,), (("dim", 1), ("k", z)), (k, blocks, z)),
             OpNode(w_view, "transpose", (f"{w_view}_unflat",), (("d0", 1), ("d1", 2)), (k, z, blocks)),
             OpNode(f"{b_view}_unflat", "unflatten", (bias,), (("dim", 0), ("k", z)), (blocks, z)),
             OpNode(b_view, "transpose", (f"{b_view}_unflat",), (("d0", 0), ("d1", 1)), (z, blocks))]
    for i, cut in enumerate(f.cuts):
        w_col, b_col, product = f"{weight}__column{i}", f"{bias}__column{i}", f"{f.product.name}__column{i}"
        nodes += [OpNode(f"{w_col}_slice", "split", (w_view,), (("dim", 2), ("start", i), ("size", 1)), (k, z, 1)),
                  OpNode(w_col, "flatten", (f"{w_col}_slice",), (("dim", 1),), (k, z)),
                  OpNode(f"{b_col}_slice", "split", (b_view,), (("dim", 1), ("start", i), ("size", 1)), (z, 1)),
                  OpNode(b_col, "flatten", (f"{b_col}_slice",), (("dim", 0),), (z,)),
                  OpNode(product, "linear", (x, w_col, b_col), (), (rows, z)),
                  OpNode(cut.name, "unflatten", (product,), f.view.attrs, cut.shape)]
    return nodes


def with_rules(nodes: Sequence, made: Mapping[str, tuple[str, ...]], locations: Mapping[str, str]) -> list:
    """PCG nodes (`ir.pcg.PNode`) with the rules of the graph nodes `heads_ordered` made named on the nodes that
    compute them (`origin`), as a plan's nodes name the rules that produced them (`locations`)."""
    return [replace(node, rules=tuple(locations.get(r, r) for r in made[node.origin]))
            if node.kind == "op" and node.origin in made else node for node in nodes]
