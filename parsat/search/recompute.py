"""Activation recomputation in the search: e-nodes and PCG nodes priced as `ir.recompute`'s policy runs them.

Recomputation is not a rewrite (it moves and changes no value); it is a
way to run a plan, which changes what each node costs: the nodes of a
block run their forward twice, and those only their own block reads hold
no activation from forward to backward (`NodeCost.recomputed`). So the
search prices the same e-graph both ways and extracts from each
(`search.mesh.search_mesh`): the plan that keeps every activation, and,
when that one does not fit, the one that recomputes.

An e-node cannot know which of its class's readers a plan will pick, so
an e-class counts as kept when any e-node of another block (or the root)
reads it. Extraction adds memory up over e-nodes, while only one block is
recomputed at a time: each block's transient activations count for one
over the number of blocks (the average block's, in all). Both are
estimates for ranking; the PCG that comes back is priced again node by
node with its own readers and its largest block (`ir.recompute.checkpoints`,
`recomputed_pcg_costs`), and that is what says whether it fits.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Mapping, Sequence

from parsat.ir.blocks import OUTSIDE
from parsat.ir.costs import NodeCost
from parsat.ir.pcg import PCG
from parsat.ir.recompute import NONE, check_policy, checkpoints
from parsat.search.repeat import snapshot_blocks
from parsat.egraph.snapshot import Snapshot

NodeId = tuple[int, int]


def recomputed_enodes(costs: Mapping[NodeId, NodeCost], snapshot: Snapshot, roots: Sequence[int],
                      policy: str) -> dict[NodeId, NodeCost]:
    """Every e-node's cost under `policy` (the module docstring); NONE leaves them as they are."""
    if check_policy(policy) == NONE:
        return dict(costs)
    blocks = snapshot_blocks(snapshot)
    kept, count = _kept_across_blocks(snapshot, roots)
    out = {}
    # e-nodes alike share one cost object (`extract.node_costs`): each is recomputed once per kept-or-not, by its
    # identity, while `costs` holds it
    done: dict[tuple[int, bool], NodeCost] = {}
    for (cid, index), cost in costs.items():
        node = snapshot.classes[cid][index]
        runs = blocks.get(cid, OUTSIDE) != OUTSIDE and node.op != "leaf" and not cost.weight_chain
        if not runs:
            out[(cid, index)] = cost
            continue
        key = (id(cost), cid in kept)
        found = done.get(key)
        if found is None:
            again = cost.recomputed(kept=key[1])
            # one block's activations at a time: each block's e-nodes count for 1 / count of them (the average
            # block)
            found = done[key] = again.with_transient(again.transient_bytes // count)
        out[(cid, index)] = found
    return out


def _kept_across_blocks(snapshot: Snapshot, roots: Sequence[int]) -> tuple[frozenset[int], int]:
    """The classes recomputation keeps (`roots`, and every class an e-node of another block reads: a block's
    checkpointed inputs) and how many blocks the snapshot holds: the snapshot's and the roots' alone, worked out
    once per snapshot and roots (`Snapshot.derived`), as every policy and ZeRO stage of every mesh's extraction
    recomputes the same e-graph's costs (gpt-6.7b:64: 21 times). Shared: read it, never change it."""
    def make() -> tuple[frozenset[int], int]:
        blocks = snapshot_blocks(snapshot)
        kept = set(roots)
        for cid, nodes in snapshot.classes.items():
            for node in nodes:
                kept.update(ch for ch in node.children if blocks.get(ch, OUTSIDE) != blocks[cid])
        return frozenset(kept), max(1, len({b for b in blocks.values() if b != OUTSIDE}))
    return snapshot.derive(("kept_across_blocks", tuple(roots)), make)


def recomputed_pcg_costs(pcg: PCG, costs: Mapping[int, NodeCost]) -> dict[int, NodeCost]:
    """A PCG's node costs under its own recomputation policy (`ir.recompute.checkpoints`). Each block's
    transient activations are charged to its first node, so that the plan's memory (`ir.costs.totals`) counts
    the largest block's, once: blocks are recomputed one at a time.

    Nodes alike share one cost object (`solve.price_pcg` prices each kind once): each is recomputed once per
    kept-or-not and charged once per transient, by its identity (`_Recomputing`), so that alike nodes share
    their recomputed cost too. This runs over every block node of every recomputing form priced (~360,000 nodes
    on llama-70b:64), so a block's nodes are looked up with `map` over their costs' ids, the few kept ones
    (`Checkpoint.kept_at`) put right after, rather than node by node."""
    out = dict(costs)
    recomputing = _Recomputing()
    for checkpoint in checkpoints(pcg):
        here, kept_at = checkpoint.runs, checkpoint.kept_at
        if not all(map(out.__contains__, here)):   # not every node priced: the block's priced ones alone
            here = [i for i in here if i in out]
            kept_at = [k for k, i in enumerate(here) if i in checkpoint.kept]
        if not here:
            continue
        entries = recomputing.entries(list(map(out.__getitem__, here)), kept_at)
        # the block's transient bytes, each node's as recomputed, charged to its first node; the rest hold none
        block = sum(map(_TRANSIENT, entries))
        out.update(zip(here, map(_UNCHARGED, entries)))
        out[here[0]] = recomputing.charged(entries[0], block)
    return out


_TRANSIENT, _UNCHARGED = itemgetter(2), itemgetter(3)   # `_Recomputing`'s entries: (cost, recomputed, its transient
                                                         # bytes, recomputed charged none)


class _Recomputing:
    """One `recomputed_pcg_costs` call's derived costs, by the identity of the cost they derive from, each table
    keeping that cost alive beside its result (so that no other object takes the id while the call reads it).

    An entry is what the node-by-node walk derives for a cost and a kept flag: `cost.recomputed(kept)`, its
    transient bytes, and that recomputed cost with no transient bytes (`with_transient(0)`: what every node but a
    block's first gets). One entry per (cost, kept), so alike nodes share the same objects, as they did with the
    look-ups written out per node; `charged` gives a block's first node its block's bytes, one object per
    (recomputed cost, bytes), the one with 0 bytes being the entry's own."""

    def __init__(self) -> None:
        self._again: tuple[dict, dict] = ({}, {})   # not kept, kept: id(cost) -> entry
        self._charged: dict[tuple[int, int], tuple[NodeCost, NodeCost]] = {}

    def entries(self, costs: list[NodeCost], kept_at: Sequence[int]) -> list[tuple]:
        """Each node's entry, the nodes' costs given in the block's order and the places of the kept ones."""
        found = list(map(self._again[False].get, map(id, costs)))
        for k in kept_at:
            found[k] = self._entry(costs[k], True)
        if None in found:
            found = [entry if entry is not None else self._entry(cost, False) for entry, cost in zip(found, costs)]
        return found

    def _entry(self, cost: NodeCost, kept: bool) -> tuple:
        table = self._again[kept]
        entry = table.get(id(cost))
        if entry is None:
            again = cost.recomputed(kept=kept)
            entry = table[id(cost)] = (cost, again, again.transient_bytes, self._charge(again, 0))
        return entry

    def charged(self, entry: tuple, transient: int) -> NodeCost:
        """`entry`'s recomputed cost charged `transient` bytes (`NodeCost.with_transient`), once per bytes."""
        return entry[3] if transient == 0 else self._charge(entry[1], transient)

    def _charge(self, again: NodeCost, transient: int) -> NodeCost:
        key = (id(again), transient)
        found = self._charged.get(key)
        if found is None:
            found = self._charged[key] = (again, again.with_transient(transient))
        return found[1]


__all__ = ["recomputed_enodes", "recomputed_pcg_costs"]
