"""Same input, same answer, however the search is called (issue 28): a plan's JSON, its pipeline search's `tried`
trace included, is the same from a plain call, from a call under `benchmarks/search_phases.py`'s wrappers (which
time the search's functions where they are looked up and ask each saturated e-graph its size,
`Session.size()`), and from the same call again in the process (every call-wide and module-level cache then warm).

Session 64 recorded gpt-175b:1024's trace as differing between search_phases.py and a plain call; the two plans it
compared came from two versions of the code (main before and after `mesh._leaner_as_run`), not from the harness
(benchmarks/search_results.md, session 65 helper A2). These tests hold the harness to observing only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from parsat.ir.machine import Machine
from parsat.ir.plan import without_timing
from parsat.search.optimize import optimize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import search_phases  # noqa: E402


def _plan_json(*args, **kwargs) -> str:
    """The plan JSON of `optimize(*args, **kwargs)` less its timing fields (`without_timing`), in its key order."""
    return json.dumps(without_timing(json.loads(optimize(*args, **kwargs).to_json())))


def _observed(monkeypatch, *args, grids: bool = False, **kwargs) -> str:
    """`_plan_json` with every wrapper search_phases.py installs (`wrap_saturations`, with `grids` `wrap_grids`
    (`--grids`), then each of `PHASES`), taken off again after the call; the wrappers must have counted the call
    (they ran)."""
    with monkeypatch.context() as patch:
        for owner, name in [(search_phases.saturate, "run_generations")] + \
                [(owner, name) for owner, name, _label in search_phases.GRID_CALLS] + \
                [(owner, name) for owner, name, _label, _pcg in search_phases.GRID_PARTS] + \
                [(owner, name) for owner, name, _label in search_phases.PHASES if hasattr(owner, name)]:
            patch.setattr(owner, name, getattr(owner, name))   # put back as it was when the context ends
        search_phases.CPU.clear()
        search_phases.SATURATIONS.clear()
        search_phases.GRIDS.clear()
        search_phases.wrap_saturations()
        if grids:
            search_phases.wrap_grids()
        for owner, name, label in search_phases.PHASES:
            if hasattr(owner, name):
                search_phases.wrap(owner, name, label)
        found = _plan_json(*args, **kwargs)
        assert search_phases.SATURATIONS and search_phases.CPU["egglog: saturate"] > 0
        if grids:
            assert any(where.startswith("independent grid") for where, _parts in search_phases.GRIDS)
            assert sum(search_phases.MET["lay out"].values()) > 0
    return found


def test_an_unstaged_search_gives_the_same_plan_plain_observed_and_again(monkeypatch):
    """mlp on 4 cpu devices (every mesh saturated, extracted and ranked, no pipeline): byte-identical plan JSON
    (timing fields aside) plain, under search_phases' wrappers, under them with `--grids`' too (each grid call and
    part timed, each part's PCG hashed to count what it met again), and plain again."""
    plain = _plan_json("mlp", "cpu", devices=4)
    assert _observed(monkeypatch, "mlp", "cpu", devices=4) == plain
    assert _observed(monkeypatch, "mlp", "cpu", devices=4, grids=True) == plain
    assert _plan_json("mlp", "cpu", devices=4) == plain


# the pipelined case of the tests below: gpt on 8 cpu devices of 3 MiB, pipeline degrees and micro-batch counts searched
PIPELINED = dict(devices=8, sizes={"blocks": 4, "batch": 16, "seq": 128, "hidden": 64, "heads": 4, "vocab": 128},
                 pipeline=True)


def _small() -> Machine:
    return replace(Machine.resolve("cpu"), memory_capacity=3 * 2 ** 20)


@pytest.mark.slow
def test_a_pipelined_search_gives_the_same_trace_and_plan_plain_observed_and_again(monkeypatch):
    """gpt on 8 cpu devices of 3 MiB, pipeline degrees and micro-batch counts searched: three pairs priced, stage
    plans over their pipeline's memory extracted again leaner (`mesh._leaner_as_run`), stage candidates ranked by
    their pipelined price (`mesh.first_ranked`), the plan pipelined. Plain, under search_phases' wrappers and plain
    again: the same plan JSON (timing fields aside), its `tried` trace entry for entry."""
    small, case = _small(), PIPELINED
    plain = _plan_json("gpt", small, **case)
    tried = json.loads(plain)["saturation"]["pipeline_search"]
    assert len({(t["pp"], t["microbatches"]) for t in tried}) >= 3 and json.loads(plain)["pipeline"] is not None
    assert _observed(monkeypatch, "gpt", small, **case) == plain
    assert _plan_json("gpt", small, **case) == plain


_IN_A_PROCESS = """
import sys
sys.path.insert(0, sys.argv[1])
import test_search_observed as t
sys.stdout.write(t._plan_json("gpt", t._small(), **t.PIPELINED))
"""


@pytest.mark.slow
def test_a_pipelined_search_gives_the_same_trace_and_plan_whatever_the_process_s_string_hashes():
    """The pipelined case in two processes hashing strings differently (PYTHONHASHSEED 0 and 1): an answer that
    followed the iteration order of a set or dict of strings (rule names, operator names, value names) would differ.
    The same plan JSON (timing fields aside), its `tried` trace entry for entry."""
    here = str(Path(__file__).resolve().parent)
    plans = [subprocess.run([sys.executable, "-c", _IN_A_PROCESS, here], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("0", "1")]
    assert json.loads(plans[0])["saturation"]["pipeline_search"] and plans[0] == plans[1]
