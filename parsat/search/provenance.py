"""The rules a plan needs: a derivation of every e-node it extracts from the input graph's, and its rules.

Every rule application records the match it applied (`egraph.derivation`):
what it read (its left side's e-nodes) and what it built. An e-node the
input graph has (or a leaf, or a pin's layout term) needs no rule; any
other e-node needs an application that built it, whose reads need theirs,
and so on down to the graph. Makers alone are not enough: a rule that only
built an intermediate term that a later rule matched is no maker of the
plan's e-nodes, yet without it the later rule never fires.

Explanations must not be circular (after unions, an application may read an
e-node only built later): levels make them well founded. An e-node of the
graph is at level 0; an application is at 1 + the highest level of what it
read; an e-node is at the lowest level of the applications that built it
(Knuth's generalisation of Dijkstra's algorithm, since 1 + max is monotone).
Each e-node is explained by an application at its own level, so every read
it adds is at a lower level, and the walk ends at the graph. Among those
applications one whose rule is already named is preferred, then library
order: the set is small, not minimal.

An e-node must also be in the class its reader reads, not only exist: see
`Derivations.joins`. docs/ARCHITECTURE.md ("Provenance") gives the argument
and what it does not cover.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Mapping, Sequence

from parsat.dsl import ast
from parsat.egraph.snapshot import Snapshot


def rules_used(library_rules: Sequence[ast.RuleDecl], snapshot: Snapshot, choice: Mapping[int, int]) -> tuple[str, ...]:
    """The rules of one derivation of an extraction's e-nodes (`choice`: class -> e-node index) from the input
    graph's, in library order, and every rule that equated a chosen class with an existing term (a rule whose
    right side is a metavariable builds nothing, so no derivation names it: `encoding.equated_row`).

    Rules that are no library rule (the fused operators' `fold`) are followed, never named. An e-node no
    recorded application explains (none should be left) is answered by all its makers."""
    order = {rule.name: i for i, rule in enumerate(library_rules)}
    found = Derivations(snapshot, order)
    found.picked |= {name for c in choice for name in snapshot.equated.get(c, ()) if name in order}
    new = [found.ids[snapshot.classes[c][i]] for c, i in choice.items()]
    read = {child for c, i in choice.items() for child in snapshot.classes[c][i].children}
    found.anchors += [node for c in choice if c not in read for node in found.members.get(c, ())
                      if not found.makers[node]]   # a root is read as the graph's own term (or its pin's)
    while new:
        found.walk(new)
        new = [read for app in found.joins() for read in found.apps[app][1]]
    return tuple(sorted(found.picked, key=order.__getitem__))


class Derivations:
    """Every application of the snapshot, indexed by e-node (e-nodes and applications numbered), with levels,
    and the derivation walked so far: the rules it picked, the e-nodes it needs, the inner terms it built."""

    def __init__(self, snapshot: Snapshot, order: Mapping[str, int]) -> None:
        self.order = order
        self.nodes = [node for nodes in snapshot.classes.values() for node in nodes]
        self.ids = {node: i for i, node in enumerate(self.nodes)}
        self.cls = [cid for cid, nodes in snapshot.classes.items() for _ in nodes]
        self.makers = [snapshot.makers(node) for node in self.nodes]
        self.apps: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        for rule in snapshot.applied:
            for app in snapshot.applied[rule]:
                if all(n in self.ids for n in app.reads + app.builds):
                    self.apps.append((rule, tuple(self.ids[n] for n in app.reads),
                                      tuple(self.ids[n] for n in app.builds)))
        self.builders: list[list[int]] = [[] for _ in self.nodes]
        for index, (_rule, _reads, builds) in enumerate(self.apps):
            for built in builds:
                self.builders[built].append(index)
        self.level, self.app_level = self._levels()
        self.picked: set[str] = set()
        self.done: set[int] = set()
        self.anchors: list[int] = []
        self.joined: set[int] = set()
        self.tried: set[tuple[int, int]] = set()
        self.members: dict[int, list[int]] = {}
        for node, cid in enumerate(self.cls):
            self.members.setdefault(cid, []).append(node)
        self._edges: list[list[tuple[int, int]]] | None = None

    def _levels(self) -> tuple[dict[int, int], dict[int, int]]:
        """The level of every derivable e-node and application (the module's docstring)."""
        waiting: list[int] = []
        readers: dict[int, list[int]] = {}
        heap: list[tuple[int, int]] = []
        app_level: dict[int, int] = {}
        for index, (_rule, reads, builds) in enumerate(self.apps):
            pending = {read for read in reads if self.makers[read]}
            waiting.append(len(pending))
            for read in pending:
                readers.setdefault(read, []).append(index)
            if not pending:
                app_level[index] = 1
                heap.extend((1, built) for built in builds)
        heapq.heapify(heap)
        level: dict[int, int] = {}
        while heap:
            at, node = heapq.heappop(heap)
            if node in level:
                continue
            level[node] = at
            for index in readers.get(node, ()):
                waiting[index] -= 1
                if waiting[index] == 0:   # its last read is its highest: nodes leave the heap in level order
                    app_level[index] = at + 1
                    for built in self.apps[index][2]:
                        if built not in level:
                            heapq.heappush(heap, (at + 1, built))
        return level, app_level

    def walk(self, targets: Sequence[int]) -> None:
        """Explains `targets` and all they need, from the highest level down: each e-node by an application at
        its own level, one whose rule is picked already if there is one (a rule that is no library rule
        first: it costs nothing)."""
        tie = itertools.count()
        heap = [(-self.level.get(node, 0), next(tie), node) for node in targets if node not in self.done]
        heapq.heapify(heap)
        while heap:
            _, _, node = heapq.heappop(heap)
            if node in self.done:
                continue
            self.done.add(node)
            if not self.makers[node]:
                continue
            if node not in self.level:
                self.picked |= self.makers[node] & self.order.keys()
                continue
            best = min((i for i in self.builders[node] if self.app_level.get(i) == self.level[node]),
                       key=lambda i: (self.apps[i][0] in self.order, self.apps[i][0] not in self.picked,
                                      self.order.get(self.apps[i][0], -1), self.apps[i][0]))
            rule, reads, builds = self.apps[best]
            if rule in self.order:
                self.picked.add(rule)
            self.anchors.extend(builds[:-1])
            for read in reads:
                if read not in self.done:
                    heapq.heappush(heap, (-self.level.get(read, 0), next(tie), read))

    def joins(self) -> list[int]:
        """Applications (not joined before) that put the e-nodes the derivation needs in the class its outer
        terms read; their rules are picked, and their reads still need explaining.

        A class is first made by one e-node: an application's inner term
        (which its outer term reads), the input graph's (which the graph's
        next operator reads, or the plan's root): those are the anchors. A
        term an application builds over a metavariable reads the class where
        its match found the metavariable, which leads back, reader by reader,
        to one of those anchors. Another e-node of the class is there only
        through unions, each made by an application between its match's root
        e-node and the top term it built. For every needed e-node in an
        anchor's class, the shortest chain of such unions to every anchor
        there is added (more than one reader needs, never less)."""
        anchors = self.anchors + [node for base in self.done if not self.makers[base]
                                  for child in self.nodes[base].children
                                  for node in self.members.get(child, ()) if not self.makers[node]]
        needed: dict[int, list[int]] = {}
        for node in self.done:
            needed.setdefault(self.cls[node], []).append(node)
        out: list[int] = []
        for anchor in dict.fromkeys(anchors):
            for goal in needed.get(self.cls[anchor], ()):
                if goal != anchor and (anchor, goal) not in self.tried:
                    self.tried.add((anchor, goal))
                    out.extend(i for i in self._path(anchor, goal) if i not in self.joined)
                    self.joined.update(out)
        self.picked |= {self.apps[i][0] for i in out if self.apps[i][0] in self.order}
        return list(dict.fromkeys(out))

    def _path(self, start: int, goal: int) -> list[int]:
        """The applications of a shortest union chain from `start` to `goal` (none when there is none)."""
        if self._edges is None:
            self._edges = [[] for _ in self.nodes]
            for index, (_rule, reads, builds) in enumerate(self.apps):
                if builds and reads and reads[-1] != builds[-1]:
                    self._edges[reads[-1]].append((builds[-1], index))
                    self._edges[builds[-1]].append((reads[-1], index))
        back: dict[int, tuple[int, int] | None] = {start: None}
        queue = [start]
        for node in queue:
            if node == goal:
                break
            for other, index in self._edges[node]:
                if other not in back:
                    back[other] = (node, index)
                    queue.append(other)
        out: list[int] = []
        step = back.get(goal)
        while step is not None:
            out.append(step[1])
            step = back[step[0]]
        return out
