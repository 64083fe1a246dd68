"""The step simulator: tasks on in-order streams with dependencies; the step time is the critical path.

A training step is a list of tasks. Each runs on one stream (a device's
compute stream, its communication stream, ...), takes a duration, waits
for its dependencies, and may allocate bytes when it starts and free bytes
when it ends. Streams run their tasks in the order they were added, one at
a time, as CUDA streams do (and as a host thread does on CPU); different
streams run at once, so communication that nothing waits for overlaps
with computation. Task builders (`cost.schedules` for DDP buckets and
FSDP prefetch; a plan's task builder) add tasks in the order the host
issues them.

`simulate` is one pass over the tasks in that order (every dependency is
an earlier task, so a task's start is the later of its stream becoming
free and its dependencies finishing). It returns the step time (the last
finish), each stream's busy time, and, worked out when first read (a
search ranks most steps by their time alone), the critical path (walked
back through whichever predecessor held each task up), per device the
time its compute and communication overlapped, the timeline for
`explain`, and the peak memory per device (a sweep over the memory
events). A few thousand
tasks take a few milliseconds (benchmarks/simulator_speed.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Hashable, Iterable, Mapping, Sequence

import numpy as np

COMPUTE, COMM = "compute", "comm"


class SimulationError(ValueError):
    """A task list the simulator cannot run (a dependency on a later task, a negative duration)."""


@dataclass(frozen=True)
class Stream:
    """A stream of one device: `kind` is COMPUTE or COMM (what `overlap` compares), `name` tells streams apart."""

    device: Hashable
    kind: str
    name: str = ""

    def label(self) -> str:
        return f"{self.device}:{self.name or self.kind}"


@dataclass(frozen=True)
class Span:
    """One task as it ran: for timelines."""

    task: int
    name: str
    stream: Stream
    start: float
    end: float
    phase: str
    alloc: int = 0
    free: int = 0


@dataclass(frozen=True)
class StepResult:
    """What one simulated step gives: time, per-stream busy time, overlap, critical path, timeline, memory."""

    step_s: float
    _columns: tuple = field(repr=False, compare=False)   # (builder, starts, ends): spans are made on demand
    _resident: Mapping[Hashable, int] = field(repr=False, compare=False, default_factory=dict)

    @cached_property
    def busy_s(self) -> Mapping[str, float]:
        """Stream label -> seconds busy: its tasks' durations summed in task order from 0.0 (`StepBuilder._busy`),
        worked out when asked (a report): the search reads a step's time and memory alone."""
        return self._columns[0]._busy()

    @cached_property
    def critical_path(self) -> tuple[int, ...]:
        """Task ids, first to last: from the task that ends last (the first such), back through whichever
        predecessor held each task up (`StepBuilder._held_by`). Worked out when asked (a report, a test), as
        `peak_memory_bytes` is: the search reads a step's time and memory alone, and keeping each task's
        predecessor in `simulate`'s loop was a quarter of its work (10^5-10^6 tasks a step)."""
        b, _start, end = self._columns
        return b._critical_path(end)

    @cached_property
    def peak_memory_bytes(self) -> Mapping[Hashable, int]:
        """Device -> the largest bytes allocated at any instant, `resident` included (`StepBuilder._peaks`):
        worked out when asked, as `overlap_s` is (a search ranks most steps by their time alone)."""
        b, start, end = self._columns
        return b._peaks(start, end, self._resident)

    @cached_property
    def overlap_s(self) -> Mapping[Hashable, float]:
        """Device -> seconds its compute and communication streams ran at once: worked out when asked (a
        search ranks thousands of steps by their time and memory alone)."""
        b, start, end = self._columns
        return b._overlap(start, end)

    @cached_property
    def spans(self) -> tuple[Span, ...]:
        """Every task as it ran, by task id."""
        b, start, end = self._columns
        return tuple(Span(i, b.names[i], b.streams[b.stream_of[i]], start[i], end[i], b.phases[i], b.allocs[i],
                          b.frees[i]) for i in range(len(start)))

    def memory_after(self, task: int, resident: int = 0) -> int:
        """Bytes allocated on the task's device right after it ends (before anything starting then):
        what a measurement taken between two host calls sees, transients of finished tasks excluded."""
        at = self.spans[task]
        level = resident
        for s in self.spans:
            if s.stream.device != at.stream.device:
                continue
            if s.alloc and (s.start < at.end or s.start == at.end and s.task <= task):
                level += s.alloc
            if s.free and (s.end < at.end or s.end == at.end and s.task <= task):
                level -= s.free
        return level

    def exposed_comm_s(self, device: Hashable) -> float:
        """Time the device's compute streams stood idle within the step (waiting on communication or peers)."""
        compute = sum(v for k, v in self.busy_s.items() if k in self._labels(device, COMPUTE))
        return max(0.0, self.step_s - compute)

    def _labels(self, device: Hashable, kind: str) -> set[str]:
        return {s.stream.label() for s in self.spans if s.stream.device == device and s.stream.kind == kind}

    def critical_breakdown(self) -> dict[str, float]:
        """Seconds of the critical path by phase ("forward", "backward", "grad_sync", ...)."""
        by_id = {s.task: s for s in self.spans}
        out: dict[str, float] = {}
        for t in self.critical_path:
            s = by_id[t]
            out[s.phase] = out.get(s.phase, 0.0) + (s.end - s.start)
        return out

    def timeline(self, width: int = 64, limit: int = 40) -> str:
        """Each stream as a bar over the step (`#` busy), then the longest tasks: for `explain`."""
        if not self.spans or self.step_s <= 0:
            return "  (empty step)"
        scale = width / self.step_s
        lines = []
        streams: dict[str, list[Span]] = {}
        for s in self.spans:
            streams.setdefault(s.stream.label(), []).append(s)
        name_width = max(len(k) for k in streams)
        for label, spans in streams.items():
            bar = [" "] * width
            for s in spans:
                if s.end <= s.start:
                    continue
                for c in range(int(s.start * scale), min(width, max(int(s.start * scale) + 1, int(s.end * scale)))):
                    bar[c] = "#"
            lines.append(f"  {label:<{name_width}} |{''.join(bar)}| {self.busy_s.get(label, 0.0) * 1e3:9.3f} ms busy")
        for device, seconds in self.overlap_s.items():
            lines.append(f"  {str(device):<{name_width}} overlap of compute and communication {seconds * 1e3:.3f} ms")
        return "\n".join(lines)


class StepBuilder:
    """Collects streams and tasks in issue order; `simulate()` runs them.

    Tasks are stored column-wise (plain lists) because extraction prices
    many candidate plans: adding and simulating a task must cost microseconds.
    The dependencies of `repeat`'s copies are not written out: each copy run
    (`_copies`) reads its source's, shifted, as `simulate` visits it (`deps`
    writes them out for a reader).
    """

    def __init__(self) -> None:
        self.streams: list[Stream] = []
        self._stream_ids: dict[Stream, int] = {}
        self.names: list[str] = []
        self.stream_of: list[int] = []
        self.durations: list[float] = []
        self._deps: list[tuple[int, ...] | None] = []   # None for a task of a copy run
        # copy runs in task order: (first, end, source's first, shift): tasks first..end-1 are the tasks from
        # source's first on, each dependency on one of them (an id >= source's first) moved by shift
        self._copies: list[tuple[int, int, int, int]] = []
        self._written: tuple[int, int, list] | None = None   # `deps` written out, for (tasks, copy runs)
        self.allocs: list[int] = []
        self.frees: list[int] = []
        self.phases: list[str] = []

    @property
    def deps(self) -> list[tuple[int, ...]]:
        """Each task's dependencies (a copy's as `repeat` says: moved onto the copies of the tasks it copies)."""
        if not self._copies:
            return self._deps
        key = (len(self._deps), len(self._copies))
        if self._written is None or self._written[:2] != key:
            out = list(self._deps)
            for first, end, source, shift in self._copies:
                out[first:end] = [tuple([d + shift if d >= source else d for d in deps]) if deps else deps
                                  for deps in self._deps[source:source + end - first]]
            self._written = (*key, out)
        return self._written[2]

    def stream(self, device: Hashable, kind: str = COMPUTE, name: str = "") -> int:
        """The id of a stream of `device` (created on first use)."""
        key = Stream(device, kind, name)
        found = self._stream_ids.get(key)
        if found is None:
            found = self._stream_ids[key] = len(self.streams)
            self.streams.append(key)
        return found

    def add(self, name: str, stream: int, duration: float, deps: Iterable[int] = (), alloc: int = 0, free: int = 0,
            phase: str = "") -> int:
        """Add a task (after every task already added on its stream); its id."""
        ident = len(self.names)
        deps = tuple(deps)
        if len(deps) == 1:   # most tasks wait for one: the checks below, on it alone
            if deps[0] is None:
                deps = ()
            elif not 0 <= deps[0] < ident:
                raise SimulationError(f"task '{name}' depends on task {deps[0]}, which is not an earlier task")
        elif deps:
            if None in deps:   # a builder's "no task" (a value that exists before the step) waits for nothing
                deps = tuple([d for d in deps if d is not None])
            # one comparison of the extremes for the common case (a step adds 10^5 tasks); the first bad one named
            if deps and not (0 <= min(deps) and max(deps) < ident):
                bad = next(d for d in deps if not 0 <= d < ident)
                raise SimulationError(f"task '{name}' depends on task {bad}, which is not an earlier task")
        if not duration >= 0:
            raise SimulationError(f"task '{name}' has duration {duration}")
        if not 0 <= stream < len(self.streams):
            raise SimulationError(f"task '{name}' is on unknown stream {stream}")
        self.names.append(name)
        self.stream_of.append(stream)
        self.durations.append(float(duration))
        self._deps.append(deps)
        # most tasks hold no bytes: their 0 appended as it is (`int(0)` is that 0)
        self.allocs.append(int(alloc) if alloc else 0)
        self.frees.append(int(free) if free else 0)
        self.phases.append(phase)
        return ident

    def __len__(self) -> int:
        return len(self.names)

    def repeat(self, start: int, end: int) -> None:
        """Tasks `start` to `end` (excluded) added again, in order, after every task so far: a dependency among
        them becomes one on the copy of that task, one on an earlier task stays. Each already passed `add`'s
        checks, and the copies keep every dependency on an earlier task.

        The copies' dependencies are a copy run (`_copies`), read shifted where `simulate` visits them: a step
        of many micro-batches repeats 10^5-10^6 tasks, and writing a tuple per task was most of the copying. A
        range holding copies itself is written out (`deps`) first."""
        shift, first = len(self.names) - start, len(self.names)
        self.names.extend(self.names[start:end])
        self.stream_of.extend(self.stream_of[start:end])
        self.durations.extend(self.durations[start:end])
        if end <= start:
            pass
        elif any(s < end and start < e for s, e, _source, _shift in self._copies):
            written = self.deps
            self._deps, self._copies = list(written), []   # every task written out, no copy run
            self._deps.extend([tuple([d + shift if d >= start else d for d in deps]) if deps else deps
                               for deps in written[start:end]])
        else:
            self._deps.extend([None] * (end - start))
            self._copies.append((first, first + end - start, start, shift))
        self.allocs.extend(self.allocs[start:end])
        self.frees.extend(self.frees[start:end])
        self.phases.extend(self.phases[start:end])

    def simulate(self, resident: Mapping[Hashable, int] | None = None, last: bool = False) -> StepResult:
        """Run the step: `resident` bytes are held on each device throughout (weights, optimizer state).
        `last`: no task is added after this, so the result reads these columns rather than a copy of them
        (`pcg_tasks.simulate_pcg`, whose builder ends here: a step of many micro-batches has 10^5-10^6 tasks).
        The critical path and the streams' busy times are worked out when asked (`StepResult.critical_path`,
        `busy_s`): the loop keeps the ends alone."""
        n = len(self.names)
        free_at = [0.0] * len(self.streams)
        start = [0.0] * n
        end = [0.0] * n
        stream_of, durations, deps = self.stream_of, self.durations, self._deps
        # run by run (`_runs`), each dependency at or past `cut` read moved by `shift` (a copy's, as `repeat` would
        # have written it: the same comparisons and sums, so the same figures)
        for first, stop, read, cut, shift in self._runs():
            for i, s, needs, duration in zip(range(first, stop), stream_of[first:stop],
                                             deps[read:read + stop - first], durations[first:stop]):
                t = free_at[s]
                for d in needs:
                    if d >= cut:
                        d += shift
                    e = end[d]
                    if e > t:
                        t = e
                start[i] = t
                end[i] = free_at[s] = t + duration
        step = max(end, default=0.0)
        snapshot = self
        if not last:   # the columns as they are now, if tasks are added later
            snapshot = StepBuilder.__new__(StepBuilder)
            snapshot.__dict__.update({k: list(v) if isinstance(v, list) else v for k, v in self.__dict__.items()})
        return StepResult(step, (snapshot, start, end), dict(resident or {}))

    def _busy(self) -> dict[str, float]:
        """Stream label -> its tasks' durations summed in task order from 0.0 (`StepResult.busy_s`)."""
        per_stream = [0.0] * len(self.streams)
        for s, duration in zip(self.stream_of, self.durations):
            per_stream[s] += duration
        return {stream.label(): per_stream[k] for k, stream in enumerate(self.streams)}

    def _critical_path(self, end: Sequence[float]) -> tuple[int, ...]:
        """The tasks `simulate`'s ends (`end`) hold on one another, first to last: from the first task that ends
        last, back through each task's `_held_by`."""
        n = len(end)
        if not n:
            return ()
        held_by = self._held_by(end)
        path: list[int] = []
        i = end.index(max(end))   # the first task of the largest end, as `max` over the ids by end finds it
        while i >= 0:
            path.append(i)
            i = held_by(i)
        path.reverse()
        return tuple(path)

    def _held_by(self, end: Sequence[float]) -> Callable[[int], int]:
        """Task -> the task that held it up in `simulate` (-1: none, it started at 0), from the ends: the latest
        earlier task on its stream (whose end is the instant the stream came free, 0.0 where there is none),
        replaced by each dependency, in order, that ends strictly later. `simulate` took exactly these
        comparisons, in this order, over the same ends (an end never changes once made), so this is the
        predecessor it would have kept per task (a dependency of a copy as `deps` writes it out, moved as
        `simulate` moves it)."""
        before: list[int] = []   # task -> the latest earlier task on its stream
        latest = [-1] * len(self.streams)
        for i, s in enumerate(self.stream_of):
            before.append(latest[s])
            latest[s] = i
        deps = self.deps

        def held_by(i: int) -> int:
            why = before[i]
            t = end[why] if why >= 0 else 0.0
            for d in deps[i]:
                e = end[d]
                if e > t:
                    t, why = e, d
            return why
        return held_by

    def _runs(self) -> list[tuple[int, int, int, int, int]]:
        """The tasks in runs, in order: (first, end, where its dependencies are read from, cut, shift): a run
        written out reads its own and moves none (cut past every id); a copy run reads its source's and moves
        those at or past the source's first."""
        n, at, out = len(self._deps), 0, []
        for first, end, source, shift in self._copies:
            out += [(at, first, at, n, 0), (first, end, source, source, shift)]
            at = end
        return out + [(at, n, at, n, 0)]

    def _overlap(self, start: Sequence[float], end: Sequence[float]) -> dict[Hashable, float]:
        """Per device: the measure of the time its compute and its communication streams were both busy."""
        keys = [(stream.device, stream.kind) for stream in self.streams]
        intervals: dict[tuple[Hashable, str], list[tuple[float, float]]] = {}
        for i, s in enumerate(self.stream_of):
            if end[i] > start[i]:
                intervals.setdefault(keys[s], []).append((start[i], end[i]))
        out = {}
        for device in {s.device for s in self.streams}:
            a = union(intervals.get((device, COMPUTE), []))
            b = union(intervals.get((device, COMM), []))
            out[device] = intersection_length(a, b)
        return out

    def _peaks(self, start: Sequence[float], end: Sequence[float], resident: Mapping[Hashable, int]) -> dict:
        """Per device: the largest sum of allocated bytes at any instant (frees before allocations at a tie).

        The events (an allocation at its task's start, a free at its end; a zero-length task's free after the
        allocations of its instant) are ordered by (instant, kind) and their running sum's largest value is the
        peak. Events of one (instant, kind) all allocate or all free, so their order among themselves leaves
        that largest value alone: within a run of allocations the sum only grows (its largest at the run's
        end, the same sum in any order), within a run of frees it only falls (its largest before the run).
        So one stable sort by (instant, kind) and a running integer sum give the figure the ordered sweep
        does (`_peaks_swept`, which a negative or huge byte count still takes)."""
        allocs, frees = self.allocs, self.frees
        if not allocs or min(allocs) < 0 or min(frees) < 0 or sum(allocs) + sum(frees) >= 2 ** 62:
            return self._peaks_swept(start, end, resident)
        devices = [stream.device for stream in self.streams]
        known = list(dict.fromkeys(devices))
        device_of = np.asarray([known.index(d) for d in devices], dtype=np.int64)[
            np.asarray(self.stream_of, dtype=np.int64)]
        took_all, gave_all = np.asarray(allocs, dtype=np.int64), np.asarray(frees, dtype=np.int64)
        begin, finish = np.asarray(start, dtype=np.float64), np.asarray(end, dtype=np.float64)
        out = {}
        for device in {s.device for s in self.streams} | set(resident):
            level = peak = int(resident.get(device, 0))
            if device in known:
                mine = device_of == known.index(device)
                took, gave = mine & (took_all != 0), mine & (gave_all != 0)
                instants = np.concatenate([begin[took], finish[gave]])
                kinds = np.concatenate([np.ones(int(took.sum()), dtype=np.int64),
                                        np.where(finish[gave] > begin[gave], 0, 2)])
                deltas = np.concatenate([took_all[took], -gave_all[gave]])
                if len(deltas):
                    peak = max(peak, level + int(np.cumsum(deltas[np.lexsort((kinds, instants))]).max()))
            out[device] = peak
        return out

    def _peaks_swept(self, start: Sequence[float], end: Sequence[float], resident: Mapping[Hashable, int]) -> dict:
        """`_peaks` as one ordered sweep of every memory event, in Python: the reference it is checked against."""
        events: dict[Hashable, list[tuple[float, int, int]]] = {}
        devices = [stream.device for stream in self.streams]
        for i, s in enumerate(self.stream_of):
            if not (self.allocs[i] or self.frees[i]):
                continue
            device = devices[s]
            if self.allocs[i]:
                events.setdefault(device, []).append((start[i], 1, self.allocs[i]))
            if self.frees[i]:  # a zero-length task's free comes after the allocations of its instant
                events.setdefault(device, []).append((end[i], 0 if end[i] > start[i] else 2, -self.frees[i]))
        out = {}
        for device in {s.device for s in self.streams} | set(resident):
            level = peak = int(resident.get(device, 0))
            for _t, _order, delta in sorted(events.get(device, [])):
                level += delta
                if level > peak:
                    peak = level
            out[device] = peak
        return out


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intervals merged where they touch or overlap, sorted."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intersection of two sorted unions of intervals (`union`), as sorted intervals."""
    i = j = 0
    out: list[tuple[float, float]] = []
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def intersection_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The measure of the intersection of two sorted unions of intervals."""
    return sum(hi - lo for lo, hi in intersection(a, b))


__all__ = ["COMM", "COMPUTE", "SimulationError", "Span", "StepBuilder", "StepResult", "Stream", "intersection",
           "intersection_length", "union"]
