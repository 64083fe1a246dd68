"""From a saturated e-graph to the cheapest PCG: price every e-node, extract, build the PCG.

The joint plan, the Megatron baseline (the same e-graph with some e-nodes
excluded) and both phases of the sequential baseline go through `solve`,
so every candidate is priced by one cost model and built one way.
`provenance.rules_used` then says which rules a plan needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from operator import attrgetter, itemgetter
from typing import Callable, Mapping, Sequence

from parsat.dsl.library import Library
from parsat.dsl.parallel_ops import PARALLEL_OPS
from parsat.cost.model import shards_state
from parsat.cost.pcg_tasks import needs_gradient, profile_for
from parsat.cost.ring_time import ring_shares, rings_run
from parsat.cost.saved import kept_values, regather_cover, regathered_values, runtime_regathers
from parsat.ir.costs import NodeCost
from parsat.ir.graph import Graph
from parsat.ir.machine import Machine
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import PCG, WEIGHT, WEIGHT_VALUE, Degrees, PNode, pcg_roles, restated
from parsat.ir.recompute import NONE
from parsat.egraph.encoding import PIN_SUFFIX
from parsat.search.extract import Extraction, NodeId, Pricer, dag_cost, extract, kept_classes, node_costs
from parsat.search.recompute import recomputed_enodes, recomputed_pcg_costs
from parsat.search.repeat import Repetition, RepeatError, conversions, copy_obligations, stamp, value_names, weigh
from parsat.egraph.runner import Limits
from parsat.egraph.saturate import SaturationResult
from parsat.egraph.snapshot import Kept, Snapshot, parallel_attrs


def solve(result: SaturationResult, graph: Graph, library: Library, machine: Machine, roots: Sequence[int],
          limits: Limits, free_input_placements: bool, exclude=None, pins: Mapping[str, Degrees] | None = None,
          costs: Mapping[NodeId, NodeCost] | None = None,
          repetition: Repetition | None = None, in_flight: int = 1,
          recompute: str = NONE, zero: int = 0,
          computed: dict | None = None, lean: bool = False) -> tuple[PCG, dict[int, NodeCost], Extraction]:
    """Extract from `result` (with `costs`, the e-nodes priced, when already known) and build the PCG.

    `in_flight` > 1 ranks memory with that many micro-batches' activations alive (a pipeline stage's), while
    the PCG's costs stay one micro-batch's, as every plan's are.

    With a `repetition`, `graph` is the searched blocks and the PCG that comes back the whole model's
    (`repeat.stamp`), priced node by node (RepeatError when the plan's blocks are not laid out alike).

    `recompute` is the activation-recomputation policy the plan runs with (`ir.recompute`), `zero` the ZeRO
    stage of its weights' state (`ir.pcg.PCG.zero`); `costs`, when given, must be priced under both (`price`).
    `computed`: compute operators' costs shared with the call's other pricers (`extract.Pricer`): the PCG priced
    here (a repeated plan's whole model, every grid point's) holds the operators the e-graph's pricing and the
    other extractions priced, which each extraction otherwise worked out again (bert-large:64: a third of every
    compute cost worked out was one worked out before). `lean`: `extract`'s, the joint extraction's."""
    if costs is None:
        costs = price(result, graph, library, machine, free_input_placements, pins, repetition, roots, recompute,
                      zero=zero)
    ranked = in_flight_costs(costs, in_flight)
    # a repeated model's copies read each other as block 1 reads block 0: what that obliges is priced with it
    obliged = copy_obligations(result.snapshot, result.classes) if repetition is not None else None
    extraction = extract(result.snapshot, ranked, roots, machine.memory_capacity, limits, exclude, lean, obliged)
    built = _built(result, extraction, graph, library, roots, repetition)
    pcg = restated(built.pcg, zero, recompute)
    if recompute != NONE and repetition is None:   # the PCG's own readers say what is kept (`search.recompute`)
        priced = built.priced(pcg, library, machine, free_input_placements, graph.microbatches, pins, computed)
        if priced is not None:
            return pcg, priced, extraction
    if repetition is not None:
        pcg = restated(built.stamped, zero, recompute)
        priced = built.priced(pcg, library, machine, free_input_placements, graph.microbatches, pins, computed)
        if priced is None:
            raise RepeatError("the repeated plan has a node the cost model cannot price")
        return pcg, priced, extraction
    ident = built.ident
    by_class = {ident[c]: costs[(c, i)] for c, i in extraction.choice.items()}
    # An e-node prices a partition of a weight as its storage, not knowing the weight's other readers, and a
    # class as kept for backward where any of its e-nodes' readers would keep it (`extract.kept_classes`, an
    # upper bound): the PCG's parallel nodes, and its compute nodes whose value the PCG's own readers keep
    # otherwise (`cost.saved.kept_values`), are priced again knowing them, so the plan's figures are what the
    # backend runs and what pricing its PCG gives.
    held_classes, held = kept_classes(result.snapshot, graph, library), kept_values(pcg, library)
    differs = {ident[c] for c in extraction.choice if (c in held_classes) != (ident[c] in held)}
    readers = price_pcg(pcg, library, machine, free_input_placements, graph.microbatches, pins,
                        only=lambda node: node.kind == "parallel" or node.id in differs, computed=computed)
    return pcg, {**by_class, **(readers or {})}, extraction


BUILT_KEPT = 4   # the last choices' PCGs `_built` keeps per e-graph (policies of one mesh extract the same choice)


@dataclass
class _Built:
    """An extraction's choice built (`pcg_from_extraction`), its repeated model's PCG (`repeat.stamp`, with a
    repetition), both without a recomputation policy or ZeRO stage, and the forms of the priced PCG priced so far:
    (machine, input placements free, micro-batches, pins) -> ZeRO stage -> `pcg_node_costs`. What the PCG is made
    of follows from the choice alone, and its forms' costs from their stage (`pcg_node_costs` reads nothing of a
    recomputation policy), so where another policy or grid point extracts a choice already built (llama-70b:64:
    14 of the 66 solves that found a plan, ZeRO 1 and 2 of one choice, keeping activations or recomputing, grid
    points whose restrictions leave the same plan), `solve` takes it, and its costs, or prices another stage's
    form from them (`restaged_node_costs`: the parallel nodes alone)."""

    pcg: PCG
    ident: dict[int, int]
    stamped: PCG | None
    raw: dict[tuple, dict[int, dict[int, NodeCost] | None]] = field(default_factory=dict)

    def priced(self, form: PCG, library: Library, machine: Machine, free_input_placements: bool, microbatches: int,
               pins: Mapping[str, Degrees] | None, computed: dict | None) -> dict[int, NodeCost] | None:
        """`price_pcg` of `form` (this choice's PCG or its stamp, `restated` with a stage and policy)."""
        stages = self.raw.setdefault((machine, free_input_placements, microbatches, tuple(sorted((pins or {}).items()))),
                                     {})
        if form.zero not in stages:
            known = next(((z, raw) for z, raw in stages.items() if raw is not None), None)
            stages[form.zero] = pcg_node_costs(form, library, machine, free_input_placements, microbatches, pins,
                                               computed=computed) if known is None else \
                restaged_node_costs(known[1], restated(form, known[0], form.recompute), form.zero, library, machine,
                                    free_input_placements, microbatches, pins, computed, form=form)
        raw = stages[form.zero]
        return recomputed_pcg_costs(form, raw) if raw is not None else None


def _built(result: SaturationResult, extraction: Extraction, graph: Graph, library: Library, roots: Sequence[int],
           repetition: Repetition | None) -> _Built:
    """`extraction`'s choice built as a PCG (and stamped into the whole model's, with a `repetition`: RepeatError
    where it cannot be), or the one built before for the same choice of the same e-graph, graph, library and
    repetition: the last BUILT_KEPT choices are kept with the snapshot (a bound: a llama-70b stage's stamped
    PCG holds ~5,000 nodes)."""
    owners = (result.classes, graph, library, repetition)
    kept = result.snapshot.derive(("solve._built", tuple(roots)), partial(Kept, BUILT_KEPT))
    key = tuple(sorted(extraction.choice.items()))
    found = kept.get(key, owners)
    if found is not None:
        return found
    pcg, ident = pcg_from_extraction(result, extraction, graph, library, roots, graph.outputs)
    stamped = None
    if repetition is not None:
        names = value_names(result.snapshot, result.classes)
        stamped = stamp(pcg, repetition, {ident[c]: name for c, name in names.items() if c in ident},
                        conversions(result.snapshot, names))
    built = _Built(pcg, ident, stamped)
    kept.put(key, owners, built)
    return built


def price(result: SaturationResult, graph: Graph, library: Library, machine: Machine, free_input_placements: bool,
          pins: Mapping[str, Degrees] | None, repetition: Repetition | None = None, roots: Sequence[int] = (),
          recompute: str = NONE, raw: Mapping[NodeId, NodeCost] | None = None, zero: int = 0) -> dict[NodeId, NodeCost]:
    """Every e-node priced (`raw`, when already priced without ZeRO: `node_costs`), as `recompute` runs it
    (`search.recompute`; `roots` are kept) with ZeRO stage `zero` (only the weights' gradient synchronisations
    are priced again, `cost.model.shards_state`); pinned inputs arrive in their placement (a pinned output is an
    extraction root). With a `repetition`, the repeated block's e-nodes count once per block they stand for
    (`repeat.weigh`)."""
    input_pins = {k: v for k, v in (pins or {}).items() if k not in graph.outputs}
    if raw is None:
        raw = node_costs(result.snapshot, graph, library, machine, free_input_placements, input_pins)
    # every e-node's cost is `_as_run` of its own raw (or ZeRO) cost alone: the raw costs as run are worked out once
    # per snapshot, roots, policy and repetition, and a ZeRO stage's few e-nodes as run laid over them
    base = _as_run_kept(raw, result.snapshot, roots, recompute, repetition)
    if not zero:
        return dict(base)
    zeroed = _zero_costs(result.snapshot, graph, library, machine, free_input_placements, input_pins, zero)
    return {**base, **_as_run(zeroed, result.snapshot, roots, recompute, repetition)}


def _as_run(costs: Mapping[NodeId, NodeCost], snapshot: Snapshot, roots: Sequence[int], recompute: str,
            repetition: Repetition | None) -> dict[NodeId, NodeCost]:
    """`costs` as `recompute` runs them (`recomputed_enodes`), with a repeated block's e-nodes counted once per block
    (`repeat.weigh`, with a `repetition`). Both map each e-node's cost alone (by its class's block, whether its
    class is kept, the snapshot's block count, whether it keeps the blocks a chain: the snapshot's and the
    roots'), and leave the e-nodes in `costs`' order (`weigh` drops some): so the map of a merged table
    (`{**a, **b}`) is the merge of the maps, value for value and key for key, which `price` reads."""
    costs = recomputed_enodes(costs, snapshot, roots, recompute)
    return weigh(costs, snapshot, repetition) if repetition is not None else costs


def _as_run_kept(raw: Mapping[NodeId, NodeCost], snapshot: Snapshot, roots: Sequence[int], recompute: str,
                 repetition: Repetition | None) -> Mapping[NodeId, NodeCost]:
    """`_as_run(raw, ...)`, worked out once per snapshot, roots and policy for the same `raw` and `repetition`
    objects (held, and checked by identity): the policies of one mesh (`mesh.policies`: keeping or recomputing,
    ZeRO 0, 1 and 2) each recomputed and weighed every e-node of its raw costs again (a two-axis llama-70b stage
    mesh: 15,000 e-nodes, five times), where a ZeRO stage changes a few hundred (`_zero_costs`). Shared: read
    it, never change it."""
    kept = snapshot.derive(("solve._as_run", tuple(roots), recompute), partial(Kept, 1))
    owners = (raw, repetition)
    found = kept.get("costs", owners)
    if found is None:
        found = _as_run(raw, snapshot, roots, recompute, repetition)
        kept.put("costs", owners, found)
    return found


def _zero_costs(snapshot: Snapshot, graph: Graph, library: Library, machine: Machine, free_input_placements: bool,
                input_pins: Mapping[str, Degrees], zero: int) -> dict[NodeId, NodeCost]:
    """The e-nodes ZeRO stage `zero` prices differently (`cost.model.shards_state`), priced under it: worked out
    once per snapshot, stage, input placements and pins for the same graph, library and machine objects (held,
    and checked by identity), as the policies of one mesh sharing a stage (keeping activations or recomputing
    blocks, `mesh.policies`) each priced them again. Shared: read it, never change it."""
    kept = snapshot.derive(("solve._zero_costs", zero, free_input_placements, tuple(sorted(input_pins.items()))),
                           partial(Kept, 1))
    owners = (graph, library, machine)
    found = kept.get("costs", owners)
    if found is not None:
        return found
    costs = node_costs(snapshot, graph, library, machine, free_input_placements, input_pins, zero,
                       only=lambda op, role: shards_state(op, role, zero))
    kept.put("costs", owners, costs)
    return costs


def price_pcg(pcg: PCG, library: Library, machine: Machine, free_input_placements: bool = True,
              microbatches: int = 1, pins: Mapping[str, Degrees] | None = None,
              only: Callable[[PNode], bool] | None = None, computed: dict | None = None) -> dict[int, NodeCost] | None:
    """Every PCG node (`only` those it accepts) priced by the same cost model as the e-nodes, on the PCG's mesh,
    per step of `microbatches` micro-batches (None if a node is not priceable); pinned inputs arrive in their
    layout. Unlike an e-node, a PCG node knows its readers: a partition of a weight that is not the weight's
    storage (`ir.pcg.weight_storage`, as the backend runs it) is priced as slicing it (`cost.parallel_cost`).
    `computed`: compute operators' costs shared with other pricers of `library` (`extract.Pricer`)."""
    raw = pcg_node_costs(pcg, library, machine, free_input_placements, microbatches, pins, only, computed)
    return recomputed_pcg_costs(pcg, raw) if raw is not None else None


def pcg_node_costs(pcg: PCG, library: Library, machine: Machine, free_input_placements: bool = True,
                   microbatches: int = 1, pins: Mapping[str, Degrees] | None = None,
                   only: Callable[[PNode], bool] | None = None,
                   computed: dict | None = None) -> dict[int, NodeCost] | None:
    """`price_pcg` before the PCG's recomputation policy is applied (`search.recompute.recomputed_pcg_costs`):
    what it reads of the PCG is its nodes, mesh and ZeRO stage, never `pcg.recompute`, so a PCG and its
    recomputing form share these costs (the independent grid prices a layout's forms from them).

    A node's cost is kept by its key (`_NodeKeys`): the nodes of a whole model's PCG repeat the same few, so each
    key is priced once, by the first node of it the loop prices (any node of a key gives the same cost: the key
    holds all the pricer reads of a node). The keys are the PCG's own (`_node_keys`), worked out once for the
    forms that share its `derived` table (`ir.pcg.restated`: its ZeRO stages and recomputation policies, which no
    key reads), so a restaged form (`restaged_node_costs`) or a layout priced again walks the nodes once more
    and prices only its distinct keys (llama-70b:64: 51 of 195 calls)."""
    if only is not None:
        return _node_costs_at(pcg, library, machine, free_input_placements, microbatches, pins, computed,
                              [at for at, node in enumerate(pcg.nodes) if only(node)])
    pricer, roles, keyed = _keyed(pcg, library, machine, free_input_placements, microbatches, pins, computed)
    keys, nodes = keyed.keys, pcg.nodes
    costs: list = [_UNPRICED] * len(keys)
    # each key priced by its first node, in the nodes' order (`_node_costs_at` over every node, less its look-ups)
    for slot, at in keyed.firsts:
        cost = costs[slot] = keyed.priced.get(slot, _UNPRICED)
        if cost is _UNPRICED:
            cost = costs[slot] = _price_keyed(pricer, pcg, nodes[at], roles, keys[slot])
        if cost is None:
            return None
    return dict(zip(keyed.ids, map(costs.__getitem__, keyed.slots)))


def _keyed(pcg: PCG, library: Library, machine: Machine, free_input_placements: bool, microbatches: int,
           pins: Mapping[str, Degrees] | None, computed: dict | None) -> tuple[Pricer, Mapping[int, str], "_NodeKeys"]:
    """What `pcg_node_costs` prices `pcg` with: its pricer, the PCG's roles and its `_NodeKeys`."""
    pricer = Pricer(library, machine, pcg.mesh, free_input_placements, pins, microbatches=microbatches, zero=pcg.zero,
                    computed=computed)
    roles = pcg_roles(pcg)
    return pricer, roles, _node_keys(pcg, library, machine, microbatches, pins, pricer, roles)


def _node_costs_at(pcg: PCG, library: Library, machine: Machine, free_input_placements: bool, microbatches: int,
                   pins: Mapping[str, Degrees] | None, computed: dict | None,
                   positions: Sequence[int]) -> dict[int, NodeCost] | None:
    """`pcg_node_costs` of the nodes at `positions` (ascending) alone, by id in the nodes' order: each key priced by
    the first of those nodes that holds it, None at the first that cannot be priced. A caller that knows which
    nodes it wants (`restaged_node_costs`: parallel nodes) walks those alone, not every node through a test."""
    pricer, roles, keyed = _keyed(pcg, library, machine, free_input_placements, microbatches, pins, computed)
    keys, nodes, slots = keyed.keys, pcg.nodes, keyed.slots
    costs: list = [_UNPRICED] * len(keys)
    out: dict[int, NodeCost] = {}
    for at in positions:
        node, slot = nodes[at], slots[at]
        cost = costs[slot]
        if cost is _UNPRICED:
            cost = costs[slot] = keyed.priced.get(slot, _UNPRICED)
            if cost is _UNPRICED:
                cost = costs[slot] = _price_keyed(pricer, pcg, node, roles, keys[slot])
        if cost is None:
            return None
        out[node.id] = cost
    return out


@dataclass(frozen=True)
class _NodeKeys:
    """A PCG's nodes by their pricing key (`pcg_node_costs`): `keys`, the distinct keys in the order the nodes
    first hold them, `slots[i]` the index in `keys` of node `i`'s (in the PCG's order), `ids[i]` node `i`'s id,
    `firsts` each slot a node holds with the position of its first node, in the nodes' order, and `priced`, the costs
    of keys priced while the keys were worked out (the readers of a re-gathered value, `_regather_covers`),
    by slot: all compute nodes, whose cost reads no ZeRO stage, mesh, input placement or pin
    (`extract.Pricer.price`: those reach only parallel nodes and leaves), so every form's pricer gives them alike.

    A node's key is (kind, operator, attributes, its kind number, its inputs' kind numbers (`_kinds`: shape, spread
    and role), whether a gradient flows, whether its value is kept, its re-gather's cover, whether it is kept
    whole, its ring's shares) and, for a leaf no pin names, `_UNPINNED_LEAF`: what the pricer reads of a node
    (`_price_node`), as `extract.node_costs` keeps e-nodes'. A key's facts (`_key_facts`) read the nodes, the
    operator library, the machine, the micro-batch count (a cover is priced per step) and the pins, never the
    ZeRO stage nor the recomputation policy: kept per PCG `derived` table by those (`_node_keys`)."""

    slots: tuple[int, ...]
    keys: tuple[tuple, ...]
    ids: tuple[int, ...]
    firsts: tuple[tuple[int, int], ...]
    priced: Mapping[int, NodeCost | None]


def _node_keys(pcg: PCG, library: Library, machine: Machine, microbatches: int, pins: Mapping[str, Degrees] | None,
               pricer: Pricer, roles: Mapping[int, str]) -> _NodeKeys:
    """The PCG's `_NodeKeys` for `machine`, `microbatches` and `pins`, worked out once per `derived` table and
    library (`PCG.derive`; `pricer`, the caller's, prices the covers' readers the first time: compute nodes,
    which any pricer of this library, machine and micro-batch count prices alike). Shared: read it."""
    input_pins = pins or {}
    key = ("solve._node_keys", machine, microbatches, tuple(sorted(input_pins.items())))
    return pcg.derive(key, library, lambda: _work_out_keys(pcg, library, machine, input_pins, pricer, roles))


def _work_out_keys(pcg: PCG, library: Library, machine: Machine, input_pins: Mapping[str, Degrees], pricer: Pricer,
                   roles: Mapping[int, str]) -> _NodeKeys:
    """`_node_keys` worked out: the kinds, the covers (their readers priced by key, each key once), then every
    node's key. What the key loop reads per node is looked up once: the tables' methods bound, a ring's or a
    cover's look-up only where the PCG has any (it runs over every node of ~145 PCGs of ~5,000 nodes on
    llama-70b:64)."""
    flows = needs_gradient(pcg, library)   # a parallel operator whose source takes no gradient runs no backward
    held = kept_values(pcg, library)       # the values some backward reads (`cost.saved`)
    again = regathered_values(pcg, library)   # of those, the gathers only products' backward reads
    rings = rings_run(pcg, profile_for(machine).overlap)   # priced as the step simulator runs them
    kind = _kinds(pcg, roles)
    kind_of = kind.__getitem__
    slot_of: dict[tuple, int] = {}
    keys: list[tuple] = []
    priced: dict[int, NodeCost | None] = {}

    def slot(key: tuple) -> int:
        found = slot_of.get(key)
        if found is None:
            found = slot_of[key] = len(keys)
            keys.append(key)
        return found

    def price_reader(reader: PNode) -> NodeCost | None:   # a product reading a re-gathered value, by its key
        at = slot((reader.kind, reader.op, reader.attrs, kind[reader.id], tuple(map(kind_of, reader.inputs)), True,
                   reader.id in held, 0.0, False, ()))
        if at not in priced:
            priced[at] = _price_keyed(pricer, pcg, reader, roles, keys[at])
        return priced[at]

    covers = _regather_covers(pcg, pricer, roles, held, again, price_reader) if runtime_regathers(machine) else {}
    slots = []
    add, find = slots.append, slot_of.get
    for node in pcg.nodes:
        ident, parallel = node.id, node.kind == "parallel"
        if node.kind == "leaf" and node.op not in input_pins:
            key = _UNPINNED_LEAF   # the pricer reads of a leaf only whether it is pinned (`Pricer.price`)
        else:
            kept = ident in held
            # a gather kept whole, not gathered again (`cost.saved.regathers`): another backward than a product's
            # reads it
            key = (node.kind, node.op, node.attrs, kind[ident], tuple(map(kind_of, node.inputs)),
                   not parallel or flows[node.inputs[0]], kept, covers.get(ident, 0.0) if covers else 0.0,
                   parallel and kept and ident not in again, ring_shares(rings, ident) if rings else ())
        at = find(key)   # `slot`, written out: it runs once per node
        if at is None:
            at = slot_of[key] = len(keys)
            keys.append(key)
        add(at)
    # each slot's first node: over the nodes backwards, a slot's last position written is its first
    first = dict(zip(reversed(slots), range(len(slots) - 1, -1, -1)))
    return _NodeKeys(tuple(slots), tuple(keys), pcg.ids,
                     tuple(sorted(first.items(), key=itemgetter(1))), priced)


def _price_keyed(pricer: Pricer, pcg: PCG, node: PNode, roles: Mapping[int, str], key: tuple) -> NodeCost | None:
    """`_price_node` of `node` with the facts its key (`_NodeKeys`) holds: whether a gradient flows, kept, cover,
    kept whole, ring shares; an unpinned leaf's key holds none, and the pricer reads of such a leaf nothing else
    than that no pin names it (`extract.Pricer.price`)."""
    facts = (True,) if key is _UNPINNED_LEAF else key[5:]
    return _price_node(pricer, pcg, node, [pcg.node(i) for i in node.inputs], roles, *facts)


def restaged_node_costs(raw: Mapping[int, NodeCost], pcg: PCG, zero: int, library: Library, machine: Machine,
                        free_input_placements: bool = True, microbatches: int = 1,
                        pins: Mapping[str, Degrees] | None = None,
                        computed: dict | None = None, form: PCG | None = None) -> dict[int, NodeCost] | None:
    """`pcg_node_costs` of `pcg` with ZeRO stage `zero` (`replace(pcg, zero=zero)`), from `raw`, those of `pcg`
    itself (every node priced). The stage reaches a node's cost only through `cost.model.shards_state` (the
    pricer hands it to parallel operators alone, `extract.Pricer`; compute nodes and leaves never read it), so
    only the parallel nodes it holds for under either stage are priced again: the rest are the same nodes, read
    by the same deterministic pricing, whatever the stage. `form`: that PCG, made by the caller so that it
    shares what `pcg` works out from its nodes (`ir.pcg.restated`: its readers, storage chains and
    derived facts, which read neither the stage nor the recomputation policy), rather than working them out
    again (a llama-70b stage layout's took most of this function's time)."""
    roles = pcg_roles(pcg)
    form = replace(pcg, zero=zero) if form is None else form
    if (form.nodes, form.outputs, form.mesh, form.zero) != (pcg.nodes, pcg.outputs, pcg.mesh, zero):
        raise ValueError("restaged_node_costs: `form` must be `pcg` with ZeRO stage `zero`")
    nodes, now = pcg.nodes, pcg.zero
    resharded = []   # the parallel nodes the stage reaches under either stage (`shards_state`), in the nodes' order
    for at in _parallel_positions(pcg):
        node = nodes[at]
        role = roles.get(node.inputs[0], "")
        if shards_state(node.op, role, now) or shards_state(node.op, role, zero):
            resharded.append(at)
    again = _node_costs_at(form, library, machine, free_input_placements, microbatches, pins, computed, resharded)
    return None if again is None else {**raw, **again}


def _parallel_positions(pcg: PCG) -> tuple[int, ...]:
    """The positions of the PCG's parallel nodes, ascending: read from the nodes' kinds alone (`ir.pcg.STRUCTURE`),
    so kept in `PCG.structural`, shared by its forms and by PCGs of its structure (`PCG.sharing`)."""
    return pcg.derive("solve._parallel_positions", None,
                      lambda: tuple(at for at, node in enumerate(pcg.nodes) if node.kind == "parallel"),
                      structural=True)


_UNPRICED = object()   # `price_pcg`: no node of this kind priced yet
_UNPINNED_LEAF = ("leaf",)   # `pcg_node_costs`' key of every leaf no pin names: all cost nothing


def _kinds(pcg: PCG, roles: Mapping[int, str]) -> dict[int, int]:
    """Node id -> the number of its (shape, spread, role), numbered in the PCG's order (`pcg_node_costs`). A PCG's
    nodes share a few shape and spread objects (~40 spreads among ~5,000 nodes of a llama-70b stage plan: its
    blocks are copies), so a node is looked up by those objects' identities first, and by their values (a spread
    hashes in Python) only the first time an object is met: objects held by the PCG's nodes live through the call,
    so an identity names one object, and equal objects get the same number either way."""
    by_value: dict[tuple, int] = {}
    by_object: dict[tuple, int] = {}
    number, seen, role_of = by_value.setdefault, by_object.get, roles.get
    kind: dict[int, int] = {}
    for node in pcg.nodes:
        ident, shape, degrees = node.id, node.shape, node.degrees
        role = role_of(ident, "")
        found = seen((id(shape), id(degrees), role))
        if found is None:
            found = by_object[(id(shape), id(degrees), role)] = number((shape, degrees, role), len(by_value))
        kind[ident] = found
    return kind


def _regather_covers(pcg: PCG, pricer: Pricer, roles: Mapping[int, str], held: frozenset[int],
                     again: frozenset[int], price_reader: Callable[[PNode], NodeCost | None] | None = None
                     ) -> dict[int, float]:
    """Each gather the runtime gathers again for backward (`again`, `cost.saved.regathered_values`) -> the seconds
    per micro-batch of its readers' input gradients, which run beside that all-gather (`cost.saved.regather_cover`):
    a PCG node knows its readers, so its second all-gather is charged what they leave exposed
    (`cost.model.parallel_cost`). `price_reader`: a reader's `_price_node` with a gradient, kept where `held`
    says, no cover, ring or whole value (`pcg_node_costs` gives one that prices each key once); each reader
    priced so by default."""
    if price_reader is None:
        def price_reader(reader: PNode) -> NodeCost | None:
            return _price_node(pricer, pcg, reader, [pcg.node(i) for i in reader.inputs], roles, True,
                               reader.id in held)
    covers: dict[int, float] = {}
    readers_of = pcg.readers_of if again else {}
    for node in pcg.nodes:
        if node.id not in again:
            continue
        grads = []
        # `readers_of` lists a reader once per operand it reads the value as: each reader once, every such operand
        for reader in dict.fromkeys(r for r in readers_of.get(node.id, ()) if r.kind == "op"):
            cost = price_reader(reader)
            grads += [cost.input_grad_s[p] if cost is not None and p < len(cost.input_grad_s) else 0.0
                      for p, i in enumerate(reader.inputs) if i == node.id]
        covers[node.id] = regather_cover(grads)
    return covers


def _price_node(pricer: Pricer, pcg: PCG, node: PNode, children: Sequence[PNode], roles: Mapping[int, str],
                gradient: bool, kept: bool = True, cover: float = 0.0, whole: bool = False,
                ring: tuple[float, ...] = ()) -> NodeCost | None:
    """One PCG node priced (`extract.Pricer.price`), its inputs `children`; `kept`: whether some backward reads
    its value (`cost.saved.kept_values`); `cover`: its readers' input gradients, where it is gathered again for
    backward (`_regather_covers`); `whole`: kept, and not gathered again where it is a gather (a backward other
    than a product's reads it, `cost.saved.regathered_values`). A view on a weight's storage chain (role WEIGHT,
    `ir.pcg.pcg_roles`) costs nothing: the weight is stored as the partition after it, which is priced as the
    weight's storage, and a view runs no kernel. `ring`: a ring attention's shares (`cost.ring_time.ring_shares`)."""
    if node.kind == "op" and roles.get(node.id) == WEIGHT:
        return NodeCost()
    axis = node.axis(pcg.mesh) if node.kind == "parallel" else None
    attrs = (node.op,) if node.kind == "leaf" else tuple(v for k, v in node.attrs
                                                          if node.kind != "parallel" or k in ("dim", "to_dim"))
    op = node.op if node.kind != "leaf" else "leaf"
    return pricer.price(op, attrs, node.shape, node.degrees, tuple(c.shape for c in children),
                        tuple(c.degrees for c in children), tuple(roles.get(c.id, "") for c in children), axis,
                        stores=roles.get(node.id) != WEIGHT_VALUE, gradient=gradient, kept=kept, cover=cover,
                        kept_whole=whole, ring=ring)


def in_flight_costs(costs: Mapping, in_flight: int) -> Mapping:
    """`costs` with `in_flight` micro-batches' activations alive at once (a pipeline stage's warm-up): what a
    stage's extraction ranks memory by, an additive estimate (what fits is judged as the pipeline runs the plan:
    `search.fit`)."""
    return costs if in_flight == 1 else {k: c.with_in_flight(in_flight) for k, c in costs.items()}


def pcg_from_extraction(result: SaturationResult, extraction: Extraction, graph: Graph, library: Library,
                        roots: Sequence[int], output_names: Sequence[str]) -> tuple[PCG, dict[int, int]]:
    """The chosen e-nodes as a PCG (topological order); also e-class -> PCG id."""
    snapshot = result.snapshot
    info = dag_cost(snapshot, {(c, i): NodeCost() for c, i in extraction.choice.items()}, extraction.choice, roots)
    order = info[2]
    names_of: dict[int, str] = {}
    for name, cid in result.classes.items():
        if not name.startswith("pin:"):
            names_of.setdefault(cid, name)
    roles = {leaf.name: leaf.role for leaf in graph.leaves}
    ident: dict[int, int] = {}
    nodes: list[PNode] = []
    mesh = snapshot.mesh or Mesh(())
    where_is = library.rule_locations
    # a node's rules, in library order, worked out once per set of makers: most e-nodes share theirs with others
    # (every block's alike), and each look-up read the whole library (bert-large:64: 19,638 look-ups)
    shown_of: dict[frozenset[str], tuple[str, ...]] = {}
    for cid in order:
        enode = snapshot.classes[cid][extraction.choice[cid]]
        inputs = tuple(ident[ch] for ch in enode.children)
        shape, degrees, where = snapshot.shape[cid], snapshot.degrees[cid], snapshot.placement[cid]
        if enode.op == "leaf":
            name = enode.attrs[0].removesuffix(PIN_SUFFIX)
            node = PNode(len(nodes), "leaf", name, (), (), shape, degrees, roles.get(name, "input"), name, where)
        elif enode.op in PARALLEL_OPS:
            node = PNode(len(nodes), "parallel", enode.op, inputs, parallel_attrs(enode, mesh), shape, degrees,
                         origin=names_of.get(cid, ""), placement=where)
        else:
            op = library.ops[enode.op]
            attrs = tuple((p.name, float(v) if p.type.kind == "real" else int(v))
                          for p, v in zip(op.attr_params, enode.attrs))
            node = PNode(len(nodes), "op", enode.op, inputs, attrs, shape, degrees, origin=names_of.get(cid, ""),
                         placement=where)
        made = snapshot.rules_at(cid, enode)
        rules = shown_of.get(made)
        if rules is None:   # the library's order, as `Library.rule_locations` lists them (see below)
            rules = shown_of[made] = tuple(shown for name, shown in where_is.items() if name in made) if made else ()
        node = replace(node, rules=rules) if rules else node
        ident[cid] = node.id
        nodes.append(node)
    return PCG(tuple(nodes), tuple(ident[r] for r in roots), tuple(output_names), mesh), ident


