"""ATen layer operators onto library operators: linear and matmul, embedding, the norms, convolution and pooling.

A Linear's `[out, in]` weight is read as it is stored, by torch's `F.linear`
(`linear_nobias_t`, `linear_t`; `x @ w.t()` too, `Translator.untransposed_of`); embedding ids are data, fed one-hot
(`padding_idx`: `embedding_padded`, whose row is read and never trained); a
batch norm in training mode computes its batch statistics as graph nodes
and records its running statistics (`Translator.running_statistics`).
Convolution and pooling take square kernels, strides and paddings
(`square`); a grouped (depthwise) convolution is `conv2d_grouped`, a 1-D
one `conv1d`, each bias added per channel (`channel_bias`); interpolation
of a tensor to its own size is the identity (`_h_upsample`).

Every handler takes the translator `t` (`translator.Translator`), the ATen
node, and the node's own arguments as torch passes them, and returns the
graph tensor (or list of tensors) of the node, or raises `Refused`.
"""

from __future__ import annotations

from parsat.importer.errors import Refused, aten_short
from parsat.importer.aten_routing import expert_matmul


def _h_linear(t, node, x, w, b=None):
    """torch's `F.linear` as torch computes it: the weight read [out, in], as nn.Linear stores it."""
    a, weight = t.tensor(x), t.tensor(w)
    if len(t.shape(weight)) != 2:
        raise Refused(f"linear with a weight of shape {list(t.shape(weight))} (expected 2-D)")
    if b is None:
        return t.op("linear_nobias_t", a, weight)
    return t.op("linear_t", a, weight, t.tensor(b))


def _h_addmm(t, node, bias, x, w, beta=1, alpha=1):
    """`bias + x @ w`; `bias + x @ w.t()` (a decomposed nn.Linear) is `F.linear` on the [out, in] weight."""
    if beta != 1 or alpha != 1:
        raise Refused("addmm with beta or alpha other than 1 is not supported")
    source = t.untransposed_of(w)
    if source is not None:
        return t.op("linear_t", t.tensor(x), source, t.tensor(bias))
    return t.op("linear", t.tensor(x), t.tensor(w), t.tensor(bias))


def _h_matmul(t, node, x, y):
    """A product by shapes; `x @ w.t()` or `x @ w.T` of a matrix `w` is `F.linear` on `w` as it is stored."""
    a, b = t.tensor(x), t.tensor(y)
    experts = expert_matmul(t, a, b)
    if experts is not None:   # rows by their top-k's picked expert weights: the experts' dispatch form
        return experts
    sa, sb = t.shape(a), t.shape(b)
    source = t.untransposed_of(b) if len(sb) == 2 else None
    if source is not None:
        return t.op("linear_nobias_t", a, source)
    if len(sa) == 2 and len(sb) == 2:
        return t.op("matmul", a, b)
    if len(sb) == 2 and len(sa) > 2:
        return t.op("linear_nobias", a, b)
    if len(sa) == len(sb) and sa[:-2] == sb[:-2]:
        return t.op("bmm", a, b)
    raise Refused(f"matmul of shapes {list(sa)} and {list(sb)} (parsat maps 2-D, batched with equal batch "
                   "dims, and [..., k] @ [k, n])")


def _h_embedding(t, node, weight, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq or sparse:
        raise Refused("embedding with scale_grad_by_freq or sparse gradients is not supported")
    if t.is_compute(ids):
        raise Refused("embedding ids computed from the weights are not supported")
    table = t.tensor(weight)
    vocab = t.shape(table)[0]
    shape = tuple(t.values[ids.name].shape)
    pad = None if padding_idx is None or padding_idx < 0 else int(padding_idx)
    onehot = t.data_leaf(ids, "onehot", shape + (vocab,), classes=vocab)
    if pad is None:
        return t.op("embedding", onehot, table)
    return t.op("embedding_padded", onehot, table, pad=pad)  # row `pad` read, never trained


def _h_layer_norm(t, node, x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn=True):
    a = t.tensor(x)
    shape = t.shape(a)
    if len(normalized_shape) != 1 or shape[-1:] != tuple(normalized_shape):
        raise Refused("layer_norm is supported over the last dim")
    n = shape[-1]
    gamma = t.tensor(weight) if weight is not None else t.data_leaf_const(node, "ones", (n,), 1.0)
    beta = t.tensor(bias) if bias is not None else t.data_leaf_const(node, "zeros", (n,), 0.0)
    return t.op("layernorm", a, gamma, beta, eps=float(eps))


def _h_batch_norm(t, node, x, weight, bias, running_mean, running_var, training, momentum, eps,
                  cudnn=True):
    a = t.tensor(x)
    shape = t.shape(a)
    if len(shape) != 4:
        raise Refused("batch_norm is supported on [N, C, H, W] tensors")
    n, c, h, w = shape
    gamma = t.tensor(weight) if weight is not None else t.data_leaf_const(node, "ones", (c,), 1.0)
    beta = t.tensor(bias) if bias is not None else t.data_leaf_const(node, "zeros", (c,), 0.0)
    if training or running_mean is None:
        count = n * h * w
        mean = t.op("bn_mean", a, count=count, tag="mean")
        var = t.op("bn_var", a, mean, count=count, tag="var")
        if training and running_mean is not None:
            t.running_statistics(node, mean, var, count, running_mean, running_var, momentum)
    else:
        mean, var = t.tensor(running_mean), t.tensor(running_var)
    return t.op("bn_normalize", a, mean, var, gamma, beta, eps=float(eps))


def _h_conv2d(t, node, x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    """`conv2d`, or `conv2d_grouped` with groups > 1 (ConvNeXt's depthwise convolution), and its bias."""
    step, pad = square(stride), square(padding)
    if step is None or pad is None or square(dilation) != 1:
        raise Refused("conv2d is supported with square stride and padding, no dilation")
    if groups == 1:
        out = t.op("conv2d", t.tensor(x), t.tensor(w), stride=step, pad=pad)
    else:
        out = t.op("conv2d_grouped", t.tensor(x), t.tensor(w), groups=int(groups), stride=step, pad=pad)
    return channel_bias(t, out, b)


def _h_conv1d(t, node, x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    """`conv1d` (Whisper's audio encoder) and its bias."""
    step, pad = square(stride), square(padding)
    if step is None or pad is None or square(dilation) != 1 or groups != 1:
        raise Refused("conv1d is supported with an integer stride and padding, no dilation, groups=1")
    return channel_bias(t, t.op("conv1d", t.tensor(x), t.tensor(w), stride=step, pad=pad), b)


def channel_bias(t, out, b):
    """A convolution's output plus its bias per channel (dim 1): channels moved last for `bias_add` and back."""
    if b is None:
        return out
    last = len(t.shape(out)) - 1
    moved = t.op("transpose", out, d0=1, d1=last, tag="bias_in")
    biased = t.op("bias_add", moved, t.tensor(b), tag="bias")
    return t.op("transpose", biased, d0=1, d1=last, tag="bias_out")


def _h_avg_pool2d(t, node, x, kernel, stride=None, padding=0, ceil_mode=False,
                  count_include_pad=True, divisor_override=None):
    size, step, pad = square(kernel), square(stride if stride else kernel), square(padding)
    if None in (size, step) or pad != 0 or ceil_mode or divisor_override:
        raise Refused("avg_pool2d is supported with square kernels and strides, no padding, no ceil_mode")
    return t.op("avgpool2d", t.tensor(x), size=size, stride=step)


def _h_max_pool2d(t, node, x, kernel, stride=None, padding=0, dilation=1, ceil_mode=False):
    size, step, pad = square(kernel), square(stride if stride else kernel), square(padding)
    if None in (size, step, pad) or square(dilation) != 1 or ceil_mode:
        raise Refused("max_pool2d is supported with square kernels, strides and padding, no dilation, no ceil_mode")
    if pad == 0:
        return t.op("maxpool2d", t.tensor(x), size=size, stride=step)
    if 2 * pad >= size:
        raise Refused(f"max_pool2d with padding {pad} and kernel {size}: parsat supports padding below half the "
                       "kernel (2 * padding < kernel)")
    return t.op("maxpool2d_padded", t.tensor(x), size=size, stride=step, pad=pad)


def _h_adaptive_avg_pool2d(t, node, x, output_size):
    if square(output_size) != 1:
        raise Refused("adaptive_avg_pool2d is supported with output size 1 (global average pooling)")
    out = t.op("global_avgpool", t.tensor(x))
    return t.reshape(out, t.shape(out) + (1, 1))


def _h_adaptive_avg_pool1d(t, node, x, output_size):
    """Swin's pooler: average pooling of the last dim to one entry, a `mean` kept as a size-1 dim."""
    if square(output_size) != 1:
        raise Refused("adaptive_avg_pool1d is supported with output size 1 (a mean over the last dim)")
    return t.reduce("mean", t.tensor(x), [-1], True)


def _h_upsample(t, node, x, output_size=None, *rest, **kwargs):
    """Bilinear or nearest upsampling of [N, C, H, W] to its own size is the identity, exactly: each output pixel
    reads the input pixel at its own position with weight 1 (BEiT interpolates its relative position bias table
    to the window it was made for). Any other size is refused."""
    a = t.tensor(x)
    shape = t.shape(a)
    given = [f for f in (*rest, *kwargs.values()) if f is not None and not isinstance(f, bool)]  # scales, not
    factors = [v for f in given for v in (f if isinstance(f, (list, tuple)) else [f])]          # align_corners
    same = output_size is None or tuple(int(s) for s in output_size) == tuple(shape[2:])
    if not same or any(float(f) != 1.0 for f in factors) or (output_size is None and not factors):
        raise Refused(f"{aten_short(node)} to another size than the input's (parsat maps interpolation of a tensor "
                      "to its own size, the identity)")
    return a


def square(value) -> int | None:
    """An int from an int or a pair of equal ints (kernel sizes, strides, paddings); None otherwise."""
    if isinstance(value, int):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2 and value[0] == value[1] and isinstance(value[0], int):
        return value[0]
    if isinstance(value, (tuple, list)) and len(value) == 1 and isinstance(value[0], int):
        return value[0]
    return None


HANDLERS = {
    "linear": _h_linear, "addmm": _h_addmm, "matmul": _h_matmul, "mm": _h_matmul, "bmm": _h_matmul,
    "embedding": _h_embedding, "layer_norm": _h_layer_norm, "batch_norm": _h_batch_norm,
    "conv2d": _h_conv2d, "conv1d": _h_conv1d, "avg_pool2d": _h_avg_pool2d, "max_pool2d": _h_max_pool2d,
    "adaptive_avg_pool2d": _h_adaptive_avg_pool2d, "adaptive_avg_pool1d": _h_adaptive_avg_pool1d,
    "upsample_bilinear2d": _h_upsample, "upsample_nearest2d": _h_upsample,
}
