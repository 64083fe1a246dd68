"""Which context parallelism the search gives fused attention: ring, Ulysses, or neither.

    .venv/bin/python benchmarks/ring_vs_ulysses.py [--model bert|gpt|llama] BLOCKS SEQ HEADS HIDDEN DEVICES [RULE,RULE...]

Runs `optimize(MODEL(blocks, batch 1, seq, hidden, heads), machine="h100x8", devices=N)` (bert by default:
bidirectional attention; gpt and llama: causal attention, a vocabulary of 8,192), the named rules
left out (`without_rules`, e.g. `attention_query_parallel,attention_of_query_blocks` for the search without
ring attention), and prints the call's CPU seconds and the 1-minute load, the predicted step beside the best
Megatron grid point's, the plan in words (`describe`: "ring attention ... over AXIS N", "context-parallel
attention (Ulysses all-to-all) over AXIS N"), and the first attention's placement and the rules that made it.
Every step is a prediction of the cost model (benchmarks/search_results.md, session 64 helper C; the causal
models session 65 helper C, e.g. `attention_causal_query_parallel` left out for the search without the causal
ring).
"""

from __future__ import annotations

import sys
import time

from parsat.dsl.library import load_library
from parsat.ir.models import build_example
from parsat.ir.parallelism import FUSED_ATTENTION, describe
from parsat.search.optimize import optimize


def main(argv: list[str]) -> None:
    model = "bert"
    if argv[:1] == ["--model"]:
        model, argv = argv[1], argv[2:]
    blocks, seq, heads, hidden, devices = (int(a) for a in argv[:5])
    without = [r for r in (argv[5].split(",") if len(argv) > 5 else []) if r]
    library = load_library()[0]
    sizes = {"blocks": blocks, "batch": 1, "seq": seq, "heads": heads, "hidden": hidden}
    if model != "bert":
        sizes["vocab"] = 8192
    graph = build_example(model, sizes, library)
    start = time.process_time()
    plan = optimize(graph, machine="h100x8", devices=devices, rules=library, without_rules=without)
    cpu = time.process_time() - start
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"cpu {cpu:.1f} load {load}")
    print(f"step {plan.totals.time_s * 1e3:.3f} ms, best grid {plan.baselines['best_grid'].time_s * 1e3:.3f} ms")
    print(describe(plan.pcg))
    attention = next(n for n in plan.pcg.nodes if n.op in FUSED_ATTENTION)
    print("attention placement", attention.placement, attention.rules)


if __name__ == "__main__":
    main(sys.argv[1:])
