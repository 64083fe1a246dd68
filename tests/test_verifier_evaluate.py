"""dsl.evaluate against plain numpy on the shipped operators."""

import numpy as np
import pytest

from parsat.dsl import ast
from parsat.dsl.evaluate import PieceSelection, evaluate, evaluate_op
from parsat.dsl.instantiate import instantiate
from parsat.dsl.library import load_library
from parsat.dsl.symbolic import Poly

S = Poly.sym


@pytest.fixture(scope="module")
def ops():
    library, _ = load_library(None)
    return library.ops


def test_matmul(ops):
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 3)), rng.normal(size=(3, 4))
    inst = instantiate(ops["matmul"], [(S("m"), S("k")), (S("k"), S("n"))], {})
    assert np.allclose(evaluate(inst, {"m": 2, "k": 3, "n": 4}, {"a": a, "b": b}), a @ b)


def test_softmax_middle_dim(ops):
    x = np.random.default_rng(1).normal(size=(2, 3, 4))
    inst = instantiate(ops["softmax"], [(S("a"), S("n"), S("b"))], {"dim": Poly.const(1)})
    e = np.exp(x)
    assert np.allclose(evaluate(inst, {"a": 2, "n": 3, "b": 4}, {"x": x}), e / e.sum(1, keepdims=True))


def test_concat_and_split(ops):
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(3, 4)), rng.normal(size=(3, 5))
    inst = instantiate(ops["concat"], [(S("a"), S("n")), (S("a"), S("m"))], {"dim": Poly.const(1)})
    assert np.allclose(evaluate(inst, {"a": 3, "n": 4, "m": 5}, {"x": x, "y": y}), np.concatenate([x, y], 1))
    inst = instantiate(ops["split"], [(S("n"), S("a"))], {"dim": Poly.const(0), "start": S("s"), "size": S("z")})
    assert np.allclose(evaluate(inst, {"n": 3, "a": 4, "s": 1, "z": 2}, {"x": x}), x[1:3])


def test_layernorm_with_real_attribute(ops):
    rng = np.random.default_rng(3)
    x, g, b = rng.normal(size=(3, 4)), rng.normal(size=4), rng.normal(size=4)
    inst = instantiate(ops["layernorm"], [(S("a"), S("n")), (S("n"),), (S("n"),)], {}, {"eps": ast.Name("e")})
    mu = x.mean(1, keepdims=True)
    var = ((x - mu) ** 2).mean(1, keepdims=True)
    got = evaluate(inst, {"a": 3, "n": 4}, {"x": x, "gamma": g, "beta": b}, {"e": 1e-5})
    assert np.allclose(got, (x - mu) / np.sqrt(var + 1e-5) * g + b)


def test_conv2d_with_padding(ops):
    rng = np.random.default_rng(4)
    x, k = rng.normal(size=(1, 2, 4, 4)), rng.normal(size=(3, 2, 3, 3))
    inst = instantiate(ops["conv2d"], [(S("n"), S("c"), S("h"), S("w")), (S("o"), S("c"), S("r"), S("s"))],
                       {"stride": Poly.const(1), "pad": Poly.const(1)})
    got = evaluate(inst, {"n": 1, "c": 2, "h": 4, "w": 4, "o": 3, "r": 3, "s": 3}, {"x": x, "k": k})
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    ref = np.array([[[[np.sum(padded[0, :, y:y + 3, z:z + 3] * k[f]) for z in range(4)] for y in range(4)]
                     for f in range(3)]])
    assert np.allclose(got, ref)


def test_rank_zero_output(ops):
    inst = instantiate(ops["reduce_sum"], [(S("a"),)], {"dim": Poly.const(0)})
    assert evaluate(inst, {"a": 3}, {"x": np.arange(3.0)}).shape == ()


def test_block_ranges_and_partial_pieces(ops):
    """One output block, and one partial piece of a contraction split in two."""
    rng = np.random.default_rng(5)
    a, b = rng.normal(size=(4, 6)), rng.normal(size=(6, 2))
    inst = instantiate(ops["matmul"], [(S("m"), S("k")), (S("k"), S("n"))], {})
    dims = {"m": 4, "k": 6, "n": 2}
    assert np.allclose(evaluate_op(inst, dims, {"a": a, "b": b}, ranges={"i": (2, 4)}), (a @ b)[2:4])
    second = evaluate_op(inst, dims, {"a": a, "b": b}, pieces=PieceSelection(1, {"l": 2}))
    assert np.allclose(second, a[:, 3:] @ b[3:])
