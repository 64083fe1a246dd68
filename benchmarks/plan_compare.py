"""Two plans' JSON compared apart from the fields that measure time: whether a change left the plan alone.

    .venv/bin/python benchmarks/plan_compare.py [--rules-moved] before.json after.json

The plans (`Plan.to_json()`, `parsat optimize -o`, `search_phases.py --plan`) are compared with every field
whose name holds "seconds" (`seconds`, `compile_seconds`, `ruleset_seconds`, `pass_seconds`, ...) and every
`cpu_s` removed, serialized in the plan's own key order (`parsat.ir.plan.without_timing`). Prints
IDENTICAL, or the first path where they differ; exit code 1 then. `--rules-moved` also leaves out each rule's
location (the ` (file:line)` after its name in a node's `rules`) and the saturation record: a change that
inserts rules moves the later rules' lines and the e-graph's counts, which is not a change of plan.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from parsat.ir.plan import without_timing


def first_difference(a, b, path: str = "") -> str | None:
    """The first path at which `a` and `b` differ, None where they do not."""
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return f"{path or '/'}: keys {sorted(set(a) ^ set(b)) or 'in another order'}"
        return next((d for k in a if (d := first_difference(a[k], b[k], f"{path}/{k}")) is not None), None)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items against {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{path}/{i}"))), None)
    return None if a == b and type(a) is type(b) else f"{path}: {a!r} against {b!r}"


RULE_LOCATION = re.compile(r" \([^()]*\.rule:\d+\)")


def without_rule_locations(plan):
    """`plan` less its saturation record and every rule's ` (file:line)` (`--rules-moved`)."""
    if isinstance(plan, dict):
        return {k: without_rule_locations(v) for k, v in plan.items() if k != "saturation"}
    if isinstance(plan, list):
        return [without_rule_locations(v) for v in plan]
    return RULE_LOCATION.sub("", plan) if isinstance(plan, str) else plan


def main(argv: list[str]) -> int:
    moved = "--rules-moved" in argv
    argv = [arg for arg in argv if arg != "--rules-moved"]
    if len(argv) != 2 or any(arg.startswith("-") for arg in argv):
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        a, b = (without_timing(json.loads(Path(p).read_text())) for p in argv)
        if moved:
            a, b = without_rule_locations(a), without_rule_locations(b)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if json.dumps(a) == json.dumps(b):
        print("IDENTICAL (apart from timing fields)")
        return 0
    print("DIFFERENT:", first_difference(a, b) or "in serialization")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
