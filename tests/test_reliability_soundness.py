"""End-to-end soundness: every plan parsat makes computes what the original graph computes.

Random small graphs are built from the operator library (chains and
branches of matmul, linear, relu, gelu, add, mul, softmax, layernorm,
concat, transpose over random shapes), optimized for a random device count
on a random machine model, written to a plan file and read back through the
backend's loader (the file is the contract), then trained for two steps on
as many CPU ranks as the plan has devices with the backend's check: every
output, gradient and updated weight piece must equal the single-process
reference (float64, tolerance 1e-9).

Why batched: spawning ranks costs seconds (torch import, library load), so
all plans for one device count run in one `launch`, each rank walking the
plans in order with `run_rank`, the function `parsat run --check` uses.

Size: `PARSAT_SOUNDNESS_CASES` (default 4, device counts 1-2, so one
2-rank job); a nightly-style run sets it to e.g. 200 and also gets device
counts 3 and 4. `PARSAT_SOUNDNESS_SEED` moves the seeds. A case that
parsat refuses to optimize (OptimizeError: e.g. nothing divides by 3) is
counted as refused, never as a pass; a failing case prints its seed, which
rebuilds the graph exactly (`random_graph(seed)`).
"""

from __future__ import annotations

import os
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from parsat.api import optimize  # noqa: E402
from parsat.backend.cli import load_plan  # noqa: E402
from parsat.backend.executor import TrainConfig, run_rank  # noqa: E402
from parsat.backend.launch import LaunchConfig, RankContext, launch  # noqa: E402
from parsat.dsl.library import Library  # noqa: E402
from parsat.ir.graph import Graph, GraphBuilder, Tensor  # noqa: E402
from parsat.ir.machine import Machine  # noqa: E402
from parsat.ir.errors import OptimizeError  # noqa: E402
from parsat.dsl.checker import resolve_library  # noqa: E402

CASES = int(os.environ.get("PARSAT_SOUNDNESS_CASES", "4"))
BASE_SEED = int(os.environ.get("PARSAT_SOUNDNESS_SEED", "0"))
MAX_DEVICES = 4 if CASES > 8 else 2
TOLERANCE = 1e-9
DIMS = (2, 4, 6, 8)
OPS = ("matmul", "linear", "relu", "gelu", "add", "mul", "softmax", "layernorm", "concat", "transpose")

# Compute is slow and links are free on this machine, so the cost model splits
# whatever it can: the point is to exercise parallel plans, not realistic ones.
SPLITTY = Machine("splitty", 4, 1, peak_flops=1e6, memory_bandwidth=1e9, memory_capacity=2 ** 40,
                  intra_bandwidth=1e15, intra_latency=1e-12, inter_bandwidth=1e15, inter_latency=1e-12)
MACHINES = (SPLITTY, SPLITTY, Machine.preset("h100x8"), Machine.preset("cpu"))


def random_graph(seed: int, library: Library) -> Graph:
    """A random DAG of library operators; the same seed gives the same graph.

    Branches come from picking any earlier tensor as an operand (not just
    the last), `add`/`mul`/`concat` join two tensors, and a second output
    is sometimes taken from the middle of the graph.
    """
    rng = random.Random(seed)
    g = GraphBuilder(library, name=f"random{seed}")
    rank = rng.choice((2, 2, 3))
    pool: list[Tensor] = [g.input("x", [rng.choice(DIMS) for _ in range(rank)])]
    weights = 0

    def weight(shape) -> Tensor:
        nonlocal weights
        weights += 1
        return g.weight(f"w{weights}", list(shape))

    for _ in range(rng.randint(2, 6)):
        t = rng.choice(pool[-2:]) if rng.random() < 0.7 else rng.choice(pool)
        shape = g.shape(t)
        op = rng.choice(OPS)
        same = [u for u in pool if g.shape(u) == shape and u != t]
        if op in ("relu", "gelu"):
            out = g.op(op, t)
        elif op == "softmax":
            out = g.op("softmax", t, dim=rng.randrange(len(shape)))
        elif op == "layernorm":
            out = g.op("layernorm", t, weight(shape[-1:]), weight(shape[-1:]), eps=1e-5)
        elif op == "matmul" and len(shape) == 2:
            out = g.op("matmul", t, weight((shape[1], rng.choice(DIMS))))
        elif op in ("linear", "matmul"):
            n = rng.choice(DIMS)
            out = g.op("linear", t, weight((shape[-1], n)), weight((n,)))
        elif op in ("add", "mul"):
            other = rng.choice(same) if same and rng.random() < 0.7 else weight(shape)
            out = g.op(op, t, other)
        elif op == "concat":
            dim = rng.randrange(len(shape))
            partners = [u for u in pool if u != t and len(g.shape(u)) == len(shape)
                        and all(a == b for i, (a, b) in enumerate(zip(g.shape(u), shape)) if i != dim)]
            out = g.op("concat", t, rng.choice(partners) if partners else t, dim=dim)
        else:  # transpose
            d0, d1 = sorted(rng.sample(range(len(shape)), 2))
            out = g.op("transpose", t, d0=d0, d1=d1)
        pool.append(out)
    if not weights:  # a step with nothing to train is outside the backend's domain (see the xfail below)
        k, n = g.shape(pool[-1])[-1], rng.choice(DIMS)
        pool.append(g.op("linear", pool[-1], weight((k, n)), weight((n,))))
    used = {i for node in g._nodes for i in node.inputs}
    sinks = [u for u in pool[1:] if u.name not in used]  # every node reaches an output: no dead weights
    g.output(*sinks)
    return g.build()


@dataclass(frozen=True)
class Case:
    """One optimized case: the seed, its device count and the plan file it wrote."""

    seed: int
    devices: int
    machine: str
    plan_path: str
    pieces: int
    operators: int


def run_plans(ctx: RankContext, plan_paths: list[str], steps: int) -> list[dict]:
    """On every rank: train each plan with the check, as `parsat run --check` does.

    Per plan: the job-wide max difference, or the error it raised (a plan
    that fails to run is a finding too, and must not hide the others).
    """
    import traceback

    out = []
    config = TrainConfig(steps=steps, check=True, tolerance=TOLERANCE)
    for path in plan_paths:
        try:
            pcg, graph, _predicted = load_plan(path, ctx.world)
            report = run_rank(ctx, pcg, config, graph)
            out.append({"diff": report["job"]["max_abs_diff"]})
        except Exception as err:  # noqa: BLE001 - reported per plan
            where = traceback.extract_tb(err.__traceback__)[-1]
            out.append({"diff": None, "error": f"{type(err).__name__}: {err} (at {Path(where.filename).name}:"
                                               f"{where.lineno})"})
    return out


@pytest.fixture(scope="module")
def library() -> Library:
    return resolve_library(None)


def make_cases(library: Library, folder: Path, count: int) -> tuple[list[Case], Counter]:
    """Optimize `count` random graphs; plans written under `folder`, refusals counted by reason."""
    cases, refused = [], Counter()
    for index in range(count):
        seed = BASE_SEED + index
        rng = random.Random(seed * 7919 + 1)
        devices = rng.randint(1, MAX_DEVICES) if MAX_DEVICES > 2 else rng.choice((1, 2, 2, 2))
        machine = rng.choice(MACHINES)
        graph = random_graph(seed, library)
        try:
            plan = optimize(graph, machine=machine, devices=devices, rules=library, baselines=rng.random() < 0.3,
                            limits={"iterations": 8})
        except OptimizeError as err:
            reason = str(err).replace(f"'{graph.name}' ", "").replace(f"'{graph.name}'", "the graph")
            refused[reason.split(":")[0].split(" (")[0][:70]] += 1
            continue
        path = folder / f"plan-{seed}.json"
        plan.save(path)
        cases.append(Case(seed, devices, machine.name, str(path), plan.pcg.max_pieces, len(graph.nodes)))
    return cases, refused


def test_every_plan_matches_the_single_process_run(library, tmp_path):
    cases, refused = make_cases(library, tmp_path, CASES)
    failures = []
    for devices in sorted({c.devices for c in cases}):
        group = [c for c in cases if c.devices == devices]
        results = launch(run_plans, ([c.plan_path for c in group], 2),
                         LaunchConfig(nproc=devices, backend="gloo", timeout_s=60 + 30 * len(group),
                                      collective_timeout_s=30))
        for case, result in zip(group, results[0]):
            diff = result["diff"]
            if diff is None or diff > TOLERANCE:
                failures.append(f"seed {case.seed} on {devices} device(s) ({case.machine}): "
                                + (result.get("error") or f"max diff {diff}"))
    parallel = sum(1 for c in cases if c.pieces > 1)
    summary = (f"{len(cases)} plans run ({parallel} split over >1 device; by devices "
               f"{dict(sorted(Counter(c.devices for c in cases).items()))}; operators "
               f"{sum(c.operators for c in cases)}), refused {sum(refused.values())} {dict(refused)}")
    print(summary)
    assert not failures, "plans that compute something else:\n" + "\n".join(failures) + "\n" + summary
    assert cases, "every case was refused: " + summary
    if CASES >= 4:
        assert parallel >= 1, "no case produced a parallel plan: the property tested nothing parallel"


@pytest.mark.parametrize("shape", ["no weights", "a weight that reaches no output"])
def test_graphs_with_nothing_to_train_run(library, shape):
    from parsat.backend.executor import reference_run

    g = GraphBuilder(library, name="inference")
    x = g.input("x", [4, 4])
    if shape != "no weights":
        g.op("matmul", x, g.weight("w", [4, 2]), name="dead")  # computed, never an output
    g.output(g.op("relu", x))
    reference = reference_run(g.build(), TrainConfig(steps=1, check=True))
    assert reference.losses
