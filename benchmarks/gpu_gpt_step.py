"""One GPU's training step of a GPT, as a PyTorch user runs it, measured: the compute a published run's GPU does.

    python3 benchmarks/gpu_gpt_step.py --out gpu_gpt_step.json            # on a CUDA machine (torch only)
    python3 benchmarks/gpu_gpt_step.py --smoke --out /tmp/s.json          # a tiny model on the CPU

Megatron-style pre-LN decoder (fused QKV, SDPA causal attention, GELU MLP
of 4h, tied embedding), bf16 autocast with fp32 master weights and fused
AdamW, as Megatron-LM trains. Each configuration runs `--steps` steps of
`microbatches` x `micro_batch` sequences (gradient accumulation) after two
warm-up steps; the record has the median step time, the model FLOPs per
step by the formula of shared/anchors/published_runs.md (72 B s l h^2 (1 +
s/(6h) + V/(12 l h)), no recomputation counted) and the TFLOP/s that
makes, and the peak memory. One GPU holds no data-, tensor- or
pipeline-parallel communication: these are the compute part of a
published row's step, at that row's per-GPU shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Config:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    micro_batch: int
    microbatches: int

    def model_flops(self) -> float:
        """Model FLOPs of one step (shared/anchors/published_runs.md)."""
        b, s, l, h, v = self.micro_batch * self.microbatches, self.seq, self.layers, self.hidden, self.vocab
        return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


CONFIGS = (
    # Megatron-Core H100 table, 1.7B row: t 1, p 1, d 48, batch 192 -> 4 sequences of 4096 per GPU per step
    Config("mcore-1.7b", 24, 2048, 16, 4096, 131072, 1, 4),
    # GPT-3 1.3B (parsat's gpt-1.3b) at sequence 2048, 8 sequences per GPU
    Config("gpt3-1.3b", 24, 2048, 16, 2048, 51200, 2, 4),
    # Narayanan et al. Table 1, 1.7B row: t 1, p 1, 32 GPUs, batch 512 -> 16 sequences of 2048 per GPU
    Config("sc21-1.7b", 24, 2304, 24, 2048, 51200, 2, 8),
)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.embed, self.pos = nn.Embedding(c.vocab, c.hidden), nn.Embedding(c.seq, c.hidden)
        self.blocks = nn.ModuleList(Block(c.hidden, c.heads) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.hidden)

    def forward(self, ids, targets):
        x = self.embed(ids) + self.pos.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.embed.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))


def measure(c: Config, device: torch.device, steps: int) -> dict:
    torch.manual_seed(0)
    model = GPT(c).to(device)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ids = torch.randint(0, c.vocab, (c.microbatches, c.micro_batch, c.seq), device=device)

    def step():
        for k in range(c.microbatches):
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                loss = model(ids[k], ids[k].roll(-1, dims=1))
            (loss / c.microbatches).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t)
    seconds = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    params = sum(p.numel() for p in model.parameters())
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {**asdict(c), "parameters": params, "step_s": seconds, "steps": steps, "model_flops": c.model_flops(),
            "model_tflops": c.model_flops() / seconds / 1e12, "peak_memory_bytes": peak, "loss": float(loss.detach())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: run with --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    configs = (Config("smoke", 2, 64, 4, 32, 256, 2, 2),) if args.smoke else CONFIGS
    rows = [measure(c, device, 2 if args.smoke else args.steps) for c in configs]
    found = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
             "torch": torch.__version__, "runs": rows}
    folder = os.path.dirname(os.path.abspath(args.out))
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as handle:
        json.dump(found, handle, indent=1)
    os.replace(handle.name, args.out)
    print(f"device {found['device']}, torch {found['torch']}")
    for r in rows:
        print(f"{r['name']:<12} {r['parameters'] / 1e9:5.2f}B params, {r['micro_batch'] * r['microbatches']} x "
              f"{r['seq']} tokens: step {r['step_s'] * 1e3:9.1f} ms, {r['model_tflops']:6.1f} model TFLOP/s, "
              f"peak {r['peak_memory_bytes'] / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
