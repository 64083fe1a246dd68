"""The public API's one decision of its own: which rules the optimizer may trust.

`saturate` applies whatever rules it is handed and `verifier` proves rules;
neither knows the other. `optimize` here joins them: saturation gets only
the rules the verifier PROVED (its verdicts are cached on disk, so a
library proved once is only looked up), unless the caller allows
unverified rules. Everything else is `parsat.saturate.api.optimize`.
"""

from __future__ import annotations

import os
from functools import partial

from parsat.dsl import ast
from parsat.dsl.library import Library
from parsat.ir.machine import Machine
from parsat.ir.plan import Plan
from parsat.saturate.api import optimize as optimize_with
from parsat.saturate.errors import OptimizeError


def proved_rules(library: Library, allow_unverified: bool | None) -> tuple[list[ast.RuleDecl], str]:
    """The rules saturation may use, and a note on how they were chosen.

    With `allow_unverified` True every rule is used. Otherwise the verifier's
    verdicts (cached on disk by the verifier) decide: only PROVED rules. If the
    verifier cannot be imported and `allow_unverified` is None, every rule is
    used and the note says so; with False that is an error.
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
    proved = {v.name for v in report.verdicts if v.proved}
    kept = [r for r in rules if r.name in proved]
    dropped = [r.name for r in rules if r.name not in proved]
    note = f"{len(kept)} PROVED rules used"
    if dropped:
        note += f"; {len(dropped)} not proved and left out: {', '.join(dropped[:20])}" + (" ..." if len(dropped) > 20 else "")
    return kept, note


def optimize(graph, machine="h100x8", rules=None, limits=None, devices=None, *,
             allow_unverified: bool | None = None, precision: str | None = None, **options) -> Plan:
    """The cheapest plan the proven rules reach: `parsat.saturate.api.optimize` with only PROVED rules.

    `allow_unverified=True` uses every rule (`proved_rules` says what None and
    False do); `precision` ("bf16", "fp32", ...) trains on `machine` in that
    precision instead of its own (`Machine.with_precision`); the other
    options are `parsat.saturate.api.optimize`'s.
    """
    if precision is not None:
        machine = Machine.resolve(machine).with_precision(precision)
    return optimize_with(graph, machine=machine, rules=rules, limits=limits, devices=devices,
                         choose_rules=partial(proved_rules, allow_unverified=allow_unverified), **options)
