"""Pipeline stages: a PCG cut into contiguous chunks of layers, the chunks' stages, and their schedule.

A pipelined plan runs one PCG (the stage plan, on the stage's sub-mesh)
split by layers (`ir.blocks`: the prelude OUTSIDE every block, then block
0 .. N-1; the head counts with the last block). The full mesh is
`pp x` the stage mesh: rank r is stage r // S, local rank r % S, and every
stage lays its part of the PCG out the same way, so a value crossing from
one stage to another goes from local rank i to local rank i, piece for
piece (`Crossing`). With `v` chunks per stage (interleaved 1F1B) the model
is cut into p * v chunks, chunk c on stage c % p (Megatron's layout).

This module is the one place that says which PCG node runs where
(`lay_out_stages`) and in which order each stage runs its micro-batches
(`schedule_order`); the cost model simulates that order
(`simulate_schedule`) and the backend runs it.

What moves is values, never what they are: a chunk computes the PCG nodes
it owns exactly as the unstaged PCG does, from the same inputs; values made
from graph inputs alone (masks, positions) or from weights alone (a weight's
parallel operators, a tied embedding's transpose) are recomputed by every
chunk that reads them (`free_nodes`), so a chunk needs nothing but its
crossings. A weight read on two stages (GPT's tied
embedding and LM head) is held by both, and its gradient is summed over
them before the update (Megatron's embedding group), so both copies stay
equal to the unstaged weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import filterfalse
from operator import attrgetter
from typing import Iterable, Mapping, Sequence

from parsat.ir.blocks import OUTSIDE, node_blocks
from parsat.ir.costs import NodeCost
from parsat.ir.pcg import PCG, WEIGHT, weight_storage

GPIPE, ONE_F_ONE_B, INTERLEAVED = "gpipe", "1f1b", "interleaved"
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED)
FORWARD, BACKWARD = "F", "B"


class PipelineError(ValueError):
    """A pipeline that cannot be laid out or scheduled as asked."""


def interleaved_chunk_counts(layers: int, degree: int) -> tuple[int, ...]:
    """The chunks per stage v >= 2 an interleaved schedule can cut `layers` layers into on `degree` stages, least
    first: those for which each stage's layers split evenly into its v chunks (degree x v divides the layers).

    Why only those: it is the rule of the runtimes whose runs the plans are compared with. Megatron-LM takes
    the chunks as `--num-layers-per-virtual-pipeline-stage` and requires `(num_layers / pipeline size) %
    num_layers_per_virtual_pipeline_stage == 0` (NVIDIA/Megatron-LM a8d172b, 2021, the SC'21 code:
    megatron/arguments.py lines 118-127, v = layers per stage / that); Megatron-Core r0.8.0 asserts the same
    beside `--virtual-pipeline-model-parallel-size` (megatron/training/arguments.py, tag core_v0.8.0). A layout
    of uneven chunks (105 layers on 35 stages as chunks of 2 and 1) is one neither can run."""
    if degree < 1 or layers % degree:
        return ()
    per_stage = layers // degree
    return tuple(v for v in range(2, per_stage + 1) if per_stage % v == 0)


def chunks_refusal(schedule: str, layers: int, degree: int, chunks_per_stage: int) -> str | None:
    """Why `schedule` cannot cut `layers` layers into `chunks_per_stage` chunks on each of `degree` stages
    (`interleaved_chunk_counts`' rule for the interleaved schedule; one chunk a stage for the others); None
    when it can."""
    if schedule != INTERLEAVED:
        return None if chunks_per_stage == 1 else f"{schedule} runs one chunk per stage, not {chunks_per_stage}"
    counts = interleaved_chunk_counts(layers, degree)
    if chunks_per_stage in counts:
        return None
    return (f"interleaved 1F1B with {chunks_per_stage} chunks per stage needs each stage's layers to split evenly "
            f"into its chunks, as Megatron-LM requires: {layers} layers on {degree} stages "
            + (f"split into {', '.join(map(str, counts))} chunks per stage" if counts else
               "have no split into 2 or more equal chunks per stage"))


def layout_chunks_refusal(schedule: str, degree: int, chunk_layers: Sequence[Sequence[int]]) -> str | None:
    """Why a laid-out pipeline (each chunk's layers, in chunk order; `OUTSIDE` rides with a chunk, as the
    embedding rides with Megatron-LM's first stage, and is not counted) cannot run under `schedule`:
    `chunks_refusal` of its totals, or, for the interleaved schedule, chunks of unequal layer counts (the same
    rule: Megatron-LM cuts every chunk to `--num-layers-per-virtual-pipeline-stage` layers). None when it can.
    What a plan file is checked against on load, so that a hand-edited or old plan is refused as the search
    refuses it."""
    if degree < 1 or len(chunk_layers) % degree:
        return f"{len(chunk_layers)} chunks do not make an equal number on each of {degree} stages"
    counts = [sum(1 for layer in layers if layer != OUTSIDE) for layers in chunk_layers]
    why = chunks_refusal(schedule, sum(counts), degree, len(chunk_layers) // degree)
    if why is None and schedule == INTERLEAVED and len(set(counts)) > 1:
        why = (f"interleaved 1F1B needs every chunk to hold the same number of layers, as Megatron-LM requires: "
               f"these chunks hold {', '.join(map(str, counts))}")
    return why


@dataclass(frozen=True)
class Chunk:
    """Contiguous layers run by one stage: the PCG nodes it computes, in PCG order."""

    index: int
    stage: int
    layers: tuple[int, ...]       # the layers it owns (`ir.blocks`), ascending
    nodes: tuple[int, ...]        # the PCG nodes it computes: its own and the free values they read

    def to_dict(self) -> dict:
        return {"index": self.index, "stage": self.stage, "layers": list(self.layers), "nodes": list(self.nodes)}


@dataclass(frozen=True)
class Crossing:
    """A value one chunk makes and a later chunk reads: sent each micro-batch from the source chunk's stage to
    the target's, local rank to local rank (its piece), and its gradient sent back in the backward."""

    node: int
    source: int                  # chunk
    target: int                  # chunk
    piece_elements: int          # per rank, per micro-batch

    def to_dict(self) -> dict:
        return {"node": self.node, "source": self.source, "target": self.target,
                "piece_elements": self.piece_elements}


@dataclass(frozen=True)
class StageLayout:
    """Where every PCG node runs: the chunks, the values that cross between them, and the weights held on
    more than one stage (their gradients summed over those stages each step)."""

    degree: int                  # p, the pipeline stages
    chunks_per_stage: int        # v
    chunks: tuple[Chunk, ...]
    crossings: tuple[Crossing, ...]
    shared_weights: tuple[tuple[int, tuple[int, ...]], ...]   # (weight leaf id, the stages that hold it)

    def stage_chunks(self, stage: int) -> tuple[Chunk, ...]:
        return tuple(c for c in self.chunks if c.stage == stage)

    def stage_nodes(self, stage: int) -> set[int]:
        """The PCG nodes a stage's ranks compute: its chunks' (a free value two of its chunks read, once)."""
        return {n for c in self.stage_chunks(stage) for n in c.nodes}

    def to_dict(self) -> dict:
        return {"degree": self.degree, "chunks_per_stage": self.chunks_per_stage,
                "chunks": [c.to_dict() for c in self.chunks], "crossings": [c.to_dict() for c in self.crossings],
                "shared_weights": [{"node": n, "stages": list(s)} for n, s in self.shared_weights]}

    @staticmethod
    def from_dict(data: Mapping) -> "StageLayout":
        return StageLayout(int(data["degree"]), int(data["chunks_per_stage"]),
                           tuple(Chunk(int(c["index"]), int(c["stage"]), tuple(int(x) for x in c["layers"]),
                                       tuple(int(x) for x in c["nodes"])) for c in data["chunks"]),
                           tuple(Crossing(int(c["node"]), int(c["source"]), int(c["target"]),
                                          int(c["piece_elements"])) for c in data["crossings"]),
                           tuple((int(w["node"]), tuple(int(s) for s in w["stages"]))
                                 for w in data["shared_weights"]))


def pcg_layers(pcg: PCG) -> tuple[int, ...]:
    """The layers a PCG can be cut between, in order: the blocks of its non-free nodes (`free_nodes`)."""
    return LayerMap(pcg).layers


def free_nodes(pcg: PCG) -> set[int]:
    """Nodes every chunk may compute for itself: leaves, and nodes made from graph inputs alone (masks,
    positions) or from weights alone (a tied embedding's transpose, a weight's parallel operators). What mixes
    the two is an activation a layer owns.

    The kinds of leaf a node reads are kept as bits (one per role, `bit`), not as a frozenset made per node: 77
    calls were ~1% of llama-70b:64's search. One bit set is one kind read, as one member was."""
    bit: dict[str, int] = {}
    reads: dict[int, int] = {}
    free: set[int] = set()
    for node in pcg.nodes:
        if node.kind == "leaf":
            reads[node.id] = bit.setdefault(node.role or "input", 1 << len(bit))
            free.add(node.id)
            continue
        kinds = 0
        for i in node.inputs:
            kinds |= reads[i]
        reads[node.id] = kinds
        if kinds and not kinds & (kinds - 1) and all(i in free for i in node.inputs):
            free.add(node.id)
    return free


def lay_out_stages(pcg: PCG, starts: Sequence[int], degree: int) -> StageLayout:
    """The PCG cut into chunks at `starts` (each chunk's first layer, ascending, the first one the PCG's first
    layer; p * v of them), chunk c on stage c % p."""
    return LayerMap(pcg).lay_out(starts, degree)


class LayerStructure:
    """What cutting a PCG into stages reads of its nodes' structure alone (`ir.pcg.STRUCTURE`: ids, kinds,
    operators, inputs, roles, origins) and its outputs: each node's layer (`ir.blocks.node_blocks`), the free
    values (`free_nodes`), the layers, each node's place in the PCG's order, the free values each node needs, the
    weights, each layer's nodes (`layer_members`), the other layers reading each node (`read_in`), the free values
    each layer alone reads (`layer_free`) and the nodes of each run of layers (`chunk_nodes`). Worked out once per
    `PCG.structural` table (`layer_structure`) and shared by every `LayerMap` of the PCGs that share it.

    Why shared: none of these reads a node's shape, attributes, degrees or placement, nor the ZeRO stage or the
    recomputation policy, so two PCGs whose nodes have the same `STRUCTURE` fields and the same outputs (a layout's
    forms, `ir.pcg.restated`; a layout rescaled to another micro-batch size, `PCG.reshaped`: those that share
    `PCG.structural`) give the same values. llama-70b:64's stage search made 106 layer maps of 68 such tables, each
    walking its ~5,000 nodes four times (`free_nodes`, `needs`, `layer_members`, `read_in`), and each map's chunk
    nodes were sorted again. What a map reads of the sizes and placements (a crossing's piece, `blocked`'s partial
    sums) stays the map's own. Read only."""

    def __init__(self, pcg: PCG):
        self.blocks = node_blocks(pcg)
        self.free = free_nodes(pcg)
        ids = pcg.ids
        # in C over the ids: the blocks of the nodes that are not free, and each node's place in the PCG's order
        self.layers = tuple(sorted(set(map(self.blocks.__getitem__, filterfalse(self.free.__contains__, ids)))))
        self.position = dict(zip(ids, range(len(ids))))
        needs: dict[int, frozenset[int]] = {}   # node -> the free values it reads, directly or through free ones
        free, none = self.free, frozenset()
        disjoint = free.isdisjoint
        for node in pcg.nodes:
            # most nodes read no free value (~6 nodes in 7): one shared empty set, found by one C test of their inputs
            # rather than a list of them made and tested in Python (the same sets either way)
            if disjoint(node.inputs):
                needs[node.id] = none
                continue
            direct = [i for i in node.inputs if i in free]
            needs[node.id] = frozenset(direct).union(*[needs[i] for i in direct])
        self.needs = needs
        self.weights = [n.id for n in pcg.nodes if n.kind == "leaf" and n.role == WEIGHT]
        # each node's id and inputs, in the PCG's order: what `layer_members` and `read_in` walk (the structure
        # keeps these, not a PCG, so that it holds no shapes or placements of the PCG it was first made from)
        self._inputs = tuple((n.id, n.inputs) for n in pcg.nodes)
        self._runs: dict[tuple[int, int], tuple[frozenset[int], tuple[int, ...]]] = {}   # `chunk_nodes`

    @cached_property
    def model_layers(self) -> int:
        """The model's layers, as a runtime counts them to split among stages and chunks: the blocks, less the
        values outside every block (`ir.blocks.OUTSIDE`: the embedding), which ride with the first chunk as
        Megatron-LM's embedding rides with its first stage (`equal_starts` gives that chunk one layer more)."""
        return sum(1 for layer in self.layers if layer != OUTSIDE)

    @cached_property
    def layer_members(self) -> dict[int, frozenset[int]]:
        """Layer -> the nodes a chunk holding it computes for it: the nodes of the layer (`blocks`) and the free
        values each reads. A chunk's nodes are the union of its layers' (`LayerMap.lay_out`); only a free value
        can be in two layers' sets."""
        members: dict[int, set[int]] = {layer: set() for layer in self.layers}
        for ident, _inputs in self._inputs:
            if ident not in self.free:
                found = members[self.blocks[ident]]
                found.add(ident)
                found |= self.needs[ident]
        return {layer: frozenset(nodes) for layer, nodes in members.items()}

    @cached_property
    def read_in(self) -> tuple[tuple[int, int, frozenset[int]], ...]:
        """The nodes some node of another layer reads (free values left out on both sides), in the PCG's order,
        each as (node, its layer, the other layers that read it): `LayerMap.reader_layers` without the pieces'
        sizes. Found from the readers' inputs in one pass (a reader of another layer, neither free), not from a
        table of every node's readers (`PCG.readers_of`): the same sets."""
        free, blocks = self.free, self.blocks
        read_in: dict[int, set[int]] = {}
        for ident, inputs in self._inputs:
            if ident in free:
                continue
            layer = blocks[ident]
            for i in inputs:
                if i not in free and blocks[i] != layer:
                    read_in.setdefault(i, set()).add(layer)
        return tuple((ident, blocks[ident], frozenset(read_in[ident])) for ident, _inputs in self._inputs
                     if read_in.get(ident))

    @cached_property
    def layer_free(self) -> tuple[tuple[tuple[int, ...], frozenset[int]], ...]:
        """Per layer, in order: the free values among its `layer_members` that no other layer's members hold
        (ascending ids), and those that some other layer's hold too (a mask, a rotary table, a tied embedding: a
        handful). A chunk counts the first with its layer wherever it lies (no other chunk reads them), the second
        once per stage (`cost.pipeline.StagePricer._chunk_bytes`). Structural: the members and free values are."""
        members, free = self.layer_members, self.free
        needed = [members[layer] & free for layer in self.layers]
        readers: dict[int, int] = {}
        for values in needed:
            for i in values:
                readers[i] = readers.get(i, 0) + 1
        return tuple((tuple(sorted(i for i in values if readers[i] == 1)),
                      frozenset(i for i in values if readers[i] > 1)) for values in needed)

    @cached_property
    def spanning_weights(self) -> tuple[int, ...]:
        """The weights (in `weights`' order) that two or more layers' `layer_members` hold: the only ones a cut can
        put on two stages (`LayerMap.lay_out`'s shared weights). Why: a weight is a leaf, so free, and a layer's
        members hold a free value only as one a node of the layer needs; a chunk's nodes are its layers' members,
        so a weight one layer alone holds lies in that layer's chunk alone, and one no layer holds in none.
        llama-70b's 723 weights: none held by two layers (an untied head), a tied embedding would be."""
        holders: dict[int, int] = {}
        weights = frozenset(self.weights)
        for members in self.layer_members.values():
            for i in members & weights:
                holders[i] = holders.get(i, 0) + 1
        return tuple(w for w in self.weights if holders.get(w, 0) > 1)

    def chunk_nodes(self, first: int, end: int) -> tuple[frozenset[int], tuple[int, ...]]:
        """The nodes of a chunk holding the layers `layers[first:end]`: the union of their `layer_members`, as a
        set and in the PCG's order. Worked out once per run of layers and structure (`_runs`): the cut search lays
        out hundreds of cuts of one stage plan, and neighbouring cuts share most of their chunks; the answer reads
        nothing but the run, so a run found again is the same set and order (gpt-175b:1024's union and sort were
        most of `lay_out`'s 3 CPU s)."""
        found = self._runs.get((first, end))
        if found is None:
            union = frozenset().union(*(self.layer_members[self.layers[i]] for i in range(first, end)))
            found = self._runs[(first, end)] = (union, tuple(sorted(union, key=self.position.__getitem__)))
        return found


def layer_structure(pcg: PCG) -> LayerStructure:
    """`pcg`'s `LayerStructure`, worked out once per structure (`PCG.derive`, kept in `PCG.structural`, which the
    PCG's restated and reshaped forms share: `LayerStructure` says why that is sound). Read only."""
    return pcg.derive("layer_structure", None, lambda: LayerStructure(pcg), structural=True)


class LayerMap:
    """What cutting one PCG into stages needs, worked out once (the cut search lays out many cuts of one PCG):
    its layers, each node's layer, its free values and what each node needs of them (its `LayerStructure`,
    shared by the PCGs of one structure), the other layers reading each node with the pieces they read
    (`reader_layers`) and the layers no chunk may begin at (`blocked`)."""

    def __init__(self, pcg: PCG):
        self.pcg = pcg
        self.structure = structure = layer_structure(pcg)
        self.blocks, self.free, self.layers = structure.blocks, structure.free, structure.layers
        self.position, self.needs, self.weights = structure.position, structure.needs, structure.weights

    @property
    def model_layers(self) -> int:
        """`LayerStructure.model_layers`."""
        return self.structure.model_layers

    @property
    def layer_members(self) -> dict[int, frozenset[int]]:
        """`LayerStructure.layer_members`."""
        return self.structure.layer_members

    @cached_property
    def reader_layers(self) -> tuple[tuple[int, int, frozenset[int], int], ...]:
        """The nodes some node of another layer reads (free values left out on both sides), in the PCG's order,
        each as (node, its layer, the other layers that read it, its piece's elements): the only nodes `lay_out`
        can find crossing chunks. Why: a chunk is a run of whole layers (`chunk_of_layer`), so a reader in the
        node's own layer is in its chunk, and a reader of another layer is in the chunk of that layer; the chunks
        `lay_out` finds reading a node are those of these layers, less its own. Worked out once per map: the
        cut search lays out hundreds of cuts of one stage plan, and each walked every node and its readers. The
        nodes and layers are the structure's (`LayerStructure.read_in`); the pieces this PCG's."""
        nodes, position = self.pcg.nodes, self.position
        return tuple((node, layer, found, nodes[position[node]].piece_size)
                     for node, layer, found in self.structure.read_in)

    @cached_property
    def blocked(self) -> dict[int, int]:
        """Layer -> a partial sum that a chunk beginning there would receive from an earlier chunk: a node whose
        value is not yet reduced on some mesh axis (its degrees' `sum` > 1), made in an earlier layer and read in
        this one or a later one. Such a layer cannot begin a chunk (`cuttable`).

        Why: a stage sends each crossing as it lies, piece for piece, and a partial sum's piece is every rank's
        addend, a whole tensor (`Degrees.piece_elements`): priced as a whole value sent, with its reduction on
        the receiving stage. Megatron-LM never sends one (its row-parallel layers and vocabulary-parallel
        embedding all-reduce, or reduce-scatter along the sequence, where the sum is made), and torch's traced
        stages cannot (`backend.torch_native.pipeline_lowering` refuses it): a cut is offered only where every
        value crossing it is whole or a piece of one, which is then what is sent and what is priced."""
        out: dict[int, int] = {}
        later = {layer: k for k, layer in enumerate(self.layers)}
        for node, layer, read_in, _elements in self.reader_layers:
            if self.pcg.node(node).degrees.sum > 1:
                for between in self.layers[later[layer] + 1:later[max(read_in)] + 1]:
                    out.setdefault(between, node)
        return out

    @cached_property
    def cuttable(self) -> frozenset[int]:
        """The layers a chunk may begin at: the first, and every other no partial sum crosses into (`blocked`)."""
        return frozenset(layer for k, layer in enumerate(self.layers) if k == 0 or layer not in self.blocked)

    def blocked_reason(self, layer: int) -> str:
        """Why `layer` cannot begin a chunk (`blocked`), naming the partial sum."""
        node = self.pcg.node(self.blocked[layer])
        origin = f" [{node.origin}]" if node.origin else ""
        placed = ", ".join(node.placement.dtensor()) or f"summed over {node.degrees.sum} devices"
        return (f"a chunk beginning at layer {layer} would receive node #{node.id} {node.label}{origin}, a partial "
                f"sum ({placed}), from an earlier chunk: stages send whole values or pieces of one, as Megatron-LM "
                "does, never a partial sum")

    def chunk_nodes(self, first: int, end: int) -> tuple[frozenset[int], tuple[int, ...]]:
        """`LayerStructure.chunk_nodes`: shared by every map of the structure."""
        return self.structure.chunk_nodes(first, end)

    def lay_out(self, starts: Sequence[int], degree: int) -> StageLayout:
        layers = self.layers
        if not starts or starts[0] != layers[0] or list(starts) != sorted(set(starts)) or \
                any(s not in layers for s in starts):
            raise PipelineError(f"chunk starts {list(starts)} do not cut the layers {list(layers)} into "
                                "contiguous runs")
        if degree < 1 or len(starts) % degree:
            raise PipelineError(f"{len(starts)} chunks cannot be spread evenly over {degree} stages")
        for start in starts[1:]:
            if start in self.blocked:
                raise PipelineError(f"chunk starts {list(starts)}: {self.blocked_reason(start)}")
        index = {layer: k for k, layer in enumerate(layers)}
        bounds = [index[s] for s in starts] + [len(layers)]
        chunk_of_layer = {layers[i]: c for c in range(len(starts)) for i in range(bounds[c], bounds[c + 1])}
        # a chunk's nodes: its layers' own nodes and the free values each needs (`chunk_nodes`)
        runs = [self.chunk_nodes(bounds[c], bounds[c + 1]) for c in range(len(starts))]
        members = [found for found, _ordered in runs]
        chunks = tuple(Chunk(c, c % degree, layers[bounds[c]:bounds[c + 1]], runs[c][1]) for c in range(len(starts)))
        crossings = []
        for node, layer, read_in, elements in self.reader_layers:
            mine = chunk_of_layer[layer]
            for target in sorted({chunk_of_layer[other] for other in read_in} - {mine}):
                if target < mine:
                    raise PipelineError(f"node {node} of chunk {mine} is read by the earlier chunk {target}")
                crossings.append(Crossing(node, mine, target, elements))
        shared = []
        for weight in self.structure.spanning_weights:   # the others lie in one chunk, one stage
            stages = tuple(sorted({c % degree for c in range(len(starts)) if weight in members[c]}))
            if len(stages) > 1:
                shared.append((weight, stages))
        return StageLayout(degree, len(starts) // degree, chunks, tuple(crossings), tuple(shared))


# ------------------------------------------------------------------ schedules


@dataclass(frozen=True)
class Action:
    """One stage's work item: the forward or backward of one micro-batch through one chunk."""

    phase: str        # FORWARD | BACKWARD
    microbatch: int
    chunk: int


def schedule_order(schedule: str, degree: int, chunks_per_stage: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Each stage's actions in the order it runs them.

    GPipe: every forward, then every backward. 1F1B (PipeDream-Flush):
    stage s runs p - s - 1 warm-up forwards, then alternates one forward
    and one backward, then drains; at most p - s micro-batches are in
    flight. Interleaved 1F1B (Megatron-LM, Narayanan et al. SC'21): v
    chunks per stage, micro-batches taken p at a time through each chunk
    in turn, (p - s - 1) * 2 + (v - 1) * p warm-up forwards; it needs m to
    be a multiple of p.
    """
    p, v, m = degree, chunks_per_stage, microbatches
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    if p < 1 or v < 1 or m < 1:
        raise PipelineError(f"a schedule needs positive stages, chunks and micro-batches, got {p}, {v}, {m}")
    if schedule != INTERLEAVED and v != 1:
        raise PipelineError(f"{schedule} runs one chunk per stage, got {v}")
    if schedule == INTERLEAVED and m % p:
        raise PipelineError(f"interleaved 1F1B needs the micro-batches ({m}) to be a multiple of the stages ({p})")
    orders = []
    for s in range(p):
        if schedule == GPIPE:
            orders.append(tuple(Action(FORWARD, k, s) for k in range(m)) +
                          tuple(Action(BACKWARD, k, s) for k in range(m)))
            continue
        forwards = [_virtual(k, s, p, v, backward=False) for k in range(m * v)]
        backwards = [_virtual(k, s, p, v, backward=True) for k in range(m * v)]
        if schedule == ONE_F_ONE_B:
            warmup = min(p - s - 1, m)
        else:
            warmup = min((p - s - 1) * 2 + (v - 1) * p, m * v)
        order = forwards[:warmup]
        for k in range(m * v - warmup):
            order += [forwards[warmup + k], backwards[k]]
        order += backwards[m * v - warmup:]
        orders.append(tuple(order))
    return tuple(orders)


def in_flight_counts(schedule: str, degree: int, chunks_per_stage: int, microbatches: int) -> tuple[int, ...]:
    """Per stage, the most chunk micro-batches its `schedule_order` has forwarded and not yet taken back
    (1F1B: p - s, GPipe: m): what a stage holds at its peak, known before any cut is priced."""
    orders = schedule_order(schedule, degree, chunks_per_stage, microbatches)
    return activation_peaks(orders, [1] * (degree * chunks_per_stage))


def activation_peaks(orders: Sequence[Sequence[Action]], activation_bytes: Sequence[int]) -> tuple[int, ...]:
    """Per stage, the most activation bytes its actions in `orders` hold at once (`activation_bytes[chunk]`:
    what one micro-batch keeps in that chunk from its forward to its backward). A stage runs its actions in
    its order whatever their timing, so this is known from the order alone: the one figure the schedule's
    simulation and the stage search's memory check (`cost.pipeline.StagePricer`) both read."""
    peaks = []
    for order in orders:
        live = peak = 0
        for action in order:
            live += activation_bytes[action.chunk] if action.phase == FORWARD else -activation_bytes[action.chunk]
            if live > peak:   # max(peak, live)
                peak = live
        peaks.append(peak)
    return tuple(peaks)


def _virtual(k: int, stage: int, p: int, v: int, backward: bool) -> Action:
    """The k-th forward (or backward) of `stage`: micro-batches go p at a time through each of its chunks."""
    local = (k // p) % v
    if backward:
        local = v - 1 - local
    microbatch = (k // (p * v)) * p + k % p
    return Action(BACKWARD if backward else FORWARD, microbatch, local * p + stage)


@dataclass(frozen=True)
class ScheduleRun:
    """A schedule simulated: when each action ran on its stage, and what that keeps alive."""

    time_s: float                                    # the last backward's end
    busy: tuple[tuple[tuple[Action, float, float], ...], ...]   # per stage: (action, start, end)
    in_flight: tuple[int, ...]                        # per stage: most chunk micro-batches forwarded, not yet back
    activation_peak_bytes: tuple[int, ...]           # per stage: the activations those hold at their peak

    @property
    def bubble_fraction(self) -> float:
        """The share of the step the busiest stage waits: 1 - its busy time / the step."""
        if self.time_s <= 0:
            return 0.0
        return 1.0 - max(sum(e - b for _a, b, e in stage) for stage in self.busy) / self.time_s


def simulate_schedule(layout: StageLayout, schedule: str, microbatches: int, forward_s: Sequence[float],
                      backward_s: Sequence[float], transfer_s: Mapping[tuple[int, int], float],
                      activation_bytes: Sequence[int], first_forward_wait_s: Sequence[float] = (),
                      first_forward_ready_s: Sequence[float] = (),
                      orders: Sequence[Sequence[Action]] | None = None,
                      in_flight: Sequence[int] | None = None) -> ScheduleRun:
    """Run each stage's actions in `schedule_order`, each as soon as its stage is free and its inputs have
    arrived: a chunk's forward waits for the forwards of the chunks it reads plus the transfer
    (`transfer_s[(source, target)]`, seconds per micro-batch), its backward for its own forward and the
    backwards of the chunks that read it plus the gradient's transfer back. Per chunk: seconds per
    micro-batch and the activation bytes one micro-batch keeps until its backward; `first_forward_wait_s`
    (per chunk, empty for none): what its first micro-batch's forward waits for its parameters mid-way
    (ZeRO's gathers overlapped with it, `cost.pipeline`), added to that action; `first_forward_ready_s` (per
    chunk, empty for none): the earliest that action may start (those gathers launched at the step's start).
    `orders`: `schedule_order`'s for this schedule, stages, chunks and micro-batches, and `in_flight` its
    `in_flight_counts`, where the caller keeps them.

    The stages are run by `_StageRunner`: each as far as its inputs allow, then the one whose next action the
    last one run let go (`_StageRunner` says why the figures are those of any order of visits)."""
    if orders is None:
        orders = schedule_order(schedule, layout.degree, layout.chunks_per_stage, microbatches)
    runner = _StageRunner(layout, orders, microbatches, forward_s, backward_s, transfer_s, first_forward_wait_s,
                          first_forward_ready_s)
    if runner.run() < sum(len(o) for o in orders):
        raise PipelineError(f"the {schedule} schedule deadlocks on this layout")
    if in_flight is None:
        in_flight = activation_peaks(orders, [1] * len(layout.chunks))
    return ScheduleRun(max(runner.free_at), tuple(tuple(b) for b in runner.busy), tuple(in_flight),
                       activation_peaks(orders, activation_bytes))


class _StageRunner:
    """`simulate_schedule`'s actions run, stage by stage.

    An action starts at the later of its stage coming free (its previous action's end) and its inputs' ends
    plus their transfers: a function of the actions it waits for alone, whatever order the stages are visited
    in. So a stage runs as far as its inputs allow (`run`), and when its next action waits for an action
    not yet run, it is set aside until that one runs (`waiting`), rather than every stage being tried again
    pass after pass (llama-70b:64's search tried 227k actions, each building a list of tuples, to run 98k in
    293 schedules). The same actions run, with the same starts and ends: each input's end plus its transfer
    taken in the same order and kept where greater (`x > ready` is what `max(ready, x)` keeps). Running an
    action only lets others run, so every order of visits runs the same actions before none is left that can:
    fewer than all of them is the deadlock the passes found."""

    def __init__(self, layout: StageLayout, orders: Sequence[Sequence[Action]], microbatches: int,
                 forward_s: Sequence[float],
                 backward_s: Sequence[float], transfer_s: Mapping[tuple[int, int], float],
                 first_forward_wait_s: Sequence[float], first_forward_ready_s: Sequence[float]):
        sources: dict[int, set[int]] = {}
        targets: dict[int, set[int]] = {}
        for crossing in layout.crossings:
            sources.setdefault(crossing.target, set()).add(crossing.source)
            targets.setdefault(crossing.source, set()).add(crossing.target)
        self.chunks = chunks = len(layout.chunks)
        # what each chunk's forward (backward) waits for, in the order it is read: (where that action's end is
        # kept, from its micro-batch's first, `ends`; the transfer's seconds); a backward waits for its own forward
        # first, at no transfer
        self.forward_needs = [tuple((2 * src, transfer_s.get((src, c), 0.0)) for src in sources.get(c, ()))
                              for c in range(chunks)]
        self.backward_needs = [((2 * c, 0.0),) + tuple((2 * t + 1, transfer_s.get((c, t), 0.0))
                                                       for t in targets.get(c, ())) for c in range(chunks)]
        self.orders, self.forward_s, self.backward_s = orders, forward_s, backward_s
        self.first_forward_wait_s, self.first_forward_ready_s = first_forward_wait_s, first_forward_ready_s
        self.ends: list[float | None] = [None] * (2 * microbatches * chunks)   # an action's end: 2 (k C + c) (+1)
        self.free_at = [0.0] * len(orders)
        self.position = [0] * len(orders)
        self.busy: list[list[tuple[Action, float, float]]] = [[] for _ in orders]
        self.waiting: dict[int, list[int]] = {}   # an action's place in `ends` -> the stages whose next action needs it
        self.ready: list[int] = list(range(len(orders) - 1, -1, -1))   # stages to visit, the last one first

    def run(self) -> int:
        """Every stage run as far as it can; how many actions ran. A stage runs from its position on until an
        action's input has not run (the stage then waits for that one in `waiting`) or none is left; a stage
        waiting for an action just run is visited again after the stage running it stops."""
        orders, position, free_at, busy_of = self.orders, self.position, self.free_at, self.busy
        ends, waiting, ready_stages, chunks = self.ends, self.waiting, self.ready, self.chunks
        forward_needs, backward_needs, forward_s, backward_s = (self.forward_needs, self.backward_needs,
                                                                self.forward_s, self.backward_s)
        wait_s, ready_s = self.first_forward_wait_s, self.first_forward_ready_s
        ran = 0
        while ready_stages:
            stage = ready_stages.pop()
            order, at, free, busy = orders[stage], position[stage], free_at[stage], busy_of[stage]
            while at < len(order):
                action = order[at]
                k, c = action.microbatch, action.chunk
                base = 2 * k * chunks
                forward = action.phase == FORWARD
                ready = 0.0
                for offset, delay in forward_needs[c] if forward else backward_needs[c]:
                    end = ends[base + offset]
                    if end is None:
                        waiting.setdefault(base + offset, []).append(stage)
                        break
                    end += delay
                    if end > ready:
                        ready = end
                else:
                    first = forward and k == 0
                    if first and ready_s:
                        ready = max(ready, ready_s[c])
                    start = ready if ready > free else free   # max(free, ready)
                    if forward:
                        free = start + (forward_s[c] + wait_s[c] if first and wait_s else forward_s[c])
                    else:
                        free = start + backward_s[c]
                    done = base + 2 * c + (0 if forward else 1)
                    ends[done] = free
                    busy.append((action, start, free))
                    at += 1
                    if done in waiting:
                        ready_stages += waiting.pop(done)
                    continue
                break
            ran += at - position[stage]
            position[stage], free_at[stage] = at, free
        return ran


# ------------------------------------------------------------------ a pipelined plan


@dataclass(frozen=True)
class StageFigures:
    """What the cost model predicts for one stage (each of its ranks)."""

    forward_s: float        # per micro-batch, all its chunks
    backward_s: float       # per micro-batch
    sync_s: float           # once per step: its weights' gradient reductions and gathers, its shared weights' sum
    optimizer_s: float      # once per step
    memory_bytes: int       # peak: weights' state plus the activations in flight at the schedule's peak
    in_flight: int          # most chunk micro-batches forwarded and not yet back

    def to_dict(self) -> dict:
        return {"forward_s": self.forward_s, "backward_s": self.backward_s, "sync_s": self.sync_s,
                "optimizer_s": self.optimizer_s, "memory_bytes": self.memory_bytes, "in_flight": self.in_flight}

    @staticmethod
    def from_dict(data: Mapping) -> "StageFigures":
        return StageFigures(float(data["forward_s"]), float(data["backward_s"]), float(data["sync_s"]),
                            float(data["optimizer_s"]), int(data["memory_bytes"]), int(data["in_flight"]))


@dataclass(frozen=True)
class PipelinePlan:
    """A plan's pipeline: the PCG (on the stage mesh of `stage_devices`) cut into stages (`layout`), run as
    `microbatches` micro-batches in `schedule` order; the plan's devices are degree x stage_devices."""

    schedule: str
    microbatches: int
    stage_devices: int
    layout: StageLayout
    stages: tuple[StageFigures, ...] = ()
    chunk_forward_s: tuple[float, ...] = ()     # per chunk, per micro-batch: what `simulate_schedule` ran
    chunk_backward_s: tuple[float, ...] = ()
    chunk_activation_bytes: tuple[int, ...] = ()
    bubble_fraction: float = 0.0
    p2p_bytes: int = 0        # per step, sent by each rank of the busiest sending stage (and as many received)
    transfers: tuple[tuple[int, int, float], ...] = ()   # (source chunk, target chunk, seconds per micro-batch)
    chunk_first_forward_wait_s: tuple[float, ...] = ()   # per chunk: its first forward's wait for its parameters
    chunk_first_forward_ready_s: tuple[float, ...] = ()  # per chunk: the earliest its first forward starts

    @property
    def transfer_s(self) -> float:
        """The longest point-to-point transfer of one micro-batch between two stages."""
        return max((t for _a, _b, t in self.transfers), default=0.0)

    def simulate(self) -> "ScheduleRun":
        """The schedule as the cost model ran it (again, from the figures kept in the plan)."""
        return simulate_schedule(self.layout, self.schedule, self.microbatches, self.chunk_forward_s,
                                 self.chunk_backward_s, {(a, b): t for a, b, t in self.transfers},
                                 self.chunk_activation_bytes, self.chunk_first_forward_wait_s,
                                 self.chunk_first_forward_ready_s)

    @property
    def degree(self) -> int:
        return self.layout.degree

    def stage_of_rank(self, rank: int) -> tuple[int, int]:
        """(stage, local rank) of a global rank: stages are consecutive blocks of `stage_devices` ranks."""
        return rank // self.stage_devices, rank % self.stage_devices

    def to_dict(self) -> dict:
        return {"degree": self.degree, "schedule": self.schedule, "microbatches": self.microbatches,
                "stage_devices": self.stage_devices, "layout": self.layout.to_dict(),
                "stages": [s.to_dict() for s in self.stages], "chunk_forward_s": list(self.chunk_forward_s),
                "chunk_backward_s": list(self.chunk_backward_s),
                "chunk_activation_bytes": list(self.chunk_activation_bytes), "bubble_fraction": self.bubble_fraction,
                "p2p_bytes": self.p2p_bytes, "transfers": [list(t) for t in self.transfers],
                "chunk_first_forward_wait_s": list(self.chunk_first_forward_wait_s),
                "chunk_first_forward_ready_s": list(self.chunk_first_forward_ready_s)}

    @staticmethod
    def from_dict(data: Mapping) -> "PipelinePlan":
        return PipelinePlan(str(data["schedule"]), int(data["microbatches"]), int(data["stage_devices"]),
                            StageLayout.from_dict(data["layout"]),
                            tuple(StageFigures.from_dict(s) for s in data.get("stages", ())),
                            tuple(float(x) for x in data.get("chunk_forward_s", ())),
                            tuple(float(x) for x in data.get("chunk_backward_s", ())),
                            tuple(int(x) for x in data.get("chunk_activation_bytes", ())),
                            float(data.get("bubble_fraction", 0.0)), int(data.get("p2p_bytes", 0)),
                            tuple((int(a), int(b), float(t)) for a, b, t in data.get("transfers", ())),
                            tuple(float(x) for x in data.get("chunk_first_forward_wait_s", ())),
                            tuple(float(x) for x in data.get("chunk_first_forward_ready_s", ())))


def p2p_elements(layout: StageLayout, microbatches: int) -> dict[tuple[int, int], int]:
    """Elements each rank of one stage sends to its twin rank of another per step, by (from stage, to stage):
    every crossing between two stages forward each micro-batch, and its gradient back (every micro-batch's,
    whether or not it is zero). A crossing between two chunks of one stage moves nothing. The backend
    counts what it sends the same way (parsat/backend/pipeline_run.py) and reports the two side by side."""
    out: dict[tuple[int, int], int] = {}
    stage = {c.index: c.stage for c in layout.chunks}
    for crossing in layout.crossings:
        a, b = stage[crossing.source], stage[crossing.target]
        if a == b:
            continue
        out[(a, b)] = out.get((a, b), 0) + crossing.piece_elements * microbatches
        out[(b, a)] = out.get((b, a), 0) + crossing.piece_elements * microbatches
    return out


def stage_comm_elements(layout: StageLayout, costs: Mapping[int, NodeCost],
                        part: str = "comm_elements") -> tuple[int, ...]:
    """Per stage, the elements its collectives send per step, summed over its ranks: the plan's node costs
    (per step, `NodeCost.per_step`) over the nodes the stage computes (`StageLayout.stage_nodes`: a free value
    two of its chunks read, once; one that several stages read, on each). `part` picks the figure:
    "comm_elements" (every collective) or "grad_sync_elements" (the gradient synchronisation). The cost
    model prices a stage with it and the backend compares each stage's measured collectives with it."""
    return tuple(nodes_elements(layout.stage_nodes(s), costs, part) for s in range(layout.degree))


def nodes_elements(nodes: Iterable[int], costs: Mapping[int, NodeCost], part: str = "comm_elements") -> int:
    """The elements the collectives of `nodes` send per step (`stage_comm_elements`, for one stage's nodes): each
    node's `part` that `costs` holds, in the order of `nodes` (iterated in C: a stage of llama-70b holds ~1,000)."""
    return sum(map(attrgetter(part), map(costs.__getitem__, filter(costs.__contains__, nodes))))


def stored_piece_elements(pcg: PCG) -> dict[int, int]:
    """Weight leaf id -> the elements of the piece each rank stores (the end of its `weight_storage` chain):
    what a weight shared by several stages sums the gradient of."""
    by_id = {n.id: n for n in pcg.nodes}
    return {leaf: by_id[chain[-1]].degrees.piece_elements(by_id[chain[-1]].shape)
            for leaf, chain in weight_storage(pcg).items()}


def shared_weight_elements(pieces: Mapping[int, int], layout: StageLayout) -> dict[int, float]:
    """Per stage, the elements each of its ranks sends per step to sum the gradients of the weights it shares
    with other stages (`StageLayout.shared_weights`): local rank i of every holding stage all-reduces its
    stored piece's gradient (`pieces`: `stored_piece_elements`) with the others' (a ring over k stages sends
    2 (k - 1) / k of the piece, so two stages exchange one piece each), once per step before the optimizer."""
    out: dict[int, float] = {}
    for leaf, stages in layout.shared_weights:
        piece, k = pieces[leaf], len(stages)
        for s in stages:
            out[s] = out.get(s, 0.0) + 2 * (k - 1) * piece / k
    return out
