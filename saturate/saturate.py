"""Equality saturation under limits: iterations, e-nodes, seconds.

egglog has no node limit and cannot be interrupted inside a run, and a
parallel rule set can grow an e-graph fast, so saturation runs one iteration
at a time, each ruleset in chunks of rules (`RuleProgram.chunks`), and checks
the limits between chunks. An iteration runs the algebraic rules once, then
the parallel rules once: neither ruleset can starve the other. `seconds`
counts from the start, compilation included: once it passes, compilation
stops adding rules and saturation stops at the next chunk, so the overshoot
is one chunk's run (one rule's, at worst) plus reading the e-graph back. The
result says which limit stopped saturation (or that it saturated) and
carries a snapshot of the e-graph for extraction, which works whatever
stopped it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.library import Library
from parsat.saturate.egglog_compile import (RuleProgram, Session, Snapshot, compile_rules, graph_program,
                                            graph_signatures)
from parsat.ir.graph import Graph
from parsat.ir.pcg import Layout

STOP_SATURATED = "saturated"
STOP_ITERATIONS = "iterations"
STOP_ENODES = "enodes"
STOP_SECONDS = "seconds"


@dataclass(frozen=True)
class Limits:
    """When to stop saturating. Extraction still returns the best plan found."""

    iterations: int = 30
    enodes: int = 200_000
    seconds: float = 30.0
    ilp_seconds: float = 10.0   # extraction's ILP time limit

    @staticmethod
    def from_mapping(values: Mapping[str, float] | None) -> "Limits":
        if not values:
            return Limits()
        allowed = set(Limits.__dataclass_fields__)
        unknown = set(values) - allowed
        if unknown:
            raise ValueError(f"unknown limit(s) {', '.join(sorted(unknown))} (limits: {', '.join(sorted(allowed))})")
        return Limits(**values)


@dataclass(frozen=True)
class SaturationResult:
    snapshot: Snapshot
    stop: str
    iterations: int
    enodes: int
    seconds: float
    compile_seconds: float
    program: RuleProgram = field(repr=False)
    matches: Mapping[str, int] = field(default_factory=dict)   # library rule -> matches
    classes: Mapping[str, int] = field(default_factory=dict)   # graph tensor (or "pin:NAME") -> e-class
    note: str = ""   # where the limit stopped it when not between iterations, e.g. "during compilation: ..."

    def to_dict(self) -> dict:
        return {"stop": self.stop, "note": self.note, "iterations": self.iterations, "enodes": self.enodes,
                "eclasses": len(self.snapshot.classes), "seconds": self.seconds,
                "compile_seconds": self.compile_seconds,
                "rules_compiled": {"algebraic": self.program.count("alg"), "parallel": self.program.count("par")},
                "rules_skipped": [{"rule": s.name, "reason": s.reason} for s in self.program.skipped]}


def saturate(graph: Graph, library: Library, rules: Sequence[ast.RuleDecl], devices: int, limits: Limits = Limits(),
             pins: Mapping[str, Layout] | None = None, rulesets: Sequence[str] = ("alg", "par"),
             progress: Callable[[str], None] | None = None, typing_cache: dict | None = None) -> SaturationResult:
    """Saturate `graph` with `rules` for `devices` devices, within `limits`; `pins` fix input/output layouts."""
    start = time.perf_counter()
    deadline = start + limits.seconds
    program = compile_rules(library, rules, graph.ranks(), devices, {n.op for n in graph.nodes}, typing_cache,
                            graph_signatures(graph, library.ops, pins), deadline)
    text, names = graph_program(graph, library.ops, pins)
    session = Session(program, text, deadline)
    compiled = time.perf_counter() - start
    note = ""
    if program.unfinished:
        note = f"during compilation: {len(rules) - program.unfinished} of {len(rules)} rules compiled"
    elif session.loaded < len(program.rules):
        note = f"during compilation: {session.loaded} of {len(program.rules)} egglog rules loaded"
    by_key = {r.key: r.name for r in program.rules}
    chunks = [chunk for ruleset in rulesets for chunk in program.chunks(ruleset)]
    matches: Counter = Counter()
    iterations, enodes = 0, session.size()
    begin = time.perf_counter()
    stop = _reached(limits, iterations, enodes, deadline)
    while stop is None:
        changed, cut = False, None
        for index, chunk in enumerate(chunks):
            # between chunks too: one iteration of a large program can run far past `seconds` or `enodes`
            cut = _reached(limits, 0, session.size() if changed else enodes, deadline) if index else None
            if cut:
                note = note or f"during iteration {iterations + 1}: after {index} of {len(chunks)} rule chunks"
                break
            updated, counts = session.run(chunk)
            changed |= updated
            for key, count in counts.items():
                if count:
                    matches[by_key.get(key, key)] += count
        iterations += 1
        enodes = session.size()
        if progress is not None:
            progress(f"iteration {iterations}: {enodes} e-nodes, {time.perf_counter() - begin:.2f} s")
        stop = cut or (_reached(limits, iterations, enodes, deadline) if changed else STOP_SATURATED)
    seconds = time.perf_counter() - begin
    snapshot = session.snapshot()
    classes = {name: snapshot.lets[var] for name, var in names.items() if var in snapshot.lets}
    return SaturationResult(snapshot, stop, iterations, snapshot.enodes, seconds, compiled, program, dict(matches),
                            classes, note)


def _reached(limits: Limits, iterations: int, enodes: int, deadline: float) -> str | None:
    """The first limit reached, or None."""
    if iterations >= limits.iterations:
        return STOP_ITERATIONS
    if enodes >= limits.enodes:
        return STOP_ENODES
    if time.perf_counter() >= deadline:
        return STOP_SECONDS
    return None
