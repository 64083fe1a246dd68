"""Two builds of a PCG from another, made cheaper per node (session 75, helper G), each equal to the way it was
worked out before: the stamp's copies of block 1 (`search.repeat._Copies.copy`, from a `_Template` worked out once
per stamp) against each node emitted alone (`_Copies.emit` with `in_copy`'s look-ups), and a kin layout rescaled
(`ir.megatron._rescaled`, each node content's answer kept in the pair's tables) against the per-node walk."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("egglog")

from parsat.dsl.library import load_library  # noqa: E402
from parsat.ir.blocks import OUTSIDE, block_of, in_block, past_block  # noqa: E402
from parsat.ir.megatron import UNBIASED, _PairTables, _rescaled, _vocabulary_parts, megatron_pcg  # noqa: E402
from parsat.ir.models import build_example  # noqa: E402
from parsat.ir.pcg import PCG, PNode  # noqa: E402
from parsat.search.repeat import REPEATED, Repetition, _Copies, _link_copies, conversions, node_blocks, stamp, \
    value_names  # noqa: E402

LIBRARY = load_library()[0]


class _NodeByNode(_Copies):
    """`_Copies` as it copied block 1 before `_Template`: each node emitted alone (`emit`), its inputs looked up one
    by one (`in_copy`), a copy's own nodes by the ids `emit` recorded."""

    def copy(self, template, block: int) -> None:
        self.starts[block] = len(self.nodes)
        source = self.in_copy(block)
        for node in self.pcg.nodes:
            if self.blocks[node.id] == REPEATED:
                self.emit(node, block, source)

    def copied(self, block: int, i: int) -> int:
        return self.new_id[(block, i)]


def _node_by_node(pcg: PCG, repetition: Repetition, values, convert=None) -> PCG:
    blocks = node_blocks(pcg)
    links = _link_copies(pcg, blocks, values, convert)
    return _NodeByNode(pcg, repetition.blocks, blocks, values, links).build()


@pytest.fixture(scope="module")
def searched():
    from test_repeat import _searched
    return _searched(with_result=True)


def _same(a: PCG, b: PCG) -> None:
    assert a == b and a.outputs == b.outputs
    assert all(x == y and type(x.shape) is type(y.shape) for x, y in zip(a.nodes, b.nodes, strict=True))


@pytest.mark.parametrize("count", [4, 6, 11])
def test_a_stamp_s_copies_are_the_nodes_emitted_one_by_one(searched, count):
    pcg, values, _repetition, _result = searched
    repetition = Repetition(build_example("gpt", {**_SMALL, "blocks": count}, LIBRARY), _repetition.searched, count)
    stamped = stamp(pcg, repetition, values)
    _same(stamped, _node_by_node(pcg, repetition, values))
    blocks = node_blocks(stamped)
    assert {blocks[n.id] for n in stamped.nodes} >= set(range(count))


def test_a_stamp_with_bridges_between_copies_is_the_nodes_emitted_one_by_one(searched):
    """Block 1 reads block 0's output in another placement than block 2 reads block 1's: each copy after the
    first reads the bridge's last node (`bridged`), the first block 0's node itself."""
    pcg, values, repetition, result = searched
    names = value_names(result.snapshot, result.classes)
    convert = conversions(result.snapshot, names)
    blocks = node_blocks(pcg)
    behind = next(i for n in pcg.nodes if blocks[n.id] == REPEATED for i in n.inputs
                  if blocks[i] == REPEATED - 1 and i in values)
    ahead_name = values[behind].replace("b0_", "b1_", 1)
    ahead = next(i for n in pcg.nodes if blocks[n.id] == 2 for i in n.inputs if values.get(i) == ahead_name)
    here = pcg.nodes[ahead].placement
    elsewhere = next(p for c, p in result.snapshot.placement.items()
                     if names.get(c) == ahead_name and p != here and convert(ahead_name, here, p))
    nodes = list(pcg.nodes)
    nodes[behind] = replace(nodes[behind], placement=elsewhere)
    moved = replace(pcg, nodes=tuple(nodes))
    stamped = stamp(moved, repetition, values, convert)
    assert len(stamped.nodes) > len(stamp(pcg, repetition, values).nodes)   # the bridges
    _same(stamped, _node_by_node(moved, repetition, values, convert))


def test_a_name_past_its_block_prefix_moves_into_a_block_as_in_block():
    for name in ("b1_wq", "b12_ln1_b0_x", "b0_", "wte", "lnf", "bq", "xb1_wq", "b1wq", "", "b7_b1_w"):
        tail = past_block(name)
        assert (tail is None) == (block_of(name) == OUTSIDE)
        for block in (0, 3, 78):
            assert in_block(name, block) == (name if tail is None else f"b{block}_" + tail)


_SMALL = {"batch": 8, "seq": 16, "hidden": 64, "heads": 4, "vocab": 128}


def _walked(pcg: PCG, tables: _PairTables) -> PCG | None:
    """`_rescaled` as it walked every node before its answers were kept by node content (the reference)."""
    before, after, was, now = tables.before, tables.after, tables.was, tables.now
    parts = _vocabulary_parts(pcg, tables)
    nodes: list[PNode] = []
    for node in pcg.nodes:
        attrs = node.attrs
        part = parts.get(node.origin) if node.kind == "op" else None
        if node.kind == "parallel":
            old, new = pcg.nodes[node.inputs[0]].shape, nodes[node.inputs[0]].shape
        elif part is not None:
            old, new, attrs = part
        else:
            name = node.op if node.kind == "leaf" else node.origin
            if node.kind == "op" and node.op in UNBIASED.values() and name not in before:
                name = name.removesuffix("_nobias")
            if name not in before:
                return None
            old, new = before[name], after[name]
            if name in was and node.op == was[name].op:
                if node.attrs != tuple(was[name].attrs):
                    return None
                attrs = tuple(now[name].attrs)
        if node.shape != old:
            return None
        nodes.append(node if (new, attrs) == (old, node.attrs) else
                     PNode(node.id, node.kind, node.op, node.inputs, attrs, tuple(new), node.degrees, node.role,
                           node.origin, node.placement, node.rules))
    return pcg.reshaped(tuple(nodes))


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_layouts_rescaled_through_one_pair_s_kept_answers_are_the_per_node_walk_s(name):
    """Every layout of one pair of graphs (a grid's: meshes, sequence parallelism, ZeRO-3, the vocabulary-parallel
    loss) rescaled with one `_PairTables`, whose kept answers the later layouts read: each equal to the walk, and
    to the layout built for the larger graph alone."""
    sizes = {"blocks": 2, "batch": 4, "seq": 8, "hidden": 16, "heads": 2, "vocab": 32}
    small, large = (build_example(name, {**sizes, "batch": b}, LIBRARY) for b in (4, 8))
    tables = _PairTables.of(small, large)
    layouts = [(shape, seq, zero, vocab) for shape in ((2, 2), (1, 4), (4, 2)) for seq in (False, True)
               for zero in (0, 3) for vocab in (False, True)]
    done = 0
    for shape, seq, zero, vocab in layouts:
        layout = megatron_pcg(small, LIBRARY, shape, zero=zero, sequence=seq, vocabulary_loss=vocab)
        if layout is None:
            continue
        got = _rescaled(layout, small, large, tables)
        fresh = _PairTables.of(small, large)
        assert got is not None
        _same(got, _walked(layout, fresh))
        _same(got, _rescaled(layout, small, large, fresh))
        assert got == megatron_pcg(large, LIBRARY, shape, zero=zero, sequence=seq, vocabulary_loss=vocab)
        done += 1
    assert done >= 12 and tables.values


def test_a_node_rescaled_keeps_its_own_attributes_where_an_equal_key_was_kept():
    """The kept answer of a bias or partial sum (not the graph's operator) says "its own attributes": a node whose
    attributes equal another's as keys (1 and 1.0) keeps its own, as the walk does."""
    graph = build_example("gpt", {"blocks": 1, "batch": 4, "seq": 8, "hidden": 16, "heads": 2, "vocab": 32}, LIBRARY)
    layout = megatron_pcg(graph, LIBRARY, (2, 2))
    tables = _PairTables.of(graph, graph)
    node = next(n for n in layout.nodes if n.kind == "leaf")
    ints, floats = (replace(layout, nodes=tuple(replace(n, attrs=(("k", v),)) if n.id == node.id else n
                                                for n in layout.nodes)) for v in (1, 1.0))
    first, second = _rescaled(ints, graph, graph, tables), _rescaled(floats, graph, graph, tables)
    assert type(dict(first.nodes[node.id].attrs)["k"]) is int
    assert type(dict(second.nodes[node.id].attrs)["k"]) is float
