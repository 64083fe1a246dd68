"""How frameworks schedule a step's communication, as task generators for the step simulator.

* `GradientBuckets`: PyTorch DDP. Gradients are grouped into buckets in
  the reverse order of the parameters (about the order backward produces
  them); the first bucket holds `first_bucket_bytes` (1 MiB), the others
  `bucket_bytes` (25 MiB by default, `bucket_cap_mb`): a bucket closes
  once it reaches its cap, so a large gradient makes a bucket of its own.
  One all-reduce per bucket, launched on the communication stream as soon
  as the bucket's last gradient is ready and every earlier bucket has been
  launched (DDP launches buckets in order), so it overlaps the rest of the
  backward pass; the optimizer waits for all of them. With `after_backward`
  (Megatron-LM's `--DDP-impl local` of 2021: `train_step` all-reduces the
  gradients once the forward-backward function has returned) the same
  buckets are launched only when the last gradient is ready, so the whole
  reduction is exposed after backward.
* `ParamGathers`: Megatron-Core's distributed optimizer (ZeRO-1/2) with
  `overlap_param_gather`. The updated parameters are all-gathered bucket
  by bucket (the gradient buckets, in forward order) during the next
  step's forward: the first bucket's gather is launched when forward
  begins, and the pre-hook that waits for a bucket launches the next one
  (`finish_param_sync`'s one-bucket prefetch), so only what the first
  layers' compute cannot hide is exposed. `prefetch_delay` is the same
  chain as a number: how much later a forward of known per-bucket offsets
  ends than it would with its parameters already there.
* `fsdp_step`: FSDP (ZeRO-3). Each unit's parameters are all-gathered
  before its forward and again before its backward, one unit ahead (the
  all-gather of unit i+1 is issued when unit i starts computing, on its own
  stream), freed after use; each unit's gradients are reduce-scattered on a
  third stream once its backward is done.

Both only add tasks to a `StepBuilder` (`cost.simulator`); the caller
prices the collectives (`cost.collectives`) and the compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Sequence

from parsat.cost.simulator import COMM, COMPUTE, SimulationError, StepBuilder


@dataclass(frozen=True)
class Gradient:
    """A parameter's gradient on one device: its name and size in bytes (as communicated)."""

    name: str
    nbytes: int


def assign_buckets(gradients: Sequence[Gradient], bucket_bytes: int, first_bucket_bytes: int) -> list[list[Gradient]]:
    """DDP's bucket assignment, `gradients` in bucket order (the reverse of the parameters' order).

    A bucket closes once it holds at least its cap (the first bucket's cap
    is `first_bucket_bytes`), as `torch.distributed`'s size-based assignment does.
    """
    if bucket_bytes < 1 or first_bucket_bytes < 1:
        raise SimulationError("bucket sizes must be positive")
    buckets: list[list[Gradient]] = []
    current: list[Gradient] = []
    size = 0
    for g in gradients:
        current.append(g)
        size += g.nbytes
        if size >= (first_bucket_bytes if not buckets else bucket_bytes):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass
class GradientBuckets:
    """DDP's bucketed gradient all-reduce on one device, added to `builder` as gradients become ready.

    Call `ready(name, task)` when the backward task that produces gradient
    `name` is added; it adds the all-reduce of every bucket that is now
    complete and next in order. `all_reduce_s(nbytes)` prices one bucket.
    """

    builder: StepBuilder
    device: Hashable
    gradients: Sequence[Gradient]
    all_reduce_s: Callable[[int], float]
    bucket_bytes: int = 25 << 20
    first_bucket_bytes: int = 1 << 20
    phase: str = "grad_sync"
    stream_name: str = ""   # the device's communication stream for the group's link (`pcg_tasks._Builder._comm`)
    after_backward: bool = False   # launch every bucket once all gradients are ready (`done`), not as they fill
    buckets: list[list[Gradient]] = field(init=False)
    tasks: list[int] = field(init=False)           # the all-reduce task of each launched bucket, in order

    def __post_init__(self) -> None:
        self.buckets = assign_buckets(self.gradients, self.bucket_bytes, self.first_bucket_bytes)
        self._bucket_of = {g.name: b for b, bucket in enumerate(self.buckets) for g in bucket}
        self.names = frozenset(self._bucket_of)
        self._missing = [len(bucket) for bucket in self.buckets]
        self._last_ready: list[int | None] = [None] * len(self.buckets)
        self._stream = self.builder.stream(self.device, COMM, self.stream_name)
        self.tasks = []

    def ready(self, name: str, task: int) -> list[int]:
        """Gradient `name` is produced by `task`: the all-reduce tasks this launches (maybe none)."""
        b = self._bucket_of.get(name)
        if b is None:
            raise SimulationError(f"gradient '{name}' is in no bucket")
        self._missing[b] -= 1
        if self._missing[b] < 0:
            raise SimulationError(f"gradient '{name}' was made ready twice")
        previous = self._last_ready[b]
        self._last_ready[b] = task if previous is None else max(previous, task)
        return [] if self.after_backward else self._launch()

    def _launch(self, after: int | None = None) -> list[int]:
        """Add the all-reduce of every complete bucket next in order, each waiting for its last gradient (and for
        task `after`, where given); the tasks added."""
        launched = []
        while len(self.tasks) < len(self.buckets) and self._missing[len(self.tasks)] == 0:
            index = len(self.tasks)
            nbytes = sum(g.nbytes for g in self.buckets[index])
            deps = (self._last_ready[index],) if after is None else (self._last_ready[index], after)
            ident = self.builder.add(f"all-reduce bucket {index} ({len(self.buckets[index])} grads, {nbytes:,} B)",
                                     self._stream, self.all_reduce_s(nbytes), deps, phase=self.phase)
            self.tasks.append(ident)
            launched.append(ident)
        return launched

    def done(self, backward_end: int | None = None) -> list[int]:
        """Every bucket's all-reduce (under `after_backward` launched now, each after the last gradient of all and
        after task `backward_end`, the backward's last: the reduction starts when the backward has returned);
        SimulationError if a gradient never became ready (DDP would hang)."""
        if self.after_backward:
            last = max((t for t in (*self._last_ready, backward_end) if t is not None), default=None)
            self._launch(last)
        if len(self.tasks) < len(self.buckets):
            waiting = [g.name for b in self.buckets[len(self.tasks):] for g in b][:5]
            raise SimulationError(f"gradients never ready, their buckets never launched: {', '.join(waiting)}")
        return list(self.tasks)


@dataclass
class ParamGathers:
    """The all-gathers of ZeRO-1/2's updated parameter shards, overlapped with the next step's forward, as
    Megatron-Core's `overlap_param_gather` runs them, added to `builder` as forward reaches the weights.

    The step simulated is a steady-state one: the gathers of the previous step's update run during this step's
    forward (and this step's update gathers nothing after it). `buckets` are the weights' names bucket by
    bucket in forward order (the gradient buckets reversed: Megatron's parameter and gradient buckets are the
    same buffers), `nbytes` each bucket's parameter bytes, `all_gather_s(nbytes)` prices one. `needed(names)`
    is called when a forward task reads those weights: it launches every bucket up to theirs and the next one
    (the pre-hook waits for its bucket and launches the next), and returns the gathers that task waits for."""

    builder: StepBuilder
    device: Hashable
    buckets: Sequence[Sequence[str]]
    nbytes: Sequence[int]
    all_gather_s: Callable[[int], float]
    phase: str = "grad_sync"
    stream_name: str = ""
    tasks: list[int] = field(init=False)          # the all-gather task of each launched bucket, in order

    def __post_init__(self) -> None:
        if len(self.buckets) != len(self.nbytes):
            raise SimulationError("one byte count per bucket")
        self._bucket_of = {name: b for b, bucket in enumerate(self.buckets) for name in bucket}
        self._stream = self.builder.stream(self.device, COMM, self.stream_name)
        self.tasks = []

    def needed(self, names: Iterable[str]) -> list[int]:
        """The gathers of the buckets holding `names` (names in no bucket are ignored), launching every bucket up
        to the last of them and one more."""
        wanted = sorted({self._bucket_of[n] for n in names if n in self._bucket_of})
        if wanted:
            self._launch(min(wanted[-1] + 1, len(self.buckets) - 1))
        return [self.tasks[b] for b in wanted]

    def finish(self) -> list[int]:
        """Every bucket's gather (the ones no forward task read launched now, in order)."""
        self._launch(len(self.buckets) - 1)
        return list(self.tasks)

    def _launch(self, last: int) -> None:
        while len(self.tasks) <= last:
            b = len(self.tasks)
            self.tasks.append(self.builder.add(
                f"all-gather of updated parameters, bucket {b} ({len(self.buckets[b])} weights, "
                f"{self.nbytes[b]:,} B)", self._stream, self.all_gather_s(self.nbytes[b]), (), phase=self.phase))


def prefetch_delay(gather_s: Sequence[float], offsets_s: Sequence[float], start_s: float = 0.0) -> float:
    """How much later a forward ends when the buckets of its parameters are all-gathered as `ParamGathers` runs
    them (on a link nothing else uses) than with its parameters in place. Bucket b takes `gather_s[b]` seconds
    (in forward order) and is first read `offsets_s[b]` seconds of compute into the forward. Bucket 0 is
    launched when the forward begins; the host launches each next one as it passes the pre-hook that waits for
    the one before (a wait on the stream, not on the host), so on their link they run back to back and bucket b
    is there at g_0 + ... + g_b. Where the forward reaches a bucket before it is there it waits; the delay is the
    longest of those waits counted from the start, max(0, max_b(g_0 + ... + g_b - o_b)): at least the first
    bucket's gather when it is read at once, at most all of them. With `start_s`, the gathers start that long
    after the forward's reference time (their link busy before, or launched earlier: negative); the result is
    then counted from that reference time, not from the gathers' start."""
    if len(gather_s) != len(offsets_s):
        raise SimulationError("one offset per bucket")
    arrived, delay = start_s, 0.0
    for seconds, offset in zip(gather_s, offsets_s):
        arrived += seconds
        delay = max(delay, arrived - offset)
    return delay


@dataclass(frozen=True)
class Unit:
    """One FSDP unit (a layer): its gathered parameters, its compute, the activations it keeps for backward."""

    name: str
    gathered_bytes: int
    forward_s: float
    backward_s: float
    activation_bytes: int = 0


@dataclass(frozen=True)
class FsdpTasks:
    forward: tuple[int, ...]
    backward: tuple[int, ...]           # in backward order (last unit first)
    all_gathers: tuple[int, ...]
    reduce_scatters: tuple[int, ...]


def fsdp_step(builder: StepBuilder, device: Hashable, units: Sequence[Unit], all_gather_s: Callable[[int], float],
              reduce_scatter_s: Callable[[int], float], after: Sequence[int] = ()) -> FsdpTasks:
    """Forward and backward of `units` under FSDP with one unit of prefetch; returns the task ids.

    Memory: a unit's gathered parameters are allocated when its all-gather
    starts and freed when the compute that uses them ends; its activations
    from its forward to its backward; its unsharded gradients from its
    backward until its reduce-scatter ends. `after`: tasks the step waits for first.
    """
    compute = builder.stream(device, COMPUTE)
    gather = builder.stream(device, COMM, "all-gather")
    scatter = builder.stream(device, COMM, "reduce-scatter")
    n = len(units)
    if not n:
        return FsdpTasks((), (), (), ())
    gathers: list[int] = []

    def all_gather(i: int, deps: Sequence[int], phase: str) -> int:
        u = units[i]
        ident = builder.add(f"all-gather {u.name} ({phase})", gather, all_gather_s(u.gathered_bytes), deps,
                            alloc=u.gathered_bytes, phase=phase)
        gathers.append(ident)
        return ident

    forward: list[int] = []
    ahead = all_gather(0, after, "forward")
    for i, u in enumerate(units):
        mine = ahead
        if i + 1 < n:  # issued when unit i starts: after unit i-1's forward
            ahead = all_gather(i + 1, [forward[-1]] if forward else list(after), "forward")
        forward.append(builder.add(f"forward {u.name}", compute, u.forward_s, (mine,), alloc=u.activation_bytes,
                                   free=u.gathered_bytes, phase="forward"))
    backward: list[int] = []
    scatters: list[int] = []
    ahead = all_gather(n - 1, (forward[-1],), "backward")
    for i in range(n - 1, -1, -1):
        u = units[i]
        mine = ahead
        if i > 0:
            ahead = all_gather(i - 1, (backward[-1],) if backward else (forward[-1],), "backward")
        task = builder.add(f"backward {u.name}", compute, u.backward_s, (mine,), alloc=u.gathered_bytes,
                           free=u.gathered_bytes + u.activation_bytes, phase="backward")
        backward.append(task)
        scatters.append(builder.add(f"reduce-scatter {u.name}", scatter, reduce_scatter_s(u.gathered_bytes), (task,),
                                    free=u.gathered_bytes, phase="grad_sync"))
    return FsdpTasks(tuple(forward), tuple(backward), tuple(gathers), tuple(scatters))


__all__ = ["FsdpTasks", "Gradient", "GradientBuckets", "ParamGathers", "Unit", "assign_buckets", "fsdp_step",
           "prefetch_delay"]
