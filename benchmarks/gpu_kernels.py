"""Measure on one GPU what the cost model assumes: GEMM, fused attention and memory-bound kernels by shape.

    python3 benchmarks/gpu_kernels.py --out gpu_kernels.json      # on a CUDA machine (needs torch only)
    python3 benchmarks/gpu_kernels.py --smoke --out /tmp/k.json   # a few tiny shapes on the CPU: the script runs

Everything is timed in bf16 as Megatron trains, with CUDA events, after
warm-up, the median of several repetitions; FLOPs are the model FLOPs of
the kernel (2 m n k for a GEMM; causal attention counts half the score
matrix: forward 2 * 2 b h s^2 d / 2, backward 2.5x the forward as
FlashAttention-2 counts it). What it records, per shape: seconds and
achieved TFLOP/s (GEMMs, attention) or GB/s (memory-bound kernels), and
attention's peak extra memory, to hold `parsat.cost` against (issue 31):

* GEMMs over the shapes a transformer layer runs (tokens x hidden x
  hidden-slices under tensor parallelism), small to large;
* `scaled_dot_product_attention(..., is_causal=True)` (FlashAttention on
  Hopper), forward and forward + backward, at sequence 1k-8k;
* layernorm, gelu, add: bytes moved over time.

The results are written whole to `--out` (JSON) and printed as a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile

import torch
import torch.nn.functional as F

GEMM_M = (512, 2048, 8192, 16384)                     # tokens (micro-batch x sequence) per rank
GEMM_KN = ((1024, 1024), (2048, 2048), (2048, 8192), (4096, 4096), (4096, 1536), (4096, 12288), (4096, 16384),
           (8192, 8192), (8192, 3072), (12288, 4608), (12288, 12288), (16384, 4096), (1536, 4096), (6144, 12288))
ATTENTION = tuple((b, h, s, 128) for s in (1024, 2048, 4096, 8192) for b, h in ((1, 16), (1, 32), (4, 32), (1, 96)))
MEMORY_ELEMENTS = (2 ** 20, 2 ** 24, 2 ** 27)


def timed(fn, device: torch.device, repeats: int) -> float:
    """The median seconds of `fn()` over `repeats` runs after warm-up (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        import time
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def gemms(device, dtype, repeats, ms, kns) -> list[dict]:
    rows = []
    for m in ms:
        for k, n in kns:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            seconds = timed(lambda: a @ b, device, repeats)
            rows.append({"m": m, "k": k, "n": n, "seconds": seconds, "tflops": 2 * m * n * k / seconds / 1e12})
            del a, b
    return rows


def attention(device, dtype, repeats, shapes) -> list[dict]:
    rows = []
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, s, d, device=device, dtype=dtype)
        forward = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)   # noqa: E731

        def both():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(grad)

        fwd = timed(forward, device, repeats)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        total = timed(both, device, repeats)
        extra = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else 0
        flops = 2 * 2 * b * h * s * s * d / 2     # causal forward: QK^T and PV over half the scores
        rows.append({"b": b, "heads": h, "s": s, "d": d, "forward_s": fwd, "forward_backward_s": total,
                     "forward_tflops": flops / fwd / 1e12, "forward_backward_tflops": 3.5 * flops / total / 1e12,
                     "extra_bytes": extra, "qkv_bytes": 3 * b * h * s * d * q.element_size()})
        del q, k, v, grad
    return rows


def memory_bound(device, dtype, repeats, sizes) -> list[dict]:
    rows = []
    for n in sizes:
        x = torch.randn(n // 1024, 1024, device=device, dtype=dtype)
        y = torch.randn_like(x)
        w, bias = torch.ones(1024, device=device, dtype=dtype), torch.zeros(1024, device=device, dtype=dtype)
        kernels = {"add": (lambda: x + y, 3), "gelu": (lambda: F.gelu(x, approximate="tanh"), 2),
                   "layernorm": (lambda: F.layer_norm(x, (1024,), w, bias), 2)}
        for name, (fn, passes) in kernels.items():
            seconds = timed(fn, device, repeats)
            moved = passes * n * x.element_size()
            rows.append({"kernel": name, "elements": n, "seconds": seconds, "gbytes_per_s": moved / seconds / 1e9})
        del x, y
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="a few tiny shapes on whatever device there is")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: run with --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    if args.smoke:
        found = {"gemm": gemms(device, torch.float32, 2, (64,), ((64, 64),)),
                 "attention": attention(device, torch.float32, 2, ((1, 2, 64, 16),)),
                 "memory": memory_bound(device, torch.float32, 2, (2 ** 14,))}
    else:
        found = {"gemm": gemms(device, dtype, args.repeats, GEMM_M, GEMM_KN),
                 "attention": attention(device, dtype, args.repeats, ATTENTION),
                 "memory": memory_bound(device, dtype, args.repeats, MEMORY_ELEMENTS)}
    found["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    found["torch"] = torch.__version__
    folder = os.path.dirname(os.path.abspath(args.out))
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as handle:
        json.dump(found, handle, indent=1)
    os.replace(handle.name, args.out)   # whole or not at all
    print(f"device {found['device']}, torch {found['torch']}")
    for row in found["gemm"]:
        print(f"gemm {row['m']:>6} x {row['k']:>6} x {row['n']:>6}: {row['tflops']:8.1f} TFLOP/s")
    for row in found["attention"]:
        print(f"attention b {row['b']} h {row['heads']:>3} s {row['s']:>5} d {row['d']}: fwd "
              f"{row['forward_tflops']:7.1f}, fwd+bwd {row['forward_backward_tflops']:7.1f} TFLOP/s, extra "
              f"{row['extra_bytes'] / 2**20:9.1f} MiB (q, k, v {row['qkv_bytes'] / 2**20:.1f} MiB)")
    for row in found["memory"]:
        print(f"{row['kernel']:<9} {row['elements']:>10} elements: {row['gbytes_per_s']:8.1f} GB/s")
    return 0 if all(math.isfinite(r["seconds"]) for r in found["gemm"]) else 1


if __name__ == "__main__":
    sys.exit(main())
