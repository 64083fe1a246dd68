"""Shortcuts of a mesh search (`search.mesh`) that must give what the full path gives.

The saturation runner's e-node limit judged from a bound, not a count after every step.

`runner._Steps.at_least` gives the limit checks the last count plus what the steps since can have added
(`StepReport.built`: each match adds at most one e-node per constructor its rule's actions apply), and counts
(`Session.size`, egglog's `print-size`) only where that bound reaches the limit. The checks then decide as a
count after every step decides; these tests hold the shortcut to that: the bound is never below the e-nodes a
step added, and a saturation cut by any e-node limit stops where, with what and after what the counting runner
stops (a runner given no bound, `built` None, counts after every step that changed something, as before).

The ILP's columns (`extract._columns`) found in one walk, each e-node asked once, are the columns of the walk
and then the second pass over the reached classes that it replaced.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.dsl.checker import resolve_library
from parsat.egraph import session as session_module
from parsat.egraph.instances import graph_signatures
from parsat.egraph.mesh_encoding import mesh_graph_program
from parsat.egraph.program import GROW, PLACE, compile_mesh_rules
from parsat.egraph.runner import STOP_ENODES, STOP_SATURATED, Limits, run_generations
from parsat.egraph.session import Session
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example
from parsat.search import extract

GPT = {"blocks": 2, "hidden": 64, "heads": 4, "batch": 8, "seq": 16, "vocab": 128}


@pytest.fixture(scope="module")
def compiled():
    library = resolve_library(None)
    graph, mesh = build_example("gpt", GPT, library), Mesh.of((4,))
    program = compile_mesh_rules(library, library.rules, graph.ranks(), mesh, {n.op for n in graph.nodes},
                                 graph_signatures(graph, library.ops))
    text, _ = mesh_graph_program(graph, library.ops, mesh)
    return program, text, mesh


class _Counting(Session):
    """A session that counts its `print-size` calls and, `blind`, reports no bound (the runner then counts after
    every step that changed something, as it did before the bound)."""

    blind = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sizes = 0

    def size(self) -> int:
        self.sizes += 1
        return super().size()

    def run(self, ruleset, budget=None):
        report = super().run(ruleset, budget)
        return replace(report, built=None) if self.blind else report


def _saturated(compiled, limits: Limits, blind: bool):
    program, text, mesh = compiled
    session = type("Blind" if blind else "Bounded", (_Counting,), {"blind": blind})(program, text, None, mesh)
    done = run_generations(session, program.phase_chunks(GROW), program.phase_chunks(PLACE), limits,
                           float("inf"), {r.key: r.name for r in program.rules})
    return session, done


def test_a_steps_bound_is_never_below_the_e_nodes_it_added(compiled, monkeypatch):
    program, text, mesh = compiled
    steps = []
    run = Session.run

    def watched(self, ruleset, budget=None):
        before = Session.size(self)
        report = run(self, ruleset, budget)
        steps.append((before, Session.size(self), report.built))
        return report

    monkeypatch.setattr(session_module.Session, "run", watched)
    session = Session(program, text, None, mesh)
    run_generations(session, program.phase_chunks(GROW), program.phase_chunks(PLACE), Limits(), float("inf"),
                    {r.key: r.name for r in program.rules})
    grew = [(before, after, built) for before, after, built in steps if after > before]
    assert len(grew) >= 5   # the e-graph grew in several steps, each within its bound
    assert all(built is not None and after - before <= built for before, after, built in steps)


def test_the_bounded_runner_stops_where_counting_after_every_step_stops(compiled):
    """Unlimited, then cut by e-node limits inside generation 0, later, and at the last steps: the same stop,
    iterations, e-nodes, note and matches per rule, and the same e-graph, as counting after every step."""
    free, free_run = _saturated(compiled, Limits(), blind=False)
    counted, counted_run = _saturated(compiled, Limits(), blind=True)
    assert free_run == replace(counted_run, seconds=free_run.seconds, step_seconds=free_run.step_seconds)
    assert free_run.stop == STOP_SATURATED and free.snapshot().classes == counted.snapshot().classes
    assert free.sizes <= 2 < counted.sizes   # the shortcut: counted at the start and at the end only
    start = Session(*compiled[:2], None, compiled[2]).size()
    cuts = {start + 1, (start + free_run.enodes) // 2, free_run.enodes - 1, free_run.enodes}
    for limit in sorted(cuts):
        bounded, bounded_run = _saturated(compiled, Limits(enodes=limit), blind=False)
        blind, blind_run = _saturated(compiled, Limits(enodes=limit), blind=True)
        assert bounded_run.stop == blind_run.stop and bounded_run.iterations == blind_run.iterations
        assert (bounded_run.enodes, bounded_run.note, bounded_run.matches) == \
            (blind_run.enodes, blind_run.note, blind_run.matches)
        assert bounded.snapshot().classes == blind.snapshot().classes
        if limit < free_run.enodes:
            assert bounded_run.stop == STOP_ENODES


def test_the_ilp_columns_walk_asks_each_e_node_once_and_gives_the_two_pass_columns(compiled):
    """`extract._columns` in one walk (each reached class's allowed e-nodes kept as it goes, by number) against the walk
    then the second pass over every reached class's e-nodes that it replaced: the same columns in the same order,
    each e-node asked once."""
    program, text, mesh = compiled
    session = Session(program, text, None, mesh)
    run_generations(session, program.phase_chunks(GROW), program.phase_chunks(PLACE), Limits(), float("inf"), {})
    snapshot = session.snapshot()
    roots = sorted(set(snapshot.lets.values()))[:3]
    asked: list = []

    def allowed(nid) -> bool:   # some e-nodes left out, so some classes are not reached
        asked.append(nid)
        return (nid[0] + 2 * nid[1]) % 5 != 0

    nids = extract.numbering(snapshot).nids   # the walk asks and lists e-nodes by number
    cols = [nids[n] for n in extract._columns(extract.numbering(snapshot), roots, lambda n: allowed(nids[n]), None)]
    assert len(asked) == len(set(asked))   # each asked once
    seen, stack = set(roots), list(roots)   # the two passes: the classes reached, then their allowed e-nodes
    while stack:
        cid = stack.pop()
        for index, node in enumerate(snapshot.classes.get(cid, ())):
            if allowed((cid, index)):
                stack.extend(ch for ch in node.children if ch not in seen)
                seen.update(node.children)
    two_pass = [(cid, i) for cid in sorted(seen) for i in range(len(snapshot.classes.get(cid, ())))
                if allowed((cid, i))]
    assert cols == two_pass and len(seen) < len(snapshot.classes)
