"""How large an e-graph saturation makes, and of what: e-nodes, e-classes and values per model and mesh.

    .venv/bin/python benchmarks/egraph_growth.py gpt:2x2 llama:2x2 bert:2x2 transformer:2x2 [--generations 8]
    .venv/bin/python benchmarks/egraph_growth.py gpt:2x2 --generations 1000 --iterations 18 --enodes 400000

Each NAME:MESH saturates the built-in example (the language models at 2
blocks, hidden 64, 4 heads, batch 8, sequence 32, vocabulary 256; the
others at their defaults) on a mesh of that shape with every shipped rule
(`parsat.egraph.saturate`, the optimizer's own) under the given budgets,
and prints the stop reason, iterations, e-nodes, e-classes, the number of
values (e-classes joined by parallel operators count as one value: a
parallel operator moves a value, never changes it), the most placements any
value has, the CPU seconds, and the e-nodes by operator. `--generations
1000` lets the rules that make new values run in every generation, which is
what saturation did before generations (docs/MESH.md "Saturation").
"""

from __future__ import annotations

import argparse
import collections
import time

from parsat.dsl.checker import resolve_library
from parsat.egraph.runner import Limits
from parsat.egraph.saturate import saturate
from parsat.ir.mesh import Mesh
from parsat.search.inputs import resolve_graph
from parsat.search.value_order import values

SMALL = {"blocks": 2, "hidden": 64, "heads": 4, "batch": 8, "seq": 32, "vocab": 256}
SIZES = {"gpt": SMALL, "llama": SMALL, "bert": {**SMALL, "ffn": 256}, "stack": {"blocks": 3}}


def placements_per_value(snapshot) -> collections.Counter:
    """Value -> its e-classes (`search.value_order.values`: classes joined by a parallel e-node are one value)."""
    return collections.Counter(values(snapshot).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", metavar="NAME:MESH")
    parser.add_argument("--generations", type=int, default=Limits().generations)
    parser.add_argument("--iterations", type=int, default=Limits().iterations)
    parser.add_argument("--enodes", type=int, default=Limits().enodes)
    args = parser.parse_args()
    library = resolve_library(None)
    limits = Limits(iterations=args.iterations, enodes=args.enodes, generations=args.generations)
    for case in args.cases:
        name, _, shape = case.partition(":")
        mesh = Mesh.of(tuple(int(x) for x in (shape or "4").split("x")), 8)
        graph = resolve_graph(name, library, SIZES.get(name))
        start = time.process_time()
        result = saturate(graph, library, list(library.rules), mesh, limits)
        cpu = time.process_time() - start
        found = placements_per_value(result.snapshot)
        ops = collections.Counter(n.op for nodes in result.snapshot.classes.values() for n in nodes)
        print(f"{case}: {len(graph.nodes)} graph nodes; stop {result.stop} after {result.iterations} iterations; "
              f"{result.enodes} e-nodes in {len(result.snapshot.classes)} e-classes; {len(found)} values, at most "
              f"{max(found.values())} placements of one; {cpu:.1f} CPU s")
        print("  e-nodes by operator: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(8)))


if __name__ == "__main__":
    main()
