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
    the largest block's, once: blocks are recomputed one at a time."""
    out = dict(costs)
    # nodes alike share one cost object (`solve.price_pcg` prices each kind once): each is recomputed once per
    # kept-or-not (`again`) and charged once per transient (`charged`), by its identity, which each table keeps
    # alive beside its result (so that no other object takes the id while it is read). The look-ups are written
    # out in the loops, not through a helper taking a closure: this runs over every block node of every
    # recomputing form priced (~720,000 nodes on llama-70b:64)
    again: dict[tuple[int, bool], tuple[NodeCost, NodeCost]] = {}
    charged: dict[tuple[int, int], tuple[NodeCost, NodeCost]] = {}
    for checkpoint in checkpoints(pcg):
        here = [i for i in checkpoint.runs if i in out]
        if not here:
            continue
        kept_ids = checkpoint.kept
        for ident in here:
            cost = out[ident]
            key = (id(cost), ident in kept_ids)
            found = again.get(key)
            if found is None:
                found = again[key] = (cost, cost.recomputed(kept=key[1]))
            out[ident] = found[1]
        block = sum(out[i].transient_bytes for i in here)
        first = here[0]
        for ident in here:
            cost = out[ident]
            key = (id(cost), block if ident == first else 0)
            found = charged.get(key)
            if found is None:
                found = charged[key] = (cost, cost.with_transient(key[1]))
            out[ident] = found[1]
    return out


__all__ = ["recomputed_enodes", "recomputed_pcg_costs"]
