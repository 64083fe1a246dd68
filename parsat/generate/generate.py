"""`generate(...)`: discover rewrite rules from operator semantics, prove them, keep the ones that matter.

Pipeline (issue 7; the design follows TASO's generator and Ruler's
rule inference by equality saturation, OOPSLA'21):

1. Enumerate (`generate.enumerate`): every small term over the chosen
   operators, in one vocabulary per compute operator and rank (its own
   parameters: biases, gains, batch dims; with the parallel operators), in
   a rank-2 vocabulary of the compute operators alone (algebraic rules to
   the full depth) and in the joint rank-2 vocabulary of them all, grouped
   by a fingerprint of their values at random sizes, degrees and inputs.
2. Candidates (`generate.candidates`): a rule per group member and the
   group's smallest member, both directions, one per canonical key
   (metavariables renamed, commutative arguments ordered), type-checked.
3. Select, small and general first, in windows: the window's left sides
   go into one e-graph (`derivation.CandidateGraph`) with the rules kept so
   far; a candidate whose right side the kept rules already reach is
   dropped unproved (it is true: the rules that derive it are proved). The
   rest are proved in batches (`--jobs` processes), each proved rule widened
   (`generate.generalise`: independent sizes, then any rank) and proved
   again in its wider form, and the batch added to the e-graph, which then
   drops what the batch derives.
4. Minimise: the kept rules, least useful first, are dropped when the
   others derive them (`derivation.Deriver`; a rank-polymorphic rule at
   every rank assignment up to groups of one dim).
5. Output: PROVED rules only, most useful first (collectives, then
   parallel operators, then operators removed), each with a comment.

`--seconds` is a limit on the whole run: enumeration gets at most
`ENUMERATION_SHARE` of it, minimisation what is left after selection (at
least `MINIMISE_SHARE` is kept for it); a run cut short keeps what it
proved and says how many candidates it did not reach.
"""

from __future__ import annotations

import re
import textwrap
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.bounds import BoundError, check_all
from parsat.dsl.lifetime import process_pool
from parsat.dsl.library import Library
from parsat.dsl.printer import format_decl, format_expr
from parsat.dsl.typecheck import RuleInstance, TypeCheckError, group_assignments, rule_groups, type_rule
from parsat.generate.candidates import Candidate, Canon, candidate, commutative_ops, ops_of, pairs, rule_identity, alpha_text
from parsat.generate.derivation import CandidateGraph, Deriver, Minimiser, instance_sizes, safe_typed
from parsat.generate.enumerate import (Vocabulary, VocabularyError, algebraic_vocabulary,
                                       enumerate_terms, environments, operator_vocabularies, vocabulary)
from parsat.egraph.runner import Limits

Progress = Callable[[str], None]
ENUMERATION_SHARE = 0.4     # of --seconds, at most
MINIMISE_SHARE = 0.25       # of --seconds, at least, kept for the final minimisation
OPERATOR_MAX_OPS = 2        # operators per side in the per-operator vocabularies


class GenerateError(Exception):
    """Why generation cannot start; the message is for the user."""


@dataclass(frozen=True)
class Settings:
    """What to enumerate, how to widen, and the limits of each phase."""

    ops: tuple[str, ...]
    max_ops: int = 2
    degrees: tuple[int, ...] = (2, 3)
    seconds: float = 600.0
    environments: int = 3
    max_terms: int = 200_000
    verify_timeout: float = 10.0
    jobs: int = 1
    prune_with_library: bool = False
    devices: int = 4                  # device budget of derivations (degrees 2, nested 4), as small plans have
    per_operator: bool = True         # also one vocabulary per compute operator and rank
    max_rank: int = 3                 # of the per-operator vocabularies' inputs
    widen: bool = True                # independent sizes
    lift: bool = True                 # any rank (rank-polymorphic rules)
    minimise: bool = True
    prefix: str = "gen"               # of the rules' names: files of two runs can be loaded together
    batch: int = 12                   # candidates proved between two saturations of the candidate e-graph
    window: int = 200                 # candidates per candidate e-graph
    derive_limits: Limits = Limits(iterations=4, enodes=80_000, seconds=20.0)


@dataclass
class Summary:
    """Counts of every phase; `to_text` is what the command prints."""

    vocabularies: int = 0
    terms_built: int = 0
    terms_defined: int = 0
    groups: int = 0
    candidates: int = 0
    ill_typed: int = 0
    derived: int = 0       # dropped unproved: the rules kept before derive them
    proved: int = 0
    refuted: int = 0
    unknown: int = 0
    widened: int = 0       # kept in a wider form than found (sizes or ranks)
    lifted: int = 0        # of which rank-polymorphic
    duplicates: int = 0    # proved, but equal to a kept rule once widened
    minimised: int = 0     # dropped at the end: the other kept rules derive them
    kept: int = 0
    seconds: float = 0.0
    enumerate_seconds: float = 0.0
    prove_seconds: float = 0.0     # proving and widening
    derive_seconds: float = 0.0    # candidate e-graphs: building, saturating, looking up
    minimise_seconds: float = 0.0
    stopped: str = ""
    not_reached: int = 0   # candidates the seconds limit left undecided

    @property
    def pruned(self) -> int:
        return self.derived + self.duplicates + self.minimised

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        out["pruned"] = self.pruned
        return out

    def to_text(self) -> str:
        text = (f"{self.terms_built} terms enumerated in {self.vocabularies} vocabularies ({self.terms_defined} "
                f"defined, {self.groups} value groups), {self.candidates} candidates ({self.ill_typed} ill-typed), "
                f"{self.derived} derived before proof, {self.proved} proved, {self.refuted} refuted, "
                f"{self.unknown} unknown, {self.widened} widened ({self.lifted} to any rank), "
                f"{self.duplicates + self.minimised} pruned after proof, {self.kept} kept, "
                + (f"{self.not_reached} not reached, " if self.not_reached else "")
                + f"{self.seconds:.1f} s (enumerate {self.enumerate_seconds:.0f}, prove and widen "
                  f"{self.prove_seconds:.0f}, derive {self.derive_seconds:.0f}, minimise {self.minimise_seconds:.0f})")
        return text + (f"; stopped early: {self.stopped}" if self.stopped else "")


@dataclass(frozen=True)
class GenerateResult:
    rules: tuple[ast.RuleDecl, ...]
    summary: Summary = field(hash=False)

    def text(self, ops: Sequence[str], command: str = "") -> str:
        """The output file: a header (operators, the command, the run's summary), then the rules."""
        header = ["Rules generated by `parsat generate` from the operator semantics, each PROVED by",
                  f"the verifier; operators: {', '.join(ops)}."]
        if command:
            header.append(f"command: {command}")
        header += textwrap.wrap("run: " + self.summary.to_text(), 100, subsequent_indent="  ")
        blocks = ["\n".join(f"# {line}" for line in header), 'import "ops.rule"']
        blocks += [format_decl(rule) for rule in self.rules]
        return "\n\n".join(blocks) + "\n"


def _also(stopped: str, why: str) -> str:
    """`why` added to what stopped the run so far."""
    return f"{stopped}; {why}" if stopped else why


# ------------------------------------------------------------------ proving and widening


def prove(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], timeout: float) -> tuple[str, str]:
    """(verdict, reason) for one rule, through the verifier's on-disk cache."""
    from parsat.verifier.cache import VerdictCache, rule_key
    from parsat.verifier.core import VERSION, RuleError, verify_rule

    cache = VerdictCache()
    key = rule_key(rule, ops, VERSION)
    hit = cache.get(key, timeout)
    if hit is not None:
        return hit.verdict, hit.reason
    try:
        verdict = verify_rule(rule, ops, timeout=timeout)
    except RuleError as err:
        return "ERROR", str(err)
    if verdict.verdict in ("PROVED", "REFUTED"):
        cache.put(key, verdict, timeout)  # whole, counterexample included: the cache refuses a REFUTED without one
    return verdict.verdict, verdict.reason


def _decide(args: tuple) -> tuple[int, str, str, ast.RuleDecl]:
    """Worker: prove a candidate and, when proved, widen it. (index, verdict, reason, the rule to keep)."""
    from parsat.generate.generalise import widen

    index, rule, ops, timeout, sizes, ranks, deadline = args
    verdict, reason = prove(rule, ops, timeout)
    if verdict != "PROVED" or not (sizes or ranks):
        return index, verdict, reason, rule
    wide = widen(rule, ops, lambda r: prove(r, ops, timeout)[0] == "PROVED", ranks=ranks, sizes=sizes,
                 deadline=deadline)
    return index, verdict, reason, wide


def decide_all(rules: Sequence[ast.RuleDecl], ops: Mapping[str, ast.OpDecl], settings: Settings,
               deadline: float | None = None) -> list[tuple[str, str, ast.RuleDecl]]:
    """(verdict, reason, kept form) per rule, `settings.jobs` processes at a time; no widening is tried
    after `deadline` (`time.perf_counter()`, the same clock in forked workers)."""
    work = [(i, r, ops, settings.verify_timeout, settings.widen, settings.lift, deadline)
            for i, r in enumerate(rules)]
    if settings.jobs > 1 and len(work) > 1:
        with process_pool(settings.jobs) as pool:
            results = list(pool.map(_decide, work, chunksize=1))
    else:
        results = [_decide(item) for item in work]
    return [(verdict, reason, rule) for _index, verdict, reason, rule in sorted(results, key=lambda r: r[0])]


def verify_all(rules: Sequence[ast.RuleDecl], ops: Mapping[str, ast.OpDecl], timeout: float,
               jobs: int) -> list[tuple[str, str]]:
    """(verdict, reason) per rule, with the verifier's on-disk cache (no widening)."""
    settings = Settings(ops=(), verify_timeout=timeout, jobs=jobs, widen=False, lift=False)
    return [(v, r) for v, r, _rule in decide_all(rules, ops, settings)]


# ------------------------------------------------------------------ enumeration and candidates


def _vocabularies(library: Library, settings: Settings) -> list[Vocabulary]:
    """Per-operator vocabularies (each operator's parallelization), the algebraic one (compute operators
    alone, to the full depth), then the joint one: the small ones first, the joint one takes what is left."""
    try:
        joint = vocabulary(settings.ops, library.ops)
        per_op = operator_vocabularies(settings.ops, library.ops, settings.max_rank) if settings.per_operator else []
        algebraic = algebraic_vocabulary(settings.ops, library.ops)
    except VocabularyError as err:
        raise GenerateError(str(err)) from None
    return per_op + ([algebraic] if algebraic is not None else []) + [joint]


def _candidates(library: Library, settings: Settings, deadline: float, summary: Summary,
                say: Progress) -> tuple[list[Candidate], frozenset[str]]:
    """Every vocabulary enumerated until `deadline`, its groups turned into typed candidates, one per key;
    and the operators found commutative."""
    vocabs = _vocabularies(library, settings)
    summary.vocabularies = len(vocabs)
    max_pieces = max(settings.degrees) ** 3
    out: list[Candidate] = []
    keys: set[str] = set()
    taken: set[str] = set()
    commutative: frozenset[str] = frozenset()
    for vocab in vocabs:
        if time.perf_counter() >= deadline:
            summary.stopped = _also(summary.stopped, f"seconds (enumeration did not reach the {vocab.label} "
                                                     "vocabulary)")
            break
        envs = environments(vocab, settings.degrees, max(settings.environments, len(settings.degrees)))
        max_ops = min(settings.max_ops, OPERATOR_MAX_OPS) if vocab.own else settings.max_ops
        enumeration = enumerate_terms(vocab, max_ops, envs, max_pieces,
                                      deadline=lambda: time.perf_counter() > deadline,
                                      max_terms=settings.max_terms,
                                      progress=lambda m, v=vocab: say(f"{v.label}: {m}"))
        summary.terms_built += enumeration.built
        summary.terms_defined += enumeration.typed
        summary.groups += sum(1 for g in enumeration.groups.values() if len(g) > 1)
        if enumeration.stopped:
            summary.stopped = _also(summary.stopped, f"{enumeration.stopped} (enumerating the {vocab.label} "
                                                     "vocabulary)")
        canon = Canon.of(vocab, commutative_ops(enumeration))
        commutative |= canon.commutative
        for lhs, rhs, key in pairs(enumeration, canon):
            if key in keys or (vocab.own and vocab.own not in ops_of(lhs) + ops_of(rhs)):
                continue   # seen, or a per-operator vocabulary's rule without its operator (the joint one has those)
            keys.add(key)
            summary.candidates += 1
            found = candidate(library.ops, vocab, lhs, rhs, key, taken, settings.prefix)
            if found is None:
                summary.ill_typed += 1
            else:
                out.append(found)
    out.sort(key=lambda c: c.order)
    say(f"candidates: {len(out)} typed of {summary.candidates}")
    return out, commutative


# ------------------------------------------------------------------ selection


def _loose_key(cand: Candidate) -> str:
    """The candidate's key without shapes and dim numbers: candidates that widening may well make one rule."""
    text = format_expr(cand.rule.lhs) + " => " + format_expr(cand.rule.rhs)
    tensors = {b.name: () for b in cand.rule.binders if b.is_tensor}
    return re.sub(r"\b\d+\b", "#", alpha_text(text, tensors))


def _select(cands: Sequence[Candidate], library: Library, settings: Settings, deadline: float,
            summary: Summary, say: Progress, commutative: frozenset[str] = frozenset()) -> list[Candidate]:
    """Kept candidates (proved, widened), in the order they were decided (see the module docstring).

    A batch takes at most one candidate per loose key (`_loose_key`): the
    same rule found at rank 1 and at rank 2, once lifted, is one rule, and
    after the first is kept the e-graph derives the second, unproved.
    """
    base = list(library.rules) if settings.prune_with_library else []
    kept: list[Candidate] = []
    texts: set[str] = set()
    typing: dict = {}
    queue = list(cands)
    decided_total = 0
    while queue and time.perf_counter() < deadline:
        window, queue = queue[:settings.window], queue[settings.window:]
        clock = time.perf_counter()
        instances = [safe_typed(c.rule, library) for c in window]
        graph = CandidateGraph(library, instances, settings.devices, settings.derive_limits, typing)
        graph.add_rules(base + [c.rule for c in kept])
        graph.saturate()
        decided = graph.derived(range(len(window)))
        summary.derived += sum(decided)
        summary.derive_seconds += time.perf_counter() - clock
        while time.perf_counter() < deadline:
            pending = [k for k in range(len(window)) if not decided[k]]
            if not pending:
                break
            batch: list[int] = []
            loose: set[str] = set()
            for k in pending:
                key = _loose_key(window[k])
                if key not in loose:
                    loose.add(key)
                    batch.append(k)
                    if len(batch) == settings.batch:
                        break
            new: list[Candidate] = []
            clock = time.perf_counter()
            decisions = decide_all([window[j].rule for j in batch], library.ops, settings, deadline)
            summary.prove_seconds += time.perf_counter() - clock
            for j, (verdict, _reason, rule) in zip(batch, decisions):
                decided[j] = True
                if verdict == "PROVED":
                    summary.proved += 1
                    text = rule_identity(rule, commutative)
                    if text in texts:
                        summary.duplicates += 1
                        continue
                    texts.add(text)
                    if rule is not window[j].rule:
                        summary.widened += 1
                        summary.lifted += bool(rule_groups(rule))
                    new.append(replace(window[j], rule=rule))
                elif verdict == "REFUTED":
                    summary.refuted += 1
                else:
                    summary.unknown += 1
            kept += new
            clock = time.perf_counter()
            graph.add_rules([c.rule for c in new])
            graph.saturate()
            rest = [k for k in range(len(window)) if not decided[k]]
            for k, derived in zip(rest, graph.derived(rest)):
                if derived:
                    decided[k] = True
                    summary.derived += 1
            summary.derive_seconds += time.perf_counter() - clock
            if graph.size() >= settings.derive_limits.enodes:
                break   # a fresh e-graph for the rest: this one has stopped saturating
        left = [window[k] for k in range(len(window)) if not decided[k]]
        decided_total += len(window) - len(left)
        queue = left + queue
        say(f"selected: {decided_total} of {len(cands)} candidates decided, {len(kept)} kept "
            f"({graph.size()} e-nodes)")
    if queue:
        summary.not_reached = len(queue)
        summary.stopped = _also(summary.stopped, f"seconds (while selecting: {len(queue)} candidates not looked at)")
        say(f"stopped by seconds: {len(queue)} candidates not looked at")
    return kept


# ------------------------------------------------------------------ minimisation


def derivation_instances(rule: ast.RuleDecl, library: Library, max_rank: int = 4) -> list[RuleInstance]:
    """The rule at every group assignment of lengths 0 or 1 (its only instance when it has no groups)."""
    out = []
    for assignment in group_assignments(rule, max_rank, max_group=1):
        try:
            instance = type_rule(rule, library.ops, assignment)
        except TypeCheckError:
            continue
        if not instance.problems:
            out.append(instance)
    return out


def _minimise(kept: Sequence[Candidate], library: Library, settings: Settings, deadline: float,
              summary: Summary, say: Progress, chunk: int = 24) -> list[Candidate]:
    """Drops, least useful first, the kept rules that the other kept ones derive (at every instance).

    Rules are tested a chunk at a time (each against the rules outside its
    chunk); two rules that derive each other and share a chunk are both
    kept by that test, so a second pass takes strided chunks, in which
    neighbours fall apart.
    """
    order = sorted(kept, key=_output_order, reverse=True)
    base = list(library.rules) if settings.prune_with_library else []
    rules = [c.rule for c in order] + base
    instances = [derivation_instances(c.rule, library) for c in order] + [[] for _ in base]
    limits = replace(settings.derive_limits, iterations=settings.derive_limits.iterations + 1)
    minimiser = Minimiser(library, rules, instances, settings.devices, limits)
    count = max(1, -(-len(order) // chunk))
    parts = [list(range(b, min(b + chunk, len(order)))) for b in range(0, len(order), chunk)]
    parts += [list(range(k, len(order), count)) for k in range(count)]
    dropped: set[int] = set()
    for done, part in enumerate(parts):
        if time.perf_counter() >= deadline:
            summary.stopped = _also(summary.stopped, f"seconds (during the final minimisation: {len(parts) - done} "
                                                     f"of {len(parts)} chunks not tested)")
            break
        part = [i for i in part if i not in dropped]
        for index, derived in zip(part, minimiser.derived(part) if part else []):
            if derived:
                minimiser.drop(index)
                dropped.add(index)
    summary.minimised += len(dropped)
    say(f"minimised: {len(dropped)} of {len(kept)} kept rules derived by the others")
    return [c for i, c in enumerate(order) if i not in dropped]


def _output_order(c: Candidate) -> tuple:
    return ([-s for s in c.score], c.size, c.key)


# ------------------------------------------------------------------ the pipeline


def generate(library: Library, settings: Settings, progress: Progress | None = None) -> GenerateResult:
    """Enumerate, group, select (prove, widen, prune) and minimise; the kept rules, most useful first."""
    say = progress or (lambda _m: None)
    start = time.perf_counter()
    try:   # the CLI's bounds (`dsl.bounds`), for API callers too
        check_all("generate", {"--degrees": settings.degrees, "--max-ops": settings.max_ops,
                               "--seconds": settings.seconds, "--jobs": settings.jobs,
                               "--verify-timeout": settings.verify_timeout, "--max-terms": settings.max_terms,
                               "--max-rank": settings.max_rank})
    except BoundError as err:
        raise GenerateError(str(err)) from None
    if not settings.degrees:
        raise GenerateError("--degrees names no degree")
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", settings.prefix):
        raise GenerateError(f"--prefix must be a name (a letter, then letters, digits or _), got '{settings.prefix}'")
    summary = Summary()
    cands, commutative = _candidates(library, settings, start + settings.seconds * ENUMERATION_SHARE, summary, say)
    summary.enumerate_seconds = time.perf_counter() - start
    end = start + settings.seconds
    reserve = settings.seconds * MINIMISE_SHARE if settings.minimise else 0.0
    kept = _select(cands, library, settings, end - reserve, summary, say, commutative)
    if settings.minimise and kept:
        clock = time.perf_counter()
        kept = _minimise(kept, library, settings, end, summary, say)
        summary.minimise_seconds = time.perf_counter() - clock
    kept.sort(key=_output_order)
    summary.kept = len(kept)
    summary.seconds = time.perf_counter() - start
    return GenerateResult(tuple(c.rule for c in kept), summary)


# ------------------------------------------------------------------ derivation of other rules


def rank_instances(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], rank: int = 2) -> list[RuleInstance]:
    """The rule typed at group lengths that make every tensor metavariable rank `rank`."""
    out = []
    for groups in group_assignments(rule, rank):
        try:
            instance = type_rule(rule, ops, groups)
        except TypeCheckError:
            continue
        if instance.problems or any(len(s) != rank for s in instance.tensors.values()):
            continue
        out.append(instance)
    return out


@dataclass(frozen=True)
class Derivation:
    rule: str
    instances: int
    derived: int
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.instances > 0 and self.derived == self.instances


def derive_rules(target: Iterable[ast.RuleDecl], deriver: Deriver, library: Library,
                 progress: Progress | None = None, rank: int = 2) -> list[Derivation]:
    """For each rule, at every rank-`rank` instance: does saturating its lhs with `deriver`'s rules reach its rhs?

    All instances are first tried in one shared e-graph (fast); an instance
    not reached there is tried again alone, so that the shared e-graph's
    size limit never costs a derivation.
    """
    rules = list(target)
    work: list[tuple[int, RuleInstance, Mapping[str, int]]] = []
    counts = [0] * len(rules)
    notes = [""] * len(rules)
    for index, rule in enumerate(rules):
        instances = rank_instances(rule, library.ops, rank)
        counts[index] = len(instances)
        if not instances:
            notes[index] = f"no rank-{rank} instance"
        for instance in instances:
            sizes = instance_sizes(instance, deriver.devices)
            if sizes is None:
                notes[index] = "no concrete sizes fit"
            else:
                work.append((index, instance, sizes))
    shared = deriver.derives_many([w[1] for w in work], [w[2] for w in work])
    derived = [0] * len(rules)
    for (index, instance, sizes), ok in zip(work, shared):
        if ok or deriver.derives(instance, sizes):
            derived[index] += 1
    out = []
    for index, rule in enumerate(rules):
        out.append(Derivation(rule.name, counts[index], derived[index], notes[index]))
        if progress is not None:
            progress(f"{rule.name}: {derived[index]}/{counts[index]}")
    return out


def rules_over(library: Library, ops: Iterable[str]) -> list[ast.RuleDecl]:
    """The library's rules that use only `ops` (parallel ops included when named)."""
    allowed = set(ops)
    return [r for r in library.rules if set(ops_of(r.lhs)) | set(ops_of(r.rhs)) <= allowed]


def derive_library(generated: Library, shipped: Library, ops: Iterable[str],
                   progress: Progress | None = None) -> list[Derivation]:
    """Which of `shipped`'s rules over `ops` the `generated` rules alone derive (issue 7's measure).

    Every rank-2 instance of each shipped rule, at concrete sizes (degrees
    2, 4 devices), saturated with the generated rules for up to 8
    iterations or 30,000 e-nodes; the benchmark and the test that guards the
    recorded set both ask this one question. Work budgets only (no seconds
    valve): the answer is a measure, the same on a busy box as on an idle one
    (the runner checks the e-node budget between rule chunks, so no instance
    runs unbounded).
    """
    deriver = Deriver(generated, list(generated.rules), devices=4,
                      limits=Limits(iterations=8, enodes=30_000))
    return derive_rules(rules_over(shipped, ops), deriver, generated, progress)
