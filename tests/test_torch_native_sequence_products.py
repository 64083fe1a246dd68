"""A sequence-parallel traced stage's products on local pieces (`backend.torch_native.sequence_products`).

In one process, 2 ranks simulated (a fake process group and torch's
`LocalTensorMode`): Megatron's sequence-parallel MLP, a column-parallel
product of the sequence split input, tanh, a row-parallel product and the
residual add, computed by `sequence_parallel_matmul` equals the unsplit
computation (values and every gradient) and runs exactly the collectives
the plan prices for it (forward: one all-gather, one reduce-scatter;
backward: one all-gather, one reduce-scatter), where DTensor's own `matmul`
on the same DTensors gathers two more in backward. The slow run on gloo
ranks is tests/test_torch_native_pipeline.py's sequence-parallel test.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from parsat.backend.torch_native.sequence_products import sequence_parallel_matmul  # noqa: E402

COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce")


@pytest.fixture
def two_local_ranks():
    """A fake 2-rank process group and `LocalTensorMode` over both ranks (each tensor holds both ranks' pieces);
    yields the 1-D DeviceMesh."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already started in this process")
    dist.init_process_group("fake", world_size=2, rank=0, store=FakeStore())
    try:
        with LocalTensorMode(frozenset(range(2))):
            yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def counted():
    """The functional collectives DTensor's redistributions issue (as tests/test_torch_native_pipeline.py's
    `counted_collectives` counts them), by phase: "fwd name" / "bwd name" (inside autograd's backward)."""
    import torch.distributed._functional_collectives as funcol

    counts: Counter = Counter()
    originals = {name: getattr(funcol, name) for name in COLLECTIVES}

    def wrap(name):
        def run(*args, **kwargs):
            counts[f"{'bwd' if torch._C._current_graph_task_id() != -1 else 'fwd'} {name}"] += 1
            return originals[name](*args, **kwargs)
        return run
    for name in COLLECTIVES:
        setattr(funcol, name, wrap(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(funcol, name, original)


def _mlp(product, x, w1, w2):
    return product(product(x, w1).tanh(), w2) + x


def test_a_sequence_parallel_mlp_on_local_pieces_runs_the_plans_collectives_only(two_local_ranks):
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    mesh = two_local_ranks
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(shape, generator=g, dtype=torch.float64) for shape in ((2, 4, 6), (6, 8), (8, 6)))
    whole = [t.clone().requires_grad_() for t in (x, w1, w2)]
    _mlp(torch.matmul, *whole).square().sum().backward()
    runs = {}
    for product in (sequence_parallel_matmul, torch.matmul):
        split = [distribute_tensor(t, mesh, [Shard(d)]).requires_grad_() for t, d in ((x, 1), (w1, 1), (w2, 0))]
        saved = []   # what autograd keeps for backward: (a DTensor?, shape)
        with counted() as counts:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((isinstance(t, DTensor),
                                                                                   tuple(t.shape))) or t,
                                                          lambda t: t):
                hidden = product(split[0], split[1])
            out = product(hidden.tanh(), split[2])
            placements = (hidden.placements, out.placements)
            y = out + split[0]
            y.square().sum().backward()
        runs[product.__name__] = dict(counts)
        assert y.placements == (Shard(1),)
        for got, want in zip([y] + [t.grad for t in split], [_mlp(torch.matmul, x, w1, w2)] + [t.grad for t in whole]):
            assert torch.allclose(got.full_tensor(), want, rtol=1e-12, atol=1e-12)
        assert [t.grad.placements for t in split] == [(Shard(1),), (Shard(1),), (Shard(0),)]
        if product is sequence_parallel_matmul:   # the gathered input kept whole (matmul's [b x s, h] view of
            # it), as the cost model prices it: no re-gather
            assert placements == ((Shard(2),), (Partial(),)) and (False, (8, 6)) in saved, saved
        else:   # DTensor's mm keeps the strided piece (a DTensor), gathered again in backward
            assert all(is_dtensor for is_dtensor, _ in saved), saved
    # the plan's: the input gathered and the output reduce-scattered forward, the output's gradient gathered and
    # the input's reduce-scattered backward; the gathered input kept for the weight's gradient (no re-gather)
    assert runs["sequence_parallel_matmul"] == {"fwd all_gather_single": 1, "fwd reduce_scatter_single": 1,
                                                "bwd all_gather_single": 1, "bwd reduce_scatter_single": 1}
    # DTensor's own matmul (mm on [batch x seq, hidden], a _StridedShard it has no strategy for): the input
    # gathered again for w1's gradient, the output's gradient gathered once for each of w2's backward products
    assert runs["matmul"] == {**runs["sequence_parallel_matmul"], "bwd all_gather_single": 3}


def test_other_placements_are_left_to_dtensor(two_local_ranks):
    """A replicated input, or a weight split otherwise, runs DTensor's own matmul: the same value either way."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = two_local_ranks
    x, w = torch.randn(2, 4, 6, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    for px, pw in ((Replicate(), Shard(1)), (Shard(1), Replicate()), (Shard(0), Shard(1)), (Shard(2), Shard(1))):
        got = sequence_parallel_matmul(distribute_tensor(x, mesh, [px]), distribute_tensor(w, mesh, [pw]))
        assert torch.allclose(got.full_tensor(), x @ w, rtol=1e-12, atol=1e-12), (px, pw)
    assert torch.equal(sequence_parallel_matmul(x, w), x @ w)


def test_a_traced_cross_entropy_on_vocabulary_split_logits_runs_as_loss_parallelism(two_local_ranks):
    """A traced last stage's `aten.cross_entropy_loss` (`loss_parallel.traced_losses` points it at
    `traced_cross_entropy`) on vocabulary-split logits: the loss and the logits' gradient of the whole logits,
    the logits never gathered: torch's loss parallelism all-reduces each row's max, sum of exps and target logit
    forward and nothing backward (the plan's vocabulary-parallel loss gathers the block maxima and all-reduces
    its sums: benchmarks/backend_results.md, 2026-12-04 helper D)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from parsat.backend.torch_native.loss_parallel import traced_cross_entropy

    mesh = two_local_ranks
    g = torch.Generator().manual_seed(1)
    logits, target = torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randint(0, 8, (6,), generator=g)
    whole = logits.clone().requires_grad_()
    want = F.cross_entropy(whole, target)
    want.backward()
    split = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
    with counted() as counts:
        loss = traced_cross_entropy(split, distribute_tensor(target, mesh, [Replicate()]))
        loss.backward()
    assert torch.allclose(loss, want.detach(), rtol=1e-12) and split.grad.placements == (Shard(1),)
    assert torch.allclose(split.grad.full_tensor(), whole.grad, rtol=1e-12, atol=1e-15)
    assert dict(counts) == {"fwd all_reduce": 3}


@pytest.mark.parametrize("vocab", [8, 7])
def test_a_vocabulary_parallel_lookup_on_local_rows_gathers_its_gradient_once(two_local_ranks, vocab):
    """`vocabulary_parallel_embedding` on a table split along the vocabulary (evenly, and 7 rows on 2 ranks) and
    whole ids, plus position embeddings split along the sequence, as the gpt's first stage computes them under
    sequence parallelism: the values and the table's gradient of the unsplit lookup, the gradient already the
    table's `Shard(0)`, with the plan's collectives only (the partial sum reduce-scattered onto the sequence
    forward, its gradient all-gathered backward). DTensor's own lookup slices the ids along the sequence for the
    table's gradient instead and leaves it a whole-table partial sum: a reduce-scatter of the whole table once
    placed as its parameter, where the plan gathers the activation's gradient."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    from parsat.backend.torch_native.sequence_products import vocabulary_parallel_embedding

    mesh = two_local_ranks
    g = torch.Generator().manual_seed(2)
    table, ids = torch.randn(vocab, 4, generator=g, dtype=torch.float64), torch.randint(0, vocab, (2, 6), generator=g)
    positions = torch.randn(6, 4, generator=g, dtype=torch.float64)
    whole = table.clone().requires_grad_()
    want = F.embedding(ids, whole) + positions
    want.square().sum().backward()
    runs = {}
    for lookup in (vocabulary_parallel_embedding, lambda t, i: F.embedding(i, t)):
        split = distribute_tensor(table, mesh, [Shard(0)]).requires_grad_()
        with counted() as counts:
            out = lookup(split, distribute_tensor(ids, mesh, [Replicate()])) + \
                distribute_tensor(positions, mesh, [Shard(0)])
            out.square().sum().backward()
        assert out.placements == (Shard(1),)
        assert torch.allclose(out.full_tensor(), want.detach(), rtol=1e-12, atol=1e-15)
        assert torch.allclose(split.grad.full_tensor(), whole.grad, rtol=1e-12, atol=1e-15)
        runs[lookup is vocabulary_parallel_embedding] = (split.grad.placements, dict(counts))
    assert runs[True] == ((Shard(0),), {"fwd reduce_scatter_single": 1, "bwd all_gather_single": 1})
    assert runs[False] == ((Partial(),), {"fwd reduce_scatter_single": 1})


def _pre_norm_mlps(product, x, w1, w2):
    """Two pre-LN residual MLPs (a column- then a row-parallel product each), as a stage's blocks are laid out:
    where a row-parallel sum is left `Partial`, the residual stream after it stays a partial sum."""
    import torch.nn.functional as F

    for _ in range(2):
        x = x + product(product(F.layer_norm(x, (x.shape[-1],)), w1).tanh(), w2)
    return x


def test_a_tensor_parallel_mlp_without_sequence_parallelism_all_reduces_once_each_way(two_local_ranks):
    """Without sequence parallelism (the input `Replicate()`): `tensor_parallel_matmul` runs the plan's
    collectives only, each MLP's row-parallel sum all-reduced once forward and the column-parallel input's
    gradient once backward (the values and every gradient of the unsplit computation). DTensor's own `matmul`
    leaves the row sum `Partial`: the residual stream stays a partial sum, all-reduced again in every norm's
    backward (the extra backward all-reduces counted in tests/test_torch_native_pipeline.py until
    2026-12-04)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    from parsat.backend.torch_native.sequence_products import tensor_parallel_matmul

    mesh = two_local_ranks
    g = torch.Generator().manual_seed(3)
    x, w1, w2 = (torch.randn(shape, generator=g, dtype=torch.float64) for shape in ((2, 4, 6), (6, 8), (8, 6)))
    whole = [t.clone().requires_grad_() for t in (x, w1, w2)]
    want = _pre_norm_mlps(torch.matmul, *whole)
    want.square().sum().backward()
    runs = {}
    for product in (tensor_parallel_matmul, torch.matmul):
        split = [distribute_tensor(t, mesh, [p]).requires_grad_()
                 for t, p in ((x, Replicate()), (w1, Shard(1)), (w2, Shard(0)))]
        with counted() as counts, implicit_replication():
            y = _pre_norm_mlps(product, *split)
            # the stage's output leaves whole (`apply._whole_outputs`)
            y.redistribute(mesh, [Replicate()]).to_local().square().sum().backward()
        runs[product.__name__] = (y.placements, dict(counts))
        assert torch.allclose(y.full_tensor(), want.detach(), rtol=1e-12, atol=1e-12)
        for got, t in zip(split, whole):
            assert torch.allclose(got.grad.full_tensor(), t.grad, rtol=1e-12, atol=1e-12)
        assert [t.grad.placements for t in split] == [(Replicate(),), (Shard(1),), (Shard(0),)]
    assert runs["tensor_parallel_matmul"] == ((Replicate(),), {"fwd all_reduce": 2, "bwd all_reduce": 2})
    # DTensor's: the partial residual stream all-reduced for the second norm and the output forward, and again
    # in both norms' backward beside each MLP's input gradient
    assert runs["matmul"][1]["bwd all_reduce"] > 2, runs["matmul"]


@pytest.mark.parametrize("sequence", [True, False], ids=["sequence-parallel", "tensor-parallel"])
def test_an_nn_linear_mlp_on_local_pieces_runs_the_plans_collectives_only(two_local_ranks, sequence):
    """`aten.linear` (how an `nn.Linear`, an imported Hugging Face module's projections, traces: weights [out,
    in], a bias) on the local pieces: the column-parallel weight `Shard(0)` with its bias `Shard(0)`, the
    row-parallel one `Shard(1)` with its bias whole, added after the sum. With sequence parallelism
    (`sequence_parallel_linear`, the input `Shard(1)`) the collectives of `sequence_parallel_matmul`'s test; without
    (`tensor_parallel_linear`, the input `Replicate()`) one all-reduce each way; values and every gradient those
    of the unsplit MLP."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    from parsat.backend.torch_native.sequence_products import sequence_parallel_linear, tensor_parallel_linear

    def mlp(linear, x, w1, b1, w2, b2):
        return linear(linear(x, w1, b1).tanh(), w2, b2) + x

    mesh = two_local_ranks
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in ((2, 4, 6), (8, 6), (8,), (6, 8), (6,))]
    whole = [t.clone().requires_grad_() for t in tensors]
    want = mlp(F.linear, *whole)
    want.square().sum().backward()
    linear = sequence_parallel_linear if sequence else tensor_parallel_linear
    entering = Shard(1) if sequence else Replicate()
    placements = (entering, Shard(0), Shard(0), Shard(1), Replicate())
    split = [distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in zip(tensors, placements)]
    if not sequence:   # the input enters as a stage's do (`apply._replicated_inputs`): its gradient, a partial sum
        # of the column-parallel product's and the residual's, all-reduced by `from_local`'s backward
        split[0] = split[0].to_local().detach().requires_grad_()
    with counted() as counts, implicit_replication():
        x = split[0] if sequence else DTensor.from_local(split[0], mesh, [Replicate()], run_check=False)
        y = mlp(linear, x, *split[1:])
        y.redistribute(mesh, [entering]).to_local().square().sum().backward()
    assert y.placements == (entering,)
    assert torch.allclose(y.full_tensor(), want.detach(), rtol=1e-12, atol=1e-12)
    # under sequence parallelism the row-parallel bias's gradient (a sum over this rank's rows) stays `Partial`
    # until read, as the norms' weights' do (docs/TORCH_NATIVE.md)
    grads = placements[:-1] + ((Partial(),) if sequence else (Replicate(),))
    for got, t, p in zip(split, whole, grads):
        if isinstance(got, DTensor):
            assert got.grad.placements == (p,)
        assert torch.allclose(got.grad.full_tensor() if isinstance(got, DTensor) else got.grad, t.grad, rtol=1e-12,
                              atol=1e-12)
    assert dict(counts) == ({"fwd all_gather_single": 1, "fwd reduce_scatter_single": 1, "bwd all_gather_single": 1,
                             "bwd reduce_scatter_single": 1} if sequence else {"fwd all_reduce": 1, "bwd all_reduce": 1})


def test_a_whole_input_read_by_several_column_parallel_products_has_its_gradient_all_reduced_once(two_local_ranks):
    """An attention's separate q, k and v projections (HF BERT's and LLaMA's `nn.Linear`s) read one whole input:
    each product's input gradient is left a partial sum, they add up, and the norm's backward all-reduces the
    sum once, the plan's one all-reduce of the input's gradient (a `redistribute` in each product would
    all-reduce each: 3)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    from parsat.backend.torch_native.sequence_products import tensor_parallel_linear

    mesh = two_local_ranks
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in ((2, 4, 6), *[(8, 6)] * 3, (6, 8))]

    def attention_like(linear, x, wq, wk, wv, wo):
        a = F.layer_norm(x, (x.shape[-1],))
        q, k, v = (linear(a, w) for w in (wq, wk, wv))
        return x + linear((q * k).tanh() * v, wo)

    whole = [t.clone().requires_grad_() for t in tensors]
    attention_like(F.linear, *whole).square().sum().backward()
    placements = (Replicate(), Shard(0), Shard(0), Shard(0), Shard(1))
    split = [distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in zip(tensors, placements)]
    with counted() as counts, implicit_replication():
        attention_like(tensor_parallel_linear, *split).to_local().square().sum().backward()
    for got, t in zip(split, whole):
        assert torch.allclose(got.grad.full_tensor(), t.grad, rtol=1e-12, atol=1e-12)
    assert dict(counts) == {"fwd all_reduce": 1, "bwd all_reduce": 1}


def test_an_element_wise_norms_input_gradient_is_whole_before_the_norm_and_its_weights_gradient_too(two_local_ranks):
    """HF LLaMA's RMSNorm, element-wise ops with a float32 section (`.to(torch.float32)`, pow, mean, rsqrt, the
    weight's product), read by q, k and v as separate products: `whole_gradient` (Megatron's f, made once for
    the input however many products read it) all-reduces their summed partial gradient once before the norm's
    backward, so the norm's weight's gradient is whole (`Replicate()`, nothing more to reduce after the step) and
    every gradient is the unsplit one's. Without it DTensor carried the partial sum back through the norm: the
    weight's gradient `Partial()`, each rank's piece rounded to float32 on its own."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    from parsat.backend.torch_native.sequence_products import tensor_parallel_linear

    mesh = two_local_ranks
    g = torch.Generator().manual_seed(7)
    tensors = [torch.randn(shape, generator=g, dtype=torch.float64)
               for shape in ((2, 4, 6), (6,), *[(8, 6)] * 3, (6, 8))]

    def rms_attention(linear, x, gain, wq, wk, wv, wo):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        a = gain * h.to(x.dtype)
        q, k, v = (linear(a, w) for w in (wq, wk, wv))
        return x + linear((q * k).tanh() * v, wo)

    whole = [t.clone().requires_grad_() for t in tensors]
    rms_attention(F.linear, *whole).square().sum().backward()
    placements = (Replicate(), Replicate(), Shard(0), Shard(0), Shard(0), Shard(1))
    split = [distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in zip(tensors, placements)]
    with counted() as counts, implicit_replication():
        rms_attention(tensor_parallel_linear, *split).to_local().square().sum().backward()
    assert split[1].grad.placements == (Replicate(),), split[1].grad.placements   # the norm's weight: whole
    for got, t in zip(split, whole):
        assert torch.allclose(got.grad.full_tensor(), t.grad, rtol=1e-12, atol=1e-12)
    assert dict(counts) == {"fwd all_reduce": 1, "bwd all_reduce": 1}


def test_conv1d_products_as_traced_addmm_run_on_local_pieces_with_the_plans_all_reduces(two_local_ranks):
    """transformers' `Conv1D` (GPT-2: weight [in, out], `addmm(bias, x.view(-1, in), w)` in a traced stage):
    `tensor_parallel_addmm` computes a column-parallel one (weight `Shard(1)`, bias `Shard(0)`) and a row-parallel
    one (weight `Shard(0)`, bias whole, added after the all-reduce) on the local pieces, equal to the unsplit
    MLP, values and every gradient, with one all-reduce forward (the row sum) and one backward (the whole input's
    gradient); a scaled `addmm` is DTensor's own."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    from parsat.backend.torch_native.sequence_products import tensor_parallel_addmm

    mesh = two_local_ranks
    g = torch.Generator().manual_seed(8)
    tensors = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in ((8, 6), (6, 10), (10,), (10, 6),
                                                                                 (6,))]

    def conv1d_mlp(addmm, x, w1, b1, w2, b2):
        return addmm(b2, addmm(b1, x.tanh(), w1).tanh(), w2)

    whole = [t.clone().requires_grad_() for t in tensors]
    conv1d_mlp(torch.addmm, *whole).square().sum().backward()
    placements = (Replicate(), Shard(1), Shard(0), Shard(0), Replicate())
    split = [distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in zip(tensors, placements)]
    with counted() as counts, implicit_replication():
        out = conv1d_mlp(tensor_parallel_addmm, *split)
        out.to_local().square().sum().backward()
    assert out.placements == (Replicate(),)
    for got, t in zip(split, whole):
        assert torch.allclose(got.grad.full_tensor(), t.grad, rtol=1e-12, atol=1e-12)
    assert dict(counts) == {"fwd all_reduce": 1, "bwd all_reduce": 1}
    scaled = tensor_parallel_addmm(split[2], split[0], split[1], beta=0.5)
    assert torch.allclose(scaled.full_tensor(), torch.addmm(tensors[2], tensors[0], tensors[1], beta=0.5))


def test_a_residual_add_of_a_column_parallel_output_gathers_the_sum_once_for_every_reader(two_local_ranks):
    """HF GPT-2's attention under Megatron's tp plan: its `c_proj` is column-parallel (output split along its last
    dim) and its residual add reads the whole stream. `tensor_parallel_add` slices the whole operand (its gradient
    all-gathered back at the add: the plan's partition) and gathers the sum once (the plan's combine), so both
    readers of the sum (a norm, the next residual add) read it whole: one all-gather forward, one backward, values
    and gradients those of the unsplit add. Left to DTensor the sum stayed split and each reader converted it
    (2 forward and 2 backward all-gathers here, measured 2026-12-05, the output's own gather included); adds of
    other placements are DTensor's own."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from parsat.backend.torch_native.sequence_products import tensor_parallel_add

    mesh = two_local_ranks
    g = torch.Generator().manual_seed(9)
    tensors = [torch.randn((2, 4, 6), generator=g, dtype=torch.float64) for _ in range(3)]

    def block(add, piece, stream, mlp):   # the sum read by a norm and by the next residual add
        total = add(piece, stream)
        return add(total, F.layer_norm(total, (6,)) * mlp)

    whole = [t.clone().requires_grad_() for t in tensors]
    block(torch.add, *whole).square().sum().backward()
    runs = {}
    for add in (torch.add, tensor_parallel_add):
        split = [distribute_tensor(t, mesh, [p]).requires_grad_()
                 for t, p in zip(tensors, (Shard(2), Replicate(), Replicate()))]
        with counted() as counts:
            out = block(add, *split)
            out.full_tensor().square().sum().backward()
        runs[add] = dict(counts)
        assert torch.allclose(out.full_tensor(), block(torch.add, *tensors), rtol=1e-12, atol=1e-12)
        for got, t in zip(split, whole):
            assert torch.allclose(got.grad.full_tensor(), t.grad, rtol=1e-12, atol=1e-12)
        if add is tensor_parallel_add:
            assert out.placements == (Replicate(),)
    assert runs[tensor_parallel_add] == {"fwd all_gather_single": 1, "bwd all_gather_single": 1}, runs
    assert runs[torch.add]["fwd all_gather_single"] > 1, runs
    both = [distribute_tensor(t, mesh, [Shard(2)]) for t in tensors[:2]]
    assert tensor_parallel_add(*both).placements == (Shard(2),)   # two pieces: DTensor's own, nothing gathered


@pytest.mark.parametrize("name", ["matmul", "linear"])
def test_a_column_parallel_product_gathers_its_input_again_in_backward_where_the_machine_regathers(two_local_ranks,
                                                                                                    name):
    """On a machine priced as a runtime that re-gathers (`Machine.runtime_regathers`, Megatron-LM's choice) the
    `sequence_parallel_regathering_*` products keep the input's shard, not the gathered input, for the weight's
    gradient: one more backward all-gather per column-parallel product (the MLP has one) and the same
    forward; values and every gradient equal either way (those of the unsplit MLP)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from parsat.backend.torch_native import sequence_products as products

    linear = name == "linear"
    mesh = two_local_ranks
    g = torch.Generator().manual_seed(6)
    shapes = ((2, 4, 6), (8, 6), (6, 8)) if linear else ((2, 4, 6), (6, 8), (8, 6))
    tensors = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes]
    whole = [t.clone().requires_grad_() for t in tensors]
    _mlp(F.linear if linear else torch.matmul, *whole).square().sum().backward()
    runs = {}
    for regather in (False, True):
        product = getattr(products, f"sequence_parallel_{'regathering_' if regather else ''}{name}")
        dims = (1, 0, 1) if linear else (1, 1, 0)
        split = [distribute_tensor(t, mesh, [Shard(d)]).requires_grad_() for t, d in zip(tensors, dims)]
        kept = []   # the plain (gathered) tensors autograd keeps while the column-parallel product runs
        with counted() as counts:
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: (None if isinstance(t, DTensor) else kept.append(tuple(t.shape))) or t, lambda t: t):
                hidden = product(split[0], split[1])
            y = product(hidden.tanh(), split[2]) + split[0]
            y.square().sum().backward()
        runs[regather] = dict(counts)
        assert torch.allclose(y.full_tensor(), _mlp(F.linear if linear else torch.matmul, *tensors),
                              rtol=1e-12, atol=1e-12)
        for got, want in zip(split, whole):
            assert torch.allclose(got.grad.full_tensor(), want.grad, rtol=1e-12, atol=1e-12)
        # the gathered [b x s, h] input is kept by the product only where the machine does not re-gather (the
        # re-gathering product's own hooks keep the shard in its place, out of this outer hook's sight)
        assert ((8, 6) in kept) == (not regather), kept
    assert runs[True] == {**runs[False], "bwd all_gather_single": runs[False]["bwd all_gather_single"] + 1}
    assert runs[False] == {"fwd all_gather_single": 1, "fwd reduce_scatter_single": 1, "bwd all_gather_single": 1,
                           "bwd reduce_scatter_single": 1}


def test_a_regathering_product_frees_the_gathered_input_after_its_forward(two_local_ranks, monkeypatch):
    """What re-gathering buys: once the forward has run, nothing holds the gathered input (autograd holds the
    shard), where the product that does not re-gather keeps it until backward (the test above)."""
    import gc
    import weakref

    from torch.distributed.tensor import Shard, distribute_tensor

    from parsat.backend.torch_native import sequence_products as products

    gathered, keeping = [], products._keeping_the_shard

    def spy(x, whole, product):
        gathered.append(weakref.ref(whole))
        return keeping(x, whole, product)

    monkeypatch.setattr(products, "_keeping_the_shard", spy)
    mesh = two_local_ranks
    x = distribute_tensor(torch.randn(2, 4, 6, dtype=torch.float64), mesh, [Shard(1)]).requires_grad_()
    w = distribute_tensor(torch.randn(6, 8, dtype=torch.float64), mesh, [Shard(1)]).requires_grad_()
    y = products.sequence_parallel_regathering_matmul(x, w)
    gc.collect()
    assert len(gathered) == 1 and gathered[0]() is None
    y.to_local().sum().backward()
    assert torch.allclose(w.grad.full_tensor(), x.full_tensor().sum((0, 1)).unsqueeze(1).expand(6, 8), rtol=1e-12)
