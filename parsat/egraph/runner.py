"""The saturation runner: one loop, with limits, a stop reason and per-rule statistics, for every e-graph.

Optimization (`egraph.saturate`) and the rule generator's derivations
(`generate.derivation`) both run their rulesets through `run`, so both stop
the same way and report the same numbers.

egglog has no node limit and cannot be interrupted inside a run, and a
parallel rule set can grow an e-graph fast, so the runner runs one
iteration at a time, each as a list of steps (rulesets, or chunks of one:
`RuleProgram.chunks`), and checks the limits between steps. An iteration
runs every step once, in order (the algebraic rules, then the parallel
ones: neither can starve the other). `seconds` is a deadline the caller
sets (optimization counts compilation in it): once it passes, the run
stops at the next step, so the overshoot is one step's run (one rule's, at
worst). The result says which limit stopped it, or that it saturated, and
what happened on the way (tinygrad's pattern-matcher statistics and
egglog's run report are the models): every rule's matches, from egglog's
report, so the rules that never fired can be named (`parsat optimize
--stats`), and the seconds each step took, measured here (egglog 13.2's own
per-rule timers read microseconds for runs of seconds: `session.StepReport`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from parsat.dsl.bounds import bound
from parsat.egraph.session import Session

STOP_SATURATED = "saturated"
STOP_ITERATIONS = "iterations"
STOP_GENERATIONS = "generations"
STOP_ENODES = "enodes"
STOP_SECONDS = "seconds"
STOP_MATCHES = "matches"   # nothing more changes, but a rule was held back by the match budget
STOP_INTERRUPTED = "interrupted"   # Ctrl-C: the e-graph as it stands is read back, and the caller stops too


@dataclass(frozen=True)
class Limits:
    """When to stop: work budgets, so the same inputs give the same plan on any machine and under any load.

    `generations`, `iterations`, `enodes` and `matches` bound each saturation (`run_generations`); `ilp_nodes` each
    extraction's ILP (HiGHS branch-and-bound nodes); extraction still returns the best plan found within
    them. `seconds` and `ilp_seconds` are wall-clock safety valves, off by default (infinite): `seconds` given
    to `optimize` bounds its whole call (`search.deadline`: each search gets a part of it) and the plan says
    what it cut; `ilp_seconds` 0 skips the ILP (the greedy passes only)."""

    iterations: int = 60
    enodes: int = 200_000
    generations: int = 8        # rounds of the rules that make new values (`run_generations`)
    matches: int | None = None  # one such rule's pattern matches in one round (None: `enodes`); past it, held back
    ilp_nodes: int = 1_000      # branch-and-bound nodes of one extraction's ILP
    seconds: float = math.inf
    ilp_seconds: float = math.inf

    @property
    def clocked(self) -> bool:
        """Whether a wall-clock valve is set (`seconds` or `ilp_seconds` finite): a search's result may then depend
        on the machine's speed, so what is kept for a call, or taken as a scout's, is kept only where it is not."""
        return math.isfinite(self.seconds) or math.isfinite(self.ilp_seconds)

    @staticmethod
    def from_mapping(values: Mapping[str, float] | None) -> "Limits":
        if not values:
            return Limits()
        allowed = set(Limits.__dataclass_fields__)
        unknown = set(values) - allowed
        if unknown:
            raise ValueError(f"unknown limit(s) {', '.join(sorted(unknown))} (limits: {', '.join(sorted(allowed))})")
        limits = Limits(**values)
        check_limits(limits, given=set(values))
        return limits

    @staticmethod
    def resolve(limits: "Limits | Mapping[str, float] | None") -> "Limits":
        """`limits` as given (checked: a user's path may hand a `Limits` in), or built from a mapping."""
        if isinstance(limits, Limits):
            check_limits(limits)
            return limits
        return Limits.from_mapping(limits)


def check_limits(limits: Limits, given: set[str] = frozenset()) -> None:
    """ValueError for a limit outside its bound (`dsl.bounds`): one that would stop the search before it starts
    (0, negative, NaN) or ask for work no one can mean (`iterations=10**30`), with the bound in the message.

    Every user's path checks (`from_mapping`, `search.optimize.optimize`,
    and so `parsat.optimize`); a `Limits` built directly may still hold 0
    (tests use it to stop at once). `seconds` and `ilp_seconds` left at
    their default, infinity, are off: there is no bound to pass."""
    for key in Limits.__dataclass_fields__:
        value = getattr(limits, key)
        if key in ("seconds", "ilp_seconds") and value == math.inf and key not in given or value is None:
            continue
        bound(_COMMAND, f"--limit {key}").check(value)


_COMMAND = "optimize"


@dataclass(frozen=True)
class Run:
    """How a run ended and what it did on the way."""

    stop: str
    iterations: int
    enodes: int
    seconds: float
    note: str                          # where a limit cut an iteration short, e.g. "during iteration 3: ..."
    matches: Mapping[str, int]         # rule -> matches (`rule_names`' rules all present, 0 if never fired)
    step_seconds: Mapping[str, float]  # step -> wall-clock seconds, summed over the iterations
    held: Mapping[str, int] = field(default_factory=dict)   # rule held back by `Limits.matches` -> its matches


class _Steps:
    """Runs rule chunks on one session, counting each rule's matches and each chunk's seconds, and checking the
    limits between chunks (one iteration of a large program can run far past `seconds` or `enodes`)."""

    def __init__(self, session: Session, limits: Limits, deadline: float, rule_names: Mapping[str, str],
                 steps: Sequence[str]):
        self.session, self.limits, self.deadline, self.names = session, limits, deadline, rule_names
        self.matches: Counter = Counter({name: 0 for name in rule_names.values()})
        self.step_seconds: Counter = Counter({step: 0.0 for step in steps})
        self.note = ""
        self.held: dict[str, int] = {}   # rule held back by the match budget -> its matches when it was
        self._counted: int | None = None   # the e-nodes as last counted; None once a step has changed the e-graph
        self._most = math.inf   # at most this many e-nodes: the last count plus what the steps since can have added

    def enodes(self) -> int:
        """The e-graph's e-nodes, counted afresh (`Session.size`: egglog's `print-size` over every table, ~1 ms
        at 1,623 tables) only when a step has reported a change since the last count: a step that reports none
        changed no table (`Session.run` reads every run that can add e-nodes), so the last count holds."""
        if self._counted is None:
            self._counted = self._most = self.session.size()
        return self._counted

    def at_least(self) -> int:
        """A figure the e-node limit judges as it judges `enodes()` (`reached`: `>= limits.enodes`): the most the
        e-graph can hold where that is below the limit (the last count plus each step's `StepReport.built` since:
        then so is the count), else the count. A 2-axis mesh's saturation counted after each of its ~120 steps
        that changed something (`print-size` sorts egglog's ~1,050 table names, ~1.3 ms a call: ~0.15 CPU s of
        llama-70b:64's `node 2 x gpu 8` saturation), where the limit, 200,000, is never near."""
        if self._counted is None and self._most < self.limits.enodes:
            return int(self._most)
        return self.enodes()

    def once(self, steps: Sequence[str], iteration: int, budget: int | None = None) -> tuple[bool, str | None]:
        """Every step once, in order: whether anything changed, and the limit that cut the run short (None).
        `budget`: the most pattern matches a gated rule may have in a step (`Session.run`)."""
        changed = False
        for index, step in enumerate(steps):
            cut = reached(self.limits, 0, self.at_least(), self.deadline) if index else None
            if cut:
                self.note = f"during iteration {iteration}: after {index} of {len(steps)} rule chunks"
                return changed, cut
            started = time.perf_counter()
            try:
                report = self.session.run(step, budget)
            except KeyboardInterrupt:
                # egglog stopped inside the run: what it changed is not reported
                self._counted, self._most = None, math.inf
                self.note = f"during iteration {iteration}: interrupted after {index} of {len(steps)} rule chunks"
                return changed, STOP_INTERRUPTED
            self.step_seconds[step] += time.perf_counter() - started
            changed |= report.changed
            if report.changed:
                self._counted = None
                self._most = math.inf if report.built is None else self._most + report.built
            for key, count in report.matches.items():
                self.matches[self.names.get(key, key)] += count
            for key, count in report.held.items():
                name = self.names.get(key, key)
                self.held[name] = max(self.held.get(name, 0), count)
        return changed, None

    def result(self, stop: str, iterations: int, begin: float) -> "Run":
        """The run as it ended; a saturated run that held a rule back did not saturate the rules given."""
        if stop == STOP_SATURATED and self.held:
            stop = STOP_MATCHES
        return Run(stop, iterations, self.enodes(), time.perf_counter() - begin, self.note,
                   dict(self.matches), dict(self.step_seconds), dict(self.held))


def run(session: Session, steps: Sequence[str], limits: Limits, deadline: float,
        rule_names: Mapping[str, str] | None = None, progress: Callable[[str], None] | None = None) -> Run:
    """Runs `steps` in turn, iteration after iteration, until nothing changes or a limit is reached.

    `deadline` is a `time.perf_counter()` value (the `seconds` limit, counted
    from where the caller started); `rule_names` maps egglog rule names
    (`CompiledRule.key`) to the names matches are counted under (the library
    rule's); a rule it does not name is counted under its own.
    """
    runner = _Steps(session, limits, deadline, rule_names or {}, steps)
    iterations, enodes = 0, runner.enodes()
    begin = time.perf_counter()
    stop = reached(limits, iterations, enodes, deadline)
    while stop is None:
        changed, cut = runner.once(steps, iterations + 1)
        iterations += 1
        enodes = runner.at_least() if progress is None else runner.enodes()   # a progress line says the count
        if progress is not None:
            progress(f"iteration {iterations}: {enodes} e-nodes, {time.perf_counter() - begin:.2f} s")
        stop = cut or (reached(limits, iterations, enodes, deadline) if changed else STOP_SATURATED)
    return runner.result(stop, iterations, begin)


def run_generations(session: Session, grow: Sequence[str], place: Sequence[str], limits: Limits, deadline: float,
                    rule_names: Mapping[str, str] | None = None,
                    progress: Callable[[str], None] | None = None) -> Run:
    """Saturation in generations, so the e-graph is bounded by construction (docs/MESH.md, "Saturation").

    `place` holds the rules that only place values the e-graph already holds
    (`dsl.checker.creates_values` is false: a parallel operator moved, a
    placement derived); there are finitely many (value, placement) e-classes,
    so they run, iteration after iteration, until nothing changes. `grow`
    holds the rules that make new values (reassociation, fusion, a
    vocabulary split into block maxima); each generation runs them once, over
    the whole e-graph, and the place rules saturate again. `limits.generations`
    such rounds are run (the stop reason `generations`) unless a round of
    them changes nothing (`saturated`); `iterations` caps the place rules'
    iterations over all generations, `enodes` the e-graph, and `seconds`, a
    safety valve, the wall time. The e-graph thus grows with the values of
    `generations` rounds times their placements, never with the number of
    ways to reach a placement, and the same inputs stop at the same point.
    One round can still multiply the values (associativity over a sum's
    commuted forms), so a grow rule whose pattern matches more than
    `match_budget` times in a round is held back, from that round on, before
    it applies any (`Session.run`); the run then ends `matches`, not
    `saturated`, and says which rules (`Run.held`)."""
    runner = _Steps(session, limits, deadline, rule_names or {}, tuple(grow) + tuple(place))
    iterations, generation, enodes = 0, 0, runner.enodes()
    begin = time.perf_counter()
    while True:
        stop, iterations, enodes = _place(runner, place, iterations, enodes, generation, begin, progress)
        if stop is None and generation == limits.generations:
            stop = STOP_GENERATIONS
        stop = stop or reached(limits, 0, enodes, deadline)
        if stop is not None:
            return runner.result(stop, iterations, begin)
        generation += 1
        grew, cut = runner.once(grow, iterations + 1, match_budget(limits))
        enodes = runner.at_least()
        if cut or not grew:
            return runner.result(cut or STOP_SATURATED, iterations, begin)


def _place(runner: _Steps, place: Sequence[str], iterations: int, enodes: int, generation: int, begin: float,
           progress: Callable[[str], None] | None) -> tuple[str | None, int, int]:
    """The place rules, iteration after iteration, until nothing changes (None) or a limit is reached (which);
    with the iterations and e-nodes after."""
    while True:
        stop = reached(runner.limits, iterations, enodes, runner.deadline)
        if stop is not None:
            return stop, iterations, enodes
        changed, cut = runner.once(place, iterations + 1)
        iterations += 1
        enodes = runner.at_least() if progress is None else runner.enodes()   # a progress line says the count
        if progress is not None:
            progress(f"generation {generation}, iteration {iterations}: {enodes} e-nodes, "
                     f"{time.perf_counter() - begin:.2f} s")
        if cut or not changed:
            return cut, iterations, enodes


def match_budget(limits: Limits) -> int:
    """The most pattern matches one grow rule may have in one round: `matches`, by default the e-node limit.

    Each match may add e-nodes, and the e-node limit is checked only
    between runs, so a round whose matches alone exceed it can grow the
    e-graph past it inside one egglog run (the imported LLaMA: 1,683,556
    matches, 106,009 -> 1,909,533 e-nodes, out of memory). Matches below
    it are applied as before: the built-in gpt on 64 devices reaches
    106,080 add_assoc matches in a round and saturates at 40,795 e-nodes."""
    return limits.enodes if limits.matches is None else limits.matches


def reached(limits: Limits, iterations: int, enodes: int, deadline: float) -> str | None:
    """The first limit reached, or None."""
    if iterations >= limits.iterations:
        return STOP_ITERATIONS
    if enodes >= limits.enodes:
        return STOP_ENODES
    if time.perf_counter() >= deadline:
        return STOP_SECONDS
    return None
