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
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterable, Mapping, Sequence

from parsat.dsl import ast
from parsat.egraph.snapshot import Application, ENode, Snapshot


def rules_used(library_rules: Sequence[ast.RuleDecl], snapshot: Snapshot, choice: Mapping[int, int]) -> tuple[str, ...]:
    """The rules of one derivation of an extraction's e-nodes (`choice`: class -> e-node index) from the input
    graph's, in library order, and every rule that equated a chosen class with an existing term (a rule whose
    right side is a metavariable builds nothing, so no derivation names it: `encoding.equated_row`).

    An e-node no recorded application explains (none should be left) is answered by all its makers."""
    order = {rule.name: i for i, rule in enumerate(library_rules)}
    picked = {name for c in choice for name in snapshot.equated.get(c, ()) if name in order}
    chosen = {c: snapshot.classes[c][i] for c, i in choice.items()}
    targets = list(chosen.values())
    joined: set[Application] = set()
    while True:
        builders = _builders(snapshot, targets, order)
        level, app_level = _levels(snapshot, builders)
        named, anchors, required = _derivation(snapshot, targets, builders, level, app_level, order, picked)
        picked |= named
        anchors += [node for base in required if not _needs_rule(snapshot, base) for child in base.children
                    for node in snapshot.classes.get(child, ()) if not _needs_rule(snapshot, node)]
        joins = _joins(snapshot, required, anchors) - joined
        if not joins:
            return tuple(sorted(picked, key=order.__getitem__))
        joined |= joins
        picked |= {app.rule for app in joins if app.rule in order}
        targets = list(dict.fromkeys(targets + [read for app in joins for read in app.reads]))


def _needs_rule(snapshot: Snapshot, node: ENode) -> bool:
    return bool(snapshot.makers(node))


def _builders(snapshot: Snapshot, targets: Iterable[ENode], order: Mapping[str, int]) -> dict[ENode, list[Application]]:
    """E-node -> the applications that built it, for the targets and everything those applications read,
    transitively. An application's rule is a maker of all it builds (`made_row`), so indexing a node's
    makers' applications finds all of its builders."""
    by_build: dict[ENode, list[Application]] = {}
    indexed: set[str] = set()
    frontier = [node for node in dict.fromkeys(targets) if _needs_rule(snapshot, node)]
    seen = set(frontier)
    while frontier:
        node = frontier.pop()
        for rule in sorted(snapshot.makers(node)):
            if rule in indexed:
                continue
            indexed.add(rule)
            for app in snapshot.applied.get(rule, ()):
                for built in app.builds:
                    by_build.setdefault(built, []).append(app)
        for app in by_build.get(node, ()):
            for read in app.reads:
                if read not in seen and _needs_rule(snapshot, read):
                    seen.add(read)
                    frontier.append(read)
    return by_build


def _levels(snapshot: Snapshot, by_build: Mapping[ENode, Sequence[Application]],
            ) -> tuple[dict[ENode, int], dict[Application, int]]:
    """The level of every derivable e-node and application (the module's docstring)."""
    apps = list(dict.fromkeys(app for found in by_build.values() for app in found))
    waiting: dict[Application, int] = {}
    readers: dict[ENode, list[Application]] = {}
    tie = itertools.count()
    heap: list[tuple[int, int, ENode]] = []
    app_level: dict[Application, int] = {}
    for app in apps:
        pending = {read for read in app.reads if _needs_rule(snapshot, read)}
        waiting[app] = len(pending)
        for read in pending:
            readers.setdefault(read, []).append(app)
        if not pending:
            app_level[app] = 1
            heap.extend((1, next(tie), built) for built in app.builds)
    heapq.heapify(heap)
    level: dict[ENode, int] = {}
    while heap:
        at, _, node = heapq.heappop(heap)
        if node in level:
            continue
        level[node] = at
        for app in readers.get(node, ()):
            waiting[app] -= 1
            if waiting[app] == 0:   # its last read is the highest: nodes leave the heap in level order
                app_level[app] = at + 1
                for built in app.builds:
                    if built not in level:
                        heapq.heappush(heap, (at + 1, next(tie), built))
    return level, app_level


def _derivation(snapshot: Snapshot, targets: Iterable[ENode], by_build: Mapping[ENode, Sequence[Application]],
                level: Mapping[ENode, int], app_level: Mapping[Application, int], order: Mapping[str, int],
                named: Iterable[str]) -> tuple[set[str], list[ENode], set[ENode]]:
    """The rules of one derivation of `targets`, walking down from the highest level (`named` rules are
    preferred where an e-node has a choice), the inner terms its applications built and every e-node it
    needs, the graph's too (`_joins`)."""
    picked = set(named)
    tie = itertools.count()
    heap = [(-level.get(node, 0), next(tie), node) for node in dict.fromkeys(targets)]
    heapq.heapify(heap)
    done: set[ENode] = set()
    anchors: list[ENode] = []
    while heap:
        _, _, node = heapq.heappop(heap)
        if node in done:
            continue
        done.add(node)
        if not _needs_rule(snapshot, node):
            continue
        if node not in level:
            picked |= snapshot.makers(node) & order.keys()
            continue
        best = min((app for app in by_build[node] if app_level.get(app) == level[node]),
                   key=lambda app: (app.rule in order, app.rule not in picked, order.get(app.rule, -1), app.rule))
        if best.rule in order:
            picked.add(best.rule)
        anchors.extend(best.builds[:-1])
        for read in best.reads:
            if read not in done:
                heapq.heappush(heap, (-level.get(read, 0), next(tie), read))
    return picked, anchors, done


def _joins(snapshot: Snapshot, required: Iterable[ENode], anchors: Iterable[ENode]) -> set[Application]:
    """Applications that put the e-nodes a derivation needs in the class its outer terms read.

    A class is first made by one e-node: an application's inner term (which
    its outer term reads) or the input graph's (which the graph's next
    operator reads): those are the anchors. Another e-node of the class is
    there only through unions, each made by an application between its
    match's root e-node and the top term it built. For every needed e-node in
    an anchor's class, the shortest chain of such unions to the anchor is
    added (its applications then need derivations of their own)."""
    where = snapshot.class_of
    needed: dict[int, list[ENode]] = {}
    for node in required:
        needed.setdefault(where.get(node), []).append(node)
    edges: dict[ENode, list[tuple[ENode, Application]]] = {}
    out: set[Application] = set()
    for anchor in dict.fromkeys(anchors):
        for goal in needed.get(where.get(anchor), ()):
            if goal != anchor:
                edges = edges or _union_edges(snapshot)
                out |= _path(anchor, goal, edges)
    return out


def _union_edges(snapshot: Snapshot) -> dict[ENode, list[tuple[ENode, Application]]]:
    """E-node -> (e-node, application) for each union an application made: its root read with its top term."""
    edges: dict[ENode, list[tuple[ENode, Application]]] = {}
    for rule in snapshot.applied:
        for app in snapshot.applied[rule]:
            if app.builds and app.reads and app.reads[-1] != app.builds[-1]:
                edges.setdefault(app.reads[-1], []).append((app.builds[-1], app))
                edges.setdefault(app.builds[-1], []).append((app.reads[-1], app))
    return edges


def _path(start: ENode, goal: ENode, edges: Mapping[ENode, Sequence[tuple[ENode, Application]]]) -> set[Application]:
    """The applications of a shortest union chain from `start` to `goal` (none when there is none)."""
    back: dict[ENode, tuple[ENode, Application] | None] = {start: None}
    queue = [start]
    for node in queue:
        if node == goal:
            break
        for other, app in edges.get(node, ()):
            if other not in back:
                back[other] = (node, app)
                queue.append(other)
    if goal not in back:
        return set()
    out = set()
    step = back[goal]
    while step is not None:
        out.add(step[1])
        step = back[step[0]]
    return out
