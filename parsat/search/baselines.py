"""The baselines every plan is compared with, priced by the same cost model.

* data parallelism: the textbook PCG (`ir.data_parallel`), priced node by
  node (`solve.price_pcg`);
* expert parallelism, for a graph with a mixture of experts' batched
  matmul: data parallelism with the experts split and tokens all-to-all'd
  to them (`ir.expert_parallel`), priced likewise;
* Megatron-style tensor parallelism: the joint e-graph with the e-nodes it
  forbids excluded (`megatron_excluded`): graph inputs never split, matrices
  never replicated or read whole;
* the sequential approach: algebraic rules saturated and extracted first,
  on one device, then parallel rules only (`sequential`);
* the best of a Megatron-style grid (`best_grid`): on every mesh the search
  tries, data x tensor axes, sequence parallelism on or off, ZeRO-3 or not
  (`strategies`), each a restriction of the same e-graph; and the same grid
  built directly from the graph (`independent_grid`: `ir.megatron`), which
  does not depend on how far saturation got.

Each is a `Candidate` (a valid PCG with its costs), so `optimize` can keep
the cheapest of them and the joint plan, and the backend can run any of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Sequence

from parsat.cost.pcg_tasks import profile_for
from parsat.dsl import ast
from parsat.dsl.checker import is_parallel_rule
from parsat.dsl.library import Library
from parsat.dsl.parallel_ops import ALL_TO_ALL, PARALLEL_OPS, PARTITION, REPLICATE
from parsat.ir.costs import NodeCost, Totals, totals
from parsat.ir.data_parallel import data_parallel_pcg
from parsat.ir.expert_parallel import expert_parallel_pcg
from parsat.ir.errors import GraphError
from parsat.ir.blocks import has_blocks
from parsat.ir.graph import Graph, GraphBuilder
from parsat.ir.machine import Machine
from parsat.ir.megatron import ZERO_LEVELS, megatron_pcg
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import PCG, Degrees, restated
from parsat.ir.placement import Placement
from parsat.ir.recompute import BLOCKS, NONE
from parsat.ir.errors import OptimizeError
from parsat.search.extract import ExtractionError, NodeId, leaf_roles
from parsat.egraph.program import MeshCaches
from parsat.search.repeat import RepeatError, Repetition
from parsat.egraph.runner import STOP_INTERRUPTED, Limits
from parsat.egraph.saturate import SaturationResult, saturate
from parsat.egraph.snapshot import Snapshot
from parsat.search.recompute import recomputed_pcg_costs
from parsat.search.solve import pcg_node_costs, price_pcg, restaged_node_costs, solve
from parsat.search.strategies import grid, grid_excluded, shared_weights

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Candidate:
    """A plan `optimize` may return: the joint extraction's or a baseline's PCG, with its costs."""

    name: str
    pcg: PCG
    costs: Mapping[int, NodeCost]
    totals: Totals
    config: Mapping | None = None    # best_grid: the configuration it chose (`strategies.Config.spelled`)


def data_parallel(graph: Graph, library: Library, machine: Machine, free_input_placements: bool,
                  devices: int, computed: dict | None = None, kin: dict | None = None) -> Candidate | None:
    """The data-parallel PCG priced; None where it does not apply (a batch that does not split, an operator
    that refuses the spread). `computed`: compute costs shared with other pricers (`extract.Pricer`). `kin`: the
    layouts of the call's grids (`grid_families`' `kin`), where the PCG is laid out as the independent grid lays out
    its tp 1 ZeRO-0 point (`megatron_pcg` on dp = `devices` x tp 1: the same `data_parallel_pcg`, or that layout of
    a kin graph rescaled, which is the same PCG) and kept there: the step's grid of this graph and devices then
    takes this PCG rather than building it again, and the grids of its kin graphs rescale it (llama-70b:64 built
    data parallelism of three graphs twice, once here and once in the grid, and four once where a rescale did)."""
    pcg = megatron_pcg(graph, library, (devices, 1), machine.devices_per_node, kin=kin) if kin is not None else \
        data_parallel_pcg(graph, library, devices, machine.devices_per_node)
    costs = price_pcg(pcg, library, machine, free_input_placements, graph.microbatches, computed=computed) \
        if pcg is not None else None
    if costs is None:
        return None
    return Candidate("data_parallel", pcg, costs, totals(costs, machine))


def expert_parallel(graph: Graph, library: Library, machine: Machine, free_input_placements: bool,
                    devices: int, computed: dict | None = None) -> Candidate | None:
    """The expert-parallel PCG priced; None where it does not apply (no experts' batched matmul, an operator that
    refuses the layout). `computed`: compute costs shared with other pricers (`extract.Pricer`)."""
    pcg = expert_parallel_pcg(graph, library, devices, machine.devices_per_node)
    costs = price_pcg(pcg, library, machine, free_input_placements, graph.microbatches, computed=computed) \
        if pcg is not None else None
    if costs is None:
        return None
    return Candidate("expert_parallel", pcg, costs, totals(costs, machine))


def independent_grid(graph: Graph, library: Library, machine: Machine, free_input_placements: bool,
                     devices: int, fits: Callable[[Candidate], bool] | None = None) -> list[Candidate]:
    """Every point of the Megatron-LM / FSDP grid built directly from the graph (`ir.megatron.megatron_pcg`, and
    `ir.data_parallel` where tp is 1) and priced by the same cost model: dp x tp = `devices` with tp 1 or a
    divisor of a node's devices (tensor parallelism stays inside a node), ZeRO 0 or 3 (where dp > 1), sequence
    parallelism off or on (where tp > 1), the loss Megatron-LM's vocabulary-parallel cross-entropy (the logits
    never gathered; `megatron_pcg(vocabulary_loss=True)`: no point gathers them beside it, which would build
    and price every tensor-parallel family twice). A point that does not fit in memory (`fits`: as the step runs it,
    `search.fit`; on `machine` by default) is priced again with its weights' state sharded (ZeRO-1,
    Megatron-LM's distributed optimizer, where dp > 1), then recomputing blocks (`ir.recompute`) too, as
    Megatron-LM runs large models. Each is a `best_grid` candidate whose `config`
    spells its point; the caller simulates their steps and keeps the best (`search.mesh.rank`). A point the
    graph cannot be laid out as is not in the grid. In the order of tp, then ZeRO, then sequence parallelism."""
    return [point for _place, point in sorted(
        (found for family in grid_families(graph, library, machine, free_input_placements, devices, fits)
         for found in family), key=lambda found: found[0])]


def grid_families(graph: Graph, library: Library, machine: Machine, free_input_placements: bool, devices: int,
                  fits: Callable[[Candidate], bool] | None = None,
                  skip: Callable[[PCG], bool] | None = None,
                  state_zero: int = 0, computed: dict | None = None,
                  order: Callable[[PCG], float | None] | None = None,
                  kin: dict | None = None, recompute: str | None = None,
                  lean_first: bool = False, reduce_at_once: bool = False,
                  priced: Mapping[int, tuple[PCG, dict]] | None = None) -> Iterator[list[tuple[int, Candidate]]]:
    """`independent_grid`'s points, one (dp, tp, sequence parallelism) layout at a time, each with its place in
    `independent_grid`'s order: the layout with ZeRO 0, then 3, each with its fallbacks.

    A family's points lay out every value but the weights' alike: ZeRO-3 stores a weight split on the data
    axis and all-gathers it into the placement its readers take, which data parallelism replicates it into
    (`megatron_pcg`, `data_parallel_pcg`), and ZeRO-1 and recomputation change how state is held and what
    runs again, not the layout. So a bound on their steps that reads only those values' operators (the
    layout's step floor, without the plan's own updates and recomputation: `cost.pcg_tasks.step_floor`) is
    one for the whole family, and `skip(pcg)`, shown the family's first layout, leaves the family out (the
    rest are not even built) where it says so (a fused projection read apart, HF GPT-2's `c_attn`, is laid out
    head by head at every ZeRO level alike: `megatron.heads_ordered_layout`). A generator: `skip` is asked when
    the caller asks for the
    family, after the ones before it, so it can read what they gave (the bar of a branch and bound).
    `order(pcg)` (such a bound of the family's first layout; None where there is none): the families come in
    its ascending order (those without one first, then ties in the grid's order), every first layout built
    before the first family is given, so that the bar falls as early as it can; without it, in the grid's order.
    `state_zero` (1 or 2: a pinned `--degrees zero=N`): the points that store their weights whole (ZeRO 0) hold
    their state so, as the pin asks (Megatron's distributed optimizer is the layout with ZeRO-1), rather than
    only where they would not fit otherwise. `recompute` (a pinned `--recompute`): every point runs that policy, as
    the pin asks (SC'21's Megatron-LM rows recompute every block), rather than keeping activations wherever they
    fit: a point with another policy does not keep the pin (`step.keeps_pins`), so the pinned grid had none of
    the layouts that fit without recomputing (sc21-18.4b: its sequence-parallel layout). Unpinned, on a machine whose execution overlaps ZeRO-1's gathers
    with the next forward (`pcg_tasks.profile_for`: GPUs), a layout that fits with ZeRO 0 is also a point with
    ZeRO-1. `computed`: compute nodes' costs shared with the caller's other pricers (`extract.Pricer`; by
    default the grid's own). `kin`: the layouts of other graphs' grids, which this one takes rescaled where its
    graph differs from theirs in sizes the layout cannot tell apart (`megatron_pcg`). `lean_first` (not with
    `skip` or `order`): the points one (layout, ZeRO level) at a time, the layouts that split most first (tp
    descending, sequence parallelism on before off) and ZeRO-3 before 0, for a caller that asks whether any
    point fits (`step.a_grid_point_fits`): each point is worked out from its layout and ZeRO level alone (the
    caches shared give what building anew gives), so every order yields the same points, and the leanest come
    first where memory is short. `reduce_at_once`: every layout reduces each contraction's partial sum on the tensor
    axis where it is made, as Megatron-LM does (`megatron_pcg`): a pipeline stage's grid, whose points are cut into
    stages, so that no value crosses a cut as a partial sum (`ir.pipeline.LayerMap.cuttable`). `priced`: node costs
    the caller worked out (`id(pcg)` -> (that PCG, its `solve.pcg_node_costs` with `computed`), as a stage grid's
    layout floor prices each family's first layout: `step._stage_layout_floor`), which the point laid out as that
    PCG reads rather than pricing it again."""
    per_node = machine.devices_per_node
    shared: dict = {}   # what every point's layout of the graph reuses (`megatron_pcg`'s cache)

    def lay_out(layout: _Layout, zero: int) -> PCG | None:
        return megatron_pcg(graph, library, (layout.dp, layout.tp), per_node, zero=zero, sequence=layout.sequence,
                            cache=shared, kin=kin, vocabulary_loss=True, reduce_at_once=reduce_at_once,
                            heads_ordered=True)

    layouts = _grid_layouts(devices, per_node)
    point = _GridPricer(graph, library, machine, free_input_placements, fits or (
        lambda candidate: candidate.totals.fits(machine)), state_zero, computed, recompute, priced)
    if lean_first:
        for layout in sorted(layouts, key=lambda layout: (-layout.tp, not layout.sequence)):
            # laid out in the grid's order (ZeRO 0 first), so that the ZeRO-3 layout is derived from the ZeRO-0
            # build (`megatron._built_layout`) as the other orders derive it, not built again; given leanest first
            pcgs = [lay_out(layout, zero) for zero in layout.zeros]
            for z in reversed(range(len(layout.zeros))):
                yield [(layout.place + z * layout.sequences, found)
                       for found in point.priced(pcgs[z], layout, layout.zeros[z])]
        return
    firsts: list = [None] * len(layouts)   # each family's first layout, where `order` asks for it up front
    if order is not None:
        firsts = [lay_out(layout, layout.zeros[0]) for layout in layouts]
        bounds = [order(pcg) if pcg is not None else None for pcg in firsts]
        visit = sorted(range(len(layouts)), key=lambda k: (-math.inf if bounds[k] is None else bounds[k], k))
        layouts, firsts = [layouts[k] for k in visit], [firsts[k] for k in visit]
    for layout, first in zip(layouts, firsts):
        family = []
        for z, zero in enumerate(layout.zeros):
            pcg = first if z == 0 and first is not None else lay_out(layout, zero)
            if z == 0 and pcg is not None and skip is not None and skip(pcg):
                break
            family += [(layout.place + z * layout.sequences, found) for found in point.priced(pcg, layout, zero)]
        yield family


@dataclass(frozen=True)
class _Layout:
    """A (dp, tp, sequence parallelism) layout of the grid: the ZeRO levels it is laid out with, and the place of
    its first point in `independent_grid`'s order (a point with ZeRO level index z is `sequences` x z later)."""

    dp: int
    tp: int
    sequence: bool
    zeros: tuple[int, ...]
    sequences: int
    place: int


def _grid_layouts(devices: int, per_node: int) -> list[_Layout]:
    """The grid's layouts in its order: tp 1 or a divisor of a node's devices that divides `devices`, then
    sequence parallelism off and on (where tp > 1); ZeRO 0 and 3 where dp > 1."""
    out, place = [], 0
    for tp in [t for t in range(1, min(devices, per_node) + 1) if per_node % t == 0 and devices % t == 0]:
        dp = devices // tp
        zeros, sequences = (tuple(ZERO_LEVELS) if dp > 1 else (0,)), ((False, True) if tp > 1 else (False,))
        out += [_Layout(dp, tp, sequence, zeros, len(sequences), place + s) for s, sequence in enumerate(sequences)]
        place += len(zeros) * len(sequences)
    return out


class _GridPricer:
    """A grid layout's points priced (`_fitting_point`), with the ZeRO-1 point beside a ZeRO-0 one that fits where
    the machine overlaps ZeRO-1's gathers (`grid_families`)."""

    def __init__(self, graph: Graph, library: Library, machine: Machine, free_input_placements: bool,
                 fits: Callable[[Candidate], bool], state_zero: int, computed: dict | None,
                 recompute: str | None = None, priced: Mapping[int, tuple[PCG, dict]] | None = None):
        self.graph, self.library, self.machine, self.free = graph, library, machine, free_input_placements
        self.fits, self.state_zero, self.recompute = fits, state_zero, recompute
        self.known = priced if priced is not None else {}   # by the PCG's id (`grid_families`' `priced`)
        # where ZeRO-1's gathers of the updated shards run during the next forward (Megatron's distributed
        # optimizer with overlap_param_gather), a layout that fits with its state whole may still run faster with
        # it sharded: half the gradient bytes reduced, the update on a shard; so both are points, the simulation
        # chooses
        self.overlapped = profile_for(machine).overlap_param_gather
        self.computed = {} if computed is None else computed   # the compute nodes' costs every pricing reuses
        self.blocks = has_blocks(leaf.name for leaf in graph.leaves)

    def priced(self, pcg: PCG | None, layout: _Layout, zero: int) -> list[Candidate]:
        """The points of `layout` laid out with `zero` (`pcg`): none, one, or one and its ZeRO-1 twin. The PCG is
        priced once; its forms with the weights' state sharded or recomputing blocks from those costs
        (`_Forms`)."""
        if pcg is None:
            return []
        if zero == 0 and self.state_zero and layout.dp > 1:
            pcg, zero = restated(pcg, self.state_zero, pcg.recompute), self.state_zero
        if self.recompute is not None and pcg.recompute != self.recompute:   # a pinned policy, the only one tried
            pcg = restated(pcg, pcg.zero, self.recompute)
        forms = _Forms(pcg, self)
        config = {"dp": layout.dp, "tp": layout.tp, "sp": layout.sequence, "zero": zero,
                  "microbatches": self.graph.microbatches}
        if pcg.recompute != NONE:
            config["recompute"] = pcg.recompute
        point = _fitting_point(forms, config, self.fits, self.blocks and self.recompute is None)
        if point is None:
            return []
        if not (self.overlapped and point.config["zero"] == 0 and layout.dp > 1):
            return [point]
        sharded = forms.point(1, point.pcg.recompute, {**point.config, "zero": 1})
        return [point] + ([sharded] if sharded is not None else [])


class _Forms:
    """One layout's PCG and its forms that differ from it only in the ZeRO stage of the weights' state or the
    recomputation policy, each priced as `solve.price_pcg` prices it: the PCG's node costs worked out once per
    stage (`solve.pcg_node_costs`; another stage's from them, `solve.restaged_node_costs`: only the nodes whose
    cost reads the stage priced again), the recomputation policy applied after (`recompute.recomputed_pcg_costs`,
    the one thing of a PCG's costs that reads it). The same figures as pricing each form afresh."""

    def __init__(self, pcg: PCG, grid: _GridPricer):
        self.pcg, self.grid = pcg, grid
        self.raw: dict[int, dict | None] = {}

    def node_costs(self, zero: int) -> dict | None:
        """The node costs (before recomputation) of the PCG with ZeRO stage `zero`."""
        known = self.grid.known.get(id(self.pcg))
        if zero not in self.raw and zero == self.pcg.zero and known is not None and known[0] is self.pcg:
            self.raw[zero] = known[1]   # what `pcg_node_costs` below would give: the same PCG, priced alike
        if zero not in self.raw:
            g = self.grid
            args = (g.library, g.machine, g.free, g.graph.microbatches)
            base = self.node_costs(self.pcg.zero) if zero != self.pcg.zero else None
            self.raw[zero] = restaged_node_costs(base, self.pcg, zero, *args, computed=g.computed,
                                                 form=restated(self.pcg, zero, self.pcg.recompute)) \
                if base is not None else pcg_node_costs(restated(self.pcg, zero, self.pcg.recompute), *args,
                                                         computed=g.computed)
        return self.raw[zero]

    def point(self, zero: int, recompute: str, config: dict) -> Candidate | None:
        """The form with `zero` and `recompute` as a `best_grid` candidate; None where it cannot be priced."""
        pcg = self.pcg if (zero, recompute) == (self.pcg.zero, self.pcg.recompute) else \
            restated(self.pcg, zero, recompute)
        raw = self.node_costs(zero)
        if raw is None:
            return None
        costs = recomputed_pcg_costs(pcg, raw)
        return Candidate("best_grid", pcg, costs, totals(costs, self.grid.machine), config)


def _fitting_point(forms: _Forms, config: dict, fits: Callable[[Candidate], bool], blocks: bool) -> Candidate | None:
    """A grid point priced; where it does not fit, priced again with ZeRO-1 (dp > 1), then recomputing blocks."""
    zero, recompute = forms.pcg.zero, forms.pcg.recompute
    point = forms.point(zero, recompute, config)
    if point is not None and not fits(point) and config["zero"] == 0 and config["dp"] > 1:
        zero, config = 1, {**config, "zero": 1}   # Megatron's distributed optimizer
        point = forms.point(zero, recompute, config) or point
    if point is not None and not fits(point) and blocks:
        point = forms.point(zero, BLOCKS, {**config, "recompute": BLOCKS}) or point
    return point


def megatron_excluded(snapshot: Snapshot, roles: Mapping[int, str]) -> Callable[[NodeId], bool]:
    """The e-nodes tensor parallelism forbids: inputs never split, matrices never replicated or read whole, no
    all-to-all (Megatron-LM moves no shard between dims). The function reads the snapshot's classes and shapes,
    not the snapshot: the passes it excludes from are kept with the snapshot by its identity
    (`extract._time_ranked`), and holding the snapshot would make that a reference cycle, left to the cyclic
    collector (`search.collector`)."""
    inputs = {c for c, r in roles.items() if r == "input"}
    weights = {c for c, r in roles.items() if r == "weight"}
    classes, shape = snapshot.classes, snapshot.shape

    def excluded(nid: NodeId) -> bool:
        node = classes[nid[0]][nid[1]]
        if node.op == PARTITION:
            return node.children[0] in inputs
        if node.op == REPLICATE:
            return node.children[0] in weights and len(shape[node.children[0]]) >= 2
        if node.op == ALL_TO_ALL:
            return True
        if node.op in PARALLEL_OPS or node.op == "leaf":
            return False
        return any(ch in weights and len(shape[ch]) >= 2 for ch in node.children)

    return excluded


def pcg_to_graph(pcg: PCG, graph: Graph, library: Library, drop_parallel: bool = False) -> Graph:
    """A whole (unparallelised) PCG as a computation graph: the sequential baseline's middle step.

    With `drop_parallel`, any PCG: its parallel operators are left out (they change how a value is spread,
    never the value), which gives the algebraic form a plan computes, e.g. to price it on one device.
    """
    builder = GraphBuilder(library, name=graph.name)
    handles = {}
    used_names = set()
    for node in pcg.nodes:
        if node.kind == "leaf":
            handles[node.id] = builder.leaf(node.op, node.shape, node.role or "input")
            used_names.add(node.op)
            continue
        if node.kind == "parallel":
            if not drop_parallel:
                raise OptimizeError("internal: the algebraic-only plan contains a parallel operator")
            handles[node.id] = handles[node.inputs[0]]
            continue
        name = node.origin if node.origin and node.origin not in used_names else None
        handles[node.id] = builder.op(node.op, *[handles[i] for i in node.inputs], name=name, **dict(node.attrs))
        used_names.add(handles[node.id].name)
    builder.output(*[handles[i] for i in pcg.outputs])
    return builder.build().with_microbatches(graph.microbatches)


def sequential(graph: Graph, library: Library, rules: Sequence[ast.RuleDecl], mesh: Mesh, limits: Limits,
               machine: Machine, pins: Mapping[str, Placement], input_pins: Mapping[str, Degrees], free_input_placements: bool,
               say: Progress, caches: MeshCaches | None = None,
               repetition: Repetition | None = None, computed: dict | None = None) -> Candidate | None:
    """Algebraic rules saturated and extracted first (on one device), then parallel rules only, on `mesh`
    (`computed`: compute costs shared with other pricers, `extract.Pricer`).
    Ctrl-C inside either saturation (which egglog's run absorbs, stop reason `interrupted`) is raised again as
    KeyboardInterrupt: the caller ends the call's search, as it does wherever else Ctrl-C lands."""
    algebraic = [r for r in rules if not is_parallel_rule(r)]
    parallel = [r for r in rules if is_parallel_rule(r)]
    try:
        first = _uninterrupted(saturate(graph, library, algebraic, 1, limits, None, rulesets=("alg",),
                                        caches=caches))
        roots = [first.classes[n] for n in graph.outputs]
        one = machine.with_devices(1)
        pcg, _c, _e = solve(first, graph, library, one, roots, limits, free_input_placements, computed=computed)
        middle = pcg_to_graph(pcg, graph, library)
        if any(n not in middle.shapes() for n in pins) or middle.outputs != graph.outputs:
            say("sequential baseline: none (the algebraic rewrite renamed a pinned tensor)")
            return None
        second = _uninterrupted(saturate(middle, library, parallel, mesh, limits, pins, rulesets=("par",),
                                         caches=caches))
        roots = [second.classes[f"pin:{n}"] if n in pins else second.classes[n] for n in middle.outputs]
        spcg, scosts, _ = solve(second, middle, library, machine, roots, limits, free_input_placements, pins=input_pins,
                                repetition=repetition, computed=computed)
    except (ExtractionError, GraphError, OptimizeError, RepeatError) as err:
        say(f"sequential baseline: none ({err})")
        return None
    return Candidate("sequential", spcg, scosts, totals(scosts, machine))


def _uninterrupted(result: SaturationResult) -> SaturationResult:
    """`result`, or KeyboardInterrupt again when Ctrl-C ended it (`runner.STOP_INTERRUPTED`)."""
    if result.stop == STOP_INTERRUPTED:
        raise KeyboardInterrupt
    return result


GRID_ILP_NODES = 200   # each grid point's ILP (branch-and-bound nodes): the grid has several points per mesh


def best_grid(result: SaturationResult, graph: Graph, library: Library, machine: Machine, roots: Sequence[int],
              limits: Limits, free_input_placements: bool, priced: Mapping[NodeId, NodeCost],
              input_pins: Mapping[str, Degrees], repetition: Repetition | None = None,
              recompute: str = NONE, zero: int = 0,
              fits: Callable[[Candidate], bool] | None = None, computed: dict | None = None) -> Candidate | None:
    """The best Megatron-style configuration on this mesh's e-graph (`strategies.grid`: data x tensor axes,
    sequence parallelism on or off, ZeRO-3 or not), priced by the same cost model (`priced`: under the
    activation-recomputation policy `recompute` and ZeRO stage `zero` of the joint plan's policy, as Megatron
    runs large models), the fastest that fits (`fits`: as the step runs it, `search.fit`; on `machine` by
    default); its configuration spelled out. `computed`: compute costs shared with other pricers (`extract.Pricer`)."""
    fits = fits or (lambda candidate: candidate.totals.fits(machine))
    mesh = result.snapshot.mesh or Mesh(())
    roles = leaf_roles(result.snapshot, graph)
    shared = shared_weights(graph, result.classes)   # one layout per parameter, as torch stores it
    best: Candidate | None = None
    unfit = []

    def keep(config, pcg: PCG, costs) -> None:
        nonlocal best
        spelled = {**config.spelled(mesh, graph.microbatches), **({"recompute": recompute} if recompute != NONE else {})}
        if zero and not config.zero3:
            spelled["zero"] = zero
        found = Candidate("best_grid", pcg, costs, totals(costs, machine), spelled)
        if best is None or _better(found, best, fits):
            best = found

    configs = grid(mesh)
    # each point's excluded e-nodes: the e-graph's verdicts worked out once for the points that differ in sequence
    # parallelism and ZeRO-3 alone (`strategies.grid_excluded`)
    for config, excluded in zip(configs, grid_excluded(result.snapshot, roles, configs, shared=shared)):
        try:
            keep(config, *solve(result, graph, library, machine, roots,
                                replace(limits, ilp_nodes=min(limits.ilp_nodes, GRID_ILP_NODES)), free_input_placements,
                                excluded, pins=input_pins, costs=priced, repetition=repetition,
                                recompute=recompute, zero=zero, computed=computed)[:2])
        except ExtractionError:
            unfit.append((config, excluded))
        except RepeatError:
            continue
    if best is None:
        # no configuration fits: the grid still says what its fastest one would take and need (greedy passes)
        roomy = replace(machine, memory_capacity=math.inf)
        for config, excluded in unfit:
            try:
                keep(config, *solve(result, graph, library, roomy, roots, replace(limits, ilp_seconds=0.0),
                                    free_input_placements, excluded, pins=input_pins, costs=priced, repetition=repetition,
                                    recompute=recompute, zero=zero, computed=computed)[:2])
            except (ExtractionError, RepeatError):
                continue
    return best


def _better(a: Candidate, b: Candidate, fits: Callable[[Candidate], bool]) -> bool:
    """Whether `a` ranks before `b`: one that fits first, then the faster."""
    return (not fits(a), a.totals.time_s) < (not fits(b), b.totals.time_s)
