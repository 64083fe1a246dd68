"""The user's module trained as a plan (`parsat run --model`, `parallelize`), checked against the module itself.

Small torch modules, 2 CPU ranks: an embedding plan (ids partitioned), a
tied embedding and LM head, `padding_idx`, dropout with real masks, a
non-finite value failing `--check`, and a graph that is not the plan's.
The Hugging Face models are in test_backend_hf.py (slow).
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import parsat  # noqa: E402
from parsat.backend.executor import TrainConfig, compare_values, operator_library  # noqa: E402
from parsat.importer.export import import_module  # noqa: E402
from parsat.cli import main  # noqa: E402
from parsat.ir.data_parallel import data_parallel_pcg  # noqa: E402
from parsat.ir.graph import Graph  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import mesh_plans  # noqa: E402

MODELS = '''
import torch
from torch import nn


class TiedLM(nn.Module):
    """Embedding and LM head share one parameter; cross-entropy over the vocabulary."""

    def __init__(self, vocab=32, width=16, padding_idx=None, dropout=0.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, width, padding_idx=padding_idx)
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids, labels):
        h = self.drop(self.norm(self.emb(ids)))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class Tagger(nn.Module):
    """Embedding -> LayerNorm -> Linear (the model of the embedding-ids bug)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 5)

    def forward(self, ids):
        return self.proj(self.norm(self.emb(ids)))


class Explodes(nn.Module):
    """sqrt of values that go negative: NaN on both sides."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.sqrt(self.fc(x)).mean()


def tied():
    ids = torch.randint(1, 32, (4, 6))
    return TiedLM(), (ids, torch.roll(ids, 1, dims=1))


def padded():
    ids = torch.randint(0, 32, (4, 6))
    ids[:, -2:] = 0
    model = TiedLM(padding_idx=0)
    with torch.no_grad():
        model.emb.weight[0] = 0.5  # a pad row that is not zero (pretrained weights): still never trained
    return model, (ids, torch.roll(ids, 1, dims=1))


def dropped():
    ids = torch.randint(1, 32, (4, 6))
    return TiedLM(dropout=0.5), (ids, torch.roll(ids, 1, dims=1))


def tagger():
    return Tagger(), torch.randint(0, 20, (4, 6))


def explodes():
    return Explodes(), torch.randn(4, 4)
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "models.py"
    path.write_text(textwrap.dedent(MODELS), encoding="utf-8")
    return path


def _optimize(models, factory: str, tmp_path, devices: int = 2) -> str:
    """The factory's module as a data-parallel plan file (`data_parallel_pcg` of its imported graph; every node
    computed on every rank where data parallelism does not apply), with the data_parallel baseline recorded
    without its PCG, so `--plan-of data_parallel` rebuilds it from the graph."""
    module, inputs = TiedLMFactory(models, factory)
    graph = parsat.from_torch(module, inputs)
    pcg = data_parallel_pcg(graph, operator_library(), devices) or mesh_plans.redundant_pcg(graph, operator_library(),
                                                                                           devices)
    plan = tmp_path / f"{factory}.json"
    plan.write_text(json.dumps(mesh_plans.plan_dict(graph, pcg, baselines={"data_parallel": None})), encoding="utf-8")
    return str(plan)


def _run(capsys, plan: str, models, factory: str, *extra: str, nproc: int = 2) -> tuple[int, dict, str]:
    capsys.readouterr()
    code = main(["run", plan, "--nproc", str(nproc), "--check", "--json", "--model", f"{models}:{factory}", *extra])
    out = capsys.readouterr()
    lines = [line for line in out.out.strip().splitlines() if line.startswith("{")]
    return code, (json.loads(lines[-1]) if lines else {}), out.out + out.err


def test_an_embedding_plan_passes_check_on_seeded_ids(two_rank_runs):
    """The embedding-ids bug: ids partitioned by the plan are still one-hot rows on every rank."""
    graph, pcg, result = two_rank_runs["embedding"]
    assert any(n.op == "partition" and graph.leaf(pcg.node(n.inputs[0]).op) is not None
               and graph.leaf(pcg.node(n.inputs[0]).op).role == "input" for n in pcg)
    assert result.check == "passed", result


@pytest.fixture(scope="module")
def tied_plan(models, tmp_path_factory) -> str:
    """The tied LM's plan file (`_optimize`: an export of the module, 1-2 CPU s), made once for the tests that
    read it; none of them writes it."""
    return _optimize(models, "tied", tmp_path_factory.mktemp("tied"))


def test_tied_weights_stay_one_parameter_and_train_like_torch(tied_plan, two_rank_runs):
    """The plan file's graph holds the tied table once, and its plan (`--plan-of parsat`) trains like the module
    on 2 ranks: run by `run_module_many` (what `parsat run --model` runs on its ranks, with the CLI's defaults:
    3 steps, float64, its tolerance for a module) in the file's one 2-rank launch (`two_rank_runs`), where it was
    a launch of its own through `parsat run`. The CLI's `--model` path itself (exit code, JSON) is run by
    test_a_module_trains_as_a_plan_on_a_2x2_mesh (this module, 4 ranks) and test_a_non_finite_value_fails_check."""
    graph = json.loads(open(tied_plan).read())["graph"]
    assert [w["name"] for w in graph["weights"] if "emb" in w["name"] or "head" in w["name"]] == ["head.weight"]
    result = two_rank_runs["tied/parsat"]
    assert result.check == "passed", result
    assert result.max_rel_diff < 1e-9


def modules_then_a_plan(ctx, jobs, config, pcg, plan_config, graph) -> dict:
    """`run_module_many` of `jobs`, then `pcg` trained by the interpreter (`run_rank`), in one process group."""
    from parsat.backend.executor import run_rank
    from parsat.backend.parallelize import run_module_many

    return {"modules": run_module_many(ctx, jobs, config), "plan": run_rank(ctx, pcg, plan_config, graph)}


@pytest.fixture(scope="module")
def two_rank_runs(models, tied_plan, tmp_path_factory):
    """In ONE 2-rank launch (a launch is two fresh processes importing torch, most of a small run): the
    data_parallel baselines (`--plan-of data_parallel`: rebuilt from the graph by `load_plan`) of the tied, padded
    and dropped modules and the tied module's own plan ("tied/parsat", `--plan-of parsat`), trained 3 steps against
    the unmodified module (float64, --check's tolerance for a module; `run_module_many`: what `parsat run --model`
    runs on its ranks), then an embedding model's data-parallel plan (its ids partitioned) trained 2 steps with
    --check by the interpreter. label -> RunResult, and "embedding" -> (graph, pcg, RunResult)."""
    from parsat.backend.cli import check_tolerance, load_plan
    from parsat.backend.executor import RunResult
    from parsat.backend.launch import LaunchConfig, launch

    folder = tmp_path_factory.mktemp("baselines")
    factories = ("tied", "padded", "dropped")
    files = {"tied": tied_plan, **{factory: _optimize(models, factory, folder) for factory in factories[1:]}}
    read = {factory: load_plan(files[factory], 2, "data_parallel") for factory in factories}
    read["tied/parsat"] = load_plan(tied_plan, 2, "parsat")
    jobs = [(label, pcg, graph, f"{models}:{label.split('/')[0]}") for label, (pcg, graph, _) in read.items()]
    config = TrainConfig(steps=3, dtype="float64", check=True, tolerance=check_tolerance("float64", "module"))
    module, ids = nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8), nn.Linear(8, 5)), torch.randint(0, 20, (4, 6))
    graph = parsat.from_torch(module, ids)
    pcg, plan_config = data_parallel_pcg(graph, operator_library(), 2), TrainConfig(steps=2, check=True)
    reports = launch(modules_then_a_plan, (jobs, config, pcg, plan_config, graph),
                     LaunchConfig(nproc=2, backend="gloo", timeout_s=600))
    runs = {label: RunResult.of_job([r["modules"][label] for r in reports], config, read[label][2]) for label in read}
    return {**runs, "embedding": (graph, pcg, RunResult.of_job([r["plan"] for r in reports], plan_config))}


def test_the_tied_lm_s_data_parallel_baseline_trains_like_torch(two_rank_runs):
    """`--plan-of data_parallel` of the tied LM (the CLI's own `--plan-of` path: test_backend_plans)."""
    result = two_rank_runs["tied"]
    assert result.check == "passed" and result.max_rel_diff < 1e-9, result


def test_a_module_trains_as_a_plan_on_a_2x2_mesh(models, tmp_path, capsys):
    """The tied LM on 4 ranks, data parallel over both axes of dp 2 x dp2 2 (the batch cut on dim 0 twice, nested):
    --check passes, and each weight's gradient is all-reduced on dp2 then on dp (4 groups' worth of 2(p-1)w
    each), plus the two all-reduces of the loss's partial sums."""
    module, inputs = TiedLMFactory(models, "tied")
    graph = parsat.from_torch(module, inputs)
    pcg = mesh_plans.nested_data_parallel(graph, operator_library())
    path = tmp_path / "tied-2x2.json"
    weights = sum(math.prod(leaf.shape) for leaf in graph.weights)
    scalars = sum(1 for name in graph.outputs if graph.shape(name) == ())
    predicted = 2 * (4 * weights) + 2 * (4 * scalars)  # per axis: 2 groups x 2(p-1) n, for every weight and loss
    path.write_text(json.dumps(mesh_plans.plan_dict(graph, pcg, predicted)), encoding="utf-8")
    code, result, text = _run(capsys, str(path), models, "tied", nproc=4)
    assert code == 0 and result["check"] == "passed", text
    assert result["comm_elements_measured"] == predicted
    assert result["comm_elements_by_axis"] == {"dp": predicted / 2, "dp2": predicted / 2}


TORCHRUN_SCRIPT = '''
import json, sys
import torch
import parsat
sys.path.insert(0, sys.argv[3])
from models import tagger

plan, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
module, ids = tagger()
module = module.double()
reference = __import__("copy").deepcopy(module)
pmodule = parsat.parallelize(module, plan, ids)
optimizer = torch.optim.SGD(pmodule.parameters(), lr=0.1)
for _ in range(2):
    loss = pmodule(ids).square().mean()
    optimizer.zero_grad(); loss.backward(); optimizer.step()
state = parsat.gather_weights(pmodule)
ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
for _ in range(2):
    ref_loss = reference(ids).square().mean()
    ref_optimizer.zero_grad(); ref_loss.backward(); ref_optimizer.step()
diff = max(float((state[k] - v).abs().max()) for k, v in reference.state_dict().items())
if torch.distributed.get_rank() == 0:
    open(out, "w").write(json.dumps({"diff": diff, "loss": float(loss), "ref_loss": float(ref_loss),
                                     "pieces": sorted(pmodule.named_pieces())}))
'''


@pytest.mark.slow
def test_parallelize_under_torchrun_on_a_2x2_mesh(models, tmp_path):
    """The public API on 4 ranks: `parsat.parallelize` of a module with a plan on dp 2 x dp2 2, the user's own
    loop and torch.optim.SGD, then `gather_weights`: the module's weights equal an unparallelized run's."""
    import subprocess

    module, ids = TiedLMFactory(models, "tagger")
    graph = parsat.from_torch(module.double(), ids)
    plan = tmp_path / "tagger-2x2.json"
    plan.write_text(json.dumps(mesh_plans.plan_dict(graph, mesh_plans.nested_data_parallel(graph, operator_library()))),
                    encoding="utf-8")
    script, out = tmp_path / "train.py", tmp_path / "out.json"
    script.write_text(TORCHRUN_SCRIPT, encoding="utf-8")
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "4", str(script), str(plan), str(out),
                           str(models.parent)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["diff"] < 1e-12 and abs(result["loss"] - result["ref_loss"]) < 1e-12, result


def test_parallelize_reuses_the_import_it_is_given(monkeypatch):
    """`parsat.parallelize(module, plan, imported=...)` does not export the module again and takes a `Plan`'s PCG as
    it is; it trains as `parallelize(module, plan, example_inputs)`, which exports (one rank, in this process)."""
    import torch.distributed as dist

    from parsat.backend.parallelize import ParallelizeError, parallelize
    from parsat.importer import export
    from parsat.ir.costs import Totals
    from parsat.ir.machine import Machine
    from parsat.ir.plan import Plan

    exports = []
    real_export = export.export_module
    monkeypatch.setattr(export, "export_module", lambda module, inputs: exports.append(module) or
                        real_export(module, inputs))
    torch.manual_seed(0)
    module = nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8), nn.Linear(8, 5)).double()
    ids = torch.randint(0, 20, (4, 6))
    imported = import_module(module, ids)
    assert len(exports) == 1
    pcg = mesh_plans.redundant_pcg(imported.graph, operator_library(), 1)
    plan = Plan(imported.graph, Machine.preset("cpu").with_devices(1), 1, pcg, {}, Totals(0.0, 0, 0, 0, 0, 0.0, 0.0))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        given = parsat.parallelize(module, plan, imported=imported)
        assert len(exports) == 1 and given.imported is imported and given.pcg is plan.pcg
        exported = parallelize(module, plan, ids)
        assert len(exports) == 2
        losses = []
        for pmodule in (given, exported):
            loss = pmodule(ids).square().mean()
            loss.backward()
            losses.append((float(loss.detach()), {name: piece.grad for name, piece in pmodule.named_pieces().items()}))
        assert losses[0][0] == losses[1][0]
        assert all(torch.equal(grad, losses[1][1][name]) for name, grad in losses[0][1].items())
        other = import_module(nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8), nn.Linear(8, 5)).double(), ids)
        with pytest.raises(ParallelizeError, match="import is not this module's"):
            parallelize(nn.Linear(8, 5).double(), plan, imported=other)
    finally:
        dist.destroy_process_group()


def test_padding_idx_row_gets_no_gradient(two_rank_runs):
    assert two_rank_runs["padded"].check == "passed", two_rank_runs["padded"]


def test_dropout_draws_masks_that_match_the_module(models, two_rank_runs):
    assert two_rank_runs["dropped"].check == "passed", two_rank_runs["dropped"]
    module, inputs = TiedLMFactory(models, "dropped")
    imported = import_module(module, inputs)
    masks = [leaf for leaf in imported.data.values() if leaf.encoding == "dropout"]
    assert len(masks) == 1 and masks[0].rate == 0.5
    first = imported.data_values(inputs, torch.float64, seed=0, step=0)[masks[0].name]
    second = imported.data_values(inputs, torch.float64, seed=0, step=1)[masks[0].name]
    assert 0.3 < float(first.mean()) < 0.7 and not torch.equal(first, second)


def TiedLMFactory(models, name):
    from parsat.importer.model_file import load_model_factory

    return load_model_factory(f"{models}:{name}")


def test_a_non_finite_value_fails_check(models, tmp_path, capsys):
    plan = _optimize(models, "explodes", tmp_path)
    code, result, text = _run(capsys, plan, models, "explodes")
    assert code == 1 and result["check"] == "failed" and result["nonfinite_values"] > 0
    assert "not finite" in text


def test_compare_values_is_relative_and_refuses_non_finite():
    big = torch.tensor([4.5e7])
    assert compare_values([("loss", big + 4e-8, big)]).max_rel < 1e-14
    found = compare_values([("gradient of w", torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]))])
    assert found.nonfinite == ("gradient of w",)


def test_a_module_whose_graph_is_not_the_plans_is_refused(models, tied_plan, capsys, monkeypatch):
    """Refused by the launcher, before any rank starts (each rank would export the module, seconds, to find it):
    the tagger's parameters hold none of the tied LM's [32, 16] table. A module whose parameters match is not
    refused there (`weights_difference` of the plan's own module is '')."""
    import parsat.backend.launch as launch_module
    from parsat.backend.parallelize import weights_difference

    def no_rank(*_args, **_kwargs):
        raise AssertionError("a rank was started for a module the launcher could refuse")

    monkeypatch.setattr(launch_module, "launch", no_rank)
    code, _, text = _run(capsys, tied_plan, models, "tagger")
    assert code == 1 and "graph is not the plan's" in text and "[32, 16]" in text and "Traceback" not in text
    graph = Graph.from_dict(json.loads(open(tied_plan).read())["graph"])
    module, _inputs = TiedLMFactory(models, "tied")
    assert weights_difference(module, graph) == ""
    module.norm.weight.requires_grad_(False)   # frozen: a constant of an import, so no longer a weight's home
    assert "[16]" in weights_difference(module, graph)


def test_seeded_weights_are_scaled_by_their_fan_in():
    from parsat.backend.executor import fan_in

    shapes = {"w": (8, 3, 3, 3), "x": (2, 3, 5, 5), "lin": (16, 4), "h": (2, 4), "b": (16,),
              "table": (10, 4), "ids": (2, 10)}
    nodes = [("c", "conv2d", ("x", "w")), ("t", "transpose", ("lin",)), ("o", "linear", ("h", "t", "b")),
             ("e", "embedding", ("ids", "table"))]
    shapes.update({"t": (4, 16)})
    assert fan_in(nodes, shapes, "w") == 27      # a conv kernel [out, in, r, s]: in * r * s
    assert fan_in(nodes, shapes, "lin") == 4     # torch's [out, in] = [16, 4] Linear weight, read transposed
    assert fan_in(nodes, shapes, "table") == 1   # an embedding table is not a contraction's input side
    assert fan_in(nodes, shapes, "b") == 1
    direct = [("o", "linear_t", ("h", "lin", "b"))]   # torch's F.linear reads [out, in] as stored: dim 1 is in
    assert fan_in(direct, shapes, "lin") == 4 and fan_in([("o", "linear_nobias_t", ("h", "lin"))], shapes, "lin") == 4
