"""The unstaged search's memory floor per micro-batch count, beside what the activations might add to it.

    PYTHONPATH=. .venv/bin/python benchmarks/unstaged_floor.py [llama-70b:64:h100x8 ...]

For each case (name:devices:machine; default the four `plan_compare` cases) and each count m in 1, 2, 4, 8 that
divides the batch: `optimize.state_floor` (the weights' training state over every device: what the search
refuses by), and two activation figures read off the graph as written at batch / m, each over every device:
every value some backward reads (`cost.saved.kept`, no recomputation) and what full recomputation of blocks
keeps (values read by another block or outside every block, by name, and what the outside keeps). These are
not shown to bound every plan (the rules may rewrite the values a plan keeps), so the search does not refuse by
them; they say how far even such a floor is from the 80 GiB of llama-70b:64's devices.
"""

from __future__ import annotations

import sys
from math import prod

from parsat.cost.saved import kept
from parsat.ir.blocks import OUTSIDE, block_of
from parsat.ir.units import fmt_bytes
from parsat.search.optimize import state_floor
from parsat.search.request import resolve_request, step_context

CASES = ("llama-70b:64:h100x8", "gpt-175b:1024:a100x8", "gpt-1.3b:64:h100x8", "bert-large:8:h100x8")


def activations(graph, library, machine) -> tuple[int, int]:
    """Bytes kept without recomputation, and by full recomputation of blocks, on one device unparallelized."""
    made = {n.name for n in graph.nodes}
    shapes = graph.shapes()
    values = kept(((n.name, n.op, n.inputs) for n in graph.nodes), library, {l.name: l.role for l in graph.leaves})
    readers: dict[str, set[int]] = {}
    for node in graph.nodes:
        for name in node.inputs:
            readers.setdefault(name, set()).add(block_of(node.name))
    crossing = {n.name for n in graph.nodes
                if block_of(n.name) != OUTSIDE and not readers.get(n.name, set()) <= {block_of(n.name)}}
    outside = {v for v in values if v in made and block_of(v) == OUTSIDE}
    size = lambda names: sum(prod(shapes[v]) for v in names) * machine.dtype_bytes
    return size(v for v in values if v in made), size(crossing | outside)


def main(argv: list[str]) -> int:
    for case in argv or CASES:
        name, devices, machine = case.split(":")
        request = resolve_request(name, machine, None, None, int(devices))
        state, capacity = state_floor(request), request.machine.memory_capacity
        for m in (1, 2, 4, 8):
            if request.batch % m:
                continue
            graph = step_context(request, m, scout=True).graph
            every, blocks = (b / request.devices for b in activations(graph, request.library, request.machine))
            print(f"{name}:{devices} {machine} m={m}: state floor {fmt_bytes(state)}, + kept activations "
                  f"{fmt_bytes(state + every)}, + what recomputing blocks keeps {fmt_bytes(state + blocks)}; "
                  f"the device {fmt_bytes(capacity)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
