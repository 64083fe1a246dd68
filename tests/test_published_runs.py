"""benchmarks/published_runs.py prices each published row on the runtime that ran it: SC'21's Megatron-LM reduced
the gradients after backward (`CommProfile.overlap_grad_reduce` off), Megatron-Core overlapped them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from published_runs import ROWS  # noqa: E402

from parsat.cost.pcg_tasks import DDP, profile_for  # noqa: E402
from parsat.ir.machine import PRESETS  # noqa: E402


def test_the_sc21_rows_reduce_gradients_after_backward_and_the_megatron_core_rows_overlap_them():
    sc21 = [r for r in ROWS if r.machine == "a100x8"]
    mcore = [r for r in ROWS if r.machine == "h100x8"]
    assert len(sc21) == 13 and len(mcore) == 9
    for row in sc21:
        machine = row.machine_of()
        assert not machine.comm.overlap_grad_reduce and not profile_for(machine).overlap_grad_reduce
        assert machine == PRESETS["a100x8"].__class__(**{**PRESETS["a100x8"].__dict__, "comm": machine.comm})
    for row in mcore:
        assert row.machine_of() is PRESETS["h100x8"] and profile_for(row.machine_of()) is DDP
    assert PRESETS["a100x8"].comm.overlap_grad_reduce   # the preset itself keeps the default
