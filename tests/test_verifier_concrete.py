"""The degree model's piece simulation (verifier.pieces), the counterexample search and shrinking."""

import numpy as np
import pytest

from parsat.dsl.library import load_library
from parsat.dsl.parser import parse
from parsat.verifier import concrete, pieces
from parsat.verifier.core import instances

ROW = """
import "ops.rule"
rule row:
  forall x: [m, k], w: [k, n], p: degree
  where m % p == 0
  matmul(partition(x, 0, p), replicate(w, p)) => partition(matmul(x, w), 0, p)
rule relu_reduce:
  forall a: [m, k], b: [k, n], p: degree
  where k % p == 0
  relu(reduce(matmul(partition(a, 1, p), partition(b, 0, p)), p)) => reduce(relu(matmul(partition(a, 1, p), partition(b, 0, p))), p)
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    path = tmp_path_factory.mktemp("rules") / "row.rule"
    path.write_text(ROW)
    lib, errors = load_library([path])
    assert not errors
    return lib


def test_partition_combine_pieces_round_trip():
    x = np.arange(24.0).reshape(4, 6)
    split = pieces._partition(pieces._whole(x), 2, 1, 3)
    assert split.shape == (1, 3, 1, 1, 4, 2)
    assert np.array_equal(split[0, 1, 0, 0], x[:, 2:4])
    back = pieces._combine(split, 2, 1, 3)
    assert np.array_equal(pieces.assemble(back, 2), x)


def test_replicate_and_reduce_pieces():
    x = np.arange(6.0).reshape(2, 3)
    copies = pieces._replicate(pieces._whole(x), 2, 2)
    assert copies.shape[2] == 2 and np.array_equal(copies[0, 0, 1, 0], x)
    partial = np.stack([x, 2 * x]).reshape((1, 1, 1, 2, 2, 3))
    assert np.array_equal(pieces.assemble(pieces._reduce(partial, 2, 2), 2), 3 * x)


def test_true_rule_has_no_counterexample(library):
    for inst in instances(library.rule("row"), library.ops, max_rank=2):
        failure, ran, _ = concrete.search(inst, count=30)
        assert failure is None and ran > 10


def test_relu_of_partial_sum_is_refuted_and_shrunk(library):
    inst = instances(library.rule("relu_reduce"), library.ops)[0]
    failure, _, _ = concrete.search(inst)
    # both sides have the same global value; on the devices the right side takes relu of partial sums
    assert failure is not None and failure.kind == "device" and "right side" in failure.reason
    assert failure.sizes["p"] == 2 and failure.sizes["m"] == 1 and failure.sizes["n"] == 1
    # the shrunk counterexample replays
    assert concrete.trial(inst, failure.sizes, seed=0) is not None or concrete.replay(inst, failure.sizes)
