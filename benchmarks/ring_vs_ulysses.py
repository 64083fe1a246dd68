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
from dataclasses import replace
from unittest import mock

from parsat.cost import ring_time
from parsat.cost.pcg_tasks import profile_for, simulate_pcg
from parsat.dsl.library import load_library
from parsat.ir.machine import Machine
from parsat.ir.models import build_example
from parsat.ir.parallelism import FUSED_ATTENTION, describe
from parsat.ir.ring_attention import ring_attentions
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
    _balanced(plan, library)


def _balanced(plan, library) -> None:
    """Where the plan runs the contiguous causal ring, its step re-simulated with each causal ring balanced
    (`RingAttention.balanced`: the zigzag ring's price, `cost.ring_time.ring_work`), the same nodes and placements:
    what the plan would take with its sequence zigzagged at the data loader (Megatron-LM's), no permutation
    priced. The search itself reaches the zigzag ring only where a graph holds a zigzagged attention output
    (`attention_causal_zigzag_query_parallel`), which the example models do not."""
    rings = ring_attentions(plan.pcg)
    if not any(r.causal and not r.balanced for r in rings.values()):
        return
    balanced = {i: replace(r, balanced=r.causal) for i, r in rings.items()}
    machine = Machine.preset("h100x8")
    plain = simulate_pcg(plan.pcg, library, machine, profile_for(machine)).step_s
    with mock.patch.object(ring_time, "ring_attentions", lambda _pcg: balanced):
        step = simulate_pcg(plan.pcg, library, machine, profile_for(machine)).step_s
    print(f"the plan simulated as it is {plain * 1e3:.3f} ms; with its causal rings balanced (zigzag) "
          f"{step * 1e3:.3f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
