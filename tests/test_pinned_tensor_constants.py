"""What a pinned tensor axis may split of the graph's constant inputs (`strategies.config_excluded`), and HF BERT
pinned `tp=2`, which needs it.

A pinned tp never reads a contraction's weight whole and splits graph inputs only where splitting a constant
costs nothing and keeps the plan Megatron's: the batch's one-hot ids and a constant lookup's ids along their
vocabulary (session 60 helper C, `_constant_lookups`), and a constant read only as a mask (`_constant_masks`),
split as the scores beside it are. HF BERT (`padding_idx` 0) had no joint plan pinned tp 2: its word lookup
(`embedding_padded`) had no e-node reading its table's column slices (nothing pushed a feature split of the lookup
onto the table: `partition_features_of_embedding_padded`), and its [batch, heads, seq, seq] mask of ones, a
constant input, was read whole, so the masked softmax was computed whole on every rank. The word table is tied
to the decoder: a weight several operators read is split along one dim (`_one_storage_dims`), else the plan
read it as columns and rows and the torch runtime refused it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import parsat
from parsat.dsl.library import load_library
from parsat.dsl.parallel_ops import PARTITION
from parsat.egraph.runner import Limits
from parsat.egraph.saturate import saturate
from parsat.ir.graph import GraphBuilder
from parsat.search.extract import leaf_roles
from parsat.search.strategies import Config, config_excluded

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def _partitions_of(snapshot, cid: int) -> dict[int, tuple[int, int]]:
    """dim of each partition e-node reading class `cid` -> its e-node id."""
    return {node.attrs[0]: (reader, index) for reader, index in snapshot.readers.get(cid, ())
            for node in [snapshot.classes[reader][index]] if node.op == PARTITION}


def test_a_pinned_tensor_axis_splits_a_constant_read_only_as_a_mask_and_no_other_constant():
    """scores [2, 4, 8] (a batch input) through a masked softmax with a constant mask, plus a constant bias: on 2
    devices pinned tp, the mask's partitions along its leading dims are allowed, the bias's are not (it is read by
    an add, not as a mask), and the batch input's along its batch dim are not (tp never splits the batch)."""
    library = load_library()[0]
    g = GraphBuilder(library, name="masked")
    x, m, c = g.input("x", [2, 4, 8]), g.input("m", [2, 4, 8]), g.input("c", [2, 4, 8])
    g.output(g.op("add", g.op("softmax_masked", x, m), c, name="y"))
    graph = g.build()
    result = saturate(graph, library, library.rules, 2, Limits(iterations=4))
    snap, cls = result.snapshot, result.classes
    excluded = config_excluded(snap, leaf_roles(snap, graph), Config(None, 0), {cls["x"]: 0})
    mask, bias, batch = (_partitions_of(snap, cls[name]) for name in ("m", "c", "x"))
    assert {0, 1} <= set(mask) and {0, 1} <= set(bias) and 0 in batch, (mask, bias, batch)
    assert not any(excluded(nid) for nid in mask.values())
    assert all(excluded(nid) for nid in bias.values())
    assert excluded(batch[0])


@pytest.fixture(scope="module")
def bert():
    """HF BERT (`hf_models.make`: 2 layers, hidden 128, 4 heads, batch 8 x 32, float64, dropout off) imported, its
    last key padding: a constant mask read by `softmax_masked` (without padding the attention is fused)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_torch_native_runtime import PADDED, _factory

    from parsat.importer.export import import_module

    module, example = _factory("bert" + PADDED)()
    return import_module(module, example, check=False).graph


def test_bert_pinned_tp_has_a_joint_plan_with_head_sharded_attention(bert):
    """The joint extraction (no baselines to fall back on) keeps tp 2: every masked softmax split along the heads
    on tp with the mask split alike (a block of a constant, nothing sent), the padded word lookup column-parallel
    (its table stored split along its columns, its output along the features), the token-type and position
    lookups vocabulary-parallel (their constant one-hots split along the vocabulary)."""
    data = parsat.optimize(bert, machine="cpu", devices=2, degrees={"tp": 2}, baselines=False).to_dict()
    assert data["extraction"]["chosen"] == "joint" and "fallback" not in data["extraction"], data["extraction"]
    assert "partition_features_of_embedding_padded" in data["rules_used"]
    nodes = {n["id"]: n for n in data["nodes"]}
    softmaxes = [n for n in data["nodes"] if n["op"] == "softmax_masked"]
    assert len(softmaxes) == 2 and all(n["placement"] == ["Shard(1)"] for n in softmaxes), softmaxes
    masks = {nodes[n["inputs"][1]]["id"] for n in softmaxes}
    assert len(masks) == 1
    split = nodes[masks.pop()]
    assert split["op"] == "partition" and (split["attrs"]["dim"], split["attrs"]["axis"]) == (1, "tp")
    assert nodes[split["inputs"][0]]["kind"] == "leaf" and nodes[split["inputs"][0]]["shape"] == [8, 4, 32, 32]
    word = next(n for n in data["nodes"] if n["op"] == "embedding_padded")
    assert word["placement"] == ["Shard(2)"]
    table = nodes[word["inputs"][1]]
    assert table["op"] == "partition" and (table["attrs"]["dim"], table["attrs"]["axis"]) == (1, "tp")
    # the table is tied to the decoder's projection: one layout (`strategies._one_storage_dims`), so the head
    # reads the same column split (row-parallel), never the rows the lookup cannot read
    tied = nodes[table["inputs"][0]]
    splits = {(n["op"], n["attrs"].get("dim")) for n in data["nodes"] if tied["id"] in n["inputs"]}
    assert splits == {("partition", 1)}, splits
    constant_ids = [n for n in data["nodes"] if n["kind"] == "leaf" and n["role"] == "input"
                    and n["shape"] in ([8, 32, 2], [1, 32, 64])]
    for ids in constant_ids:
        readers = [(n["op"], n["attrs"].get("dim"), n["attrs"].get("axis")) for n in data["nodes"]
                   if ids["id"] in n["inputs"]]
        assert readers == [("partition", 2, "tp")], (ids["shape"], readers)
    assert len(constant_ids) == 2


@pytest.mark.slow
def test_bert_s_pinned_tp_joint_plan_trains_on_two_ranks_like_one_process(bert, tmp_path):
    """The joint plan above, lowered with `runtime="torch"` on 2 gloo ranks (`_train_hf`: 3 AdamW steps with
    clipping against the unmodified module in one process, every parameter a DTensor, the checkpoint loading
    into the unmodified module); before the tied table had one layout, the lowering refused the plan."""
    from test_torch_native_runtime import PADDED, _train_hf

    plan = parsat.optimize(bert, machine="cpu", devices=2, degrees={"tp": 2}, baselines=False).to_dict()
    assert plan["extraction"]["chosen"] == "joint"
    _train_hf("bert" + PADDED, {"joint": plan}, 2, tmp_path)


def test_bert_s_pinned_plan_is_never_worse_than_the_grid_point(bert):
    """With baselines: the joint plan is extracted (no fallback) and compared; the plan kept is the faster."""
    data = parsat.optimize(bert, machine="cpu", devices=2, degrees={"tp": 2}).to_dict()
    assert data["extraction"]["candidates"] and "fallback" not in data["extraction"], data["extraction"]
    assert data["totals"]["time_s"] <= data["baselines"]["best_grid"]["time_s"] + 1e-12
