"""The independent grid runs once per (graph, machine, devices, stage) key: once per micro-batch count of the
unstaged search and once per pipeline (degree, micro-batch count) stage search (issue 28). What its calls share
across those keys (`ir.megatron._Kin`: one graph's memo for every call that lays it out, the placement
analysis's answers for every graph and mesh; `cost.saved.kept`'s operator answers kept by name) must give
exactly what each key computes afresh, in a request of its own."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.cost.saved import ALIASING_PARALLEL, INPUT, kept, kept_values, through_aliases
from parsat.dsl.checker import resolve_library
from parsat.dsl.gradient import backward_reads, gradient_free, is_alias
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.ir.machine import Machine
from parsat.ir.megatron import megatron_pcg
from parsat.ir.models import build_example
from parsat.ir.pcg import pcg_roles
from parsat.search.baselines import grid_families, independent_grid

SIZES = {"blocks": 2, "hidden": 256, "heads": 8, "batch": 64, "seq": 128, "vocab": 1024}


def _points(families) -> list:
    return [point for _place, point in sorted((found for family in families for found in family),
                                              key=lambda found: found[0])]


def _same_points(got, fresh) -> None:
    assert [p.config for p in got] == [p.config for p in fresh]
    for a, b in zip(got, fresh):
        assert a.pcg == b.pcg and (a.pcg.zero, a.pcg.recompute) == (b.pcg.zero, b.pcg.recompute)
        assert dict(a.costs) == dict(b.costs)
        assert a.totals == b.totals


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_grids_of_several_keys_sharing_their_work_are_each_key_s_grid_alone(name):
    """The keys a search asks in turn (micro-batch counts 1, 2, 4 on 16 devices, then stage grids on 8 and 4
    devices of a machine with more memory per device), all through one request's `kin` and compute prices: every
    point (its configuration, PCG, node costs and totals) is the one a fresh request for that key alone gives."""
    library = resolve_library(None)
    base = Machine.preset("h100x8")
    keys = [(m, base.with_devices(16), 16) for m in (1, 2, 4)]
    keys += [(m, replace(base.with_devices(devices), memory_capacity=base.memory_capacity * 16 // devices), devices)
             for m, devices in ((2, 8), (4, 4))]   # as `pipeline_search._stage_machine` makes a stage's
    graphs = {m: build_example(name, SIZES, library).with_microbatches(m) for m in (1, 2, 4)}
    kin: dict = {}
    computed: dict = {}
    for m, machine, devices in keys:
        shared = _points(grid_families(graphs[m], library, machine, True, devices, computed=computed, kin=kin))
        fresh = independent_grid(build_example(name, SIZES, library).with_microbatches(m), library, machine, True,
                                 devices)
        assert len(fresh) >= 4
        _same_points(shared, fresh)
    found = kin["kin"]
    assert found.placements and len(found.memos) == len(graphs)   # the work was shared, not redone


def test_layouts_on_other_meshes_sharing_one_memo_are_the_layouts_built_alone():
    """One graph laid out on meshes of 16, 8 and 4 devices (the unstaged grid's and two stage grids') through one
    `kin`, data parallelism included: each layout is the one built with nothing shared, whichever mesh came first."""
    library = resolve_library(None)
    graph = build_example("gpt", SIZES, library).with_microbatches(2)
    wanted = [((devices // tp, tp), seq, zero) for devices in (16, 8, 4) for tp in (1, 2, 4) if devices // tp >= 1
              for seq in ((False, True) if tp > 1 else (False,)) for zero in (0, 3)]
    alone = {want: megatron_pcg(graph, library, want[0], 8, zero=want[2], sequence=want[1]) for want in wanted}
    assert sum(p is not None for p in alone.values()) >= 20
    for order in (wanted, wanted[::-1]):
        kin: dict = {}
        got = {want: megatron_pcg(graph, library, want[0], 8, zero=want[2], sequence=want[1], cache={}, kin=kin)
               for want in order}
        assert got == alone


def _kept_naively(readers, library, roles) -> frozenset:
    """`kept` as it was written before its answers were kept by operator name: each declaration asked anew (the
    alias closure after it is the same code, `through_aliases`)."""
    direct: set = set()
    aliases: dict = {}
    for made, op, reads in readers:
        decl = library.ops.get(op)
        if op in ALIASING_PARALLEL:   # a replicated or gathered activation stands for its source
            if reads and not roles.get(reads[0], ""):
                aliases.setdefault(made, []).append(reads[0])
            continue
        if decl is not None and op not in PARALLEL_OPS and is_alias(decl):   # a view: its operand's storage
            names = [p.name for p in decl.tensor_params]
            aliases.setdefault(made, []).append(reads[names.index(decl.body.tensor)])
            continue
        if decl is None or op in PARALLEL_OPS:
            continue
        names = [p.name for p in decl.tensor_params]
        free = gradient_free(decl)
        needs = frozenset(n for n, v in zip(names, reads) if roles.get(v, "") != INPUT and n not in free)
        wanted = backward_reads(decl, needs)
        direct.update(v for n, v in zip(names, reads) if n in wanted)
    return through_aliases(direct, aliases)


@pytest.mark.parametrize("name", ["gpt", "llama", "bert"])
def test_kept_values_with_answers_kept_by_operator_are_those_asked_anew(name):
    """`cost.saved.kept` keeps each operator's declaration and backward reads by its name and needs: the values
    kept are those asking each node's declaration anew gives, on layouts where inputs (no gradient), weights and
    activations read the same operators (so the needs differ per node of one operator)."""
    library = resolve_library(None)
    graph = build_example(name, SIZES, library)
    for shape, seq in (((8, 1), False), ((4, 2), True), ((2, 4), False)):
        pcg = megatron_pcg(graph, library, shape, 8, sequence=seq)
        roles = pcg_roles(pcg)
        readers = [(n.id, n.op, n.inputs) for n in pcg.nodes if n.kind != "leaf"]
        naive = _kept_naively(readers, library, roles)
        assert kept(readers, library, roles) == naive == kept_values(pcg, library)
        assert naive


@pytest.mark.parametrize("microbatches", [1, 4])
def test_forms_reading_their_layout_s_floor_pass_floor_as_fresh_ones(microbatches):
    """`pcg_tasks.step_floor` keeps a micro-batch's part of the floor in the PCG's derived facts, which a layout's
    restated forms (another ZeRO stage, recomputing blocks: `ir.pcg.restated`) share: the layout's floor
    without its plan's part, then each form's whole floor (from the kept part, as the grid asks for them), are
    the floors of fresh PCGs with nothing worked out, to the bit."""
    from parsat.cost.pcg_tasks import OpTimes, step_floor
    from parsat.ir.recompute import BLOCKS
    from parsat.ir.pcg import restated

    library = resolve_library(None)
    machine = Machine.preset("h100x8").with_devices(8)
    graph = build_example("llama", SIZES, library).with_microbatches(microbatches)
    for shape, seq, zero in (((8, 1), False, 0), ((4, 2), True, 0), ((2, 4), False, 3), ((4, 2), True, 3)):
        layout = megatron_pcg(graph, library, shape, 8, zero=zero, sequence=seq)
        times = OpTimes(library, machine)
        bare = step_floor(layout, machine, times, microbatches, plan=False)
        assert any(isinstance(key[0], tuple) and key[0][0] == "floor_pass" for key in layout.derived)   # kept, for the forms to read
        assert bare == step_floor(replace(layout), machine, OpTimes(library, machine), microbatches, plan=False)
        for stage, policy in ((layout.zero, "none"), (1, "none"), (2, BLOCKS), (layout.zero, BLOCKS)):
            form = restated(layout, stage, policy)
            fresh = replace(layout, zero=stage, recompute=policy)
            got = step_floor(form, machine, times, microbatches)
            assert got == step_floor(fresh, machine, OpTimes(library, machine), microbatches)
            assert got >= bare
