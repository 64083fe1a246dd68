"""A plan's graph as a module `torch.distributed.pipelining` can cut: one submodule per block of the plan's stack.

`run.GraphModule` holds every graph weight as a parameter of one module,
which `pipeline()` cannot cut: it cuts before a submodule's call
(`SplitPoint.BEGINNING`), and `pipeline_lowering` cuts chunk c before the
submodule holding its first layer's weights (`lowering.layer_module`).
`StagedGraphModule` holds block L's weights (`b{L}_...`, `ir.blocks`) in
submodule `blocks.L` and the weights outside every block on itself; its
forward calls `blocks.L` for each block in order, and each computes its
block's nodes: a node belongs to the latest block whose weights it depends
on, as `ir.blocks.node_blocks` assigns a PCG's nodes and so the plan's
chunks (`ir.pipeline`). A value outside every block (the embedding, the
tied head's transposed table) is computed inside each block that reads it,
as the plan's chunks compute the free values they read: the traced stage
then reads the weights the plan's chunk reads (what `pipelined.py` checks),
a tied table on the first and the last stage.

The forward takes the tensors a pipeline schedule splits into
micro-batches, every one along dim 0: the graph's input leaves, then the
targets of its outputs that have one (`tensor_names`), and returns the
interpreter's objective of the outputs (`training_data.objective`, a
loss output as it is), evaluated on the graph at the batch it is given
(`GraphModule.graph_for`: a built-in example rebuilt at that batch, so a
loss averages its micro-batch).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from parsat.backend.torch_native.run import GraphModule
from parsat.backend.training_data import is_loss, objective
from parsat.importer.torch_ops import apply_op
from parsat.ir.blocks import OUTSIDE, block_of
from parsat.ir.graph import Graph


def graph_blocks(graph: Graph) -> dict[str, int]:
    """Graph node or leaf name -> its block: the latest block whose weights (or named nodes) it depends on, OUTSIDE
    for values that depend on none (`ir.blocks.node_blocks`' rule, on the graph's names)."""
    blocks = {leaf.name: block_of(leaf.name) if leaf.role == "weight" else OUTSIDE for leaf in graph.leaves}
    for node in graph.nodes:
        blocks[node.name] = max([block_of(node.name)] + [blocks[i] for i in node.inputs])
    return blocks


def block_values(graph: Graph, blocks: Mapping[str, int], index: int, env: Mapping[str, torch.Tensor],
                 leaves: Mapping[str, torch.Tensor], wanted=None) -> dict[str, torch.Tensor]:
    """The values of block `index`'s nodes of `graph` (`blocks`: `graph_blocks(graph)`), or of the nodes `wanted`,
    from `env` (the inputs and earlier blocks' values) and `leaves` (the weights it may read, by graph name); a
    value outside every block it reads is computed here, as each chunk of the plan computes the free values it
    reads."""
    nodes = {n.name: n for n in graph.nodes}
    made: dict[str, torch.Tensor] = {}

    def value(name: str) -> torch.Tensor:
        if name in made:
            return made[name]
        if name in env:
            return env[name]
        if name in leaves:
            return leaves[name]
        node = nodes[name]
        made[name] = apply_op(node.op, [value(i) for i in node.inputs], dict(node.attrs))
        return made[name]

    names = [n.name for n in graph.nodes if blocks[n.name] == index] if wanted is None else list(wanted)
    return {name: value(name) for name in names}


class GraphBlock(nn.Module):
    """Block `index` of a `StagedGraphModule`: its weights, and a forward computing its nodes (a call of it is
    where `pipeline()` cuts)."""

    def __init__(self, index: int, names: Mapping[str, str]):
        super().__init__()
        self.index = index
        self.names = dict(names)   # graph weight -> this module's parameter name

    def forward(self, graph: Graph, blocks: Mapping[str, int], env: Mapping[str, torch.Tensor],
                outside: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The block's nodes' values (`block_values`), reading its own weights and those outside every block."""
        own = {name: self.get_parameter(local) for name, local in self.names.items()}
        return block_values(graph, blocks, self.index, env, {**outside, **own})


class StagedGraphModule(GraphModule):
    """A plan's graph as a module cut by blocks (module docstring). `param_names` maps each graph weight to its
    parameter (`blocks.{L}.{name}` for block L's, `{name}` outside every block; `.` in a graph name as `_`),
    what `parallelize` is given as `weight_names`."""

    def __init__(self, graph: Graph, weights: Mapping[str, torch.Tensor], library=None):
        super().__init__(graph, {}, library)
        blocks = graph_blocks(graph)
        held = {b: {w: w.replace(".", "_") for w in weights if blocks[w] == b}
                for b in sorted(set(blocks.values()) - {OUTSIDE})}
        self.blocks = nn.ModuleDict({str(b): GraphBlock(b, names) for b, names in held.items()})
        for name, value in weights.items():
            local, block = name.replace(".", "_"), blocks[name]
            owner = self if block == OUTSIDE else self.blocks[str(block)]
            owner.register_parameter(local, nn.Parameter(value.detach().clone()))
            self.param_names[name] = local if block == OUTSIDE else f"blocks.{block}.{local}"
        shapes = graph.shapes()
        self.input_names = tuple(leaf.name for leaf in graph.leaves if leaf.role == "input")
        self.target_names = tuple(o for o in graph.outputs if not is_loss(shapes[o]))
        self._blocks_of: dict[int, dict[str, int]] = {}

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """What `forward` takes, in order: the input leaves, then the targets of the outputs that are no loss."""
        return self.input_names + self.target_names

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        """The objective of the graph's outputs on `tensors` (`tensor_names`' values), block after block."""
        if len(tensors) != len(self.tensor_names):
            raise TypeError(f"the graph's module takes {len(self.tensor_names)} tensors "
                            f"({', '.join(self.tensor_names)}), got {len(tensors)}")
        given = dict(zip(self.tensor_names, tensors))
        graph = self.graph_for({name: given[name] for name in self.input_names})
        if id(graph) not in self._blocks_of:   # the plan's graph, or its example rebuilt at a batch (both kept)
            self._blocks_of[id(graph)] = graph_blocks(graph)
        blocks = self._blocks_of[id(graph)]
        outside = {name: self.get_parameter(param) for name, param in self.param_names.items()
                   if blocks[name] == OUTSIDE}
        env = {name: given[name] for name in self.input_names}
        for block in self.blocks.values():
            env.update(block(graph, blocks, env, outside))
        env.update(block_values(graph, blocks, OUTSIDE, env, outside,   # an output outside every block: last
                                wanted=[o for o in graph.outputs if o not in env]))
        total = 0.0
        for o in graph.outputs:
            total = total + objective(env[o], given.get(o), env[o].numel())
        return total
