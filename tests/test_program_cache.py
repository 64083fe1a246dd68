"""Compiled mesh programs kept on disk by their content (`egraph.program_cache`).

A program read back equals the one compiled; any change to what it is a function of (a rule, the mesh, the
graph's ranks, the chunk size, the code) misses; a corrupt, edited or planted entry is a miss that is compiled
and written again, never a crash; a program cut by a deadline is not kept; a folder that cannot be written
only costs the compile.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from parsat.dsl.checker import load_checked
from parsat.egraph import program as compiler
from parsat.egraph import program_cache
from parsat.egraph.instances import graph_signatures
from parsat.egraph.program import MeshCaches, compile_mesh_rules
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example


@pytest.fixture(scope="module")
def shipped():
    return load_checked(None)


@pytest.fixture
def compiles(monkeypatch):
    """How many programs were compiled (not read back)."""
    count = []

    def counted(*args, **kwargs):
        count.append(1)
        return compile_mesh_rules(*args, **kwargs)

    monkeypatch.setattr(program_cache, "compile_mesh_rules", counted)
    return count


def compiled(library, folder, mesh=Mesh.of((2,), 4), rules=None, graph="mlp", deadline=None):
    graph = build_example(graph, None, library)
    return program_cache.cached_mesh_rules(library, library.rules if rules is None else rules, graph.ranks(), mesh,
                                           {n.op for n in graph.nodes}, graph_signatures(graph, library.ops, None),
                                           deadline, MeshCaches(folder))


def entries(folder):
    return sorted((folder / "programs").glob("*.json"))


def test_a_program_read_back_is_the_one_compiled(shipped, tmp_path, compiles):
    first = compiled(shipped, tmp_path)
    second = compiled(shipped, tmp_path)
    assert len(compiles) == 1 and len(entries(tmp_path)) == 1
    assert second == first and second.rules and second.declarations == first.declarations
    assert second.text() == first.text()


def test_what_a_program_depends_on_misses(shipped, tmp_path, compiles, monkeypatch):
    compiled(shipped, tmp_path)
    rules = list(shipped.rules)
    index = next(i for i, r in enumerate(rules) if r.name == "matmul_column_parallel")
    rules[index] = replace(rules[index], name="matmul_column_parallel_renamed")
    assert compiled(shipped, tmp_path, rules=rules).rules != ()      # one rule changed
    compiled(shipped, tmp_path, mesh=Mesh.of((4,), 4))                 # another mesh
    compiled(shipped, tmp_path, mesh=Mesh.of((2,), 4, names=("x",)))  # the same shape, another axis name
    compiled(shipped, tmp_path, graph="transformer")                   # another graph
    monkeypatch.setattr(compiler, "CHUNK_RULES", 1)
    compiled(shipped, tmp_path)                                        # another chunk size
    monkeypatch.setattr(compiler, "CHUNK_RULES", 256)
    monkeypatch.setattr(program_cache, "code_hash", lambda: "other code")
    compiled(shipped, tmp_path)                                        # other code
    assert len(compiles) == 7 and len(entries(tmp_path)) == 7


@pytest.mark.parametrize("spoil", [
    lambda text: text[: len(text) // 2],                                             # truncated
    lambda text: "\x00\xff not json",                                                # garbage
    lambda text: text.replace('"format": 1', '"format": 99'),                         # another format
    lambda text: json.dumps({**json.loads(text), "key": "0" * 64}),                  # another key inside
    lambda text: json.dumps({**json.loads(text), "program": {"declarations": 1}}),   # wrong types
    lambda text: json.dumps({**json.loads(text), "program": {
        **json.loads(text)["program"], "rules": [["x"] * 9]}}),                      # a rule that is not one
    lambda text: json.dumps({**json.loads(text), "program": {
        **json.loads(text)["program"], "unfinished": 3}}),                           # a cut program
    lambda text: json.dumps({"__class__": "os.system", "args": ["touch /tmp/x"]}),   # planted
])
def test_a_spoiled_entry_is_compiled_and_written_again(shipped, tmp_path, compiles, spoil):
    fresh = compiled(shipped, tmp_path)
    [entry] = entries(tmp_path)
    entry.write_text(spoil(entry.read_text()), encoding="utf-8", errors="surrogateescape")
    assert compiled(shipped, tmp_path) == fresh and len(compiles) == 2
    assert compiled(shipped, tmp_path) == fresh and len(compiles) == 2   # the entry was written again


def test_an_entry_that_is_not_a_file_is_a_miss(shipped, tmp_path, compiles):
    fresh = compiled(shipped, tmp_path)
    [entry] = entries(tmp_path)
    entry.unlink()
    entry.mkdir()
    assert compiled(shipped, tmp_path) == fresh and len(compiles) == 2


def test_a_program_cut_by_its_deadline_is_not_kept(shipped, tmp_path, compiles):
    cut = compiled(shipped, tmp_path, deadline=0.0)   # long past: nothing is typed
    assert cut.unfinished and not entries(tmp_path)
    whole = compiled(shipped, tmp_path)
    assert not whole.unfinished and len(entries(tmp_path)) == 1 and len(compiles) == 2


def test_a_folder_that_cannot_be_written_only_costs_the_compile(shipped, tmp_path, compiles):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    first = compiled(shipped, blocked)
    assert compiled(shipped, blocked) == first and len(compiles) == 2


def test_without_a_folder_nothing_is_written(shipped, tmp_path, compiles, monkeypatch):
    monkeypatch.setenv("PARSAT_CACHE_DIR", str(tmp_path))
    graph = build_example("mlp", None, shipped)
    program_cache.cached_mesh_rules(shipped, shipped.rules, graph.ranks(), Mesh.of((2,), 4), caches=MeshCaches())
    assert len(compiles) == 1 and not (tmp_path / "programs").exists()
