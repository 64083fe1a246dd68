"""Built-in example graphs, sized by keyword (`parsat optimize mlp --set batch=64`).

Each example is a function of integer sizes with documented defaults; the
registry `EXAMPLES` maps the name a user types to it. They are plain graphs
built with `GraphBuilder`, so they are validated like any user graph.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Mapping

from parsat.dsl.bounds import SIZE_LIMITS, BoundError, size_bound
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



def _mse_loss(g: GraphBuilder, y: Tensor, rows: int, cols: int) -> Tensor:
    """Mean squared error of `y` [rows, cols] against the input `target`: the graph's scalar output.

    The objective of a regression head, or of distilling a teacher's hidden
    states: sum((y - target)^2) / (rows * cols).
    """
    err = g.op("sub", y, g.input("target", [rows, cols]), name="err")
    squares = g.op("mul", err, err, name="sq")
    total = g.op("reduce_sum", g.op("reduce_sum", squares, dim=1, name="sq_rows"), dim=0, name="sq_sum")
    return g.op("scale", total, c=1.0 / (rows * cols), name="loss")


def experts(experts: int = 4, tokens: int = 8192, hidden: int = 1024, ffn: int = 4096,
            library: Library | None = None, budget: GraphBudget | None = None) -> Graph:
    """A dense mixture of expert FFNs: every token goes through every expert, the outputs are summed.

    x [tokens, hidden] -> sum over experts of relu(x @ w1_e) @ w2_e, then
    the residual and a layernorm, trained against a target with the mean
    squared error (`_mse_loss`). The defaults are BERT-Large's FFN
    (hidden 1024, ffn 4096) and 8,192 tokens (16 sequences of 512).

    Why it is an example (benchmarks/joint_results.md): fusing the experts
    into one FFN over concatenated weights (`matmul_fuse_shared_input`,
    `matmul_merge_contraction`) costs weight concatenations that one device
    does not win back at this token count, so the sequential baseline keeps
    the experts apart; on several nodes the fused FFN's hidden dim splits
    over the node axis, one expert per node, and one all-reduce sums the
    experts' partial outputs where separate experts need one each.
    """
    if experts < 1:
        raise GraphError("a mixture needs at least one expert")
    g = GraphBuilder(library, name="experts", budget=budget)
    x = g.input("x", [tokens, hidden])
    total = None
    for e in range(experts):
        up = g.op("matmul", x, g.weight(f"e{e}_w1", [hidden, ffn]), name=f"e{e}_up")
        out = g.op("matmul", g.op("relu", up, name=f"e{e}_act"), g.weight(f"e{e}_w2", [ffn, hidden]), name=f"e{e}_down")
        total = out if total is None else g.op("add", total, out, name=f"sum{e}")
    y = g.op("layernorm", g.op("add", x, total, name="res"), g.weight("ln_g", [hidden]), g.weight("ln_b", [hidden]),
             eps=1e-5, name="ln")
    g.output(_mse_loss(g, y, tokens, hidden))
    return g.build()


def moe(num_experts: int = 8, top: int = 2, tokens: int = 4096, hidden: int = 1024, ffn: int = 4096,
        library: Library | None = None, budget: GraphBudget | None = None) -> Graph:
    """A routed mixture of experts, dropless: each token goes to its `top` experts, none is dropped.

    The router's softmax picks each token's top experts (`topk_onehot`, as
    `torch.topk`); the token's output is the sum of those experts' FFNs
    (relu(x @ w1_e) @ w2_e) weighted by their router probabilities (Switch /
    GShard's gates, not renormalized over the chosen ones), then the
    residual, a layernorm and the mean squared error (`_mse_loss`). It is
    written as GShard's dispatch and combine with the capacity of every
    expert equal to all tokens, so no token is ever dropped (Megablocks'
    and torchtitan's dropless semantics) and every shape is static: the
    tokens are dispatched as [experts, tokens, hidden] (zero rows for the
    experts a token did not choose), the experts run as one batched
    matmul over the experts dim, and the combine sums the experts' rows
    weighted by the gates. The price of static shapes: each expert
    multiplies all token rows, zero or not, `experts / top` times the
    FLOPs of a sparse (grouped GEMM) implementation, and the cost model
    prices it so.

    Why it is an example (docs/MODELS.md): it is where expert parallelism
    (`bmm_expert_parallel`: the experts' weights stored split on the
    experts dim, tokens moved by an all-to-all to the rank that holds
    their expert and back) competes with data parallelism (every rank
    holds every expert, the weights' gradients all-reduced).
    """
    experts = num_experts   # a dim here, not a count of separately built parts (`dsl.bounds.SIZE_LIMITS`)
    if not 1 <= top <= experts:
        raise GraphError(f"a mixture routes each token to 1 <= top <= num_experts experts, got top {top} of "
                         f"{experts}")
    g = GraphBuilder(library, name="moe", budget=budget)
    x = g.input("x", [tokens, hidden])
    probs = g.op("softmax", g.op("matmul", x, g.weight("router", [hidden, experts]), name="logits"), dim=1,
                 name="probs")
    chosen = g.op("reduce_sum", g.op("topk_onehot", probs, k=top, name="topk"), dim=1, name="chosen")
    gates = g.op("transpose", g.op("mul", probs, chosen, name="gates"), d0=0, d1=1, name="gates_t")
    spread = g.op("broadcast", x, dim=0, n=experts, name="to_experts")
    dispatched = g.op("mul_bcast_dim", spread, g.op("transpose", chosen, d0=0, d1=1, name="chosen_t"), dim=2,
                      name="dispatch")
    up = g.op("relu", g.op("bmm", dispatched, g.weight("w1", [experts, hidden, ffn]), name="expert_up"),
              name="expert_act")
    down = g.op("bmm", up, g.weight("w2", [experts, ffn, hidden]), name="expert_down")
    mixed = g.op("reduce_sum", g.op("mul_bcast_dim", down, gates, dim=2, name="weighted"), dim=0, name="combine")
    y = g.op("layernorm", g.op("add", x, mixed, name="res"), g.weight("ln_g", [hidden]), g.weight("ln_b", [hidden]),
             eps=1e-5, name="ln")
    g.output(_mse_loss(g, y, tokens, hidden))
    return g.build()


def factorized(tokens: int = 8192, hidden: int = 4096, rank: int = 2816, library: Library | None = None,
               budget: GraphBudget | None = None) -> Graph:
    """An MLP whose second layer is trained in factored form: relu((relu(x @ w0) @ u) @ v), u [hidden, rank].

    A linear layer written as a product of two matrices with nothing in
    between (linear over-parameterization, e.g. ExpandNets, Guo et al.
    2020, merged into one matrix for inference), trained against a target
    with the mean squared error (`_mse_loss`).

    Why it is an example (benchmarks/joint_results.md): one device computes
    h @ (u @ v) with fewer FLOPs than (h @ u) @ v when rank > tokens *
    hidden / (2 * tokens - hidden) (2,731 at the defaults), so the
    sequential baseline reassociates (`matmul_assoc_right`); split over
    the contraction, the partial sums the devices must add are then
    [tokens, hidden] wide instead of [tokens, rank], and the joint search
    keeps the product as written. The band of ranks where the two disagree
    is narrow (about 2,731 to 3,500 at these sizes).
    """
    g = GraphBuilder(library, name="factorized", budget=budget)
    x = g.input("x", [tokens, hidden])
    h = g.op("relu", g.op("matmul", x, g.weight("w0", [hidden, hidden]), name="mm0"), name="act0")
    low = g.op("matmul", h, g.weight("u", [hidden, rank]), name="down")
    y = g.op("relu", g.op("matmul", low, g.weight("v", [rank, hidden]), name="up"), name="act1")
    g.output(_mse_loss(g, y, tokens, hidden))
    return g.build()

class _Scope:
    """One block's names: every weight and node it makes is prefixed (`b3_wq`), so blocks never collide."""

    def __init__(self, g: GraphBuilder, prefix: str):
        self.g, self.prefix = g, prefix

    def w(self, name: str, shape: list[int]) -> Tensor:
        return self.g.weight(f"{self.prefix}{name}", shape)

    def op(self, kind: str, *args, name: str, **attrs) -> Tensor:
        return self.g.op(kind, *args, name=f"{self.prefix}{name}", **attrs)

    def heads(self, t: Tensor, dh: int, tag: str) -> Tensor:
        """[b, s, n * dh] -> [b, n, s, dh]: a projection cut into heads (torch's view + transpose)."""
        return self.op("transpose", self.op("unflatten", t, dim=2, k=dh, name=f"{tag}_split"), d0=1, d1=2,
                       name=f"{tag}_heads")

    def attention(self, q: Tensor, k: Tensor, v: Tensor, dh: int, causal: bool = False, fused: bool = True
                  ) -> Tensor:
        """softmax(q k^T / sqrt(dh)) v on [b, n, s, dh] heads, heads merged back: [b, s, n * dh].

        Causal attention is the fused operator `attention_causal`, as GPT and
        LLaMA training runs it (FlashAttention, `scaled_dot_product_attention(...,
        is_causal=True)`): the mask is made from positions, so no [b, n, s, s]
        mask is a graph input and attention splits by heads, and no [b, n, s, s]
        scores are stored, so the cost model keeps O(b s h) for its backward.
        Bidirectional attention (BERT, ViT) is the fused operator `attention`, as
        BERT training runs it (`scaled_dot_product_attention` without a mask).
        With `fused` False either is written out, as runtimes before FlashAttention
        computed it (bmm, scale, `softmax_causal` or `softmax`, bmm: the [b, n, s, s]
        scores and probabilities materialised; `gpt`'s and `bert`'s
        `unfused_attention`, and the `stack` / `transformer` examples' blocks).
        """
        if fused:
            ctx = self.op("attention_causal" if causal else "attention", q, k, v, c=1.0 / dh ** 0.5, name="ctx")
        else:
            kt = self.op("transpose", k, d0=2, d1=3, name="kT")
            scores = self.op("scale", self.op("bmm", q, kt, name="scores"), c=1.0 / dh ** 0.5, name="scaled")
            probs = self.op("softmax_causal" if causal else "softmax", scores, **({} if causal else {"dim": 3}),
                            name="probs")
            ctx = self.op("bmm", probs, v, name="ctx")
        return self.op("flatten", self.op("transpose", ctx, d0=1, d1=2, name="ctx_t"), dim=2, name="ctx_merged")


def _head_size(hidden: int, heads: int) -> int:
    if hidden % heads:
        raise GraphError(f"hidden size {hidden} is not divisible by {heads} heads")
    return hidden // heads


def _encoder_block(g: GraphBuilder, x: Tensor, prefix: str, batch: int, seq: int, hidden: int, heads: int,
                   ffn: int, fused_attention: bool = False) -> Tensor:
    """Post-LN BERT encoder block: self-attention (fused, or written out as the `stack` example keeps it),
    residual, layernorm, MLP, residual, layernorm."""
    dh = _head_size(hidden, heads)
    s = _Scope(g, prefix)
    q = s.heads(s.op("linear", x, s.w("wq", [hidden, hidden]), s.w("bq", [hidden]), name="q"), dh, "q")
    k = s.heads(s.op("linear", x, s.w("wk", [hidden, hidden]), s.w("bk", [hidden]), name="k"), dh, "k")
    v = s.heads(s.op("linear", x, s.w("wv", [hidden, hidden]), s.w("bv", [hidden]), name="v"), dh, "v")
    merged = s.attention(q, k, v, dh, fused=fused_attention)
    attn = s.op("linear", merged, s.w("wo", [hidden, hidden]), s.w("bo", [hidden]), name="attn_out")
    x1 = s.op("layernorm", s.op("add", x, attn, name="res1"), s.w("ln1_g", [hidden]), s.w("ln1_b", [hidden]),
              eps=1e-12, name="ln1")
    up = s.op("gelu", s.op("linear", x1, s.w("w1", [hidden, ffn]), s.w("b1", [ffn]), name="ffn_up"), name="ffn_act")
    down = s.op("linear", up, s.w("w2", [ffn, hidden]), s.w("b2", [hidden]), name="ffn_down")
    return s.op("layernorm", s.op("add", x1, down, name="res2"), s.w("ln2_g", [hidden]), s.w("ln2_b", [hidden]),
                eps=1e-12, name="ln2")


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


# ---------------------------------------------------------------- language models
#
# Sizes people train (GPT-3, LLaMA, Llama 2, BERT), written the way
# `parsat.importer` maps the Hugging Face models onto the library, so
# the parallel rules of those operators apply to them: token ids and
# targets one-hot over the vocabulary (vocabulary-parallel embedding and
# cross-entropy), heads as a dim of their own (heads-parallel attention),
# projections as `linear`/`linear_nobias` (column- and row-parallel),
# norms over the last dim only (sequence-parallel). docs/MODELS.md gives
# each configuration's source and its parameter count against the published one.


def _lm_loss(g: GraphBuilder, logits: Tensor, rows: int, vocab: int, counted: int) -> Tensor:
    """Mean cross-entropy of `logits` [b, s, vocab] against one-hot targets: the graph's scalar output.

    As the importer maps torch's `cross_entropy`: logits as rows [b * s,
    vocab], `logsumexp` per row, `nll_sum` of the one-hot input `targets` (a
    row that is all zero, a position without a target, adds nothing), then
    the mean over the `counted` targets: `scale` by 1 / counted. The count is
    fixed by the model here (every position for a causal LM, as Megatron-LM
    averages over all tokens; BERT's masked positions per sequence), where
    the importer, not knowing it, multiplies by an input (`inv_count`).
    """
    flat = g.op("flatten", logits, dim=0, name="logits_rows")
    lse = g.op("logsumexp", flat, name="lse")
    total = g.op("nll_sum", flat, lse, g.input("targets", [rows, vocab]), name="nll")
    return g.op("scale", total, c=1.0 / counted, name="loss")


def _fused_qkv(s: _Scope, a: Tensor, hidden: int, heads: int, dh: int) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as one product, laid out per head as Megatron-LM lays it out: three [b, n, s, dh] heads.

    One weight `wqkv` [hidden, 3 * hidden] and bias `bqkv` [3 * hidden]; the
    product [b, s, 3 * hidden] is unflattened per head into [b, s, n, 3 * dh]
    and q, k, v are the three `dh`-wide slices of the last dim. This is
    Megatron-LM's `query_key_value`, one ColumnParallelLinear of [h, 3h]
    (NVIDIA/Megatron-LM a8d172b, 2021-04-28, the SC'21 code:
    megatron/model/transformer.py lines 142-146, then lines 197-209:
    `mixed_x_layer.view(... np, 3 * hn)` and `split_tensor_along_last_dim(.., 3)`;
    Megatron-Core d98e8a6, megatron/core/transformer/attention.py
    `get_query_key_value_tensors`: `linear_qkv`, the view [sq, b, ng, (np/ng + 2) hn]
    and a split of [hn, hn, hn] along dim 3 when every head is its own group).
    Why per head and not [q | k | v]: a column split of the product then
    keeps whole heads with their own q, k and v, so tensor parallelism is
    the product split on its output dim (column-parallel) followed by
    attention split by heads, with no collective between them (HF GPT-2's
    `c_attn` fuses too but lays out [q | k | v], whose column split mixes
    heads: docs/TORCH_NATIVE.md). Why fused: the GEMM curve prices one
    [h, 3h] product faster than three [h, h] ones, as the runs the
    published-runs benchmark pins ran it (benchmarks/published_runs.md,
    2026-12-03 (night)).
    """
    mixed = s.op("linear", a, s.w("wqkv", [hidden, 3 * hidden]), s.w("bqkv", [3 * hidden]), name="qkv")
    per_head = s.heads(mixed, 3 * dh, "qkv")
    q, k, v = (s.op("split", per_head, dim=3, start=i * dh, size=dh, name=tag) for i, tag in enumerate("qkv"))
    return q, k, v


def _gpt_block(g: GraphBuilder, x: Tensor, prefix: str, hidden: int, heads: int, ffn: int,
               fused_attention: bool = True) -> Tensor:
    """Pre-LN decoder block (GPT-2/GPT-3): x + attn(ln(x)), then + mlp(ln(.)), causal multi-head attention with
    q, k, v one product (`_fused_qkv`), fused or written out (`gpt`'s `unfused_attention`)."""
    dh = hidden // heads
    s = _Scope(g, prefix)
    a = s.op("layernorm", x, s.w("ln1_g", [hidden]), s.w("ln1_b", [hidden]), eps=1e-5, name="ln1")
    q, k, v = _fused_qkv(s, a, hidden, heads, dh)
    merged = s.attention(q, k, v, dh, causal=True, fused=fused_attention)
    attn = s.op("linear", merged, s.w("wo", [hidden, hidden]), s.w("bo", [hidden]), name="attn_out")
    x = s.op("add", x, attn, name="res1")
    m = s.op("layernorm", x, s.w("ln2_g", [hidden]), s.w("ln2_b", [hidden]), eps=1e-5, name="ln2")
    up = s.op("gelu_tanh", s.op("linear", m, s.w("w1", [hidden, ffn]), s.w("b1", [ffn]), name="ffn_up"),
              name="ffn_act")
    down = s.op("linear", up, s.w("w2", [ffn, hidden]), s.w("b2", [hidden]), name="ffn_down")
    return s.op("add", x, down, name="res2")


def gpt(blocks: int = 12, batch: int = 512, seq: int = 2048, hidden: int = 768, heads: int = 12,
        ffn: int | None = None, vocab: int = 51200, unfused_attention: int = 0, library: Library | None = None,
        name: str = "gpt", budget: GraphBudget | None = None) -> Graph:
    """A GPT-2/GPT-3 decoder with its language-modelling loss; the defaults are GPT-3 Small (125M).

    Token embedding `wte` [vocab, hidden] (ids one-hot) plus a learned position
    table `wpe` [seq, hidden] (a full sequence reads every position once, in
    order, so the lookup is the table itself: `add_bcast`); `blocks` pre-LN
    blocks (layernorm, causal multi-head attention whose q, k, v are one
    product `wqkv` laid out per head as Megatron-LM's (`_fused_qkv`),
    residual, layernorm, MLP of `ffn` = 4 x hidden with the tanh GELU,
    residual); a final layernorm;
    the LM head tied to the token embedding: the same weight leaf read a
    second time through `transpose`, as the importer reads HF GPT-2's tied
    `lm_head`; then the mean cross-entropy over the vocabulary.

    `unfused_attention` 0 (the default) computes attention as the fused
    `attention_causal` (FlashAttention, 2022, and the SDPA kernels after it); 1
    writes it out as Megatron-LM of 2021 ran it before those existed: the
    [b, n, s, s] scores of `bmm(q, k^T)`, scaled, a causal softmax, and `bmm` with v
    (NVIDIA/Megatron-LM a8d172b, the SC'21 code: megatron/model/transformer.py
    lines 167-332, `torch.baddbmm` of the whole scores, `FusedScaleMaskSoftmax`
    of megatron/model/fused_softmax.py, `torch.bmm`). The search's
    `fuse_causal_attention` rewrites that form into the fused operator, so a plan
    pinned to the 2021 runtime leaves that rule out (`without_rules`).
    No dropout (GPT-3's paper states none; it would add mask inputs, `dropout_masked`).
    Sizes: Brown et al. 2020, "Language Models are Few-Shot Learners",
    Table 2.1 (n_layers, d_model, n_heads, d_head = 128 for 1.3B-175B;
    context 2048; the GPT-2 BPE vocabulary of 50,257 tokens), the vocabulary
    padded to 51,200 as Megatron-LM does (Narayanan et al. 2021, SC'21,
    section 5.1) so that it divides among devices.
    """
    ffn = 4 * hidden if ffn is None else ffn
    _head_size(hidden, heads)
    if unfused_attention not in (0, 1):
        raise GraphError(f"unfused_attention is 0 (fused) or 1 (written out), got {unfused_attention}")
    g = GraphBuilder(library, name=name, budget=budget)
    wte = g.weight("wte", [vocab, hidden])
    tokens = g.op("embedding", g.input("ids", [batch, seq, vocab]), wte, name="tok_emb")
    x = g.op("add_bcast", tokens, g.weight("wpe", [seq, hidden]), name="emb")
    for index in range(blocks):
        x = _gpt_block(g, x, f"b{index}_", hidden, heads, ffn, not unfused_attention)
    x = g.op("layernorm", x, g.weight("lnf_g", [hidden]), g.weight("lnf_b", [hidden]), eps=1e-5, name="lnf")
    logits = g.op("linear_nobias", x, g.op("transpose", wte, d0=0, d1=1, name="wte_t"), name="logits")
    g.output(_lm_loss(g, logits, batch * seq, vocab, batch * seq))
    return g.build()


def llama_ffn(hidden: int, multiplier: float = 1.0, multiple_of: int = 256) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4 x hidden, times `multiplier`, rounded up to `multiple_of`.

    Meta's reference code (`llama/model.py`, FeedForward): 11,008 for hidden
    4,096 (LLaMA-7B); Llama 2 70B uses multiplier 1.3 and multiple_of 4,096: 28,672.
    """
    width = int(multiplier * int(2 * 4 * hidden / 3))
    return multiple_of * -(-width // multiple_of)


def _rotary(s: _Scope, t: Tensor, cos: Tensor, sin: Tensor, dh: int, tag: str) -> Tensor:
    """t * cos + rotate_half(t) * sin on [b, n, s, dh] heads, as HF LLaMA writes it and the importer maps it:
    rotate_half(t) = concat(-t[..., dh/2:], t[..., :dh/2]); the tables [s, dh] are graph inputs."""
    half = dh // 2
    lo = s.op("split", t, dim=3, start=0, size=half, name=f"{tag}_lo")
    hi = s.op("split", t, dim=3, start=half, size=half, name=f"{tag}_hi")
    rotated = s.op("concat", s.op("neg", hi, name=f"{tag}_neg"), lo, dim=3, name=f"{tag}_rot")
    return s.op("add", s.op("mul_bcast", t, cos, name=f"{tag}_cos"), s.op("mul_bcast", rotated, sin,
                                                                            name=f"{tag}_sin"), name=f"{tag}_rope")


def _llama_block(g: GraphBuilder, x: Tensor, cos: Tensor, sin: Tensor, prefix: str, hidden: int,
                 heads: int, kv_heads: int, ffn: int) -> Tensor:
    """Pre-norm LLaMA block: RMSNorm, grouped-query attention with rotary positions, residual, RMSNorm,
    SwiGLU MLP (silu(x w1) * (x w3)) w2, residual; no biases."""
    dh = hidden // heads
    s = _Scope(g, prefix)
    a = s.op("rmsnorm", x, s.w("attn_norm", [hidden]), eps=1e-5, name="attn_rms")
    q = s.heads(s.op("linear_nobias", a, s.w("wq", [hidden, heads * dh]), name="q"), dh, "q")
    k = s.heads(s.op("linear_nobias", a, s.w("wk", [hidden, kv_heads * dh]), name="k"), dh, "k")
    v = s.heads(s.op("linear_nobias", a, s.w("wv", [hidden, kv_heads * dh]), name="v"), dh, "v")
    q, k = _rotary(s, q, cos, sin, dh, "q"), _rotary(s, k, cos, sin, dh, "k")
    if kv_heads != heads:  # each key/value head serves heads / kv_heads query heads (torch's expand + reshape)
        group = heads // kv_heads
        k = s.op("flatten", s.op("broadcast", k, dim=2, n=group, name="k_expand"), dim=1, name="k_shared")
        v = s.op("flatten", s.op("broadcast", v, dim=2, n=group, name="v_expand"), dim=1, name="v_shared")
    merged = s.attention(q, k, v, dh, causal=True)
    x = s.op("add", x, s.op("linear_nobias", merged, s.w("wo", [heads * dh, hidden]), name="attn_out"), name="res1")
    m = s.op("rmsnorm", x, s.w("ffn_norm", [hidden]), eps=1e-5, name="ffn_rms")
    gate = s.op("silu", s.op("linear_nobias", m, s.w("w1", [hidden, ffn]), name="ffn_gate"), name="ffn_act")
    up = s.op("linear_nobias", m, s.w("w3", [hidden, ffn]), name="ffn_up")
    down = s.op("linear_nobias", s.op("mul", gate, up, name="ffn_glu"), s.w("w2", [ffn, hidden]), name="ffn_down")
    return s.op("add", x, down, name="res2")


def llama(blocks: int = 32, batch: int = 512, seq: int = 2048, hidden: int = 4096, heads: int = 32,
          kv_heads: int | None = None, ffn: int | None = None, vocab: int = 32000, library: Library | None = None,
          name: str = "llama", budget: GraphBudget | None = None) -> Graph:
    """A LLaMA decoder with its language-modelling loss; the defaults are LLaMA-7B.

    Token embedding (ids one-hot), `blocks` pre-norm blocks (RMSNorm,
    grouped-query attention with rotary position embeddings, causal
    (`attention_causal`, fused), SwiGLU MLP of width `ffn`), a final RMSNorm, an untied LM head
    `lm_head` [hidden, vocab], the mean cross-entropy. No biases anywhere.
    `kv_heads` defaults to `heads` (multi-head attention, LLaMA 1), `ffn` to
    `llama_ffn(hidden)`. The rotary tables `rope_cos`/`rope_sin` are inputs
    of HF's shape [1, seq, head size] (the importer folds HF's to constants
    of that shape), so data parallelism, which splits inputs on dim 0,
    leaves them whole.

    Sizes: Touvron et al. 2023, "LLaMA: Open and Efficient Foundation
    Language Models", Table 2 (dimension, heads, layers, 4M-token batches)
    and section 2 (pre-normalization with RMSNorm, SwiGLU of 2/3 4d, RoPE, a
    32k-token vocabulary); Llama 2 (Touvron et al. 2023, "Llama 2: Open
    Foundation and Fine-Tuned Chat Models", Table 1: grouped-query attention
    for 34B and 70B, context 4096); the 70B dimensions (hidden 8192, 80
    layers, 64 heads, 8 key/value heads, ffn 28,672) from Meta's released
    configuration (model card `meta-llama/Llama-2-70b-hf`, config.json).
    """
    kv_heads = heads if kv_heads is None else kv_heads
    ffn = llama_ffn(hidden) if ffn is None else ffn
    dh = _head_size(hidden, heads)
    if heads % kv_heads:
        raise GraphError(f"{heads} heads cannot share {kv_heads} key/value heads (heads must be a multiple)")
    if dh % 2:
        raise GraphError(f"rotary embeddings need an even head size, got {dh} (hidden {hidden} / {heads} heads)")
    g = GraphBuilder(library, name=name, budget=budget)
    x = g.op("embedding", g.input("ids", [batch, seq, vocab]), g.weight("tok_embeddings", [vocab, hidden]),
             name="tok_emb")
    # HF's rotary module returns its tables as [1, seq, head size] (one row of positions for the batch).
    cos = g.op("flatten", g.input("rope_cos", [1, seq, dh]), dim=0, name="rope_cos_table")
    sin = g.op("flatten", g.input("rope_sin", [1, seq, dh]), dim=0, name="rope_sin_table")
    for index in range(blocks):
        x = _llama_block(g, x, cos, sin, f"b{index}_", hidden, heads, kv_heads, ffn)
    x = g.op("rmsnorm", x, g.weight("norm", [hidden]), eps=1e-5, name="final_rms")
    logits = g.op("linear_nobias", x, g.weight("lm_head", [hidden, vocab]), name="logits")
    g.output(_lm_loss(g, logits, batch * seq, vocab, batch * seq))
    return g.build()


def bert(blocks: int = 12, batch: int = 256, seq: int = 512, hidden: int = 768, heads: int = 12,
         ffn: int | None = None, vocab: int = 30592, types: int = 2, masked: int | None = None,
         unfused_attention: int = 0, library: Library | None = None, name: str = "bert",
         budget: GraphBudget | None = None) -> Graph:
    """BERT pre-training with the masked-language-model loss; the defaults are BERT-Base.

    Embeddings: word (`wte`, ids one-hot), token type (`types` segments,
    one-hot) and a learned position table [seq, hidden], summed, then a
    layernorm; `blocks` post-LN encoder blocks (the `stack` example's block:
    attention and GELU MLP with biases, `ffn` = 4 x hidden); the MLM head: a
    dense layer, GELU, layernorm, and the decoder tied to the word
    embedding (read through `transpose`) with its own bias; the mean
    cross-entropy over the vocabulary of the `masked` positions of each
    sequence: every position's logits are computed and the other positions'
    targets are all-zero rows, as HF's `BertForMaskedLM` does with label
    -100. `masked` defaults to round(15% of seq), what BERT's data pipeline
    masks in a full-length sequence (77 of 512; `create_pretraining_data.py`
    caps it at max_predictions_per_seq = 80). No attention mask (sequences
    are packed to full length) and no next-sentence head (RoBERTa drops it).
    `unfused_attention` 0 (the default) computes attention as the fused
    `attention` (FlashAttention / SDPA without a mask: no [b, n, s, s] scores
    stored); 1 writes it out (bmm, scale, softmax, bmm), which the search's
    `fuse_attention` rewrites into the fused operator unless left out.

    Sizes: Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional
    Transformers for Language Understanding", section 3 (BERT-Base L=12,
    H=768, A=12, 110M; BERT-Large L=24, H=1024, A=16, 340M; ffn 4H) and
    appendix A.2 (batches of 256 sequences of 512 tokens); the 30,522-token
    WordPiece vocabulary padded to 30,592 (a multiple of 128, as Megatron-LM
    pads it) so that it divides among devices.
    """
    ffn = 4 * hidden if ffn is None else ffn
    masked = max(1, round(0.15 * seq)) if masked is None else masked
    if masked > seq:
        raise GraphError(f"{masked} masked positions do not fit in a sequence of {seq}")
    _head_size(hidden, heads)
    if unfused_attention not in (0, 1):
        raise GraphError(f"unfused_attention is 0 (fused) or 1 (written out), got {unfused_attention}")
    g = GraphBuilder(library, name=name, budget=budget)
    wte = g.weight("wte", [vocab, hidden])
    words = g.op("embedding", g.input("ids", [batch, seq, vocab]), wte, name="tok_emb")
    segments = g.op("embedding", g.input("token_types", [batch, seq, types]), g.weight("wtt", [types, hidden]),
                    name="type_emb")
    x = g.op("add_bcast", g.op("add", words, segments, name="emb_sum"), g.weight("wpe", [seq, hidden]), name="emb")
    x = g.op("layernorm", x, g.weight("emb_ln_g", [hidden]), g.weight("emb_ln_b", [hidden]), eps=1e-12,
             name="emb_ln")
    for index in range(blocks):
        x = _encoder_block(g, x, f"b{index}_", batch, seq, hidden, heads, ffn, not unfused_attention)
    t = g.op("gelu", g.op("linear", x, g.weight("mlm_w", [hidden, hidden]), g.weight("mlm_b", [hidden]),
                          name="mlm_dense"), name="mlm_act")
    t = g.op("layernorm", t, g.weight("mlm_ln_g", [hidden]), g.weight("mlm_ln_b", [hidden]), eps=1e-12,
             name="mlm_ln")
    logits = g.op("linear", t, g.op("transpose", wte, d0=0, d1=1, name="wte_t"), g.weight("mlm_bias", [vocab]),
                  name="logits")
    g.output(_lm_loss(g, logits, batch * seq, vocab, batch * masked))
    return g.build()


def parameter_count(graph: Graph) -> int:
    """Trained elements: the sum of the weight leaves' sizes (a tied weight is one leaf, counted once)."""
    count = 0
    for leaf in graph.weights:
        size = 1
        for d in leaf.shape:
            size *= d
        count += size
    return count


@dataclass(frozen=True)
class Example:
    """A built-in graph a user names: a builder, the sizes a named configuration fixes, and their source.

    `preset` overrides the builder's defaults (`gpt-6.7b` is `gpt` with
    GPT-3 6.7B's sizes); `--set` overrides both. A size whose default is
    None is derived from the others when nobody sets it (`derived` says
    how: GPT's ffn = 4 x hidden). `parameters` is the published parameter
    count the sizes come with (tests compare the graph's against it).
    """

    name: str
    build: Callable[..., Graph]
    summary: str
    preset: tuple[tuple[str, int], ...] = ()
    derived: tuple[tuple[str, str], ...] = ()
    source: str = ""
    parameters: float | None = None

    def defaults(self) -> dict[str, int | None]:
        """Every size the example takes, with its value unless overridden (None: derived, see `derived`)."""
        sig = inspect.signature(self.build)
        sizes = {k: p.default for k, p in sig.parameters.items() if k not in ("library", "name", "budget")}
        sizes.update(self.preset)
        return sizes

    def describe_sizes(self) -> str:
        derived = dict(self.derived)
        return " ".join(f"{k}={derived.get(k, 'auto') if v is None else v}" for k, v in self.defaults().items())

    def make(self, sizes: Mapping[str, int], library: Library | None, budget: GraphBudget | None = None) -> Graph:
        given = {**dict(self.preset), **sizes}
        if "name" in inspect.signature(self.build).parameters:
            return self.build(**given, library=library, name=self.name, budget=budget)
        return self.build(**given, library=library, budget=budget)


_GPT3 = "Brown et al. 2020, Language Models are Few-Shot Learners, Table 2.1"
_GPT_DERIVED = (("ffn", "4*hidden"),)
_BERT_DERIVED = (("ffn", "4*hidden"), ("masked", "round(0.15*seq)"))
_LLAMA_DERIVED = (("kv_heads", "heads"), ("ffn", "llama_ffn(hidden)"))


def _gpt3(name: str, params: float, blocks: int, hidden: int, heads: int) -> Example:
    return Example(name, gpt, f"GPT-3 {name[4:].upper()}: pre-LN decoder, tied LM head, cross-entropy",
                   (("blocks", blocks), ("hidden", hidden), ("heads", heads)), _GPT_DERIVED, _GPT3, params)


EXAMPLES: Mapping[str, Example] = {
    "mlp": Example("mlp", mlp, "2-layer MLP, relu(x @ w1) @ w2 (Unity Fig. 1)"),
    "transformer": Example("transformer", transformer, "one BERT-Large encoder block"),
    "stack": Example("stack", stack, "a stack of BERT-Large encoder blocks"),
    "branches": Example("branches", branches, "MLP with two parallel branches joined by concat"),
    "experts": Example("experts", experts, "dense mixture of expert FFNs, outputs summed, residual, layernorm, MSE loss"),
    "moe": Example("moe", moe, "routed dropless mixture of experts (top-k router, experts' batched matmul), "
                               "residual, layernorm, MSE loss"),
    "factorized": Example("factorized", factorized, "MLP whose second layer is a product of two matrices, MSE loss"),
    "gpt": Example("gpt", gpt, "GPT-3 Small (125M): pre-LN decoder, tied LM head, cross-entropy", (), _GPT_DERIVED,
                   _GPT3, 125e6),
    "gpt-1.3b": _gpt3("gpt-1.3b", 1.3e9, 24, 2048, 16),
    "gpt-6.7b": _gpt3("gpt-6.7b", 6.7e9, 32, 4096, 32),
    "gpt-13b": _gpt3("gpt-13b", 13.0e9, 40, 5120, 40),
    "gpt-175b": _gpt3("gpt-175b", 175.0e9, 96, 12288, 96),
    "llama": Example("llama", llama, "LLaMA decoder (LLaMA-7B sizes): RMSNorm, SwiGLU, rotary, kv_heads key/value heads",
                     (), _LLAMA_DERIVED, "Touvron et al. 2023, LLaMA, Table 2", 6.7e9),
    "llama-7b": Example("llama-7b", llama, "LLaMA-7B: RMSNorm, SwiGLU, rotary, multi-head attention, untied head",
                        (("blocks", 32), ("hidden", 4096), ("heads", 32)), _LLAMA_DERIVED,
                        "Touvron et al. 2023, LLaMA, Table 2", 6.7e9),
    "llama-70b": Example("llama-70b", llama, "Llama 2 70B: grouped-query attention (64 heads, 8 key/value heads)",
                         (("blocks", 80), ("hidden", 8192), ("heads", 64), ("kv_heads", 8), ("ffn", 28672)),
                         _LLAMA_DERIVED, "Touvron et al. 2023, Llama 2, Table 1; meta-llama/Llama-2-70b-hf config",
                         70e9),
    "bert": Example("bert", bert, "BERT-Base: post-LN encoder with the masked-LM head and loss", (), _BERT_DERIVED,
                    "Devlin et al. 2019, BERT, section 3", 110e6),
    "bert-large": Example("bert-large", bert, "BERT-Large: post-LN encoder with the masked-LM head and loss",
                          (("blocks", 24), ("hidden", 1024), ("heads", 16)), _BERT_DERIVED,
                          "Devlin et al. 2019, BERT, section 3", 340e6),
}


BATCH = "batch"
"""The size a step's micro-batches divide (`search.optimize.optimize`'s `microbatches`): an example built at its
batch / m is one micro-batch of a step of m (`ir.microbatch`)."""


def check_example(name: str, sizes: Mapping[str, int] | None = None) -> Example:
    """The example `name`, its `sizes` checked (known keys, each within `dsl.bounds.size_bound`: from 1 to 10,000
    blocks or experts, any other size to 2**53); GraphError with the message otherwise. Needs no library, so
    `optimize` refuses a bad name or size before the rules load."""
    example = EXAMPLES.get(name)
    if example is None:
        raise GraphError(f"unknown example '{name}' (examples: {', '.join(EXAMPLES)})")
    sizes = dict(sizes or {})
    unknown = set(sizes) - set(example.defaults())
    if unknown:
        raise GraphError(f"example '{name}' has no size {', '.join(sorted(unknown))} "
                         f"(sizes: {example.describe_sizes()})")
    for key, value in sizes.items():
        try:
            size_bound(key).check(value)
        except BoundError as err:
            raise GraphError(str(err)) from None
    return example


def build_example(name: str, sizes: Mapping[str, int] | None = None, library: Library | None = None,
                  budget: GraphBudget | None = None) -> Graph:
    """An example by name with some sizes overridden; unknown names and keys are clear errors.

    Sizes are checked here (`check_example`), before anything is built, and by the builder (at most 2**53
    elements per tensor, and the `budget`'s tensor count and deadline while it builds)."""
    example = check_example(name, sizes)
    sizes = dict(sizes or {})
    if budget is not None and budget.tensors is not None:
        budget.check_count(estimated_tensors(example, sizes, library), f"graph '{name}'", growing=True)
    return example.make(sizes, library, budget).from_example(name, sizes)


def estimated_tensors(example: Example, sizes: Mapping[str, int], library: Library | None) -> int:
    """How many tensors (leaves and operators) `example` has at `sizes`, from two small builds: each block (or
    expert) adds the same count, so a graph of 10,000 blocks is known to be too large for the e-graph before
    it is built (building it until the budget ran out took 7-11 s)."""
    given = {**example.defaults(), **sizes}
    for key in SIZE_LIMITS:
        count = given.get(key)
        if isinstance(count, int) and count > 2:
            one, two = (example.make({**sizes, key: k}, library) for k in (1, 2))
            per = len(two.leaves) + len(two.nodes) - len(one.leaves) - len(one.nodes)
            return len(one.leaves) + len(one.nodes) + (count - 1) * per
    return 0
