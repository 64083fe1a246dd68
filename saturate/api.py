"""`optimize(graph, machine=..., rules=..., limits=...) -> Plan`: the joint search and its baselines.

1. load the rules (only those the verifier PROVED, unless told otherwise);
2. saturate the graph with algebraic and parallel rules together, within
   limits;
3. price every e-node with the cost model and extract the cheapest plan
   that fits in memory;
4. compute the baselines with the same cost model: data parallelism only,
   the sequential approach (algebraic rules first, then parallel rules),
   and Megatron-style tensor parallelism (graph inputs never split);
5. the best feasible plan wins: the joint plan unless a baseline's PCG
   (each is a valid PCG, kept in the plan so a backend can run it) is
   strictly cheaper, which the plan then says (`extraction.chosen`).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.checker import is_parallel_rule
from parsat.dsl.instantiate import InstantiationError
from parsat.dsl.library import Library
from parsat.dsl.placement import PlacementError
from parsat.dsl.spread import infer_compute
from parsat.saturate.cost import NodeCost, Totals, totals
from parsat.saturate.egglog_compile import PIN_SUFFIX, Snapshot
from parsat.saturate.extract import Extraction, ExtractionError, NodeId, Pricer, dag_cost, extract, leaf_roles, node_costs
from parsat.saturate.graph import Graph, GraphBuilder, GraphError, instance_for
from parsat.saturate.machine import Machine
from parsat.saturate.pcg import PARALLEL, PCG, Layout, PNode
from parsat.saturate.pcg_layout import lay_out
from parsat.saturate.plan import JOINT, BaselinePlan, Plan
from parsat.saturate.saturate import Limits, SaturationResult, saturate


class OptimizeError(Exception):
    """Why no plan could be made; the message is for the user."""


Progress = Callable[[str], None]


# ------------------------------------------------------------------------ inputs


def resolve_library(rules) -> Library:
    """A `Library`, paths of `.rule` files/folders, or None for the shipped rules."""
    if isinstance(rules, Library):
        return rules
    from parsat.dsl.checker import load_checked

    if rules is None:
        return load_checked(None)
    if isinstance(rules, (str, os.PathLike)):
        rules = [rules]
    return load_checked(list(rules))


def resolve_graph(graph, library: Library, sizes: Mapping[str, int] | None = None) -> Graph:
    """A Graph, a graph JSON path, or a built-in example name."""
    if isinstance(graph, Graph):
        return graph
    from parsat.saturate.models import EXAMPLES, build_example

    if isinstance(graph, str) and graph in EXAMPLES:
        return build_example(graph, sizes, library)
    if sizes:
        raise GraphError("--set sizes only apply to built-in examples")
    if isinstance(graph, (str, os.PathLike)) and os.path.exists(graph):
        return Graph.load(graph, library)
    raise GraphError(f"'{graph}' is neither a graph JSON file nor a built-in example "
                     f"(examples: {', '.join(EXAMPLES)})")


def proved_rules(library: Library, allow_unverified: bool | None) -> tuple[list[ast.RuleDecl], str]:
    """The rules saturation may use, and a note on how they were chosen.

    With `allow_unverified` True every rule is used. Otherwise the verifier's
    verdicts (cached on disk by the verifier) decide: PROVED rules, and
    BOUNDED ones restricted to the ranks they were proved for (a `where` on
    their groups' lengths, `dsl.typecheck.rank_bounded`). If the verifier
    cannot be imported and `allow_unverified` is None, every rule is used
    and the note says so; with False that is an error.
    """
    rules = list(library.rules)
    if allow_unverified:
        return rules, "all rules used (--allow-unverified)"
    try:
        from parsat.verifier.api import verify_library
        from parsat.verifier.cache import VerdictCache
    except ImportError as err:
        if allow_unverified is None:
            return rules, f"verifier not available ({err}); all rules used unverified"
        raise OptimizeError(f"the verifier is not available ({err}); pass --allow-unverified to use rules "
                            "without proofs") from None
    from parsat.dsl.typecheck import rank_bounded

    report = verify_library(library, cache=VerdictCache(), jobs=max(1, min(os.cpu_count() or 1, 8)))
    if report.errors:
        raise OptimizeError("the verifier could not check some rules:\n" + "\n".join(report.errors))
    verdicts = {v.name: v for v in report.verdicts}
    kept, bounded = [], []
    for rule in rules:
        verdict = verdicts.get(rule.name)
        if verdict is None or not verdict.usable:
            continue
        if verdict.max_rank is not None:
            kept.append(rank_bounded(rule, verdict.max_rank))
            bounded.append(f"{rule.name} (ranks up to {verdict.max_rank})")
        else:
            kept.append(rule)
    dropped = [r.name for r in rules if r.name not in verdicts or not verdicts[r.name].usable]
    note = f"{len(kept)} proved rules used"
    if bounded:
        note += f", {len(bounded)} of them only at the ranks they were proved for: {', '.join(bounded[:10])}" + (
            " ..." if len(bounded) > 10 else "")
    if dropped:
        note += f"; {len(dropped)} not proved and left out: {', '.join(dropped[:20])}" + (" ..." if len(dropped) > 20 else "")
    return kept, note


# ---------------------------------------------------------------------- the PCG


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
    for cid in order:
        enode = snapshot.classes[cid][extraction.choice[cid]]
        inputs = tuple(ident[ch] for ch in enode.children)
        shape, layout = snapshot.shape[cid], snapshot.layout[cid]
        if enode.op == "leaf":
            name = enode.attrs[0].removesuffix(PIN_SUFFIX)
            node = PNode(len(nodes), "leaf", name, (), (), shape, layout, roles.get(name, "input"), name)
        elif enode.op in PARALLEL:
            keys = ("dim", "degree") if enode.op in ("partition", "combine") else ("degree",)
            node = PNode(len(nodes), "parallel", enode.op, inputs, tuple(zip(keys, enode.attrs)), shape, layout,
                         origin=names_of.get(cid, ""))
        else:
            op = library.ops[enode.op]
            attrs = tuple((p.name, float(v) if p.type.kind == "real" else int(v))
                          for p, v in zip(op.attr_params, enode.attrs))
            node = PNode(len(nodes), "op", enode.op, inputs, attrs, shape, layout, origin=names_of.get(cid, ""))
        ident[cid] = node.id
        nodes.append(node)
    return PCG(tuple(nodes), tuple(ident[r] for r in roots), tuple(output_names)), ident


def price_pcg(pcg: PCG, library: Library, machine: Machine, free_input_layouts: bool = True,
              devices: int | None = None) -> dict[int, NodeCost] | None:
    """Every PCG node priced by the same cost model as the e-nodes (None if a node is not priceable).

    `devices` defaults to the largest piece count in the PCG.
    """
    pricer = Pricer(library, machine, free_input_layouts, devices or pcg.max_pieces)
    by_id = {n.id: n for n in pcg.nodes}
    out: dict[int, NodeCost] = {}
    for node in pcg.nodes:
        children = [by_id[i] for i in node.inputs]
        attrs = tuple(v for _k, v in node.attrs)
        op = node.op if node.kind != "leaf" else "leaf"
        cost = pricer.price(op, attrs, node.shape, node.layout, tuple(c.shape for c in children),
                            tuple(c.layout for c in children), tuple(c.role for c in children))
        if cost is None:
            return None
        out[node.id] = cost
    return out


def pcg_to_graph(pcg: PCG, graph: Graph, library: Library) -> Graph:
    """A whole (unparallelised) PCG as a computation graph: the sequential baseline's middle step."""
    builder = GraphBuilder(library, name=graph.name)
    handles = {}
    used_names = set()
    for node in pcg.nodes:
        if node.kind == "leaf":
            handles[node.id] = builder.leaf(node.op, node.shape, node.role or "input")
            used_names.add(node.op)
            continue
        if node.kind == "parallel":
            raise OptimizeError("internal: the algebraic-only plan contains a parallel operator")
        name = node.origin if node.origin and node.origin not in used_names else None
        handles[node.id] = builder.op(node.op, *[handles[i] for i in node.inputs], name=name, **dict(node.attrs))
        used_names.add(handles[node.id].name)
    builder.output(*[handles[i] for i in pcg.outputs])
    return builder.build()


def data_parallel_pcg(graph: Graph, library: Library, devices: int) -> PCG | None:
    """Data parallelism: every input split along dim 0, every weight replicated, outputs gathered.

    Built directly (the textbook definition, independent of the rules) and
    checked operator by operator with spread inference; None when an
    operator does not accept it or a batch does not split evenly.
    """
    if devices < 2:
        return None
    nodes: list[PNode] = []
    ident: dict[str, int] = {}

    def add(kind, op, inputs, attrs, shape, layout, role="", origin="") -> int:
        nodes.append(PNode(len(nodes), kind, op, tuple(inputs), tuple(attrs), tuple(shape), layout, role, origin))
        return len(nodes) - 1

    for leaf in graph.leaves:
        base = add("leaf", leaf.name, (), (), leaf.shape, Layout.whole(len(leaf.shape)), leaf.role, leaf.name)
        if leaf.role == "input":
            if not leaf.shape or leaf.shape[0] % devices:
                return None
            shard = (devices,) + (1,) * (len(leaf.shape) - 1)
            ident[leaf.name] = add("parallel", "partition", (base,), (("dim", 0), ("degree", devices)), leaf.shape,
                                   Layout(shard))
        else:
            ident[leaf.name] = add("parallel", "replicate", (base,), (("degree", devices),), leaf.shape,
                                   Layout(Layout.whole(len(leaf.shape)).shard, devices))
    for gnode in graph.nodes:
        op = library.ops[gnode.op]
        inputs = [nodes[ident[i]] for i in gnode.inputs]
        try:
            instance = instance_for(op, [n.shape for n in inputs], dict(gnode.attrs))
        except InstantiationError:
            return None
        inferred = infer_compute(instance, [n.layout.to_spread() for n in inputs])
        if inferred.problems:
            return None
        spread = inferred.spread
        layout = Layout(tuple(int(d.evaluate({})) for d in spread.shard), int(spread.copy.evaluate({})),
                        int(spread.sum.evaluate({})))
        ident[gnode.name] = add("op", gnode.op, [n.id for n in inputs], gnode.attrs, gnode.shape, layout,
                                origin=gnode.name)
    outputs = []
    for name in graph.outputs:
        node = nodes[ident[name]]
        if node.layout.is_whole:
            outputs.append(node.id)
        elif node.layout.shard and node.layout.shard[0] == devices and node.layout.pieces == devices:
            outputs.append(add("parallel", "combine", (node.id,), (("dim", 0), ("degree", devices)), node.shape,
                               Layout.whole(len(node.shape))))
        else:
            return None
    return PCG(tuple(nodes), tuple(outputs), tuple(graph.outputs))


# ------------------------------------------------------------------ rules used


def rules_used(library_rules: Sequence[ast.RuleDecl], snapshot: Snapshot, choice: Mapping[int, int]) -> tuple[str, ...]:
    """A small set of rules that built the e-nodes an extraction chose, in library order.

    Every rule application records the e-nodes it built (`egglog_compile.made_row`),
    and the input graph's operators need no rule. An e-node is often built by
    several rules (a pattern reached two ways), so listing every maker says
    little; the rules are picked greedily, the one that built most of the
    still unexplained e-nodes first, until each of the plan's new e-nodes has
    a maker among them.
    """
    order = {rule.name: i for i, rule in enumerate(library_rules)}
    unexplained = [makers for makers in (snapshot.makers(snapshot.classes[c][i]) for c, i in choice.items()) if makers]
    picked: list[str] = []
    while unexplained:
        counts = Counter(name for makers in unexplained for name in makers if name in order)
        if not counts:
            break
        best = min(counts, key=lambda name: (-counts[name], order[name]))
        picked.append(best)
        unexplained = [makers for makers in unexplained if best not in makers]
    return tuple(sorted(picked, key=order.__getitem__))


# ---------------------------------------------------------------------- optimize


@dataclass(frozen=True)
class _Candidate:
    name: str
    pcg: PCG
    costs: Mapping[int, NodeCost]
    totals: Totals


def _check_devices(graph: Graph, devices: int) -> None:
    if devices < 1:
        raise OptimizeError(f"the device count must be at least 1, got {devices}")
    if devices == 1:
        return
    degrees = [d for d in range(2, devices + 1) if devices % d == 0]
    if not any(dim % d == 0 for shape in graph.shapes().values() for dim in shape for d in degrees):
        raise OptimizeError(f"'{graph.name}' cannot use {devices} devices: no dim of any tensor is divisible by "
                            f"{' or '.join(map(str, degrees[:6]))}, so nothing can be split across them")


def _pins(graph: Graph, outputs: Mapping[str, Layout | Mapping] | None, inputs: Mapping[str, Layout | Mapping] | None,
          devices: int) -> dict[str, Layout]:
    """Pinned layouts by tensor name, checked: outputs the plan must produce, inputs as they arrive."""
    out: dict[str, Layout] = {}
    input_names = [l.name for l in graph.leaves if l.role == "input"]
    for kind, spreads, allowed in (("output", outputs, graph.outputs), ("input", inputs, input_names)):
        for name, value in (spreads or {}).items():
            if name not in allowed:
                raise OptimizeError(f"cannot pin '{name}': it is not an {kind} of the graph ({', '.join(allowed)})")
            try:
                layout = value if isinstance(value, Layout) else Layout.from_dict(dict(value))
            except (KeyError, TypeError, ValueError):
                raise OptimizeError(f"pinned spread of '{name}' must look like "
                                    "{'shard': [...], 'copy': 1}") from None
            shape = graph.shape(name)
            if len(layout.shard) != len(shape):
                raise OptimizeError(f"pinned spread of '{name}' has {len(layout.shard)} dims, the tensor has "
                                    f"{len(shape)}")
            if layout.sum != 1:
                raise OptimizeError(f"an {kind} cannot be pinned as a partial sum ('{name}')")
            if layout.pieces > devices or devices % layout.pieces:
                raise OptimizeError(f"pinned spread of '{name}' has {layout.pieces} pieces, which {devices} devices "
                                    "cannot hold")
            for dim, degree in zip(shape, layout.shard):
                if dim % degree:
                    raise OptimizeError(f"pinned spread of '{name}': dim of size {dim} does not split into {degree}")
            if not layout.is_whole:
                out[name] = layout
    return out


def _solve(result: SaturationResult, graph: Graph, library: Library, machine: Machine, roots: Sequence[int],
           limits: Limits, free_inputs: bool, devices: int, exclude=None,
           pins: Mapping[str, Layout] | None = None,
           costs: Mapping[NodeId, NodeCost] | None = None) -> tuple[PCG, dict[int, NodeCost], Extraction]:
    """Extract from `result` (with `costs`, the e-nodes priced, when already known) and build the PCG."""
    if costs is None:
        costs = _price(result, graph, library, machine, free_inputs, devices, pins)
    extraction = extract(result.snapshot, costs, roots, machine.memory_capacity, limits.ilp_seconds, exclude)
    pcg, ident = pcg_from_extraction(result, extraction, graph, library, roots, graph.outputs)
    by_class = {ident[c]: costs[(c, i)] for c, i in extraction.choice.items()}
    return pcg, by_class, extraction


def _price(result: SaturationResult, graph: Graph, library: Library, machine: Machine, free_inputs: bool,
           devices: int, pins: Mapping[str, Layout] | None) -> dict[NodeId, NodeCost]:
    input_pins = {k: v for k, v in (pins or {}).items() if k not in graph.outputs}
    return node_costs(result.snapshot, graph, library, machine, free_inputs, devices, input_pins)


def optimize(graph, machine: Machine | str = "h100x8", rules=None, limits: Limits | Mapping | None = None,
             devices: int | None = None, *, allow_unverified: bool | None = None,
             output_spreads: Mapping[str, Layout | Mapping] | None = None,
             input_spreads: Mapping[str, Layout | Mapping] | None = None, free_input_layouts: bool = True,
             baselines: bool = True, sizes: Mapping[str, int] | None = None,
             progress: Progress | None = None) -> Plan:
    """The cheapest plan the proven rules reach for `graph` on `devices` devices of `machine`.

    `graph` is a Graph, a graph JSON path or an example name (with `sizes`);
    `rules` a Library, `.rule` paths, or None for the shipped rules;
    `output_spreads` pins outputs (default: whole); `input_spreads` says how
    inputs arrive (default: in whatever layout the plan wants, as a data
    loader can read any slice; a pinned input read in another layout costs
    a gather). Raises OptimizeError,
    GraphError or MachineError with a message for the user.
    """
    say = progress or (lambda _m: None)
    library = resolve_library(rules)
    graph = resolve_graph(graph, library, sizes)
    limits = limits if isinstance(limits, Limits) else Limits.from_mapping(limits)
    base = Machine.resolve(machine)
    devices = base.devices if devices is None else int(devices)
    _check_devices(graph, devices)
    machine = base.with_devices(devices)
    pins = _pins(graph, output_spreads, input_spreads, devices)
    chosen, note = proved_rules(library, allow_unverified)
    say(f"{len(chosen)} rules; {note}")

    t = time.perf_counter()
    joint = saturate(graph, library, chosen, devices, limits, pins, progress=say)
    say(f"saturation: {joint.stop} after {joint.iterations} iterations, {joint.enodes} e-nodes, "
        f"{time.perf_counter() - t:.2f} s")
    if devices > 1 and all(l.pieces == 1 for l in joint.snapshot.layout.values()):
        raise OptimizeError(f"no rule can spread '{graph.name}' over {devices} devices (no parallel rule applies "
                            "at a degree dividing the device count)")
    roots = [joint.classes[f"pin:{n}"] if n in pins else joint.classes[n] for n in graph.outputs]
    t = time.perf_counter()
    priced = _price(joint, graph, library, machine, free_input_layouts, devices, pins)
    solve_pins = {"pins": pins, "costs": priced}
    try:
        pcg, costs, extraction = _solve(joint, graph, library, machine, roots, limits, free_input_layouts, devices,
                                         **solve_pins)
    except ExtractionError as err:
        raise OptimizeError(str(err)) from None
    extract_seconds = time.perf_counter() - t
    say(f"extraction: {extraction.method}, {extract_seconds:.2f} s")
    candidates = [_Candidate(JOINT, pcg, costs, totals(costs, machine))]

    found: dict[str, Totals | None] = {}
    if baselines:
        limits = Limits(limits.iterations, limits.enodes, limits.seconds, limits.ilp_seconds / 2)
        roles = leaf_roles(joint.snapshot, graph)
        inputs = {c for c, r in roles.items() if r == "input"}
        snapshot = joint.snapshot

        weights = {c for c, r in roles.items() if r == "weight"}

        def not_megatron(nid: NodeId) -> bool:
            """Tensor parallelism: inputs never split, matrices never replicated or read whole."""
            node = snapshot.classes[nid[0]][nid[1]]
            if node.op == "partition":
                return node.children[0] in inputs
            if node.op == "replicate":
                return node.children[0] in weights and len(snapshot.shape[node.children[0]]) >= 2
            if node.op in PARALLEL or node.op == "leaf":
                return False
            return any(ch in weights and len(snapshot.shape[ch]) >= 2 for ch in node.children)

        try:
            mpcg, mcosts, _ = _solve(joint, graph, library, machine, roots, limits, free_input_layouts, devices,
                                         not_megatron, **solve_pins)
            if mpcg.max_pieces > 1:
                candidates.append(_Candidate("megatron", mpcg, mcosts, totals(mcosts, machine)))
                found["megatron"] = candidates[-1].totals
            else:
                found["megatron"] = None
        except ExtractionError:
            found["megatron"] = None
        found["sequential"] = _sequential(graph, library, chosen, devices, limits, machine, pins, free_input_layouts,
                                          candidates, say)
        dp = data_parallel_pcg(graph, library, devices) if not pins else None
        dcosts = price_pcg(dp, library, machine, free_input_layouts, devices) if dp is not None else None
        found["data_parallel"] = totals(dcosts, machine) if dcosts is not None else None
        if dcosts is not None:
            candidates.append(_Candidate("data_parallel", dp, dcosts, found["data_parallel"]))

    # Every candidate must be one the backend can lay out (`pcg_layout`); the layout guards make that so,
    # and a candidate that still is not is left out, and said, rather than returned.
    unplaceable = _unplaceable(candidates, library, devices)
    for name, why in unplaceable.items():
        say(f"{name}: left out, it cannot be laid out on the devices ({why})")
    candidates = [c for c in candidates if c.name not in unplaceable]
    if not candidates:
        raise OptimizeError(f"internal: no plan for '{graph.name}' can be laid out on {devices} devices "
                            f"({unplaceable.get(JOINT, '')})")
    # Every baseline is a PCG priced by the same model, so the best candidate is a valid plan. The joint plan
    # wins ties; a baseline only replaces it when strictly cheaper (e.g. after a limit stopped the joint search),
    # and `extraction.chosen` and explain() say so.
    best = min(candidates, key=lambda c: (c.totals.peak_memory_bytes > machine.memory_capacity,
                                          round(c.totals.time_s, 12), c.name != JOINT))
    if best.name != JOINT:
        say(f"baseline {best.name} was cheaper than anything extracted: the plan is its PCG")
    saturation = joint.to_dict()
    saturation["rules_note"] = note
    saturation["rules_available"] = len(chosen)
    ext = {"method": extraction.method, "chosen": best.name,
           "seconds": round(extract_seconds, 4), "candidates": dict(extraction.candidates),
           "ilp_status": extraction.ilp_status, "pass_seconds": dict(extraction.seconds)}
    if unplaceable:
        ext["unplaceable"] = unplaceable
    baseline_plans = {c.name: BaselinePlan(c.pcg, c.costs) for c in candidates if c.name != JOINT}
    return Plan(graph, machine, devices, best.pcg, best.costs, best.totals, found,
                rules_used(chosen, joint.snapshot, extraction.choice) if best.name == JOINT else (),
                saturation, ext, pins,
                baseline_plans)


def _unplaceable(candidates: Sequence[_Candidate], library: Library, devices: int) -> dict[str, str]:
    """The candidates whose PCG cannot be laid out on `devices` ranks, and why."""
    out = {}
    for candidate in candidates:
        try:
            lay_out(candidate.pcg, library.ops, devices)
        except PlacementError as err:
            out[candidate.name] = str(err)
    return out


def _sequential(graph: Graph, library: Library, rules: Sequence[ast.RuleDecl], devices: int, limits: Limits,
                machine: Machine, pins, free_inputs: bool, candidates: list, say: Progress) -> Totals | None:
    """Algebraic rules saturated and extracted first (on one device), then parallel rules only."""
    algebraic = [r for r in rules if not is_parallel_rule(r)]
    parallel = [r for r in rules if is_parallel_rule(r)]
    try:
        first = saturate(graph, library, algebraic, 1, limits, None, rulesets=("alg",))
        roots = [first.classes[n] for n in graph.outputs]
        one = machine.with_devices(1)
        pcg, _c, _e = _solve(first, graph, library, one, roots, limits, free_inputs, 1)
        middle = pcg_to_graph(pcg, graph, library)
        if any(n not in middle.shapes() for n in pins) or middle.outputs != graph.outputs:
            say("sequential baseline: none (the algebraic rewrite renamed a pinned tensor)")
            return None
        second = saturate(middle, library, parallel, devices, limits, pins, rulesets=("par",))
        roots = [second.classes[f"pin:{n}"] if n in pins else second.classes[n] for n in middle.outputs]
        spcg, scosts, _ = _solve(second, middle, library, machine, roots, limits, free_inputs, devices, pins=pins)
    except (ExtractionError, GraphError, OptimizeError) as err:
        say(f"sequential baseline: none ({err})")
        return None
    result = totals(scosts, machine)
    candidates.append(_Candidate("sequential", spcg, scosts, result))
    return result
