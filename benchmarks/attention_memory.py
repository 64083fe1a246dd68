"""Attention's activation memory under the cost model, fused against written out, sequence 1024 to 8192.

    .venv/bin/python benchmarks/attention_memory.py [--seq 1024 2048 4096 8192] [--batch 1] [--hidden 2048]
        [--heads 16] [--machine h100x8] [--markdown] [--bert]

`--bert`: the built-in `bert` (one post-LN encoder block with its embeddings and masked-LM head, at BERT-Large's
width with `--hidden 1024 --heads 16`) instead of a GPT attention block: its bidirectional attention fused
(`attention`, what `bert` builds) or written out (`unfused_attention` 1: bmm, scale, softmax, bmm; what
`fuse_attention` rewrites into the fused one), the block's figure then the whole model's activations.

One attention block of a GPT (GPT-3 1.3B's width by default: hidden 2048,
16 heads of 128): x [b, s, hidden] -> q, k, v projections cut into heads ->
causal attention -> heads merged -> output projection, on one device of
`--machine` (bf16 on the GPU presets). Causal attention is built two ways:

* fused: `attention_causal` (what `parsat.ir.models` gpt and llama build and
  the importer makes of a causal `scaled_dot_product_attention`);
* written out: transpose(k), bmm, scale, softmax_causal, bmm (what they
  built before, and what `fuse_causal_attention` rewrites into the fused one).

For each sequence length it prints what the cost model keeps for backward:
the attention core's activation bytes (`cost.model.compute_cost`, per node:
its output piece and what a fused kernel keeps beside it), and the whole
block's activations at the end of forward in the simulated step
(`cost.pcg_tasks.simulate_pcg`, as `profile_for(machine)` runs it: what is
allocated then, less the weights and optimizer state), each also per token
of the micro-batch: constant per token means linear in s. Results and the
command: benchmarks/attention_memory.md.
"""

from __future__ import annotations

import argparse
import sys

from parsat.cost.model import compute_cost
from parsat.cost.pcg_tasks import profile_for, simulate_pcg
from parsat.dsl.library import Library, load_library
from parsat.ir.graph import Graph, GraphBuilder, instance_for
from parsat.ir.machine import Machine
from parsat.ir.pcg import PCG, Degrees, PNode

CORE = ("kT", "scores", "scaled", "probs", "ctx")   # the attention core's nodes, fused (ctx) or written out


def bert_graph(library: Library, fused: bool, batch: int, seq: int, hidden: int, heads: int) -> Graph:
    """The built-in bert with one encoder block, its attention fused or written out (`--bert`)."""
    from parsat.ir.models import bert

    return bert(blocks=1, batch=batch, seq=seq, hidden=hidden, heads=heads, unfused_attention=int(not fused),
                library=library)


def attention_block(library: Library, fused: bool, batch: int, seq: int, hidden: int, heads: int) -> Graph:
    """One attention block, causal attention fused or written out (the module docstring)."""
    dh = hidden // heads
    g = GraphBuilder(library, name="attention")
    x = g.input("x", [batch, seq, hidden])

    def heads_of(tag: str):
        t = g.op("linear_nobias", x, g.weight(f"w{tag}", [hidden, hidden]), name=tag)
        return g.op("transpose", g.op("unflatten", t, dim=2, k=dh, name=f"{tag}_split"), d0=1, d1=2,
                    name=f"{tag}_heads")

    q, k, v = heads_of("q"), heads_of("k"), heads_of("v")
    if fused:
        ctx = g.op("attention_causal", q, k, v, c=dh ** -0.5, name="ctx")
    else:
        scores = g.op("bmm", q, g.op("transpose", k, d0=2, d1=3, name="kT"), name="scores")
        probs = g.op("softmax_causal", g.op("scale", scores, c=dh ** -0.5, name="scaled"), name="probs")
        ctx = g.op("bmm", probs, v, name="ctx")
    merged = g.op("flatten", g.op("transpose", ctx, d0=1, d1=2, name="ctx_t"), dim=2, name="ctx_merged")
    g.output(g.op("linear_nobias", merged, g.weight("wo", [hidden, hidden]), name="out"))
    return g.build()


def one_device_pcg(graph: Graph) -> PCG:
    """The graph as a PCG on one device: every value whole, no parallel operator."""
    shapes, ids, nodes = graph.shapes(), {}, []
    for leaf in graph.leaves:
        ids[leaf.name] = len(nodes)
        nodes.append(PNode(len(nodes), "leaf", leaf.name, (), (), leaf.shape, Degrees.whole(len(leaf.shape)),
                           role=leaf.role, origin=leaf.name))
    for node in graph.nodes:
        ids[node.name] = len(nodes)
        shape = shapes[node.name]
        nodes.append(PNode(len(nodes), "op", node.op, tuple(ids[i] for i in node.inputs), tuple(node.attrs), shape,
                           Degrees.whole(len(shape)), origin=node.name))
    return PCG(tuple(nodes), tuple(ids[o] for o in graph.outputs), tuple(graph.outputs))


def core_bytes(graph: Graph, library: Library, machine: Machine) -> int:
    """What the cost model keeps for backward of the attention core's nodes (`compute_cost`'s activation): those
    named in `CORE`, under a block's prefix ("b0_") or none (the heads' and the merge's views are the block's)."""
    shapes, total = graph.shapes(), 0
    for node in graph.nodes:
        if node.name.split("_", 1)[-1] not in CORE and node.name not in CORE:
            continue
        inputs = [shapes[i] for i in node.inputs]
        instance = instance_for(library.ops[node.op], inputs, dict(node.attrs))
        whole = [Degrees.whole(len(s)) for s in inputs]
        cost = compute_cost(instance, whole, Degrees.whole(len(shapes[node.name])), machine, [False] * len(inputs))
        total += cost.activation_bytes
    return total


def block_activation_bytes(graph: Graph, library: Library, machine: Machine) -> int:
    """The block's activations at the end of forward in the simulated step (less weights and optimizer state)."""
    prediction = simulate_pcg(one_device_pcg(graph), library, machine, profile_for(machine))
    end = prediction.end_of_forward
    return prediction.result.memory_after(end, prediction.resident_bytes) - prediction.resident_bytes


def rows(args, library: Library, machine: Machine) -> list[dict]:
    out = []
    for seq in args.seq:
        row = {"seq": seq, "tokens": args.batch * seq}
        for label, fused in (("fused", True), ("written_out", False)):
            build = bert_graph if args.bert else attention_block
            graph = build(library, fused, args.batch, seq, args.hidden, args.heads)
            row[f"{label}_core"] = core_bytes(graph, library, machine)
            row[f"{label}_block"] = block_activation_bytes(graph, library, machine)
        out.append(row)
    return out


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:,.1f}"


def print_rows(table: list[dict], markdown: bool) -> None:
    head = ["seq", "fused core MiB", "per token B", "fused block MiB", "per token B",
            "written-out core MiB", "per token B", "written-out block MiB", "per token B"]
    cells = [[str(r["seq"])] + [x for key in ("fused_core", "fused_block", "written_out_core", "written_out_block")
                                for x in (_mib(r[key]), f"{r[key] / r['tokens']:,.0f}")] for r in table]
    if markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for c in cells:
            print("| " + " | ".join(c) + " |")
        return
    print("  ".join(f"{h:>14}" for h in head))
    for c in cells:
        print("  ".join(f"{x:>14}" for x in c))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--machine", default="h100x8")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--bert", action="store_true", help="the built-in bert (one block) instead of a GPT block")
    args = parser.parse_args(argv)
    library, machine = load_library()[0], Machine.resolve(args.machine)
    what = "bert, one encoder block" if args.bert else "one attention block"
    print(f"{what}: batch {args.batch}, hidden {args.hidden}, {args.heads} heads, machine "
          f"{machine.name} ({machine.precision}); activation bytes kept for backward")
    print_rows(rows(args, library, machine), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
