"""The compiled rule program: the declarations and the egglog rules of every instance saturation needs.

`compile_rules` asks `instances` which instances can fire, has `rule_text`
write each (once: typed instances and their text are cached), and places
them in rulesets, `alg` and `par`, each cut into chunks of CHUNK_RULES
rules so a time limit can be checked between chunks (`runner`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.checker import creates_values, is_parallel_rule
from parsat.dsl.library import Library
from parsat.dsl.typecheck import RuleInstance
from parsat.ir.mesh import Mesh
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.egraph.encoding import (ANALYSES, LIVE, MADE_PREFIX, MAX_RANK, RULESETS, SHAPE_RULESET, SkipRule,
                                    applied_declaration, ctor, equated_relation, match_ruleset, shape_term)
from parsat.egraph.guards import degree_choices
from parsat.egraph.instances import Signature, TypedInstance, reachable_instances, reachable_rules, typed_instances
from parsat.egraph.rule_text import CompiledRule, SkippedRule, compile_rule_instance
from parsat.egraph.lifted_text import lifted_bodies
from parsat.egraph.lifting import NotLiftable, assignments, lift
from parsat.egraph.mesh_encoding import mesh_declarations, table_text

CHUNK_RULES = 256        # egglog rules per chunk (see `RuleProgram.chunks`)
GROW, PLACE = "grow", "place"   # a mesh program's two phases: rules that make new values, rules that place them
DEADLINE_NOTE = "compilation stopped by the seconds limit"


@dataclass(frozen=True)
class RuleProgram:
    """The compiled rules: declarations, rules by ruleset, and what was left out and why."""

    declarations: str
    rules: tuple[CompiledRule, ...]
    skipped: tuple[SkippedRule, ...]
    unfinished: int = 0   # library rules not compiled because the deadline passed (skipped says which)

    def text(self) -> str:
        return self.declarations + "\n" + "\n".join(r.text for r in self.rules) + "\n"

    def count(self, ruleset: str) -> int:
        return sum(1 for r in self.rules if r.ruleset == ruleset)

    def phase_chunks(self, phase: str, rulesets: Sequence[str] = RULESETS) -> tuple[str, ...]:
        """The chunks of the rules of one phase (GROW, PLACE) in `rulesets`, algebraic ones first."""
        return tuple(dict.fromkeys(r.chunk for ruleset in rulesets for r in self.rules
                                   if r.ruleset == ruleset and r.phase == phase))

    def without(self, left_out: Mapping[str, str]) -> "RuleProgram":
        """The program less the compiled rules of the library rules `left_out` names, each said in `skipped`
        with its reason (`sums.sequential_cut`); the chunks they leave empty are not run."""
        if not left_out:
            return self
        return replace(self, rules=tuple(r for r in self.rules if r.name not in left_out),
                       skipped=self.skipped + tuple(SkippedRule(name, why) for name, why in left_out.items()))

    def chunks(self, ruleset: str) -> tuple[str, ...]:
        """The egglog rulesets `ruleset`'s rules are split into, in order (at least one, maybe empty).

        egglog cannot be interrupted inside a run, so a saturation with a
        time limit runs a large ruleset chunk by chunk and checks its limits
        in between. A ruleset of at most CHUNK_RULES rules is one chunk, so
        the usual programs keep egglog's semantics (every rule matches the
        same e-graph, then all apply); `ruleset` itself is egglog's combined
        ruleset of its chunks, which keeps them for callers that run it whole.
        """
        return tuple(dict.fromkeys(r.chunk for r in self.rules if r.ruleset == ruleset)) or (f"{ruleset}0",)


def declarations(ops: Mapping[str, ast.OpDecl], devices: int, free_degrees: Sequence[int] | None = None) -> str:
    """The sort of tensors, the analysis tables, and the degrees a rule may choose (`free_degrees`, by default
    the divisors >= 2 of `devices`)."""
    signatures = {ctor(op.name): ["T" if p.is_tensor else ("String" if p.type.kind == "real" else "i64")
                                  for p in op.params] for op in ops.values()}
    signatures.update({ctor(op.name): ["T" if kind == "tensor" else "i64" for kind in op.params]
                       for op in PARALLEL_OPS.values()})
    lines = ["(datatype T", "  (Leaf String)"]
    lines += [f"  ({name} {' '.join(sorts)})" for name, sorts in signatures.items()]
    lines[-1] += ")"
    lines += [f"(relation {MADE_PREFIX}{name} ({' '.join(sorts)} String))" for name, sorts in signatures.items()]
    lines.append(equated_relation())
    for name in ANALYSES:
        key = "T i64" if name in ("Dim", "Shard") else "T"
        lines.append(f"(function {name} ({key}) i64 :merge (min old new))")
    lines.append("(datatype Shape " + " ".join(f"(S{r}{' i64' * r})" for r in range(MAX_RANK + 1)) + ")")
    lines.append("(function Whole (T) Shape :merge new)")
    lines.append("(relation Degree (i64))")
    chosen = free_degrees if free_degrees is not None else degree_choices(devices)
    lines += [f"(Degree {d})" for d in chosen]
    lines.append(f"(ruleset {SHAPE_RULESET})")
    for r in range(MAX_RANK + 1):
        dims = [f"d{i}" for i in range(r)]
        lookups = "".join(f" (= d{i} (Dim t {i}))" for i in range(r))
        lines.append(f"(rule ((= (Pieces t) 1) (= (Rank t) {r}){lookups}) ((set (Whole t) {shape_term(dims)})) "
                     f":ruleset {SHAPE_RULESET})")
    return "\n".join(lines) + "\n"


def _ruleset_declarations(program: RuleProgram) -> str:
    """Each chunk's ruleset, and "alg" / "par" as the combined ruleset of their chunks; the gated rules' `Live`
    table."""
    lines = [f"(relation {LIVE} (String))"]
    for ruleset in RULESETS:
        chunks = program.chunks(ruleset)
        for name in (lambda c: c, match_ruleset):
            lines += [f"(ruleset {name(chunk)})" for chunk in chunks]
            lines.append(f"(unstable-combined-ruleset {name(ruleset)} {' '.join(name(c) for c in chunks)})")
    return "\n".join(lines) + "\n"


def past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() >= deadline


_TYPING_CACHE: dict = {}


_COMPILED_CACHE: dict = {}


def compile_rules(library: Library, rules: Sequence[ast.RuleDecl], ranks: set[int], devices: int,
                  graph_ops: set[str] | None = None, typing_cache: dict | None = None,
                  signatures: set[Signature] | None = None, deadline: float | None = None,
                  free_degrees: Sequence[int] | None = None, compiled_cache: dict | None = None) -> RuleProgram:
    """Every rule at every rank assignment the graph's `ranks` need, in the degree encoding, for `devices`
    devices: what the rule generator's derivations saturate with (the optimizer uses `compile_mesh_rules`).

    Rules whose left side needs an operator that neither the graph (`graph_ops`)
    nor any rule can produce are left out; with `signatures` (the graph's,
    `graph_signatures`), so is every rank assignment whose left side can never
    match (`reachable_instances`). Typed instances and their egglog text are
    kept in module caches (keyed by rule, ranks and device count), so repeated
    searches do not type or compile twice. A caller that passes its own
    `typing_cache` (the rule generator, whose candidate rules are throwaway)
    gets neither module cache, so they do not grow. Once `deadline` (a
    `time.perf_counter()` value) passes, the rules not yet typed and compiled
    are left out (skipped, `DEADLINE_NOTE`; counted in `unfinished`): typing
    thousands of rules takes longer than a time limit. A caller may keep its
    own `compiled_cache` (keyed like the module's). `free_degrees` restricts
    the degrees a rule that introduces parallelism may choose (the rule
    generator's derivations need only the degree its instances use).
    """
    def write(instance: RuleInstance, parallel: bool) -> tuple[list[CompiledRule], str]:
        return compile_rule_instance(instance, devices, parallel)

    return _assemble(library, rules, ranks, graph_ops, typing_cache, signatures, deadline, compiled_cache,
                     ("degrees", devices), write, declarations(library.ops, devices, free_degrees))


def compile_mesh_rules(library: Library, rules: Sequence[ast.RuleDecl], ranks: set[int], mesh: Mesh,
                       graph_ops: set[str] | None = None, signatures: set[Signature] | None = None,
                       deadline: float | None = None, caches: "MeshCaches | None" = None) -> RuleProgram:
    """Every rule instance the graph needs, lifted onto every assignment of its degrees to `mesh`'s axes
    (docs/MESH.md): what the optimizer saturates with. Reachability, caching and the deadline as in
    `compile_rules`; the caches (typing, placement inference, compiled text) can be shared by the meshes of
    one search (`MeshCaches`)."""
    caches = caches or MeshCaches()

    def write(instance: RuleInstance, parallel: bool) -> tuple[list[CompiledRule], str]:
        made: list[CompiledRule] = []
        reason = ""
        try:
            sigmas = assignments(instance, len(mesh))
        except NotLiftable as err:
            return [], str(err)
        for sigma in sigmas:
            try:
                lifted = lift(instance, len(mesh), sigma, caches.placements)
                bodies, tables = lifted_bodies(lifted, mesh)
            except (NotLiftable, SkipRule) as err:
                reason = reason or str(err)
                continue
            note = ",".join(f"{g}={n}" for g, n in instance.groups.items())
            axes = " ".join(f"{s}->{mesh.axes[a].name}" for s, a in sigma.items())
            listed = tuple((name, width, rows) for name, (width, rows) in tables.items())
            phase = GROW if creates_values(instance.rule) else PLACE
            made += [CompiledRule(instance.rule.name, f"{note} {axes}".strip() + (f" #{k}" if len(bodies) > 1 else ""),
                                  "par" if parallel else "alg", body, phase, tables=listed)
                     for k, body in enumerate(bodies)]
        return made, ("" if made else reason or "no assignment of its degrees to the mesh's axes")

    return _assemble(library, rules, ranks, graph_ops, caches.typing, signatures, deadline, caches.compiled,
                     ("mesh", mesh.shape), write, mesh_declarations(library.ops, mesh))


class MeshCaches:
    """What the meshes of one search share: typed rule instances, single-axis placement inference, compiled
    rule text (keyed by rule, rank assignment and mesh shape), programs loaded into egglog (`session.Session`).
    One object per search, not a module global.
    With a `folder`, whole programs are also kept on disk by their content (`program_cache`), and `digests`
    holds the hashes of the rule objects the search's keys are made of."""

    def __init__(self, folder: Path | None = None) -> None:
        self.typing: dict = {}
        self.placements: dict = {}
        self.compiled: dict = {}
        self.folder = folder
        self.digests: dict = {}
        self.loaded: dict = {}   # program text's hash -> its rules loaded in an egglog e-graph (`session.take_loaded`)


def _assemble(library: Library, rules: Sequence[ast.RuleDecl], ranks: set[int], graph_ops: set[str] | None,
              typing_cache: dict | None, signatures: set[Signature] | None, deadline: float | None,
              compiled_cache: dict | None, encoding_key: tuple, write, declared: str) -> RuleProgram:
    """The program: reachable rules typed at `ranks`, each instance written by `write`, placed in chunks."""
    ops = library.ops
    compiled: list[CompiledRule] = []
    skipped: list[SkippedRule] = []
    usable = rules if graph_ops is None else reachable_rules(rules, graph_ops)
    cache = typing_cache if typing_cache is not None else _TYPING_CACHE
    if compiled_cache is None:
        compiled_cache = {} if typing_cache is not None else _COMPILED_CACHE
    for rule in rules:
        if rule not in usable:
            skipped.append(SkippedRule(rule.name, "its left side needs an operator the graph never contains"))
    typed: dict[ast.RuleDecl, list[TypedInstance]] = {}
    for rule in usable:
        if past(deadline):
            break
        typed[rule] = typed_instances(rule, ops, ranks, cache)
    if signatures is not None:
        flat = [item for items in typed.values() for item in items]
        keep = {id(item) for item, ok in zip(flat, reachable_instances(flat, signatures)) if ok}
    unfinished = 0
    for rule in usable:
        if rule not in typed or past(deadline):
            skipped.append(SkippedRule(rule.name, DEADLINE_NOTE))
            unfinished += 1
            continue
        parallel = is_parallel_rule(rule)
        found = 0
        last_reason = "no rank assignment of its metavariables fits the graph's ranks"
        compile_reason = ""   # says more than a signature that does not match: kept when there is one
        for item in typed[rule]:
            if signatures is not None and id(item) not in keep:
                last_reason = "no rank assignment of its left side matches an operator the graph (or a rule) makes"
                continue
            key = (item.instance.rule, tuple(sorted(item.instance.groups.items())), encoding_key)
            if key not in compiled_cache:
                compiled_cache[key] = write(item.instance, parallel)
            made, reason = compiled_cache[key]
            compiled.extend(made)
            found += len(made)
            compile_reason = reason or compile_reason
        if not found:
            skipped.append(SkippedRule(rule.name, compile_reason or last_reason))
    position: dict[tuple[str, str], int] = {}
    named = []
    tables: dict[str, str] = {}
    for i, r in enumerate(compiled):
        group = (r.ruleset, r.phase)
        chunk = f"{r.ruleset}{'_' + r.phase if r.phase else ''}{position.get(group, 0) // CHUNK_RULES}"
        position[group] = position.get(group, 0) + 1
        key = f"{r.name}#{i}"
        named.append(replace(r, key=key, chunk=chunk, text=r.body.text(i, chunk, key, gated=r.phase == GROW)))
        for name, width, rows in r.tables:
            tables.setdefault(name, table_text(name, width, rows))
    program = RuleProgram("", tuple(named), tuple(skipped), unfinished)
    applied = "".join(f"{text}\n" for text in dict.fromkeys(applied_declaration(r.body.applied_sorts()) for r in named))
    return replace(program, declarations=declared + "".join(tables.values()) + applied + _ruleset_declarations(program))
