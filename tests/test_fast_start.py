"""Fast starts (issue 28, item 5): bad input is refused before the rules load, and egglog's bindings load
without the egglog package's Python layer (which imports `black`).

The refusals are checked with the rules' loader replaced by one that fails the test: each refusal must come
from the input alone. The CLI's are checked through `parsat.cli.main`, as a user meets them: exit status 1,
one `parsat: error:` line, never a stack trace.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from parsat import cli
from parsat.ir.errors import GraphError, OptimizeError
from parsat.search import request
from parsat.search.optimize import optimize


@pytest.fixture
def no_rules(monkeypatch):
    """Loading the rules fails the test: what is refused must be refused before."""
    def loaded(rules):
        raise AssertionError("the rules were loaded before the input was refused")

    monkeypatch.setattr(request, "resolve_library", loaded)


@pytest.mark.parametrize("graph,options,error,words", [
    ("nosuchmodel", {}, GraphError, "neither a graph JSON file nor a built-in example"),
    ("mlp", {"sizes": {"nosuch": 3}}, GraphError, "has no size nosuch"),
    ("mlp", {"sizes": {"batch": 0}}, GraphError, "size batch must be a whole number"),
    ("/no/such/graph.json", {"sizes": {"batch": 2}}, GraphError, "only apply to built-in examples"),
    ("mlp", {"degrees": {"tp": 3}}, OptimizeError, "tp=3 does not divide the 2 devices"),
    ("mlp", {"degrees": {"xx": 2}}, OptimizeError, "unknown parallelism xx"),
    ("mlp", {"degrees": {"dp": 2, "tp": 2}}, OptimizeError, "dp 2 x tp 2 = 4 devices"),
    ("mlp", {"degrees": {"tp": 0}}, OptimizeError, "positive integer"),
])
def test_bad_input_is_refused_before_the_rules_load(no_rules, graph, options, error, words):
    with pytest.raises(error, match=words):
        optimize(graph, "cpu", devices=2, **options)


def test_a_pin_is_checked_against_one_pipeline_stage_s_devices(no_rules):
    """With pp pinned, dp x tp are one stage's devices: 8 devices, pp=2, tp=8 cannot hold."""
    with pytest.raises(OptimizeError, match="tp=8 does not divide the 4 devices"):
        optimize("gpt", "cpu", devices=8, degrees={"pp": 2, "tp": 8}, microbatches=2)


@pytest.mark.parametrize("argv,words", [
    (["optimize", "nosuchmodel"], "neither a graph JSON file nor a built-in example"),
    (["optimize", "mlp", "--devices", "0"], "the device count must be a whole number"),
    (["optimize", "mlp", "--machine", "nosuch"], "unknown machine 'nosuch'"),
    (["optimize", "mlp", "-n", "2", "--degrees", "tp=3"], "--degrees: tp=3 does not divide the 2 devices"),
    (["optimize", "mlp", "-n", "2", "--degrees", "tp=2,tp=2"], "--degrees tp is given twice"),
    (["optimize", "mlp", "-n", "2", "--set", "batch"], "--set must look like KEY=VALUE"),
    (["optimize", "mlp", "-n", "2", "--set", "=4"], "--set must look like KEY=VALUE"),
    (["optimize", "mlp", "-n", "2", "--set", "batch=x"], "--set batch: 'x' is not a whole number"),
    (["optimize", "mlp", "-n", "2", "--set", "batch=4", "--set", "batch=8"], "--set batch is given twice"),
    (["optimize", "mlp", "-n", "2", "--limit", "foo=1"], "unknown limit(s) foo"),
])
def test_the_cli_refuses_bad_input_in_one_line_before_the_rules_load(no_rules, capsys, argv, words):
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("parsat: error: ") and words in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_bindings_load_without_the_egglog_package_and_a_later_import_shares_them():
    """`egraph.session` loads egglog's Rust extension alone: neither the egglog package nor `black` (its
    pretty-printer, imported by the package) is imported, an e-graph runs, and a user's later `import egglog`
    in the same process reuses the same extension module rather than initialising it twice."""
    code = ("import sys\n"
            "from parsat.egraph import session\n"
            "print(sorted(m for m in ('egglog', 'black') if m in sys.modules))\n"
            "eg = session.bindings.EGraph()\n"
            "eg.run_program(*eg.parse_program('(datatype N (Z) (S N)) (let two (S (S (Z))))'))\n"
            "from egglog import bindings\n"
            "import egglog\n"
            "print(bindings is session.bindings, egglog.EGraph is not None)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "True True"], result.stdout


def _cli_in_a_fresh_process(argv: list[str]) -> subprocess.CompletedProcess:
    """`parsat.cli.main(argv)` in a new interpreter, which prints its exit status and whether torch was
    imported."""
    code = ("import sys\n"
            "from parsat import cli\n"
            f"status = cli.main({argv!r})\n"
            "print(status, 'torch' in sys.modules)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_a_model_file_that_is_not_there_is_refused_before_torch_loads(tmp_path):
    """`optimize missing.py:make` names the missing file without importing torch (3 CPU s) first."""
    result = _cli_in_a_fresh_process(["optimize", str(tmp_path / "missing.py") + ":make", "-n", "2"])
    assert result.stdout.split() == ["1", "False"], result.stdout + result.stderr
    assert "missing.py' is not a file" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("options,words", [
    (["--degrees", "tp=3"], "--degrees: tp=3 does not divide the 2 devices"),
    (["--degrees", "sp=2"], "needs tp pinned to the same degree"),
    (["--degrees", "zero=7"], "--degrees zero must be a ZeRO stage"),
    (["--set", "hidden=4"], "--set sizes only apply to built-in examples"),
])
def test_a_model_file_s_bad_pins_and_sizes_are_refused_before_torch_loads(tmp_path, options, words):
    """A model file that exists is imported by torch.export (seconds); a pin or size that cannot hold is said
    first, in one line, without importing torch."""
    model = tmp_path / "model.py"
    model.write_text("raise SystemExit('the model file was run')\n")
    result = _cli_in_a_fresh_process(["optimize", str(model) + ":make", "-n", "2", *options])
    assert result.stdout.split() == ["1", "False"], result.stdout + result.stderr
    assert result.stderr.startswith("parsat: error: ") and words in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
