"""Every operator's torch implementation against the numpy evaluation of its index semantics."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parsat.importer.torch_ops import OPS, OpCallError, UnsupportedOpError, apply_op, torch_op  # noqa: E402
from parsat.dsl.evaluate import evaluate  # noqa: E402
from parsat.dsl.library import load_library  # noqa: E402
from parsat.dsl.parser import parse  # noqa: E402
from parsat.ir.graph import instance_for  # noqa: E402

LIBRARY_OPS = load_library()[0].ops

# op -> cases of (input shapes, attributes); a couple of ranks for rank-polymorphic ops.
CASES: dict[str, list[tuple[list[tuple[int, ...]], dict]]] = {
    "matmul": [([(3, 4), (4, 5)], {})],
    "bmm": [([(2, 3, 4), (2, 4, 5)], {}), ([(2, 2, 3, 4), (2, 2, 4, 3)], {})],
    "linear": [([(3, 4), (4, 5), (5,)], {}), ([(2, 3, 4), (4, 5), (5,)], {})],
    "bias_add": [([(3, 4), (4,)], {}), ([(2, 3, 4), (4,)], {})],
    "add": [([(3, 4), (3, 4)], {}), ([(2, 3, 4), (2, 3, 4)], {})],
    "sub": [([(5,), (5,)], {}), ([(2, 3), (2, 3)], {})],
    "mul": [([(3, 4), (3, 4)], {}), ([(2, 2, 3), (2, 2, 3)], {})],
    "scale": [([(3, 4)], {"c": 0.125}), ([(2, 3, 4)], {"c": -2.0})],
    "relu": [([(3, 4)], {}), ([(2, 3, 4)], {})],
    "gelu": [([(3, 4)], {}), ([(2, 5)], {})],
    "tanh": [([(3, 4)], {}), ([(6,)], {})],
    "sigmoid": [([(3, 4)], {}), ([(2, 2, 2)], {})],
    "exp": [([(3, 4)], {}), ([(5,)], {})],
    "dropout": [([(3, 4)], {"rate": 0.1}), ([(2, 3, 4)], {"rate": 0.5})],
    "softmax": [([(3, 4)], {"dim": 1}), ([(3, 4)], {"dim": 0}), ([(2, 3, 4)], {"dim": 1})],
    "layernorm": [([(3, 4), (4,), (4,)], {"eps": 1e-5}), ([(2, 3, 6), (6,), (6,)], {"eps": 1e-3})],
    "reduce_sum": [([(3, 4)], {"dim": 0}), ([(2, 3, 4)], {"dim": 2})],
    "mean": [([(3, 4)], {"dim": 1}), ([(2, 3, 4)], {"dim": 1})],
    "concat": [([(2, 4), (3, 4)], {"dim": 0}), ([(2, 3, 4), (2, 3, 2)], {"dim": 2})],
    "split": [([(6, 4)], {"dim": 0, "start": 1, "size": 3}), ([(2, 3, 8)], {"dim": 2, "start": 4, "size": 4})],
    "transpose": [([(3, 4)], {"d0": 0, "d1": 1}), ([(2, 3, 4, 5)], {"d0": 1, "d1": 3})],
    "unflatten": [([(6, 4)], {"dim": 0, "k": 3}), ([(2, 12, 3)], {"dim": 1, "k": 4})],
    "flatten": [([(2, 3, 4)], {"dim": 0}), ([(2, 3, 4, 5)], {"dim": 2})],
    "embedding": [([(4, 7), (7, 3)], {}), ([(2, 3, 7), (7, 5)], {})],
    "conv2d": [([(2, 3, 6, 6), (4, 3, 3, 3)], {"stride": 1, "pad": 1}),
               ([(1, 2, 7, 5), (3, 2, 3, 2)], {"stride": 2, "pad": 0})],
    "avgpool2d": [([(2, 3, 6, 6)], {"size": 2, "stride": 2}), ([(1, 2, 7, 5)], {"size": 3, "stride": 1})],
    "global_avgpool": [([(2, 3, 4, 5)], {})],
    "neg": [([(3, 4)], {})],
    "add_scalar": [([(3, 4)], {"c": 1.5})],
    "div": [([(3, 4), (3, 4)], {})],
    "reciprocal": [([(3, 4)], {})],
    "sqrt": [([(3, 4)], {})],
    "rsqrt": [([(2, 3)], {})],
    "log": [([(3, 4)], {})],
    "sin": [([(3, 4)], {})],
    "cos": [([(3, 4)], {})],
    "silu": [([(3, 4)], {})],
    "gelu_tanh": [([(3, 4)], {})],
    "linear_nobias": [([(3, 4), (4, 5)], {}), ([(2, 3, 4), (4, 5)], {})],
    "linear_nobias_t": [([(3, 4), (5, 4)], {}), ([(2, 3, 4), (5, 4)], {})],
    "linear_t": [([(3, 4), (5, 4), (5,)], {}), ([(2, 3, 4), (5, 4), (5,)], {})],
    "add_bcast": [([(2, 3, 4), (3, 4)], {}), ([(2, 3, 4), (4,)], {})],
    "mul_bcast": [([(2, 3, 4), (3, 4)], {}), ([(5, 2, 3, 4), (3, 4)], {})],
    "add_bcast_dim": [([(2, 3, 4), (2, 4)], {"dim": 1}), ([(2, 3, 4), (2, 3)], {"dim": 2})],
    "mul_bcast_dim": [([(2, 3, 4), (3, 4)], {"dim": 0}), ([(2, 3, 4), (2, 3)], {"dim": 2})],
    "broadcast": [([(2, 4)], {"dim": 1, "n": 3}), ([(2, 3)], {"dim": 0, "n": 2})],
    "softmax_masked": [([(3, 4), (3, 4)], {}), ([(2, 3, 4), (2, 3, 4)], {})],
    "softmax_causal": [([(4, 4)], {}), ([(2, 3, 5, 5)], {})],
    "attention_causal": [([(4, 3), (4, 3), (4, 2)], {"c": 0.5}), ([(2, 3, 5, 4), (2, 3, 5, 4), (2, 3, 5, 6)],
                                                                  {"c": 0.25})],
    "attention": [([(4, 3), (4, 3), (4, 2)], {"c": 0.5}), ([(2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6)], {"c": 0.25})],
    "causal_mask": [([], {"s": 1}), ([], {"s": 5})],
    "zigzag": [([(8, 3)], {"dim": 0, "g": 4}), ([(2, 12, 3)], {"dim": 1, "g": 6}), ([(4,)], {"dim": 0, "g": 2})],
    "unzigzag": [([(8, 3)], {"dim": 0, "g": 4}), ([(2, 12, 3)], {"dim": 1, "g": 6}), ([(4,)], {"dim": 0, "g": 2})],
    "attention_masked": [([(4, 3), (5, 3), (5, 2), (4, 5)], {"c": 0.5}),
                         ([(2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6), (5, 7)], {"c": 0.25})],
    "logsumexp": [([(3, 4)], {}), ([(2, 3, 4)], {})],
    "amax": [([(3, 4)], {}), ([(2, 3, 4)], {})],
    "topk_onehot": [([(3, 5)], {"k": 2}), ([(2, 3, 4)], {"k": 4}), ([(4, 1)], {"k": 1})],
    "sumexp_shifted": [([(3, 4), (3,)], {}), ([(2, 3, 4), (2, 3)], {})],
    "maxpool2d": [([(2, 3, 6, 6)], {"size": 2, "stride": 2}), ([(1, 2, 7, 5)], {"size": 3, "stride": 2})],
    "maxpool2d_padded": [([(2, 3, 8, 8)], {"size": 3, "stride": 2, "pad": 1}),
                         ([(1, 2, 5, 7)], {"size": 3, "stride": 1, "pad": 1}),
                         ([(1, 1, 4, 4)], {"size": 5, "stride": 2, "pad": 2})],
    "nll_sum": [([(4, 5), (4,), (4, 5)], {})],
    "bn_mean": [([(2, 3, 4, 5)], {"count": 40})],
    "bn_var": [([(2, 3, 4, 5), (3,)], {"count": 40})],
    "bn_normalize": [([(2, 3, 4, 5), (3,), (3,), (3,), (3,)], {"eps": 1e-5})],
    "rmsnorm": [([(3, 4), (4,)], {"eps": 1e-6}), ([(2, 3, 4), (4,)], {"eps": 1e-5})],
    "dropout_masked": [([(3, 4), (3, 4)], {"rate": 0.25})],
    "embedding_padded": [([(4, 7), (7, 3)], {"pad": 0}), ([(2, 3, 7), (7, 5)], {"pad": 6})],
    "conv2d_grouped": [([(2, 4, 6, 6), (4, 1, 3, 3)], {"groups": 4, "stride": 1, "pad": 1}),   # depthwise
                       ([(1, 4, 7, 5), (6, 2, 3, 2)], {"groups": 2, "stride": 2, "pad": 0})],
    "conv1d": [([(2, 3, 8), (4, 3, 3)], {"stride": 1, "pad": 1}), ([(1, 2, 9), (3, 2, 3)], {"stride": 2, "pad": 1})],
    "pad": [([(2, 3, 4)], {"dim": 1, "before": 1, "after": 2, "c": 0.0}),
            ([(3, 2)], {"dim": 1, "before": 0, "after": 3, "c": -1.5})],
}

POSITIVE = {"sqrt": (0,), "rsqrt": (0,), "log": (0,), "reciprocal": (0,), "div": (1,), "bn_normalize": (2,)}
ZERO_ONE = {"softmax_masked": 1, "dropout_masked": 1, "attention_masked": 3}


def _inputs(op: str, shapes, rng: np.random.Generator) -> list[np.ndarray]:
    arrays = [rng.standard_normal(s) for s in shapes]
    if op in ("embedding", "embedding_padded"):  # one-hot ids, as the semantics assumes; one row left all-zero (an id held elsewhere)
        ids = rng.integers(0, shapes[0][-1], size=shapes[0][:-1])
        onehot = np.eye(shapes[0][-1])[ids]
        onehot.reshape(-1, shapes[0][-1])[0] = 0.0
        arrays[0] = onehot
    if op == "nll_sum":  # one-hot targets, one row ignored (all zero)
        ids = rng.integers(0, shapes[0][-1], size=shapes[0][:-1])
        arrays[2] = np.eye(shapes[0][-1])[ids]
        arrays[2][0] = 0.0
    for position in POSITIVE.get(op, ()):
        arrays[position] = np.abs(arrays[position]) + 0.5
    if op in ZERO_ONE:  # a 0/1 mask that keeps at least one entry per row
        mask = (rng.random(shapes[ZERO_ONE[op]]) < 0.6).astype(float)
        mask[..., 0] = 1.0
        arrays[ZERO_ONE[op]] = mask
    return arrays


def test_every_library_op_has_a_case_and_an_implementation():
    assert set(CASES) == set(LIBRARY_OPS), "keep CASES in step with rules/ops.rule"
    for name, decl in LIBRARY_OPS.items():
        torch_op(decl)  # arity and attribute names match the declaration


@pytest.mark.parametrize("op,shapes,attrs", [(op, s, a) for op, cases in CASES.items() for s, a in cases])
def test_op_matches_index_semantics(op, shapes, attrs):
    decl = LIBRARY_OPS[op]
    rng = np.random.default_rng(hash((op, str(shapes))) % 2**32)
    arrays = _inputs(op, shapes, rng)
    instance = instance_for(decl, shapes, attrs)
    expected = evaluate(instance, {}, dict(zip(instance.inputs, arrays)))
    got = apply_op(decl, [torch.tensor(a, dtype=torch.float64) for a in arrays], attrs)
    assert tuple(got.shape) == tuple(int(d.constant) for d in instance.output_shape)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-10)


def test_topk_onehot_ranks_equal_entries_by_position_as_declared():
    """Rows with ties (entries from {0, 1, 2}): the torch implementation follows the declared tie-break (the lower
    position first), which the random cases above never meet."""
    rng = np.random.default_rng(7)
    x = rng.integers(0, 3, size=(6, 5)).astype(float)
    decl = LIBRARY_OPS["topk_onehot"]
    instance = instance_for(decl, [x.shape], {"k": 3})
    expected = evaluate(instance, {}, {instance.inputs[0]: x})
    got = apply_op(decl, [torch.tensor(x)], {"k": 3}).numpy()
    np.testing.assert_array_equal(got, expected)
    assert (expected.sum(axis=-1) == 1).all() and (expected.sum(axis=-2) <= 1).all()   # k distinct picks


def test_embedding_gradient_through_matmul_path():
    """With a one-hot input that needs a gradient, the contraction is exact for it too."""
    onehot = torch.eye(5, dtype=torch.float64)[[1, 3]].requires_grad_()
    table = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    apply_op("embedding", [onehot, table]).sum().backward()
    np.testing.assert_allclose(onehot.grad.numpy(), table.detach().sum(1).expand(2, 5).numpy())


def test_unknown_op_is_a_clear_error(tmp_path):
    path = tmp_path / "mine.rule"
    path.write_text("op frobnicate(x: [n]) -> [n]\n  out[i] = x[i] * 2\n", encoding="utf-8")
    decl = parse(path.read_text(), str(path)).ops[0]
    with pytest.raises(UnsupportedOpError, match=r"operator 'frobnicate' \(declared at .*mine.rule:1:\d+\)"):
        apply_op(decl, [torch.ones(3)])
    with pytest.raises(UnsupportedOpError, match="'nope'"):
        torch_op("nope")


def test_wrong_attributes_are_named():
    with pytest.raises(OpCallError, match=r"missing \['dim'\]"):
        apply_op("softmax", [torch.ones(2, 2)], {})
    with pytest.raises(OpCallError, match="takes 2 tensor"):
        apply_op("matmul", [torch.ones(2, 2)])
    assert "matmul" in OPS
