"""Convolutional models with batch norm in training mode and max pooling, and a safe vocabulary-parallel logsumexp.

On 2 CPU ranks: a small CNN (conv, batch norm, relu, padded max pooling,
global average pooling, cross-entropy) trained data-parallel with
synchronized batch statistics, checked against the unmodified module
(loss, gradients, weights, and the running statistics torch keeps); the
import leaves the module's buffers alone; what the import refuses; the
assembly of a statistic left spread over ranks; and a vocabulary-parallel
logsumexp of logits far beyond exp's range.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import parsat  # noqa: E402
from parsat.backend import running_stats  # noqa: E402
from parsat.backend.executor import TrainConfig, compare_values  # noqa: E402
from parsat.importer.errors import TorchImportError  # noqa: E402
from parsat.importer.export import import_module  # noqa: E402
from parsat.cli import main  # noqa: E402

MODELS = '''
import torch
from torch import nn


class SmallCNN(nn.Module):
    """ResNet's stem and one block, shrunk: conv, batch norm, relu, 3x3/2 max pooling with padding 1."""

    def __init__(self, momentum=0.1):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4, momentum=momentum)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(6)
        self.head = nn.Linear(6, 5)

    def forward(self, x, labels):
        h = self.pool(torch.relu(self.bn(self.conv(x))))
        h = torch.relu(self.bn2(self.conv2(h)))
        return nn.functional.cross_entropy(self.head(h.mean(dim=(2, 3))), labels)


def cnn():
    return SmallCNN(), (torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("cnn") / "models.py"
    path.write_text(textwrap.dedent(MODELS), encoding="utf-8")
    return path


def _cnn(models):
    from parsat.importer.model_file import load_model_factory

    return load_model_factory(f"{models}:cnn")


def test_cnn_trains_data_parallel_with_synchronized_batch_norm_like_the_module(models, tmp_path, capsys):
    plan = tmp_path / "cnn.json"
    assert main(["optimize", f"{models}:cnn", "--devices", "2", "--machine", "h100x8", "-q", "-o", str(plan)]) == 0
    data = json.loads(plan.read_text())
    dp = data["baselines"]["data_parallel"]["pcg"]["nodes"]
    assert sum(n["op"] == "reduce" and n["origin"].endswith(("_mean", "_var")) for n in dp) == 4  # synchronized
    assert any(n["op"] == "maxpool2d_padded" and n["spread"]["shard"][0] == 2 for n in dp)
    capsys.readouterr()
    code = main(["run", str(plan), "--nproc", "2", "--check", "--json", "--model", f"{models}:cnn",
                 "--plan-of", "data_parallel"])
    out = capsys.readouterr().out
    result = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert code == 0 and result["check"] == "passed", out
    assert result["max_rel_diff"] < 1e-9


def test_import_leaves_the_running_statistics_alone_and_records_them(models):
    module, inputs = _cnn(models)
    before = {k: v.clone() for k, v in module.named_buffers()}
    imported = import_module(module, inputs)
    assert all(torch.equal(v, before[k]) for k, v in module.named_buffers())
    stats = {s.running_mean: s for s in imported.running_stats}
    assert set(stats) == {"bn.running_mean", "bn2.running_mean"}
    assert stats["bn.running_mean"].count == 4 * 8 * 8 and stats["bn.running_mean"].momentum == 0.1
    assert stats["bn2.running_mean"].count == 4 * 4 * 4 and stats["bn2.running_mean"].batches_tracked == \
        "bn2.num_batches_tracked"


def test_running_statistics_that_differ_fail_the_comparison(models):
    module, inputs = _cnn(models)
    imported = import_module(module, inputs)
    other = _cnn(models)[0]
    with torch.no_grad():
        other.bn.running_var.mul_(1.5)
    found = compare_values(running_stats.compared(module, other, imported.running_stats))
    assert found.max_rel > 0.3 and "bn.running_var" in found.worst


@pytest.mark.parametrize("change,message", [
    ("model.bn.momentum = None", "momentum=None"),
    ("model.pool = torch.nn.MaxPool2d(2, 2, 1)", "padding below half the kernel"),
    ("model.pool = torch.nn.MaxPool2d(3, 2, 1, ceil_mode=True)", "no ceil_mode"),
])
def test_what_the_import_refuses_is_said(models, change, message):
    model, inputs = _cnn(models)
    exec(change, {"model": model, "torch": torch})
    with pytest.raises(TorchImportError) as err:
        import_module(model, inputs)
    assert message in str(err.value) and "Traceback" not in str(err.value)


def _whole_values(ctx):
    import torch.distributed as dist

    from parsat.backend.collectives import CommCounter
    from parsat.ir.mesh import Mesh
    from parsat.ir.placement import PARTIAL, Placement, shard

    rank = dist.get_rank()
    full = torch.arange(6.0)
    counter = CommCounter()
    mesh = Mesh.of((2,), 1)
    by_channel = running_stats.whole_value(full[rank * 3:(rank + 1) * 3].clone(), Placement((shard(0),)), (6,),
                                           mesh, counter)
    summed = running_stats.whole_value(full * (rank + 1), Placement((PARTIAL,)), (6,), mesh, counter)
    return {"by_channel": by_channel.tolist(), "summed": summed.tolist(), "events": len(counter.events)}


def _whole_values_then_the_plan(ctx, pcg, config, graph) -> dict:
    """`_whole_values`, then `pcg` trained (`run_rank`), in one process group: one launch for both tests."""
    from parsat.backend.executor import run_rank

    return {"whole": _whole_values(ctx), "plan": run_rank(ctx, pcg, config, graph)}


@pytest.fixture(scope="module")
def two_ranks():
    """The statistics assembled over 2 ranks, and the logsumexp plan (`big_logits_plan`) trained 2 steps with
    --check on them, in ONE launch (a launch is two fresh processes importing torch): (each rank's results,
    the plan's dict, the plan's RunResult)."""
    from parsat.backend.executor import RunResult
    from parsat.backend.launch import LaunchConfig, launch
    from parsat.ir.plan import pcg_from_dict

    graph, plan = big_logits_plan()
    config = TrainConfig(steps=2, check=True)
    results = launch(_whole_values_then_the_plan, (pcg_from_dict(plan), config, graph),
                     LaunchConfig(nproc=2, timeout_s=300))
    return [r["whole"] for r in results], plan, RunResult.of_job([r["plan"] for r in results], config)


def test_a_statistic_left_spread_over_ranks_is_assembled(two_ranks):
    results = two_ranks[0]
    assert len(results) == 2
    for result in results:
        assert result["by_channel"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert result["summed"] == [3.0 * v for v in range(6)]
        assert result["events"] == 2


def big_logits_plan() -> tuple:
    """(graph, the optimizer's plan dict) of logits near 1000 (a scaled weight) and their logsumexp, on 2 devices
    of a machine whose compute is slow and links free, with only the vocabulary-parallel logsumexp rules."""
    from parsat.dsl import ast
    from parsat.dsl.library import load_library, shipped_rules_dir
    from parsat.ir.graph import GraphBuilder
    from parsat.ir.machine import Machine

    shipped, _ = load_library([shipped_rules_dir()])
    keep = {"logsumexp_shifted_parts", "amax_vocab_parallel", "sumexp_shifted_vocab_parallel"}
    library = replace(shipped, modules=tuple(
        replace(m, items=tuple(i for i in m.items if not isinstance(i, ast.RuleDecl) or i.name in keep))
        for m in shipped.modules))
    builder = GraphBuilder(library, name="big_logits")
    logits = builder.op("scale", builder.weight("w", (4, 64)), c=1000.0, name="logits")
    builder.output(builder.op("logsumexp", logits, name="lse"))
    graph = builder.build()
    slow = replace(Machine.resolve("h100x8"), peak_flops=1e3, intra_bandwidth=1e13, intra_latency=1e-12)
    return graph, parsat.optimize(graph, machine=slow, rules=library, devices=2, baselines=False).to_dict()


def test_a_vocabulary_parallel_logsumexp_stays_finite_beyond_exps_range(two_ranks):
    """Logits near 1000 (exp overflows float64 above 709): the vocabulary split takes each shard's max, gathers
    them, and sums exp(x - max) per shard; the plan trains with --check passing."""
    _, plan, result = two_ranks
    ops = {(n["op"], tuple(n["spread"]["shard"])) for n in plan["nodes"] if n["kind"] != "leaf"}
    assert ("sumexp_shifted", (1,)) in ops and ("amax", (1, 2)) in ops and ("logsumexp", (1,)) not in ops
    assert result.check == "passed" and result.nonfinite == 0, result
    assert min(result.losses) > 709.0 ** 2  # the logsumexps are far above 709, where exp overflows
