"""Collectives as NCCL runs them: time and bytes sent, from a group's topology and a byte count.

A group is priced by its `GroupTopology`: p devices, `members_per_node` of
them in each node, over `nodes_spanned` nodes (a mesh axis's groups,
docs/MESH.md; `GroupTopology.consecutive` for p consecutive ranks). Links
come from the machine: inside a node (NVLink/NVSwitch, or shared memory)
and between nodes (one NIC per GPU), each a bus bandwidth per device and a
latency per algorithm step; `machine.comm.launch_s` is paid once per call.

Algorithms (n bytes; alpha the step latency and B the bus bandwidth of the
slowest link the group uses):

* all-reduce, ring: 2(p-1) alpha + 2(p-1)/p n / B.
* all-reduce, tree (NCCL's double binary tree): 2 ceil(log2 p) alpha +
  2(p-1)/p n / (f B), f = `comm.tree_bandwidth_factor`: latency grows with
  log p, so small messages and large groups prefer it.
* all-reduce, hierarchical (a group over several nodes, several devices in
  each): reduce-scatter inside the node, all-reduce of the 1/m shards
  across nodes (ring or tree, one NIC per device, all NICs at once), then
  all-gather inside the node. This is also how NCCL's multi-channel rings
  use every NIC of a node.
* The tuner takes the fastest (`CollectiveCost.algorithm` says which).
* all-gather, reduce-scatter: ring, (p-1) alpha + (p-1)/p n / B, or
  hierarchical across nodes (across nodes on 1/m of the data, then inside).
* all-to-all: p-1 alpha + the larger of the in-node part (m-1)/p n at
  intra-node bandwidth and the cross-node part (p-m)/p n at the NIC's.
* send/recv (pipeline stages): alpha + n / B of the one link it crosses.
* broadcast: pipelined ring (p-1) alpha + n / B, or tree ceil(log2 p) alpha + n / (f B).

Where the machine's measured table (`machine.comm.points`, filled by
`parsat calibrate`) has this collective, link and group size, the
measurement is used instead: latency + bus factor x n / bus bandwidth
(`algorithm` = "measured").

Bytes sent per device follow the ring convention the backend counts
(parsat/backend/collectives.py, `CommEvent.sent`) whatever algorithm runs:
all-reduce 2(p-1)/p n, all-gather (p-1)/p n of the gathered tensor,
reduce-scatter (p-1)/p n of the input, all-to-all (p-1)/p n, send/recv n
(by the sender), broadcast (p-1)/p n on average.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parsat.ir.machine import Machine
from parsat.ir.mesh import Mesh
from parsat.ir.machine_profile import bus_factor

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, SEND_RECV, BROADCAST = (
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, SEND_RECV, BROADCAST)


class CollectiveError(ValueError):
    """A collective or group the model cannot price."""


@dataclass(frozen=True)
class GroupTopology:
    """The devices of one collective group: how many, how many share a node, how many nodes."""

    size: int
    members_per_node: int
    nodes_spanned: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.members_per_node < 1 or self.nodes_spanned < 1:
            raise CollectiveError(f"a group needs positive sizes, got {self}")
        if self.members_per_node > self.size or self.members_per_node * self.nodes_spanned < self.size:
            raise CollectiveError(f"{self.size} devices cannot be {self.members_per_node} per node on "
                                  f"{self.nodes_spanned} node(s)")

    @staticmethod
    def of_axis(mesh: Mesh, axis: int) -> "GroupTopology":
        """One group of a mesh axis (every group of an axis has the same shape, docs/MESH.md)."""
        return GroupTopology(mesh.size(axis), mesh.members_per_node(axis), mesh.nodes_spanned(axis))

    @staticmethod
    def consecutive(size: int, devices_per_node: int) -> "GroupTopology":
        """`size` consecutive ranks, starting at a node boundary (ranks fill nodes in order)."""
        inside = min(size, devices_per_node)
        return GroupTopology(size, inside, -(-size // inside))

    @property
    def link(self) -> str:
        """The slowest link the group crosses: "intra" inside one node, else "inter"."""
        return "intra" if self.nodes_spanned == 1 else "inter"


@dataclass(frozen=True)
class CollectiveCost:
    """One collective priced: its time, the algorithm the tuner chose, the bytes each device sends."""

    collective: str
    algorithm: str
    seconds: float
    sent_bytes: float
    nbytes: float
    group: GroupTopology

    def describe(self) -> str:
        g = self.group
        where = "in a node" if g.nodes_spanned == 1 else f"{g.nodes_spanned} nodes x {g.members_per_node}"
        return f"{self.collective} {self.algorithm} ({g.size} devices {where}, {self.nbytes:,.0f} bytes)"


def sent_bytes(collective: str, p: int, nbytes: float) -> float:
    """Bytes one device sends (ring convention, as the backend counts them): see the module docstring."""
    if collective not in COLLECTIVES:
        raise CollectiveError(f"unknown collective '{collective}' ({', '.join(COLLECTIVES)})")
    if p <= 1:
        return 0.0
    if collective == SEND_RECV:
        return float(nbytes)
    if collective == BROADCAST:
        return (p - 1) / p * nbytes
    return bus_factor(collective, p) * nbytes


def _link(machine: Machine, kind: str) -> tuple[float, float]:
    """(bus bandwidth bytes/s, step latency s) of a link kind."""
    if kind == "intra":
        return machine.intra_bandwidth, machine.intra_latency
    return machine.inter_bandwidth, machine.inter_latency


def _slowest(machine: Machine, group: GroupTopology) -> tuple[float, float]:
    """A flat algorithm over the whole group runs at its slowest link."""
    bw, alpha = _link(machine, "intra")
    if group.nodes_spanned > 1:
        ibw, ialpha = _link(machine, "inter")
        bw, alpha = min(bw, ibw), max(alpha, ialpha)
    return bw, alpha


def _log2(p: int) -> int:
    return max(1, math.ceil(math.log2(p))) if p > 1 else 0


# ------------------------------------------------------------------ the algorithms (launch cost not included)


def _ring_all_reduce(machine: Machine, group: GroupTopology, n: float) -> float:
    p = group.size
    bw, alpha = _slowest(machine, group)
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bw


def _tree_all_reduce(machine: Machine, group: GroupTopology, n: float) -> float:
    p = group.size
    bw, alpha = _slowest(machine, group)
    return 2 * _log2(p) * alpha + 2 * (p - 1) / p * n / (bw * machine.comm.tree_bandwidth_factor)


def _flat_all_reduce(machine: Machine, group: GroupTopology, n: float) -> tuple[str, float]:
    return min((("ring", _ring_all_reduce(machine, group, n)), ("tree", _tree_all_reduce(machine, group, n))),
               key=lambda c: c[1])


def _ring_gather(machine: Machine, group: GroupTopology, n: float) -> float:
    """All-gather (n: the gathered tensor) or reduce-scatter (n: the input): the same ring, data reversed."""
    p = group.size
    bw, alpha = _slowest(machine, group)
    return (p - 1) * alpha + (p - 1) / p * n / bw


def _split(group: GroupTopology) -> tuple[GroupTopology, GroupTopology]:
    """(the in-node part, the cross-node part) of a group spanning nodes: m in a node, k across."""
    m, k = group.members_per_node, group.nodes_spanned
    return GroupTopology(m, m, 1), GroupTopology(k, 1, k)


def _hierarchical_all_reduce(machine: Machine, group: GroupTopology, n: float) -> tuple[str, float]:
    inside, across = _split(group)
    kind, cross = _flat_all_reduce(machine, across, n / inside.size)
    return f"hierarchical/{kind}", _ring_gather(machine, inside, n) + cross + _ring_gather(machine, inside, n)


def _hierarchical_gather(machine: Machine, group: GroupTopology, n: float) -> float:
    inside, across = _split(group)
    return _ring_gather(machine, across, n / inside.size) + _ring_gather(machine, inside, n)


def _all_to_all(machine: Machine, group: GroupTopology, n: float) -> float:
    p, m = group.size, group.members_per_node
    bw, alpha = _link(machine, "intra")
    inside = (m - 1) / p * n / bw
    if group.nodes_spanned == 1:
        return (p - 1) * alpha + inside
    ibw, ialpha = _link(machine, "inter")
    return (p - 1) * max(alpha, ialpha) + max(inside, (p - m) / p * n / ibw)


def _broadcast(machine: Machine, group: GroupTopology, n: float) -> tuple[str, float]:
    p = group.size
    bw, alpha = _slowest(machine, group)
    ring = (p - 1) * alpha + n / bw
    tree = _log2(p) * alpha + n / (bw * machine.comm.tree_bandwidth_factor)
    return ("ring", ring) if ring <= tree else ("tree", tree)


def _algorithms(collective: str, machine: Machine, group: GroupTopology, n: float) -> tuple[str, float]:
    """The fastest algorithm for this collective: (its name, its time without the launch cost)."""
    hierarchical = group.nodes_spanned > 1 and group.members_per_node > 1
    if collective == ALL_REDUCE:
        options = [_flat_all_reduce(machine, group, n)]
        if hierarchical:
            options.append(_hierarchical_all_reduce(machine, group, n))
        return min(options, key=lambda c: c[1])
    if collective in (ALL_GATHER, REDUCE_SCATTER):
        options = [("ring", _ring_gather(machine, group, n))]
        if hierarchical:
            options.append(("hierarchical", _hierarchical_gather(machine, group, n)))
        return min(options, key=lambda c: c[1])
    if collective == ALL_TO_ALL:
        return "direct", _all_to_all(machine, group, n)
    if collective == SEND_RECV:
        bw, alpha = _slowest(machine, group)
        return "direct", alpha + n / bw
    if collective == BROADCAST:
        return _broadcast(machine, group, n)
    raise CollectiveError(f"unknown collective '{collective}' ({', '.join(COLLECTIVES)})")


def price(collective: str, group: GroupTopology, nbytes: float, machine: Machine) -> CollectiveCost:
    """The time of one `collective` over `group` on `machine` for a buffer of `nbytes` (see the module docstring).

    `nbytes`: the all-reduced buffer; the gathered (output) tensor of an
    all-gather; the input of a reduce-scatter; one device's whole buffer of
    an all-to-all; the message of a send/recv or broadcast.
    """
    if nbytes < 0:
        raise CollectiveError(f"a collective of {nbytes} bytes")
    if collective not in COLLECTIVES:
        raise CollectiveError(f"unknown collective '{collective}' ({', '.join(COLLECTIVES)})")
    p = group.size
    if p <= 1:
        return CollectiveCost(collective, "none", 0.0, 0.0, nbytes, group)
    sent = sent_bytes(collective, p, nbytes)
    measured = machine.comm.point(collective, group.link, p)
    if measured is not None:
        return CollectiveCost(collective, "measured", measured.seconds(nbytes), sent, nbytes, group)
    algorithm, seconds = _algorithms(collective, machine, group, nbytes)
    return CollectiveCost(collective, algorithm, machine.comm.launch_s + seconds, sent, nbytes, group)


__all__ = ["ALL_GATHER", "ALL_REDUCE", "ALL_TO_ALL", "BROADCAST", "COLLECTIVES", "CollectiveCost", "CollectiveError",
           "GroupTopology", "REDUCE_SCATTER", "SEND_RECV", "price", "sent_bytes"]
