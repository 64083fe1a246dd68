"""Peak memory per rank of GPT-2 (vocabulary 50,257, batch 8, sequence 1,024) through `runtime="torch"` (issue 30).

    PYTHONPATH=. python benchmarks/torch_native_memory.py [--steps 2] [--layers 2] [--embd 128]

The point: the plan models the ids as one-hot [B, T, V] tensors, but the
lowered module is the user's own, so each rank is given integer ids and
labels of its local batch only; no [B, T, V] input is materialised (at
V = 50,257 a float32 one-hot of the global batch would be 1.6 GB, and
the logits themselves are as large). Two jobs, each in fresh processes
(`backend.launch`) so that both pay the same imports:

* `parallel`: 2 gloo ranks, Hugging Face GPT-2 (the config below, tied
  head, dropout off) with the data-parallel plan (`megatron_pcg` of the
  graph imported at sequence 32, as tests/test_torch_native_runtime.py
  builds plans; the weights, not the sequence, are what the plan places),
  `parsat.parallelize(..., runtime="torch")`, AdamW steps on
  `local_batch` of the global [8, 1024] ids;
* `single`: 1 process, the unmodified module trained the same steps on the
  global batch, without parsat.

Each prints its peak resident set size during the steps (VmHWM, reset
before the first step: a spawned rank starts with its parent's), the RSS
before the first step, `ru_maxrss` (the process's whole life), and the largest tensor the module's forward was given
(a forward pre-hook on the top module). Figures are CPU, not GPU memory.
Recorded in benchmarks/torch_native_results.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

VOCAB, BATCH, SEQ, IMPORT_SEQ = 50257, 8, 1024, 32


def gpt2(layers: int, embd: int):
    """GPT-2 with the real vocabulary and context, small otherwise; dropout off, seeded."""
    import transformers as T
    from hf_models import Loss

    torch.manual_seed(0)
    config = T.GPT2Config(n_layer=layers, n_embd=embd, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return Loss(T.GPT2LMHeadModel(config), "causal")


def batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: integer ids and labels (int64), [BATCH, seq]."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    return ids, ids.clone()


def _mib_now() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM; Linux's clear_refs 5): a spawned rank inherits its parent's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _largest_input(module) -> dict:
    """A forward pre-hook recording the largest tensor the module is given (bytes, shape, dtype)."""
    seen = {"bytes": 0}

    def hook(_module, args):
        for t in args:
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > seen["bytes"]:
                seen.update(bytes=t.numel() * t.element_size(), shape=list(t.shape), dtype=str(t.dtype))
    module.register_forward_pre_hook(hook)
    return seen


def memory_job(ctx, plan: dict | None, steps: int, layers: int, embd: int) -> dict:
    """One rank's run: parallelized with the plan (or, plan None, the unmodified module on the global batch)."""
    import parsat
    from parsat.backend.torch_native.apply import local_batch

    module = gpt2(layers, embd)
    ids, labels = batch(SEQ)
    if plan is not None:
        model = parsat.parallelize(module, plan, batch(IMPORT_SEQ), runtime="torch")
        ids, labels = local_batch(model, ids, labels)
    else:
        model = module
    largest = _largest_input(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _mib_now()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    reset = _reset_peak()
    losses, started = [], time.perf_counter()
    for _ in range(steps):
        loss = model(ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"rank": ctx.rank, "world": ctx.world, "parsat": plan is not None, "local_batch": list(ids.shape),
            "rss_before_steps_mib": round(before, 1), "peak_rss_before_steps_mib": round(peak_before, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "peak_rss_in_steps_mib": round(_peak_mib(), 1) if reset else None,
            "largest_input": largest, "losses": losses, "steps_s": round(time.perf_counter() - started, 1),
            "logits_local_mib": round(ids.numel() * VOCAB * 4 / 2**20, 1)}


def make_plan(layers: int, embd: int) -> dict:
    """The data-parallel plan of the model's graph imported at sequence IMPORT_SEQ (the tests' `megatron_pcg`)."""
    import mesh_plans

    import parsat
    from parsat.backend.executor import operator_library
    from parsat.ir.megatron import megatron_pcg

    graph = parsat.from_torch(gpt2(layers, embd), batch(IMPORT_SEQ))
    return mesh_plans.plan_dict(graph, megatron_pcg(graph, operator_library(), (2, 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--jobs", nargs="+", default=["parallel", "single"])
    args = parser.parse_args()
    from parsat.backend.launch import LaunchConfig, launch

    for job in args.jobs:
        plan = make_plan(args.layers, args.embd) if job == "parallel" else None
        config = LaunchConfig(nproc=2 if plan else 1, backend="gloo", timeout_s=1800, collective_timeout_s=900)
        for result in launch(memory_job, (plan, args.steps, args.layers, args.embd), config):
            print(json.dumps(dict(result, job=job)), flush=True)


if __name__ == "__main__":
    main()
