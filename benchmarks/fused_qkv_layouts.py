"""HF GPT-2's fused q, k, v projection under a pinned tp: the plan the search gives, and the plan of the same model
with the fused projection written as three (what Megatron-LM's head-ordered layout computes).

    .venv/bin/python benchmarks/fused_qkv_layouts.py [--devices 2] [--machine cpu]

GPT-2 is `hf_models.make("gpt2")` (2 layers, hidden 128, 4 heads, batch 8 x 32, dropout on). Rows, one JSON line
each: `fused tp` (the model as imported, `--degrees tp=N`: the plan and which search gave it), `fused tp joint`
(the same without baselines: the e-graph's own plan, or why there is none), `fused free` (nothing pinned), and
`three projections tp`: each block's `linear -> unflatten -> split x 3` replaced by three `linear`s of [h, h]
weights and [h] biases (one leaf each), whose tp plan keeps each rank's heads of q, k and v (every weight
column-parallel, the attention's `bmm`s and softmax split along the heads, `c_proj` row-parallel). That graph is
not GPT-2's parameters (three leaves, not one `Conv1D`): it prices Megatron-LM's layout with three weights. Since
2026-12-06 the grid lays the fused graph out so too (`megatron_pcg(heads_ordered=True)`: the one fused weight
stored as the tensor axis's partition of its [h, h, 3] view, torch's `_StridedShard(1, split_factor=3)`), so the
`fused tp` row is that point. Predictions of parsat's cost model; CPU seconds of this process, the 1-minute load
beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_models  # noqa: E402

import parsat  # noqa: E402
from parsat.importer.export import import_module  # noqa: E402
from parsat.ir.graph import Graph, Leaf, OpNode  # noqa: E402

PARTS = 3   # q, k, v


def three_projections(graph: Graph) -> Graph:
    """`graph` with every `linear` whose only reader is an `unflatten` cut into 3 equal `split`s along its last dim
    written as 3 `linear`s, each with its own weight [k, n / 3] and bias [n / 3] leaves (named `<weight>__<i>`)."""
    readers: dict[str, list[OpNode]] = {}
    for node in graph.nodes:
        for name in node.inputs:
            readers.setdefault(name, []).append(node)
    leaves, nodes, dropped = list(graph.leaves), [], set()
    for node in graph.nodes:
        if node.name in dropped:
            continue
        view = readers.get(node.name, [None])[0] if len(readers.get(node.name, [])) == 1 else None
        cuts = [r for r in readers.get(view.name, []) if r.op == "split"] if view and view.op == "unflatten" else []
        width = node.shape[-1] // PARTS if node.op == "linear" else 0
        if len(cuts) != PARTS or len(readers[view.name]) != PARTS or \
                sorted(c.attr("start") for c in cuts) != [i * width for i in range(PARTS)]:
            nodes.append(node)
            continue
        x, weight, bias = node.inputs
        for cut in cuts:
            i = cut.attr("start") // width
            w, b, y = f"{weight}__{i}", f"{bias}__{i}", f"{node.name}__{i}"
            leaves += [Leaf(w, (graph.shape(weight)[0], width), "weight"), Leaf(b, (width,), "weight")]
            nodes += [OpNode(y, "linear", (x, w, b), (), (*node.shape[:-1], width)),
                      OpNode(cut.name, "unflatten", (y,), view.attrs, cut.shape)]
        dropped |= {view.name, *(c.name for c in cuts)}
        leaves = [leaf for leaf in leaves if leaf.name not in (weight, bias)]
    return replace(graph, leaves=tuple(leaves), nodes=tuple(nodes))


def row(label: str, graph: Graph, devices: int, machine: str, **options) -> dict:
    start = time.process_time()
    data = parsat.optimize(graph, machine=machine, devices=devices, **options).to_dict()
    seconds = time.process_time() - start
    grid = (data.get("baselines") or {}).get("best_grid")
    partitions = [n for n in data["nodes"] if n["kind"] == "parallel" and n["op"] == "partition"]
    return {"row": label, "step_ms": round(data["totals"]["time_s"] * 1e3, 4), "chosen": data["extraction"]["chosen"],
            "fallback": data["extraction"].get("fallback"),
            "best_grid_ms": round(grid["time_s"] * 1e3, 4) if isinstance(grid, dict) else None,
            "peak_memory_mib": round(data["totals"]["peak_memory_bytes"] / 2**20, 3),
            "comm_elements": data["totals"].get("comm_elements"),
            "heads_split": any(len(n["shape"]) == 4 and n["attrs"].get("dim") == 1 for n in partitions) or any(
                n["kind"] == "op" and n["op"] in ("softmax_causal", "attention_causal") and "Shard(1)" in n["placement"]
                for n in data["nodes"]),
            "enodes": data["saturation"].get("enodes"), "cpu_s": round(seconds, 2),
            "load_1min": float(Path("/proc/loadavg").read_text().split()[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--machine", default="cpu")
    args = parser.parse_args()
    module, inputs = hf_models.make("gpt2")
    fused = import_module(module, inputs, check=False).graph
    tp = {"degrees": {"tp": args.devices}}
    for label, graph, options in (("fused tp", fused, tp), ("fused tp joint", fused, {**tp, "baselines": False}),
                                  ("fused free", fused, {}), ("three projections tp", three_projections(fused), tp)):
        print(json.dumps(row(label, graph, args.devices, args.machine, **options)), flush=True)


if __name__ == "__main__":
    main()
