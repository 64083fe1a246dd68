"""The demo's products timed as `parsat calibrate` times its grid: what `gemm_grid_spread.py --measured` reads.

Two ranks (gloo), each rank's thread CPU, `GemmPasses` (5 passes, each figure the median of the slowest rank's
rounds), the forward product and autograd's two backward ones (`_backward_products`) of the demo's per-rank
products (`parsat optimize mlp --devices 2`: [128, 784] @ [784, 256] and [128, 256] @ [256, 10]) and of 512^3.
Prints one JSON object: the dispatch chain's (forward, backward) seconds and the rows [op, shape, seconds, FLOPs,
bytes].

    .venv/bin/python benchmarks/gemm_demo_products.py > probe.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from parsat.backend.calibrate import (Budget, GemmPasses, _backward_products, _chain_dispatch,  # noqa: E402
                                      compute_clock)
from parsat.backend.launch import LaunchConfig, launch  # noqa: E402
from parsat.importer.torch_ops import apply_op  # noqa: E402

SHAPES = [(128, 256, 784), (128, 10, 256), (512, 512, 512)]   # (m, n, k) of a forward product


def measure(ctx) -> dict:
    budget = Budget(5, 0.03, compute_clock(False, torch.get_num_threads()))
    gen = torch.Generator().manual_seed(ctx.rank)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def sync():
        return None

    dispatch = _chain_dispatch(ctx, rand(2, 2).requires_grad_(), budget, sync)
    products = GemmPasses(ctx, budget, sync)
    for m, n, k in SHAPES:
        a, b = rand(m, k), rand(k, n)
        products.add(["matmul", [m, n, k], 2.0 * m * n * k, 0.0], lambda a=a, b=b: apply_op("matmul", [a, b], {}))
        _backward_products(products, a, b, rand(m, n))
    for _ in range(budget.repeats):
        products.run_pass()
    return {"dispatch": dispatch, "rows": products.rows()}


if __name__ == "__main__":
    print(json.dumps(launch(measure, (), LaunchConfig(nproc=2, timeout_s=1500))[0]))
