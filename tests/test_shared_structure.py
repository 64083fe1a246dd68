"""Layouts of one structure share the facts worked out from it (`ir.pcg.StructureTable`, `PCG.sharing`, through
`ir.megatron.megatron_pcg`'s `kin`): a graph laid out on dp 4 x tp 2 and on dp 2 x tp 4, or a kin graph's layout
built on another mesh, holds the same operators reading the same values, so its roles, blocks, checkpoints, saved
values and the step simulator's facts are worked out once. Each fact read through the shared table must be what
the PCG works out alone, and its pricing the same figures."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.cost.pcg_tasks import attention_views, needs_gradient, reader_counts, regathered, unkept
from parsat.cost.saved import kept_values, regathered_values
from parsat.dsl.checker import resolve_library
from parsat.ir.blocks import node_blocks
from parsat.ir.machine import Machine
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import build_example
from parsat.ir.pcg import PCG, StructureTable, pcg_roles, restated, weight_chains, weight_storage
from parsat.ir.recompute import BLOCKS, checkpoints
from parsat.search.solve import price_pcg

SIZES = {"blocks": 4, "batch": 8, "seq": 16, "hidden": 32, "heads": 4, "vocab": 64}


def fresh(pcg: PCG) -> PCG:
    """`pcg` as a new object, nothing worked out of it yet: each fact is then worked out from its own nodes."""
    return PCG(pcg.nodes, pcg.outputs, pcg.output_names, pcg.mesh, pcg.recompute, pcg.zero)


def facts(pcg: PCG, library) -> tuple:
    """Every structural fact the pricing, recomputation and step simulator read of a PCG."""
    return (dict(pcg_roles(pcg)), weight_chains(pcg), dict(node_blocks(pcg)), weight_storage(pcg),
            checkpoints(restated(pcg, pcg.zero, BLOCKS)), kept_values(pcg, library), regathered_values(pcg, library),
            dict(needs_gradient(pcg, library)), dict(reader_counts(pcg)), regathered(pcg, library),
            unkept(pcg, library), attention_views(pcg))


@pytest.mark.parametrize("name", ["llama", "gpt"])
@pytest.mark.parametrize("options", [dict(sequence=False, zero=0), dict(sequence=True, zero=3)])
def test_layouts_on_other_meshes_share_their_structure_and_its_facts(name, options):
    library = resolve_library(None)
    graph = build_example(name, SIZES, library).with_microbatches(2)
    kin: dict = {}
    first, second = (megatron_pcg(graph, library, mesh, 8, kin=kin, vocabulary_loss=True, **options)
                     for mesh in ((4, 2), (2, 4)))
    assert first is not None and second is not None and first.mesh != second.mesh
    assert second.structural is first.structural   # shared: without the table, each its own
    assert second == megatron_pcg(graph, library, (2, 4), 8, vocabulary_loss=True, **options)   # the layout alone
    # the facts the first works out, read by the second, are the ones the second works out alone
    assert facts(first, library) == facts(second, library) == facts(fresh(second), library)
    machine = Machine.resolve("h100x8").with_devices(8)
    for form in (second, restated(second, 1, BLOCKS)):
        alone = fresh(form)
        assert price_pcg(form, library, machine, microbatches=2) == price_pcg(alone, library, machine, microbatches=2)


def test_kin_graphs_laid_out_on_other_meshes_share_too():
    """A kin graph (another micro-batch count) laid out on a mesh no layout of the first graph took: built, and of
    the first's structure on its mesh, so it shares that layout's facts (a stage grid on 8 devices beside 16)."""
    library = resolve_library(None)
    graphs = [build_example("llama", {**SIZES, "batch": SIZES["batch"] // m}, library).with_microbatches(m)
              for m in (1, 2)]
    kin: dict = {}
    first = megatron_pcg(graphs[0], library, (4, 2), 8, kin=kin, reduce_at_once=True)
    second = megatron_pcg(graphs[1], library, (2, 2), 8, kin=kin, reduce_at_once=True)
    assert second.structural is first.structural
    assert facts(second, library) == facts(fresh(second), library)


def test_a_table_shares_only_the_same_structure():
    library = resolve_library(None)
    graph = build_example("gpt", SIZES, library).with_microbatches(2)
    plain, sequence = (megatron_pcg(graph, library, (2, 2), 8, sequence=s) for s in (False, True))
    table = StructureTable()
    assert table.shared(plain) is plain
    assert table.shared(sequence) is sequence and sequence.structural is not plain.structural   # another structure
    again = table.shared(fresh(plain))
    assert again is not plain and again == plain and again.structural is plain.structural
    with pytest.raises(ValueError):
        sequence.sharing(plain)
    renamed = list(plain.nodes)
    renamed[-1] = replace(renamed[-1], origin=renamed[-1].origin + "_other")
    with pytest.raises(ValueError):
        replace(plain, nodes=tuple(renamed)).sharing(plain)
    with pytest.raises(ValueError):
        replace(plain, outputs=plain.outputs[:-1] + (0,)).sharing(plain)
