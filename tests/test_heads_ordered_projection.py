"""A fused projection read apart (HF GPT-2's `c_attn`) laid out head by head: the weight stored through a view.

`ir.fused_projections.heads_ordered` writes the cut of a fused [rows, n] product as one product per block, each
block's weight and bias a column of the weight's and bias's [k, z, n / z] view (the proved rules it names);
`ir.megatron.megatron_pcg(heads_ordered=True)` (the search's grid) stores that view split along z on the tensor
axis: each rank's heads' q, k and v columns, a strided block of the parameter (`ir.pcg.weight_storage` follows
views), and GPT-2's attention runs heads-parallel. torch's styles refuse such a plan by name; the rewritten
forward holds such a parameter head-major (`backend.torch_native.head_major`), ZeRO-3 included.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from parsat.dsl.library import load_library
from parsat.dsl.parallel_ops import COMBINE, PARTITION
from parsat.ir.fused_projections import RULES, fused_projections, heads_ordered
from parsat.ir.graph import GraphBuilder
from parsat.ir.megatron import megatron_pcg
from parsat.ir.pcg import WEIGHT, WEIGHT_PIECE, pcg_roles, storage_views, weight_storage
from parsat.ir.pipeline import stored_piece_elements

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # sibling test modules (the HF runtime harness)


def _fused(parts: int = 3, width: int = 4):
    library = load_library()[0]
    g = GraphBuilder(library, name="fused")
    x, w, b = g.input("x", [6, 4]), g.weight("w", [4, parts * width]), g.weight("b", [parts * width])
    view = g.op("unflatten", g.op("linear", x, w, b), dim=0, k=3)
    g.output(*(g.op("split", view, dim=2, start=i * width, size=width, name=f"part{i}") for i in range(parts)))
    return library, g.build()


def test_the_head_ordered_form_computes_what_the_fused_projection_does():
    """The rewritten graph's blocks equal the fused product's cut, to rounding (torch, float64): the weight's
    and bias's views read column i as columns i z .. (i + 1) z of the parameter."""
    torch = pytest.importorskip("torch")
    from parsat.importer.torch_ops import evaluate_graph

    _library, graph = _fused()
    assert [f.product.op for f in fused_projections(graph)] == ["linear"]
    rewritten, made = heads_ordered(graph)
    assert set(made.values()) == {RULES}
    assert [n.name for n in rewritten.nodes if n.op == "linear"] == [f"{graph.nodes[0].name}__column{i}"
                                                                     for i in range(3)]
    gen = torch.Generator().manual_seed(0)
    leaves = {leaf.name: torch.randn(leaf.shape, generator=gen, dtype=torch.float64) for leaf in graph.leaves}
    want, got = evaluate_graph(graph, leaves), evaluate_graph(rewritten, leaves)
    for name in graph.outputs:
        assert torch.allclose(want[name], got[name], rtol=1e-12, atol=1e-12), name   # one GEMM or three: rounding


def test_a_projection_read_otherwise_is_not_rewritten():
    """Blocks that do not cover the product (two of three cut) are no fused projection read apart."""
    library = load_library()[0]
    g = GraphBuilder(library, name="partial")
    x, w, b = g.input("x", [6, 4]), g.weight("w", [4, 12]), g.weight("b", [12])
    view = g.op("unflatten", g.op("linear", x, w, b), dim=0, k=3)
    g.output(*(g.op("split", view, dim=2, start=i * 4, size=4) for i in range(2)))
    assert fused_projections(g.build()) == () and heads_ordered(g.build()) is None


def test_the_layout_stores_the_weight_as_a_partition_of_its_view():
    """tp 2: the weight's storage chain is leaf -> view(s) -> partition on tp, the view's role the whole weight's,
    the partition the stored piece: half the weight's elements on each rank, as a contiguous column split stores
    it, priced alike (the view nothing); no value is gathered (each block column-parallel); the rewritten nodes
    name the rules in the library."""
    library, graph = _fused()
    plain = megatron_pcg(graph, library, (1, 2))
    pcg = megatron_pcg(graph, library, (1, 2), heads_ordered=True)
    assert pcg is not None and plain is not None
    leaves = {n.op: n.id for n in pcg.nodes if n.kind == "leaf" and n.role == WEIGHT}
    chains, roles = weight_storage(pcg), pcg_roles(pcg)
    for name in ("w", "b"):
        chain = chains[leaves[name]]
        views = storage_views(pcg, chain)
        assert views and pcg.node(chain[-1]).op == PARTITION, [pcg.node(i).label for i in chain]
        assert all(roles[v.id] == WEIGHT for v in views) and roles[chain[-1]] == WEIGHT_PIECE
    plain_leaves = {n.op: n.id for n in plain.nodes if n.kind == "leaf"}
    pieces, plain_pieces = stored_piece_elements(pcg), stored_piece_elements(plain)
    assert pieces[leaves["w"]] == plain_pieces[plain_leaves["w"]] == 4 * 12 // 2
    def whole_product_gathered(layout) -> bool:   # the [.., 12] product (its view) gathered before the cut
        return any(n.op == COMBINE and n.shape[-1] == 12 for n in layout.nodes)

    assert not whole_product_gathered(pcg) and whole_product_gathered(plain)
    from parsat.ir.machine import Machine
    from parsat.search.solve import price_pcg

    machine = Machine.preset("cpu")
    costs, plain_costs = price_pcg(pcg, library, machine), price_pcg(plain, library, machine)
    for name in ("w", "b"):   # the view runs nothing and holds nothing; the storage holds what a column split does
        chain, plain_chain = chains[leaves[name]], weight_storage(plain)[plain_leaves[name]]
        assert all(costs[v.id] == type(costs[v.id])() for v in storage_views(pcg, chain))
        assert sum(costs[i].memory_bytes for i in chain) == sum(plain_costs[i].memory_bytes for i in plain_chain) > 0
    names = {r.name for r in library.rules}
    named = {rule.split(" (")[0] for n in pcg.nodes for rule in n.rules}
    assert named == set(RULES) and named <= names
    assert not storage_views(plain, weight_storage(plain)[plain_leaves["w"]])
    # ZeRO-3 (dp 2 x tp 2): the view's tp piece split again on dp along a dim that is not its tp dim, all-gathered
    zero3 = megatron_pcg(graph, library, (2, 2), heads_ordered=True, zero=3)
    weight = weight_storage(zero3)[next(n.id for n in zero3.nodes if n.kind == "leaf" and n.op == "w")]
    assert storage_views(zero3, weight) and [str(zero3.node(i).placement) for i in weight[-2:]] == ["[- S2]", "[S0 S2]"]
    assert [(u.op, str(u.placement)) for u in zero3.nodes if weight[-1] in u.inputs] == [("all_gather", "[R S2]")]
    from parsat.ir.pcg import weight_placement
    assert [(str(p), f) for p, f in [weight_placement(zero3, weight)]] == [("[S0 S1]", (1, 3))]
    shared: dict = {}   # the ZeRO-3 layout derived from the ZeRO-0 build (`sharded_nodes`) is the one built alone
    megatron_pcg(graph, library, (2, 2), heads_ordered=True, cache=shared)
    assert megatron_pcg(graph, library, (2, 2), heads_ordered=True, zero=3, cache=shared) == zero3


def test_the_grid_bounds_a_family_by_its_first_layout_with_a_fused_projection_too():
    """A fused projection is laid out head by head at every ZeRO level alike (ZeRO-3 splits the view's piece again
    on dp: the test above), so a family's points lay out the activations alike and the grid's branch and bound
    (`baselines.grid_families`' `skip`) is shown each family's first layout only (no ZeRO-3 point, whose weights
    are gathered on dp), head-ordered where the family has a tensor axis, as for a graph without one."""
    from parsat.ir.machine import Machine
    from parsat.search.baselines import grid_families

    library, graph = _fused()
    plain = GraphBuilder(library, name="plain")
    x, w, b = plain.input("x", [6, 4]), plain.weight("w", [4, 12]), plain.weight("b", [12])
    plain.output(plain.op("linear", x, w, b))
    for g, fused in ((graph, True), (plain.build(), False)):
        shown: list = []
        families = list(grid_families(g, library, Machine.preset("cpu"), True, 4,
                                      skip=lambda pcg: shown.append(pcg) or True))
        assert families and not any(families) and len(shown) <= len(families)   # every family skipped at once
        assert not any(n.op == "all_gather" for p in shown for n in p.nodes)    # no ZeRO-3 layout shown
        ordered = [p for p in shown if any(storage_views(p, c) for c in weight_storage(p).values())]
        assert bool(ordered) is fused


@pytest.fixture(scope="module")
def gpt2():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import hf_models

    from parsat.importer.export import import_module

    module, inputs = hf_models.make("gpt2")
    return module, import_module(module, inputs, check=False)


def test_gpt2_tp2_heads_ordered_layout_is_heads_parallel(gpt2):
    """HF GPT-2 (2 blocks, 4 heads) on tp 2 laid out head by head: each `c_attn` weight stored through its view,
    the causal softmax split along the heads, `c_proj` row-parallel (its partial sum reduced), no [.., 3h] value
    gathered; laid out plainly, the softmax runs whole and the fused product is gathered."""
    _module, imported = gpt2
    library = load_library()[0]
    graph = imported.graph
    for ordered in (False, True):
        pcg = megatron_pcg(graph, library, (1, 2), heads_ordered=ordered, vocabulary_loss=True)
        softmax = [n for n in pcg.nodes if n.op == "softmax_causal"]
        assert len(softmax) == 2
        assert all(str(n.placement) == ("[S1]" if ordered else "[-]") for n in softmax)
        gathered = [n for n in pcg.nodes if n.op == COMBINE and n.shape[-1] == 3 * 128]
        assert bool(gathered) != ordered
        c_attn = [chain for leaf, chain in weight_storage(pcg).items() if "c_attn.weight" in pcg.node(leaf).op]
        assert len(c_attn) == 2 and all(bool(storage_views(pcg, chain)) == ordered for chain in c_attn)
        c_proj = [pcg.node(chain[-1]) for leaf, chain in weight_storage(pcg).items()
                  if "attn.c_proj.weight" in pcg.node(leaf).op]
        assert len(c_proj) == 2 and all(str(n.placement) == ("[S0]" if ordered else "[S1]") for n in c_proj)


def test_the_torch_runtime_refuses_a_weight_stored_through_a_view(gpt2):
    """The lowering names the weight and why: the parameter's piece is a strided block, not lowered yet."""
    from parsat.backend.torch_native.lowering import LoweringError, lower
    from parsat.backend.torch_native.apply import module_info

    module, imported = gpt2
    library = load_library()[0]
    pcg = megatron_pcg(imported.graph, library, (1, 2), heads_ordered=True, vocabulary_loss=True)
    with pytest.raises(LoweringError, match="c_attn.* as a block of its view"):
        lower(pcg, imported.graph, module_info(module, imported.weights))


def test_the_pinned_search_answers_the_heads_parallel_point_and_it_lowers_to_strided_parameters():
    """`parsat.optimize` of the tests' HF GPT-2 (float64, dropout off) pinned tp 2 on 2 cpu devices answers the
    grid's head-ordered point (each `c_attn` weight stored through its view, the softmax split along the heads);
    without processes, its lowering is a rewritten forward (no style stores a strided block) whose `c_attn`
    parameters are strided blocks with split factor 3, held head-major as `Shard(d)`, and whose row-parallel
    `c_proj` is `Shard(0)`."""
    pytest.importorskip("transformers")
    from test_torch_native_runtime import _factory

    import parsat
    from parsat.backend.torch_native.apply import module_info
    from parsat.backend.torch_native.rewritten import dtensor_placement, lowered_plan
    from parsat.importer.export import import_module

    module, inputs = _factory("gpt2")()
    imported = import_module(module, inputs, check=False)
    plan = parsat.optimize(imported.graph, machine="cpu", devices=2, degrees={"tp": 2})
    pcg = plan.pcg
    assert all(str(n.placement) == "[S1]" for n in pcg.nodes if n.op == "softmax_causal")
    chains = [chain for leaf, chain in weight_storage(pcg).items() if "c_attn" in pcg.node(leaf).op]
    assert len(chains) == 4 and all(storage_views(pcg, chain) for chain in chains)
    from parsat.report.explain import parallel_text

    data = plan.to_dict()
    nodes = {n["id"]: n for n in data["nodes"]}
    weights = {n["op"] for n in data["nodes"] if n["kind"] == "leaf" and n.get("role") == "weight"}
    said = [parallel_text(n, nodes, weights) for n in data["nodes"] if n["kind"] == "parallel"]
    assert sum("stored sharded as a block of this view" in line for line in said) == 4, said
    lowering, rewrite = lowered_plan(pcg, imported.graph, module_info(module, imported.weights), imported)
    assert rewrite is not None and lowering.styles == () and "stored as a block of its view" in lowering.rewritten
    stored, strided = dict(rewrite.stored), dict(rewrite.strided)
    weight, bias = "model.transformer.h.0.attn.c_attn.weight", "model.transformer.h.0.attn.c_attn.bias"
    assert strided == {name.replace(".0.", f".{i}."): 3 for i in (0, 1) for name in (weight, bias)}
    assert repr(dtensor_placement(stored[weight])) == "Shard(dim=1)"   # held head-major (`head_major`)
    assert repr(dtensor_placement(stored[bias])) == "Shard(dim=0)"
    assert repr(dtensor_placement(stored["model.transformer.h.0.attn.c_proj.weight"])) == "Shard(dim=0)"


def _heads_ordered_plan(shape: tuple[int, int] = (1, 2), zero: int = 0) -> dict:
    """Megatron's layout of the tests' HF GPT-2 (`_factory`: float64, dropout off) with `c_attn` head by head."""
    import mesh_plans
    from test_torch_native_runtime import _factory

    import parsat

    module, inputs = _factory("gpt2")()
    graph = parsat.from_torch(module, inputs)
    pcg = megatron_pcg(graph, load_library()[0], shape, heads_ordered=True, zero=zero)
    return mesh_plans.plan_dict(graph, pcg)


@pytest.mark.slow
@pytest.mark.parametrize("shape,zero", [((1, 2), 0), ((2, 2), 0), ((2, 2), 3)])
def test_gpt2_heads_ordered_layout_trains_like_one_process_and_checkpoints_for_the_unmodified_module(
        shape, zero, tmp_path):
    """HF GPT-2 under the head-ordered tp 2 layout on 2 gloo ranks, dp 2 x tp 2 on 4, and dp 2 x tp 2 with ZeRO-3
    on dp (`fully_shard`) on 4 (float64): the module's forward evaluates the plan's graph on DTensors
    (`rewritten`), each `c_attn` weight and bias held head-major (`head_major`: each tp rank its heads' q, k and v
    as a plain `Shard(d)`, which `fully_shard` shards again on dp as any column-parallel weight; torch's own
    `_StridedShard` there gathers back wrong, `benchmarks/strided_fully_shard.py`), every parameter a DTensor;
    3 AdamW steps with clip_grad_norm_ equal the unmodified module's in one process (its weights read from the
    state dict, in the module's order); the DCP checkpoint loads into the unmodified module with the trained
    weights."""
    pytest.importorskip("transformers")
    from test_torch_native_runtime import _train_hf

    dp, tp = shape
    results = _train_hf("gpt2", {"gpt2_heads": _heads_ordered_plan(shape, zero)}, dp * tp, tmp_path)
    assert ("fully_shard" in results[0]["gpt2_heads"]["lowering"]) == (zero == 3)
    for result in results:
        placements = result["gpt2_heads"]["placements"]
        # (tp, dp under ZeRO-3): on dp the dim the plan stores the weight split along (`shard_placement_fn`: the
        # view's dim 0 is the weight's), FSDP's default dim 0 for the bias, which the plan keeps whole on dp (its
        # only dim is split on tp), `_StridedShard` beside tp's split of the same dim
        for name, want, sharded in (("attn.c_attn.weight", "Shard(dim=1)", "Shard(dim=0)"),
                                    ("attn.c_attn.bias", "Shard(dim=0)", "_StridedShard(dim=0, sf=2)"),
                                    ("attn.c_proj.weight", "Shard(dim=0)", "Shard(dim=1)")):
            got = placements[f"model.transformer.h.1.{name}"]
            assert got == [want] if dp == 1 else got == ["Replicate()" if zero == 0 else sharded, want], (name, got)
        assert all(p for p in placements.values()), placements   # every parameter a DTensor


def test_head_major_order_round_trip():
    """`head_major` puts each rank's q, k and v blocks together (rank-major) and back, along either dim; a
    `Shard(d)` block of the head-major tensor is the rank's strided block of the module's parameter."""
    torch = pytest.importorskip("torch")
    from parsat.backend.torch_native.head_major import head_major

    w = torch.arange(4 * 12).reshape(4, 12)
    held = head_major(w, 1, 3, 2)
    assert held[0].tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]   # rank 0 first: the first 2 of q, k and v each
    assert torch.equal(head_major(held, 1, 3, 2, inverse=True), w)
    for ranks in (1, 2, 4):
        b = torch.arange(24)
        held = head_major(b, 0, 3, ranks)
        assert torch.equal(head_major(held, 0, 3, ranks, inverse=True), b)
        for r in range(ranks):   # rank r's contiguous block: its part of each of q, k and v
            block = held.chunk(ranks)[r]
            assert torch.equal(block, torch.cat([part.chunk(ranks)[r] for part in b.chunk(3)]))
    with pytest.raises(ValueError, match="does not cut"):
        head_major(torch.zeros(10), 0, 3, 2)
