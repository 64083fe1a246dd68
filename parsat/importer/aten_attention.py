"""ATen softmax, dropout, attention and loss operators onto library operators.

A causal square `scaled_dot_product_attention` without dropout is the fused
operator `attention_causal` (FlashAttention: no [*, s, s] scores stored), whether
it says `is_causal=True` or passes the causal mask itself as a constant (what the
Hugging Face `sdpa` attention does: a mask built from positions only, never from
the inputs). One without a mask (or with a constant mask that keeps every key, what
Hugging Face BERT passes without an attention mask), without dropout and not
causal (BERT's `sdpa` attention in eval or with attention dropout 0, ViT-like
encoders, cross-attention with any number of keys) is the fused operator
`attention`.
Any other is written out (`bmm`, `scale`, then `softmax`,
`softmax_causal` for a causal square one with dropout, or `softmax_masked`,
`bmm`); an explicit mask, and a causal mask over more keys than queries, are
data leaves; a float mask computed from the weights (T5's relative position
bias, where a data mask keeps it) is added to the scores before `softmax`,
as torch adds it.
Dropout is `dropout_masked` with its mask a data leaf drawn each step
(`imported.dropout_mask`). `cross_entropy` is `logsumexp` and `nll_sum`
over one-hot targets; its mean multiplies that sum by the inverse count of
the targets that are not ignored (a data leaf: the importer cannot know a
batch's count).

Every handler takes the translator `t` (`translator.Translator`), the ATen
node, and the node's own arguments as torch passes them, and returns the
graph tensor (or list of tensors) of the node, or raises `Refused`.
"""

from __future__ import annotations

import math

from parsat.importer.errors import Refused, TorchImportError
from parsat.importer.imported import mask_keep


def _h_softmax(t, node, x, dim, half_to_float=False, *rest, **kwargs):
    a = t.tensor(x)
    return t.op("softmax", a, dim=t.dim(a, dim))


def _h_log_softmax(t, node, x, dim, *rest, **kwargs):
    a = t.tensor(x)
    d = t.dim(a, dim)
    if d != len(t.shape(a)) - 1:
        raise Refused("log_softmax is supported along the last dim")
    lse = t.op("logsumexp", a, tag="lse")
    return t.op("add_bcast_dim", a, t.op("neg", lse, tag="neg_lse"), dim=d)


def _h_dropout(t, node, x, p, train=True):
    a = t.tensor(x)
    if not train or p == 0:
        return a
    if p >= 1:
        raise Refused("dropout with p >= 1")
    return t.op("dropout_masked", a, t.dropout_leaf(node, "", t.shape(a), p), rate=float(p))


def _h_sdpa(t, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
            enable_gqa=False):
    """softmax(q k^T * scale [masked]) [dropout] v on [..., s, d] tensors: `attention_causal` where it is causal
    square attention without dropout, `attention` where it has no mask, no dropout and is not causal (any
    number of keys), else written out with library operators."""
    qh, kh, vh = t.tensor(q), t.tensor(k), t.tensor(v)
    qh, kh, vh = _broadcast_heads(t, qh, kh, vh)
    sq, sk, sv = t.shape(qh), t.shape(kh), t.shape(vh)
    if len(sq) < 3 or sq[:-2] != sk[:-2] or sk[:-1] != sv[:-1]:
        if enable_gqa:
            raise Refused("scaled_dot_product_attention with enable_gqa is not supported (repeat k and v)")
        raise Refused(f"scaled_dot_product_attention of q {list(sq)}, k {list(sk)}, v {list(sv)}")
    if attn_mask is not None and is_causal:
        raise Refused("scaled_dot_product_attention with both attn_mask and is_causal")
    rank = len(sq)
    c = float(scale if scale is not None else 1.0 / math.sqrt(sq[-1]))
    shape = (*sq[:-1], sk[-2])
    square = shape[-1] == shape[-2]
    causal = is_causal or (attn_mask is not None and square and _is_causal_mask(t, attn_mask, shape))
    if causal and square and not dropout_p:
        return t.op("attention_causal", qh, kh, vh, c=c, tag="ctx")   # FlashAttention: the mask from positions
    unmasked = attn_mask is None or _is_full_mask(t, attn_mask, shape)
    if unmasked and not is_causal and not dropout_p:
        return t.op("attention", qh, kh, vh, c=c, tag="ctx")   # FlashAttention over every key (BERT, ViT)
    kt = t.op("transpose", kh, d0=rank - 2, d1=rank - 1, tag="kT")
    scores = t.op("scale", t.op("bmm", qh, kt, tag="scores"), c=c, tag="scaled")
    if causal and square:
        probs = t.op("softmax_causal", scores, tag="probs")   # the mask from positions: no mask tensor
    elif attn_mask is not None and t.is_compute(attn_mask):   # a float mask from the weights is added to the
        biased = t.binary_handles("add", scores, t.tensor(attn_mask))   # scores (T5's relative position bias)
        probs = t.op("softmax", biased, dim=rank - 1, tag="probs")
    elif attn_mask is not None:
        probs = t.op("softmax_masked", scores, t.data_leaf(attn_mask, "mask", shape), tag="probs")
    elif is_causal:   # more keys than queries: torch aligns the causal mask at the end, a constant data leaf
        probs = t.op("softmax_masked", scores, t.data_leaf_const(node, "causal", shape, None), tag="probs")
    else:
        probs = t.op("softmax", scores, dim=rank - 1, tag="probs")
    if dropout_p:
        mask = t.dropout_leaf(node, "_attn", t.shape(probs), dropout_p)
        probs = t.op("dropout_masked", probs, mask, rate=float(dropout_p), tag="attn_drop")
    return t.op("bmm", probs, vh, tag="ctx")


def _broadcast_heads(t, qh, kh, vh):
    """q, k and v with k's and v's leading dims broadcast to q's where torch's attention broadcasts them (Falcon's
    multi-query attention: one key and value head for every query head), as `broadcast` nodes."""
    sq = t.shape(qh)
    lead = tuple(sq[:-2])
    out = []
    for x in (kh, vh):
        sx = t.shape(x)
        fits = len(sx) == len(sq) and all(a in (1, b) for a, b in zip(sx[:-2], lead))
        out.append(t.expand_to(x, lead + tuple(sx[-2:])) if fits and tuple(sx[:-2]) != lead else x)
    return (qh, *out)


def _is_causal_mask(t, attn_mask, shape) -> bool:
    """Whether an explicit mask is the causal one of square scores: constant data (made from positions, never
    from the user's inputs) whose every [s, s] slice keeps exactly the keys t <= r for query r. A mask that
    depends on the inputs (padding) or keeps anything else stays a data leaf (`_constant_mask_is`)."""
    return _constant_mask_is(t, attn_mask, shape, "causal")


def _is_full_mask(t, attn_mask, shape) -> bool:
    """Whether an explicit mask keeps every key of every query: constant data, no padding (what Hugging Face BERT's
    `sdpa` attention passes when it is called without an attention mask, its all-ones default made into the
    additive mask under tracing), so the attention is unmasked (`_constant_mask_is`)."""
    return _constant_mask_is(t, attn_mask, shape, "full")


def _constant_mask_is(t, attn_mask, shape, kind: str) -> bool:
    """Whether an explicit mask is constant data (never from the user's inputs) that keeps exactly the keys of
    `kind` ("causal": t <= r for query r of square scores; "full": every key). On meta tensors its value is made
    again on the CPU (`Translator.constant_value`); a mask too large for that is taken as neither."""
    torch = t.torch
    if not isinstance(attn_mask, torch.fx.Node) or t.is_compute(attn_mask) or attn_mask.name in t.varying:
        return False
    key = (attn_mask.name, tuple(shape), kind)
    if key not in t.constant_masks:     # every layer reads the one mask: looked at once
        t.constant_masks[key] = _keeps(t, attn_mask, shape, kind)
    return t.constant_masks[key]


def _keeps(t, attn_mask, shape, kind: str) -> bool:
    """Whether a constant mask's value keeps exactly the keys of `kind` in every [s, n] slice (`_constant_mask_is`)."""
    torch = t.torch
    value = t.constant_value(attn_mask)
    if not isinstance(value, torch.Tensor):
        return False
    try:
        keep = mask_keep(value, attn_mask.name)
        if torch.broadcast_shapes(keep.shape, tuple(shape)) != tuple(shape):
            return False
    except (TorchImportError, RuntimeError):
        return False   # values other than 0/1 or 0/-inf, or not broadcastable to the scores: not such a mask
    want = torch.ones(shape[-2], shape[-1], dtype=torch.bool)
    if kind == "causal":
        want = want.tril()
    return bool((keep == want).all())   # broadcast over the mask's leading dims: never expanded to the heads


def _h_cross_entropy(t, node, x, target, weight=None, reduction=1, ignore_index=-100,
                     label_smoothing=0.0):
    if weight is not None or label_smoothing:
        raise Refused("cross_entropy with class weights or label smoothing is not supported")
    if t.is_compute(target):
        raise Refused("cross_entropy targets computed from the weights (soft targets) are not supported")
    logits = t.tensor(x)
    shape = t.shape(logits)
    if len(shape) != 2:
        raise Refused(f"cross_entropy is supported on [N, classes] logits, got {list(shape)}")
    n, classes = shape
    if tuple(t.values[target.name].shape) != (n,):
        raise Refused("cross_entropy targets must be class indices of shape [N]")
    y = t.data_leaf(target, "onehot", (n, classes), classes=classes, ignore=int(ignore_index))
    lse = t.op("logsumexp", logits, tag="lse")
    total = t.op("nll_sum", logits, lse, y, tag="nll")
    if reduction == 2:  # sum
        return total
    if reduction != 1:
        raise Refused("cross_entropy with reduction='none' is not supported (return its mean or sum)")
    inv = t.data_leaf(target, "inv_count", (), classes=classes, ignore=int(ignore_index))
    return t.op("mul", total, inv, tag="mean")


HANDLERS = {
    "softmax": _h_softmax, "_softmax": _h_softmax, "log_softmax": _h_log_softmax,
    "dropout": _h_dropout, "scaled_dot_product_attention": _h_sdpa, "cross_entropy_loss": _h_cross_entropy,
}
