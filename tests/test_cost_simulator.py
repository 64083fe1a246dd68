"""The step simulator: in-order streams, dependencies, critical path, overlap, memory; DDP buckets, FSDP prefetch."""

from __future__ import annotations

import pytest

from parsat.cost.schedules import Gradient, GradientBuckets, Unit, assign_buckets, fsdp_step
from parsat.cost.simulator import COMM, COMPUTE, SimulationError, StepBuilder


def test_a_stream_runs_its_tasks_in_order_and_streams_run_at_once():
    b = StepBuilder()
    compute, comm = b.stream(0, COMPUTE), b.stream(0, COMM)
    a = b.add("a", compute, 3.0)
    c = b.add("c", comm, 2.0, [a])          # waits for a
    b.add("d", compute, 4.0)                 # runs while c does
    e = b.add("e", compute, 1.0, [c])
    r = b.simulate()
    spans = {s.name: (s.start, s.end) for s in r.spans}
    assert spans == {"a": (0, 3), "c": (3, 5), "d": (3, 7), "e": (7, 8)}
    assert r.step_s == 8
    assert r.busy_s == {"0:compute": 8, "0:comm": 2}
    assert r.overlap_s[0] == 2                # c ran entirely under d
    assert [b.names[i] for i in r.critical_path] == ["a", "d", "e"]
    assert r.exposed_comm_s(0) == 0
    assert e == 3


def test_exposed_communication_and_critical_path_through_a_collective():
    b = StepBuilder()
    compute, comm = b.stream("gpu", COMPUTE), b.stream("gpu", COMM)
    a = b.add("forward", compute, 1.0, phase="forward")
    c = b.add("all-reduce", comm, 5.0, [a], phase="grad_sync")
    b.add("update", compute, 1.0, [c], phase="optimizer")
    r = b.simulate()
    assert r.step_s == 7 and r.exposed_comm_s("gpu") == 5
    assert r.critical_breakdown() == {"forward": 1.0, "grad_sync": 5.0, "optimizer": 1.0}
    assert "gpu:compute" in r.timeline() and "overlap" in r.timeline()


def test_peak_memory_follows_allocations_and_frees_over_time():
    b = StepBuilder()
    s = b.stream(0)
    b.add("forward 1", s, 1.0, alloc=100)
    b.add("forward 2", s, 1.0, alloc=50)
    b.add("backward 2", s, 1.0, free=50)
    b.add("backward 1", s, 1.0, alloc=120, free=220)   # a transient of 120 on top of what it frees at its end
    assert b.simulate({0: 1000}).peak_memory_bytes[0] == 1000 + 100 + 50 - 50 + 120


def test_a_zero_length_task_still_counts_its_transient():
    b = StepBuilder()
    s = b.stream(0)
    b.add("x", s, 0.0, alloc=64, free=64)
    assert b.simulate().peak_memory_bytes[0] == 64


def test_frees_before_allocations_at_the_same_instant_across_streams():
    b = StepBuilder()
    s0, s1 = b.stream(0), b.stream(0, COMM)
    b.add("holds until 1", s0, 1.0, alloc=100, free=100)
    b.add("starts at 1", s1, 1.0, [0], alloc=100)
    assert b.simulate().peak_memory_bytes[0] == 100


def test_bad_tasks_are_refused():
    b = StepBuilder()
    s = b.stream(0)
    with pytest.raises(SimulationError):
        b.add("later dep", s, 1.0, [0])
    with pytest.raises(SimulationError):
        b.add("negative", s, -1.0)
    with pytest.raises(SimulationError):
        b.add("nowhere", 5, 1.0)


def test_devices_are_separate_and_cross_device_dependencies_wait():
    b = StepBuilder()
    s0, s1 = b.stream(0), b.stream(1)
    send = b.add("stage 0", s0, 2.0)
    b.add("stage 1", s1, 3.0, [send])
    r = b.simulate()
    assert r.step_s == 5 and set(r.peak_memory_bytes) == {0, 1}


# -------------------------------------------------------------------- DDP buckets


def test_bucket_assignment_first_bucket_small_then_caps_and_big_gradients_alone():
    grads = [Gradient(f"g{i}", size) for i, size in enumerate([300, 800, 100, 2000, 500, 500, 100])]
    buckets = assign_buckets(grads, bucket_bytes=1000, first_bucket_bytes=1000 // 2)
    assert [[g.name for g in bucket] for bucket in buckets] == [["g0", "g1"], ["g2", "g3"], ["g4", "g5"], ["g6"]]


def test_buckets_launch_when_complete_in_order_and_overlap_backward():
    b = StepBuilder()
    compute = b.stream(0, COMPUTE)
    grads = [Gradient(f"w{i}", 100) for i in range(4)]     # backward order
    buckets = GradientBuckets(b, 0, grads, lambda nbytes: nbytes / 100, bucket_bytes=200, first_bucket_bytes=100)
    assert [len(x) for x in buckets.buckets] == [1, 2, 1]
    launched = []
    for i in range(4):
        task = b.add(f"backward {i}", compute, 2.0)
        launched += buckets.ready(f"w{i}", task)
    r = b.simulate()
    spans = {s.name: (s.start, s.end) for s in r.spans}
    assert len(launched) == 3 and buckets.done() == launched
    starts = [r.spans[t].start for t in launched]
    assert starts == [2.0, 6.0, 8.0]           # each as soon as its last gradient is ready
    assert spans["backward 3"] == (6.0, 8.0)
    assert r.step_s == 9.0 and r.overlap_s[0] == pytest.approx(3.0)


def test_buckets_after_backward_launch_only_when_backward_has_returned():
    """Megatron-LM's `--DDP-impl local` of 2021: the same buckets, all launched after the backward's last task, so
    the step is the backward plus every bucket's all-reduce (the overlapped one above: 9.0 s)."""
    b = StepBuilder()
    compute = b.stream(0, COMPUTE)
    grads = [Gradient(f"w{i}", 100) for i in range(4)]
    buckets = GradientBuckets(b, 0, grads, lambda nbytes: nbytes / 100, bucket_bytes=200, first_bucket_bytes=100,
                              after_backward=True)
    for i in range(4):
        assert buckets.ready(f"w{i}", b.add(f"backward {i}", compute, 2.0)) == []
    end = b.add("input gradient after the last weight's", compute, 1.0)
    launched = buckets.done(end)
    r = b.simulate()
    assert [r.spans[t].start for t in launched] == [9.0, 10.0, 12.0]
    assert r.step_s == 13.0 and r.overlap_s[0] == 0.0


def test_a_bucket_waits_for_the_earlier_ones():
    b = StepBuilder()
    s = b.stream(0)
    buckets = GradientBuckets(b, 0, [Gradient("a", 10), Gradient("b", 10)], lambda n: 1.0, bucket_bytes=10,
                              first_bucket_bytes=10)
    t = b.add("grad b", s, 1.0)
    assert buckets.ready("b", t) == []          # bucket 1 is complete, bucket 0 is not: DDP waits
    t = b.add("grad a", s, 1.0)
    assert len(buckets.ready("a", t)) == 2


def test_a_gradient_never_ready_is_an_error():
    b = StepBuilder()
    buckets = GradientBuckets(b, 0, [Gradient("a", 10)], lambda n: 1.0)
    with pytest.raises(SimulationError, match="never ready"):
        buckets.done()
    with pytest.raises(SimulationError, match="no bucket"):
        buckets.ready("z", 0)


# -------------------------------------------------------------------- FSDP


def test_fsdp_prefetches_one_unit_ahead_and_frees_gathered_parameters():
    b = StepBuilder()
    units = [Unit(f"layer{i}", gathered_bytes=1000, forward_s=1.0, backward_s=2.0, activation_bytes=10)
             for i in range(4)]
    tasks = fsdp_step(b, 0, units, all_gather_s=lambda n: 0.5, reduce_scatter_s=lambda n: 0.5)
    r = b.simulate({0: 400})
    start = {s.task: s.start for s in r.spans}
    end = {s.task: s.end for s in r.spans}
    forward = tasks.forward
    assert start[forward[0]] == 0.5                         # the first all-gather is exposed
    assert all(start[forward[i + 1]] == end[forward[i]] for i in range(3))   # the others hidden by prefetch
    assert r.step_s == pytest.approx(0.5 + 4 * 1.0 + 0.5 + 4 * 2.0 + 0.5)  # + first backward gather, last scatter
    # at most two units' parameters gathered and two units' unsharded gradients (one being reduce-scattered)
    # at once, plus the activations: never the whole model gathered (8 units' worth)
    assert r.peak_memory_bytes[0] == 400 + 2 * 1000 + 2 * 1000 + 3 * 10
    assert len(tasks.all_gathers) == 8 and len(tasks.reduce_scatters) == 4


def test_fsdp_with_slow_gathers_is_communication_bound():
    b = StepBuilder()
    units = [Unit(f"l{i}", 1000, 1.0, 1.0) for i in range(3)]
    fsdp_step(b, 0, units, all_gather_s=lambda n: 3.0, reduce_scatter_s=lambda n: 0.0)
    assert b.simulate().step_s >= 6 * 3.0


def test_memory_after_a_task_leaves_out_finished_transients_and_later_allocations():
    b = StepBuilder()
    s = b.stream(0)
    first = b.add("gather", s, 1.0, alloc=100)
    concat = b.add("concat", s, 1.0, alloc=100, free=100)     # the gathered buffers die with the concatenation
    b.add("next", s, 1.0, alloc=7)
    r = b.simulate({0: 10})
    assert r.peak_memory_bytes[0] == 210
    assert r.memory_after(first, 10) == 110
    assert r.memory_after(concat, 10) == 110                  # the transient 200 is not seen between calls


def _random_step(seed: int, devices: int = 3, tasks: int = 400) -> StepBuilder:
    """A step of random tasks over several devices' streams: many tasks at the same instants (zero-length ones,
    equal durations), allocations and frees of all sizes, some tasks both allocating and freeing."""
    import random
    rng = random.Random(seed)
    b = StepBuilder()
    streams = [b.stream(f"d{k}", kind) for k in range(devices) for kind in (COMPUTE, COMM)]
    for i in range(tasks):
        deps = rng.sample(range(i), k=min(i, rng.randint(0, 3)))
        b.add(f"t{i}", rng.choice(streams), rng.choice([0.0, 0.5, 1.0, 0.25 * rng.randint(1, 8)]), deps,
              alloc=rng.choice([0, 0, 1, 7, 2 ** 40]), free=rng.choice([0, 0, 3, 7, 2 ** 40]))
    return b


@pytest.mark.parametrize("seed", range(12))
def test_the_memory_peak_sums_events_as_the_ordered_sweep_does(seed):
    """`_peaks` (a stable sort by instant and kind, a running sum) gives each device the peak the ordered sweep
    of every event gives (`_peaks_swept`, the reference), with ties at one instant, zero-length tasks, and a
    resident amount on a device no task runs on; a negative byte count takes the sweep itself."""
    b = _random_step(seed)
    result = b.simulate()
    _snapshot, start, end = result._columns
    resident = {"d0": 5, "elsewhere": 11}
    assert b._peaks(start, end, resident) == b._peaks_swept(start, end, resident)
    assert list(b._peaks(start, end, resident)) == list(b._peaks_swept(start, end, resident))
    assert b._peaks(start, end, {}) == b._peaks_swept(start, end, {})
    b.frees[-1] = -4   # not something a builder adds: the reference sweep answers it
    assert b._peaks(start, end, resident) == b._peaks_swept(start, end, resident)


def test_a_repeated_span_depends_on_its_own_copies_and_keeps_earlier_dependencies():
    """`repeat`: a copied task's dependency inside the span moves to the copy, one before it stays, one
    without any stays without; the simulation of the copies is the one of tasks added anew."""
    b, fresh = StepBuilder(), StepBuilder()
    for builder in (b, fresh):
        s, c = builder.stream("d", COMPUTE), builder.stream("d", COMM)
        builder.add("w", s, 1.0)
        builder.add("f", s, 2.0, [0], alloc=4)
        builder.add("g", c, 1.5, [1, 0], free=4)
        builder.add("h", s, 0.5)
    b.repeat(1, 4)
    fresh.add("f", 0, 2.0, [0], alloc=4)
    fresh.add("g", 1, 1.5, [4, 0], free=4)
    fresh.add("h", 0, 0.5)
    assert b.deps == fresh.deps == [(), (0,), (1, 0), (), (0,), (4, 0), ()]
    one, other = b.simulate(), fresh.simulate()
    assert (one.step_s, one.busy_s, one.peak_memory_bytes, one.critical_path) == \
        (other.step_s, other.busy_s, other.peak_memory_bytes, other.critical_path)


def _written_out(b: StepBuilder, start: int, end: int) -> None:
    """`repeat` as it was before copy runs: every copied task's dependencies written out (the reference)."""
    shift = len(b.names) - start
    for i in range(start, end):
        b.add(b.names[i], b.stream_of[i], b.durations[i], [d + shift if d >= start else d for d in b.deps[i]],
              b.allocs[i], b.frees[i], b.phases[i])


@pytest.mark.parametrize("seed", range(8))
def test_copy_runs_simulate_as_the_tasks_written_out(seed):
    """`repeat`'s copy runs (dependencies read shifted from their source as `simulate` visits them) give every
    figure the same tasks added one by one give, bit for bit: ends, starts, step, busy times, critical path,
    peaks and `deps`; with tasks added between and after runs, several runs of one source, and a range holding
    copies repeated (written out first)."""
    import random
    rng = random.Random(seed)
    virtual, written = _random_step(seed, tasks=60), _random_step(seed, tasks=60)
    runs = 0
    for _ in range(6):
        n = len(virtual.names)
        start = rng.randrange(0, n - 1)
        end = rng.randrange(start + 1, min(n, start + 40) + 1)
        virtual.repeat(start, end)
        runs = max(runs, len(virtual._copies))
        _written_out(written, start, end)
        for builder in (virtual, written):   # a task after the run, reading one of the copies
            builder.add("after", 0, 0.5, [len(builder.names) - 1], alloc=3, free=1)
    assert runs and virtual.deps == written.deps and virtual.names == written.names
    one, other = virtual.simulate({"d0": 4}), written.simulate({"d0": 4})
    assert (one.step_s, one.busy_s, one.critical_path, one.peak_memory_bytes, one.overlap_s) == \
        (other.step_s, other.busy_s, other.critical_path, other.peak_memory_bytes, other.overlap_s)
    assert one._columns[1:] == other._columns[1:]


def test_the_peaks_worked_out_when_read_are_those_of_the_simulated_tasks():
    """`StepResult.peak_memory_bytes` is worked out on first read (a search reads most steps' time alone): from
    the tasks as they were when simulated, with the resident bytes, whatever the builder was given since."""
    b = StepBuilder()
    c = b.stream(0, COMPUTE)
    first = b.add("a", c, 1.0, alloc=100)
    b.add("b", c, 1.0, [first], alloc=50, free=100)
    result = b.simulate({0: 7, 1: 3})
    b.add("later", c, 1.0, alloc=10**6)           # after the simulation: not part of its step
    assert result.peak_memory_bytes == {0: 157, 1: 3} == StepBuilder._peaks_swept(
        result._columns[0], result._columns[1], result._columns[2], {0: 7, 1: 3})
