"""parsat's `attention_causal` as the torch backend runs it, on a GPU: correct, linear memory, time vs the cost model.

    python3 benchmarks/gpu_attention_causal.py --out gpu_attention_causal.json    # on a CUDA machine (torch only)

The backend's operator is `scaled_dot_product_attention(q, k, v, is_causal=True, scale=c)`
(parsat/importer/torch_ops.py `_attention_causal`; copied here so that the
script needs torch alone). q, k and v are made as a plan makes them: one
[b, s, 3 h d] projection cut into heads by a view and a transpose (not
contiguous). Per shape, bf16: the largest difference from the written-out
form in fp32 (s <= 2048); forward and forward + backward time (CUDA events,
mean of 10 after 3 warm-ups) against the cost model's prediction with the
GPU presets' attention rate (`ir/machine.py`: 0.52 of 989 TFLOP/s, half at
4.4e10 forward FLOPs, backward 2.5x: `pred_ms`); `kept_bytes`: what one
forward adds to the allocated memory beyond the output it replaces (the
previous call's output is freed as the new one is assigned: so this is
what the kernel keeps for backward besides its output, the logsumexp);
`peak_extra_over_qkv`: the peak memory of a forward + backward beyond what
was allocated before, over the bytes of q, k and v (constant in s: no
[s, s] matrix). The run of 2026-11-27 is benchmarks/gpu/gpu_attention_causal.{json,txt}.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

PEAK, EFFICIENCY, HALF_FLOPS = 989e12, 0.52, 4.4e10
SHAPES = ((1, 16, 1024, 128), (1, 16, 2048, 128), (1, 16, 4096, 128), (1, 16, 8192, 128), (2, 16, 2048, 128),
          (1, 32, 8192, 128), (2, 24, 2048, 96))


def attention_causal(q, k, v, c):
    """parsat/importer/torch_ops.py's `_attention_causal`."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=float(c))


def measure(b: int, h: int, s: int, d: int) -> dict:
    x = torch.randn(b, s, 3 * h * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def qkv():
        return [t.unflatten(2, (h, d)).transpose(1, 2) for t in x.chunk(3, -1)]

    q, k, v = qkv()
    c = d ** -0.5
    err = None
    if s <= 2048:
        causal = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1)
        scores = (q.float() @ k.float().transpose(-1, -2) * c).masked_fill(causal, float("-inf"))
        err = (attention_causal(q, k, v, c).float() - torch.softmax(scores, -1) @ v.float()).abs().max().item()
    for _ in range(3):
        q, k, v = qkv()
        o = attention_causal(q, k, v, c)
        o.backward(torch.ones_like(o))
    x.grad = None
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    q, k, v = qkv()
    o = attention_causal(q, k, v, c)
    kept = torch.cuda.memory_allocated() - m0
    o.backward(torch.ones_like(o))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - m0
    x.grad = None
    forward, both = _times(qkv, c)
    flops = b * h * s * s * 2 * d
    predicted = 3.5 * flops / (PEAK * EFFICIENCY / (1 + HALF_FLOPS / flops))
    return dict(b=b, h=h, s=s, d=d, max_err=err, fwd_ms=forward * 1e3, fwdbwd_ms=both * 1e3,
                tflops=3.5 * flops / both / 1e12, pred_ms=predicted * 1e3, meas_over_pred=both / predicted,
                kept_bytes=kept, kept_over_out_lse=kept / (b * h * s * d * 2 + b * h * s * 4),
                peak_extra_over_qkv=peak / (3 * b * h * s * d * 2))


def _times(qkv, c, n: int = 10) -> tuple[float, float]:
    """Seconds per forward, and per forward + backward (CUDA events, mean of n)."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    ev[0].record()
    for _ in range(n):
        q, k, v = qkv()
        attention_causal(q, k, v, c)
    ev[1].record()
    ev[2].record()
    for _ in range(n):
        q, k, v = qkv()
        o = attention_causal(q, k, v, c)
        o.backward(torch.ones_like(o))
    ev[3].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / n / 1e3, ev[2].elapsed_time(ev[3]) / n / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    rows = []
    for shape in SHAPES:
        rows.append(measure(*shape))
        print(json.dumps(rows[-1]))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
