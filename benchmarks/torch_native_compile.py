"""`torch.compile` of a module lowered with `runtime="torch"`: the eager loss, and time per step (issue 30).

    PYTHONPATH=. python benchmarks/torch_native_compile.py [--runs gpt2:dp llama:tp] [--backend inductor]
        [--warmup 3] [--steps 8] [--seq 32]

Each run is a model from `hf_models.make` (GPT-2 for data parallelism,
since its `Conv1D` projections have no tensor-parallel style; LLaMA, a
GPT-like decoder whose projections are `nn.Linear`, for the Megatron
tensor-parallel plan) and a plan built as tests/test_torch_native_runtime.py
builds them (`megatron_pcg` on the imported graph). On 2 gloo ranks, each
rank holds two copies lowered with `parsat.parallelize(..., runtime="torch")`
from the same seed: one run eagerly, one through `torch.compile`. Both
train the same SGD steps on the same local batches, one eager step then
one compiled step, so load from other jobs on the box falls on both alike.
The first `--warmup` steps (compilation) are not timed; of the next
`--steps` the median wall and CPU seconds are printed, with each step's
loss of both (the ranks' mean), the compiled graphs and graph breaks
(`torch._dynamo.explain` of the compiled module's forward) and whether any
recompilation happened after warm-up. Dropout is off: each copy would draw
its own masks. One JSON line per run; the recorded figures are in
benchmarks/torch_native_results.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"dp": (2, 1), "tp": (1, 2)}


def build(name: str, seq: int):
    """The benchmark model (float32, dropout off) and a global batch of integer ids and labels, seeded."""
    import hf_models

    module, (ids, _) = hf_models.make(name)
    for sub in module.modules():
        if isinstance(sub, torch.nn.Dropout):
            sub.p = 0.0
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 256, (hf_models.BATCH, seq), generator=g)
    return module, (ids, ids.clone())


def make_plan(name: str, kind: str) -> dict:
    """The plan a run lowers: `megatron_pcg` of the imported graph on a (dp, tp) mesh, as the tests build it."""
    import mesh_plans

    import parsat
    from parsat.backend.executor import operator_library
    from parsat.ir.megatron import megatron_pcg

    module, inputs = build(name, 32)
    graph = parsat.from_torch(module, inputs)
    pcg = megatron_pcg(graph, operator_library(), SHAPES[kind])
    if pcg is None:
        raise SystemExit(f"no {kind} plan for {name}")
    return mesh_plans.plan_dict(graph, pcg)


def _step(model, optimizer, batch) -> tuple[float, float, float]:
    """One training step: (local loss, wall seconds, this process's CPU seconds)."""
    wall, cpu = time.perf_counter(), time.process_time()
    loss = model(*batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach()), time.perf_counter() - wall, time.process_time() - cpu


def _graphs(compiled, batch) -> dict:
    """Dynamo's view of the compiled forward: graphs, graph breaks and their reasons (deduplicated)."""
    import torch._dynamo as dynamo

    explained = dynamo.explain(compiled._orig_mod)(*batch)
    reasons = sorted({f"{str(b.reason).splitlines()[0][:200]} at {_where(b)}" for b in explained.break_reasons})
    return {"graphs": explained.graph_count, "graph_breaks": explained.graph_break_count, "reasons": reasons}


def _where(graph_break) -> str:
    """The innermost frame of a graph break's user stack: file (last two parts) and line."""
    stack = getattr(graph_break, "user_stack", None) or []
    if not stack:
        return "?"
    frame = stack[-1]
    return f"{'/'.join(Path(frame.filename).parts[-2:])}:{frame.lineno} ({frame.name})"


def compile_job(ctx, name: str, plan: dict, backend: str, warmup: int, steps: int, seq: int) -> dict:
    """On every rank: the eager and the compiled copy trained side by side (module docstring)."""
    import torch._dynamo.utils as dynamo_utils
    import torch.distributed as dist

    import parsat
    from parsat.backend.torch_native.apply import local_batch

    models = []
    for _ in range(2):
        module, batch = build(name, seq)
        # example inputs of the plan's import: the import maps its block names (b{i}_...) to the module's
        example = build(name, 32)[1]
        models.append(parsat.parallelize(module, plan, example, runtime="torch"))
    eager, compiled = models[0], torch.compile(models[1], backend=backend)
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in models]
    batch = local_batch(eager, *batch)
    rows = {"eager": [], "compiled": []}
    compile_started = time.perf_counter()
    frames_after_warmup = None
    for step in range(warmup + steps):
        for label, model, optimizer in (("eager", eager, optimizers[0]), ("compiled", compiled, optimizers[1])):
            rows[label].append(_step(model, optimizer, batch))
        if step == warmup - 1:
            warmup_s = time.perf_counter() - compile_started
            frames_after_warmup = dict(dynamo_utils.counters["frames"])
    frames_after = dict(dynamo_utils.counters["frames"])
    losses = {}
    for label, row in rows.items():
        held = torch.tensor([r[0] for r in row], dtype=torch.float64)
        dist.all_reduce(held)
        losses[label] = (held / ctx.world).tolist()
    timed = {label: row[warmup:] for label, row in rows.items()}
    worst = max(abs(c - e) / abs(e) for c, e in zip(losses["compiled"], losses["eager"]))
    return {"run": name, "rank": ctx.rank, "backend": backend, "threads": torch.get_num_threads(),
            "warmup_steps_s": round(warmup_s, 2),
            "wall_s": {k: round(statistics.median(r[1] for r in v), 5) for k, v in timed.items()},
            "cpu_s": {k: round(statistics.median(r[2] for r in v), 5) for k, v in timed.items()},
            "losses": losses, "worst_loss_rel": worst,
            "recompiled_after_warmup": frames_after != frames_after_warmup, "frames": frames_after,
            "dynamo": _graphs(compiled, batch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["gpt2:dp", "llama:tp"])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()
    from parsat.backend.launch import LaunchConfig, launch

    for run in args.runs:
        name, kind = run.split(":")
        plan = make_plan(name, kind)
        results = launch(compile_job, (name, plan, args.backend, args.warmup, args.steps, args.seq),
                         LaunchConfig(nproc=2, backend="gloo", timeout_s=1800, collective_timeout_s=900))
        for result in results:
            print(json.dumps(dict(result, plan=run)), flush=True)


if __name__ == "__main__":
    main()
