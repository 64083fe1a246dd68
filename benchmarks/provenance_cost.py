"""What complete provenance costs (issue 29, item 6): CPU seconds, e-nodes, peak memory, rules named.

Run with one tree first on the path, once per case, for the tree before and after the change:

    PYTHONPATH=<tree> python benchmarks/provenance_cost.py bert-large
    PYTHONPATH=<tree> python benchmarks/provenance_cost.py transformer
    PYTHONPATH=<tree> python benchmarks/provenance_cost.py gpt2x2

It prints one JSON line: CPU seconds of the whole `optimize`, of its saturations (every mesh's) and of the
`rules_used` call in it (process time, not wall clock), the joint e-graph's e-nodes and saturation stop, the process's peak resident memory, and the
rules named. Results and the exact commands: benchmarks/provenance_cost.md.
"""

from __future__ import annotations

import json
import resource
import sys
import time

from parsat.api import optimize
from parsat.dsl.library import load_library
from parsat.ir.models import build_example
from parsat.search import mesh, step

SMALL_GPT = {"batch": 4, "seq": 8, "hidden": 16, "heads": 2, "vocab": 32, "blocks": 2}


def main(case: str) -> dict:
    """Optimizes `case` with the shipped rules (all of them) and measures it."""
    library = load_library()[0]
    spent = []
    original = step.rules_used

    def timed(*args):
        begin = time.process_time()
        out = original(*args)
        spent.append(time.process_time() - begin)
        return out

    step.rules_used = timed
    saturating = []
    original_saturate = mesh.saturate

    def saturate(*args, **kwargs):
        begin = time.process_time()
        out = original_saturate(*args, **kwargs)
        saturating.append(time.process_time() - begin)
        return out

    mesh.saturate = saturate
    cases = {
        "bert-large": lambda: optimize("bert-large", machine="h100x8", devices=8, rules=library,
                                       allow_unverified=True),
        "transformer": lambda: optimize("transformer", machine="cpu", devices=2, rules=library,
                                        allow_unverified=True, baselines=False),
        "gpt2x2": lambda: optimize(build_example("gpt", SMALL_GPT, library), machine="cpu", devices=4,
                                   rules=library, allow_unverified=True, baselines=False,
                                   degrees={"dp": 2, "tp": 2}),
    }
    begin = time.process_time()
    plan = cases[case]()
    return {"case": case, "optimize_cpu_s": round(time.process_time() - begin, 2),
            "saturate_cpu_s": round(sum(saturating), 2), "saturations": len(saturating),
            "rules_used_cpu_s": round(sum(spent), 3), "enodes": plan.saturation["enodes"],
            "stop": plan.saturation["stop"], "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
            "rules_used": len(plan.rules_used), "plan_time_s": plan.totals.time_s}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
