"""The verifier under stress: timeouts never become PROVED, one rule's crash spares the others, --jobs = serial.

tests/test_verifier_prove.py already covers one rule's timeout and one
rule's crash in isolation and --jobs on true rules; here the same
properties are checked across a mixed library (true and wrong rules), at
the CLI with a tiny --timeout, through the verdict cache, and with a
crash (exception, or a worker process dying) in one rule among many.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from parsat.cli import main
from parsat.dsl.library import load_library
from parsat.verifier import prove
from parsat.verifier.api import verify_library
from parsat.verifier.cache import VerdictCache

WRONG = Path(__file__).parent / "wrong_rules"
MIXED = """\
import "ops.rule"

rule t_row_parallel:
  forall x: [m, k], w: [k, n], p: degree
  where m % p == 0
  matmul(partition(x, 0, p), replicate(w, p)) => partition(matmul(x, w), 0, p)

rule t_contraction_parallel:
  forall x: [m, k], w: [k, n], p: degree
  where k % p == 0
  matmul(x, w) => reduce(matmul(partition(x, 1, p), partition(w, 0, p)), p)

rule t_split_contraction:
  forall x1: [m, k1], x2: [m, k2], w1: [k1, n], w2: [k2, n]
  matmul(concat(x1, x2, 1), concat(w1, w2, 0)) => add(matmul(x1, w1), matmul(x2, w2))

rule t_transpose_matmul:
  forall x: [m, k], w: [k, n]
  transpose(matmul(x, w), 0, 1) => matmul(transpose(w, 0, 1), transpose(x, 0, 1))

rule w_relu_through_reduce:
  forall x: [m, k], w: [k, n], p: degree
  where k % p == 0
  relu(reduce(matmul(partition(x, 1, p), partition(w, 0, p)), p)) => reduce(relu(matmul(partition(x, 1, p), partition(w, 0, p))), p)

rule w_matmul_commutes:
  forall x: [n, n], w: [n, n]
  matmul(x, w) => matmul(w, x)

rule w_softmax_split_wrong_dim:
  forall x: [m, n], p: degree
  where n % p == 0
  softmax(x, 1) => combine(softmax(partition(x, 1, p), 1), 1, p)
"""
TRUE = {"t_row_parallel", "t_contraction_parallel", "t_split_contraction", "t_transpose_matmul"}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    path = tmp_path_factory.mktemp("rules") / "mixed.rule"
    path.write_text(MIXED, encoding="utf-8")
    return path, load_library([path])[0]


@pytest.fixture(scope="module")
def reference(mixed):
    """Verdicts with a safety-valve timeout, serial, no cache: what every other run is compared with."""
    _, library = mixed
    report = verify_library(library, timeout=600)
    assert not report.errors
    verdicts = {v.name: v.verdict for v in report.verdicts}
    assert {n for n, v in verdicts.items() if v == "PROVED"} == TRUE
    # relu of a partial sum, softmax split along its own dim: refused by the spread analysis, never run as plans
    assert verdicts["w_relu_through_reduce"] == verdicts["w_softmax_split_wrong_dim"] == "ILLEGAL"
    assert verdicts["w_matmul_commutes"] == "REFUTED"
    return report


def _cli(args, capsys) -> tuple[int, list[dict]]:
    code = main(["verify", *args, "--json"])
    return code, [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("timeout", ["0.001", "0.05"])
def test_a_tiny_timeout_never_proves_what_it_could_not_finish(mixed, reference, capsys, tmp_path, monkeypatch,
                                                              timeout):
    monkeypatch.setenv("PARSAT_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = mixed
    code, records = _cli([str(path), "--timeout", timeout, "--no-cache"], capsys)
    assert len(records) == len(reference.verdicts)
    truth = {v.name: v.verdict for v in reference.verdicts}
    for record in records:
        if "timeout" in record["reason"]:
            assert record["verdict"] == "UNKNOWN", record
        # a verdict under a tiny budget is UNKNOWN or the same verdict as with time to spare: never a flip
        assert record["verdict"] in ("UNKNOWN", truth[record["name"]]), record
        assert record["verdict"] != "PROVED" or record["seconds"] <= float(timeout) + 0.5, record
    if float(timeout) <= 0.001:  # at 0.05 s a fast machine may finish every rule: only the tiniest must run out
        assert any(r["verdict"] == "UNKNOWN" for r in records), "nothing ran out of time: the test tested nothing"
    assert code == 1  # UNKNOWN is not success


def test_a_cached_timeout_is_not_served_to_a_longer_run(mixed, reference, tmp_path):
    _, library = mixed
    cache = VerdictCache(tmp_path)
    short = verify_library(library, timeout=0.001, cache=cache)
    assert any(v.verdict == "UNKNOWN" for v in short.verdicts)
    again = verify_library(library, timeout=600, cache=cache)
    assert [(v.name, v.verdict) for v in again.verdicts] == [(v.name, v.verdict) for v in reference.verdicts]


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_crash_in_one_rule_does_not_stop_the_others(mixed, reference, monkeypatch, jobs):
    _, library = mixed
    real = prove.prove_instance

    def crash_one(instance, timeout, *solving):
        if instance.rule.name == "t_split_contraction":
            raise MemoryError("z3 ran out of memory")
        return real(instance, timeout, *solving)

    monkeypatch.setattr(prove, "prove_instance", crash_one)  # workers are forked: they see it too
    report = verify_library(library, timeout=600, jobs=jobs)
    verdicts = {v.name: v for v in report.verdicts}
    assert verdicts["t_split_contraction"].verdict == "UNKNOWN"
    assert "internal error: MemoryError" in verdicts["t_split_contraction"].reason
    for v in reference.verdicts:
        if v.name != "t_split_contraction":
            assert verdicts[v.name].verdict == v.verdict, v.name


def test_a_worker_that_dies_does_not_stop_the_others(mixed, reference, monkeypatch):
    _, library = mixed
    real = prove.prove_instance

    def die_on_one(instance, timeout, *solving):
        if instance.rule.name == "t_split_contraction":
            os._exit(139)  # what a segfault in z3 looks like from the parent
        return real(instance, timeout, *solving)

    monkeypatch.setattr(prove, "prove_instance", die_on_one)
    report = verify_library(library, timeout=600, jobs=2)
    verdicts = {v.name: v for v in report.verdicts}
    assert all(verdicts[v.name].verdict == v.verdict for v in reference.verdicts if v.name != "t_split_contraction")
    died = verdicts["t_split_contraction"]
    assert died.verdict == "UNKNOWN" and "worker process died" in died.reason


def test_jobs_equal_serial_on_true_and_wrong_rules(mixed, reference, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PARSAT_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = mixed
    paths = [str(path), str(WRONG / "parallel_wrong.rule")]
    _, serial = _cli([*paths, "--no-cache", "--timeout", "600"], capsys)
    _, parallel = _cli([*paths, "--no-cache", "--timeout", "600", "--jobs", "2"], capsys)

    def strip(records):  # records stream as rules are decided: compare them in one order
        return sorted((r["file"], r["name"], r["line"], r["verdict"], r["reason"],
                       json.dumps(r["counterexample"], sort_keys=True)) for r in records)

    assert len(serial) == len(reference.verdicts) + 15
    assert strip(serial) == strip(parallel)
