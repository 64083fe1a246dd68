"""The e-graph read back: e-classes, their e-nodes, shapes and spreads, and who made each e-node.

Extraction, pricing and the plan work on this snapshot, not on egglog:
`session` fills it from egglog's tables once saturation stops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Mapping

from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import Degrees
from parsat.ir.placement import Placement
from parsat.egraph.encoding import GRAPH_MADE


@dataclass(frozen=True)
class ENode:
    """One e-node of the snapshot: constructor (operator name, or "leaf"), children classes, attributes."""

    op: str
    children: tuple[int, ...]
    attrs: tuple  # values of the non-tensor positions, in order (ints, strings for reals, leaf name)


@dataclass(frozen=True)
class Application:
    """One application of a rule, read back (`derivation`): the e-nodes its match read (its left side's,
    children first, the root's last) and the e-nodes its right side built."""

    rule: str
    reads: tuple[ENode, ...]
    builds: tuple[ENode, ...]


def parallel_attrs(node: ENode, mesh: Mesh) -> tuple[tuple[str, int | str], ...]:
    """A parallel operator e-node's attributes as its PCG node carries them: its dim (partition, combine), the
    name of the mesh axis it acts on and that axis's size (the e-node's last attribute is the axis index)."""
    axis = node.attrs[-1]
    return tuple(zip(PARALLEL_OPS[node.op].dim_params, node.attrs[:-1])) + (("axis", mesh.axes[axis].name), ("degree", mesh.size(axis)))


class Kept:
    """The last `bound` results a reader worked out from a snapshot and the objects it read besides (`owners`),
    by key: a result is taken again only where each of its owners is the very object it was made from (checked
    by identity, so an owner rebuilt equal but not the same is worked out anew), the oldest dropped past the
    bound. What `Snapshot.derive` holds where a reader's results also depend on objects outside the snapshot
    (an extraction's costs, a graph, a library), which the snapshot cannot key by content. Shared: read what it
    gives, never change it."""

    def __init__(self, bound: int):
        self.bound = bound
        self._entries: dict = {}   # key -> (owners, result), oldest first

    def get(self, key, owners: tuple):
        """The result kept under `key` from these very `owners`, or None."""
        found = self._entries.get(key)
        if found is not None and len(found[0]) == len(owners) and all(a is b for a, b in zip(found[0], owners)):
            return found[1]
        return None

    def keys(self) -> tuple:
        """The keys kept, oldest first."""
        return tuple(self._entries)

    def put(self, key, owners: tuple, result) -> None:
        """Keep `result` (never None) under `key`, made from `owners` (held, so that their ids stay theirs)."""
        self._entries.pop(key, None)
        self._entries[key] = (owners, result)
        while len(self._entries) > self.bound:
            del self._entries[next(iter(self._entries))]   # the oldest


@dataclass(frozen=True)
class Snapshot:
    """The e-graph read back: e-classes with their e-nodes and their analysis.

    `shape` is every class's global shape, `degrees` its spread; on a device
    mesh (the optimizer's encoding, `mesh_encoding`) `placement` gives each
    class's placement on `mesh` (the degrees follow from it); the rule
    generator's degree encoding has no mesh and no placements.
    """

    classes: Mapping[int, tuple[ENode, ...]]
    shape: Mapping[int, tuple[int, ...]]
    degrees: Mapping[int, Degrees]
    lets: Mapping[str, int]
    made: Mapping[ENode, frozenset[str]] = field(default_factory=dict)  # who made an e-node (`made_row`)
    placement: Mapping[int, Placement] = field(default_factory=dict)
    mesh: Mesh | None = None
    equated: Mapping[int, frozenset[str]] = field(default_factory=dict)  # class -> rules that built nothing there
    applied: Mapping[str, tuple[Application, ...]] = field(default_factory=dict)  # rule -> its applications

    def makers(self, node: ENode) -> frozenset[str]:
        """The rules that made `node`; empty for the input graph's own e-nodes (and leaves and pins)."""
        who = self.made.get(node, frozenset())
        return frozenset() if GRAPH_MADE in who else who

    def rules_at(self, cid: int, node: ENode) -> frozenset[str]:
        """The rules whose rewrites produced `node` as class `cid`'s choice: its makers (each built it as the
        right side of a match in this class), and the rules that equated the class with a term that already
        existed (`encoding.equated_row`; rows are per class, so one may name an equation the choice does not
        need). A rule that built only an earlier term that a later rule matched is not named here (a plan's
        `rules_used` follows those back through `applied`: `search.provenance`)."""
        return self.makers(node) | self.equated.get(cid, frozenset())

    @cached_property
    def derived(self) -> dict:
        """What a reader works out from this snapshot alone and asks for again, by its key (the search's leaf roles
        and value names per graph: every extraction on a mesh asked for them afresh). The snapshot never changes,
        so neither do they; readers keep only what follows from the snapshot and the key (`derive`)."""
        return {}

    def derive(self, key, make: Callable[[], object]):
        """`derived[key]`, made by `make()` the first time it is asked for. Shared: read it, never change it."""
        known = self.derived.get(key)
        if known is None:
            known = self.derived[key] = make()
        return known

    @cached_property
    def class_of(self) -> dict[ENode, int]:
        """E-node -> its class (the e-graph is hash-consed: each e-node is in one class)."""
        return {node: cid for cid, nodes in self.classes.items() for node in nodes}

    @property
    def enodes(self) -> int:
        return sum(len(v) for v in self.classes.values())

    @cached_property
    def kids(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """(e-class, index) -> the distinct classes the e-node reads. Every extraction pass walks the e-graph
        by these (`extract`), a dozen passes per e-graph (the joint plan, the grid's points, Megatron's): they
        are worked out once per snapshot."""
        return {(cid, index): tuple(dict.fromkeys(node.children)) for cid, nodes in self.classes.items()
                for index, node in enumerate(nodes)}

    @cached_property
    def readers(self) -> dict[int, tuple[tuple[int, int], ...]]:
        """E-class -> the e-nodes that read it (each once), for the same passes."""
        out: dict[int, list[tuple[int, int]]] = {}
        for nid, kids in self.kids.items():
            for child in kids:
                out.setdefault(child, []).append(nid)
        return {cid: tuple(nids) for cid, nids in out.items()}


def matched_classes(a: "Snapshot", b: "Snapshot") -> dict[int, int]:
    """`a`'s classes -> `b`'s, matched e-node by e-node from the leaves up (operator, children's matches,
    attributes): how an e-graph reused at other sizes is held against a fresh saturation
    (tests/test_saturate_resize.py, benchmarks/taken_egraphs.py)."""
    index = {(n.op, n.children, n.attrs): cid for cid, nodes in b.classes.items() for n in nodes}
    found: dict[int, int] = {}
    changed = True
    while changed:
        changed = False
        for cid, nodes in a.classes.items():
            for node in nodes:
                if cid not in found and all(k in found for k in node.children):
                    other = index.get((node.op, tuple(found[k] for k in node.children), node.attrs))
                    if other is not None:
                        found[cid], changed = other, True
    return found
