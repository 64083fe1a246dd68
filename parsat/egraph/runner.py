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
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from parsat.egraph.session import Session

STOP_SATURATED = "saturated"
STOP_ITERATIONS = "iterations"
STOP_ENODES = "enodes"
STOP_SECONDS = "seconds"


@dataclass(frozen=True)
class Limits:
    """When to stop saturating. Extraction still returns the best plan found. `seconds` given to `optimize`
    bounds its whole call (`search.deadline`: each saturation gets a part of it); `iterations` and `enodes`
    bound each saturation."""

    iterations: int = 30
    enodes: int = 200_000
    seconds: float = 30.0
    ilp_seconds: float = 10.0   # extraction's ILP time limit (0: no ILP, the greedy passes only)

    @staticmethod
    def from_mapping(values: Mapping[str, float] | None) -> "Limits":
        if not values:
            return Limits()
        allowed = set(Limits.__dataclass_fields__)
        unknown = set(values) - allowed
        if unknown:
            raise ValueError(f"unknown limit(s) {', '.join(sorted(unknown))} (limits: {', '.join(sorted(allowed))})")
        limits = Limits(**values)
        check_limits(limits)
        return limits

    @staticmethod
    def resolve(limits: "Limits | Mapping[str, float] | None") -> "Limits":
        """`limits` as given (checked: a user's path may hand a `Limits` in), or built from a mapping."""
        if isinstance(limits, Limits):
            check_limits(limits)
            return limits
        return Limits.from_mapping(limits)


def check_limits(limits: Limits) -> None:
    """ValueError for a limit that would stop the search before it starts, or never (0, negative, NaN).

    Every user's path checks (`from_mapping`, `search.optimize.optimize`); a
    `Limits` built directly may still hold 0 (tests use it to stop at once)."""
    for key in ("iterations", "enodes"):
        value = getattr(limits, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--limit {key} must be a whole number of at least 1, got {value!r}")
    for key, zero in (("seconds", False), ("ilp_seconds", True)):   # ilp_seconds 0: the greedy passes only
        value = getattr(limits, key)
        number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        if not number or value < 0 or (value == 0 and not zero):
            need = "0 or more" if zero else "more than 0"
            raise ValueError(f"--limit {key} must be a finite number of seconds, {need}, got {value!r}")


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


def run(session: Session, steps: Sequence[str], limits: Limits, deadline: float,
        rule_names: Mapping[str, str] | None = None, progress: Callable[[str], None] | None = None) -> Run:
    """Runs `steps` in turn, iteration after iteration, until nothing changes or a limit is reached.

    `deadline` is a `time.perf_counter()` value (the `seconds` limit, counted
    from where the caller started); `rule_names` maps egglog rule names
    (`CompiledRule.key`) to the names matches are counted under (the library
    rule's); a rule it does not name is counted under its own.
    """
    names = rule_names or {}
    matches: Counter = Counter({name: 0 for name in names.values()})
    step_seconds: Counter = Counter({step: 0.0 for step in steps})
    note = ""
    iterations, enodes = 0, session.size()
    begin = time.perf_counter()
    stop = reached(limits, iterations, enodes, deadline)
    while stop is None:
        changed, cut = False, None
        for index, step in enumerate(steps):
            # between steps too: one iteration of a large program can run far past `seconds` or `enodes`
            cut = reached(limits, 0, session.size() if changed else enodes, deadline) if index else None
            if cut:
                note = f"during iteration {iterations + 1}: after {index} of {len(steps)} rule chunks"
                break
            started = time.perf_counter()
            report = session.run(step)
            step_seconds[step] += time.perf_counter() - started
            changed |= report.changed
            for key, count in report.matches.items():
                matches[names.get(key, key)] += count
        iterations += 1
        enodes = session.size()
        if progress is not None:
            progress(f"iteration {iterations}: {enodes} e-nodes, {time.perf_counter() - begin:.2f} s")
        stop = cut or (reached(limits, iterations, enodes, deadline) if changed else STOP_SATURATED)
    return Run(stop, iterations, enodes, time.perf_counter() - begin, note, dict(matches), dict(step_seconds))


def reached(limits: Limits, iterations: int, enodes: int, deadline: float) -> str | None:
    """The first limit reached, or None."""
    if iterations >= limits.iterations:
        return STOP_ITERATIONS
    if enodes >= limits.enodes:
        return STOP_ENODES
    if time.perf_counter() >= deadline:
        return STOP_SECONDS
    return None
