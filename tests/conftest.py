"""Shared fixtures: helpers to write .rule files and check them."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from parsat.dsl.checker import check_paths
from parsat.ir.pcg import PCG, Degrees, PNode

# An exception no command catches is one line for a user (`parsat.cli.unexpected`); under test it is raised, in
# this process and in every `parsat` the tests start, so a bug is never mistaken for a refusal (exit 1).
os.environ.setdefault("PARSAT_TRACEBACK", "1")


def pytest_configure(config: pytest.Config) -> None:
    """Prove the shipped library into the verdict cache once, before the workers start.

    Every test that optimizes asks the verifier for the shipped library's verdicts (`api.proved_rules`). On a
    machine with no cache (CI) each pytest-xdist worker would prove all of it at once, the same rules in the same
    order, neither seeing the other's verdicts until written: ~116 CPU s of z3 done twice on 2 cores. Here the
    process that starts the workers proves it once (a cached library is only looked up: ~1 s); the workers then
    read the verdicts. Nothing is skipped: the same verifier, the same cache, the same promise. Only under xdist
    (`-n`): a single test file run by hand does not pay for a library it may never load.
    """
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    if config.getoption("collectonly", False):
        return
    from parsat.api import proved_rules
    from parsat.dsl.checker import resolve_library

    proved_rules(resolve_library(None), allow_unverified=False)


@pytest.fixture(autouse=True, scope="session")
def _searches_keep_their_programs():
    """A search called as `parsat.search.optimize.optimize` keeps its compiled mesh programs in the cache folder,
    as `parsat.optimize` does (`egraph.program_cache`), so a program compiled for one test is read back by the
    next with the same inputs.

    Called without `caches`, the search compiled every mesh's rules afresh: most of a small search's CPU (26 of
    47 s of test_pipeline_floor's first test, whose two searches compile the same 4 programs), over and over
    across the suite (benchmarks/suite_time.md, session 68). A program is stored under a key made of everything
    it is compiled from (the rules, the graph's ranks and operators, the mesh, the chunk size, the code of
    egraph/, dsl/ and ir/), and the program cache's own tests (test_program_cache.py) check that what is read
    back is what compiling gives; the compiler itself is still run by every first use of a program, and
    directly by the tests of `compile_mesh_rules`. A test that passes its own `caches` keeps them."""
    import parsat.search.request as request

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(request, "MeshCaches", _programs_kept)
        yield


def _programs_kept():
    """Mesh caches that keep compiled programs in the cache folder (`egraph.program_cache`), as `parsat.optimize`
    makes them: what the searches' fixture above and `kept_programs` below both hand out."""
    from parsat.dsl.files import cache_dir
    from parsat.egraph.program import MeshCaches

    return MeshCaches(cache_dir())


@pytest.fixture(scope="module")
def kept_programs():
    """Caches for a test's own `saturate` calls that keep the mesh programs in the cache folder, as a search keeps
    them (`_searches_keep_their_programs`): a program is compiled once for its inputs, then read back, under the
    same key as the searches' (so one compiled by a search is read by a test, and the other way round).

    A test that saturates to check what the e-graph (or the program's rule list) is, not how a program is made,
    compiled its programs afresh every time: most of the CPU of test_saturate_sums and test_saturate_resize
    (benchmarks/suite_time.md, session 70). The program cache's own tests check that what is read back is what
    compiling gives. One per module: a module's tests share the shipped library's rule objects."""
    return _programs_kept()


@pytest.fixture
def write_rules(tmp_path: Path):
    """Write a .rule file (dedented) and return its path."""

    def write(text: str, name: str = "t.rule") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
        return path

    return write


@pytest.fixture
def diagnostics(write_rules):
    """Check a snippet (with the shipped operators imported) and return its diagnostics."""

    def run(text: str):
        path = write_rules('import "ops.rule"\n' + textwrap.dedent(text).lstrip("\n"))
        return check_paths([path]).diagnostics

    return run


# ------------------------------------------------------------------ plans that do or do not lay out


def _node(ident, kind, op, inputs, shape, shard, copy=1, attrs=(), role=""):
    return PNode(ident, kind, op, tuple(inputs), tuple(attrs), tuple(shape), Degrees(tuple(shard), copy), role)


def _data_parallel_matmul(aligned: bool) -> PCG:
    """x split on the first mesh atom; w replicated directly (its copies on that atom too), or by way of a
    partition and a combine that leave its copies on the second atom: the same spreads, other ranks."""
    if aligned:
        weight = (_node(5, "parallel", "replicate", (1,), (6, 2), (1, 1), copy=2, attrs=(("degree", 2),)),)
    else:
        weight = (_node(3, "parallel", "partition", (1,), (6, 2), (2, 1), attrs=(("dim", 0), ("degree", 2))),
                  _node(4, "parallel", "replicate", (3,), (6, 2), (2, 1), copy=2, attrs=(("degree", 2),)),
                  _node(5, "parallel", "combine", (4,), (6, 2), (1, 1), copy=2, attrs=(("dim", 0), ("degree", 2))))
    nodes = (
        _node(0, "leaf", "x", (), (4, 6), (1, 1), role="input"),
        _node(1, "leaf", "w", (), (6, 2), (1, 1), role="weight"),
        _node(2, "parallel", "partition", (0,), (4, 6), (2, 1), attrs=(("dim", 0), ("degree", 2))),
        *weight,
        _node(6, "op", "matmul", (2, 5), (4, 2), (2, 1)),
        _node(7, "parallel", "combine", (6,), (4, 2), (1, 1), attrs=(("dim", 0), ("degree", 2))),
    )
    return PCG(nodes, (7,))


@pytest.fixture
def data_parallel_matmul():
    """`_data_parallel_matmul`: a 4-rank plan whose matmul inputs line up (aligned=True) or not."""
    return _data_parallel_matmul


@pytest.fixture
def unrepeatable_blocks(monkeypatch):
    """The searched blocks' plan refused as unrepeatable (`RepeatError`) wherever a mesh's search extracts one.

    Cut to its greedy passes (a limit, Ctrl-C), extraction could lay the searched blocks out unlike each other,
    and the call then ended in an error although every baseline fit. Whether the greedy passes do depends on
    the order of the e-graph's classes (the graph loader of 3b4e15b made the small gpt's blocks come out
    alike), so tests of the fallback inject the refusal."""
    import parsat.search.mesh as mesh_module
    from parsat.search.repeat import RepeatError

    real_solve = mesh_module.solve

    def unrepeatable(*args, **kwargs):
        found = real_solve(*args, **kwargs)
        if kwargs.get("repetition") is not None:
            raise RepeatError("the blocks are not laid out alike: block 1 reads block 0's output in another "
                              "placement (injected)")
        return found

    monkeypatch.setattr(mesh_module, "solve", unrepeatable)
