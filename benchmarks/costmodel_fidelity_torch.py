"""`costmodel_fidelity.py --runtime torch`: the plans run through `parsat.parallelize(..., runtime="torch")`.

The interpreter's graphs (built-in mlp, transformer, gpt) have no torch
module, and the torch-native runtime runs the user's module; so this
runtime's rows are the Hugging Face models of benchmarks/hf_models.py
(`make`, code unchanged, dropout off, float32), imported with
`parsat.from_torch`, under the Megatron-layout plans the lowering takes
(`ir.megatron.megatron_pcg`): data parallel (`replicate`), ZeRO-3
(`fully_shard`), tensor parallel (`ColwiseParallel` / `RowwiseParallel`;
LLaMA only: GPT-2's projections are `Conv1D`, BERT's tied decoder is
refused) and, on 4 ranks, 2 x 2 (data x tensor, LLaMA); a plan the
lowering refuses is left out, saying why on stderr (LLaMA's tp 4: the
Megatron layout partitions an activation between two styles, where the
module's own code runs on local pieces). The optimizer's
own plans of these models are not run: `parsat optimize` of an imported
transformer takes minutes on the shared 2-core box, and its per-layer
choices often mix roles on one mesh axis, which the lowering refuses.

Predicted: the step simulator on the plan's mesh PCG with the library's
profile of this runtime, `cost.pcg_tasks.TORCH_NATIVE` (collectives
inline and blocking, activations freed by backward, integer ids rather
than seeded one-hots, FSDP2's parameter groups, torch's tensor-parallel
styles on DTensors, the loss each rank's own, SGD), with the machine
`parsat calibrate --dtype float32 --dtensor` measured just before and
just after (as for the interpreter; float32, as these runs train). Measured, per plan:
the median step (forward, backward, `optimizer.step()`, `zero_grad()`;
SGD lr 1e-3 on `local_batch` of a fixed global batch; each step starts at
a barrier; wall seconds, the slowest rank's, as the interpreter's rows; the
first step dropped) and, on one more step that is not timed (runs T1-T3
timed the bookkeeping with the step: 4-9 ms CPU of DTensor reads a step),
live bytes as the simulator samples them: at the end of forward, the rank's parameter
pieces plus the distinct storages autograd saved for backward plus the
loss; at the end of backward, parameters plus gradients; the larger.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from parsat.cost.pcg_tasks import TORCH_NATIVE  # noqa: E402

MODELS = ("gpt2", "llama", "bert")
SHAPES = {2: {"dp": ((2, 1), 0), "zero3": ((2, 1), 3), "tp": ((1, 2), 0)},
          4: {"dp": ((4, 1), 0), "zero3": ((4, 1), 3), "tp": ((1, 4), 0), "dp2xtp2": ((2, 2), 0)}}
TENSOR_MODELS = ("llama",)   # the models whose tensor-parallel plans the lowering takes


def model(name: str):
    """(module, example inputs) of `hf_models.make(name)` with dropout off (each rank would draw its own)."""
    import hf_models
    from torch import nn

    module, inputs = hf_models.make(name)
    for sub in module.modules():
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0
    return module, inputs


def torch_plans(n: int, machine, models: list[str], devices_per_node: int | None = None
                ) -> list[tuple[str, object, object, object]]:
    """(label, pcg, graph, PlanFigures) of each model's Megatron-layout plans on `n` ranks, on a mesh of
    `devices_per_node` ranks a node (default the machine's: the `n` ranks of this box are one node, and their
    groups are priced by the collectives' measured table, which holds the intra-node link only; runs T1-T5
    built the meshes with 1 rank a node, so every group was priced as crossing nodes, by the analytic ring
    model from the all-reduce's figures: a reduce-scatter or all-gather's own measurements went unused)."""
    per_node = machine.devices_per_node if devices_per_node is None else devices_per_node
    from costmodel_fidelity import PlanFigures
    from parsat.backend.executor import operator_library
    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.lowering import LoweringError
    from parsat.backend.torch_native.rewritten import lowered_plan
    from parsat.cost.pcg_tasks import simulate_pcg
    from parsat.importer.call_count import count_module_calls
    from parsat.importer.export import import_module
    from parsat.ir.costs import totals
    from parsat.ir.megatron import megatron_pcg
    from parsat.search.baselines import price_pcg

    library = operator_library()
    out = []
    for name in models:
        module, inputs = model(name)
        imported = import_module(module, inputs, check=False)
        graph, info = imported.graph, module_info(module, imported.weights)
        profile = TORCH_NATIVE.running(count_module_calls(module, inputs, graph))
        for label, (shape, zero) in SHAPES[n].items():
            if shape[1] > 1 and name not in TENSOR_MODELS:
                continue
            pcg = megatron_pcg(graph, library, shape, per_node, zero=zero)
            if pcg is None:
                print(f"{name}/{label} on {n} ranks: no Megatron layout", file=sys.stderr)
                continue
            try:   # as `parallelize` lowers it given the example inputs (the rewritten forward where no style runs)
                lowered_plan(pcg, graph, info, imported, library)
            except LoweringError as err:
                print(f"{name}/{label} on {n} ranks: not lowered ({err})", file=sys.stderr)
                continue
            summed = totals(price_pcg(pcg, library, machine), machine)
            out.append((f"{name}/{label}", pcg, graph,
                        PlanFigures(simulate_pcg(pcg, library, machine, profile).step_s, summed.time_s,
                                    summed.peak_memory_bytes, profile)))
    return out


def lowered(label: str, plan: dict) -> tuple:
    """On this rank: (the unmodified module of `label`'s model, it lowered with `runtime="torch"`, its SGD
    optimizer, this rank's local batch): what `torch_many` and `costmodel_fidelity_phases.py` step."""
    import torch

    import parsat
    from parsat.backend.torch_native.apply import local_batch

    module, example = model(label.split("/")[0])
    net = parsat.parallelize(module, plan, example, runtime="torch")
    return module, net, torch.optim.SGD(net.parameters(), lr=1e-3), local_batch(net, *example)


def phased_step(net, optimizer, batch, sample=time.perf_counter) -> list:
    """One SGD step after a barrier, as `torch_many` times it: `sample()` at its start, after forward (the loss
    included), after backward, after `optimizer.step()` and after `zero_grad()` (five readings), for the probes
    that split a step by phase (`costmodel_fidelity_phases.py`, `costmodel_fidelity_split.py`)."""
    import torch.distributed as dist

    dist.barrier()
    readings = [sample()]
    loss = net(*batch)
    readings.append(sample())
    loss.backward()
    readings.append(sample())
    optimizer.step()
    readings.append(sample())
    optimizer.zero_grad()
    readings.append(sample())
    return readings


def torch_many(ctx, jobs: list[tuple[str, dict]], steps: int) -> dict:
    """On every rank, per (label, plan dict): the model lowered with `runtime="torch"`, `steps` SGD steps on this
    rank's local batch; this rank's step times and live bytes (module docstring)."""
    import torch
    import torch.distributed as dist

    out = {}
    for label, plan in jobs:
        _, net, optimizer, batch = lowered(label, plan)
        times = []
        for _ in range(steps):   # timed: the step alone
            start, *_, end = phased_step(net, optimizer, batch)
            times.append(end - start)
        # one more step, untimed, for the memory: the bookkeeping reads every parameter (a DTensor operator
        # each) and hooks every saved tensor, 4-9 ms CPU a step on these models, which run T3 timed
        dist.barrier()
        saved: dict[int, int] = {}
        with torch.autograd.graph.saved_tensors_hooks(_recorder(saved), lambda t: t):
            loss = net(*batch)
        forward = _param_bytes(net, saved) + sum(saved.values()) + loss.nbytes
        loss.backward()
        backward = _param_bytes(net, {}) + _grad_bytes(net)
        optimizer.step()
        optimizer.zero_grad()
        out[label] = {"step_times": times, "peak_memory_bytes": max(forward, backward)}
        dist.barrier()
    return out


def slowest(per_rank: list[dict]) -> dict:
    """The ranks' figures as `parsat run` reports them: per step the slowest rank's time, the largest peak."""
    return {label: {"step_times": [max(times) for times in zip(*(r[label]["step_times"] for r in per_rank))],
                    "peak_memory_bytes": max(r[label]["peak_memory_bytes"] for r in per_rank)}
            for label in per_rank[0]}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _storage(t) -> tuple[int, int]:
    """(address, bytes) of a tensor's storage (a DTensor's local piece); (0, 0) where it holds none (a freed
    FSDP buffer, a tensor subclass without storage)."""
    try:
        storage = _local(t).untyped_storage()
        return (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else (0, 0)
    except (RuntimeError, NotImplementedError):
        return 0, 0


def _recorder(saved: dict):
    """A pack hook that records each saved tensor's storage once (by address) with its size."""
    def pack(t):
        address, size = _storage(t)
        if size:
            saved[address] = size
        return t
    return pack


def _param_bytes(net, seen: dict) -> int:
    """The rank's parameter storages, each once: FSDP2 makes a group's unsharded parameters views of one flat
    buffer (`replicate` keeps them after forward, and so does `fully_shard`'s root), so summing each parameter's
    storage counted that buffer once per parameter (run T1's 30-53 MiB). A storage autograd also saved is
    counted here only (removed from `seen`)."""
    storages = dict(_storage(p.data) for p in net.parameters())
    for address in storages:
        seen.pop(address, None)
    return sum(size for address, size in storages.items() if address)


def _grad_bytes(net) -> int:
    """The gradients' storages, each once (a group's reduced gradients may be views of one buffer)."""
    storages = dict(_storage(p.grad) for p in net.parameters() if p.grad is not None)
    return sum(size for address, size in storages.items() if address)


def repredict_memory(rows: list[dict]) -> list[dict]:
    """`rows` (a run's JSON) with the predicted memory of the current simulator: with collectives inline (one
    stream) the memory sampled at the end of forward and of backward depends on the tasks' order and sizes,
    not on the calibrated rates, so any float32 machine of the run's rank count gives it."""
    from parsat.backend.executor import operator_library
    from parsat.cost.pcg_tasks import simulate_pcg
    from parsat.ir.machine import Machine

    library, memory = operator_library(), {}
    for n in sorted({r["nproc"] for r in rows}):
        machine = Machine.preset("cpu").with_precision("fp32").with_devices(n)
        for label, pcg, _graph, figures in torch_plans(n, machine, sorted({r["plan"].split("/")[0] for r in rows})):
            memory[(n, label)] = float(simulate_pcg(pcg, library, machine, figures.profile).sampled_memory_bytes)
    return [dict(r, predicted_peak_bytes=memory[(r["nproc"], r["plan"])]) for r in rows]


if __name__ == "__main__":
    # python benchmarks/costmodel_fidelity_torch.py ROWS.json: the run's summary, memory predicted anew
    import json

    from costmodel_fidelity import summarize

    print(summarize(repredict_memory(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")))))
