"""The Megatron-style grid, imposed on an extraction: kinds of parallelism as restrictions of the e-graph.

`Config` is one point of the grid (a data axis, a tensor axis, sequence
parallelism on or off, ZeRO-3 over the data axis or not; the kinds are
`ir.parallelism`'s), and `config_excluded` turns it into the e-nodes an
extraction must not use, so the grid's plans come out of the same e-graph
and cost model as parsat's own (`baselines.best_grid`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from parsat.dsl.parallel_ops import ALL_GATHER, ALL_TO_ALL, PARALLEL_OPS, PARTITION, REDUCE_SCATTER, REPLICATE
from parsat.ir.data_forms import DATA_ARGS, MASK, ONEHOT
from parsat.ir.graph import Graph
from parsat.ir.mesh import Mesh
from parsat.ir.parallelism import FUSED_ATTENTION, along_sequence, query_blocks
from parsat.ir.pcg import STORED_ROLES, WEIGHT_ROLES
from parsat.ir.placement import FREE, shard_dim
from parsat.egraph.snapshot import Snapshot


@dataclass(frozen=True)
class Config:
    """A Megatron-style configuration on a mesh: which axis is data parallel and which tensor parallel
    (None: no such axis), sequence parallelism, ZeRO-3 over the data axis."""

    data_axis: int | None
    tensor_axis: int | None
    sequence: bool = False
    zero3: bool = False
    others_free: bool = False   # pinned parallel dims: axes the configuration does not name are searched freely
    zero3_only: bool = False    # `--degrees zero=3`: every weight stored split on the data axis, never replicated
    query_blocks: bool = True   # attention may compute blocks of its queries on the tensor axis (`grid`: never)

    def spelled(self, mesh: Mesh, microbatches: int = 1) -> dict:
        dp = mesh.size(self.data_axis) if self.data_axis is not None else 1
        tp = mesh.size(self.tensor_axis) if self.tensor_axis is not None else 1
        return {"dp": dp, "tp": tp, "sp": self.sequence and tp > 1, "zero": 3 if self.zero3 else 0,
                "microbatches": microbatches}


def grid(mesh: Mesh) -> list[Config]:
    """The configurations of a mesh of one or two axes: data parallel on the major axis, tensor parallel on the
    minor one (inside a node), each alone or both, with and without sequence parallelism and ZeRO-3.

    Megatron-LM's tensor axis splits attention along its heads, never its queries along the sequence (context
    parallelism, ring attention: `query_blocks` off): the grid restricted to an e-graph is then the same grid
    whether or not the rules that cut attention's queries (`attention_causal_query_parallel`) were in the
    search, so the best grid point does not move with them (benchmarks/search_results.md, session 65 helper D:
    llama 2 x 16,384 tokens, 4 heads, 8 devices gave 7.474 ms, tp 8 with the causal ring, with the rule and
    8.963 ms without it)."""
    out: list[Config] = []
    axes = len(mesh)
    shapes: list[tuple[int | None, int | None]] = []
    if axes == 1:
        shapes = [(0, None)] + ([(None, 0)] if mesh.nodes_spanned(0) == 1 else [])
    elif axes == 2:
        shapes = [(0, 1)]
    for data, tensor in shapes:
        for sequence in ((False, True) if tensor is not None else (False,)):
            for zero3 in ((False, True) if data is not None else (False,)):
                out.append(Config(data, tensor, sequence, zero3, query_blocks=False))
    return out


def config_excluded(snapshot: Snapshot, roles: Mapping[int, str], config: Config,
                    batch: Mapping[int, int] | None = None,
                    split: frozenset[int] = frozenset(),
                    shared: Mapping[int, frozenset[str]] | None = None) -> Callable[[tuple[int, int]], bool]:
    """The e-nodes a configuration forbids, for `extract.extract(..., exclude=...)`.

    A pinned `dp` and `tp` are promises, not hints. `batch` (input leaf class -> its batch dim,
    `ir.microbatch.batch_dims`) makes the data axis one: those inputs are read only split along their batch
    dim on the data axis, never whole there, so every data-parallel rank computes on its own samples. `split`
    (the leaf classes of the weights a contraction reads, `contraction_weights`) makes the tensor axis one:
    they are never replicated on it, so every projection and embedding is split as Megatron-LM splits them
    (columns, rows, the vocabulary) and attention follows its heads.

    On the data axis: graph inputs split along dim 0, weights replicated (their gradients synchronised) or, with
    ZeRO-3, stored split and all-gathered; activations only gathered or summed (the loss). On the tensor axis:
    weights split, activations replicated, summed, gathered or split by the operators' own rules (heads,
    vocabulary), graph inputs never split but for the batch's along another dim than the batch (one-hot ids along
    their vocabulary), a constant one-hot that a table is looked up with along its vocabulary (GPT-2's positions,
    whose table `wpe` the axis splits) and a constant read only as a mask (BERT's attention mask, along the heads
    with its scores, `_constant_masks`); sequence parallelism adds reduce-scatter / all-gather of activations and
    cuts along the sequence.

    `shared` (`shared_weights`: a weight read by several operators of the graph, a table tied to a head) makes
    such a weight split along one dim on the tensor axis (`_one_storage_dims`): a parameter has one layout.

    The set is decided once, e-node by e-node: extraction asks about every e-node in each of its passes (10^5 a point).
    """
    return grid_excluded(snapshot, roles, (config,), batch, split, shared)[0]


def grid_excluded(snapshot: Snapshot, roles: Mapping[int, str], configs: Sequence[Config],
                  batch: Mapping[int, int] | None = None, split: frozenset[int] = frozenset(),
                  shared: Mapping[int, frozenset[str]] | None = None) -> list[Callable[[tuple[int, int]], bool]]:
    """`config_excluded` of each of `configs`, the e-nodes' verdicts (`_verdicts`) worked out once per group of
    configurations that differ in sequence parallelism and ZeRO-3 alone (`grid`: a two-axis mesh's four points
    asked every e-node of one e-graph four times, ~200,000 asks on llama-70b:64): an e-node's verdict reads
    `Config.sequence` and `Config.zero3` at two places each, where it is the verdict "excluded unless sequence
    parallelism" or "unless ZeRO-3", so each configuration's set is the always-excluded e-nodes with those of the
    two conditions it does not meet: the set `config_excluded` decides node by node, node for node."""
    verdicts: dict[Config, tuple[frozenset[tuple[int, int]], ...]] = {}
    out: list[Callable[[tuple[int, int]], bool]] = []
    for config in configs:
        common = replace(config, sequence=False, zero3=False)
        found = verdicts.get(common)
        if found is None:
            found = verdicts[common] = _verdicts(snapshot, roles, common, batch, split, shared)
        always, unless_zero3, unless_sequence = found
        forbidden = always.union(*((unless_zero3,) if not config.zero3 else ()),
                                 *((unless_sequence,) if not config.sequence else ()))
        out.append(forbidden.__contains__)
    return out


_UNLESS_ZERO3, _UNLESS_SEQUENCE = "unless zero3", "unless sequence"   # `_verdicts`' conditional verdicts


def _verdicts(snapshot: Snapshot, roles: Mapping[int, str], config: Config, batch: Mapping[int, int] | None,
              split: frozenset[int], shared: Mapping[int, frozenset[str]] | None
              ) -> tuple[frozenset[tuple[int, int]], frozenset[tuple[int, int]], frozenset[tuple[int, int]]]:
    """The e-nodes `config` excludes whatever its sequence parallelism and ZeRO-3, those it excludes unless
    ZeRO-3 is on and those it excludes unless sequence parallelism is on (`config_excluded`'s rules; `config`'s
    own `sequence` and `zero3` are not read)."""
    samples = _derived(snapshot, batch or {})
    stored_split = frozenset(_derived(snapshot, dict.fromkeys(split, 0)))
    from_weights = _weight_values(snapshot, roles, samples if batch else None) if config.data_axis is not None \
        else frozenset()
    # which inputs carry no batch is known only where the batch's are (`batch`): without it every one-hot ids
    # input and every mask would look constant (the restricted grid's calls, `baselines`)
    constants = config.tensor_axis is not None and bool(batch)
    looked_up = _constant_lookups(snapshot, roles, samples) if constants else frozenset()
    masks = _constant_masks(snapshot, roles, samples) if constants else frozenset()
    one_dim = _derived(snapshot, _one_storage_dims(snapshot, shared, config.tensor_axis)) \
        if shared and config.tensor_axis is not None else {}

    def excluded(node) -> bool | str:   # False, True, _UNLESS_ZERO3 or _UNLESS_SEQUENCE
        if node.op == "leaf":
            return False
        if _query_blocks_on_tensor_axis(node, snapshot, config):
            return True   # context parallelism on the tensor axis: not Megatron-LM's (`grid`)
        if samples and config.data_axis is not None and any(ch in samples for ch in node.children) and \
                _reads_samples_whole(node, samples, snapshot, config.data_axis):
            return True
        if node.op not in PARALLEL_OPS and config.tensor_axis is not None and any(
                ch in stored_split and snapshot.placement[ch].codes[config.tensor_axis] == FREE
                for ch in node.children):
            return True   # a split weight read whole on the tensor axis: every tensor-parallel rank the same work
        if node.op not in PARALLEL_OPS:
            # on the data axis a weight is whole where it is used: its shards (ZeRO-3) are only storage
            return config.data_axis is not None and any(
                roles.get(ch) in WEIGHT_ROLES and shard_dim(snapshot.placement[ch].codes[config.data_axis])
                is not None for ch in node.children)
        if node.op == ALL_TO_ALL:
            return True   # the grid is Megatron-LM's and FSDP's layouts: no shard moves between dims
        axis = node.attrs[-1]
        dim = node.attrs[0] if PARALLEL_OPS[node.op].has_dim else None
        source = roles.get(node.children[0], "")
        weight = source in WEIGHT_ROLES
        if axis == config.data_axis:
            if node.op == PARTITION:
                if source == "input" and dim == 0:
                    return False
                return _UNLESS_ZERO3 if weight else True
            if node.op == REPLICATE:   # what every data-parallel rank holds alike: weights, inputs, values of weights
                if config.zero3_only and source in STORED_ROLES:
                    return True   # pinned ZeRO-3: no rank holds a whole weight's state
                return not (weight or source == "input" or node.children[0] in from_weights)
            if node.op == ALL_GATHER:
                return _UNLESS_ZERO3 if weight else True
            return node.op == REDUCE_SCATTER
        if axis == config.tensor_axis:
            return _tensor_axis_excluded(node, dim, source, snapshot, (samples, looked_up, masks, stored_split, one_dim))
        return not config.others_free   # an axis the configuration does not name

    always: list[tuple[int, int]] = []
    unless = {_UNLESS_ZERO3: [], _UNLESS_SEQUENCE: []}
    for cid, nodes in snapshot.classes.items():
        for index, node in enumerate(nodes):
            verdict = excluded(node)
            if verdict is _UNLESS_ZERO3 or verdict is _UNLESS_SEQUENCE:
                unless[verdict].append((cid, index))
            elif verdict:
                always.append((cid, index))
    return frozenset(always), frozenset(unless[_UNLESS_ZERO3]), frozenset(unless[_UNLESS_SEQUENCE])


def _query_blocks_on_tensor_axis(node, snapshot: Snapshot, config: Config) -> bool:
    """Whether `node` is fused attention computing blocks of its queries on the configuration's tensor axis where the
    configuration forbids it (`Config.query_blocks`, off in `grid`: Megatron-LM's tensor axis splits heads)."""
    if node.op not in FUSED_ATTENTION or config.tensor_axis is None or config.query_blocks:
        return False
    query = node.children[0]
    return query_blocks(snapshot.shape[query], snapshot.placement[query].codes[config.tensor_axis])


def _tensor_axis_excluded(node, dim: int | None, source: str, snapshot: Snapshot,
                          inputs: tuple[Mapping[int, int], frozenset[int], frozenset[int], frozenset[int],
                                        Mapping[int, int]]) -> bool | str:
    """Whether a pinned tensor axis forbids the parallel operator `node` on it (`config_excluded`'s docstring says
    what the axis allows), or _UNLESS_SEQUENCE where it forbids it unless sequence parallelism is on; `inputs` is
    (the batch's inputs and their batch dims, the constant one-hot lookups, the constant masks, the weights stored
    split, the one dim each shared weight is split along)."""
    samples, looked_up, masks, stored_split, one_dim = inputs
    child = node.children[0]
    if source == "input" and child in samples:   # vocabulary-parallel one-hot ids, targets
        return node.op != REPLICATE and not (node.op == PARTITION and dim != samples[child])
    if source == "input" and child in looked_up:   # vocabulary-parallel constant one-hot ids
        return node.op != REPLICATE and not (node.op == PARTITION and dim == len(snapshot.shape[child]) - 1)
    if source == "input" and child in masks:   # a constant mask, split as the scores it masks are
        return node.op not in (PARTITION, REPLICATE)
    if source == "input":
        return node.op != REPLICATE
    if source in WEIGHT_ROLES:
        if node.op == PARTITION and one_dim.get(child, dim) != dim:
            return True   # a shared weight split along another dim than its one layout's
        return node.op not in (PARTITION, REPLICATE) or (node.op == REPLICATE and child in stored_split)
    if node.op in (REDUCE_SCATTER, ALL_GATHER):
        return _UNLESS_SEQUENCE
    if node.op == PARTITION and along_sequence(snapshot.shape[child], dim):
        return _UNLESS_SEQUENCE
    return False


def _weight_values(snapshot: Snapshot, roles: Mapping[int, str],
                   samples: Mapping[int, int] | None = None) -> frozenset[int]:
    """The classes computed from weights alone (a tied embedding's transpose), and, when the batch inputs are
    known (`samples`), from weights and the inputs that carry no batch (T5's position bias: a weight read
    through a constant one-hot): the same on every data-parallel rank, so replicating one over the data axis is
    replicating the weights it is made of (its gradient summed once a step)."""
    found = {cid for cid, role in roles.items()
             if role in WEIGHT_ROLES or (samples is not None and role == "input" and cid not in samples)}
    # a worklist over the snapshot's readers, not sweeps over every class until none changes: a class is looked
    # at again only when one it reads is found (the same fixpoint)
    work = list(found)
    while work:
        child = work.pop()
        for cid, index in snapshot.readers.get(child, ()):
            if cid not in found and all(ch in found for ch in snapshot.kids[(cid, index)]):
                found.add(cid)
                work.append(cid)
    return frozenset(found)


# The operators that look a table up with one-hot ids (their first argument).
LOOKUPS = frozenset(op for (op, arg), form in DATA_ARGS.items() if form == ONEHOT and arg == 0)


def _constant_lookups(snapshot: Snapshot, roles: Mapping[int, str], samples: Mapping[int, int]) -> frozenset[int]:
    """The graph inputs without a batch dim that an embedding looks a table up with: one-hot ids made from
    shapes alone (GPT-2's positions, `wpe`). A pinned tensor axis splits the table (it is a contraction's
    weight), so these ids split along their vocabulary dim with it, as the batch's one-hot ids do; every rank
    takes its block of a constant, nothing is sent."""
    return frozenset(cid for cid, role in roles.items() if role == "input" and cid not in samples and any(
        snapshot.classes[reader][index].op in LOOKUPS and snapshot.kids[(reader, index)][0] == cid
        for reader, index in snapshot.readers.get(cid, ())))


def shared_weights(graph: Graph, classes: Mapping[str, int]) -> dict[int, frozenset[str]]:
    """The weights (their leaf classes) that more than one node of the graph reads, each with those nodes'
    operators: a table tied to a head (BERT's word table read by its padded lookup and by the decoder's
    projection), which torch stores as one parameter in one layout."""
    readers: dict[str, list[str]] = {}
    for node in graph.nodes:
        for source in node.inputs:
            readers.setdefault(source, []).append(node.op)
    return {classes[w.name]: frozenset(readers[w.name]) for w in graph.weights
            if len(readers.get(w.name, ())) > 1 and w.name in classes}


def _one_storage_dims(snapshot: Snapshot, shared: Mapping[int, frozenset[str]], axis: int) -> dict[int, int]:
    """For each shared weight (`shared_weights`) that a table lookup reads, the one dim a tensor axis splits it
    along: the lowest of the dims along which every lookup reading it has an e-node reading it split (a tied
    table's vocabulary where the lookup reads it so, as Megatron-LM ties table and head; its columns for a padded
    lookup, whose rules split nothing else). The lookup decides: a projection reads its weight split along either
    dim (column- or row-parallel, under other operators' names: `linear_nobias_t` and a reduce), a lookup only
    along those its rules have. Without one dim, a plan read BERT's tied word table split two ways (columns for
    the lookup, rows for the head), which no torch style stores: one parameter, one layout."""
    out: dict[int, int] = {}
    for leaf, ops in shared.items():
        admits: dict[str, set[int]] = {op: set() for op in ops & LOOKUPS}
        for reader, index in snapshot.readers.get(leaf, ()):
            node = snapshot.classes[reader][index]
            if node.op == PARTITION and node.attrs[-1] == axis:
                for user, position in snapshot.readers.get(reader, ()):
                    if snapshot.classes[user][position].op in admits:
                        admits[snapshot.classes[user][position].op].add(node.attrs[0])
        common = set.intersection(*admits.values()) if admits else set()
        if common:
            out[leaf] = min(common)
    return out


# The (operator, argument) pairs that read a 0/1 mask (a masked softmax's second argument).
MASKED_ARGS = frozenset(key for key, form in DATA_ARGS.items() if form == MASK)


def _constant_masks(snapshot: Snapshot, roles: Mapping[int, str], samples: Mapping[int, int]) -> frozenset[int]:
    """The graph inputs not among the batch's (`samples`) that every compute e-node reading them reads as a mask
    (BERT's attention mask of ones, [batch, heads, seq, seq], which the module builds from shapes). A pinned tensor axis
    may split one along any dim: every rank takes its block of a constant, nothing is sent, and the operator
    that reads it decides which split is used, as it does for the scores beside it: the masked softmax's rules
    (proved) read a mask split only where the scores are split alike (along the heads, where attention is
    head-sharded), so a split the scores do not share is no plan. Kept whole, a mask makes every tensor-parallel
    rank gather its heads' scores and compute the whole softmax."""
    def read_as_mask(cid: int) -> bool:
        readers = [(reader, index) for reader, index in snapshot.readers.get(cid, ())
                   if snapshot.classes[reader][index].op not in PARALLEL_OPS]
        return bool(readers) and all(
            (snapshot.classes[reader][index].op, position) in MASKED_ARGS
            for reader, index in readers for position, kid in enumerate(snapshot.kids[(reader, index)]) if kid == cid)
    return frozenset(cid for cid, role in roles.items() if role == "input" and cid not in samples and read_as_mask(cid))


def _derived(snapshot: Snapshot, batch: Mapping[int, int]) -> dict[int, int]:
    """The classes made from the batch inputs' leaves by parallel operators alone, each with its batch dim."""
    found = dict(batch)
    changed = bool(found)
    while changed:
        changed = False
        for cid, nodes in snapshot.classes.items():
            if cid in found:
                continue
            source = next((node.children[0] for node in nodes if node.op in PARALLEL_OPS
                           and node.children[0] in found), None)
            if source is not None:
                found[cid] = found[source]
                changed = True
    return found


def _reads_samples_whole(node, samples: Mapping[int, int], snapshot: Snapshot, data_axis: int) -> bool:
    """Whether an e-node reading a batch input would read it other than split along its batch dim on the data
    axis: a compute operator on a class free there, or a parallel operator on the data axis other than that
    split (every parallel operator on another axis is the other axis's rules' business)."""
    if node.op not in PARALLEL_OPS:
        return any(ch in samples and snapshot.placement[ch].codes[data_axis] == FREE for ch in node.children)
    if node.attrs[-1] != data_axis:
        return False
    source = node.children[0]
    return not (node.op == PARTITION and PARALLEL_OPS[node.op].has_dim and node.attrs[0] == samples[source]
                and snapshot.placement[source].codes[data_axis] == FREE)


# --------------------------------------------------------------- pinned parallel dims

PINNABLE = ("dp", "tp")


class PinError(Exception):
    """Pinned parallel dims (`--degrees`) that cannot hold (the message says why)."""


def pinned_meshes(dims: Mapping[str, int], devices: int, devices_per_node: int,
                  zero: int | str = "auto", sequence: bool | None = None) -> list[tuple[Mesh, Config]]:
    """The meshes and configurations that realise pinned parallel dims (`--degrees tp=2,dp=4`): a pinned tensor
    degree is the minor axis (inside a node when it fits), a pinned data degree the major one; whatever is not
    pinned is searched (sequence parallelism, ZeRO-3, and the unpinned axis's use). A pinned ZeRO stage (`zero`:
    0-3, else "auto") below 3 keeps weights whole on the data axis; stage 3 stores every weight split there.
    A pinned `sequence` (`--degrees sp`) False keeps activations whole along the sequence on the tensor axis;
    True or None (searched) lets extraction cut them (that a True pin holds is `search.step.idle_pinned_axes`'s
    check). Raises PinError."""
    unknown = sorted(set(dims) - set(PINNABLE) - {"pp", "zero"})
    if unknown:
        raise PinError(f"unknown parallelism {', '.join(unknown)} in --degrees (pin {', '.join(PINNABLE)})")
    if "pp" in dims and dims["pp"] != 1:
        raise PinError("pp: one stage's search pins dp and tp only; `optimize` searches the pipeline around it")
    for kind, value in dims.items():
        if not isinstance(value, int) or value < 1:
            raise PinError(f"{kind} must be a positive integer, got {value!r}")
        if devices % value:
            raise PinError(f"{kind}={value} does not divide the {devices} devices")
    dp, tp = dims.get("dp"), dims.get("tp")
    if dp is not None and tp is not None and dp * tp != devices:
        raise PinError(f"dp {dp} x tp {tp} = {dp * tp} devices, but the plan is for {devices}")
    if tp is None and dp is None:
        return []
    if tp is None:
        tp = devices // dp
        tensor_pinned = False
    else:
        tensor_pinned = True
    dp = devices // tp
    data_pinned = "dp" in dims
    split, only = zero in ("auto", 3), zero == 3
    cut = sequence is not False
    if dp == 1:
        mesh = Mesh.of((tp,), devices_per_node, names=("tp",))
        return [(mesh, Config(None, 0, cut, False, others_free=False))]
    if tp == 1:
        mesh = Mesh.of((dp,), devices_per_node, names=("dp",))
        return [(mesh, Config(0, None, False, split, others_free=False, zero3_only=only))]
    mesh = Mesh.of((dp, tp), devices_per_node, names=("dp" if data_pinned else "a0", "tp" if tensor_pinned else "a1"))
    return [(mesh, Config(0 if data_pinned else None, 1 if tensor_pinned else None, cut, split, others_free=True,
                          zero3_only=only))]
