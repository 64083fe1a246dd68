"""Graphs in: builder, shape inference, JSON, examples; machines; the cost model's derivations."""

from __future__ import annotations

import json

import pytest

from parsat.dsl.library import load_library
from parsat.dsl.work import work
from parsat.ir.graph import Graph, GraphBuilder, GraphError, instance_for
from parsat.ir.machine import Machine, MachineError
from parsat.ir.models import EXAMPLES, build_example


@pytest.fixture(scope="module")
def lib():
    return load_library()[0]


def test_builder_infers_shapes(lib):
    g = GraphBuilder(lib)
    x = g.input("x", [128, 784])
    w = g.weight("w1", [784, 512])
    h = g.op("relu", g.op("matmul", x, w))
    g.output(h)
    graph = g.build()
    assert graph.shape(h.name) == (128, 512)
    assert [l.role for l in graph.leaves] == ["input", "weight"]


def test_unknown_operator_is_named(lib):
    g = GraphBuilder(lib)
    x = g.input("x", [4, 4])
    with pytest.raises(GraphError, match=r"node 'bad': unknown operator 'matmull'; did you mean 'matmul'"):
        g.op("matmull", x, x, name="bad")


def test_shape_mismatch_is_named(lib):
    g = GraphBuilder(lib)
    x = g.input("x", [3, 4])
    w = g.weight("w", [5, 6])
    with pytest.raises(GraphError, match=r"node 'mm' \(matmul of x\[3, 4\], w\[5, 6\]\).*dim 0 is 5, expected 4"):
        g.op("matmul", x, w, name="mm")


def test_json_round_trip_and_errors(lib, tmp_path):
    graph = build_example("mlp", library=lib)
    path = tmp_path / "g.json"
    graph.save(path)
    assert Graph.load(path, lib) == graph
    data = json.loads(path.read_text())
    data["nodes"][0]["op"] = "conv9d"
    with pytest.raises(GraphError, match="unknown operator 'conv9d'"):
        Graph.from_dict(data, lib)
    data = json.loads(path.read_text())
    data["weights"][1]["shape"] = [256, 10]
    with pytest.raises(GraphError, match="node 'mm2'.*expected 512"):
        Graph.from_dict(data, lib)
    data = json.loads(path.read_text())
    data["version"] = 99
    with pytest.raises(GraphError, match="version 99"):
        Graph.from_dict(data, lib)


def test_examples_build(lib):
    for name in EXAMPLES:
        sizes = {"blocks": 2} if name == "stack" else {}
        graph = build_example(name, sizes, lib)
        assert graph.nodes and graph.outputs
    assert build_example("mlp", {"batch": 64}, lib).shape("x") == (64, 784)
    with pytest.raises(GraphError, match="no size depth"):
        build_example("mlp", {"depth": 3}, lib)
    with pytest.raises(GraphError, match="unknown example"):
        build_example("resnet", None, lib)


def test_flops_from_index_semantics(lib):
    mm = instance_for(lib.ops["matmul"], [(8, 16), (16, 4)], {})
    assert work(mm) == (2 * 8 * 16 * 4, 8 * 16 + 16 * 4 + 8 * 4)
    # layernorm: the row mean and variance are loop-invariant in j, counted once per row, not per element
    ln = instance_for(lib.ops["layernorm"], [(4, 1024), (1024,), (1024,)], {"eps": 1e-5})
    flops, _ = work(ln)
    assert 4 * 1024 * 5 < flops < 4 * 1024 * 20


def test_machine_presets_and_files(tmp_path):
    h100 = Machine.preset("h100x8")
    assert h100.devices == 8
    assert h100.with_devices(64).nodes == 8
    assert h100.link(8) == (h100.intra_bandwidth, h100.intra_latency)
    assert h100.link(16) == (h100.inter_bandwidth, h100.inter_latency)
    path = tmp_path / "m.json"
    h100.save(path)
    assert Machine.load(path) == h100
    with pytest.raises(MachineError, match="unknown machine preset"):
        Machine.preset("tpu")
    with pytest.raises(MachineError, match="do not fill whole nodes"):
        h100.with_devices(12)
