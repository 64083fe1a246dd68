"""Hand-built plans on device meshes: what the backend runs until the optimizer writes such plans itself.

Each plan is written node by node the way the optimizer states one (every
node's placement derived by `ir.placement`, so `derive_placements` accepts it), on a
named mesh, with the communication it must move per step written out from
the collectives' ring formulas (docs/plan-schema.md): on an axis of size p
in a world of W ranks, W/p groups each run the collective, and

* an all-reduce of n elements sends 2(p-1) n per group,
* an all-gather whose result has n elements sends (p-1) n per group,
* a reduce-scatter of n elements sends (p-1) n per group,

where n is the piece the group works on (the tensor already cut by the
other axes). `Collective.sent(world)` is that figure summed over all ranks.

Plans (mesh major first; `dp` splits the batch):

* `dp_tp_mlp`: DP x TP on dp 2 x tp 2. The batch split on dp, the
  column-parallel then row-parallel MLP (Megatron) on tp, the weights'
  tp-pieces replicated on dp (their gradients all-reduced there).
* `tp_sp_block`: DP x TP x SP on dp 2 x tp 2: Megatron sequence
  parallelism on a transformer-like chain (layernorm, MLP, residual,
  layernorm): layernorms and the residual on sequence-sharded activations,
  `all_gather` of the sequence before the column-parallel linear,
  `reduce_scatter` back onto the sequence after the row-parallel one.
* `zero3_tp_mlp`: ZeRO-3 x TP on dp 2 x tp 2: the TP MLP with every weight
  stored partitioned on dp as well and `all_gather`-ed on dp for use (its
  gradient reduce-scattered back onto the stored piece); the output
  gathered whole.
* `hsdp_tp_mlp`: 8 ranks, dp 2 x fsdp 2 x tp 2: the batch split on dp and
  fsdp (one dim sharded on two axes, nested in mesh order), weights stored
  sharded on fsdp, replicated on dp and gathered on fsdp (hybrid sharding),
  TP on tp; the output gathered over fsdp, then dp.

Used by tests/test_backend_distributed.py and benchmarks/mesh_run.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

from parsat.dsl.library import Library
from parsat.ir import models
from parsat.ir.graph import Graph, GraphBuilder, instance_for
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import PCG, Degrees, PNode
from parsat.ir.placement import Placement, apply_parallel, compute_placement


class MeshPlanBuilder:
    """Writes a PCG node by node on `mesh`; placements stated as the optimizer would state them."""

    def __init__(self, mesh: Mesh, library: Library):
        self.mesh, self.library, self.nodes = mesh, library, []

    def _add(self, kind, op, inputs, attrs, shape, placement: Placement, role="", origin="") -> int:
        ident = len(self.nodes)
        degrees = Degrees.of_placement(placement, self.mesh, len(shape))
        self.nodes.append(PNode(ident, kind, op, tuple(inputs), tuple(attrs), tuple(shape), degrees, role, origin,
                                placement))
        return ident

    def leaf(self, name: str, shape: Sequence[int], role: str) -> int:
        return self._add("leaf", name, (), (), shape, Placement.whole(len(self.mesh)), role, name)

    def par(self, op: str, x: int, axis: str, dim: int | None = None) -> int:
        index = self.mesh.index(axis)
        attrs = ((("dim", dim),) if dim is not None else ()) + (("axis", axis), ("degree", self.mesh.size(index)))
        placement = apply_parallel(self.nodes[x].placement, op, index, dim)
        return self._add("parallel", op, (x,), attrs, self.nodes[x].shape, placement)

    def chain(self, x: int, *steps: tuple) -> int:
        """Parallel operators in turn: each step is (op, axis) or (op, axis, dim)."""
        for step in steps:
            x = self.par(step[0], x, *step[1:])
        return x

    def op(self, op: str, *inputs: int, origin: str = "", **attrs) -> int:
        shapes = [self.nodes[i].shape for i in inputs]
        instance = instance_for(self.library.ops[op], shapes, attrs)
        placement = compute_placement(instance, [self.nodes[i].placement for i in inputs])
        shape = tuple(int(d.constant) for d in instance.output_shape)
        return self._add("op", op, inputs, tuple(attrs.items()), shape, placement, origin=origin)

    def pcg(self, outputs: Sequence[int], names: Sequence[str]) -> PCG:
        return PCG(tuple(self.nodes), tuple(outputs), tuple(names), self.mesh)


@dataclass(frozen=True)
class Collective:
    """One collective of a plan's step, as the ring formulas count it (module docstring)."""

    axis: str
    kind: str        # all_reduce | all_gather | reduce_scatter
    size: int        # p, the axis's size
    elements: int    # n: all-reduced size, gathered result's size, or reduce-scattered input's size
    grad_sync: bool = False

    def sent(self, world: int) -> int:
        per_group = (2 if self.kind == "all_reduce" else 1) * (self.size - 1) * self.elements
        return world // self.size * per_group


@dataclass(frozen=True)
class MeshPlan:
    """A hand-built plan, its graph, and the collectives one training step must run."""

    name: str
    graph: Graph
    pcg: PCG
    collectives: tuple[Collective, ...]

    @property
    def world(self) -> int:
        return self.pcg.mesh.world

    @property
    def sent(self) -> int:
        return sum(c.sent(self.world) for c in self.collectives)

    @property
    def grad_sync(self) -> int:
        return sum(c.sent(self.world) for c in self.collectives if c.grad_sync)

    def sent_by_axis(self) -> dict[str, int]:
        return {name: sum(c.sent(self.world) for c in self.collectives if c.axis == name)
                for name in self.pcg.mesh.names}


MLP = dict(batch=8, d_in=4, d_hidden=8, d_out=4)
BLOCK = dict(batch=4, seq=8, hidden=8, ffn=16)


def dp_tp_mlp(library: Library, batch: int = 8, d_in: int = 4, d_hidden: int = 8, d_out: int = 4) -> MeshPlan:
    b, k, h, o = batch, d_in, d_hidden, d_out
    mesh = Mesh.of((2, 2), names=("dp", "tp"))
    p = MeshPlanBuilder(mesh, library)
    x = p.chain(p.leaf("x", (b, k), "input"), ("partition", "dp", 0), ("replicate", "tp"))
    w1 = p.chain(p.leaf("w1", (k, h), "weight"), ("partition", "tp", 1), ("replicate", "dp"))
    w2 = p.chain(p.leaf("w2", (h, o), "weight"), ("partition", "tp", 0), ("replicate", "dp"))
    act = p.op("relu", p.op("matmul", x, w1, origin="mm1"), origin="act")
    y = p.par("reduce", p.op("matmul", act, w2, origin="mm2"), "tp")
    pcg = p.pcg((y,), ("mm2",))
    return MeshPlan("dp_tp_mlp", models.mlp(b, k, h, o, library=library), pcg, (
        Collective("dp", "all_reduce", 2, k * h // 2, grad_sync=True),   # w1's tp-piece gradient
        Collective("dp", "all_reduce", 2, h * o // 2, grad_sync=True),   # w2's
        Collective("tp", "all_reduce", 2, b // 2 * o),                   # the row-parallel matmul's partial sums
    ))


def sp_block_graph(library: Library, batch: int = 4, seq: int = 8, hidden: int = 8, ffn: int = 16) -> Graph:
    """layernorm -> linear -> gelu -> linear (no bias) + bias -> residual add -> layernorm: the regions of a
    transformer block that Megatron's sequence parallelism splits (attention aside)."""
    g = GraphBuilder(library, name="sp_block")
    x = g.input("x", [batch, seq, hidden])
    ln1 = g.op("layernorm", x, g.weight("ln1_g", [hidden]), g.weight("ln1_b", [hidden]), eps=1e-5, name="ln1")
    up = g.op("linear", ln1, g.weight("w1", [hidden, ffn]), g.weight("b1", [ffn]), name="ffn_up")
    act = g.op("gelu", up, name="ffn_act")
    down = g.op("bias_add", g.op("linear_nobias", act, g.weight("w2", [ffn, hidden]), name="ffn_down"),
                g.weight("b2", [hidden]), name="ffn_bias")
    res = g.op("add", x, down, name="res")
    g.output(g.op("layernorm", res, g.weight("ln2_g", [hidden]), g.weight("ln2_b", [hidden]), eps=1e-5, name="ln2"))
    return g.build()


def tp_sp_block(library: Library, batch: int = 4, seq: int = 8, hidden: int = 8, ffn: int = 16) -> MeshPlan:
    b, s, d, f = batch, seq, hidden, ffn
    mesh = Mesh.of((2, 2), names=("dp", "tp"))
    p = MeshPlanBuilder(mesh, library)
    x = p.chain(p.leaf("x", (b, s, d), "input"), ("partition", "dp", 0), ("partition", "tp", 1))

    def everywhere(name: str, shape) -> int:  # a layernorm's or bias's vector: replicated on both axes
        return p.chain(p.leaf(name, shape, "weight"), ("replicate", "dp"), ("replicate", "tp"))

    ln1 = p.op("layernorm", x, everywhere("ln1_g", (d,)), everywhere("ln1_b", (d,)), eps=1e-5, origin="ln1")
    gathered = p.par("all_gather", ln1, "tp", 1)                              # the sequence, whole, for TP
    w1 = p.chain(p.leaf("w1", (d, f), "weight"), ("partition", "tp", 1), ("replicate", "dp"))
    b1 = p.chain(p.leaf("b1", (f,), "weight"), ("partition", "tp", 0), ("replicate", "dp"))
    up = p.op("gelu", p.op("linear", gathered, w1, b1, origin="ffn_up"), origin="ffn_act")
    w2 = p.chain(p.leaf("w2", (f, d), "weight"), ("partition", "tp", 0), ("replicate", "dp"))
    down = p.par("reduce_scatter", p.op("linear_nobias", up, w2, origin="ffn_down"), "tp", 1)  # onto the sequence
    biased = p.op("bias_add", down, everywhere("b2", (d,)), origin="ffn_bias")
    res = p.op("add", x, biased, origin="res")
    out = p.op("layernorm", res, everywhere("ln2_g", (d,)), everywhere("ln2_b", (d,)), eps=1e-5, origin="ln2")
    pcg = p.pcg((out,), ("ln2",))
    vectors = 5  # ln1_g, ln1_b, b2, ln2_g, ln2_b: each all-reduced on tp, then on dp
    activation = b // 2 * s * d   # one dp-group's [b/2, s, d]: the gathered result / the reduce-scattered input
    return MeshPlan("tp_sp_block", sp_block_graph(library, b, s, d, f), pcg, (
        *(Collective(axis, "all_reduce", 2, d, grad_sync=True) for axis in ("tp", "dp") for _ in range(vectors)),
        Collective("tp", "all_gather", 2, activation),                    # forward: the sequence gathered
        Collective("tp", "reduce_scatter", 2, activation),                # its backward
        Collective("tp", "reduce_scatter", 2, activation),                # forward: partial sums onto the sequence
        Collective("tp", "all_gather", 2, activation),                    # its backward
        Collective("dp", "all_reduce", 2, d * f // 2, grad_sync=True),    # w1's tp-piece
        Collective("dp", "all_reduce", 2, f // 2, grad_sync=True),        # b1's
        Collective("dp", "all_reduce", 2, f * d // 2, grad_sync=True),    # w2's
    ))


def zero3_tp_mlp(library: Library, batch: int = 8, d_in: int = 4, d_hidden: int = 8, d_out: int = 4) -> MeshPlan:
    b, k, h, o = batch, d_in, d_hidden, d_out
    mesh = Mesh.of((2, 2), names=("dp", "tp"))
    p = MeshPlanBuilder(mesh, library)
    x = p.chain(p.leaf("x", (b, k), "input"), ("partition", "dp", 0), ("replicate", "tp"))
    # stored as [k/2, h/2] (dp, tp), gathered on dp for use
    w1 = p.chain(p.leaf("w1", (k, h), "weight"), ("partition", "tp", 1), ("partition", "dp", 0),
                 ("all_gather", "dp", 0))
    # stored as [h/2, o/2] (tp, dp): dim 0 is tp's, so dp stores dim 1
    w2 = p.chain(p.leaf("w2", (h, o), "weight"), ("partition", "tp", 0), ("partition", "dp", 1),
                 ("all_gather", "dp", 1))
    act = p.op("relu", p.op("matmul", x, w1, origin="mm1"), origin="act")
    y = p.chain(p.op("matmul", act, w2, origin="mm2"), ("reduce", "tp"), ("combine", "dp", 0))
    pcg = p.pcg((y,), ("mm2",))
    return MeshPlan("zero3_tp_mlp", models.mlp(b, k, h, o, library=library), pcg, (
        Collective("dp", "all_gather", 2, k * h // 2),                    # w1 gathered: [k, h/2]
        Collective("dp", "reduce_scatter", 2, k * h // 2, grad_sync=True),
        Collective("dp", "all_gather", 2, h // 2 * o),                    # w2 gathered: [h/2, o]
        Collective("dp", "reduce_scatter", 2, h // 2 * o, grad_sync=True),
        Collective("tp", "all_reduce", 2, b // 2 * o),                    # row-parallel partial sums
        Collective("dp", "all_gather", 2, b * o),                         # the output gathered (on both tp groups)
    ))


def hsdp_tp_mlp(library: Library, batch: int = 8, d_in: int = 4, d_hidden: int = 8, d_out: int = 4) -> MeshPlan:
    b, k, h, o = batch, d_in, d_hidden, d_out
    mesh = Mesh.of((2, 2, 2), names=("dp", "fsdp", "tp"))
    p = MeshPlanBuilder(mesh, library)
    x = p.chain(p.leaf("x", (b, k), "input"), ("partition", "dp", 0), ("partition", "fsdp", 0), ("replicate", "tp"))
    w1 = p.chain(p.leaf("w1", (k, h), "weight"), ("partition", "tp", 1), ("partition", "fsdp", 0),
                 ("replicate", "dp"), ("all_gather", "fsdp", 0))
    w2 = p.chain(p.leaf("w2", (h, o), "weight"), ("partition", "tp", 0), ("partition", "fsdp", 1),
                 ("replicate", "dp"), ("all_gather", "fsdp", 1))
    act = p.op("relu", p.op("matmul", x, w1, origin="mm1"), origin="act")
    y = p.chain(p.op("matmul", act, w2, origin="mm2"), ("reduce", "tp"), ("combine", "fsdp", 0), ("combine", "dp", 0))
    pcg = p.pcg((y,), ("mm2",))
    return MeshPlan("hsdp_tp_mlp", models.mlp(b, k, h, o, library=library), pcg, (
        Collective("dp", "all_reduce", 2, k // 2 * h // 2, grad_sync=True),   # w1's stored piece, over dp
        Collective("dp", "all_reduce", 2, h // 2 * o // 2, grad_sync=True),   # w2's
        Collective("fsdp", "all_gather", 2, k * h // 2),
        Collective("fsdp", "reduce_scatter", 2, k * h // 2, grad_sync=True),
        Collective("fsdp", "all_gather", 2, h // 2 * o),
        Collective("fsdp", "reduce_scatter", 2, h // 2 * o, grad_sync=True),
        Collective("tp", "all_reduce", 2, b // 4 * o),
        Collective("fsdp", "all_gather", 2, b // 2 * o),                      # output: [b/4, o] pieces -> [b/2, o]
        Collective("dp", "all_gather", 2, b * o),                             # then [b/2, o] -> [b, o]
    ))


PLANS_2X2 = {"dp_tp_mlp": dp_tp_mlp, "tp_sp_block": tp_sp_block, "zero3_tp_mlp": zero3_tp_mlp}
PLANS_2X2X2 = {"hsdp_tp_mlp": hsdp_tp_mlp}


def plan_dict(graph: Graph, pcg: PCG, comm_elements: int | None = None, grad_sync_elements: int | None = None,
              baselines: Mapping[str, PCG | None] | None = None) -> dict:
    """The plan JSON `parsat run` reads (docs/plan-schema.md, version 3) for a PCG with no cost model's figures:
    per-node costs empty, and as totals only the communication given (the formulas' prediction; null if none).
    `baselines`: name -> a baseline's PCG, or None for a baseline recorded without one (figures all null)."""
    from parsat.ir.costs import Totals
    from parsat.ir.machine import Machine
    from parsat.ir.plan import BaselinePlan, Plan

    baselines = dict(baselines or {})
    machine = Machine.preset("cpu").with_devices(pcg.mesh.world)
    unknown = Totals(0.0, 0, 0, 0, 0, 0.0, 0.0)
    data = Plan(graph, machine, pcg.mesh.world, pcg, {}, unknown, baselines={name: unknown for name in baselines},
                baseline_plans={name: BaselinePlan(b, {}) for name, b in baselines.items() if b is not None}).to_dict()
    for name in baselines:
        data["baselines"][name].update({key: None for key in unknown.to_dict()})
    data["totals"].update({key: None for key in unknown.to_dict()})
    data["totals"]["comm_elements"] = comm_elements
    data["totals"]["grad_sync_elements"] = grad_sync_elements
    return data


def redundant_pcg(graph: Graph, library: Library, devices: int) -> PCG:
    """The graph on a one-axis mesh of `devices` ranks with nothing spread: every rank computes every node (all
    placements free), no parallel operator, no communication."""
    mesh = Mesh.of((devices,), names=("dp",))
    p = MeshPlanBuilder(mesh, library)
    ids = {leaf.name: p.leaf(leaf.name, leaf.shape, leaf.role) for leaf in graph.leaves}
    for node in graph.nodes:
        ids[node.name] = p.op(node.op, *(ids[i] for i in node.inputs), origin=node.name, **dict(node.attrs))
    return p.pcg(tuple(ids[o] for o in graph.outputs), graph.outputs)


def nested_data_parallel(graph: Graph, library: Library, sizes: Sequence[int] = (2, 2),
                         names: Sequence[str] = ("dp", "dp2")) -> PCG | None:
    """Data parallelism over every axis of a mesh at once: each input whose batch splits cut along dim 0 on every
    axis (nested, in mesh order), every weight replicated on every axis, outputs reduced or gathered axis by axis,
    the last axis first; None where an operator refuses. Any graph, so a user's module runs on a 2-axis mesh."""
    from parsat.ir.placement import FREE, PARTIAL, REPLICA, PlacementError, shard

    mesh = Mesh.of(tuple(sizes), names=tuple(names))
    p = MeshPlanBuilder(mesh, library)
    ids = {}
    for leaf in graph.leaves:
        split = leaf.role == "input" and leaf.shape and leaf.shape[0] % mesh.world == 0
        steps = [("partition", axis, 0) if split else ("replicate", axis) for axis in mesh.names]
        ids[leaf.name] = p.chain(p.leaf(leaf.name, leaf.shape, leaf.role), *steps)
    try:
        for node in graph.nodes:
            ids[node.name] = p.op(node.op, *(ids[i] for i in node.inputs), origin=node.name, **dict(node.attrs))
    except PlacementError:
        return None
    outputs = []
    for name in graph.outputs:
        out = ids[name]
        for axis in reversed(range(len(mesh))):
            code = p.nodes[out].placement.codes[axis]
            if code == PARTIAL:
                out = p.par("reduce", out, mesh.names[axis])
            elif code == shard(0):
                out = p.par("combine", out, mesh.names[axis], 0)
            elif code not in (FREE, REPLICA):
                return None
        outputs.append(out)
    return p.pcg(outputs, graph.outputs)


def save_plan(plan: MeshPlan, path) -> None:
    """`plan_dict` of a hand-built plan, with its predicted communication, written as a plan file."""
    path.write_text(json.dumps(plan_dict(plan.graph, plan.pcg, plan.sent, plan.grad_sync)), encoding="utf-8")


def data_parallel_mlp(library: Library, devices: int = 2, batch: int = 8, d_in: int = 6, d_hidden: int = 4,
                      d_out: int = 2) -> MeshPlan:
    """`ir.data_parallel.data_parallel_pcg` of the MLP (one axis, dp): the weights' gradients all-reduced, the
    output gathered."""
    from parsat.ir.data_parallel import data_parallel_pcg

    b, k, h, o, n = batch, d_in, d_hidden, d_out, devices
    graph = models.mlp(b, k, h, o, library=library)
    return MeshPlan("data_parallel_mlp", graph, data_parallel_pcg(graph, library, n), (
        Collective("dp", "all_reduce", n, k * h, grad_sync=True),
        Collective("dp", "all_reduce", n, h * o, grad_sync=True),
        Collective("dp", "all_gather", n, b * o),
    ))
