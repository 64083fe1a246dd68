"""Issue 31: a collective timed as `parsat calibrate` times it, against the same collective issued as the
torch-native runtime issues it (DTensor's `redistribute`, FSDP2's unshard / reshard), on NPROC ranks at once.

`parsat calibrate` times the collectives' table on plain tensors back to back (`calibrate.collective_cases`:
an all-reduce of a clone, an all-gather into a list then concatenated, a reduce-scatter of a list). The runtime
issues tensor parallelism's collectives through DTensor (`redistribute` between placements on a 1-D DeviceMesh:
Partial -> Replicate all-reduces, Shard -> Replicate all-gathers, Partial -> Shard reduce-scatters), and data
parallelism's / ZeRO-3's through FSDP2 (copy-in, `all_gather_into_tensor`, copy-out; the gradients' reduce-scatter).
Each row: the same buffer (the collective's whole tensor, `n` elements of the dtype, `collectives.price`'s
convention) timed both ways in the same processes, interleaved, the slowest rank's lower-quartile call
(`calibrate._timed` is an average of back-to-back calls; here one call at a time after a barrier every
CALLS_PER_BARRIER calls, as a step issues them one by one between compute). A measurement, not a test.

    PYTHONPATH=. .venv/bin/python benchmarks/collective_host_work.py [NPROC] [DTYPE] [CALLS]
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parsat.backend.calibrate import DTYPES, collective_cases  # noqa: E402
from parsat.backend.launch import LaunchConfig, RankContext, launch  # noqa: E402
from parsat.ir.machine_profile import COMM_ELEMENTS  # noqa: E402

WIDTH = 64   # the buffers' last dim: [n / WIDTH, WIDTH], an activation's [tokens, hidden] in miniature


def _cases(ctx: RankContext, dtype, n: int) -> dict[str, object]:
    """Name -> one call, for a whole tensor of `n` elements on the world's 1-D mesh."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    g = ctx.world
    mesh = init_device_mesh(ctx.device.type, (g,))
    plain = dict(collective_cases(ctx, dtype, n, g, None))
    rows = n // WIDTH
    whole = torch.ones(rows, WIDTH, dtype=dtype, device=ctx.device)
    partial = DTensor.from_local(whole, mesh, [Partial()], run_check=False)
    rows_piece = DTensor.from_local(torch.ones(rows // g, WIDTH, dtype=dtype), mesh, [Shard(0)], run_check=False)
    cols_piece = DTensor.from_local(torch.ones(rows, WIDTH // g, dtype=dtype), mesh, [Shard(1)], run_check=False)

    def redistribute(source, placement):
        def run():
            out = source.redistribute(mesh, [placement]).to_local()
            if hasattr(out, "wait"):    # an AsyncCollectiveTensor: the next operator on it would wait
                out.wait()
        return run

    module = nn.Linear(WIDTH, rows, bias=False).to(ctx.device, dtype)   # one parameter of n elements
    fully_shard(module, mesh=mesh, reshard_after_forward=True)

    def fsdp_gather():
        module.unshard()
        module.reshard()

    piece, full = torch.ones(n // g, dtype=dtype), torch.ones(n, dtype=dtype)
    return {"plain all_reduce": plain["all_reduce"], "plain all_gather": plain["all_gather"],
            "plain reduce_scatter": plain["reduce_scatter"],
            "dtensor Partial->Replicate": redistribute(partial, Replicate()),
            "dtensor Shard(0)->Replicate": redistribute(rows_piece, Replicate()),
            "dtensor Shard(1)->Replicate": redistribute(cols_piece, Replicate()),
            "dtensor Partial->Shard(0)": redistribute(partial, Shard(0)),
            "fsdp2 unshard+reshard": fsdp_gather,
            "copy piece": lambda: piece.clone(), "copy whole": lambda: full.clone()}


def _rank(ctx: RankContext, dtype_name: str, calls: int) -> dict:
    _p, dtype, _o = DTYPES[dtype_name]
    out = {}
    for n in COMM_ELEMENTS:
        n = max(ctx.world * WIDTH, n - n % (ctx.world * WIDTH))
        cases = _cases(ctx, dtype, n)
        seconds: dict[str, list[float]] = {name: [] for name in cases}
        cpu: dict[str, list[float]] = {name: [] for name in cases}
        for name, run in cases.items():   # warm every path once (DTensor's sharding propagation caches)
            run()
        for i in range(calls):   # interleaved, one call at a time, every rank issuing the same call
            for name, run in cases.items():
                dist.barrier()
                start, thread = time.perf_counter(), time.thread_time()
                run()
                cpu[name].append(time.thread_time() - thread)
                seconds[name].append(time.perf_counter() - start)
        quartile = torch.tensor([sorted(t)[len(t) // 4] for t in seconds.values()]
                                + [statistics.median(t) for t in cpu.values()], dtype=torch.float64)
        dist.all_reduce(quartile, op=dist.ReduceOp.MAX)
        figures = quartile.tolist()
        out[str(n)] = dict(zip(cases, figures[:len(cases)])) | {f"cpu {k}": v for k, v in zip(cases, figures[len(cases):])}
    return out


def main() -> None:
    nproc = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    start = time.process_time()
    result = launch(_rank, (dtype, calls), LaunchConfig(nproc=nproc, timeout_s=900.0))[0]
    names = list(next(iter(result.values())))
    for title, chosen in ((f"wall, lower quartile of {calls} calls", [k for k in names if not k.startswith("cpu ")]),
                          (f"main thread CPU, median of {calls} calls", [k for k in names if k.startswith("cpu ")])):
        print(f"{nproc} ranks, {dtype}, {title} each, us (slowest rank)")
        print("elements | " + " | ".join(chosen))
        for n, row in result.items():
            print(f"{n} | " + " | ".join(f"{row[k] * 1e6:.0f}" for k in chosen))
    for n, row in result.items():
        print(f"{n}: DTensor all-reduce - plain {(row['dtensor Partial->Replicate'] - row['plain all_reduce']) * 1e6:.0f}"
              f", DTensor all-gather(0) - plain {(row['dtensor Shard(0)->Replicate'] - row['plain all_gather']) * 1e6:.0f}"
              f", (1) - plain {(row['dtensor Shard(1)->Replicate'] - row['plain all_gather']) * 1e6:.0f}"
              f", reduce-scatter - plain all-reduce {(row['dtensor Partial->Shard(0)'] - row['plain all_reduce']) * 1e6:.0f}"
              f", FSDP2 - (all-gather + copies) "
              f"{(row['fsdp2 unshard+reshard'] - row['plain all_gather'] - row['copy piece'] - row['copy whole']) * 1e6:.0f}")
    print(json.dumps(result))
    print(f"parent CPU {time.process_time() - start:.1f} s; load {open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()
