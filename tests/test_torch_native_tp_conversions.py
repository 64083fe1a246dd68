"""An unpipelined tensor-parallel plan runs the plan's backward all-reduces (`lowering.gathered_inputs`).

Megatron's layout all-reduces a replicated activation's gradient once, however many column-parallel
projections read it (LLaMA's q/k/v, its gate/up). torch's `ColwiseParallel` converts each projection's
input on its own, so its backward all-reduced each projection's partial input gradient apart (11 a step on
the 2-layer LLaMA where the plan has 5); the lowering converts the parent's input once instead
(`PrepareModuleInput`, torchtitan's layout), and the projections' gradients meet as one partial sum,
all-reduced once. The lowering is read without processes; on 2 gloo ranks one step's collectives are
counted (by phase, as tests/test_torch_native_sequence_products.py counts them) and equal what the cost
model prices for the plan (`cost.pcg_tasks.TORCH_NATIVE`). The Hugging Face models' trained losses, norms
and weights under these plans are tests/test_torch_native_runtime.py's slow tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from parsat.backend.executor import operator_library  # noqa: E402
from parsat.backend.torch_native.apply import module_info  # noqa: E402
from parsat.backend.torch_native.lowering import COLWISE, PREPARE_STYLE, lower  # noqa: E402
from parsat.importer.export import import_module  # noqa: E402
from parsat.ir.megatron import megatron_pcg  # noqa: E402

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _tp_plan(name: str):
    """(module, example inputs, the tp 2 Megatron PCG, its graph, its lowering) of a Hugging Face model, dropout off."""
    from costmodel_fidelity_torch import model

    module, inputs = model(name)
    imported = import_module(module, inputs, check=False)
    pcg = megatron_pcg(imported.graph, operator_library(), (1, 2))
    return module, inputs, pcg, imported.graph, lower(pcg, imported.graph, module_info(module, imported.weights))


def _priced_backward_all_reduces(pcg) -> int:
    """The activation all-reduces in backward that the torch-native profile prices for `pcg`."""
    from parsat.cost.pcg_tasks import TORCH_NATIVE, simulate_pcg
    from parsat.ir.machine import Machine

    step = simulate_pcg(pcg, operator_library(), Machine.preset("cpu").with_devices(2), TORCH_NATIVE).result
    return sum(1 for s in step.spans if s.phase == "backward_comm" and s.name.endswith("all-reduce"))


def test_llama_tp_converts_each_attention_and_mlp_input_once():
    """q/k/v and gate/up read their parent's input, converted once (`PrepareModuleInput`, a `Replicate()`
    DTensor kept for them); lm_head, alone under the root, converts its own; o_proj / down_proj unchanged."""
    _module, _inputs, pcg, _graph, low = _tp_plan("llama")
    styles = {s.module: s for s in low.styles}
    for layer in (0, 1):
        prefix = f"model.model.layers.{layer}."
        for parent, projections in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
            prepared = styles[prefix + parent]
            assert (prepared.kind, prepared.input_layout) == (PREPARE_STYLE, "replicate"), prepared
            node, = prepared.nodes
            assert pcg.node(node).op == "replicate"
            assert "input_layouts=Replicate(), desired_input_layouts=Replicate(), use_local_output=False" in \
                prepared.describe()
            for name in projections:   # the replicate is the parent's, not the projection's
                style = styles[f"{prefix}{parent}.{name}"]
                assert style.kind == COLWISE and node not in style.nodes
    head = styles["model.lm_head"]
    assert head.kind == COLWISE and any(pcg.node(n).op == "replicate" for n in head.nodes)


def counted_job(ctx, names: list[str]) -> dict:
    """On every rank, per Hugging Face model: its tp 2 Megatron plan lowered with `runtime="torch"`, one forward and
    backward on this rank's local batch, the functional collectives DTensor issued counted by phase."""
    import mesh_plans
    import parsat
    from parsat.backend.torch_native.apply import local_batch
    from test_torch_native_sequence_products import counted

    out = {}
    for name in names:
        module, inputs, pcg, graph, _low = _tp_plan(name)
        net = parsat.parallelize(module, mesh_plans.plan_dict(graph, pcg), inputs, runtime="torch")
        batch = local_batch(net, *inputs)
        with counted() as counts:
            net(*batch).backward()
        out[name] = dict(counts)
    return out


@pytest.mark.slow
def test_tp_plans_run_the_plans_backward_all_reduces_on_two_ranks():
    """LLaMA's tp 2 plan: 5 backward all-reduces a step (one per attention, one per MLP, one for the head), the
    plan's and the cost model's, where each style converting its own input ran 11; GPT-2's (one fused c_attn, one
    c_fc: one reader each) 7 before and after; BERT's (query/key/value under one parent) 6, priced 10 before."""
    from parsat.backend.launch import LaunchConfig, launch

    names = ["llama", "gpt2", "bert"]
    results = launch(counted_job, (names,), LaunchConfig(nproc=2, backend="gloo", timeout_s=600))
    assert results[0] == results[1]
    for name in names:
        pcg = _tp_plan(name)[2]
        ran = results[0][name].get("bwd all_reduce", 0)
        assert ran == _priced_backward_all_reduces(pcg), (name, results[0][name])
    assert results[0]["llama"]["bwd all_reduce"] == 5, results[0]["llama"]
