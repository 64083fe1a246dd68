"""Built-in example graphs, sized by keyword (`parsat optimize mlp --set batch=64`).

Each example is a function of integer sizes with documented defaults; the
registry `EXAMPLES` maps the name a user types to it. They are plain graphs
built with `GraphBuilder`, so they are validated like any user graph.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Mapping

from parsat.dsl.library import Library
from parsat.ir.budget import GraphBudget
from parsat.ir.graph import Graph, GraphBuilder, GraphError, Tensor


def mlp(batch: int = 128, d_in: int = 784, d_hidden: int = 512, d_out: int = 10,
        library: Library | None = None, budget: GraphBudget | None = None) -> Graph:
    """The 2-layer MLP of Unity's Fig. 1: relu(x @ w1) @ w2, no biases."""
    g = GraphBuilder(library, name="mlp", budget=budget)
    x = g.input("x", [batch, d_in])
    w1 = g.weight("w1", [d_in, d_hidden])
    w2 = g.weight("w2", [d_hidden, d_out])
    h = g.op("relu", g.op("matmul", x, w1, name="mm1"), name="act")
    g.output(g.op("matmul", h, w2, name="mm2"))
    return g.build()


def branches(batch: int = 128, d_in: int = 784, d_hidden: int = 512, d_out: int = 10,
             library: Library | None = None, budget: GraphBudget | None = None) -> Graph:
    """An MLP with two parallel hidden branches joined by concat."""
    g = GraphBuilder(library, name="branches", budget=budget)
    x = g.input("x", [batch, d_in])
    wa = g.weight("wa", [d_in, d_hidden])
    wb = g.weight("wb", [d_in, d_hidden])
    wo = g.weight("wo", [2 * d_hidden, d_out])
    a = g.op("relu", g.op("matmul", x, wa, name="mm_a"), name="act_a")
    b = g.op("relu", g.op("matmul", x, wb, name="mm_b"), name="act_b")
    joined = g.op("concat", a, b, dim=1, name="join")
    g.output(g.op("matmul", joined, wo, name="mm_out"))
    return g.build()


def _encoder_block(g: GraphBuilder, x: Tensor, prefix: str, batch: int, seq: int, hidden: int, heads: int,
                   ffn: int) -> Tensor:
    """Post-LN BERT encoder block: self-attention, residual, layernorm, MLP, residual, layernorm."""
    if hidden % heads:
        raise GraphError(f"hidden size {hidden} is not divisible by {heads} heads")
    dh = hidden // heads

    def w(name: str, shape: list[int]) -> Tensor:
        return g.weight(f"{prefix}{name}", shape)

    def op(kind: str, *args, name: str, **attrs) -> Tensor:
        return g.op(kind, *args, name=f"{prefix}{name}", **attrs)

    def heads_of(t: Tensor, tag: str) -> Tensor:  # [b, s, d] -> [b, heads, s, dh]
        return op("transpose", op("unflatten", t, dim=2, k=dh, name=f"{tag}_split"), d0=1, d1=2, name=f"{tag}_heads")

    q = heads_of(op("linear", x, w("wq", [hidden, hidden]), w("bq", [hidden]), name="q"), "q")
    k = heads_of(op("linear", x, w("wk", [hidden, hidden]), w("bk", [hidden]), name="k"), "k")
    v = heads_of(op("linear", x, w("wv", [hidden, hidden]), w("bv", [hidden]), name="v"), "v")
    kt = op("transpose", k, d0=2, d1=3, name="kT")
    scores = op("scale", op("bmm", q, kt, name="scores"), c=1.0 / dh ** 0.5, name="scaled")
    probs = op("softmax", scores, dim=3, name="probs")
    ctx = op("bmm", probs, v, name="ctx")
    merged = op("flatten", op("transpose", ctx, d0=1, d1=2, name="ctx_t"), dim=2, name="ctx_merged")
    attn = op("linear", merged, w("wo", [hidden, hidden]), w("bo", [hidden]), name="attn_out")
    x1 = op("layernorm", op("add", x, attn, name="res1"), w("ln1_g", [hidden]), w("ln1_b", [hidden]), eps=1e-12,
            name="ln1")
    up = op("gelu", op("linear", x1, w("w1", [hidden, ffn]), w("b1", [ffn]), name="ffn_up"), name="ffn_act")
    down = op("linear", up, w("w2", [ffn, hidden]), w("b2", [hidden]), name="ffn_down")
    return op("layernorm", op("add", x1, down, name="res2"), w("ln2_g", [hidden]), w("ln2_b", [hidden]), eps=1e-12,
              name="ln2")


def transformer(batch: int = 8, seq: int = 512, hidden: int = 1024, heads: int = 16, ffn: int = 4096,
                library: Library | None = None, budget: GraphBudget | None = None) -> Graph:
    """One BERT-Large-sized encoder block (hidden 1024, 16 heads, FFN 4096)."""
    return stack(1, batch, seq, hidden, heads, ffn, library, name="transformer", budget=budget)


def stack(blocks: int = 24, batch: int = 8, seq: int = 512, hidden: int = 1024, heads: int = 16, ffn: int = 4096,
          library: Library | None = None, name: str = "stack", budget: GraphBudget | None = None) -> Graph:
    """`blocks` encoder blocks in sequence (24 = BERT-Large)."""
    if blocks < 1:
        raise GraphError("a stack needs at least one block")
    g = GraphBuilder(library, name=name, budget=budget)
    x = g.input("x", [batch, seq, hidden])
    for index in range(blocks):
        x = _encoder_block(g, x, f"b{index}_" if blocks > 1 else "", batch, seq, hidden, heads, ffn)
    g.output(x)
    return g.build()


@dataclass(frozen=True)
class Example:
    name: str
    build: Callable[..., Graph]
    summary: str

    def defaults(self) -> dict[str, int]:
        sig = inspect.signature(self.build)
        return {k: p.default for k, p in sig.parameters.items()
                if isinstance(p.default, int) and not isinstance(p.default, bool)}


EXAMPLES: Mapping[str, Example] = {
    "mlp": Example("mlp", mlp, "2-layer MLP, relu(x @ w1) @ w2 (Unity Fig. 1)"),
    "transformer": Example("transformer", transformer, "one BERT-Large encoder block"),
    "stack": Example("stack", stack, "a stack of BERT-Large encoder blocks"),
    "branches": Example("branches", branches, "MLP with two parallel branches joined by concat"),
}


def build_example(name: str, sizes: Mapping[str, int] | None = None, library: Library | None = None,
                  budget: GraphBudget | None = None) -> Graph:
    """An example by name with some sizes overridden; unknown names and keys are clear errors.

    Sizes are checked here (positive) and by the builder (at most 2**53 elements per tensor, and the
    `budget`'s tensor count and deadline while it builds)."""
    example = EXAMPLES.get(name)
    if example is None:
        raise GraphError(f"unknown example '{name}' (examples: {', '.join(EXAMPLES)})")
    sizes = dict(sizes or {})
    unknown = set(sizes) - set(example.defaults())
    if unknown:
        raise GraphError(f"example '{name}' has no size {', '.join(sorted(unknown))} "
                         f"(sizes: {', '.join(f'{k}={v}' for k, v in example.defaults().items())})")
    for key, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise GraphError(f"size {key} must be a positive integer, got {value!r}")
    return example.build(**sizes, library=library, budget=budget)
