"""Every rank of a pipelined step passes a batch of one shape, or every rank refuses the step, naming the shapes.

A pipelined step's shapes are fixed by its trace (`pipelined.PipelinedModule`):
torch's `PipelineStage` sizes its receive buffers from the traced values,
and a new shape is traced on its first step. A rank passing another shape
than the others would trace again alone (its stages then wait for sends
that never come) or send a buffer of another size (gloo's "mismatch"
error on one rank, a hang on the others). So before the schedule runs,
the ranks exchange what they were given: each rank's shapes and dtypes as
a few integers, two all-gathers of int64 tensors (their length, then the
padded integers) on the job's default group; where they differ, every rank
raises the same error, naming each rank's shapes, and no stage runs.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from parsat.backend.torch_native.apply import NativeParallelizeError

# the dtypes a batch is encoded by (an index); any other encodes as -1, which still differs from these
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)


def _encoded(inputs: Sequence) -> list[int]:
    """The batch as integers: the count of inputs, then each one's dim count, dims and dtype index (a non-tensor
    argument as dim count -1)."""
    out = [len(inputs)]
    for x in inputs:
        if not isinstance(x, torch.Tensor):
            out.append(-1)
            continue
        out += [x.dim(), *x.shape, _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1]
    return out


def _decoded(values: Sequence[int]) -> str:
    """`_encoded`'s integers as text: each input's shape and dtype."""
    it = iter(values)
    parts = []
    for _ in range(next(it)):
        dims = next(it)
        if dims < 0:
            parts.append("not a tensor")
            continue
        shape = [next(it) for _ in range(dims)]
        code = next(it)
        parts.append(f"{shape} {str(_DTYPES[code]).removeprefix('torch.') if code >= 0 else 'other dtype'}")
    return "(" + ", ".join(parts) + ")"


def check_same_batch(inputs: Sequence, device: torch.device, what: str = "a pipelined step") -> None:
    """Raise NativeParallelizeError on every rank when the ranks' `inputs` differ in count, shape or dtype (module
    docstring). A collective on the default group: every rank calls it, each step, before the schedule."""
    mine = torch.tensor(_encoded(inputs), dtype=torch.int64, device=device)
    world = dist.get_world_size()
    lengths = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor(mine.numel(), dtype=torch.int64, device=device))
    longest = int(max(int(n) for n in lengths))
    padded = torch.full((longest,), -2, dtype=torch.int64, device=device)
    padded[: mine.numel()] = mine
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    batches = [g[: int(n)].tolist() for g, n in zip(gathered, lengths)]
    if all(b == batches[0] for b in batches):
        return
    shapes = "; ".join(f"rank {r}: {_decoded(b)}" for r, b in enumerate(batches))
    raise NativeParallelizeError(f"the ranks passed {what} batches of different shapes ({shapes}): every rank "
                                 "passes its local batch of one shape (the first stage reads it; a new shape is "
                                 "traced on every rank at once)")
