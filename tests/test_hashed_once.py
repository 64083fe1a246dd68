"""PCGs and graphs hash once (`ir.hashed`): the same hash the dataclass would give, kept in the process only."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from parsat.dsl.library import load_library
from parsat.ir.graph import Graph
from parsat.ir.hashed import HASH_KEY
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import build_example
from parsat.ir.pcg import PCG

SIZES = {"blocks": 1, "hidden": 64, "heads": 4, "batch": 4, "seq": 16, "vocab": 128}


@pytest.fixture(scope="module")
def made():
    library = load_library()[0]
    graph = build_example("gpt", SIZES, library)
    return graph, megatron_pcg(graph, library, (2, 2), 4, vocabulary_loss=True)


def _generated(obj) -> int:
    """The hash a frozen dataclass generates: its compared fields, in order, as one tuple."""
    return hash(tuple(getattr(obj, f.name) for f in dataclasses.fields(obj) if f.compare))


def test_hash_is_the_generated_one_and_kept(made):
    for obj in made:
        assert hash(obj) == _generated(obj)
        assert obj.__dict__[HASH_KEY] == hash(obj)


def test_equal_objects_hash_alike_and_a_changed_field_rehashes(made):
    graph, pcg = made
    hash(pcg), hash(graph)
    again = dataclasses.replace(pcg)   # equal, a new object: its own hash, worked out anew
    assert again == pcg and HASH_KEY not in again.__dict__ and hash(again) == hash(pcg)
    staged = dataclasses.replace(pcg, zero=1)
    assert HASH_KEY not in staged.__dict__ and hash(staged) == _generated(staged)
    renamed = dataclasses.replace(graph, microbatches=2)
    assert hash(renamed) == _generated(renamed) and renamed != graph


@pytest.mark.parametrize("kind", [Graph, PCG])
def test_the_kept_hash_is_neither_pickled_nor_copied(made, kind):
    obj = next(o for o in made if isinstance(o, kind))
    hash(obj)
    obj.__dict__[HASH_KEY] = 12345   # as another process's hash of it would be: not to be carried
    try:
        for other in (pickle.loads(pickle.dumps(obj)), copy.copy(obj), copy.deepcopy(obj)):
            assert other == obj and HASH_KEY not in other.__dict__
            assert hash(other) == _generated(obj)
    finally:
        obj.__dict__[HASH_KEY] = _generated(obj)
