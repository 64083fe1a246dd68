"""One rule to one verdict: type check, concrete search, proof, replay.

The order is docs/ARCHITECTURE.md's (the verifier's verdicts): the checker's diagnostics first (a
semantic one, such as an illegal spread, is not an error here but a claim
to refute concretely), then a fast numpy search for a counterexample on
small ranks, then a z3 proof for every rank assignment up to `MAX_RANK`.
Any model z3 proposes is replayed and shrunk before it is reported; one
that does not replay is UNKNOWN, never REFUTED, and never PROVED. Any
crash inside one rule's verification becomes that rule's UNKNOWN.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Mapping

from parsat.dsl import ast
from parsat.dsl.checker import SEMANTIC_KINDS, compare_sides
from parsat.dsl.typecheck import RuleInstance, TypeCheckError, check_rhs_bound, group_assignments, type_rule
from parsat.verifier import concrete
from parsat.verifier.verdict import PROVED, REFUTED, UNKNOWN, Verdict

MAX_RANK = 5
SEARCH_MAX_RANK = 3
SEARCH_MAX_INSTANCES = 8  # rank assignments searched concretely (smallest first); all are proved
SEARCH_MIN_TRIALS = 12
DEFAULT_TIMEOUT = 20.0
VERSION = "verify-3"  # bump when the verifier can decide more: cached verdicts are reused only within a version


class RuleError(Exception):
    """The rule is malformed (not a semantic claim): a `check` error."""


def instances(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], max_rank: int = MAX_RANK) -> list[RuleInstance]:
    """Every rank assignment, smallest ranks first (raises RuleError)."""
    check_rhs_bound(rule)
    out = []
    assignments = sorted(group_assignments(rule, max_rank), key=lambda g: (sum(g.values()), sorted(g.items())))
    for groups in assignments:
        try:
            out.append(type_rule(rule, ops, groups))
        except TypeCheckError as err:
            if err.kind == "rank":
                continue  # an op cannot take these ranks: the rule does not apply there
            raise
    return out


def _rank(instance: RuleInstance) -> int:
    return max((len(s) for s in instance.tensors.values()), default=0)


def verify_rule(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], file: str = "", timeout: float = DEFAULT_TIMEOUT,
                search_trials: int = 80) -> Verdict:
    """The verdict for one rule; never raises for a semantic problem."""
    start = time.monotonic()
    line = rule.span.line if rule.span else 0
    file = file or (rule.span.file if rule.span else "")

    def done(verdict: str, reason: str = "", cex=None, assumptions=()) -> Verdict:
        return Verdict(rule.name, file, line, verdict, round(time.monotonic() - start, 4), reason, cex,
                       tuple(assumptions))

    try:
        try:
            typed = instances(rule, ops)
        except TypeCheckError as err:
            raise RuleError(f"rule {rule.name}: {err}") from None
        if not typed:
            return done(UNKNOWN, f"no rank up to {MAX_RANK} fits the rule")
        semantic = None
        for instance in typed:
            problem = compare_sides(instance)
            if problem is not None:
                if problem.kind not in SEMANTIC_KINDS:
                    raise RuleError(f"rule {rule.name}: {problem}")
                semantic = semantic or problem
        skip_reason = ""
        searched = [i for i in typed if _rank(i) <= SEARCH_MAX_RANK][:SEARCH_MAX_INSTANCES]
        per_instance = max(SEARCH_MIN_TRIALS, search_trials // max(1, len(searched)))
        for instance in searched:
            failure, _ran, skipped = concrete.search(instance, count=per_instance)
            skip_reason = skip_reason or skipped
            if failure is not None:
                cex = failure.counterexample
                if semantic is not None and semantic.kind == "illegal-spread":
                    # say why before showing what: the checker's finding, confirmed by the replay
                    cex = replace(cex, reason=f"{semantic}; replayed piece by piece, {cex.reason}")
                return done(REFUTED, cex.reason, cex)
            if time.monotonic() - start > timeout:
                return done(UNKNOWN, "timeout during the concrete search")
        if semantic is not None and semantic.kind == "illegal-spread":
            return done(UNKNOWN, f"{semantic} (no counterexample found)")
        from parsat.verifier import prove

        assumptions: tuple = ()
        for instance in typed:
            remaining = timeout - (time.monotonic() - start)
            if remaining <= 0:
                return done(UNKNOWN, "timeout")
            try:
                result = prove.prove_instance(instance, remaining)
            except prove.Unprovable as err:
                return done(UNKNOWN, f"{err}{_groups(instance)}")
            assumptions = assumptions or result.assumptions
            if result.status == "proved":
                continue
            if result.status == "candidate":
                failure = _replay(instance, result.model)
                if failure is not None:
                    return done(REFUTED, failure.reason, failure.counterexample)
                sizes = ", ".join(f"{k} = {v}" for k, v in sorted(result.model.items()))
                return done(UNKNOWN, f"{result.reason}{_groups(instance)}; its model ({sizes}) does not replay "
                                     "concretely, so a lemma may be missing")
            return done(UNKNOWN, result.reason + _groups(instance))
        if any(instance.groups for instance in typed):
            assumptions = tuple(assumptions) + (f"every rank up to {MAX_RANK} ({len(typed)} rank assignments)",)
        return done(PROVED, assumptions=assumptions)
    except RuleError:
        raise
    except Exception as err:  # a crash in one rule never stops the others
        return done(UNKNOWN, f"internal error: {type(err).__name__}: {err}")


def refuted_concretely(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], trials: int = 40) -> bool:
    """Whether the concrete search finds a counterexample (False is no proof, only no evidence against).

    The rule generator tries many variants of a proved rule (wider sizes,
    more ranks) and proves only the one it settles on; this refutes most
    wrong variants in milliseconds. Raises RuleError for a malformed rule.
    """
    try:
        typed = instances(rule, ops)
    except TypeCheckError as err:
        raise RuleError(f"rule {rule.name}: {err}") from None
    if not typed:
        return True
    searched = [i for i in typed if _rank(i) <= SEARCH_MAX_RANK][:SEARCH_MAX_INSTANCES]
    per_instance = max(SEARCH_MIN_TRIALS, trials // max(1, len(searched)))
    for instance in searched:
        problem = compare_sides(instance)
        if problem is not None and problem.kind not in SEMANTIC_KINDS:
            raise RuleError(f"rule {rule.name}: {problem}")
        failure, _ran, _skipped = concrete.search(instance, count=per_instance, shrink_failure=False)
        if failure is not None:
            return True
    return False


def _groups(instance: RuleInstance) -> str:
    if not instance.groups:
        return ""
    return " (when " + ", ".join(f"len({g}) = {n}" for g, n in instance.groups.items()) + ")"


def _replay(instance: RuleInstance, model: Mapping[str, int]) -> concrete.Failure | None:
    """A z3 model counts only if numpy agrees; then it is shrunk."""
    if not model:
        return None
    failure = concrete._fails(instance, model)
    return concrete.shrink(instance, failure) if failure is not None else None
