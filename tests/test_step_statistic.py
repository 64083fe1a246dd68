"""The step's statistic, one for both sides of `parsat run`'s comparison (issue 31): the run's steps and the
calibration's rounds are summarised alike (each the slowest rank's, the median, the middle half), and what
`parsat run` prints and writes says the measured step, its spread, the prediction, their ratio and each
rank's CPU a step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from parsat.backend import calibrate  # noqa: E402
from parsat.backend.cli import step_time_line  # noqa: E402
from parsat.backend.executor import Prediction, RunResult  # noqa: E402
from parsat.backend.launch import RankContext  # noqa: E402
from parsat.backend.step_statistic import Spread, slowest_per_round, spread, steady  # noqa: E402
from parsat.backend.training_data import TrainConfig  # noqa: E402


def test_the_spread_is_the_median_and_the_quartiles():
    s = spread([0.004, 0.001, 0.002, 0.003, 0.100])
    assert (s.median_s, s.low_s, s.high_s, s.count) == (0.003, 0.002, 0.004, 5)
    assert s.relative_width == pytest.approx(2 / 3)
    assert spread([0.005]) == Spread(0.005, 0.005, 0.005, 1)
    with pytest.raises(ValueError):
        spread([])


def test_a_round_takes_its_slowest_rank_and_the_warmup_is_left_out():
    assert slowest_per_round([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == [3.0, 5.0, 2.5]
    assert steady([9.0, 1.0, 2.0]) == [1.0, 2.0]
    assert steady([9.0]) == [9.0]   # a one-step run is its own sample


def _job(step_times, by_rank=None, cpu=None) -> dict:
    return {"job": {"max_abs_diff": None, "sent": 0.0, "distinct_sent": 0.0, "grad_sync": 0.0,
                    "step_times": step_times, "peak_memory_bytes": 0, "process_rss_bytes": 0,
                    "step_times_by_rank": by_rank, "step_cpu_times_by_rank": cpu}, "losses": [1.0]}


def test_a_runs_step_is_the_median_after_the_warmup_with_its_middle_half_and_each_ranks_cpu():
    wall = [[0.050, 0.004, 0.003, 0.005, 0.030, 0.004], [0.040, 0.004, 0.002, 0.006, 0.010, 0.003]]
    cpu = [[0.020, 0.003, 0.003, 0.004, 0.004, 0.003], [0.020, 0.002, 0.002, 0.002, 0.003, 0.002]]
    result = RunResult.of_job([_job(slowest_per_round(wall), wall, cpu)], TrainConfig(check=False))
    assert result.step_time_s == 0.004   # of 0.004, 0.003, 0.006, 0.030, 0.004 (the slowest ranks' after the first)
    assert (result.step_spread.low_s, result.step_spread.high_s, result.step_spread.count) == (0.004, 0.006, 5)
    assert result.step_cpu_s == (0.003, 0.002)
    written = result.to_dict()
    assert written["step_time_quartiles_s"] == [0.004, 0.006] and written["step_cpu_s_by_rank"] == [0.003, 0.002]
    assert written["step_times_by_rank"] == wall and written["steps_timed"] == 5
    older = RunResult.of_job([_job([0.05, 0.002, 0.004])], TrainConfig(check=False))   # a runner without ranks' rows
    assert older.step_time_s == 0.003 and older.step_cpu_s == () and "step_cpu_s_by_rank" not in older.to_dict()


def test_the_line_gives_measured_predicted_ratio_spread_and_cpu():
    predicted = Prediction(time_s=0.004, machine="box", machine_kind="calibrated")
    line = step_time_line(0.005, predicted, Spread(0.005, 0.0044, 0.006, 19), (0.0031, 0.0029))
    first, second = line.splitlines()
    assert first == ("  step time (median)   5.000 ms, predicted 4.000 ms on 'box' (calibrated): measured 1.25 x the "
                     "prediction; middle half of 19 steps 4.400-6.000 ms (1.10-1.50 x)")
    assert second.startswith("    CPU a step         rank 0 3.100 ms, rank 1 2.900 ms")
    assert step_time_line(0.005, predicted) == first.split(";")[0]   # no spread given: none printed


@pytest.fixture
def one_rank():
    """A one-rank gloo group in this process: what `calibrate`'s timing needs to run (barriers, the max)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield RankContext(0, 1, "gloo", torch.device("cpu"))
    dist.destroy_process_group()


def test_a_figure_is_the_median_of_its_rounds_so_one_slow_round_does_not_move_it(one_rank):
    rounds = iter([0.001, 0.001, 0.050, 0.002, 0.001])
    assert calibrate._in_rounds(one_rank, lambda: next(rounds), calibrate.Budget(repeats=5)) == 0.001
    calls = []
    budget = calibrate.Budget(repeats=3, window_s=0.0)
    seconds = calibrate._timed(one_rank, lambda: calls.append(1), budget, lambda: None)
    assert seconds > 0 and len(calls) == 2 + 1 + 3   # two warm-ups, the call that sizes a round, a call a round


def test_compute_is_timed_on_the_ranks_cpu_time_where_one_thread_computes_and_waiting_in_wall_time():
    import time
    assert calibrate.compute_clock(cuda=False, threads=1) is time.thread_time
    assert calibrate.compute_clock(cuda=False, threads=2) is time.perf_counter   # other threads' work: wall time
    assert calibrate.compute_clock(cuda=True, threads=1) is time.perf_counter
    # ranks sharing cores (--oversubscribe) take turns on them: the turn is the job's own, in wall time
    assert calibrate.compute_clock(cuda=False, threads=1, shared_cores=True) is time.perf_counter
    assert calibrate.Budget().clock is time.perf_counter   # the collectives' (waiting) budget


def test_a_round_on_cpu_time_leaves_out_the_time_the_rank_slept(one_rank):
    import time
    budget = calibrate.Budget(repeats=3, window_s=0.0, clock=time.thread_time)
    assert calibrate._timed(one_rank, lambda: time.sleep(0.005), budget, lambda: None) < 0.002
    assert calibrate._timed(one_rank, lambda: time.sleep(0.005), calibrate.Budget(3, 0.0), lambda: None) >= 0.005


def test_a_collective_is_timed_as_a_step_issues_it_right_after_a_product_one_call_a_round(one_rank, monkeypatch):
    events = []
    monkeypatch.setattr(calibrate, "_groups", lambda ctx: {2: None})
    monkeypatch.setattr(calibrate, "_step_product", lambda ctx, dtype, size: lambda: events.append("product"))
    monkeypatch.setattr(calibrate, "collective_cases",
                        lambda ctx, dtype, n, g, group: [("all_reduce", lambda: events.append("all_reduce"))])
    budget = calibrate.Budget(repeats=2, window_s=0.0)
    collectives = calibrate.StepCollectives(one_rank, torch.float64, budget, [256], lambda: None)
    collectives.run_pass()   # one of `STEP_ROUNDS_FACTOR` passes spread over the calibration
    assert [row[:3] for row in collectives.rows()] == [["all_reduce", 2, 2048.0]]
    # two warm-up pairs, then one product and one collective a round, in `repeats` rounds a pass
    assert events == ["product", "all_reduce"] * (2 + budget.repeats)
    events.clear()
    calibrate._collectives(one_rank, torch.float64, budget, [256], lambda: None)
    assert "product" not in events and events.count("all_reduce") == 2 + 1 + 2   # ranks sharing cores: back to back
