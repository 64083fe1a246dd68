"""What a lower bound over a stage mesh's e-graph can say at the search of every stage mesh, and what the e-graph holds.

    PYTHONPATH=. .venv/bin/python benchmarks/stage_mesh_bounds.py llama-70b:64 [--machine a100x8] [--shares 0.8,0.65]

Runs `parsat.optimize` on the case (as `models_bench.py optimize` does) with `mesh._saturate` and `mesh.search_mesh`
wrapped where they are looked up. For each mesh of the search of every stage mesh that its scout did not search
(`StageFit.scouted_meshes`), after the e-graph is saturated and priced, it prints:

* `lp`: a lower bound of the pipelined floor (`StageFit.floor_s`) of every plan extraction can return from the
  e-graph, by an LP relaxation of extraction (HiGHS) over a quotient of the e-graph that has no cycle (below),
  and the CPU seconds the bound took;
* `keep-all`: plans that keep every activation, extracted (`solve`, lean) at ZeRO stages 0, 1 and 2 with the stage
  machine's memory scaled by each of `--shares`: their floor, whether they fit as the pipeline runs them
  (`step.memory`), whether they can be placed (`derive_placements`), and their pipelined steps in 1F1B and
  interleaved (`StagePricer.pipelined` on the pipeline's machine);
* after the mesh's search: the floors of the joint plan and the restricted grid point it extracted, and the bar.

Why the LP is over a quotient. Extraction's constraints (a root chosen, an e-node's children chosen with it) admit
cyclic choices: `combine(partition(x))` holds x in x's own class, so an LP over the e-graph as it stands supports
every value by a loop of parallel operators that computes nothing (its optimum is ~0). In any acyclic choice,
though, the first chosen class (in the choice's topological order) of any set S of classes has a chosen e-node
whose children all lie outside S (they are chosen and earlier). So with S the strongly connected components of the
values (`value_order`: classes joined by parallel e-nodes, and values algebra makes from each other), every S the
choice needs has an "entry" e-node chosen, whose children's components are needed in turn: an LP over the entry
e-nodes (one constraint per needed component) is a relaxation of every acyclic extraction. Each entry's coefficient
is a lower bound of what `floor_s` counts for the PCG node it becomes: its forward and backward seconds (as priced
on the e-graph, the same `compute_time` the PCG's pricing reads; recomputation only adds), times the copies the
stamped model makes of it where every choice puts it in the repeated block (`lo == hi == REPEATED`, below), and only
where every choice makes it read both inputs and weights (`free_nodes` leaves out nodes made from one kind of leaf);
0 elsewhere. The bound is sound and weak: a component that a cycle of algebra joins is entered once however many of
its values a plan computes.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace

import numpy as np

import parsat
import parsat.search.mesh as mesh
from parsat.cost.pipeline import FLOOR_MARGIN, StagePricer
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.egraph.encoding import PIN_SUFFIX
from parsat.ir.blocks import OUTSIDE, block_of
from parsat.ir.costs import totals
from parsat.ir.pcg_placement import derive_placements
from parsat.ir.placement import PlacementError
from parsat.ir.plan import Plan
from parsat.search.baselines import Candidate
from parsat.search.repeat import REPEATED, SEARCHED_BLOCKS, chain_nodes
from parsat.search.solve import price, solve
from parsat.search.value_order import value_order


def class_facts(step, sat) -> tuple[dict, dict, dict, int]:
    """Per class: the kinds of leaf every choice's node reads (bits, a greatest fixpoint: sound for every acyclic
    choice by induction over it), and the least and greatest block `ir.blocks.node_blocks` can give its compute
    node (the same first-pass rule: the latest of its name's block and its inputs' blocks)."""
    snapshot = sat.result.snapshot
    roles = {leaf.name: leaf.role for leaf in step.searched.leaves}
    names: dict[int, str] = {}
    for name, cid in sat.result.classes.items():   # `pcg_from_extraction`'s origin: the first name of the class
        if not name.startswith("pin:"):
            names.setdefault(cid, name)
    bit: dict[str, int] = {}
    every = -1
    kinds, lo, hi, leaves = {}, {}, {}, {}
    for cid, nodes in snapshot.classes.items():
        for node in nodes:
            if node.op == "leaf":
                leaves[cid] = str(node.attrs[0]).removesuffix(PIN_SUFFIX)
    for cid in snapshot.classes:
        if cid in leaves:
            kinds[cid] = bit.setdefault(roles.get(leaves[cid], "input") or "input", 1 << len(bit))
            lo[cid] = hi[cid] = block_of(leaves[cid])
        else:
            kinds[cid], lo[cid], hi[cid] = every, SEARCHED_BLOCKS - 1, block_of(names.get(cid, ""))
    changed = True
    while changed:
        changed = False
        for cid, nodes in snapshot.classes.items():
            if cid in leaves:
                continue
            must, least, most = every, None, hi[cid]
            for node in nodes:
                reads, latest = 0, OUTSIDE
                for child in node.children:
                    reads |= kinds[child]
                    latest = max(latest, lo[child])
                    most = max(most, hi[child])
                must &= reads
                least = latest if least is None else min(least, latest)
            least = max(block_of(names.get(cid, "")), OUTSIDE if least is None else least)
            if (must, least, most) != (kinds[cid], lo[cid], hi[cid]):
                kinds[cid], lo[cid], hi[cid], changed = must, min(lo[cid], least), most, True
    return kinds, lo, hi, len(bit)


def lp_bound(step, sat) -> tuple[float, int]:
    """The module docstring's LP: a lower bound of `floor_s` over every plan extraction can return; its entries."""
    import highspy

    snapshot, raw, rep = sat.result.snapshot, sat.raw, step.repetition
    chained = chain_nodes(snapshot) if rep is not None else None
    kinds, lo, hi, nbits = class_facts(step, sat)
    mixed = lambda k: k == -1 or bin(k & ((1 << nbits) - 1)).count("1") >= 2
    part = value_order(snapshot)
    entries = [nid for nid, kids in snapshot.kids.items() if nid in raw and (chained is None or nid in chained)
               and all(part[ch] != part[nid[0]] for ch in kids)]
    copies = rep.copies if rep is not None else 1

    def coefficient(nid) -> float:
        cid, index = nid
        node = snapshot.classes[cid][index]
        if node.op == "leaf" or node.op in PARALLEL_OPS or not mixed(kinds[cid]):
            return 0.0
        cost = raw[nid]
        return (cost.forward_s + cost.backward_s) * (copies if lo[cid] == hi[cid] == REPEATED else 1)

    by_part: dict[int, list[int]] = {}
    for k, (cid, _i) in enumerate(entries):
        by_part.setdefault(part[cid], []).append(k)
    start, index, value, lower = [0], [], [], []

    def row(cols, least: float) -> None:   # least <= sum of value * column
        for col, v in cols:
            index.append(col)
            value.append(v)
        start.append(len(index))
        lower.append(least)

    for p in sorted(set(part[r] for r in sat.roots)):   # a root's component is entered
        row([(c, 1.0) for c in by_part.get(p, [])], 1.0)
    for k, (cid, i) in enumerate(entries):   # an entry chosen: each of its children's components is entered
        for p in sorted(set(part[ch] for ch in snapshot.kids[(cid, i)])):
            row([(c, 1.0) for c in by_part.get(p, [])] + [(k, -1.0)], 0.0)
    n = len(entries)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, len(lower)
    lp.col_cost_ = np.array([coefficient(nid) for nid in entries])
    lp.col_lower_, lp.col_upper_ = np.zeros(n), np.ones(n)
    lp.row_lower_, lp.row_upper_ = np.array(lower), np.full(len(lower), math.inf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.array(start, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(value)
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, len(lower)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.passModel(lp)
    h.run()
    total = h.getInfo().objective_function_value
    return total / step.stage.degree * (1.0 - FLOOR_MARGIN), n


def keep_all_plans(step, sat, shares) -> None:
    """Plans keeping every activation at ZeRO 0, 1, 2, extracted with the stage machine's memory scaled by `shares`."""
    fit, rep = step.stage, step.repetition
    request = step.request
    for zero in (0, 1, 2):
        priced = price(sat.result, step.searched, request.library, step.machine, request.free_input_placements,
                       step.input_pins, rep, sat.roots, "none", sat.raw, zero=zero)
        for share in shares:
            machine = replace(step.machine, memory_capacity=step.machine.memory_capacity * share)
            try:
                pcg, costs, found = solve(sat.result, step.searched, request.library, machine, sat.roots,
                                          request.limits, request.free_input_placements, None, pins=step.input_pins,
                                          costs=priced, repetition=rep, in_flight=step.in_flight,
                                          computed=request.prices, zero=zero, lean=True)
            except Exception as err:   # no plan under this share: said, and on to the next
                print(f"  keep-all zero {zero} memory x{share}: {type(err).__name__}: {str(err)[:120]}")
                continue
            candidate = Candidate("joint", pcg, costs, totals(costs, step.machine))
            try:
                derive_placements(pcg, request.library.ops)
                placed = "placed"
            except PlacementError as err:
                placed = f"not placed ({str(err)[:60]})"
            steps = []
            if step.memory.fits(candidate):
                pricer = StagePricer(Plan(step.graph, step.machine, step.devices, pcg, costs, candidate.totals),
                                     fit.machine, memo=fit.memo)
                for schedule, chunks in (("1f1b", 1), ("interleaved", 2)):
                    try:
                        plan = pricer.pipelined(fit.degree, schedule, chunks)
                        steps.append(f"{schedule} {plan.totals.time_s:.3f} s at {plan.totals.peak_memory_bytes / 2**30:.1f}"
                                     f" GiB ({'fits' if plan.totals.fits(fit.machine) else 'does not fit'})")
                    except Exception as err:
                        steps.append(f"{schedule}: {str(err)[:60]}")
            print(f"  keep-all zero {zero} memory x{share}: {found.method}, floor {fit.floor_s(pcg, costs):.4f} s, "
                  f"as run {step.memory.needs(candidate) / 2**30:.1f} GiB "
                  f"({'fits' if step.memory.fits(candidate) else 'does not fit'}), {placed}; {'; '.join(steps)}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", help="NAME:DEVICES")
    parser.add_argument("--machine", default="h100x8")
    parser.add_argument("--shares", default="0.8,0.65", help="memory shares to extract the keep-all plans at")
    args = parser.parse_args(argv)
    name, devices = args.case.split(":")
    shares = [float(s) for s in args.shares.split(",") if s]
    saturate, search_mesh = mesh._saturate, mesh.search_mesh

    def new_mesh(step, where) -> bool:
        return step.stage is not None and step.stage.scouted_meshes > 0 and len(where.axes) > 1

    def saturated(step, where, pins, clock):
        sat = saturate(step, where, pins, clock)
        if new_mesh(step, where):
            t = time.process_time()
            bound, entries = lp_bound(step, sat)
            print(f"mesh {where} (search of every stage mesh, {sat.result.enodes} e-nodes): lp bound {bound:.4f} s "
                  f"over {entries} entry e-nodes, {time.process_time() - t:.2f} CPU s; bar {step.stage.bar_s:.4f} s, "
                  f"grid bar {step.stage.grid_bar_s}", flush=True)
            keep_all_plans(step, sat, shares)
        return sat

    def searched(step, where, config, pins, clock):
        found = search_mesh(step, where, config, pins, clock)
        if new_mesh(step, where):
            for role in ("joint", "grid"):
                candidate = getattr(found, role)
                if candidate is not None:
                    print(f"  extracted {role}: floor {step.stage.floor_s(candidate.pcg, candidate.costs):.4f} s",
                          flush=True)
        return found

    mesh._saturate, mesh.search_mesh = saturated, searched
    start = time.process_time()
    plan = parsat.optimize(name, machine=args.machine, devices=int(devices))
    print(f"plan {plan.totals.time_s * 1e3:.3f} ms; {time.process_time() - start:.1f} CPU s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
