"""Hostile graph, plan and machine JSON: refused with parsat's own error naming the problem, or accepted.

Never another exception, never a stack trace at the CLI. Two kinds of test:

* property tests (hypothesis) start from valid graph and plan dicts and
  mutate them (delete a field, replace a value with a hostile one: null,
  negatives, zero, 2**70, NaN, strings, wrong containers, deep nesting;
  reorder, duplicate, drop nodes), then run every loader and reader
  (`Graph.from_dict`, `load_plan_dict`, the backend's `pcg_from_dict`,
  `explain`, `show`'s DOT writer). The outcome must be the object or
  GraphError / PlanError / MachineError;
* a table of named malformed files is given to the CLIs (`optimize`,
  `run`, `explain`, `show`): exit 1, a message naming the field, no trace.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from parsat.backend.executor import operator_library  # noqa: E402
from parsat.cli import main  # noqa: E402
from parsat.ir import models  # noqa: E402
from parsat.ir.costs import totals  # noqa: E402
from parsat.ir.data_parallel import data_parallel_pcg  # noqa: E402
from parsat.ir.graph import Graph, GraphError  # noqa: E402
from parsat.ir.machine import Machine, MachineError  # noqa: E402
from parsat.ir.plan import Plan, PlanError, load_plan_dict, pcg_from_dict  # noqa: E402
from parsat.report.explain import explain  # noqa: E402
from parsat.ir.validate import validate_plan_report  # noqa: E402
from parsat.search.baselines import price_pcg  # noqa: E402
from parsat.report.dot import plan_dot  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HOSTILE: list[Any] = [None, True, 0, -1, 1.5, 2 ** 70, float("nan"), float("inf"), "", "x", "matmul", [], [0],
                      [[]], {}, {"a": 1}, [1, -2], ["x"], 10 ** 400]
EXAMPLES = int(os.environ.get("PARSAT_FUZZ_EXAMPLES", "150"))


@pytest.fixture(scope="module")
def lib():
    return operator_library()


def graph_dicts(lib) -> list[dict]:
    """Valid graphs to mutate: a chain, branches joined by concat, a chain with integer and real attributes."""
    from parsat.ir.graph import GraphBuilder

    g = GraphBuilder(lib, name="attrs")
    x = g.input("x", [8, 6])
    h = g.op("linear", x, g.weight("w", [6, 4]), g.weight("b", [4]), name="lin")
    h = g.op("layernorm", h, g.weight("gamma", [4]), g.weight("beta", [4]), eps=1e-5, name="ln")
    h = g.op("softmax", g.op("scale", h, c=0.5, name="sc"), dim=1, name="sm")
    g.output(g.op("transpose", g.op("concat", h, h, dim=1, name="cat"), d0=0, d1=1, name="tr"))
    return [models.mlp(batch=8, d_in=6, d_hidden=4, d_out=2, library=lib).to_dict(),
            models.branches(batch=8, d_in=6, d_hidden=4, d_out=2, library=lib).to_dict(),
            g.build().to_dict()]


def plan_dict(lib, devices: int = 2) -> dict:
    """A complete plan (as `parsat optimize` writes it) for data parallelism of a small MLP."""
    graph = models.mlp(batch=8, d_in=6, d_hidden=4, d_out=2, library=lib)
    pcg = data_parallel_pcg(graph, lib, devices)
    machine = Machine.preset("cpu").with_devices(devices)
    costs = price_pcg(pcg, lib, machine)
    plan = Plan(graph, machine, devices, pcg, costs, totals(costs, machine), {"data_parallel": None})
    return json.loads(plan.to_json())


_CACHE: dict[str, Any] = {}


def _cached_plan(lib) -> dict:
    """plan_dict, built once per session (mutate() deep-copies before editing)."""
    if "plan" not in _CACHE:
        _CACHE["plan"] = plan_dict(lib)
    return _CACHE["plan"]


def _cached_graphs(lib) -> list[dict]:
    if "graphs" not in _CACHE:
        _CACHE["graphs"] = graph_dicts(lib)
    return _CACHE["graphs"]


# ------------------------------------------------------------------ mutations


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (sequence of keys / indices) inside a JSON value."""
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out += _paths(item, prefix + (index,))
    return out


def _parent(data: Any, path: tuple) -> Any:
    for key in path[:-1]:
        data = data[key]
    return data


def mutate(data: dict, draw) -> dict:
    """One to three hostile edits at random places of a deep copy."""
    data = copy.deepcopy(data)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(data) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = _parent(data, path)
        action = draw(st.sampled_from(["delete", "replace", "replace", "duplicate", "reverse", "deep", "swap"]))
        key = path[-1]
        if action == "delete":
            del parent[key]
        elif action == "replace":
            parent[key] = copy.deepcopy(draw(st.sampled_from(HOSTILE)))
        elif action == "duplicate" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        elif action == "reverse" and isinstance(parent[key], list):
            parent[key].reverse()
        elif action == "deep":
            nested: Any = 1
            for _ in range(draw(st.sampled_from([5, 50, 500]))):
                nested = [nested]
            parent[key] = nested
        elif action == "swap" and isinstance(parent, list) and len(parent) > 1:
            other = draw(st.integers(0, len(parent) - 1))
            parent[key], parent[other] = parent[other], parent[key]
    return data


# ----------------------------------------------------------------- properties

SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@SETTINGS
@given(st.data())
def test_mutated_graph_json_is_refused_with_a_graph_error_or_accepted(lib, data):
    base = data.draw(st.sampled_from(_cached_graphs(lib)))
    mutated = mutate(base, data.draw)
    try:
        graph = Graph.from_dict(mutated, lib)
    except GraphError as err:
        assert str(err).strip(), "an empty message"
        return
    assert graph.outputs and all(all(d >= 1 for d in s) for s in graph.shapes().values())


@SETTINGS
@given(st.data())
def test_mutated_plan_json_is_refused_with_a_plan_error_or_read_by_every_reader(lib, tmp_path_factory, data):
    mutated = mutate(_cached_plan(lib), data.draw)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(json.dumps(mutated), encoding="utf-8")
    try:
        loaded = load_plan_dict(path)
    except PlanError as err:
        assert str(path) in str(err) or "cannot read" in str(err)
        return
    # what the backend does with an accepted plan (backend/cli.load_plan), without its catch-all
    try:
        Graph.from_dict(loaded["graph"], lib)
    except GraphError:
        pass
    pcg = pcg_from_dict(loaded)
    assert len(pcg.nodes) == len(loaded["nodes"])
    try:
        validate_plan_report(loaded, PlanError, str(path))
    except PlanError:
        return
    assert explain(loaded, None)
    assert plan_dot(loaded)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(st.dictionaries(st.sampled_from(list(Machine.__dataclass_fields__) + ["schema", "extra"]),
                       st.sampled_from(HOSTILE), max_size=6))
def test_mutated_machine_json_is_refused_with_a_machine_error_or_accepted(changes):
    data = {**Machine.preset("cpu").to_dict(), **changes}
    try:
        Machine.from_dict(data)
    except MachineError as err:
        assert str(err).strip()


# --------------------------------------------------------------- named inputs


def _graph_case(lib, name: str) -> tuple[Any, str]:
    """A malformed graph (as JSON-able data, or raw text for the first few) and the words its error must hold."""
    g = graph_dicts(lib)[0]

    def edit(fn) -> dict:
        d = copy.deepcopy(g)
        fn(d)
        return d

    cases = {
        "missing nodes[0].op": (edit(lambda d: d["nodes"][0].pop("op")), r"nodes\[0\] \('mm1'\): the field 'op' is missing"),
        "missing inputs[0].shape": (edit(lambda d: d["inputs"][0].pop("shape")), r"inputs\[0\]: the field 'shape'"),
        "wrong type nodes": (edit(lambda d: d.update(nodes={"a": 1})), r"nodes: must be a JSON array, got an object"),
        "wrong type attrs": (edit(lambda d: d["nodes"][0].update(attrs=[1])), r"nodes\[0\] \('mm1'\)\.attrs: must be a JSON object"),
        "wrong type shape dim": (edit(lambda d: d["weights"][0].update(shape=["784", 4])), r"weights\[0\]\.shape\[0\]: must be an integer, got a string"),
        "cycle": (edit(lambda d: d["nodes"][0].update(inputs=["mm2", "w1"])), r"'mm2' is defined later .*cycle"),
        "dangling edge": (edit(lambda d: d["nodes"][1].update(inputs=["ghost"])), r"nodes\[1\] \('act'\)\.inputs\[0\]: 'ghost' is not an input"),
        "dangling output": (edit(lambda d: d.update(outputs=["ghost"])), r"output 'ghost' is not a node or leaf"),
        "zero size": (edit(lambda d: d["inputs"][0].update(shape=[0, 6])), r"inputs\[0\]\.shape\[0\]: must be at least 1, got 0"),
        "negative size": (edit(lambda d: d["inputs"][0].update(shape=[8, -6])), r"inputs\[0\]\.shape\[1\]: must be at least 1, got -6"),
        "overflowing size": (edit(lambda d: d["inputs"][0].update(shape=[2 ** 40, 2 ** 40])), r"inputs\[0\]\.shape: .* elements, more than parsat handles"),
        "overflowing dim": (edit(lambda d: d["inputs"][0].update(shape=[10 ** 30, 6])), r"inputs\[0\]\.shape\[0\]: must be at most"),
        "fractional size": (edit(lambda d: d["inputs"][0].update(shape=[8.5, 6])), r"must be an integer, got a number \(8.5\)"),
        "NaN attribute": (edit(lambda d: d["nodes"][0].update(attrs={"eps": float("nan")})), r"attrs\.eps: must be a finite number"),
        "10**400 attribute": (edit(lambda d: d["nodes"][0].update(attrs={"eps": 10 ** 400})), r"attrs\.eps: must be a finite number"),
        "wrong version": (edit(lambda d: d.update(version=2)), r"version 2 is not supported"),
        "version as text": (edit(lambda d: d.update(version="1")), r"version: must be the integer 1"),
        "wrong schema": (edit(lambda d: d.update(schema="onnx")), r"not a parsat graph"),
        "not an object": ([1, 2, 3], r"must be a JSON object, got an array"),
        "shape mismatch": (edit(lambda d: d["nodes"][0].update(shape=[8, 5])), r"node 'mm1': the file says shape \[8, 5\]"),
        "duplicate name": (edit(lambda d: d["nodes"][1].update(name="x")), r"the name 'x' is used twice"),
    }
    return cases[name]


GRAPH_CASES = ["missing nodes[0].op", "missing inputs[0].shape", "wrong type nodes", "wrong type attrs",
               "wrong type shape dim", "cycle", "dangling edge", "dangling output", "zero size", "negative size",
               "overflowing size", "overflowing dim", "fractional size", "NaN attribute", "10**400 attribute", "wrong version",
               "version as text", "wrong schema", "not an object", "shape mismatch", "duplicate name"]


@pytest.mark.parametrize("name", GRAPH_CASES)
def test_named_malformed_graphs_are_refused_naming_the_problem(lib, name):
    data, words = _graph_case(lib, name)
    with pytest.raises(GraphError, match=words):
        Graph.from_dict(data, lib)


RAW_FILES = {
    "not JSON": (b"this is not json", r"is not valid JSON"),
    "empty file": (b"", r"is not valid JSON"),
    "binary": (bytes(range(256)) * 4, r"is not UTF-8 text|not valid JSON"),
    "deeply nested": (b"[" * 200_000 + b"]" * 200_000, r"nested too deeply|not valid JSON"),
    "huge integer literal": (b'{"version": ' + b"9" * 5000 + b"}", r"not valid JSON|not supported|version"),
    "JSON null": (b"null", r"must be a JSON object|not a parsat"),
}


@pytest.mark.parametrize("name", list(RAW_FILES))
def test_raw_files_are_refused_by_every_loader(tmp_path, lib, name):
    content, words = RAW_FILES[name]
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(GraphError, match=words):
        Graph.load(path, lib)
    with pytest.raises(PlanError, match=words):
        load_plan_dict(path)
    with pytest.raises(MachineError, match=words):
        Machine.load(path)


def test_huge_files_are_refused_before_they_are_read(tmp_path, lib, monkeypatch):
    path = tmp_path / "huge.json"
    with open(path, "wb") as handle:  # sparse: 65 MiB on paper, nothing on disk (the cap is 32 MiB)
        handle.seek(65 * 2 ** 20)
        handle.write(b"}")
    with pytest.raises(GraphError, match=r"over the limit of 33,554,432"):
        Graph.load(path, lib)
    monkeypatch.setenv("PARSAT_MAX_INPUT_BYTES", "100")
    small = tmp_path / "g.json"
    small.write_text(json.dumps(graph_dicts(lib)[0]))
    with pytest.raises(GraphError, match=r"over the limit of 100"):
        Graph.load(small, lib)
    with pytest.raises(PlanError, match=r"over the limit of 100"):
        load_plan_dict(small)


def _plan_edit(lib, name: str) -> tuple[dict, str]:
    p = plan_dict(lib)

    def edit(fn) -> dict:
        d = copy.deepcopy(p)
        fn(d)
        return d

    last = len(p["nodes"]) - 1
    cases = {
        "devices zero": (edit(lambda d: d.update(devices=0)), r"devices: must be at least 1, got 0"),
        "devices text": (edit(lambda d: d.update(devices="2")), r"devices: must be an integer, got a string"),
        "missing graph": (edit(lambda d: d.pop("graph")), r"the field 'graph' is missing"),
        "graph zero size": (edit(lambda d: d["graph"]["inputs"][0].update(shape=[0, 6])), r"graph\.inputs\[0\]\.shape\[0\]: must be at least 1"),
        "node cycle": (edit(lambda d: d["nodes"][1].update(inputs=[last])), rf"nodes\[1\] .*inputs\[0\]: node {last} is a later node.*cycle"),
        "dangling node": (edit(lambda d: d["nodes"][1].update(inputs=[999])), r"node 999 is not a node of the plan"),
        "dangling output": (edit(lambda d: d["outputs"][0].update(node=999)), r"outputs\[0\]\.node: node 999 is not a node"),
        "duplicate id": (edit(lambda d: d["nodes"][1].update(id=0)), r"id 0 is used twice"),
        "bad kind": (edit(lambda d: d["nodes"][0].update(kind="magic")), r"kind: must be one of leaf, op, parallel"),
        "spread rank": (edit(lambda d: d["nodes"][0]["spread"].update(shard=[1])), r"spread\.shard: has 1 dims but the shape"),
        "negative degree": (edit(lambda d: d["nodes"][0]["spread"].update(copy=-2)), r"spread\.copy: must be at least 1"),
        "zero shape": (edit(lambda d: d["nodes"][2].update(shape=[0, 4])), r"nodes\[2\] .*shape\[0\]: must be at least 1"),
        "no nodes": (edit(lambda d: d.update(nodes=[])), r"the plan has no nodes"),
        "wrong version": (edit(lambda d: d.update(version=4)), r"plan version 4 is not supported"),
        "not a plan": ({"schema": "parsat.graph"}, r"is not a parsat plan"),
    }
    return cases[name]


PLAN_CASES = ["devices zero", "devices text", "missing graph", "graph zero size", "node cycle", "dangling node",
              "dangling output", "duplicate id", "bad kind", "spread rank", "negative degree", "zero shape",
              "no nodes", "wrong version", "not a plan"]


@pytest.mark.parametrize("name", PLAN_CASES)
def test_named_malformed_plans_are_refused_by_run_explain_and_show(tmp_path, lib, capsys, name):
    data, words = _plan_edit(lib, name)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    for argv in (["run", str(path), "--nproc", "2", "--backend", "gloo"], ["explain", str(path)],
                 ["show", str(path), "-o", str(tmp_path / "p.dot")]):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 1, (argv, err)
        assert re.search(words, err), (argv, err)
        assert "Traceback" not in err


def test_explain_refuses_a_plan_without_costs(tmp_path, lib, capsys):
    data = plan_dict(lib)
    del data["nodes"][3]["cost"]["collectives"]
    data["totals"]["time_s"] = "fast"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert main(["explain", str(path)]) == 1
    err = capsys.readouterr().err
    assert "totals.time_s: must be a number" in err and "Traceback" not in err
    data = plan_dict(lib)
    data["nodes"][2]["cost"]["time_s"] = 10 ** 400  # found by the 3,000-example run: OverflowError in explain
    path.write_text(json.dumps(data))
    assert main(["explain", str(path)]) == 1
    assert "nodes[2].cost.time_s: must be a finite number" in capsys.readouterr().err


def test_optimize_cli_refuses_bad_graphs_naming_the_field(tmp_path, lib, capsys):
    rules = str(REPO / "rules" / "ops.rule")
    for name in ("cycle", "zero size", "overflowing size", "wrong version", "dangling edge"):
        data, words = _graph_case(lib, name)
        path = tmp_path / "g.json"
        path.write_text(json.dumps(data))
        code = main(["optimize", str(path), "--rules", rules, "-q", "--no-baselines", "--allow-unverified"])
        err = capsys.readouterr().err
        assert code == 1 and re.search(words, err) and "Traceback" not in err, (name, err)
    path = tmp_path / "g.json"
    path.write_text("[" * 100_000)
    assert main(["optimize", str(path), "--rules", rules, "-q", "--allow-unverified"]) == 1
    assert "nested too deeply" in capsys.readouterr().err


def test_optimize_cli_refuses_a_bad_machine_file_and_device_count(tmp_path, lib, capsys):
    rules = str(REPO / "rules" / "ops.rule")
    machine = tmp_path / "m.json"
    machine.write_text(json.dumps({**Machine.preset("cpu").to_dict(), "devices_per_node": "four"}))
    code = main(["optimize", "mlp", "--rules", rules, "-q", "--allow-unverified", "--machine", str(machine)])
    assert code == 1 and "devices_per_node: must be an integer" in capsys.readouterr().err
    code = main(["optimize", "mlp", "--rules", rules, "-q", "--allow-unverified", "--devices", "0"])
    assert code == 1 and "at least 1" in capsys.readouterr().err


def test_the_real_command_line_exits_1_without_a_trace(tmp_path):
    """The installed entry point, in a fresh process: exit status and stderr as a user sees them."""
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "parsat.plan", "version": 3, "devices": 0}')
    for args in (["run", str(bad), "--nproc", "2"],):
        done = subprocess.run([sys.executable, "-m", "parsat", *args], capture_output=True, text=True, timeout=120,
                              cwd=REPO)
        assert done.returncode == 1, done.stderr
        assert "devices: must be at least 1, got 0" in done.stderr and "Traceback" not in done.stderr


# A spawned rank unpickles the job its launcher handed it in memory, after the parent-death guard (as
# multiprocessing's spawn itself would): bytes from the parent process, never a file.
IN_MEMORY = {("parsat/backend/rank_guard.py", r"pickle\.loads?\(")}


def test_no_file_is_ever_unpickled():
    """Scan parsat's sources: no pickle/marshal/shelve loads, torch.load only with weights_only=True."""
    offenders = []
    for folder in ("parsat",):   # every package of parsat lives under parsat/
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            for pattern in (r"pickle\.loads?\(", r"marshal\.loads?\(", r"shelve\.open\(", r"yaml\.load\(",
                            r"allow_pickle\s*=\s*True", r"dill\.", r"joblib\.load"):
                if re.search(pattern, text) and (path.relative_to(REPO).as_posix(), pattern) not in IN_MEMORY:
                    offenders.append(f"{path.relative_to(REPO)}: {pattern}")
            for match in re.finditer(r"torch\.load\(([^)]*)\)", text):
                if "weights_only=True" not in match.group(1):
                    offenders.append(f"{path.relative_to(REPO)}: torch.load without weights_only=True")
    assert not offenders, offenders


def test_hostile_values_are_really_hostile():
    """Guard for the mutation table itself: the non-finite values survive a JSON round trip as parsat reads it."""
    assert math.isnan(json.loads(json.dumps(float("nan"))))
    assert json.loads(json.dumps(10 ** 400)) == 10 ** 400


def test_a_baseline_pcg_is_validated_like_the_plan_s_own(tmp_path, lib):
    """Plan v2 carries each baseline's PCG (`parsat run --plan-of NAME` runs it): same checks, under its path."""
    data = plan_dict(lib)
    pcg = {"mesh": copy.deepcopy(data["mesh"]), "nodes": copy.deepcopy(data["nodes"]),
           "outputs": copy.deepcopy(data["outputs"])}
    data["baselines"]["data_parallel"] = {**data["totals"], "pcg": pcg}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert load_plan_dict(path)["baselines"]["data_parallel"]["pcg"]["nodes"]
    pcg["nodes"][1]["inputs"] = [999]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"baselines\.data_parallel\.pcg\.nodes\[1\] .*node 999 is not a node"):
        load_plan_dict(path)
