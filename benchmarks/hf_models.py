"""Hugging Face models imported as they are, optimized, and trained with `parsat.parallelize` (issue 18).

Five models from small configs (2 layers, hidden 64-128, random weights):
GPT2LMHeadModel, LlamaForCausalLM, BertForMaskedLM,
ViTForImageClassification, ResNetForImageClassification. The only code
around them is `Loss`, a wrapper whose forward returns the model's own
training loss (`use_cache=False` for the causal LMs).

Five modes:

  python benchmarks/hf_models.py optimize [--devices 2 4 8] [--out DIR]
      import each model with torch.export, optimize it for each device count
      (machine h100x8), write the plans, print one JSON line per plan.

  python benchmarks/hf_models.py tensor-parallel [--models gpt2 llama] [--devices 2 4]
      a tensor-parallel plan per model and device count (inputs pinned as
      copies, a machine where splitting always pays: see
      `optimize_tensor_parallel`), printed as how it splits the weights.

  torchrun --nproc-per-node N benchmarks/hf_models.py train [--out DIR]
      on N CPU ranks: `parsat.parallelize(model, plan, inputs)` with the
      N-device plan, the user's own loop (torch.optim.SGD, 3 steps, the same
      global batch on every rank), and in every rank the unmodified module
      trained the same 3 steps with torch (same dropout masks), compared
      step by step: loss, gradients and updated weights (relative
      differences, `executor.compare_values`). Rank 0 prints one JSON line
      per model.

  python benchmarks/hf_models.py blocks [--models llama gpt2 bert vit] [--layers 2 4]
      import each model with that many layers and say the identical blocks
      the import found by structure (`ir.block_layout`) and how it named them.

  python benchmarks/hf_models.py llama-7b [--batch 128] [--microbatches 4] [--devices 64]
      Llama-2-7B's configuration (32 layers, hidden 4096) built on the meta
      device, imported at batch x 2048 tokens, optimized for `--devices`
      devices (machine h100x8, default limits) as `--microbatches`
      micro-batches a step; one JSON line: CPU seconds, blocks, the plan.

The recorded results and the commands that made them are in
benchmarks/hf_models_results.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

MODELS = ("gpt2", "llama", "bert", "vit", "resnet")
BATCH = 8


class Loss(torch.nn.Module):
    """A Hugging Face model whose forward returns its training loss: the only code around it.

    `padded_keys` (masked LMs): that many last positions of every sequence are padding no query attends to, a
    fixed layout whose attention mask is made from the shapes only (a constant, never from the inputs): BERT's
    attention then stays written out with that constant mask (`softmax_masked`), where without padding its
    all-ones mask is no mask and the importer makes the fused `attention`."""

    def __init__(self, model, kind: str, padded_keys: int = 0):
        super().__init__()
        self.model, self.kind, self.padded_keys = model, kind, padded_keys

    def forward(self, x, labels):
        if self.kind in ("causal", "seq2seq"):
            return self.model(input_ids=x, labels=labels, use_cache=False).loss
        if self.kind == "masked" and self.padded_keys:
            keep = torch.ones(x.shape, dtype=torch.long, device=x.device)
            keep[:, x.shape[1] - self.padded_keys:] = 0
            return self.model(input_ids=x, attention_mask=keep, labels=labels).loss
        if self.kind == "masked":
            return self.model(input_ids=x, labels=labels).loss
        if self.kind == "speech":
            return self.model(input_features=x, labels=labels, use_cache=False).loss
        return self.model(pixel_values=x, labels=labels).loss


def make(name: str, seed: int = 0, layers: int = 2):
    """(wrapped model, example inputs) of one benchmark model, seeded (`layers`: of the transformers)."""
    import transformers as T

    torch.manual_seed(seed)
    ids = torch.randint(1, 256, (BATCH, 32))
    if name == "gpt2":
        config = T.GPT2Config(n_layer=layers, n_embd=128, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0,
                              eos_token_id=0)
        return Loss(T.GPT2LMHeadModel(config), "causal"), (ids, ids)
    if name == "llama":
        config = T.LlamaConfig(num_hidden_layers=layers, hidden_size=128, intermediate_size=256,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                               max_position_embeddings=64)
        return Loss(T.LlamaForCausalLM(config), "causal"), (ids, ids)
    if name == "bert":
        config = T.BertConfig(num_hidden_layers=layers, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                              vocab_size=256, max_position_embeddings=64)
        labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
        return Loss(T.BertForMaskedLM(config), "masked"), (ids, labels)
    if name == "vit":
        config = T.ViTConfig(num_hidden_layers=layers, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                             image_size=32, patch_size=8, num_labels=10)
        return Loss(T.ViTForImageClassification(config), "image"), (torch.randn(BATCH, 3, 32, 32),
                                                                    torch.randint(0, 10, (BATCH,)))
    if name == "resnet":
        config = T.ResNetConfig(embedding_size=32, hidden_sizes=[64, 128], depths=[1, 1], num_labels=10,
                                layer_type="basic")
        return Loss(T.ResNetForImageClassification(config), "image"), (torch.randn(BATCH, 3, 32, 32),
                                                                       torch.randint(0, 10, (BATCH,)))
    raise SystemExit(f"unknown model {name}")


def optimize(args) -> None:
    import parsat
    from parsat.importer.errors import TorchImportError
    from parsat.importer.export import import_module

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        module, inputs = make(name)
        start = time.process_time()
        try:
            graph = import_module(module, inputs).graph
        except TorchImportError as err:
            print(json.dumps({"model": name, "import": "failed", "error": str(err)}), flush=True)
            continue
        imported_s = time.process_time() - start
        ops = sorted({n.op for n in graph.nodes})
        for devices in args.devices:
            start = time.process_time()
            plan = parsat.optimize(graph, machine=args.machine, devices=devices)
            seconds = time.process_time() - start
            plan.save(out / f"{name}-{devices}.json")
            data = plan.to_dict()
            baseline = (data.get("baselines") or {}).get("data_parallel")
            if isinstance(baseline, dict):  # the data-parallel baseline as a plan of its own, to train it too
                source = baseline.get("pcg") if isinstance(baseline.get("pcg"), dict) else baseline
                (out / f"{name}-{devices}-data_parallel.json").write_text(json.dumps(
                    {**data, **{k: source[k] for k in ("nodes", "outputs", "mesh") if k in source}}))
            row = {"model": name, "devices": devices, "nodes": len(graph.nodes), "operators": len(ops),
                   "weights": len(graph.weights), "import_cpu_s": round(imported_s, 2),
                   "optimize_cpu_s": round(seconds, 2), "parsat_ms": data["totals"]["time_s"] * 1e3,
                   "stop": data.get("saturation", {}).get("stop_reason")}
            for base in ("data_parallel", "megatron", "sequential"):
                b = (data.get("baselines") or {}).get(base)
                row[f"{base}_ms"] = b["time_s"] * 1e3 if isinstance(b, dict) and "time_s" in b else None
            print(json.dumps(row), flush=True)


def blocks(args) -> None:
    """Each model imported with each layer count: the identical blocks found by structure, and their names."""
    from parsat.importer.export import import_module
    from parsat.ir.block_layout import named_layout

    for name in args.models:
        for layers in args.layers:
            module, inputs = make(name, layers=layers)
            start = time.process_time()
            imported = import_module(module, inputs)
            seconds = time.process_time() - start
            layout = named_layout(imported.graph)
            renamed = {leaf: param for leaf, param in imported.weights.items() if leaf != param}
            example = next(iter(sorted(renamed.items(), key=lambda kv: kv[1])), None)
            print(json.dumps({"model": name, "layers": layers, "blocks": layout.count if layout else 0,
                              "tensors_per_block": len(layout.members[0]) if layout else 0,
                              "weights_renamed": len(renamed), "weights": len(imported.graph.weights),
                              "example": example, "import_cpu_s": round(seconds, 2)}), flush=True)


def llama_7b(args) -> None:
    """Llama-2-7B's configuration on the meta device, imported and optimized (one JSON line)."""
    import transformers as T

    import parsat
    from parsat.importer.export import import_module
    from parsat.ir.block_layout import named_layout

    seq = 2048
    config = T.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                           vocab_size=32000, max_position_embeddings=seq)
    start = time.process_time()
    with torch.device("meta"):
        module = Loss(T.LlamaForCausalLM(config), "causal")
        ids = torch.randint(0, 32000, (args.batch, seq))
    built = time.process_time() - start
    start = time.process_time()
    graph = import_module(module, (ids, ids)).graph
    imported = time.process_time() - start
    limits = {key: float(value) if "." in value else int(value)
              for key, value in (item.split("=", 1) for item in args.limit)}
    start = time.process_time()
    plan = parsat.optimize(graph, machine=args.machine, devices=args.devices, limits=limits or None,
                           microbatches=args.microbatches if args.microbatches > 1 else None,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    optimized = time.process_time() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan.save(out / f"llama-7b-imported-{args.batch}x{args.microbatches}-{args.devices}.json")
    data = plan.to_dict()
    layout = named_layout(graph)
    print(json.dumps({"batch": args.batch, "microbatches": args.microbatches, "devices": args.devices,
                      "build_cpu_s": round(built, 2), "import_cpu_s": round(imported, 2),
                      "optimize_cpu_s": round(optimized, 2), "nodes": len(graph.nodes),
                      "operators": sorted({n.op for n in graph.nodes}), "blocks": layout.count if layout else 0,
                      "step_ms": data["totals"]["time_s"] * 1e3,
                      "memory_gib": data["totals"]["peak_memory_bytes"] / 2**30,
                      "repeated_blocks": data["saturation"].get("repeated_blocks"),
                      "stop": data["saturation"].get("stop"), "enodes": data["saturation"].get("enodes")}),
          flush=True)


def tensor_parallel_machine(base: str):
    """The machine a tensor-parallel plan is made for: `base` with devices 1e5x slower at compute, 1e3x slower
    at memory, and links that cost nothing. At these model sizes a real machine splits nothing (a collective
    costs more than the whole step); on this one every split that takes work or bytes off a device pays for
    itself, and a weight read whole costs more than its stored shard."""
    from dataclasses import replace

    from parsat.ir.machine import Machine

    machine = Machine.resolve(base)
    return replace(machine, name=f"{machine.name}-slow-compute-free-links", peak_flops=machine.peak_flops / 1e5,
                   memory_bandwidth=machine.memory_bandwidth / 1e3, intra_bandwidth=1e13, intra_latency=1e-9,
                   inter_bandwidth=1e13, inter_latency=1e-9)


def optimize_tensor_parallel(args) -> None:
    """A tensor-parallel plan per model and device count: every graph input pinned to arrive as a copy on each
    device (no batch to split: data parallelism is off the table), optimized for `tensor_parallel_machine`.
    What the extraction then picks is reported by how it splits the weights."""
    import parsat
    from parsat.importer.export import import_module

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        module, inputs = make(name)
        graph = import_module(module, inputs).graph
        machine = tensor_parallel_machine(args.machine)
        for devices in args.devices:
            pins = {leaf.name: {"shard": [1] * len(leaf.shape), "copy": devices} for leaf in graph.leaves
                    if leaf.role == "input"}
            start = time.process_time()
            plan = parsat.optimize(graph, machine=machine, devices=devices, input_spreads=pins, baselines=False)
            seconds = time.process_time() - start
            plan.save(out / f"{name}-{devices}-tensor_parallel.json")
            data = plan.to_dict()
            print(json.dumps({"model": name, "devices": devices, "plan": "tensor_parallel",
                              "optimize_cpu_s": round(seconds, 2), **split_summary(data)}), flush=True)


def split_summary(plan: dict) -> dict:
    """How a plan splits the weights (2-D and up): by dim, replicated, or whole; and its collectives."""
    nodes = {n["id"]: n for n in plan["nodes"]}
    users: dict[int, list] = {}
    for n in plan["nodes"]:
        for i in n["inputs"]:
            users.setdefault(i, []).append(n)
    weights = {}
    for n in plan["nodes"]:
        if n["kind"] == "leaf" and n.get("role") == "weight" and len(n["shape"]) >= 2:
            first = [u for u in users.get(n["id"], []) if u["kind"] == "parallel"]
            how = [f"{u['op']}(dim {u['attrs']['dim']})" if "dim" in u["attrs"] else u["op"] for u in first]
            weights[n["op"]] = ", ".join(how) or "whole"
    counts: dict[str, int] = {}
    for how in weights.values():
        counts[how] = counts.get(how, 0) + 1
    collectives: dict[str, int] = {}
    for n in nodes.values():
        if n["kind"] == "parallel" and n["op"] in ("reduce", "combine", "all_to_all"):
            collectives[n["op"]] = collectives.get(n["op"], 0) + 1
    sharded_ops = sorted({n["op"] for n in nodes.values() if n["kind"] == "op" and n["spread"]["shard"]
                          and max(n["spread"]["shard"]) > 1})
    return {"matrices": counts, "collectives": collectives, "ops_on_sharded_dims": sharded_ops,
            "grad_sync_elements": plan["totals"]["grad_sync_elements"], "predicted_ms": plan["totals"]["time_s"] * 1e3}


def train_one(module, inputs, plan_path, steps: int, tolerance: float) -> dict:
    """`parsat.parallelize(module, plan)` trained `steps` steps of the user's SGD loop on this rank, beside the
    unmodified module (a deep copy, the same dropout masks) trained by torch; every step the loss, each gradient
    and each updated weight (this rank's piece against the same piece of the reference) compared by relative
    difference. Float64 throughout. Returns the row rank 0 prints (every rank must call it: it all-reduces)."""
    import torch.distributed as dist

    import parsat
    from parsat.backend.executor import Comparison, compare_values, gradient_of
    from parsat.backend import running_stats
    from parsat.backend.parallelize import ReferenceDropout
    from parsat.ir.placement import piece_index

    world, rank = dist.get_world_size(), dist.get_rank()
    module = module.double()
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    reference = copy.deepcopy(module)
    start = time.process_time()
    pmodule = parsat.parallelize(module, str(plan_path), inputs)
    optimizer = torch.optim.SGD(pmodule.parameters(), lr=0.01)          # the user's own loop
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    found, losses = Comparison(), []
    for step in range(steps):
        loss = pmodule(*inputs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with ReferenceDropout(pmodule.imported.dropout, pmodule.seed, step):
            want = reference(*inputs)
        ref_optimizer.zero_grad()
        want.backward()
        ref_optimizer.step()
        pairs = [("loss", loss.detach(), want.detach())]
        for weight, (placement, shape) in pmodule.piece_placements().items():
            where = piece_index(placement, shape, pmodule.pcg.mesh, rank)
            piece, ref = pmodule.named_pieces()[weight], reference.get_parameter(weight)
            pairs.append((f"gradient of {weight}", gradient_of(piece), gradient_of(ref)[where]))
            pairs.append((f"weight {weight}", piece.detach(), ref.detach()[where]))
        pairs += running_stats.compared(pmodule.module, reference, pmodule.imported.running_stats)
        found = found.merge(compare_values(pairs))
        losses.append(float(loss.detach()))
    seconds = time.process_time() - start
    worst = torch.tensor([found.max_rel, float(len(found.nonfinite))], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    state = parsat.gather_weights(pmodule)  # the module's own names and layouts, trained
    verdict = "passed" if worst[1] == 0 and worst[0] <= tolerance else "failed"
    return {"ranks": world, "steps": steps, "check": verdict, "tolerance": tolerance,
            "max_rel_diff": float(worst[0]), "worst_on_rank0": found.worst, "losses": losses,
            "comm_elements_step": float(pmodule.counter.sent()) / steps,
            "state_dict_keys": len(state), "cpu_s_rank0": round(seconds, 2)}


def train(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, plan_of in [(m, p) for m in args.models for p in ("parsat", "data_parallel", "tensor_parallel")]:
        plan_path = Path(args.out) / (f"{name}-{world}.json" if plan_of == "parsat" else
                                      f"{name}-{world}-{plan_of}.json")
        if not plan_path.is_file():
            continue
        module, inputs = make(name)
        row = train_one(module, inputs, plan_path, args.steps, 1e-6)
        if rank == 0:
            print(json.dumps({"model": name, "plan": plan_of, **row}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("optimize", "tensor-parallel", "train", "blocks", "llama-7b"))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--devices", nargs="+", type=int, default=None)
    parser.add_argument("--machine", default="h100x8")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("PARSAT_HF_PLANS", "benchmarks/hf_plans"))
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--limit", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.mode == "llama-7b":
        args.devices = (args.devices or [64])[0]
    else:
        args.devices = args.devices or [2, 4, 8]
    {"optimize": optimize, "tensor-parallel": optimize_tensor_parallel, "train": train, "blocks": blocks,
     "llama-7b": llama_7b}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
