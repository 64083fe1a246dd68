"""`run --check` fails on anything non-finite and compares by relative tolerance; `run` refuses a plan
that does not compute what its own graph computes, before any rank starts (issue 19)."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")

from parsat.backend.executor import TrainConfig, check_verdict, compare_values  # noqa: E402
from parsat.cli import main  # noqa: E402
from test_backend_cli import plan_file  # noqa: E402 (a sibling test module: pytest puts tests/ on the path)


def test_compare_values_counts_nan_anywhere_not_only_first():
    a = torch.tensor([1.0, 2.0, float("nan")], dtype=torch.float64)
    b = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    found = compare_values([("weight w", a, b)])
    assert found.nonfinite == ("weight w",)
    assert max([0.0, float("nan")]) == 0.0  # what the old check did: Python's max drops a NaN that is not first
    found = compare_values([("weight w", b, torch.tensor([1.0, 2.0, float("inf")], dtype=torch.float64))])
    assert found.nonfinite == ("weight w",)
    found = compare_values([("weight w", b * (1 + 1e-12), b)])
    assert not found.nonfinite and found.max_rel < 1e-11 and found.max_abs > 0


def test_check_verdict_fails_on_non_finite_and_on_relative_excess():
    config = TrainConfig(check=True, tolerance=1e-9)
    assert check_verdict({"max_rel_diff": 1e-12, "nonfinite": []}, config) == "passed"
    assert check_verdict({"max_rel_diff": 1e-12, "nonfinite": 3}, config) == "failed"
    assert check_verdict({"max_rel_diff": float("nan"), "nonfinite": 0}, config) == "failed"
    assert check_verdict({"max_rel_diff": 1e-6, "nonfinite": 0}, config) == "failed"
    assert check_verdict({"max_rel_diff": None, "nonfinite": 0}, config) == "failed"


def _edited(tmp_path, edit):
    path = plan_file(tmp_path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def _relu_to_gelu(data):
    node = next(n for n in data["nodes"] if n["op"] == "relu")
    node["op"] = "gelu"


def _weight_to_input(data):
    node = next(n for n in data["nodes"] if n["kind"] == "leaf" and n["role"] == "weight")
    node["role"] = "input"


def _rename_output(data):
    data["outputs"][0]["name"] = "renamed"


@pytest.mark.parametrize("edit,message", [
    (_relu_to_gelu, "output 'mm2' differs from the graph's"),
    (_weight_to_input, "is a weight of shape"),
    (_rename_output, "the plan's outputs ['renamed'] are not the graph's ['mm2']"),
])
def test_run_refuses_a_plan_that_departs_from_its_graph(tmp_path, capsys, edit, message):
    path = _edited(tmp_path, edit)
    code = main(["run", str(path), "--nproc", "2", "--backend", "gloo", "--steps", "1"])
    err = capsys.readouterr().err
    assert code != 0 and "does not compute what its graph computes" in err and message in err, err
    assert "Traceback" not in err


def test_lr_nan_is_refused(tmp_path, capsys):
    code = main(["run", str(plan_file(tmp_path)), "--nproc", "2", "--backend", "gloo", "--lr", "nan", "--check"])
    assert code != 0 and "--lr must be a finite number" in capsys.readouterr().err


def test_huge_lr_fails_the_check_with_non_finite_values(tmp_path, capsys):
    code = main(["run", str(plan_file(tmp_path)), "--nproc", "2", "--backend", "gloo", "--steps", "3",
                 "--lr", "1e300", "--check", "--json"])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 1 and result["check"] == "failed" and result["nonfinite_values"] > 0
    assert "non-finite value(s)" in out and "relative tolerance 1e-09" in out
