"""The public API's one decision of its own: which rules the optimizer may trust.

`saturate` applies whatever rules it is handed and `verifier` proves rules;
neither knows the other. `optimize` here joins them: saturation gets only
the rules the verifier PROVED, and the BOUNDED ones at the ranks they were
proved for (its verdicts are cached on disk, so a library proved once is
only looked up; a cached verdict that fails its checks is recomputed with
a `CacheWarning`), unless the caller allows unverified rules; VACUOUS,
ILLEGAL, REFUTED and UNKNOWN rules are never used. Everything else is `parsat.search.optimize.optimize`.
"""

from __future__ import annotations

import os
import warnings
from functools import partial

from parsat.dsl import ast
from parsat.dsl.files import cache_dir
from parsat.dsl.library import Library
from parsat.dsl.typecheck import rank_bounded
from parsat.egraph.program import MeshCaches
from parsat.ir.machine import Machine
from parsat.ir.plan import Plan
from parsat.search.optimize import optimize as optimize_with
from parsat.ir.errors import OptimizeError


class CacheWarning(UserWarning):
    """A cached verdict failed its checks (a wrong checksum, evidence that does not fit its word, a
    counterexample that no longer fails) and was recomputed: the cache folder was edited or corrupted."""


def proved_rules(library: Library, allow_unverified: bool | None) -> tuple[list[ast.RuleDecl], str]:
    """The rules saturation may use, and a note on how they were chosen.

    With `allow_unverified` True every rule is used. Otherwise the verifier's
    verdicts (cached on disk by the verifier) decide: PROVED rules, and
    BOUNDED ones restricted to the ranks they were proved for (a `where` on
    their groups' lengths, `dsl.typecheck.rank_bounded`; docs/VERIFIER.md).
    If the verifier cannot be imported and `allow_unverified` is None, every
    rule is used and the note says so; with False that is an error.
    """
    rules = list(library.rules)
    if allow_unverified:
        return rules, "all rules used (--allow-unverified)"
    try:
        from parsat.verifier.api import verify_library   # z3 loads here, and only when proofs are asked for
        from parsat.verifier.cache import VerdictCache
    except ImportError as err:
        if allow_unverified is None:
            return rules, f"verifier not available ({err}); all rules used unverified"
        raise OptimizeError(f"the verifier is not available ({err}); pass --allow-unverified to use rules "
                            "without proofs") from None
    report = verify_library(library, cache=VerdictCache(), jobs=max(1, min(os.cpu_count() or 1, 8)))
    if report.errors:
        raise OptimizeError("the verifier could not check some rules:\n" + "\n".join(report.errors))
    for problem in report.cache_problems:  # never silent: someone or something wrote to the cache folder
        warnings.warn(f"{problem}; the verdict was recomputed", CacheWarning, stacklevel=2)
    verdicts = {v.name: v for v in report.verdicts}
    kept, bounded = [], []
    for rule in rules:
        verdict = verdicts.get(rule.name)
        if verdict is None or not verdict.usable:
            continue
        if verdict.max_rank is not None:
            kept.append(rank_bounded(rule, verdict.max_rank))
            bounded.append(f"{rule.name} (ranks up to {verdict.max_rank})")
        else:
            kept.append(rule)
    dropped = [r.name + (f" ({verdicts[r.name].verdict})" if r.name in verdicts else "")
               for r in rules if r.name not in verdicts or not verdicts[r.name].usable]
    note = f"{len(kept)} proved rules used"
    if bounded:
        note += f", {len(bounded)} of them only at the ranks they were proved for: {', '.join(bounded[:10])}" + (
            " ..." if len(bounded) > 10 else "")
    if dropped:
        note += f"; {len(dropped)} not proved and left out: {', '.join(dropped[:20])}" + (" ..." if len(dropped) > 20 else "")
    if report.cache_problems:
        note += f"; {len(report.cache_problems)} cached verdicts failed their checks and were recomputed"
    return kept, note


def optimize(graph, machine="h100x8", rules=None, limits=None, devices=None, *,
             allow_unverified: bool | None = None, precision: str | None = None, **options) -> Plan:
    """The cheapest plan the proven rules reach: `parsat.search.optimize.optimize` with only proved rules.

    `allow_unverified=True` uses every rule (`proved_rules` says what None and
    False do); `precision` ("bf16", "fp32", ...) trains on `machine` in that
    precision instead of its own (`Machine.with_precision`); the other
    options are `parsat.search.optimize.optimize`'s; unless `caches` is
    given, the rules compiled for each mesh are kept in the cache folder
    (`$PARSAT_CACHE_DIR`) and read back by a later call with the same inputs.
    """
    if precision is not None:
        machine = Machine.resolve(machine).with_precision(precision)
    # compiled mesh programs are kept on disk by their content (`egraph.program_cache`), beside the verdicts
    options.setdefault("caches", MeshCaches(cache_dir()))
    return optimize_with(graph, machine=machine, rules=rules, limits=limits, devices=devices,
                         choose_rules=partial(proved_rules, allow_unverified=allow_unverified), **options)
