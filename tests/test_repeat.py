"""Repeated blocks (`search.repeat`): a model of N identical blocks searched as three, the middle block's plan
repeated, gives the whole model's plan: the full search's cost, every leaf, a PCG that trains like one process."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("egglog")

import parsat  # noqa: E402
from parsat.dsl.library import load_library  # noqa: E402
from parsat.ir.models import build_example  # noqa: E402
from parsat.ir.pcg import PCG  # noqa: E402
from parsat.ir.pcg_placement import derive_placements  # noqa: E402
from parsat.dsl.parallel_ops import PARALLEL_OPS  # noqa: E402
from parsat.search.repeat import (OUTSIDE, REPEATED, RepeatError, Repetition, block_of, class_blocks,  # noqa: E402
                                    conversions, node_blocks, stamp, value_names, weigh)
from parsat.ir.costs import NodeCost  # noqa: E402
from parsat.report.explain import explain_plan  # noqa: E402

LIBRARY = load_library()[0]
SMALL = {"batch": 8, "seq": 16, "hidden": 64, "heads": 4, "vocab": 128}   # on the slow "cpu" machine: split
LIMITS = {"iterations": 4}


@pytest.fixture(scope="module")
def plans():
    """gpt with 5 blocks on 2 devices: searched whole, and as three blocks repeated."""
    sizes = {**SMALL, "blocks": 5}
    whole = parsat.optimize("gpt", "cpu", devices=2, sizes=sizes, limits=LIMITS, repeat_blocks=False,
                            baselines=False)
    repeated = parsat.optimize("gpt", "cpu", devices=2, sizes=sizes, limits=LIMITS, baselines=False)
    return whole, repeated


def test_block_names():
    assert block_of("b12_wq") == 12 and block_of("b0_ln1") == 0
    assert block_of("wte") == OUTSIDE and block_of("lnf") == OUTSIDE and block_of("bq") == OUTSIDE


def test_a_name_moved_into_a_block_is_the_substitution_of_its_block():
    from parsat.ir.blocks import _BLOCK_NAME, in_block
    for name in ("b1_wq", "b12_ln1_b0_x", "b0_", "wte", "lnf", "bq", "xb1_wq", "b1wq", "", "b7_b1_w"):
        for block in (0, 3, 17):
            assert in_block(name, block) == (_BLOCK_NAME.sub(f"b{block}_", name, count=1)
                                             if block_of(name) != OUTSIDE else name)


def test_the_stamper_makes_every_field_of_a_pcg_node():
    """`repeat._Stamper.emit` builds PNodes field by field, in order: a field added to PNode must be added there."""
    from dataclasses import fields
    from parsat.ir.pcg import PNode
    assert tuple(f.name for f in fields(PNode)) == ("id", "kind", "op", "inputs", "attrs", "shape", "degrees",
                                                    "role", "origin", "placement", "rules")


def test_repeated_plan_is_as_good_as_the_whole_search(plans):
    whole, repeated = plans
    assert repeated.saturation["repeated_blocks"] == {"blocks": 5, "searched_blocks": 3, "repeated_block": 1,
                                                      "copies": 3}
    assert "repeated_blocks" not in whole.saturation
    blocks = node_blocks(repeated.pcg)
    assert any(n.placement.spread_axes for n in repeated.pcg.nodes if blocks[n.id] == 2 and n.kind == "op")
    assert repeated.totals.time_s <= whole.totals.time_s * 1.02
    assert "5 identical blocks, searched as 3" in explain_plan(repeated)


def test_repeated_plan_reads_every_leaf_and_lays_out(plans):
    _, repeated = plans
    leaves = {n.op: n.shape for n in repeated.pcg.nodes if n.kind == "leaf"}
    assert leaves == {leaf.name: tuple(leaf.shape) for leaf in repeated.graph.leaves}
    assert {block_of(n.origin) for n in repeated.pcg.nodes if n.origin} >= set(range(5))
    derive_placements(repeated.pcg, LIBRARY.ops)   # raises PlacementError if a node's placement does not follow


def test_repeated_plan_trains_like_one_process(plans):
    from parsat.backend.executor import TrainConfig, run_plan

    _, repeated = plans
    result = run_plan(repeated.pcg, 2, TrainConfig(steps=2, check=True, dtype="float64"), graph=repeated.graph,
                      backend="gloo")
    assert result.check == "passed"
    assert result.comm_elements_measured == repeated.totals.comm_elements


def _searched(with_result: bool = False):
    """The three searched blocks' PCG on 2 devices, the graph tensor each node holds, and a 6-block repetition
    (and the saturation result, `with_result`)."""
    from parsat.ir.machine import Machine
    from parsat.search.extract import extract, node_costs
    from parsat.egraph.runner import Limits
    from parsat.egraph.saturate import saturate
    from parsat.search.solve import pcg_from_extraction

    graph = build_example("gpt", {**SMALL, "blocks": 3}, LIBRARY)
    machine = Machine.resolve("cpu").with_devices(2)
    result = saturate(graph, LIBRARY, LIBRARY.rules, 2, Limits(iterations=4))
    roots = [result.classes[n] for n in graph.outputs]
    extraction = extract(result.snapshot, node_costs(result.snapshot, graph, LIBRARY, machine), roots,
                         machine.memory_capacity, Limits(ilp_seconds=0))
    pcg, ident = pcg_from_extraction(result, extraction, graph, LIBRARY, roots, graph.outputs)
    values = {ident[c]: name for c, name in value_names(result.snapshot, result.classes).items() if c in ident}
    repetition = Repetition(build_example("gpt", {**SMALL, "blocks": 6}, LIBRARY), graph, 6)
    return (pcg, values, repetition, result) if with_result else (pcg, values, repetition)


@pytest.fixture(scope="module")
def searched():
    """`_searched(with_result=True)` once for the module's three `stamp` tests: each saturated, extracted and built
    the same 3-block PCG again (~1.7 CPU s a time). They read it and stamp copies (`replace`, new dicts); the PCG,
    the repetition and the saturation result are frozen or only read, so each test gets what it built."""
    return _searched(with_result=True)


def test_stamp_repeats_block_one_and_refuses_blocks_laid_out_differently(searched):
    pcg, values, repetition, _result = searched
    stamped = stamp(pcg, repetition, values)
    blocks = node_blocks(stamped)
    per_block = {b: sum(1 for v in blocks.values() if v == b) for b in range(6)}
    assert per_block[1] == per_block[2] == per_block[3] == per_block[4] > 0   # four copies of block 1
    searched = node_blocks(pcg)
    read = next(i for n in pcg.nodes if searched[n.id] == 2 for i in n.inputs if searched[i] == REPEATED)
    # block 2 reads another value from block 1 than block 1 read from block 0: copies cannot read each other
    with pytest.raises(RepeatError, match="not laid out alike"):
        stamp(pcg, repetition, {**values, read: "b1_ln2"})
    # ... or the same value laid out another way
    nodes = list(pcg.nodes)
    nodes[read] = replace(nodes[read], placement=type(nodes[read].placement)(()))
    with pytest.raises(RepeatError, match="not laid out alike"):
        stamp(replace(pcg, nodes=tuple(nodes)), repetition, values)
    # ... or a value the graph does not name
    with pytest.raises(RepeatError, match="holds no value the graph names"):
        stamp(pcg, repetition, {k: v for k, v in values.items() if k != read})


def test_stamp_bridges_blocks_whose_outputs_are_laid_out_apart(searched):
    """Block 1 reads block 0's output in one placement, block 2 reads block 1's in another: the e-graph's own
    parallel operators move each copy's output into the placement the next copy reads."""
    pcg, values, repetition, result = searched
    names = value_names(result.snapshot, result.classes)
    convert = conversions(result.snapshot, names)
    searched = node_blocks(pcg)
    behind = next(i for n in pcg.nodes if searched[n.id] == REPEATED for i in n.inputs
                  if searched[i] == REPEATED - 1 and i in values)
    ahead_name = values[behind].replace("b0_", "b1_", 1)
    ahead = next(i for n in pcg.nodes if searched[n.id] == 2 for i in n.inputs if values.get(i) == ahead_name)
    here = pcg.nodes[ahead].placement
    # another placement of the same value that saturation can reach from the one block 2 reads
    elsewhere = next(p for c, p in result.snapshot.placement.items()
                     if names.get(c) == ahead_name and p != here and convert(ahead_name, here, p))
    steps = convert(ahead_name, here, elsewhere)
    assert steps and steps[-1].placement == elsewhere and all(s.op in PARALLEL_OPS for s in steps)
    assert convert(ahead_name, here, here) == ()
    nodes = list(pcg.nodes)
    nodes[behind] = replace(nodes[behind], placement=elsewhere)   # block 1 now reads block 0's output elsewhere
    moved = replace(pcg, nodes=tuple(nodes))
    with pytest.raises(RepeatError, match="not laid out alike"):
        stamp(moved, repetition, values)                           # no converter: refused, as before
    stamped = stamp(moved, repetition, values, convert)
    by_id = {n.id: n for n in stamped.nodes}
    blocks = node_blocks(stamped)
    bridges = [n for n in stamped.nodes if n.kind == "parallel" and n.placement == elsewhere
               and n.origin.endswith(ahead_name[3:]) and by_id[n.inputs[0]].kind != "leaf"
               and blocks[n.id] in (2, 3, 4)]
    assert len(bridges) == 3      # between copies 1-2, 2-3 and 3-4 (copy 1 reads block 0 itself)
    for bridge in bridges:
        first = bridge
        for _ in range(len(steps) - 1):
            first = by_id[first.inputs[0]]
        assert by_id[first.inputs[0]].placement == here      # it starts from what the copy before made


def test_stamp_refuses_a_plan_that_misses_the_model_leaves(searched):
    pcg, values, repetition, _result = searched
    other = build_example("gpt", {**SMALL, "blocks": 6, "hidden": 128}, LIBRARY)
    with pytest.raises(RepeatError, match="leaves differ"):
        stamp(pcg, replace(repetition, whole=other), values)


def test_weigh_counts_the_middle_block_once_per_copy():
    from parsat.egraph.saturate import saturate

    graph = build_example("gpt", {**SMALL, "blocks": 3}, LIBRARY)
    result = saturate(graph, LIBRARY, [], 1)
    blocks = class_blocks(result.snapshot)
    assert blocks[result.classes["b1_wqkv"]] == 1 and blocks[result.classes["b1_res2"]] == 1
    assert blocks[result.classes["b2_ln1"]] == 2 and blocks[result.classes["loss"]] == 2
    assert blocks[result.classes["wte"]] == OUTSIDE and blocks[result.classes["emb"]] == OUTSIDE
    one = NodeCost(forward_s=1.0, memory_bytes=10, comm_elements=3)
    costs = {(cid, 0): one for cid in result.snapshot.classes}
    weighed = weigh(costs, result.snapshot, Repetition(graph, graph, 30))
    assert weighed[(result.classes["b1_wqkv"], 0)] == one.times(28)
    assert weighed[(result.classes["b0_wqkv"], 0)] == one and weighed[(result.classes["b2_wqkv"], 0)] == one
