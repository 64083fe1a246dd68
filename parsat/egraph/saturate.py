"""Equality saturation of one graph on a device mesh: compile, load, run within limits, read back.

The rules are lifted onto the mesh and compiled for the graph
(`program.compile_mesh_rules`, docs/MESH.md; kept on disk by content when
the caches ask for it, `program_cache`), loaded with it into an
egglog e-graph (`session`) and run by the runner (`runner`: iterations,
e-nodes and seconds, checked between chunks of rules). `seconds` counts
from the start, compilation included: once it passes, compilation stops
adding rules and saturation stops at the next chunk, so the overshoot is
one chunk's run plus reading the e-graph back. The result says which limit
stopped saturation (or that it saturated), what each rule did, and carries
a snapshot of the e-graph for extraction, which works whatever stopped it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.library import Library
from parsat.ir.graph import Graph
from parsat.ir.mesh import Mesh
from parsat.ir.placement import Placement
from parsat.egraph.encoding import RULESET_NAMES, RULESETS
from parsat.egraph.instances import graph_signatures
from parsat.egraph.mesh_encoding import mesh_graph_program
from parsat.egraph.program import GROW, PLACE, MeshCaches, RuleProgram
from parsat.egraph.program_cache import cached_mesh_rules
from parsat.egraph.runner import Limits, match_budget, run_generations
from parsat.egraph.session import Session
from parsat.egraph.snapshot import Snapshot
from parsat.egraph.sums import sequential_cut


@dataclass(frozen=True)
class SaturationResult:
    snapshot: Snapshot
    stop: str
    iterations: int
    enodes: int
    seconds: float
    compile_seconds: float
    program: RuleProgram = field(repr=False)
    rule_matches: Mapping[str, int] = field(default_factory=dict)   # each rule loaded, library order; 0: never fired
    classes: Mapping[str, int] = field(default_factory=dict)   # graph tensor (or "pin:NAME") -> e-class
    note: str = ""   # where the limit stopped it when not between iterations, e.g. "during compilation: ..."
    ruleset_seconds: Mapping[str, float] = field(default_factory=dict)   # "algebraic"/"parallel" -> seconds run
    held_back: Mapping[str, int] = field(default_factory=dict)   # rule held back by --limit matches -> its matches
    # every rule's pattern matches (`Session.match_rows`), read when asked for (`saturate`'s `matches`): what taking
    # this e-graph for a graph of other sizes checks (`resize`); None where not read, where some rules were not
    # loaded (the deadline), or where a class holds two `At` rows (no e-graph is then taken from this one)
    pattern_rows: Mapping[str, list[tuple]] | None = field(default=None, repr=False, compare=False)

    @property
    def matches(self) -> dict[str, int]:
        """Library rule -> matches, for the rules that matched."""
        return {name: count for name, count in self.rule_matches.items() if count}

    def to_dict(self) -> dict:
        return {"stop": self.stop, "note": self.note, "iterations": self.iterations, "enodes": self.enodes,
                "eclasses": len(self.snapshot.classes), "seconds": self.seconds,
                "compile_seconds": self.compile_seconds,
                "rules_compiled": {RULESET_NAMES[r]: self.program.count(r) for r in RULESETS},
                "rules_skipped": [{"rule": s.name, "reason": s.reason} for s in self.program.skipped],
                "rule_matches": dict(self.rule_matches),
                "rules_held_back": [{"rule": name, "matches": count} for name, count in self.held_back.items()],
                "ruleset_seconds": {k: round(v, 6) for k, v in self.ruleset_seconds.items()}}


def saturate(graph: Graph, library: Library, rules: Sequence[ast.RuleDecl], mesh: Mesh | int,
             limits: Limits = Limits(), pins: Mapping[str, Placement] | None = None,
             rulesets: Sequence[str] = ("alg", "par"), progress: Callable[[str], None] | None = None,
             caches: MeshCaches | None = None, cut_sums: bool = False, matches: bool = False) -> SaturationResult:
    """Saturate `graph` with `rules` on `mesh` (a device count means a one-axis mesh), within `limits`; `pins`
    fix input/output placements on the mesh. `cut_sums` leaves out the associativity rules that cannot pay off
    on the graph (`sums.sequential_cut`: its sums are sequential), said in the result's `rules_skipped`.
    `matches` also reads every rule's pattern matches back (`resize`)."""
    if isinstance(mesh, int):
        mesh = Mesh.of((mesh,) if mesh > 1 else ())
    start = time.perf_counter()
    deadline = start + limits.seconds
    program = cached_mesh_rules(library, rules, graph.ranks(), mesh, {n.op for n in graph.nodes},
                                graph_signatures(graph, library.ops, pins), deadline, caches)
    if cut_sums:
        loadable = {r.name for r in program.rules}
        program = program.without(sequential_cut(graph, [rule for rule in rules if rule.name in loadable]))
    text, names = mesh_graph_program(graph, library.ops, mesh, pins)
    session = Session(program, text, deadline, mesh, caches.loaded if caches is not None else None)
    try:
        compiled = time.perf_counter() - start
        note = ""
        if program.unfinished:
            note = f"during compilation: {len(rules) - program.unfinished} of {len(rules)} rules compiled"
        elif session.loaded < len(program.rules):
            note = f"during compilation: {session.loaded} of {len(program.rules)} egglog rules loaded"
        chunks = {ruleset: program.chunks(ruleset) for ruleset in rulesets}
        loaded = [r for r in program.rules[:session.loaded] if r.ruleset in rulesets]
        done = run_generations(session, program.phase_chunks(GROW, rulesets), program.phase_chunks(PLACE, rulesets),
                               limits, deadline, {r.key: r.name for r in loaded}, progress)
        snapshot = session.snapshot()
        # only for the whole program: an e-graph some rules never ran on is not the program's saturation
        whole = not program.unfinished and session.loaded == len(program.rules)
        rows = session.match_rows() if matches and whole else None
    finally:
        session.close()
    classes = {name: snapshot.lets[var] for name, var in names.items() if var in snapshot.lets}
    seconds = {RULESET_NAMES[ruleset]: sum(done.step_seconds.get(chunk, 0.0) for chunk in chunks[ruleset])
               for ruleset in rulesets}
    return SaturationResult(snapshot, done.stop, done.iterations, snapshot.enodes, done.seconds, compiled, program,
                            {r.name: done.matches.get(r.name, 0) for r in loaded}, classes,
                            _joined(note or done.note, held_note(done.held, limits)), seconds, dict(done.held), rows)


def held_note(held: Mapping[str, int], limits: Limits) -> str:
    """The rules the match budget held back, in the user's words ('' when none was)."""
    if not held:
        return ""
    rules = ", ".join(f"{name} ({count:,} matches in one round)" for name, count in sorted(held.items()))
    return f"held back past {match_budget(limits):,} matches in a round (--limit matches): {rules}"


def _joined(*notes: str) -> str:
    return "; ".join(note for note in notes if note)
