"""The kinds of parallelism people name, read off a plan as uses of its mesh axes.

A plan's parallel operators act on mesh axes; what an axis is *for*
follows from what those operators do to which values:

* data parallelism: graph inputs split along their batch dim (dim 0);
* tensor parallelism: weights split and computed on in pieces (Megatron's
  column/row-parallel layers, attention heads, the vocabulary);
* sequence parallelism: activations cut along the sequence (dim 1 of a
  rank-3 activation) or moved by a reduce-scatter / all-gather pair
  (Megatron-SP's norm and dropout regions);
* ZeRO-3 / FSDP: weights stored in shards and all-gathered for use.

`axis_uses` reads them off a PCG, `describe` says them the way people do
("DP 8 across nodes x TP 8 inside a node, sequence-parallel norms, ZeRO-3
over DP"). The optimizer imposes the same kinds on extraction
(`search.strategies`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from parsat.dsl.parallel_ops import ALL_GATHER, PARTITION, REDUCE_SCATTER
from parsat.ir.pcg import PCG, WEIGHT_ROLES, describe_zero, pcg_roles
from parsat.ir.placement import shard_dim

WEIGHTY = WEIGHT_ROLES   # a weight, or a piece or value of one made by parallel operators

DATA, TENSOR, SEQUENCE, ZERO3 = "data", "tensor", "sequence", "zero3"
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
        return f"{main} {self.size} {self.where}"


def axis_uses(pcg: PCG) -> list[AxisUse]:
    """What each axis of the PCG's mesh is used for (module docstring)."""
    roles = pcg_roles(pcg)
    by_id = {n.id: n for n in pcg.nodes}
    kinds: dict[int, set[str]] = {a: set() for a in range(len(pcg.mesh))}
    for node in pcg.nodes:
        if node.kind != "parallel":
            continue
        axis = node.axis(pcg.mesh)
        source = roles.get(node.inputs[0], "")
        dim = dict(node.attrs).get("dim")
        rank = len(node.shape)
        if node.op == PARTITION and source == "input" and dim == 0:
            kinds[axis].add(DATA)
        elif node.op == ALL_GATHER and source in WEIGHTY:
            kinds[axis].add(ZERO3)
        elif node.op == PARTITION and source in WEIGHTY:
            kinds[axis].add(TENSOR)
        elif node.op in (REDUCE_SCATTER, ALL_GATHER) or (node.op == PARTITION and rank == 3 and dim == 1
                                                          and by_id[node.inputs[0]].kind != "leaf"):
            kinds[axis].add(SEQUENCE)
    # storage shards that are gathered again are ZeRO-3, not tensor parallelism, on that axis
    for axis, found in kinds.items():
        if ZERO3 in found and not _computes_on_weight_pieces(pcg, by_id, roles, axis):
            found.discard(TENSOR)
    return [AxisUse(a.name, a.size, pcg.mesh.describe_axis(i), frozenset(kinds[i])) for i, a in enumerate(pcg.mesh)]


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
    zero = [u for u in uses if ZERO3 in u.kinds]
    if zero:
        parts.append("ZeRO-3 over " + ", ".join(("DP" if DATA in u.kinds else u.name) for u in zero))
    if pcg.zero:
        parts.append(describe_zero(pcg.zero))
    return ", ".join(parts)
