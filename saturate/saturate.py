"""Equality saturation under limits: iterations, e-nodes, seconds.

egglog has no node limit and a parallel rule set can grow an e-graph fast,
so saturation runs one iteration at a time and checks the limits between
iterations. An iteration runs the algebraic rules once, then the parallel
rules once: neither ruleset can starve the other. The result says which
limit stopped saturation (or that it saturated) and carries a snapshot of
the e-graph for extraction, which works whatever stopped it.
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
from parsat.saturate.graph import Graph
from parsat.saturate.pcg import Layout

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

    def to_dict(self) -> dict:
        return {"stop": self.stop, "iterations": self.iterations, "enodes": self.enodes,
                "eclasses": len(self.snapshot.classes), "seconds": self.seconds,
                "compile_seconds": self.compile_seconds,
                "rules_compiled": {"algebraic": self.program.count("alg"), "parallel": self.program.count("par")},
                "rules_skipped": [{"rule": s.name, "reason": s.reason} for s in self.program.skipped]}


def saturate(graph: Graph, library: Library, rules: Sequence[ast.RuleDecl], devices: int, limits: Limits = Limits(),
             pins: Mapping[str, Layout] | None = None, rulesets: Sequence[str] = ("alg", "par"),
             progress: Callable[[str], None] | None = None, typing_cache: dict | None = None) -> SaturationResult:
    """Saturate `graph` with `rules` for `devices` devices, within `limits`; `pins` fix input/output layouts."""
    start = time.perf_counter()
    program = compile_rules(library, rules, graph.ranks(), devices, {n.op for n in graph.nodes}, typing_cache,
                            graph_signatures(graph, library.ops, pins))
    text, names = graph_program(graph, library.ops, pins)
    session = Session(program, text)
    compiled = time.perf_counter() - start
    by_key = {r.key: r.name for r in program.rules}
    matches: Counter = Counter()
    stop, iterations, enodes = STOP_SATURATED, 0, session.size()
    begin = time.perf_counter()
    while True:
        if iterations >= limits.iterations:
            stop = STOP_ITERATIONS
            break
        if enodes >= limits.enodes:
            stop = STOP_ENODES
            break
        if time.perf_counter() - begin >= limits.seconds:
            stop = STOP_SECONDS
            break
        changed = False
        for ruleset in rulesets:
            updated, counts = session.run(ruleset)
            changed |= updated
            for key, count in counts.items():
                if count:
                    matches[by_key.get(key, key)] += count
        iterations += 1
        enodes = session.size()
        if progress is not None:
            progress(f"iteration {iterations}: {enodes} e-nodes, {time.perf_counter() - begin:.2f} s")
        if not changed:
            break
    seconds = time.perf_counter() - begin
    snapshot = session.snapshot()
    classes = {name: snapshot.lets[var] for name, var in names.items() if var in snapshot.lets}
    return SaturationResult(snapshot, stop, iterations, snapshot.enodes, seconds, compiled, program, dict(matches),
                            classes)
