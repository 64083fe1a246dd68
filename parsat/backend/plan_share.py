"""One plan for every rank: rank 0's plan handed to the ranks that hold none, and different plans refused.

Each rank of a job must run the same PCG: two ranks that each optimized and
got different plans would pair up different collectives (gloo aborts with a
mismatch, NCCL hangs). `shared_plan` is a collective every rank calls with
the plan it holds, or None: the ranks exchange a fingerprint of what they
would run (the PCG and its graph, timing fields aside, so two ranks that
optimized the same inputs agree), a rank without a plan receives rank 0's
(its JSON, broadcast as bytes: no pickle), and the job is refused on every
rank, naming the ranks, when rank 0 holds none or a rank holds another.
Every rank takes the same decision from the same gathered data, so a
refusal never leaves a rank waiting.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from parsat.ir.graph import Graph
from parsat.ir.pcg import PCG

DIGEST = 32   # bytes of a fingerprint (sha256)


class PlanMismatch(ValueError):
    """Ranks that do not hold one plan; the message names them."""


def fingerprint(pcg: PCG, graph: Graph, pipeline=None, regathers: bool = False) -> bytes:
    """What a rank would run, hashed: the PCG (nodes, placements, mesh, recomputation), its graph, and its
    pipeline when it has one (schedule, micro-batches, stage devices, layout: not the predicted times);
    `regathers` (the machine's runtime re-gathers, `parallelize.resolved_plan`: one more backward all-gather per
    sequence-parallel column-parallel product, so ranks that differ in it would wait on each other)."""
    text = repr(pcg) + "\0" + json.dumps(graph.to_dict(), sort_keys=True)
    if pipeline is not None:
        text += "\0" + repr((pipeline.schedule, pipeline.microbatches, pipeline.stage_devices, pipeline.layout))
    if regathers:
        text += "\0regathers"
    return hashlib.sha256(text.encode("utf-8")).digest()


def shared_plan(held, resolve, device: torch.device):
    """(PCG, graph) every rank runs: the `held` plan's (`resolve(plan) -> (pcg, graph)`, or (pcg, graph, pipeline)
    or (pcg, graph, pipeline, regathers) which is then returned), or rank 0's for a rank that holds None. Call on
    every rank of the default group."""
    mine = resolve(held) if held is not None else None
    row = torch.zeros(DIGEST + 1, dtype=torch.uint8, device=device)
    if mine is not None:
        row[:DIGEST] = torch.tensor(list(fingerprint(*mine)), dtype=torch.uint8)
        row[DIGEST] = 1
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    held_by = [bool(r[DIGEST]) for r in rows]
    if not held_by[0]:
        raise PlanMismatch("rank 0 holds no plan: give it the plan (the other ranks may pass None to receive it)")
    others = [rank for rank, r in enumerate(rows) if held_by[rank] and not torch.equal(r, rows[0])]
    if others:
        raise PlanMismatch(f"rank(s) {', '.join(map(str, others))} hold another plan than rank 0: optimize once (on "
                           "rank 0, or into a file every rank reads) and pass that plan, or None, on the others")
    if all(held_by):
        return mine
    return _from_rank0(held, resolve, device)


def _from_rank0(held, resolve, device: torch.device):
    """Rank 0's plan, as JSON bytes broadcast to every rank; the ranks that held it keep their own (equal) one."""
    if dist.get_rank() == 0:
        from parsat.ir.plan import Plan, load_plan_dict

        data = held.to_dict() if isinstance(held, Plan) else held if isinstance(held, dict) else load_plan_dict(held)
        payload = json.dumps(data).encode("utf-8")
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device))
    dist.broadcast(buffer, 0)
    if held is not None:
        return resolve(held)
    return resolve(json.loads(bytes(buffer.cpu().tolist()).decode("utf-8")))
