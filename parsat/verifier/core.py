"""One rule to one verdict: ranks, concrete search, vacuity, proof, replay, each bounded by counted work.

The order is docs/VERIFIER.md's (and docs/ARCHITECTURE.md's):
1. `ranks.plan` types the rule at the rank assignments to search and to
   prove, and says whether the proofs cover every rank (PROVED) or only
   ranks up to a bound (BOUNDED). A rank where the left side types and
   the right does not is a counterexample.
2. The checker's diagnostics: a malformed rule is an error (`RuleError`);
   a semantic one (sides spread or shaped differently, a window that does
   not tile its block at some sizes) is a claim to refute.
3. A concrete search at every searched rank where the spread analysis
   places every node, smallest ranks and shapes first, judged device by
   device (`concrete`, `devices`), with witnesses the checker finds for a
   failing legality condition tried first.
4. Vacuity: a rule whose assumptions force a degree to 1 (or can never
   hold) is VACUOUS, never PROVED. Then a rule with a node the spread
   analysis cannot place (at any rank) is ILLEGAL: the refused read and
   why, no counterexample (a term that is no parallel program has no
   device semantics to compare).
5. z3 (`prove`) for every proof instance; any model it proposes is
   replayed device by device and shrunk before it is REFUTED.
6. Before PROVED: the search must have run the rule on the devices at
   least once, the z3 lowering must agree with the devices
   (`crosscheck`), random instances at ranks up to 8 and dims up to 12
   must agree on the devices (`crosscheck.devices_disagree`), and the
   spread analysis must not have disagreed with them anywhere; otherwise
   the verdict is UNKNOWN with a bug report.

Every stage is bounded by counted work (`limits`): the search by its trial
counts, every z3 query by `rlimit`, so the verdict is a function of the rule
and the budgets. `timeout` is only a safety valve on the wall clock: a rule
that passes it is UNKNOWN saying which stage the wall clock cut.
A crash inside one rule's verification becomes that rule's UNKNOWN.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Mapping

from parsat.dsl import ast
from parsat.dsl.checker import SEMANTIC_KINDS, compare_sides, witness
from parsat.dsl.conditions import Negation, Rel
from parsat.dsl.parallel_ops import expand_fused_rule
from parsat.dsl.symbolic import Poly
from parsat.dsl.typecheck import RuleInstance, TypeCheckError, check_rhs_bound, group_assignments, type_rule
from parsat.verifier import concrete, ranks
from parsat.verifier.limits import DEFAULT_RLIMIT, DEFAULT_TIMEOUT, OutOfTime, WallClock, wall_clock_reason
from parsat.verifier.verdict import (BOUNDED, ILLEGAL, PROVED, REFUTED, UNKNOWN, VACUOUS, Counterexample,
                                     Verdict)

MAX_RANK = ranks.MAX_RANK
SEARCH_TRIALS = 80       # random trials per rule, spread over its searched instances
SEARCH_MIN_TRIALS = 12   # per instance
VERSION = "verify-5"     # with the hash of the verifier's code (cache.code_hash), the cache key's version


class RuleError(Exception):
    """The rule is malformed (not a semantic claim): a `check` error."""


def instances(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], max_rank: int = MAX_RANK) -> list[RuleInstance]:
    """Every rank assignment with metavariables up to `max_rank`, smallest first (raises RuleError)."""
    try:
        check_rhs_bound(rule)
    except TypeCheckError as err:
        raise RuleError(f"rule {rule.name}: {err}") from None
    out = []
    assignments = sorted(group_assignments(rule, max_rank), key=lambda g: (sum(g.values()), sorted(g.items())))
    for groups in assignments:
        try:
            out.append(type_rule(rule, ops, groups))
        except TypeCheckError as err:
            if err.kind == "rank":
                continue
            raise RuleError(f"rule {rule.name}: {err}") from None
    return out


def _rank(instance: RuleInstance) -> int:
    return max((len(s) for s in instance.tensors.values()), default=0)


@dataclass(frozen=True)
class _Verdicts:
    """Makes one rule's verdicts, so that every stage words them alike and none can promise a proof the
    devices contradicted: `notes` gathers the disagreements the stages find (bug reports), and a PROVED or
    BOUNDED verdict made while there are any becomes UNKNOWN."""

    name: str
    file: str
    line: int
    clock: WallClock
    notes: list[str] = field(default_factory=list, compare=False)

    def __call__(self, verdict: str, reason: str = "", cex=None, assumptions=(), max_rank=None) -> Verdict:
        found = tuple(dict.fromkeys(self.notes))[:3]  # bug reports: a few say enough
        if verdict in (PROVED, BOUNDED) and found:  # a disagreement is no proof: report it, promise nothing
            verdict, reason, max_rank = UNKNOWN, f"proved, but the devices disagree with the verifier: {found[0]}", None
        return Verdict(self.name, self.file, self.line, verdict, round(self.clock.elapsed(), 4), reason, cex,
                       tuple(assumptions), max_rank=max_rank, notes=found)


@dataclass(frozen=True)
class _Stages:
    """What the stages after typing share, so each takes one argument for the rule's state: the rank plan,
    the wall clock, the verdict maker and the rule's z3 work (`prove.Solving`, set once the search is done:
    z3 is loaded only for rules that get that far)."""

    plan: ranks.RankPlan
    clock: WallClock
    done: _Verdicts
    rule: ast.RuleDecl                  # with fused operators expanded
    ops: Mapping[str, ast.OpDecl]
    rlimit: int
    solving: object = None


@dataclass(frozen=True)
class _Searched:
    """What a concrete search that found no counterexample did: the later stages quote it in their reasons,
    and a proof counts only if the devices ran the rule at least once (`trials`)."""

    trials: int
    skipped: str       # why some sizes could not be simulated ('' if none)
    instances: int     # how many rank assignments were searched


def verify_rule(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], file: str = "", timeout: float = DEFAULT_TIMEOUT,
                search_trials: int = SEARCH_TRIALS, rlimit: int = DEFAULT_RLIMIT) -> Verdict:
    """The verdict for one rule; never raises for a semantic problem (RuleError for a malformed rule).

    `search_trials` and `rlimit` (z3's work units per query) decide the verdict; `timeout` (seconds) only
    stops a runaway, with an UNKNOWN that says so. A fused parallel operator means its steps
    (`dsl.parallel_ops`): the rule is verified with them expanded."""
    rule = expand_fused_rule(rule)
    clock = WallClock(timeout)
    line = rule.span.line if rule.span else 0
    file = file or (rule.span.file if rule.span else "")
    done = _Verdicts(rule.name, file, line, clock)

    try:
        rank_plan = _typed_plan(rule, ops)
        if rank_plan.rhs_untyped:
            return _rhs_untyped(rule, ops, rank_plan, clock, done)
        if not rank_plan.search and not rank_plan.proof:
            top = f" up to rank {ranks.SEARCH_MAX_RANK}" if rank_plan.max_rank is not None else ""
            return done(VACUOUS, f"no rank assignment types{top}: the rule never applies")
        stages = _Stages(rank_plan, clock, done, rule, ops, rlimit)
        searched = _concrete_search(stages, search_trials)
        if isinstance(searched, Verdict):
            return searched

        from parsat.verifier import prove

        stages = replace(stages, solving=prove.Solving(rlimit))
        settled, hint = _settled_before_proof(stages, searched)
        if settled is not None:
            return settled
        settled, assumptions = _proof_stage(stages)
        if settled is not None:
            return settled
        return _trusted_verdict(stages, searched, assumptions, hint)
    except RuleError:
        raise
    except OutOfTime as cut:
        return done(UNKNOWN, wall_clock_reason(timeout, cut.stage))
    except Exception as err:  # a crash in one rule never stops the others
        return done(UNKNOWN, f"internal error: {type(err).__name__}: {err}")


def _typed_plan(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl]) -> ranks.RankPlan:
    """Steps 1 and 2: the rank plan; a malformed rule raises RuleError here, before any search (a semantic
    finding of the checker is for the later stages to refute, or to call ILLEGAL)."""
    try:
        rank_plan = ranks.plan(rule, ops)
    except TypeCheckError as err:
        raise RuleError(f"rule {rule.name}: {err}") from None
    for instance in rank_plan.search + rank_plan.proof:
        problem = compare_sides(instance)
        if problem is not None and problem.kind not in SEMANTIC_KINDS:
            raise RuleError(f"rule {rule.name}: {problem}")
    return rank_plan


def _concrete_search(stages: _Stages, search_trials: int) -> Verdict | _Searched:
    """Step 3: the concrete search, smallest ranks first, witnesses of failing legality conditions first.

    A counterexample is REFUTED (a Verdict); otherwise what the search did, which the later stages need.
    Bounded by its trial counts only (the wall clock raises OutOfTime)."""
    clock, done = stages.clock, stages.done
    # A rank where the spread analysis refuses a node is no parallel program: nothing there to replay as a
    # counterexample (ILLEGAL, `_settled_before_proof`); the other ranks are searched.
    searched = sorted((i for i in stages.plan.search if not i.problems), key=lambda i: (_rank(i), sum(i.groups.values())))
    per_instance = max(SEARCH_MIN_TRIALS, search_trials // max(1, len(searched)))
    trials, skipped = 0, ""
    for instance in searched:
        failure, ran, skip = concrete.search(instance, count=per_instance, deadline=clock.deadline,
                                             extra=_witnesses(instance), notes=done.notes)
        if failure is None and not ran:  # no drawn size applies: ask the checker's search for some that do
            failure, ran, skip = concrete.search(instance, count=0, deadline=clock.deadline,
                                                 extra=_applicable(instance), notes=done.notes)
        trials += ran
        skipped = skipped or skip
        if failure is not None:
            return done(REFUTED, failure.reason, failure.counterexample)
    return _Searched(trials, skipped, len(searched))


def _settled_before_proof(stages: _Stages, searched: _Searched) -> tuple[Verdict | None, str]:
    """Step 4: the verdicts z3 is not asked for (no rank to prove at, a vacuous rule, an illegal spread the
    search could not refute), or None; and a hint that the rule is perhaps vacuous ('' if not), which keeps
    a later proof from being PROVED."""
    plan, done = stages.plan, stages.done
    if not plan.proof:
        return done(UNKNOWN, f"the rule types only above rank {plan.max_rank}, where it is not proved "
                             f"({plan.why_bounded}); no counterexample up to rank {ranks.SEARCH_MAX_RANK} "
                             f"in {searched.trials} trials"), ""

    vacuous = _vacuity(plan.proof or plan.search, stages)
    hint = ""
    if vacuous.startswith("?"):  # probably vacuous, not shown: said with an UNKNOWN, never PROVED
        vacuous, hint = "", vacuous[1:]
    if vacuous:
        return done(VACUOUS, vacuous), hint
    refused = _refused(plan.search + plan.proof)
    if refused:
        limits = (f"{searched.trials} trials over {searched.instances} rank assignments where it can"
                  if searched.instances else "it refuses it at every rank")
        return done(ILLEGAL, f"{refused} A term the analysis cannot place is no parallel program, so the rule is "
                             f"neither proved nor refuted with values (no counterexample where the analysis places "
                             f"both sides: {limits})"), hint
    return None, hint


def _proof_stage(stages: _Stages) -> tuple[Verdict | None, tuple]:
    """Step 5: z3 on every proof instance; a verdict when one is not proved (a z3 model counts as REFUTED
    only once it replays on the devices), else None and the assumptions the proofs made."""
    from parsat.verifier import prove

    clock, done = stages.clock, stages.done
    assumptions: tuple = ()
    for instance in stages.plan.proof:
        clock.check(f"the proof{_groups(instance)}")
        try:
            result = prove.prove_instance(instance, clock.left(), stages.solving)
        except prove.Unprovable as err:
            return done(UNKNOWN, f"{err}{_groups(instance)}"), assumptions
        assumptions = assumptions or result.assumptions
        if result.status in ("proved", "never"):
            continue
        if result.status == "candidate":
            failure = _replay(instance, result, clock.deadline)
            if failure is not None:
                return done(REFUTED, failure.reason, failure.counterexample), assumptions
            sizes = ", ".join(f"{k} = {v}" for k, v in sorted(result.model.items()))
            return done(UNKNOWN, f"{result.reason}{_groups(instance)}; its model ({sizes}) does not replay on "
                                 "the devices, so a lemma may be missing"), assumptions
        return done(UNKNOWN, result.reason + _groups(instance)), assumptions
    return None, assumptions


def _trusted_verdict(stages: _Stages, searched: _Searched, assumptions: tuple, hint: str) -> Verdict:
    """Step 6: a z3 proof becomes PROVED (or BOUNDED) only if the devices ran the rule, the z3 lowering
    agrees with them and no vacuity hint stands; otherwise UNKNOWN, saying which check failed."""
    plan, done, skipped = stages.plan, stages.done, searched.skipped
    if not searched.trials:
        return done(UNKNOWN, "z3 proved it, but no size where it applies could be run on the devices, so the "
                             f"proof was never checked against them{': ' + skipped if skipped else ''}",
                    assumptions=assumptions)
    disagreement = _lowering_checked(plan.proof, stages.clock)
    if disagreement:
        done.notes.append(disagreement)
        return done(UNKNOWN, f"z3 proved it, but the proof cannot be trusted: {disagreement} (a bug in "
                             "parsat/verifier/prove.py or parsat/verifier/normal.py: please report it)")
    from parsat.verifier.crosscheck import devices_disagree

    disagreement = devices_disagree(stages.rule, stages.ops, plan.max_rank, stages.clock.deadline, done.notes)
    if disagreement:
        done.notes.append(disagreement)
        return done(UNKNOWN, f"z3 proved it, but {disagreement} (a bug in the verifier's proof or its rank "
                             "argument, parsat/verifier/ranks.py: please report it)")
    if hint:
        return done(UNKNOWN, f"proved, but perhaps vacuously: {hint}", assumptions=assumptions)
    if plan.max_rank is not None:
        return done(BOUNDED, f"proved for every rank up to {plan.max_rank} ({len(plan.proof)} rank "
                             f"assignments), not beyond: {plan.why_bounded}", assumptions=assumptions,
                    max_rank=plan.max_rank)
    if any(instance.groups for instance in plan.proof):
        assumptions = tuple(assumptions) + ("every rank: each group proved at lengths 0 and 1, and longer "
                                            "groups reduce to length 1 (parsat/verifier/ranks.py)",)
    return done(PROVED, assumptions=assumptions)


def _lowering_checked(proved: list[RuleInstance], clock: WallClock) -> str:
    """The z3 lowering of every proved instance against the devices ('' if they agree), at its smallest
    applicable sizes and at the applicable candidate sizes with the most symbols above 1 (the smallest such):
    at size 1 a max, a window, a block re-indexing or a gather has a single term, and a wrong lowering of it can
    agree with the devices by accident."""
    from parsat.verifier.crosscheck import lowering_disagrees

    stage = "the cross-check of the z3 lowering against the devices"
    for instance in proved:
        clock.check(stage)
        kinds = instance.symbols
        wide = [{n: (2 if k == "degree" else m if k == "dim" else m // 2) for n, k in kinds.items()} for m in (4, 6)]
        applicable = [sizes for sizes in list(concrete.candidate_sizes(instance, random.Random(0), 8)) + wide
                      if concrete.applies(instance, sizes)]
        if not applicable:
            continue
        spread = max(applicable, key=lambda sizes: (sum(v >= 2 for v in sizes.values()), -sum(sizes.values())))
        for sizes in [applicable[0]] + ([spread] if spread != applicable[0] else []):
            clock.check(stage)
            try:
                found = lowering_disagrees(instance, sizes)
            except concrete.Unsupported:
                continue
            if found:
                return found
    return ""


def _refused(typed: list[RuleInstance]) -> str:
    """The first node the spread analysis cannot place, the read it refuses and why ('' if none)."""
    for instance in typed:
        for problem, node in instance.problems:
            return f"the spread analysis cannot place {_text(node)}{_groups(instance)}: {problem}."
    return ""


def _witnesses(instance: RuleInstance) -> list[dict[str, int]]:
    """Sizes where the rule applies but a legality condition fails (the checker's search)."""
    assumptions = instance.where + instance.lhs_requires
    found = []
    for cond, _node in instance.legal_when:
        sizes = witness(assumptions + (Negation(cond),), instance.symbols)
        if sizes is not None:
            found.append(sizes)
    return found


def _applicable(instance: RuleInstance) -> list[dict[str, int]]:
    """Sizes where the rule applies (with every degree at least 2 when possible), for rules whose
    conditions the drawn sizes miss."""
    assumptions = instance.where + instance.lhs_requires + instance.rhs_requires
    degrees = tuple(Rel(">=", Poly.sym(d), Poly.const(2)) for d, k in instance.symbols.items() if k == "degree")
    found = [witness(assumptions + degrees, instance.symbols)]
    if found[0] is None:
        found = [witness(assumptions, instance.symbols)]
    return [sizes for sizes in found if sizes is not None]


def _vacuity(typed: list[RuleInstance], stages: _Stages) -> str:
    """Why the rule is vacuous ('' when it is not): it never applies, or only with a degree forced to 1."""
    from parsat.verifier import prove

    clock, solving = stages.clock, stages.solving
    if not typed:
        return ""
    never = 0
    forced: dict[str, str] = {}
    hints: list[str] = []
    for instance in typed:
        assumptions = instance.where + instance.lhs_requires
        if witness(assumptions, instance.symbols) is None and prove.never_applies(instance, clock.left(), solving):
            never += 1
            continue
        for degree in sorted(s for s, k in instance.symbols.items() if k == "degree"):
            at_least_two = Rel(">=", Poly.sym(degree), Poly.const(2))
            if witness(assumptions + (at_least_two,), instance.symbols) is not None:
                continue
            if prove.forced_to_one(instance, degree, clock.left(), solving):
                shown = dict.fromkeys(prove.describe_condition(c) for c in assumptions)
                forced.setdefault(degree, "; ".join(shown) or "no assumption")
            else:
                hints.append(f"no sizes up to 64 apply it with {degree} >= 2, but z3 could not show that {degree} "
                             "must be 1")
    if never == len(typed):
        return "the rule never applies: its 'where' and the left-hand side's requirements cannot hold together"
    if forced:
        degree, why = next(iter(forced.items()))
        return (f"vacuous: the rule applies only when {degree} = 1 (its assumptions {why} force it), so it "
                "parallelizes nothing")
    return "" if not hints else "?" + hints[0]


def _rhs_untyped(rule, ops, rank_plan, clock: WallClock, done) -> Verdict:
    """The left side types at some ranks and the right does not: show the left side applying there."""
    groups, error = rank_plan.rhs_untyped[0]
    reason = f"the right-hand side does not type where the left does ({_fmt_groups(groups)}): {error}"
    left_only = replace(rule, rhs=rule.lhs)
    try:
        instance = type_rule(left_only, ops, groups)
    except TypeCheckError:
        return done(REFUTED, reason, Counterexample(reason, groups=dict(groups), rhs="does not type"))
    failure = None
    for sizes in concrete.candidate_sizes(instance, random.Random(0), 40):
        if concrete.applies(instance, sizes):
            failure = sizes
            break
    cex = Counterexample(reason, groups=dict(groups), sizes=dict(sorted((failure or {}).items())),
                         lhs_text=_text(rule.lhs), rhs_text=_text(rule.rhs), lhs="defined", rhs="does not type")
    return done(REFUTED, reason, cex)


def _text(expr) -> str:
    from parsat.dsl.printer import format_expr

    return format_expr(expr)


def _fmt_groups(groups: Mapping[str, int]) -> str:
    return ", ".join(f"len({g}) = {n}" for g, n in groups.items()) or "no groups"


def refuted_concretely(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], trials: int = 40) -> bool:
    """Whether the concrete search finds a counterexample (False is no proof, only no evidence against).

    The rule generator tries many variants of a proved rule (wider sizes,
    more ranks) and proves only the one it settles on; this refutes most
    wrong variants in milliseconds. Raises RuleError for a malformed rule.
    """
    rule = expand_fused_rule(rule)
    try:
        rank_plan = ranks.plan(rule, ops)
    except TypeCheckError as err:
        raise RuleError(f"rule {rule.name}: {err}") from None
    if rank_plan.rhs_untyped:
        return True
    if not rank_plan.search:
        return True
    searched = sorted(rank_plan.search, key=lambda i: (_rank(i), sum(i.groups.values())))
    per_instance = max(SEARCH_MIN_TRIALS, trials // max(1, len(searched)))
    for instance in searched:
        problem = compare_sides(instance)
        if problem is not None and problem.kind not in SEMANTIC_KINDS:
            raise RuleError(f"rule {rule.name}: {problem}")
        failure, _ran, _skipped = concrete.search(instance, count=per_instance, shrink_failure=False,
                                                  extra=_witnesses(instance))
        if failure is not None:
            return True
    return False


def _groups(instance: RuleInstance) -> str:
    if not instance.groups:
        return ""
    return " (when " + _fmt_groups(instance.groups) + ")"


def _replay(instance: RuleInstance, result, deadline: float) -> concrete.Failure | None:
    """A z3 model counts only if the devices agree: replayed at its own input values first (a root of a
    denominator, a value outside the search's small integers), then at random ones; then it is shrunk."""
    if not result.model and instance.symbols:
        return None
    failure = concrete.replay_model(instance, result.model, result.inputs, result.reals)
    failure = failure or concrete.replay(instance, result.model)
    return concrete.shrink(instance, failure, deadline) if failure is not None else None
