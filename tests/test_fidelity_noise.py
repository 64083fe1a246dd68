"""benchmarks/costmodel_fidelity.py reports the box's noise beside its figure (issue 31): what the rounds alone
spread, the rank order they leave, how far the calibrations around a round disagree, measured over predicted and
the load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from costmodel_fidelity import noise  # noqa: E402


def row(r: int, plan: str, measured: float, predicted: float, before: float, after: float) -> dict:
    return {"round": r, "nproc": 2, "plan": plan, "measured_s": measured, "predicted_s": predicted,
            "predicted_before_s": before, "predicted_after_s": after, "load_1min": [1.0 + r, 2.0 + r]}


def test_noise_gives_the_rounds_spread_rank_order_calibrations_ratio_and_load():
    rows = [row(0, "a", 1.0, 1.0, 1.0, 1.0), row(1, "a", 1.2, 1.0, 1.0, 1.5), row(2, "a", 0.9, 1.0, 1.0, 1.0),
            row(0, "b", 2.0, 1.0, 1.0, 1.0), row(1, "b", 2.0, 1.0, 1.0, 1.0), row(2, "b", 2.0, 1.0, 0.5, 1.0),
            row(0, "c", 3.0, 2.0, 2.0, 2.0), row(1, "c", 1.5, 2.0, 2.0, 2.0), row(2, "c", 3.0, 2.0, 2.0, 2.0)]
    text = noise(rows, [(2, "a"), (2, "b"), (2, "c")])
    assert "median over plans 1.33, worst 2.00" in text            # max / min: a 1.33, b 1.00, c 2.00
    assert "median over plans 20.0%, largest 50.0%" in text        # farthest from the median: a 0.2, b 0, c 0.5
    assert "Spearman 0.500-1.000" in text                          # round 1 swaps b and c against rounds 0 and 2
    assert "round 1: median relative error 33.3%" in text             # a 16.7%, b 50%, c 33.3%
    assert "median 1.00, range 1.00-2.00" in text                  # after / before: 1.5 (a, round 1), 2.0 (b, round 2)
    assert "median 1.50 (2 ranks 1.50), range 0.75-2.00" in text
    assert "1-minute load while the plans ran: 1.0-4.0" in text
