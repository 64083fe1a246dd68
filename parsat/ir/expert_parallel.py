"""Expert parallelism, by its textbook definition: data parallelism with the experts split over the ranks.

A mixture of experts' experts run as one batched matmul over an experts
dim (`bmm(x [experts, tokens, k], w [experts, k, n])`, the built-in
example `moe`). Data parallelism (`ir.data_parallel`) splits the tokens
and copies every expert's weights to every rank; expert parallelism
(GShard, Switch, Megablocks, torchtitan) stores each expert's weights on
one rank only (the weight split on its experts dim, no gradient
synchronisation) and moves the tokens instead: an all-to-all from
token-sharded to expert-sharded before the experts (the dispatch,
`all_to_all(x, 1, 0, p)`), the experts' chain run locally on each rank's
experts, and the reverse all-to-all where a reader needs the tokens split
again (the combine). That is the rule `bmm_expert_parallel`
(rules/parallel.rule) applied at every experts' matmul, with the two
all-to-alls between consecutive expert operators cancelled
(`all_to_all_to_earlier_dim`).

Built from the graph alone, like the data-parallel PCG it extends, so
that the backend can run it (`parsat run --plan-of expert_parallel`) and
a test can pin it; the optimizer's own plans come from the rules.
"""

from __future__ import annotations

from typing import Sequence

from parsat.dsl.library import Library
from parsat.dsl.parallel_ops import ALL_TO_ALL, PARTITION
from parsat.ir.data_parallel import DP_AXIS, _built, _DataParallelBuilder
from parsat.ir.graph import Graph, Leaf, OpNode
from parsat.ir.pcg import PCG, PNode
from parsat.ir.placement import Placement, apply_parallel, shard, shard_dim

EXPERTS_DIM = 0   # the experts dim of an experts' batched matmul's operands (bmm's leading batch dim)


def expert_weights(graph: Graph, devices: int) -> frozenset[str]:
    """The weights an experts' batched matmul reads as its second operand (`expert_matmuls`)."""
    return frozenset(expert_matmuls(graph, devices).values())


def expert_matmuls(graph: Graph, devices: int) -> dict[str, str]:
    """Each experts' batched matmul -> the weight it reads as its second operand: rank 3, [experts, k, n], the
    experts dim the same as the first operand's and split evenly by `devices`, read by nothing else; read as it
    is (the built-in `moe`) or through a transpose of its last two dims (an imported [experts, n, k] weight as
    torch's `F.linear` stores it, `importer.aten_routing.expert_matmul`), that transpose read by nothing else."""
    weights = {leaf.name for leaf in graph.leaves if leaf.role == "weight"}
    readers: dict[str, int] = {}
    for node in graph.nodes:
        for name in node.inputs:
            readers[name] = readers.get(name, 0) + 1
    nodes = {n.name: n for n in graph.nodes}
    shapes = {**{leaf.name: leaf.shape for leaf in graph.leaves}, **{n.name: n.shape for n in graph.nodes}}
    found = {}
    for node in graph.nodes:
        if node.op != "bmm" or readers.get(node.inputs[1]) != 1:
            continue
        source = node.inputs[1]
        turned = nodes.get(source)
        if turned is not None and turned.op == "transpose" and dict(turned.attrs) == {"d0": 1, "d1": 2}:
            source = turned.inputs[0] if readers.get(turned.inputs[0]) == 1 else None
        x, w = shapes[node.inputs[0]], shapes[node.inputs[1]]
        if source in weights and len(x) == 3 and len(w) == 3 and x[0] == w[0] and w[0] % devices == 0:
            found[node.name] = source
    return found


def expert_parallel_pcg(graph: Graph, library: Library, devices: int, devices_per_node: int = 1) -> PCG | None:
    """Data parallelism with every experts' batched matmul expert-parallel (module docstring): None where the
    graph has no such matmul (it would be the data-parallel PCG) or an operator accepts no repair."""
    if devices < 2 or not expert_weights(graph, devices):
        return None
    build = _built(graph, library, devices, devices_per_node, False, _ExpertParallelBuilder)
    return build.pcg if isinstance(build, _ExpertParallelBuilder) else None


def expert_parallel_refusal(graph: Graph, library: Library, devices: int) -> str | None:
    """Why `expert_parallel_pcg` has none, in words; None where it has one."""
    if devices < 2:
        return f"expert parallelism needs 2 or more devices, not {devices}"
    if not expert_weights(graph, devices):
        return (f"no experts' batched matmul (bmm of [experts, tokens, k] by a weight [experts, k, n] read only "
                f"there, experts divisible by {devices})")
    build = _built(graph, library, devices, 1, False, _ExpertParallelBuilder)
    return build if isinstance(build, str) else None


class _ExpertParallelBuilder(_DataParallelBuilder):
    """The data-parallel builder with the experts split: expert weights stored split on their experts dim, the
    experts' matmuls' token operand all-to-all'd onto the experts dim (dispatch), and a value left split on the
    experts dim all-to-all'd back to the dim its tokens were split on where a reader refuses it (combine)."""

    def __init__(self, graph: Graph, devices: int, mesh, library: Library):
        super().__init__(graph, devices, mesh, library)
        self.matmuls = expert_matmuls(graph, devices)
        self.experts = frozenset(self.matmuls.values())
        self.home: dict[int, int] = {}       # node split on the experts dim -> the dim its tokens were split on
        self.sent: dict[int, int] = {}       # such a node -> its all-to-all back (made once)

    def all_to_all(self, source: int, dim: int, to_dim: int) -> int:
        """Append an all-to-all over all devices of the `dp` axis moving `source`'s shard from dim to to_dim."""
        node = self.nodes[source]
        attrs = (("dim", dim), ("to_dim", to_dim), ("axis", DP_AXIS), ("degree", self.devices))
        return self.add("parallel", ALL_TO_ALL, (source,), attrs, node.shape,
                        apply_parallel(node.placement, ALL_TO_ALL, 0, dim, to_dim))

    def place_leaf(self, leaf: Leaf, zero3: bool, constant: bool = False) -> None:
        """An expert weight stored split on its experts dim (each rank holds its experts only); any other leaf as
        data parallelism places it."""
        if leaf.name not in self.experts:
            return super().place_leaf(leaf, zero3, constant)
        base = self.add("leaf", leaf.name, (), (), leaf.shape, Placement.whole(1), leaf.role, leaf.name)
        self.whole[leaf.name] = None
        self.ident[leaf.name] = self.parallel(PARTITION, base, EXPERTS_DIM)

    def place_operator(self, gnode: OpNode, op, cache: dict) -> str | None:
        """An experts' matmul gets its token operand dispatched first (all-to-all onto the experts dim); every
        operator's output stays split on the experts dim where an input was (its tokens' dim remembered)."""
        if gnode.name in self.matmuls:
            self.dispatch(gnode.inputs[0])
        refused = super().place_operator(gnode, op, cache)
        if refused is None and gnode.name in self.ident:
            out = self.nodes[self.ident[gnode.name]]
            homes = [self.home[i] for i in out.inputs if i in self.home]
            if homes and shard_dim(out.placement.codes[0]) == EXPERTS_DIM:
                self.home[out.id] = homes[0]
        return refused

    def dispatch(self, name: str) -> None:
        """The token operand `name` of an experts' matmul, split on its tokens' dim, all-to-all'd onto the
        experts dim (nothing to do where it already is there)."""
        node = self.nodes[self.ident[name]]
        dim = shard_dim(node.placement.codes[0])
        if dim is None or dim == EXPERTS_DIM or node.shape[EXPERTS_DIM] % self.devices:
            return
        moved = self.all_to_all(node.id, dim, EXPERTS_DIM)
        self.home[moved] = dim
        self.ident[name] = moved

    def sent_home(self, inputs: Sequence[PNode]) -> list[PNode]:
        """Inputs split on the experts dim all-to-all'd back to their tokens' dim (the combine)."""
        out = []
        for n in inputs:
            if n.id in self.home and n.placement.codes[0] == shard(EXPERTS_DIM):
                if n.id not in self.sent:
                    self.sent[n.id] = self.all_to_all(n.id, EXPERTS_DIM, self.home[n.id])
                n = self.nodes[self.sent[n.id]]
            out.append(n)
        return out

    def repairs(self, gnode: OpNode) -> tuple:
        """Data parallelism's repairs, with the combine first after none (`sent_home`), then with each of the
        others. A sum over the experts dim (an imported mixture's combine, `reduce_sum(.., 0)` of the experts'
        rows) is not tried as it is: on expert-split rows it would be a partial sum, all-reduced over the tokens
        of every rank, where expert parallelism sends the rows back to their tokens' rank first."""
        base = super().repairs(gnode)
        combined = (self.sent_home, *(lambda ins, r=r: r(self.sent_home(ins)) for r in base[1:]))
        if gnode.op == "reduce_sum" and dict(gnode.attrs).get("dim") == EXPERTS_DIM:
            return combined
        return (base[0], *combined)
