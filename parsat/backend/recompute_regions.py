"""The order a rank runs its part of a PCG in, with each recomputed block as one checkpointed region.

Under activation recomputation (`PCG.recompute`, `ir.recompute`) a block's
nodes run inside one `torch.utils.checkpoint` call: the region takes the
values the block reads from outside (earlier blocks, values outside every
block, the weights' chains, inputs) and returns only those read outside it,
so its other values are dropped after forward and made again before its
backward. A rank runs a region only as a whole, so its forward is a
sequence of *units*: a region, or one node outside every region.

What a rank runs of a checkpoint is the checkpoint's `runs` among the nodes
it computes (a pipeline stage's, a chunk's); what its region keeps is the
checkpoint's `kept` plus whatever another chunk or stage reads (a value
sent point to point must outlive the forward), plus `keep` (values the
caller reads after forward: the batch statistics `parallelize` updates the
running statistics from).

The units follow the PCG's order where they can, but a region's nodes need
not be contiguous in it (a later block's weight chain may sit between two
of them), so they are ordered by their dependencies (Kahn's algorithm, ties
broken by PCG position). A block's nodes form a convex piece of the graph
(a node's block is the latest of its inputs', `ir.blocks`, so no path leaves
a block and comes back), and the order always exists; one that does not is
refused rather than run out of order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Union

from parsat.ir.pcg import PCG
from parsat.ir.recompute import checkpoints


class RegionError(ValueError):
    """A recomputed block that cannot run as one region (a path leaves it and comes back)."""


@dataclass(frozen=True)
class Region:
    """One checkpointed block as a rank runs it: its nodes (PCG order), the outside values they read (first
    read first), and the values it returns (the only ones alive after its forward)."""

    block: int
    runs: tuple[int, ...]
    inputs: tuple[int, ...]
    kept: tuple[int, ...]

    @property
    def dropped(self) -> tuple[int, ...]:
        kept = set(self.kept)
        return tuple(i for i in self.runs if i not in kept)


Unit = Union[int, Region]


def forward_units(pcg: PCG, computed: Iterable[int], keep: Iterable[int] = ()) -> tuple[Unit, ...]:
    """`computed` (the node ids a forward runs) as units in an order that respects every dependency: each
    recomputed block's nodes among them as one `Region`, every other node as its id (the module docstring)."""
    order = [n.id for n in pcg.nodes]
    position = {ident: p for p, ident in enumerate(order)}
    computed = sorted(set(computed), key=position.__getitem__)
    wanted, keep = set(computed), set(keep)
    inputs_of = {n.id: n.inputs for n in pcg.nodes}
    readers: dict[int, set[int]] = {}
    for node in pcg.nodes:
        for i in node.inputs:
            readers.setdefault(i, set()).add(node.id)
    regions: list[Region] = []
    member: dict[int, int] = {}
    for checkpoint in checkpoints(pcg):
        runs = tuple(i for i in checkpoint.runs if i in wanted)
        if not runs:
            continue
        inside = set(runs)
        inputs = tuple(dict.fromkeys(i for n in runs for i in inputs_of[n] if i not in inside))
        kept = tuple(i for i in runs if i in checkpoint.kept or i in keep or readers.get(i, set()) - inside)
        for i in runs:
            member[i] = len(regions)
        regions.append(Region(checkpoint.block, runs, inputs, kept))
    if not regions:
        return tuple(computed)

    def unit_of(ident: int) -> tuple[str, int]:
        return ("region", member[ident]) if ident in member else ("node", ident)

    first: dict[tuple[str, int], int] = {}
    needs: dict[tuple[str, int], set[tuple[str, int]]] = {}
    for ident in computed:
        unit = unit_of(ident)
        first.setdefault(unit, position[ident])
        needs.setdefault(unit, set()).update(unit_of(i) for i in inputs_of[ident] if i in wanted and
                                             unit_of(i) != unit)
    waiting = {unit: len(deps) for unit, deps in needs.items()}
    then: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for unit, deps in needs.items():
        for dep in deps:
            then.setdefault(dep, []).append(unit)
    ready = [(first[u], u) for u, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    units: list[Unit] = []
    while ready:
        _, unit = heapq.heappop(ready)
        units.append(regions[unit[1]] if unit[0] == "region" else unit[1])
        for after in then.get(unit, ()):
            waiting[after] -= 1
            if waiting[after] == 0:
                heapq.heappush(ready, (first[after], after))
    if len(units) != len(waiting):
        stuck = sorted({regions[u[1]].block for u, n in waiting.items() if n and u[0] == "region"})
        raise RegionError(f"recomputed block(s) {stuck} cannot run as one region each: a value leaves the block "
                          "and is read back into it (the plan's blocks are not contiguous pieces of its graph)")
    return tuple(units)


__all__ = ["Region", "RegionError", "Unit", "forward_units"]
