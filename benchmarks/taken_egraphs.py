"""Every e-graph one `parsat.optimize` call takes at other sizes (`search.mesh._resized`, `egraph.resize`), held
against saturating that graph anew on the same mesh and pins: classes matched e-node by e-node from the leaves up,
and each class's shape and placement, the e-node counts and the stop reason compared.

    .venv/bin/python benchmarks/taken_egraphs.py llama-70b:64 [--machine h100x8]

A check of the argument in docs/MESH.md ("One saturation for every micro-batch count") on a real search, not a
figure: exits 1 where a taken e-graph differs from the fresh one.
"""

from __future__ import annotations

import argparse
import sys
import time

import parsat
import parsat.search.mesh as mesh
from parsat.egraph.runner import Limits
from parsat.egraph.saturate import saturate
from parsat.egraph.snapshot import matched_classes


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", help="MODEL:DEVICES")
    parser.add_argument("--machine", default="h100x8")
    args = parser.parse_args()
    taken = []
    resized = mesh._resized

    def recorded(step, on, pins):
        found = resized(step, on, pins)
        if found is not None:
            taken.append((step.searched, on, dict(pins), found, step.request))
        return found

    mesh._resized = recorded
    name, devices = args.case.split(":")
    start = time.process_time()
    parsat.optimize(name, machine=args.machine, devices=int(devices))
    print(f"the optimize call: {time.process_time() - start:.1f} CPU s, {len(taken)} e-graphs taken")
    differ = 0
    for graph, on, pins, result, request in taken:
        fresh = saturate(graph, request.library, request.rules, on, Limits(), pins, caches=request.caches,
                         cut_sums=request.cut_sums)
        a, b = result.snapshot, fresh.snapshot
        same = matched_classes(a, b)
        alike = (len(same) == len(a.classes) == len(b.classes) and a.enodes == b.enodes and fresh.stop == result.stop
                 and all(a.shape[c] == b.shape[same[c]] and a.placement[c] == b.placement[same[c]] for c in same))
        differ += not alike
        data = next((leaf for leaf in graph.leaves if leaf.role == "input"), graph.leaves[0])
        print(f"{str(on):24s} {data.name} {data.shape}: taken {a.enodes} e-nodes, "
              f"fresh {b.enodes} ({fresh.stop}), classes {len(a.classes)} / {len(b.classes)}, matched {len(same)}: "
              f"{'SAME' if alike else 'DIFFERENT'}")
    print("every taken e-graph is the fresh one" if not differ else f"{differ} DIFFERENT")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
