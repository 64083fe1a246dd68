"""`verify(rules)`: verdicts for a set of rules, cached, optionally in parallel.

This is what `parsat verify` and `parsat.verify` call. Load errors and
malformed rules are collected as messages (`VerifyReport.errors`), never
raised as stack traces; semantic problems are verdicts. With `jobs > 1`
rules are verified in worker processes; each rule's verdict depends only on
the rule, its operators and the work budget (`rlimit`, `limits`), so the
results are the same as a serial run, on any machine, under any load. The
wall-clock `timeout` is a safety valve: what it cuts is UNKNOWN and never
cached.
"""

from __future__ import annotations

import fnmatch
import os
from concurrent.futures import as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from parsat.dsl import ast
from parsat.dsl.bounds import check_all
from parsat.dsl.lifetime import process_pool
from parsat.dsl.errors import DslError
from parsat.dsl.library import Library, display_path, load_library, rule_files, shipped_rules_dir
from parsat.dsl.parallel_ops import expand_fused_rule
from parsat.verifier.cache import VerdictCache, rule_key
from parsat.verifier.core import VERSION, RuleError, verify_rule
from parsat.verifier.limits import DEFAULT_RLIMIT, DEFAULT_TIMEOUT, is_wall_clock
from parsat.verifier.verdict import BOUNDED, ILLEGAL, PROVED, REFUTED, UNKNOWN, VACUOUS, VERDICTS, Verdict


@dataclass
class VerifyReport:
    """Verdicts in library order, the errors that stopped some rules, and cache entries ignored."""

    verdicts: list[Verdict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    cache_problems: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {k: sum(1 for v in self.verdicts if v.verdict == k) for k in VERDICTS}

    @property
    def ok(self) -> bool:
        """Every rule PROVED for every rank (BOUNDED and VACUOUS are not)."""
        return not self.errors and all(v.proved for v in self.verdicts)

    def summary(self) -> str:
        """`N proved, N refuted, N unknown`, with `N bounded`, `N vacuous` and `N illegal` when there are any."""
        c = self.counts()
        parts = [f"{c[PROVED]} proved"]
        parts += [f"{c[k]} {k.lower()}" for k in (BOUNDED, VACUOUS, ILLEGAL) if c[k]]
        parts += [f"{c[REFUTED]} refuted", f"{c[UNKNOWN]} unknown"]
        return ", ".join(parts)


def _matches(name: str, patterns: Sequence[str] | None) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(name, p) or p == name for p in patterns)


def _one(args: tuple) -> tuple[str, Verdict | None, str]:
    """Worker: (key, verdict or None, error message)."""
    key, rule, ops, timeout, rlimit = args
    try:
        return key, verify_rule(rule, ops, timeout=timeout, rlimit=rlimit), ""
    except RuleError as err:
        return key, None, f"{rule.span}: error: {err}" if rule.span else str(err)


_WORKER_DIED = "the verifier's worker process died"


def _run_parallel(work: list[tuple], jobs: int, on_outcome: Callable[[tuple], None]) -> None:
    """`_one` over `work` in processes, each outcome passed on as it comes; a worker that dies costs only its rule.

    A process that dies (a segfault in z3, an OOM kill) breaks the whole pool
    and every rule still pending in it. Those are then retried one process
    each, so the rule that kills its process is found, reported UNKNOWN with
    the reason, and never cached; the others get their real verdicts.
    """
    done: set[str] = set()
    try:
        with process_pool(jobs) as pool:
            futures = {pool.submit(_one, item): item[0] for item in work}
            for future in as_completed(futures):
                outcome = future.result()
                done.add(outcome[0])
                on_outcome(outcome)
    except BrokenProcessPool:
        pass
    for item in work:
        key, rule = item[0], item[1]
        if key in done:
            continue
        try:
            with process_pool(1) as alone:
                outcome = alone.submit(_one, item).result()
        except BrokenProcessPool:
            span = rule.span
            outcome = (key, Verdict(rule.name, span.file if span else "", span.line if span else 0, UNKNOWN,
                                    reason=f"{_WORKER_DIED} while proving this rule (a crash in z3, or out of "
                                           "memory); try it alone with --jobs 1"), "")
        done.add(key)
        on_outcome(outcome)


def verify_library(library: Library, *, match: Sequence[str] | None = None, timeout: float = DEFAULT_TIMEOUT,
                   jobs: int = 1, cache: VerdictCache | None = None, only_files: set[str] | None = None,
                   on_verdict: Callable[[Verdict], None] | None = None,
                   rlimit: int = DEFAULT_RLIMIT) -> VerifyReport:
    """Verify the library's rules (those in `only_files` when given).

    `rlimit` (z3's work units per query) decides verdicts and is part of the cache key; `timeout` (seconds
    per rule) is the wall clock's safety valve.

    `on_verdict` is called with each verdict as soon as it is decided
    (cached ones first), so a caller can stream them; the report keeps
    library order. A cached REFUTED verdict is trusted only once its
    counterexample fails again on the devices.
    """
    check_all("verify", {"--timeout": timeout, "--jobs": jobs, "--rlimit": rlimit})   # the CLI's bounds (a ValueError), for API callers
    report = VerifyReport()
    ops = library.ops
    todo: list[tuple[str, ast.RuleDecl]] = []
    for rule in library.rules:
        if only_files is not None and rule.span is not None and rule.span.file not in only_files:
            continue
        if not _matches(rule.name, match):
            continue
        todo.append((rule_key(rule, ops, VERSION, rlimit), rule))
    results: dict[str, Verdict] = {}
    errors: dict[str, str] = {}
    rules = dict(todo)

    def decided(key: str, verdict: Verdict) -> None:
        results[key] = verdict
        if on_verdict is not None:
            on_verdict(_relocate(verdict, rules[key], cached=verdict.cached))

    work = []
    for key, rule in todo:
        if key in results or any(key == item[0] for item in work):
            continue
        hit = cache.get(key, timeout) if cache is not None else None
        if hit is not None:
            problem = _replays(hit, rule, ops)
            if problem:
                cache.reject(key, problem)
                hit = None
        if hit is not None:
            decided(key, replace(hit, cached=True))
        else:
            work.append((key, rule, ops, timeout, rlimit))

    def outcome(item: tuple) -> None:
        key, verdict, error = item
        if verdict is None:
            errors[key] = error
            return
        if cache is not None and not verdict.reason.startswith(_WORKER_DIED) and not is_wall_clock(verdict):
            cache.put(key, verdict, timeout)
        decided(key, verdict)

    if jobs > 1 and len(work) > 1:
        _run_parallel(work, jobs, outcome)
    else:
        for item in work:
            outcome(_one(item))
    for key, rule in todo:
        if key in errors:
            report.errors.append(errors[key])
        elif key in results:
            report.verdicts.append(_relocate(results[key], rule, cached=results[key].cached))
    if cache is not None:
        report.cache_problems = list(cache.problems)
    return report


def _replays(verdict: Verdict, rule: ast.RuleDecl, ops) -> str:
    """'' when a cached REFUTED verdict's counterexample still fails (any other verdict passes), else why not."""
    if verdict.verdict != REFUTED:
        return ""
    from parsat.dsl.typecheck import TypeCheckError, type_rule
    from parsat.verifier.concrete import replay_counterexample

    cex = verdict.counterexample
    rule = expand_fused_rule(rule)   # what was verified (`core.verify_rule`)
    try:
        if cex.rhs == "does not type":  # the right side did not type at these ranks: it still must not
            type_rule(rule, ops, cex.groups)
            return "its counterexample says the right-hand side does not type, but it does"
        instance = type_rule(rule, ops, cex.groups)
    except TypeCheckError:
        return "" if cex.rhs == "does not type" else "its counterexample's ranks do not type"
    except (TypeError, KeyError, AttributeError):
        return "its counterexample is malformed"
    if replay_counterexample(instance, cex) is None:
        return "its counterexample does not fail when replayed on the devices"
    return ""


def _relocate(verdict: Verdict, rule: ast.RuleDecl, cached: bool) -> Verdict:
    """A cached verdict reported at the rule's current place."""
    span = rule.span
    return replace(verdict, name=rule.name, file=span.file if span else verdict.file,
                   line=span.line if span else verdict.line, cached=cached)


def verify_paths(paths: Sequence[str | os.PathLike] | None = None, **options) -> VerifyReport:
    """Load files or folders (default: the shipped library) and verify their rules.

    Operators imported from other files are used, but only the rules of
    the files named (or found in the folders named) are verified.
    """
    try:
        library, load_errors = load_library(paths, strict=False)
        named = {display_path(p) for p in rule_files(paths if paths else [shipped_rules_dir()])}
    except DslError as err:
        return VerifyReport(errors=[d.render() for d in err.diagnostics])
    if load_errors:
        return VerifyReport(errors=[d.render() for d in load_errors])
    report = verify_library(library, only_files=named, **options)
    return report


def verify(rules=None, **options) -> list[Verdict]:
    """Verdicts for a `Library`, a list of paths, or the shipped library.

    Raises `DslError`-like `ValueError` with every message when rules are
    malformed; semantic failures are REFUTED verdicts, not exceptions.
    """
    if isinstance(rules, Library):
        report = verify_library(rules, **options)
    else:
        if isinstance(rules, (str, os.PathLike)):
            rules = [rules]
        report = verify_paths(rules, **options)
    if report.errors:
        raise ValueError("\n".join(report.errors))
    return report.verdicts
