"""`optimize(graph, machine=..., rules=..., limits=...) -> Plan`: the joint search and its baselines.

1. resolve the inputs (`inputs`) and ask the caller which rules saturation
   may apply (`choose_rules`: the facade's `parsat.optimize` keeps the rules
   the verifier PROVED; this package never imports the verifier);
2. saturate the graph with algebraic and parallel rules together, within
   limits;
3. price every e-node with the cost model and extract the cheapest plan
   that fits in memory (`solve`);
4. compute the baselines with the same cost model (`baselines`): data
   parallelism only, the sequential approach (algebraic rules first, then
   parallel rules), and Megatron-style tensor parallelism (graph inputs
   never split);
5. the best feasible plan wins: the joint plan unless a baseline's PCG
   (each is a valid PCG, kept in the plan so a backend can run it) is
   strictly cheaper, which the plan then says (`extraction.chosen`).

`limits.seconds` bounds the whole search, not saturation alone: building
the graph, saturating, extracting and the baselines share one deadline
(`Deadline`); what the deadline leaves no time for is cut (the ILP, then
the baselines), never the plan. Loading the rules and looking up their
proofs (cached) are not counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.library import Library
from parsat.ir.budget import GraphBudget
from parsat.ir.costs import totals
from parsat.ir.machine import Machine
from parsat.ir.pcg import Degrees
from parsat.ir.pcg_layout import lay_out
from parsat.ir.placement import PlacementError
from parsat.ir.plan import JOINT, BaselinePlan, Plan
from parsat.saturate.baselines import Candidate, data_parallel, megatron_excluded, sequential
from parsat.saturate.errors import OptimizeError
from parsat.saturate.extract import ExtractionError, leaf_roles
from parsat.saturate.inputs import check_devices, check_pins, resolve_graph, resolve_library
from parsat.saturate.runner import STOP_SATURATED, Limits, check_limits
from parsat.saturate.saturate import saturate
from parsat.saturate.solve import price, rules_used, solve

Progress = Callable[[str], None]
RuleChooser = Callable[[Library], tuple[Sequence[ast.RuleDecl], str]]
"""Picks the rules saturation may apply out of a library, with a note for the plan (`saturation.rules_note`)."""


def every_rule(library: Library) -> tuple[list[ast.RuleDecl], str]:
    """The default `RuleChooser`: every rule of the library, unverified (the facade's chooser keeps PROVED ones)."""
    return list(library.rules), "all rules used (no proof check was asked for)"


def optimize(graph, machine: Machine | str = "h100x8", rules=None, limits: Limits | Mapping | None = None,
             devices: int | None = None, *, choose_rules: RuleChooser = every_rule,
             output_spreads: Mapping[str, Degrees | Mapping] | None = None,
             input_spreads: Mapping[str, Degrees | Mapping] | None = None, free_input_layouts: bool = True,
             baselines: bool = True, sizes: Mapping[str, int] | None = None,
             progress: Progress | None = None) -> Plan:
    """The cheapest plan the chosen rules reach for `graph` on `devices` devices of `machine`.

    `graph` is a Graph, a graph JSON path or an example name (with `sizes`);
    `rules` a Library, `.rule` paths, or None for the shipped rules, of which
    `choose_rules` picks the ones saturation applies (once the inputs are
    checked, so a bad graph is refused before any proof is looked up);
    `output_spreads` pins outputs (default: whole); `input_spreads` says how
    inputs arrive (default: in whatever layout the plan wants, as a data
    loader can read any slice; a pinned input read in another layout costs
    a gather). Raises OptimizeError,
    GraphError or MachineError with a message for the user.
    """
    say = progress or (lambda _m: None)
    library = resolve_library(rules)
    limits = limits if isinstance(limits, Limits) else Limits.from_mapping(limits)
    check_limits(limits)
    clock = Deadline(time.perf_counter() + limits.seconds, limits)
    graph = resolve_graph(graph, library, sizes, GraphBudget(limits.enodes, clock.at, limits.seconds))
    base = Machine.resolve(machine)
    devices = base.devices if devices is None else int(devices)
    check_devices(graph, devices)
    machine = base.with_devices(devices)
    pins = check_pins(graph, output_spreads, input_spreads, devices)
    t = time.perf_counter()
    chosen, note = choose_rules(library)
    clock = clock.pause(time.perf_counter() - t)   # proofs (cached) are not the search's time
    chosen = list(chosen)
    say(f"{len(chosen)} rules; {note}")

    t = time.perf_counter()
    within = clock.limits()
    if within is None:
        raise OptimizeError(f"--limit seconds={limits.seconds:g} passed before saturation could start (building "
                            f"'{graph.name}' took it); raise the limit")
    joint = saturate(graph, library, chosen, devices, within, pins, progress=say)
    say(f"saturation: {joint.stop} after {joint.iterations} iterations, {joint.enodes} e-nodes, "
        f"{time.perf_counter() - t:.2f} s")
    if devices > 1 and all(l.pieces == 1 for l in joint.snapshot.degrees.values()):
        if joint.stop != STOP_SATURATED:
            value = getattr(limits, joint.stop, "")
            raise OptimizeError(f"saturation stopped at --limit {joint.stop}={value:g} before any parallel rule "
                                f"spread '{graph.name}' over {devices} devices; raise the limit")
        raise OptimizeError(f"no rule can spread '{graph.name}' over {devices} devices (no parallel rule applies "
                            "at a degree dividing the device count)")
    roots = [joint.classes[f"pin:{n}"] if n in pins else joint.classes[n] for n in graph.outputs]
    t = time.perf_counter()
    priced = price(joint, graph, library, machine, free_input_layouts, devices, pins)
    try:
        pcg, costs, extraction = solve(joint, graph, library, machine, roots, clock.limits() or clock.greedy(),
                                       free_input_layouts, devices, pins=pins, costs=priced)
    except ExtractionError as err:
        raise OptimizeError(str(err)) from None
    extract_seconds = time.perf_counter() - t
    say(f"extraction: {extraction.method}, {extract_seconds:.2f} s")
    candidates = [Candidate(JOINT, pcg, costs, totals(costs, machine))]

    found = {}
    spare = clock.limits(share=0.25)   # the Megatron extraction and the sequential baseline's four steps
    skipped = f"--limit seconds={limits.seconds:g} reached before the baselines" if baselines and spare is None else ""
    if skipped:
        say(f"baselines skipped: {skipped}")
    if baselines and spare is not None:
        limits = replace(spare, ilp_seconds=min(spare.ilp_seconds, limits.ilp_seconds / 2))
        excluded = megatron_excluded(joint.snapshot, leaf_roles(joint.snapshot, graph))
        try:
            mpcg, mcosts, _ = solve(joint, graph, library, machine, roots, limits, free_input_layouts, devices,
                                    excluded, pins=pins, costs=priced)
            megatron = Candidate("megatron", mpcg, mcosts, totals(mcosts, machine)) if mpcg.max_pieces > 1 else None
        except ExtractionError:
            megatron = None
        two_phase = sequential(graph, library, chosen, devices, limits, machine, pins, free_input_layouts, say)
        dp = data_parallel(graph, library, machine, free_input_layouts, devices) if not pins else None
        for name, candidate in (("megatron", megatron), ("sequential", two_phase), ("data_parallel", dp)):
            found[name] = candidate.totals if candidate is not None else None
            if candidate is not None:
                candidates.append(candidate)

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
    if skipped:
        ext["baselines_skipped"] = skipped
    baseline_plans = {c.name: BaselinePlan(c.pcg, c.costs) for c in candidates if c.name != JOINT}
    return Plan(graph, machine, devices, best.pcg, best.costs, best.totals, found,
                rules_used(chosen, joint.snapshot, extraction.choice) if best.name == JOINT else (),
                saturation, ext, pins,
                baseline_plans)


@dataclass(frozen=True)
class Deadline:
    """The search's one deadline (`time.perf_counter()`), and the limits that fit in what is left of it."""

    at: float
    limits_given: Limits

    def pause(self, seconds: float) -> "Deadline":
        """The same deadline, `seconds` later: time spent on what the limit does not count."""
        return replace(self, at=self.at + seconds)

    def limits(self, share: float = 1.0) -> Limits | None:
        """The given limits with `seconds` (and the ILP's) cut to `share` of the time left; None if none is."""
        left = (self.at - time.perf_counter()) * share
        if left <= 0:
            return None
        given = self.limits_given
        return replace(given, seconds=left, ilp_seconds=min(given.ilp_seconds, left))

    def greedy(self) -> Limits:
        """No time left: extraction's greedy passes only (they always give a plan)."""
        return replace(self.limits_given, ilp_seconds=0)


def _unplaceable(candidates: Sequence[Candidate], library: Library, devices: int) -> dict[str, str]:
    """The candidates whose PCG cannot be laid out on `devices` ranks, and why."""
    out = {}
    for candidate in candidates:
        try:
            lay_out(candidate.pcg, library.ops, devices)
        except PlacementError as err:
            out[candidate.name] = str(err)
    return out
