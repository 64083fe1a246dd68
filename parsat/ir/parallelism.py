"""The kinds of parallelism people name, read off a plan as uses of its mesh axes.

A plan's parallel operators act on mesh axes; what an axis is *for*
follows from what those operators do to which values:

* data parallelism: graph inputs split along their batch dim (dim 0);
* tensor parallelism: weights split and computed on in pieces (Megatron's
  column/row-parallel layers, attention heads, the vocabulary);
* sequence parallelism: activations cut along the sequence (dim 1 of a
  rank-3 activation) or moved by a reduce-scatter / all-gather pair
  (Megatron-SP's norm and dropout regions);
* ZeRO-3 / FSDP: weights stored in shards and all-gathered for use;
* expert parallelism: a mixture of experts' weights ([experts, k, n], read
  by a `bmm` over the experts dim) split on their experts dim, each device
  computing its own experts (the rows moved to them by an all-to-all, or
  every row on every device); not tensor parallelism, which splits one
  expert's matrices;
* context parallelism: fused attention (causal or not) whose output is
  all-to-all'd back to a split of the sequence (DeepSpeed-Ulysses: q, k and v
  moved from a sequence split to a split of the heads, the rules
  `attention_causal_context_parallel` and `attention_context_parallel`), or
  bidirectional attention's queries split on the sequence with k and v
  gathered for it alone, which a GPU framework runs as ring attention
  (`attention_query_parallel`, `ir.ring_attention`).

`axis_uses` reads them off a PCG, `describe` says them the way people do
("DP 8 across nodes x TP 8 inside a node, sequence-parallel norms, ZeRO-3
over DP"). The optimizer imposes the same kinds on extraction
(`search.strategies`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from parsat.dsl.parallel_ops import ALL_GATHER, ALL_TO_ALL, PARTITION, REDUCE_SCATTER
from parsat.ir.pcg import PCG, WEIGHT_ROLES, describe_zero, pcg_roles
from parsat.ir.placement import shard_dim
from parsat.ir.ring_attention import ring_attentions

WEIGHTY = WEIGHT_ROLES   # a weight, or a piece or value of one made by parallel operators

DATA, TENSOR, SEQUENCE, ZERO3, EXPERT, CONTEXT = "data", "tensor", "sequence", "zero3", "expert", "context"


def along_sequence(shape: tuple[int, ...], dim: int | None) -> bool:
    """Whether `dim` of a value of `shape` is its sequence: dim 1 of a rank-3 activation [batch, seq, hidden],
    as the built-in examples and the importer lay activations out. One place for what "cut along the sequence"
    means: the reading of a plan (`axis_uses`), the grid's restrictions and the `--degrees sp` pin."""
    return dim == 1 and len(shape) == 3


def sequence_split(shape: tuple[int, ...], code: int) -> bool:
    """Whether a value of `shape` placed with `code` on an axis is cut along its sequence there."""
    return along_sequence(shape, shard_dim(code))


def query_blocks(query_shape: tuple[int, ...], code: int) -> bool:
    """Whether fused attention whose query of `query_shape` is placed with `code` on an axis computes blocks of
    its queries there: the query cut along its sequence (dim -2), each block against keys and values it does not
    hold cut alike (context parallelism: ring attention, `attention_query_parallel`,
    `attention_causal_query_parallel`). Megatron-LM's tensor axis never does: it splits attention's heads."""
    return shard_dim(code) == len(query_shape) - 2


FUSED_ATTENTION = frozenset({"attention_causal", "attention", "attention_masked"})
"""The fused attention operators (FlashAttention, `scaled_dot_product_attention`), causal, bidirectional or under a
mask (`attention_masked`, the causal ring's query blocks): one whose output
an all-to-all moves back to the sequence is Ulysses context parallelism; the cost model's views of their operands
and output (`cost.pcg_tasks.attention_views`) read the same set."""
KINDS = {"dp": DATA, "tp": TENSOR, "sp": SEQUENCE, "pp": "pipeline"}   # what `--degrees` names them


@dataclass(frozen=True)
class AxisUse:
    """What one mesh axis carries in a plan."""

    name: str
    size: int
    where: str                  # "across nodes", "inside a node", ...
    kinds: frozenset[str]

    def label(self) -> str:
        main = "DP" if DATA in self.kinds else "TP" if TENSOR in self.kinds else "SP" if SEQUENCE in self.kinds \
            else "unused"
        if EXPERT in self.kinds:
            main = "EP" if main == "unused" else f"{main}+EP"
        return f"{main} {self.size} {self.where}"


def axis_uses(pcg: PCG) -> list[AxisUse]:
    """What each axis of the PCG's mesh is used for (module docstring)."""
    roles = pcg_roles(pcg)
    by_id = {n.id: n for n in pcg.nodes}
    experts = _expert_splits(pcg)
    kinds: dict[int, set[str]] = {a: set() for a in range(len(pcg.mesh))}
    for node in pcg.nodes:
        if node.kind != "parallel":
            continue
        axis = node.axis(pcg.mesh)
        source = roles.get(node.inputs[0], "")
        dim = dict(node.attrs).get("dim")
        if node.op == PARTITION and source == "input" and dim == 0:
            kinds[axis].add(DATA)
        elif node.op == ALL_GATHER and source in WEIGHTY:
            kinds[axis].add(ZERO3)
        elif node.op == PARTITION and source in WEIGHTY:
            kinds[axis].add(EXPERT if node.id in experts else TENSOR)
        elif node.op in (REDUCE_SCATTER, ALL_GATHER) or (node.op == PARTITION and along_sequence(node.shape, dim)
                                                          and by_id[node.inputs[0]].kind != "leaf"):
            kinds[axis].add(SEQUENCE)
        elif node.op == ALL_TO_ALL and by_id[node.inputs[0]].kind == "op" \
                and by_id[node.inputs[0]].op in FUSED_ATTENTION:
            kinds[axis].add(CONTEXT)
    # storage shards that are gathered again are ZeRO-3, not tensor parallelism, on that axis
    for axis, found in kinds.items():
        if ZERO3 in found and not _computes_on_weight_pieces(pcg, by_id, roles, axis):
            found.discard(TENSOR)
    return [AxisUse(a.name, a.size, pcg.mesh.describe_axis(i), frozenset(kinds[i])) for i, a in enumerate(pcg.mesh)]


def _expert_splits(pcg: PCG) -> set[int]:
    """The partitions of dim 0 of a weight that a `bmm` reads as its second operand (directly, or through
    transposes that keep dim 0 in place) with dim 0 its batch dim: a mixture's experts split over the axis."""
    by_id = {n.id: n for n in pcg.nodes}
    readers: dict[int, list] = {}
    for node in pcg.nodes:
        for i in node.inputs:
            readers.setdefault(i, []).append(node)

    def feeds_bmm(ref: int) -> bool:
        for user in readers.get(ref, []):
            if user.kind == "op" and user.op == "bmm" and user.inputs[1] == ref and len(user.shape) == 3:
                return True
            if user.kind == "op" and user.op == "transpose" and 0 not in dict(user.attrs).values() \
                    and feeds_bmm(user.id):
                return True
        return False

    return {n.id for n in pcg.nodes if n.kind == "parallel" and n.op == PARTITION and dict(n.attrs).get("dim") == 0
            and by_id[n.inputs[0]].kind == "leaf" and by_id[n.inputs[0]].role == "weight"
            and feeds_bmm(n.id)}


def _computes_on_weight_pieces(pcg: PCG, by_id: Mapping, roles: Mapping[int, str], axis: int) -> bool:
    """Whether a compute operator reads a weight split on `axis` (tensor parallelism), not only its gather."""
    for node in pcg.nodes:
        if node.kind != "op":
            continue
        for ref in node.inputs:
            source = by_id[ref]
            if roles.get(ref) in WEIGHTY and source.kind == "parallel" and shard_dim(source.placement.codes[axis]) \
                    is not None:
                return True
    return False


def describe(pcg: PCG) -> str:
    """The plan's parallelism in words: axes by what they do, then sequence parallelism and ZeRO-3."""
    uses = [u for u in axis_uses(pcg) if u.kinds]
    if not uses:
        return "no parallelism: every device runs the whole step"
    parts = [" x ".join(u.label() for u in uses)]
    if any(SEQUENCE in u.kinds and TENSOR in u.kinds for u in uses):
        parts.append("sequence-parallel norms")
    context = [u for u in uses if CONTEXT in u.kinds]
    if context:
        parts.append("context-parallel attention (Ulysses all-to-all) over "
                     + ", ".join(f"{u.name} {u.size}" for u in context))
    found = ring_attentions(pcg).values()
    kinds = {(False, False): "", (True, False): "causal ", (True, True): "balanced (zigzag) causal "}
    for (causal, balanced), kind in kinds.items():
        rings = sorted({pcg.node(r.gathers[0]).axis(pcg.mesh) for r in found
                        if (r.causal, r.balanced) == (causal, balanced)})
        if rings:
            parts.append(f"{kind}ring attention (k, v blocks passed round) over "
                         + ", ".join(f"{pcg.mesh.axes[a].name} {pcg.mesh.size(a)}" for a in rings))
    zero = [u for u in uses if ZERO3 in u.kinds]
    if zero:
        parts.append("ZeRO-3 over " + ", ".join(("DP" if DATA in u.kinds else u.name) for u in zero))
    if pcg.zero:
        parts.append(describe_zero(pcg.zero))
    return ", ".join(parts)
