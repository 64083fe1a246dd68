"""The step simulator's loop keeps the ends alone (session 77): the critical path and the streams' busy times,
worked out when read (`StepResult.critical_path`, `busy_s`), are the ones the loop kept per task before."""

from __future__ import annotations

import random

import pytest

from parsat.cost.simulator import COMM, COMPUTE, StepBuilder


def _reference(b: StepBuilder) -> tuple[float, list[float], list[float], tuple[int, ...], dict[str, float]]:
    """The loop as it was before session 77 (each task's predecessor and each stream's busy time kept as it runs),
    over the dependencies written out (`deps`): (step, starts, ends, critical path, busy times)."""
    n, streams = len(b.names), len(b.streams)
    free_at, latest, per_stream = [0.0] * streams, [-1] * streams, [0.0] * streams
    start, end, held_by = [0.0] * n, [0.0] * n, [-1] * n
    for i, (s, needs, duration) in enumerate(zip(b.stream_of, b.deps, b.durations)):
        t, why = free_at[s], latest[s]
        for d in needs:
            if end[d] > t:
                t, why = end[d], d
        start[i] = t
        end[i] = free_at[s] = t + duration
        latest[s] = i
        held_by[i] = why
        per_stream[s] += duration
    path: list[int] = []
    if n:
        i = max(range(n), key=end.__getitem__)
        while i >= 0:
            path.append(i)
            i = held_by[i]
        path.reverse()
    busy = {stream.label(): per_stream[k] for k, stream in enumerate(b.streams)}
    return max(end, default=0.0), start, end, tuple(path), busy


def _random_step(rng: random.Random, tasks: int) -> StepBuilder:
    """A step of `tasks` tasks on five streams of two devices, durations from a few values (ties everywhere:
    the predecessor a tie leaves is what the path reads), each reading up to three earlier tasks."""
    b = StepBuilder()
    streams = [b.stream(d, kind, name) for d in ("d0", "d1") for kind, name in ((COMPUTE, ""), (COMM, "nv"))]
    streams.append(b.stream("d0", COMM, "net"))
    for i in range(tasks):
        deps = rng.sample(range(i), min(i, rng.randint(0, 3)))
        b.add(f"t{i}", rng.choice(streams), rng.choice([0.0, 0.0, 0.5, 1.0, 0.1, 0.2, 0.3]), deps,
              phase=rng.choice(["forward", "backward"]))
    return b


@pytest.mark.parametrize("seed", range(16))
def test_the_path_and_busy_times_read_later_are_those_the_loop_kept(seed):
    """With copy runs (`repeat`, some of a range holding copies: written out), ties and zero-length tasks, the
    result's step, starts, ends, critical path and busy times are the reference loop's, bit for bit."""
    rng = random.Random(seed)
    b = _random_step(rng, 50)
    for _ in range(4):
        n = len(b.names)
        first = rng.randrange(0, n - 1)
        b.repeat(first, rng.randrange(first + 1, min(n, first + 30) + 1))
        b.add("after", rng.randrange(len(b.streams)), 0.25, [len(b.names) - 1])
    for i in range(12):   # tasks added anew, then copied: a copy run past every other (none of it a copy)
        b.add(f"u{i}", rng.randrange(len(b.streams)), rng.choice([0.0, 0.5]), [len(b.names) - 1 - rng.randrange(30)])
    b.repeat(len(b.names) - 12, len(b.names))
    assert b._copies   # copy runs are read shifted by the loop, and by the path's walk back
    step, start, end, path, busy = _reference(b)
    result = b.simulate()
    assert (result.step_s, result._columns[1], result._columns[2]) == (step, start, end)
    assert result.critical_path == path
    assert result.busy_s == busy and list(result.busy_s) == list(busy)


def test_a_result_read_after_more_tasks_were_added_reads_the_step_it_simulated():
    """`simulate()` (not `last`): tasks added afterwards are no part of the path or the busy times read later."""
    rng = random.Random(7)
    b = _random_step(rng, 40)
    step, _start, _end, path, busy = _reference(b)
    result = b.simulate()
    for i in range(10):
        b.add(f"later {i}", 0, 5.0, [len(b.names) - 1])
    assert result.critical_path == path and result.busy_s == busy and result.step_s == step


def test_an_empty_step_has_no_path_and_idle_streams():
    b = StepBuilder()
    b.stream(0)
    result = b.simulate()
    assert result.critical_path == () and result.busy_s == {"0:compute": 0.0} and result.step_s == 0.0


def test_a_simulated_training_step_reads_the_reference_path():
    """A whole step of a 3-block gpt in Megatron's sequence-parallel layout on tp 2 x dp 2 with ZeRO-1 and its
    blocks recomputed, 4 micro-batches (copy runs), as DDP with tensor-parallel overlap runs it: the critical
    path and busy times read off the ends are the reference loop's."""
    from parsat.cost.pcg_tasks import DDP, simulate_pcg
    from parsat.dsl.library import load_library, shipped_rules_dir
    from parsat.ir.machine import Machine
    from parsat.ir.megatron import megatron_pcg
    from parsat.ir.models import gpt
    from parsat.ir.pcg import restated

    library = load_library([shipped_rules_dir() / "ops.rule"])[0]
    graph = gpt(blocks=3, batch=8, seq=64, hidden=64, heads=4, vocab=128, library=library)
    pcg = restated(megatron_pcg(graph, library, (2, 2), 8, sequence=True), 1, "blocks")
    machine = Machine.resolve("h100x8").with_devices(4)
    prediction = simulate_pcg(pcg, library, machine, DDP, microbatches=4)
    b = prediction.result._columns[0]
    assert b._copies and prediction.pipelined
    step, _start, end, path, busy = _reference(b)
    assert (prediction.result.step_s, prediction.result._columns[2]) == (step, end)
    assert prediction.result.critical_path == path and prediction.result.busy_s == busy
