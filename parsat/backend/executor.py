"""Run a PCG as real training steps on N ranks, and check it against one process.

The job's ranks are the plan's device mesh (`pcg.mesh`, docs/MESH.md):
`--nproc` must be its size. Each rank walks the PCG in order: a leaf
becomes its full tensor, made from a seed (weights once, data batches per
step), so every rank and the single-process reference see the same values
without communication; a compute node runs the torch op on local pieces
(`importer.torch_ops`); a parallel node runs its collective on its mesh axis's
group (`collectives.parallel_op`). Every node's placement is derived once,
before any rank starts (`ir.pcg_placement.derive_placements`: the pieces of a compute
node's inputs line up, and each placement is the one the plan states), so
a plan the backend would run differently from what the optimizer costed
is refused, not run.

A weight whose only reader is a chain of `partition`s is *stored* as the
piece that chain gives (`ir.placement.piece_index`), with no collective at
all, as the cost model assumes; read on through an `all_gather` it is
ZeRO-3/FSDP: stored sharded, gathered every step, its gradient
reduce-scattered back onto the piece. Any other weight is held whole by
every rank, which compute identical gradients for it (a `replicate`
reading it sums its copies' gradients: the gradient synchronisation of
data parallelism).

Micro-batches (gradient accumulation, `Graph.microbatches` m): a step
makes the values of every weight's chain (the weight and what parallel
operators alone make of it: its ZeRO-3 all-gather, its replicas,
`ir.pcg.weight_chains`) once, and hands each micro-batch detached copies
that require a gradient; the m micro-batches run forward and backward one
after another (each freed before the next), their gradients accumulating
on those copies; then one backward through the weights' chains carries the
accumulated gradients to the stored pieces (with one micro-batch the chains
simply run inside its forward and backward), so each gathering collective
and each gradient reduction (all-reduce, reduce-scatter) runs once per
step, activations' collectives once per micro-batch: what the cost model
prices (`ir.costs.NodeCost.per_step`). The collectives are linear, so
reducing the sum of m gradients once is the sum of m reductions.

Loss scaling: each micro-batch's objective is a mean over its own samples;
the step's objective is the mean of the m micro-batches' (the whole
batch's, `training_data`), so each micro-batch differentiates its
objective divided by m, and the accumulated gradient is the whole batch's.
The step's data, its cut into micro-batches and the objective are
`training_data`'s; `--check` compares with the whole batch's graph trained
in one process where it is known (`ir.microbatch`), otherwise with the
micro-batch graph accumulated m times in one process.

Activation recomputation (`pcg.recompute == "blocks"`, `ir.recompute`):
each block runs as one non-reentrant `torch.utils.checkpoint` region
(`RankProgram._checkpointed`, `recompute_regions`) that returns only the
values read outside it, so the others are gone after forward; its whole
forward, collectives included, runs again before its backward (early
stopping off), counted as any collective, which is what the cost model
prices (docs/ARCHITECTURE.md, "Activation recomputation in the backend").

Objective: a loss output (a scalar) as it is, any other output
0.5 * mean((output - target)^2), summed over outputs, targets from the
seed (`training_data.objective`). A rank's share is its piece's part. The ranks holding the same piece
are those that differ only on the output's free and replica axes: the
reported loss divides by their number, so the sum over ranks is the loss
once. The share a rank differentiates divides by the sizes of the replica
axes only: `replicate`'s backward all-reduce sums the gradients of a
replica axis's ranks, which must add up to one whole gradient, while the
ranks of a free axis compute the same gradient redundantly and never sum
it. The optimizer (SGD or Adam, both elementwise) updates local pieces,
which is the full update restricted to them.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass, field, replace
from math import prod
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from parsat.backend.collectives import GRAD_SYNC, CommCounter, MeshGroups, parallel_op
from parsat.backend.launch import LaunchConfig, RankContext, launch
from parsat.backend.recompute_regions import Region, RegionError, Unit, forward_units
from parsat.backend.state_shards import ShardingError, StateShards, check_runnable
from parsat.backend.step_statistic import Spread, spread, steady
from parsat.importer.torch_ops import apply_op, evaluate_graph
from parsat.backend.training_data import (MASK, ONEHOT, StepData, TrainConfig, causal_mask, data_leaves,  # noqa: F401
                                          fan_in, leaf_value, loss_terms, objective, target_value)
from parsat.dsl.library import Library, load_library, shipped_rules_dir
from parsat.dsl.parallel_ops import ALL_GATHER, REPLICATE
from parsat.ir.machine import PRESETS
from parsat.ir.mesh import Mesh
from parsat.ir.microbatch import StepBatch, step_batch
from parsat.ir.placement import FREE, PARTIAL, Placement, PlacementError, piece_index
from parsat.ir.graph import Graph
from parsat.ir.pcg import PCG, PNode, storage_views, weight_chains, weight_storage
from parsat.ir.pcg_placement import derive_placements

OPTIMIZERS = ("sgd", "adam")


class ExecutionError(Exception):
    """A plan the backend refuses to run, or a rank program that cannot be built."""


# ----------------------------------------------------------------- seeded data: parsat/backend/training_data.py


class Optimizer:
    """SGD or Adam (torch's defaults: betas 0.9/0.999, eps 1e-8) on a list of tensors.

    Written out rather than taken from `torch.optim`, whose first use
    imports torch._dynamo (about 4 s per rank process); both updates are
    elementwise, so updating pieces is the full update restricted to them.
    """

    def __init__(self, params: list[torch.Tensor], config: TrainConfig):
        if config.optimizer not in OPTIMIZERS:
            raise ExecutionError(f"unknown optimizer '{config.optimizer}' ({', '.join(OPTIMIZERS)})")
        self.params, self.kind, self.lr = params, config.optimizer, config.lr
        self.betas, self.eps, self.steps = (0.9, 0.999), 1e-8, 0
        self.moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params] if self.kind == "adam" else []

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        b1, b2 = self.betas
        for index, p in enumerate(self.params):
            if p.grad is None:
                continue
            if self.kind == "sgd":
                p.sub_(self.lr * p.grad)
                continue
            m, v = self.moments[index]
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            m_hat = m / (1 - b1 ** self.steps)
            v_hat = v / (1 - b2 ** self.steps)
            p.sub_(self.lr * m_hat / (v_hat.sqrt() + self.eps))


def _make_optimizer(params: list[torch.Tensor], config: TrainConfig) -> Optimizer:
    return Optimizer(params, config)


# ------------------------------------------------------------ the reference run


@dataclass(frozen=True)
class Reference:
    """Single-process results per step: loss, outputs, and weights' gradients and values after the step.

    An output's expected value in a step is a tuple of its m micro-batches'
    values where those are known (each micro-batch compared on its own), or
    one tensor, the mean over the micro-batches (an output without a cut,
    compared with the whole batch's graph: a loss).
    """

    losses: tuple[float, ...]
    outputs: tuple[dict, ...]
    grads: tuple[dict, ...]
    weights: tuple[dict, ...]


def step_data(graph: Graph, batch: StepBatch, config: TrainConfig, step: int) -> StepData:
    """The data of `step` for micro-batch graph `graph` (its input leaves, data forms and outputs)."""
    forms = data_leaves([(n.name, n.op, n.inputs) for n in graph.nodes])
    shapes = graph.shapes()
    return StepData(batch, config, step, [(leaf.name, leaf.shape, forms.get(leaf.name, ""))
                                          for leaf in graph.leaves if leaf.role == "input"],
                    [(o, shapes[o]) for o in graph.outputs])


def seeded_weights(graph: Graph, config: TrainConfig) -> dict[str, torch.Tensor]:
    """Every weight of `graph` as a run starts from it (`leaf_value`, scaled by its fan-in)."""
    shapes = graph.shapes()
    nodes = [(n.name, n.op, n.inputs) for n in graph.nodes]
    return {leaf.name: leaf_value(leaf.name, leaf.shape, "weight", config, fan_in=fan_in(nodes, shapes, leaf.name))
            for leaf in graph.weights}


def starting_weights(graph: Graph | None, config: TrainConfig) -> dict[str, torch.Tensor] | None:
    """The weights a rank starts from: the graph's seeded ones (`seeded_weights`) when the plan's graph is known.

    Why not seed them from the PCG: a weight's scale is its fan-in, read off the first operator that contracts
    it, and a rewritten PCG may read it through other operators than the graph does (`matmul_fuse_shared_input`
    puts a `concat` between `wa` and its matmul, so the PCG alone gives fan-in 1 where the graph gives d_in):
    the ranks would then train other starting weights than the reference (`reference_run`) and the graph's
    module. None without a graph: `RankProgram` then seeds them from the PCG."""
    return seeded_weights(graph, config) if graph is not None else None


def reference_run(graph: Graph, config: TrainConfig, batch: StepBatch | None = None) -> Reference:
    """`graph` (one micro-batch's) trained in one process with the same seeds, data, loss and optimizer.

    Where the step's whole batch has a graph (`batch.whole`), that graph is
    trained on the whole batch, in one pass: the stronger check, since it
    does not share the backend's accumulation; otherwise `graph` runs the m
    micro-batches one after another, each objective divided by m, the
    gradients accumulated (and m = 1 is the graph itself either way).
    """
    batch = batch or StepBatch()
    m = batch.microbatches
    passes = [(batch.whole, None)] if batch.whole is not None else [(graph, k) for k in range(m)]
    weights = {name: w.requires_grad_() for name, w in seeded_weights(graph, config).items()}
    optimizer = _make_optimizer(list(weights.values()), config)
    losses, outputs, grads, values = [], [], [], []
    for step in range(config.steps):
        data = step_data(graph, batch, config, step)
        optimizer.zero_grad()
        loss, made = 0.0, {o: [] for o in graph.outputs}
        for run, k in passes:
            inputs, targets = ((data.whole_inputs(), data.whole_targets()) if k is None
                               else (data.inputs(k), data.targets(k)))
            env = evaluate_graph(run, {**weights, **inputs})
            term = sum(objective(env[o], targets[o], env[o].numel()) for o in run.outputs)
            if k is not None:
                term = term / m
            if term.requires_grad:  # a graph with no weight on any output's path has nothing to train
                term.backward()
            loss += float(term.detach())
            for o in run.outputs:
                made[o].append(env[o].detach().clone())
        optimizer.step()
        losses.append(loss)
        outputs.append({o: _expected(batch, o, got, k is None) for o, got in made.items()})
        grads.append({name: gradient_of(w).clone() for name, w in weights.items()})
        values.append({name: w.detach().clone() for name, w in weights.items()})
    return Reference(tuple(losses), tuple(outputs), tuple(grads), tuple(values))


def _expected(batch: StepBatch, name: str, made: list[torch.Tensor], whole: bool):
    """An output's expected value in a step (`Reference`): the micro-batches' values, or their mean."""
    if not whole:
        return tuple(made)
    value = made[0]
    if batch.cut(name) is None:
        return value
    return tuple(value[batch.block(value.shape, name, k)] for k in range(batch.microbatches))


# --------------------------------------------------------- one rank's program


@dataclass
class _Param:
    name: str
    tensor: torch.Tensor
    placement: Placement
    shape: tuple[int, ...]


@dataclass
class RankProgram:
    """The PCG as one rank runs it: stored weight pieces, groups, counters.

    `weights` gives full weight values by leaf name (a user's module, or the
    graph's seeded ones, `starting_weights`); without it weights come from
    the seed, scaled by their fan-in in the PCG. `forward` takes the full input values by
    leaf name the same way (dropout masks included: they are data).

    `nodes` restricts the program to the PCG nodes this rank computes (a
    pipeline stage's, `ir.pipeline.StageLayout.stage_nodes`; None: all): it
    stores only the weights those read, makes only their chains, and
    differentiates only the outputs among them. A stage's ranks then pass
    their own `ctx` (rank and world within the stage) and `groups` (the
    stage's process groups, `MeshGroups(..., stages=p)`).

    `keep`: node ids whose values the caller reads after forward, kept even
    where a recomputed block would drop them (`parallelize` reads the batch
    statistics).
    """

    pcg: PCG
    ctx: RankContext
    config: TrainConfig
    library: Library
    weights: Mapping[str, torch.Tensor] | None = None
    nodes: frozenset[int] | None = None
    groups: MeshGroups | None = None
    keep: frozenset[int] = frozenset()                     # values kept alive after forward whatever recompute says
    params: dict[int, _Param] = field(init=False)          # stored-at node id -> parameter
    folded: set[int] = field(init=False)                   # partition nodes absorbed into storage
    placements: dict[int, Placement] = field(init=False)   # node id -> where its pieces live
    output_names: tuple[str, ...] = field(init=False)
    state: StateShards = field(init=False)                 # ZeRO-1/2 (`PCG.zero`): the weights updated as shards

    def __post_init__(self) -> None:
        self.placements = check_mesh(self.pcg, self.ctx.world, self.library)
        if self.groups is None:
            self.groups = MeshGroups(self.pcg.mesh, self.ctx.rank, self.ctx.device, self.ctx.collective_timeout_s)
        self.output_names = self.pcg.output_names or tuple(f"out{i}" for i in range(len(self.pcg.outputs)))
        self.outputs_here = tuple((i, name) for i, name in zip(self.pcg.outputs, self.output_names)
                                  if self.computes(i))
        self.params, self.folded = {}, set()
        by_id = self._by_id = {n.id: n for n in self.pcg}
        self._unit_cache: dict[frozenset[int] | None, tuple[Unit, ...]] = {}
        for leaf, chain in weight_storage(self.pcg).items():
            if self.computes(leaf):
                self._store_weight(by_id[leaf], chain)
        self._grad_syncs = gradient_reductions(self.pcg)
        self.state = StateShards(self)
        self._chains = {i for i in weight_chains(self.pcg) if self.computes(i)}
        outputs = {i for i, _ in self.outputs_here}
        readers: dict[int, list[PNode]] = {}
        for node in self.pcg:
            for i in node.inputs:
                if self.computes(node.id):
                    readers.setdefault(i, []).append(node)
        # the chains' values read outside them: what a micro-batch reads and accumulates a gradient on
        self._chain_ends = sorted(i for i in self._chains if i in outputs or any(
            user.id not in self._chains for user in readers.get(i, [])))

    @property
    def mesh(self) -> Mesh:
        return self.pcg.mesh

    def computes(self, ident: int) -> bool:
        """Whether this rank computes PCG node `ident` (every node, unless `nodes` says otherwise)."""
        return self.nodes is None or ident in self.nodes

    def _store_weight(self, leaf: PNode, chain: tuple[int, ...]) -> None:
        """Hold this rank's piece of `leaf` as its storage chain's last node gives it (`ir.pcg.weight_storage`)."""
        views = storage_views(self.pcg, chain)
        if views:
            raise ExecutionError(f"weight '{leaf.op}' is stored as a block of its view "
                                 f"({', '.join(v.op for v in views)}: a strided block of the parameter, "
                                 "Megatron-LM's head-ordered fused projection); this backend stores a weight as a "
                                 "contiguous block of itself only")
        if self.weights is not None:
            full = self.weights[leaf.op].detach().to(self.config.torch_dtype())
        else:
            nodes = [(str(n.id), n.op, [str(i) for i in n.inputs]) for n in self.pcg]
            shapes = {str(n.id): n.shape for n in self.pcg}
            full = leaf_value(leaf.op, leaf.shape, "weight", self.config, fan_in=fan_in(nodes, shapes, str(leaf.id)))
        at = chain[-1]
        self.folded.update(chain[1:])
        placement = self.placements[at]
        where = piece_index(placement, leaf.shape, self.mesh, self.ctx.rank)
        piece = full[where].to(self.ctx.device, copy=True).requires_grad_()
        self.params[at] = _Param(leaf.op, piece, placement, tuple(leaf.shape))

    def step_data(self, batch: StepBatch, step: int) -> StepData:
        """This step's inputs and targets (`training_data.StepData`), from the PCG's leaves and outputs."""
        forms = data_leaves([(str(n.id), n.op, [str(i) for i in n.inputs]) for n in self.pcg])
        leaves = [(n.op, n.shape, forms.get(str(n.id), "")) for n in self.pcg
                  if n.kind == "leaf" and n.role != "weight"]
        outputs = [(name, self.pcg.node(i).shape) for i, name in zip(self.pcg.outputs, self.output_names)]
        return StepData(batch, self.config, step, list({leaf[0]: leaf for leaf in leaves}.values()), outputs)

    def weight_values(self, counter: CommCounter) -> "WeightValues":
        """The values of every weight's chain, made once per step for all its micro-batches (the module
        docstring): each one read outside its chain is handed on detached, to accumulate its gradient."""
        made: dict[int, tuple[torch.Tensor, Placement]] = {}
        for node in self.pcg:
            if node.id not in self._chains:
                continue
            if node.id in self.params:
                param = self.params[node.id]
                made[node.id] = (param.tensor, param.placement)
            elif node.kind == "parallel" and node.id not in self.folded:
                made[node.id] = self._parallel(node, made, counter)
        used = {}
        for ident in self._chain_ends:
            x, placement = made[ident]
            used[ident] = (x if x.grad_fn is None else x.detach().requires_grad_(), placement)
        return WeightValues(made, used)

    def reduce_gradients(self, weights: "WeightValues") -> None:
        """The backward of every weight's chain, once, on the gradients its values accumulated over the step's
        micro-batches: the gradient synchronisation (and the rest of the chains' backward collectives)."""
        ends, grads = [], []
        for ident, (used, _) in weights.used.items():
            made = weights.made[ident][0]
            if used is not made and used.grad is not None:
                ends.append(made)
                grads.append(used.grad)
        if ends:  # the same on every rank: the plan, not the data, decides which values get a gradient
            torch.autograd.backward(ends, grads)

    def forward(self, step: int, counter: CommCounter, inputs: Mapping[str, torch.Tensor],
                weights: "WeightValues | None" = None, nodes: frozenset[int] | set[int] | None = None,
                env: dict[int, tuple[torch.Tensor, Placement]] | None = None,
                recomputed: Callable[[Mapping[int, tuple[torch.Tensor, Placement]]], None] | None = None,
                ) -> dict[int, tuple[torch.Tensor, Placement]]:
        """Every node's local piece and placement for one (micro-)batch (`inputs`: full values by leaf name).

        With `weights` (`weight_values`), the weights' chains are not run again: their values are those;
        without, they run here, inside this forward's autograd graph (one batch, its own backward).
        `nodes` limits it to those (a pipeline chunk's); values already in `env` (what a chunk received
        from another stage) are taken as they are.

        Under activation recomputation (`pcg.recompute`), each block runs as one checkpointed region
        (`_checkpointed`): only the values it keeps are in the returned `env`, the others are dropped and
        made again before the block's backward; `recomputed` is then called with the values made again
        (for the memory count: they are alive, beside everything else, until the block's backward)."""
        env = {} if env is None else env
        for unit in self._units(None if nodes is None else frozenset(nodes)):
            if isinstance(unit, Region):
                self._checkpointed(unit, env, counter, recomputed)
                continue
            node = self._by_id[unit]
            if node.id in env:
                continue
            if weights is not None and node.id in self._chains:
                if node.id in weights.used:
                    env[node.id] = weights.used[node.id]
            elif node.id in self.params:
                param = self.params[node.id]
                env[node.id] = (param.tensor, param.placement)
            elif node.kind == "leaf":
                if node.role == "weight":
                    continue  # stored further down its partition chain
                value = inputs[node.op].to(self.config.torch_dtype()).to(self.ctx.device)
                env[node.id] = (value, self.placements[node.id])
            elif node.id in self.folded:
                continue
            else:
                env[node.id] = self._compute(node, env, counter)
        return env

    def _units(self, nodes: frozenset[int] | None) -> tuple[Unit, ...]:
        """What `forward` runs over `nodes` (None: all this rank computes), in order: node ids, and the
        recomputed blocks as regions (`recompute_regions.forward_units`); made once per distinct `nodes`."""
        if nodes not in self._unit_cache:
            computed = [n.id for n in self.pcg if self.computes(n.id) and (nodes is None or n.id in nodes)]
            try:
                self._unit_cache[nodes] = forward_units(self.pcg, computed, self.keep)
            except RegionError as err:
                raise ExecutionError(str(err)) from None
        return self._unit_cache[nodes]

    def _compute(self, node: PNode, env, counter: CommCounter) -> tuple[torch.Tensor, Placement]:
        """A compute or parallel node's piece and placement, from its inputs' in `env`."""
        if node.kind == "parallel":
            return self._parallel(node, env, counter)
        return apply_op(node.op, [env[i][0] for i in node.inputs], dict(node.attrs)), self.placements[node.id]

    def _checkpointed(self, region: Region, env: dict, counter: CommCounter, recomputed=None) -> None:
        """One recomputed block: its nodes run inside `torch.utils.checkpoint` (non-reentrant), from the values
        it reads in `env`; only the values it keeps are put in `env`.

        Early stopping is off: the whole block, every collective in it included, runs again before its
        backward, as the cost model prices it (Megatron's full recomputation; with early stopping torch
        would skip the block's last operators whose saved tensors no backward needs, e.g. a final
        all-reduce, and the ranks' collectives would no longer be the plan's). No RNG state is stashed:
        no operator of the library draws random numbers (a dropout's mask is a data input), so the
        recomputation is the same computation on the same inputs; torch's default determinism check
        still compares the recomputed saved tensors' shapes, dtypes and devices with the first run's."""
        clash = [i for i in region.runs if i in env]
        if clash:
            raise ExecutionError(f"node(s) {clash} of recomputed block {region.block} were handed in already made; "
                                 "a block recomputes from its inputs only")
        placements = {i: env[i][1] for i in region.inputs}
        made: dict[int, Placement] = {}
        runs = [0]

        def block(*pieces: torch.Tensor) -> tuple[torch.Tensor, ...]:
            values = {i: (x, placements[i]) for i, x in zip(region.inputs, pieces)}
            for ident in region.runs:
                values[ident] = self._compute(self._by_id[ident], values, counter)
            runs[0] += 1
            if runs[0] == 1:
                made.update((i, values[i][1]) for i in region.kept)
            elif recomputed is not None:
                recomputed({i: values[i] for i in region.runs})
            return tuple(values[i][0] for i in region.kept)

        kept = checkpoint(block, *(env[i][0] for i in region.inputs), use_reentrant=False, early_stop=False,
                          preserve_rng_state=False)
        for ident, x in zip(region.kept, kept):
            env[ident] = (x, made[ident])

    def _parallel(self, node: PNode, env, counter: CommCounter) -> tuple[torch.Tensor, Placement]:
        x, placement = env[node.inputs[0]]
        dims = {k: int(v) for k, v in node.attrs if k in ("dim", "to_dim")}
        tag = GRAD_SYNC if node.id in self._grad_syncs else ""
        return parallel_op(node.op, x, placement, node.axis(self.mesh), dims.get("dim"), self.groups, counter, tag,
                           deferred=node.id in self.state.replicates, to_dim=dims.get("to_dim"))

    def loss(self, env, targets: Mapping[str, torch.Tensor | None],
             outputs: Sequence[tuple[int, str]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's share to differentiate, its share of the reported loss); `targets`: full targets by
        output name (None for a loss output, `training_data.objective`). `outputs` (id, name): those of the
        outputs to count (default: every output this rank computes)."""
        pieces = []
        for out_id, name in (self.outputs_here if outputs is None else outputs):
            x, placement = env[out_id]
            shape = self.pcg.node(out_id).shape
            replicas, holders = output_holders(placement, self.mesh, name)
            target = targets[name]
            if target is not None:
                target = target[piece_index(placement, shape, self.mesh, self.ctx.rank)].to(self.ctx.device)
            pieces.append((x, target, prod(shape), replicas, holders))
        return loss_terms(pieces)


@dataclass(frozen=True)
class WeightValues:
    """A step's values of the weights' chains: `made` by the chains (inside autograd, from the stored pieces),
    and `used` by the micro-batches where a chain is read (detached, requiring a gradient, where `made` is not
    a stored piece itself)."""

    made: Mapping[int, tuple[torch.Tensor, Placement]]
    used: Mapping[int, tuple[torch.Tensor, Placement]]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held for the step (for the memory count), accumulated gradients included."""
        out = [x for x, _ in self.made.values()] + [x for x, _ in self.used.values()]
        return out + [x.grad for x, _ in self.used.values() if x.grad is not None]


def output_holders(placement: Placement, mesh: Mesh, name: str) -> tuple[int, int]:
    """(the product of the sizes of an output's replica axes, the number of ranks holding each of its pieces:
    the product over its free and replica axes); ExecutionError for a partial sum (the module docstring)."""
    if PARTIAL in placement.codes:
        axes = ", ".join(mesh.names[a] for a in placement.partial_axes)
        raise ExecutionError(f"output '{name}' is a partial sum on mesh axis {axes}; the plan must reduce it")
    sizes = mesh.shape
    replicas = prod(sizes[a] for a in placement.replica_axes)
    return replicas, replicas * prod(sizes[a] for a, c in enumerate(placement.codes) if c == FREE)


def gradient_reductions(pcg: PCG) -> set[int]:
    """The parallel nodes whose backward sums a weight's gradient over their axis: a `replicate` (all-reduce)
    or an `all_gather` (reduce-scatter) of a weight's value, read from its leaf through parallel operators
    only. Their collectives are the gradient synchronisation (tagged GRAD_SYNC)."""
    chains = weight_chains(pcg)
    return {node.id for node in pcg if node.id in chains and node.kind == "parallel"
            and node.op in (REPLICATE, ALL_GATHER)}


# ------------------------------------------------------------------ the worker


def gradient_of(weight: torch.Tensor) -> torch.Tensor:
    """A weight's gradient; zero for a weight that no output depends on."""
    return weight.grad.detach() if weight.grad is not None else torch.zeros_like(weight).detach()


def operator_library() -> Library:
    """The shipped operators only: all a rank needs to run a plan (rules are the optimizer's business)."""
    return load_library([shipped_rules_dir() / "ops.rule"])[0]


def run_rank(ctx: RankContext, pcg: PCG, config: TrainConfig, graph: Graph | None,
             library: Library | None = None, batch: StepBatch | None = None) -> dict:
    """One rank's training run (the function `launch` sends to each rank).

    `batch` says how a step's batch is cut into micro-batches (default: from `graph`, `ir.microbatch`);
    each step runs them as the module docstring says."""
    library = library or operator_library()
    if batch is None:
        batch = step_batch(graph, library) if graph is not None else StepBatch()
    m = batch.microbatches
    program = RankProgram(pcg, ctx, config, library, starting_weights(graph, config))
    optimizer = _make_optimizer(program.state.optimized(program.params), config)
    reference = reference_run(graph, config, batch) if config.check and graph is not None else None
    losses, times, cpu_times, steps_comm, diffs = [], [], [], [], []  # diffs: (relative, absolute, non-finite)
    memory = TensorMemory()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    for step in range(config.steps):
        counter = CommCounter()
        data = program.step_data(batch, step).loaded()   # before the clock: the data loader's work, not the plan's
        start = ctx.step_start()
        cpu_start = time.process_time()   # this rank's process (its gloo threads too): what the step cost it
        # once per step for all micro-batches: gathers, replicas (one batch runs them inside its own autograd)
        weights = program.weight_values(counter) if m > 1 else None
        reported = torch.zeros((), dtype=config.torch_dtype(), device=ctx.device)
        outputs: dict[str, list] = {name: [] for _, name in program.outputs_here}
        for k in range(m):
            env: dict = {}
            with memory.saving():
                program.forward(step, counter, data.inputs(k), weights, env=env,
                                recomputed=lambda made: memory.measure(_beside(env, made), program, optimizer,
                                                                       weights))
                to_diff, to_report = program.loss(env, data.targets(k))
            memory.measure(env, program, optimizer, weights)  # end of forward: activations, saved tensors
            if k == 0:
                optimizer.zero_grad()   # after the first forward: last step's gradients were alive until here
            if to_diff.requires_grad:  # same on every rank: the plan, not the data, decides it
                (to_diff / m).backward()   # the step's objective is the mean of its micro-batches'
            memory.measure(env, program, optimizer, weights)  # end of backward: every gradient alive
            reported = reported + to_report / m
            for out_id, name in program.outputs_here:
                x, placement = env[out_id]
                outputs[name].append((x.detach(), placement))
            del env, to_diff   # this micro-batch's values go before the next one's are made
        if weights is not None:
            program.reduce_gradients(weights)             # once per step: the gradient synchronisation
            memory.measure({}, program, optimizer, weights)
            del weights
        program.state.reduce(counter)   # ZeRO-1/2: each rank's shard of the gradient's sum
        optimizer.step()
        program.state.gather(counter)   # ... and the updated shards into the weights
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        total = reported.clone()
        dist.all_reduce(total)  # reporting only: not part of the plan, not counted
        losses.append(float(total))
        steps_comm.append(step_comm(counter, program.mesh))
        if reference is not None:
            diffs.append(compare_with_reference(program, outputs, reference, step, float(total)))
    found = Comparison()
    for d in diffs:
        found = found.merge(d)
    peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else memory.peak
    report = {"rank": ctx.rank, "losses": losses, "step_times": times, "step_cpu_times": cpu_times,
              "comm": steps_comm, "max_abs_diff": found.max_abs if diffs else None,
              "max_rel_diff": found.max_rel if diffs else None,
              "worst": found.worst, "nonfinite": list(found.nonfinite[:20]), "peak_memory_bytes": peak,
              "process_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    report["job"] = _job_summary(report, ctx)
    return report


def _beside(env: Mapping, made: Mapping) -> dict:
    """`env`'s values and a recomputed block's, all alive at once (the block's own kept values are made again
    beside the kept ones of its first run), for `TensorMemory.measure`."""
    return {**{("env", i): v for i, v in env.items()}, **{("recomputed", i): v for i, v in made.items()}}


class TensorMemory:
    """Peak bytes of this rank's live tensors on CPU, where torch keeps no allocator statistics.

    Counted at the high points of a step: the end of the forward pass
    (every activation, the tensors autograd saved for backward, parameters,
    last step's gradients, optimizer state), the end of the backward
    pass (every gradient), and under activation recomputation the moment
    each block has been computed again before its backward (its values
    beside everything alive then). Storages are counted once however many
    views share them. Backward's transient buffers are not seen, so this is
    a lower bound of the allocator's peak; it is what the plan's memory
    bound describes, unlike the process RSS (interpreter, torch, the
    single-process reference of --check).

    A recomputed block's values are not in the rank's values after its
    forward, and the tensors autograd saves inside its checkpoint are
    torch's placeholders, not tensors (the checkpoint's own saved-tensor
    hooks stand in for `saving`'s there), so what the block drops is not
    counted, what it keeps is, and its inputs, which the checkpoint saves
    outside its hooks, are counted through `saving` as any saved tensor.
    """

    def __init__(self) -> None:
        self.peak = 0
        self._saved: dict[object, dict[int, int]] = {}

    def saving(self, key: object = None):
        """A context recording the storages autograd saves for backward, under `key` (replacing what it
        recorded before): a pipeline stage keeps one per forward not yet run backward (`release`)."""
        saved = self._saved[key] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def release(self, key: object) -> None:
        """The tensors saved under `key` are gone (its backward ran)."""
        self._saved.pop(key, None)

    def measure(self, env, program: "RankProgram", optimizer: Optimizer, weights: "WeightValues | None" = None) -> None:
        live = {ptr: size for saved in self._saved.values() for ptr, size in saved.items()}
        tensors = [x for x, _ in env.values()] + [p.tensor for p in program.params.values()]
        tensors += weights.tensors() if weights is not None else []
        tensors += [p.tensor.grad for p in program.params.values() if p.tensor.grad is not None]
        tensors += [m for pair in optimizer.moments for m in pair]
        for t in tensors:
            storage = t.untyped_storage()
            live[storage.data_ptr()] = storage.nbytes()
        self.peak = max(self.peak, sum(live.values()))


def run_many(ctx: RankContext, jobs: Sequence[tuple[str, PCG, Graph | None]], config: TrainConfig) -> dict:
    """Several plans trained in turn in one process group: label -> job-wide figures (`_job_summary`).

    For tests and benchmarks that run many plans: one launch instead of one
    per plan (process start-up dominates small plans).
    """
    return {label: run_rank(ctx, pcg, config, graph)["job"] for label, pcg, graph in jobs}


def step_comm(counter: CommCounter, mesh: Mesh) -> dict:
    """What one rank's collectives sent in one step: in all, each distinct collective once, in bytes, for the
    gradient synchronisation, and per mesh axis (every axis of the mesh, in mesh order)."""
    return {"sent": float(counter.sent()), "distinct_sent": float(counter.distinct_sent()),
            "sent_bytes": float(counter.sent_bytes()), "grad_sync": float(counter.sent_tagged(GRAD_SYNC)),
            "events": len(counter.events), "grad_sync_events": sum(1 for e in counter.events if e.tag == GRAD_SYNC),
            "by_axis": {name: float(counter.sent(axis=name)) for name in mesh.names}}


def _job_summary(report: dict, ctx: RankContext) -> dict:
    """The job-wide figures, agreed by all ranks (so a torchrun rank can print them alone).

    Reporting traffic only: not part of the plan, not counted.
    """
    last = report["comm"][-1]
    by_axis = last.get("by_axis", {})  # the same axes, in the same order, on every rank (the plan's mesh)
    sums = torch.tensor([last["distinct_sent"], last["sent"], last["grad_sync"], len(report.get("nonfinite", [])),
                         *by_axis.values()], dtype=torch.float64, device=ctx.device)
    diff, rel = report["max_abs_diff"], report.get("max_rel_diff")
    maxes = torch.tensor([-1.0 if diff is None else diff, -1.0 if rel is None else rel,
                          float(report["peak_memory_bytes"]), float(report["process_rss_bytes"]),
                          *report["step_times"]], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(sums)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    sums, maxes = sums.tolist(), maxes.tolist()
    wall, cpu = _per_rank(ctx, report["step_times"]), _per_rank(ctx, report.get("step_cpu_times"))
    return {"distinct_sent": sums[0], "sent": sums[1], "grad_sync": sums[2], "nonfinite": int(sums[3]),
            "sent_by_axis": dict(zip(by_axis, sums[4:])),
            "nonfinite_names": report.get("nonfinite", []), "worst": report.get("worst", ""),
            "max_abs_diff": None if maxes[0] < 0 else maxes[0], "max_rel_diff": None if maxes[1] < 0 else maxes[1],
            "peak_memory_bytes": int(maxes[2]), "process_rss_bytes": int(maxes[3]), "step_times": maxes[4:],
            "step_times_by_rank": wall, "step_cpu_times_by_rank": cpu}


def _per_rank(ctx: RankContext, times: Sequence[float] | None) -> list[list[float]] | None:
    """Every rank's per-step figures, rank by rank (None where this runner does not record them). Reporting
    traffic only: not part of the plan, not counted."""
    if times is None:
        return None
    table = torch.zeros((ctx.world, len(times)), dtype=torch.float64, device=ctx.device)
    table[ctx.rank] = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(table)
    return table.tolist()


@dataclass(frozen=True)
class Comparison:
    """What `--check` found in one step on one rank: the largest absolute and relative differences (and
    which value had the largest relative one), and every value that is not finite on either side."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    worst: str = ""
    nonfinite: tuple[str, ...] = ()

    def merge(self, other: "Comparison") -> "Comparison":
        worst = self if self.max_rel >= other.max_rel else other
        return Comparison(max(self.max_abs, other.max_abs), worst.max_rel, worst.worst,
                          self.nonfinite + other.nonfinite)


def compare_values(pairs) -> Comparison:
    """--check's one comparison: (what, got, want) triples, got a rank's piece and want the reference's.

    A tensor's relative difference is its largest absolute difference over
    its scale: the larger of the two sides' largest magnitudes, but at least
    1e-3 of the largest magnitude among the values of its kind (every
    gradient, every weight, the loss and outputs; the kind is the label's
    first word). So a loss of 4.5e7 off by 4e-8 differs by 1e-15, and a
    gradient that is zero in exact arithmetic (rounding noise on both sides)
    is measured against the gradients that are not. A value that is not
    finite on either side is listed: `--check` fails on it whatever the
    differences.
    """
    result = Comparison()
    rows, kind_scale = [], {}
    for what, got, want in pairs:
        got = torch.as_tensor(got).detach().cpu().to(torch.float64)
        want = torch.as_tensor(want).detach().cpu().to(torch.float64)
        if not (bool(torch.isfinite(got).all()) and bool(torch.isfinite(want).all())):
            result = result.merge(Comparison(nonfinite=(what,)))
            continue
        if got.numel() == 0:
            continue
        scale = max(float(got.abs().max()), float(want.abs().max()))
        kind = what.split(" ")[0]
        kind_scale[kind] = max(kind_scale.get(kind, 0.0), scale)
        rows.append((what, kind, float((got - want).abs().max()), scale))
    for what, kind, diff, scale in rows:
        scale = max(scale, 1e-3 * kind_scale[kind])
        result = result.merge(Comparison(diff, diff / scale if scale > 0 else 0.0, what))
    return result


def compare_with_reference(program: RankProgram, outputs: Mapping[str, list], reference: Reference, step: int,
                           loss: float) -> Comparison:
    """This rank's pieces against the reference, this step: outputs, loss, gradients, updated weights.

    `outputs` are each output's (piece, placement) per micro-batch, for the outputs this rank computes
    (`RankProgram.outputs_here`: a pipeline stage's); an output the reference knows per micro-batch is
    compared micro-batch by micro-batch, one it knows as the whole batch's (a loss) as the mean over the
    micro-batches (`Reference`)."""
    rank = program.ctx.rank
    missing: list[Comparison] = []
    pairs = [("loss", torch.tensor(loss), torch.tensor(reference.losses[step]))]
    for _, name in program.outputs_here:
        pieces = outputs[name]
        placement = pieces[0][1]
        expected = reference.outputs[step].get(name)
        if expected is None:  # a renamed output is a failure, never skipped
            missing.append(Comparison(math.inf, math.inf, f"output {name} (the reference has no such output)"))
        elif isinstance(expected, tuple):
            for k, ((x, _), want) in enumerate(zip(pieces, expected)):
                what = f"output {name}" + (f" (micro-batch {k})" if len(pieces) > 1 else "")
                pairs.append((what, x, want[piece_index(placement, want.shape, program.mesh, rank)]))
        else:
            mean = sum(x for x, _ in pieces) / len(pieces)
            pairs.append((f"output {name}", mean, expected[piece_index(placement, expected.shape, program.mesh,
                                                                         rank)]))
    for at, param in program.params.items():
        where = piece_index(param.placement, param.shape, program.mesh, rank)
        expected = reference.grads[step][param.name][where]
        shard = program.state.shards.get(at)
        if shard is not None:   # ZeRO: this rank holds only its shard of the summed gradient
            pairs.append((f"gradient of {param.name} (this rank's shard)", gradient_of(shard.tensor),
                          shard.expected_gradient(expected)))
        else:
            pairs.append((f"gradient of {param.name}", gradient_of(param.tensor), expected))
        pairs.append((f"weight {param.name}", param.tensor, reference.weights[step][param.name][where]))
    result = compare_values(pairs)
    for found in missing:
        result = result.merge(found)
    return result


# --------------------------------------------------------------- entry point


@dataclass(frozen=True)
class Prediction:
    """The cost model's figures for the plan that runs (the plan's `totals`, or a baseline's)."""

    comm_elements: float | None = None
    grad_sync_elements: float | None = None
    peak_memory_bytes: float | None = None
    time_s: float | None = None
    # the machine the figures are for: its name, and whether it was measured (`parsat calibrate`), a preset,
    # or described by hand; a preset's step time is not this box's, and `parsat run` says so beside its own
    machine: str | None = None
    machine_kind: str | None = None   # "calibrated" | "preset" | "described"

    @staticmethod
    def from_totals(totals) -> "Prediction":
        """From a plan JSON's `totals` object (or a baseline's); missing fields stay None."""
        totals = totals if isinstance(totals, dict) else {}
        return Prediction(totals.get("comm_elements"), totals.get("grad_sync_elements"),
                          totals.get("peak_memory_bytes"), totals.get("time_s"))

    def on_machine(self, machine) -> "Prediction":
        """This prediction, naming the plan file's machine (its `machine` object) and what kind it is."""
        if not isinstance(machine, Mapping) or not isinstance(machine.get("name"), str):
            return self
        comm = machine.get("comm")
        measured = isinstance(comm, Mapping) and bool(comm.get("points"))
        kind = "calibrated" if measured else "preset" if machine["name"] in PRESETS else "described"
        return replace(self, machine=machine["name"], machine_kind=kind)


@dataclass(frozen=True)
class RunResult:
    """What `parsat run --json` prints: communication per step, summed over ranks.

    `comm_elements_measured` counts every collective every rank ran, the
    redundant ones of a tensor held by fewer pieces than ranks included,
    which is the cost model's convention (parsat/cost/model.py); the distinct
    collectives alone are `comm_elements_distinct`. `grad_sync_elements_*`
    is the part that synchronises weights' gradients (the all-reduces of
    replicated weights, the reduce-scatters of weights stored sharded).
    `comm_elements_by_axis` splits the measured figure by mesh axis.
    """

    check: str | None
    max_abs_diff: float | None
    comm_elements_measured: float
    comm_elements_distinct: float
    grad_sync_elements_measured: float
    step_time_s: float
    peak_memory_bytes: int
    process_rss_bytes: int
    losses: tuple[float, ...]
    predicted: Prediction = Prediction()
    max_rel_diff: float | None = None
    nonfinite: int = 0
    worst: str = ""
    comm_by_axis: Mapping[str, float] = field(default_factory=dict)
    microbatches: int = 1   # per step: activations' collectives ran this many times, the gradient sync once
    # a pipelined plan: each stage's collectives, point-to-point and shared-weight figures beside the prediction
    # (parsat/backend/pipeline_run.py `pipeline_comparison`); the totals above are then summed over every stage's ranks
    pipeline: Mapping | None = None
    recompute: str = "none"   # the plan's activation recomputation (`PCG.recompute`) the run followed
    # the step's median and middle half over the steps after the warm-up, each step the slowest rank's
    # (`step_statistic`: the statistic `parsat calibrate` times its figures with); step_time_s is its median
    step_spread: Spread | None = None
    # each rank's median CPU seconds a step (its process, every thread): what the step cost the rank whatever
    # else ran on the box; wall time beyond it was spent waiting (for a peer, a collective, or a core)
    step_cpu_s: tuple[float, ...] = ()
    # every step's wall and CPU seconds, rank by rank (the warm-up included): what the figures above summarise
    step_times_by_rank: tuple[tuple[float, ...], ...] = ()
    step_cpu_times_by_rank: tuple[tuple[float, ...], ...] = ()

    @staticmethod
    def of_job(reports: Sequence[dict], config: TrainConfig, predicted: Prediction | None = None,
               microbatches: int = 1, recompute: str = "none") -> "RunResult":
        """The summary of a launched job: every rank's report carries the job-wide figures (`_job_summary`);
        under torchrun there is only this rank's."""
        job = reports[0]["job"]
        step = spread(steady(job["step_times"]))
        by_rank = tuple(tuple(times) for times in job.get("step_times_by_rank") or ())
        cpu_by_rank = tuple(tuple(times) for times in job.get("step_cpu_times_by_rank") or ())
        cpu = tuple(spread(steady(times)).median_s for times in cpu_by_rank)
        return RunResult(check_verdict(job, config), job["max_abs_diff"], job["sent"], job["distinct_sent"],
                         job["grad_sync"], step.median_s, job["peak_memory_bytes"],
                         job["process_rss_bytes"], tuple(reports[0]["losses"]), predicted or Prediction(),
                         job.get("max_rel_diff"), job.get("nonfinite", 0), job.get("worst", ""),
                         dict(job.get("sent_by_axis", {})), microbatches, recompute=recompute, step_spread=step,
                         step_cpu_s=cpu, step_times_by_rank=by_rank, step_cpu_times_by_rank=cpu_by_rank)

    @property
    def comm_elements_predicted(self) -> float | None:
        return self.predicted.comm_elements

    @property
    def comm_matches(self) -> bool | None:
        """Whether measured communication equals the prediction (None: nothing predicted)."""
        if self.predicted.comm_elements is None:
            return None
        return abs(self.comm_elements_measured - self.predicted.comm_elements) < 0.5

    def to_dict(self) -> dict:
        return {"check": self.check, "max_abs_diff": self.max_abs_diff, "max_rel_diff": self.max_rel_diff,
                "nonfinite_values": self.nonfinite, "largest_difference_in": self.worst,
                "comm_elements_measured": self.comm_elements_measured,
                "comm_elements_predicted": self.predicted.comm_elements,
                "step_time_s": self.step_time_s, "peak_memory_bytes": self.peak_memory_bytes,
                **({"step_time_quartiles_s": [self.step_spread.low_s, self.step_spread.high_s],
                    "steps_timed": self.step_spread.count} if self.step_spread else {}),
                **({"step_cpu_s_by_rank": list(self.step_cpu_s)} if self.step_cpu_s else {}),
                **({"step_times_by_rank": [list(t) for t in self.step_times_by_rank]} if self.step_times_by_rank
                   else {}),
                **({"step_cpu_times_by_rank": [list(t) for t in self.step_cpu_times_by_rank]}
                   if self.step_cpu_times_by_rank else {}),
                "comm_matches": self.comm_matches,
                "comm_elements_distinct": self.comm_elements_distinct,
                "comm_elements_by_axis": dict(self.comm_by_axis),
                "grad_sync_elements_measured": self.grad_sync_elements_measured,
                "grad_sync_elements_predicted": self.predicted.grad_sync_elements,
                "step_time_predicted_s": self.predicted.time_s,
                "peak_memory_predicted_bytes": self.predicted.peak_memory_bytes,
                "process_rss_bytes": self.process_rss_bytes, "microbatches": self.microbatches,
                "recompute": self.recompute,
                "losses": list(self.losses), **({"pipeline": dict(self.pipeline)} if self.pipeline else {})}


def run_plan(pcg: PCG, nproc: int, config: TrainConfig, graph: Graph | None = None,
             predicted: Prediction | None = None, backend: str | None = None,
             timeout_s: float = 300.0, collective_timeout_s: float = 30.0) -> RunResult:
    """Train `pcg` on `nproc` spawned ranks (or the torchrun group) and summarise.

    `graph` is the plan's graph (one micro-batch's: its `microbatches` say how many a step runs). With
    `config.check`, it (or its whole batch's graph, `reference_run`) is trained in every rank's process as
    the reference. `timeout_s` bounds the
    whole job; `collective_timeout_s` one collective: when it is the shorter,
    a rank that hangs is named as the one its peers waited for, not merely
    as "still running".
    """
    if config.check and graph is None:
        raise ExecutionError("--check needs the original graph to compare with")
    if config.steps < 1:
        raise ExecutionError(f"--steps must be >= 1, got {config.steps}")
    check_mesh(pcg, nproc)  # before any rank starts
    batch = step_batch(graph, operator_library()) if graph is not None else StepBatch()  # once, for every rank
    try:
        check_runnable(pcg, batch.microbatches)
    except ShardingError as err:
        raise ExecutionError(str(err)) from None
    reports = launch(run_rank, (pcg, config, graph, None, batch),
                     LaunchConfig(nproc=nproc, backend=backend, timeout_s=timeout_s,
                                  collective_timeout_s=collective_timeout_s))
    return RunResult.of_job(reports, config, predicted, batch.microbatches, pcg.recompute)


def check_verdict(job: Mapping, config: TrainConfig) -> str | None:
    """'passed' when every compared value was finite and within the relative tolerance; None without --check."""
    if not config.check:
        return None
    rel = job.get("max_rel_diff")
    return "passed" if rel is not None and not job.get("nonfinite") and rel <= config.tolerance else "failed"


def check_mesh(pcg: PCG, nproc: int, library: Library | None = None) -> dict[int, Placement]:
    """Every node's placement on the plan's mesh; ExecutionError for a job whose rank count is not the mesh's
    size, or a plan whose pieces cannot be laid out on it. `parsat run` calls it before any rank starts
    (otherwise every rank finds it out at the same node), and each rank once, for the placements it runs
    with."""
    mesh = pcg.mesh
    if mesh.world != nproc:
        what = f"a mesh of {mesh.world} rank{'s' if mesh.world != 1 else ''}" + (f" ({mesh})" if len(mesh) else "")
        raise ExecutionError(f"the plan runs on {what}, but --nproc is {nproc}: start as many ranks as the mesh "
                             "has devices")
    try:
        return derive_placements(pcg, (library or operator_library()).ops)
    except PlacementError as err:
        raise ExecutionError(f"the plan cannot run on its mesh ({mesh or 'one device'}): {err}") from None


__all__ = ["ExecutionError", "PlacementError", "Prediction", "RunResult", "evaluate_graph", "run_many", "TrainConfig", "reference_run", "run_plan",
           "check_mesh", "leaf_value", "output_holders"]
