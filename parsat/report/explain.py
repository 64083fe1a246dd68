"""A plan as text (`parsat explain`, `parsat.explain`): what parsat did, where the time and bytes go, the baselines.

It reads the plan's JSON form (docs/plan-schema.md), so a plan file and a
`Plan` object print the same report; each section of the report is one
function below, in the order they print.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from typing import Mapping, Sequence

from parsat.dsl.parallel_ops import ALL_GATHER, ALL_TO_ALL, COMBINE, PARTITION, REDUCE, REDUCE_SCATTER, REPLICATE
from parsat.ir.mesh import Mesh
from parsat.ir.parallelism import describe
from parsat.ir.pcg import STRIDED_VIEW, VIEW_OPS, Degrees, describe_zero
from parsat.ir.pipeline import PipelinePlan
from parsat.ir.plan import BASELINES, JOINT, Plan, load_plan_dict, pcg_from_dict
from parsat.ir.recompute import NONE
from parsat.ir.recompute import describe as describe_recompute
from parsat.report.pipeline import describe_pipeline
from parsat.ir.units import fmt_bytes, fmt_time


def explain_plan(plan: Plan | Mapping | str | os.PathLike, limit: int | None = 40) -> str:
    """`explain` of a `Plan`, a plan dict or a plan file (read and checked: `ir.plan.load_plan_dict`)."""
    if isinstance(plan, Plan):
        plan = plan.to_dict()
    elif isinstance(plan, (str, os.PathLike)):
        plan = load_plan_dict(plan)
    return explain(plan, limit)


def explain(data: Mapping, limit: int | None = 40) -> str:
    """A readable breakdown of a plan dict: what parsat did, where the time and bytes go, the baselines.

    Long plans show the first `limit` parallel operators and nodes (None: all).
    """
    nodes = {n["id"]: n for n in data["nodes"]}
    lines = summary_lines(data)
    lines += ["", "what parsat did:"]
    lines += parallel_lines(data, nodes, limit)
    lines += ["", "nodes (id, operator, spread, time, communication, memory):"]
    lines += node_lines(data, nodes, limit)
    lines += ["", "compared with (same cost model; time: the simulated step, node sum: the per-node sum):"]
    lines += baseline_lines(data)
    lines += search_lines(data)
    return "\n".join(lines)


def summary_lines(data: Mapping) -> list[str]:
    """The plan's headline: machine, predicted step and its parts, memory, micro-batches, recomputation, the mesh
    and the kinds of parallelism, the pipeline, the step timeline, and whether a baseline's PCG won."""
    graph, machine, totals = data["graph"], data["machine"], data["totals"]
    lines = [f"plan for '{graph.get('name', 'graph')}' on {data['devices']} device(s) of {machine['name']} "
             f"({machine['devices_per_node']} per node)"]
    if "step" in totals:
        lines.append(f"  predicted step time {fmt_time(totals['time_s'])} (simulated as {totals['step']['profile']} "
                     f"runs it; the per-node sum extraction ranks by: {fmt_time(totals['node_sum_s'])}, of which "
                     f"compute {fmt_time(totals['compute_s'])}, communication {fmt_time(totals['comm_s'])})")
    else:
        lines.append(f"  predicted step time {fmt_time(totals['time_s'])} "
                     f"(compute {fmt_time(totals['compute_s'])}, communication {fmt_time(totals['comm_s'])})")
    lines.append(f"  communication {totals['comm_elements']:,} elements ({fmt_bytes(totals['comm_bytes'])}) per "
                 f"step, of which gradient sync {totals['grad_sync_elements']:,}")
    if "step" in totals:
        lines.append(f"  peak memory {fmt_bytes(_deciding_memory(totals))} per device (simulated, "
                     f"transient buffers included: what decides whether it fits; the per-node bound extraction "
                     f"ranks by: {fmt_bytes(totals['peak_memory_bytes'])})")
    else:
        lines.append(f"  peak memory {fmt_bytes(totals['peak_memory_bytes'])} per device (bound)")
    micro = graph.get("microbatches", 1)
    if micro != 1:
        lines.append(f"  {micro} micro-batches per step (gradient accumulation): the graph is one micro-batch, "
                     "its weights gathered and gradients synchronised once per step; memory is one micro-batch's "
                     "activations")
    if data.get("recompute", NONE) != NONE:
        lines.append(f"  {describe_recompute(data['recompute'])}: the blocks' forward runs twice per step")
    if data.get("zero"):
        lines.append(f"  {describe_zero(data['zero'])}: each such gradient reduce-scattered, the updated shards "
                     "all-gathered")
    repeated = (data.get("saturation") or {}).get("repeated_blocks")
    if repeated:
        lines.append(f"  {repeated['blocks']} identical blocks, searched as {repeated['searched_blocks']}: block "
                     f"{repeated['repeated_block']}'s plan repeated for {repeated['copies']} blocks")
    mesh = Mesh.from_dict(data["mesh"])
    lines.append(f"  {'each stage: ' if data.get('pipeline') else ''}mesh "
                 f"{mesh if len(mesh) else 'none (one device)'}: {describe(pcg_from_dict(data))}")
    if data.get("pipeline"):
        lines += describe_pipeline(PipelinePlan.from_dict(data["pipeline"]), machine["devices_per_node"])
    if "step" in totals:
        lines += step_timeline(totals)
    return lines + chosen_baseline_lines(data)


def chosen_baseline_lines(data: Mapping) -> list[str]:
    """Why the plan is a baseline's PCG: a baseline's simulated step beat every plan extracted, or no plan was
    extracted (a safety valve cut the search, or no joint plan keeps the pinned degrees: `extraction.fallback`)."""
    ext = data.get("extraction") or {}
    chosen = ext.get("chosen", JOINT)
    if chosen == JOINT:
        return []
    if ext.get("fallback"):
        return [f"  {ext['fallback']}: this plan is the best baseline that fits, {chosen}'s PCG"]
    extracted = min((v for v in (ext.get("candidates") or {}).values() if v is not None and math.isfinite(v)),
                    default=None)
    return [f"  baseline {chosen}'s simulated step was faster than the plan extracted from the joint "
            f"e-graph (which ranks by the per-node sum"
            + (f", best extracted {fmt_time(extracted)}" if extracted is not None else "")
            + f"): this plan is the {chosen} baseline's PCG"]


def step_timeline(totals: Mapping) -> list[str]:
    """The simulated step as two lanes over time (`ir.costs.StepTimeline`), their overlap, and the phases."""
    step = totals["step"]
    lanes = step["lanes"]
    compute, comm, both = lanes["compute"], lanes["comm"], lanes["overlap"]
    micro = step.get("microbatches", 1)
    lines = ["", f"step timeline (simulated, {step['profile']}"
             + (f", {micro} micro-batches" if micro > 1 else "") + "): "
             "F/f forward, B/b backward, G gradient sync, O optimizer, w waiting for slower ranks",
             f"  compute |{compute}| {fmt_time(totals['compute_busy_s'])} busy",
             f"  comm    |{comm}| {fmt_time(totals['comm_busy_s'])} busy",
             f"  both    |{both}| {fmt_time(totals['overlap_s'])} overlapped; communication exposed "
             f"{fmt_time(totals['exposed_comm_s'])}",
             f"          0{fmt_time(totals['time_s']):>{len(compute)}}",
             f"  {'phase':<12} {'from':>10} {'to':>10} {'compute':>10} {'comm':>10}"]
    for phase in step["phases"]:
        lines.append(f"  {phase['phase']:<12} {fmt_time(phase['start_s']):>10} {fmt_time(phase['end_s']):>10} "
                     f"{fmt_time(phase['compute_s']):>10} {fmt_time(phase['comm_s']):>10}")
    lines.append(f"  simulated peak memory {fmt_bytes(step['peak_memory_bytes'])} per device (decides whether it "
                 "fits)")
    return lines


def parallel_lines(data: Mapping, nodes: Mapping[int, Mapping], limit: int | None) -> list[str]:
    """What parsat did: inputs read in another placement than they arrive in, then every parallel operator in
    words (the first `limit`, after a one-line summary when there are more), and the rules used."""
    weights = {w["name"] for w in data["graph"].get("weights", [])}
    lines = []
    for node in data["nodes"]:
        if node["kind"] == "leaf" and node["cost"]["collectives"]:
            lines.append(f"  #{node['id']:<4} reads input {node['op']} whole although it arrives "
                         f"{_degrees_text(data.get('pinned_spreads', {}).get(node['op'], node['spread']))}; "
                         + "; ".join(node["cost"]["collectives"]))
    parallel = [n for n in data["nodes"] if n["kind"] == "parallel"]
    if limit is not None and len(parallel) > limit:
        lines.append("  in short: " + _parallel_summary(parallel, nodes, weights))
    lines += [f"  #{node['id']:<4} {parallel_text(node, nodes, weights)}" for node in parallel[:limit]]
    if limit is not None and len(parallel) > limit:
        lines.append(f"  ... {len(parallel) - limit} more parallel operators (parsat explain --all)")
    if not parallel:
        lines.append("  nothing split: under the cost model no parallel plan is faster on this machine "
                     "(every device runs the whole step; see the baselines below)")
    if data.get("rules_used"):
        lines.append("  rules: " + ", ".join(data["rules_used"]))
    return lines


def parallel_text(node: Mapping, nodes: Mapping[int, Mapping], weights: set[str]) -> str:
    """One parallel operator in words: what it does to which value, on which mesh axis, and what it sends."""
    source = nodes[node["inputs"][0]]
    what = source["op"] if source["kind"] == "leaf" else f"{source['op']} #{source['id']}"
    attrs = node["attrs"]
    if node["op"] == PARTITION:
        text = f"splits {what} along dim {attrs['dim']} into {attrs['degree']} blocks"
    elif node["op"] == COMBINE:
        text = f"gathers {what} along dim {attrs['dim']} from {attrs['degree']} blocks"
    elif node["op"] == REPLICATE:
        text = f"replicates {what} on {attrs['degree']} devices"
    elif node["op"] == REDUCE:
        text = f"adds up {attrs['degree']} partial sums of {what}"
    elif node["op"] == REDUCE_SCATTER:
        text = f"adds up {attrs['degree']} partial sums of {what}, each device keeping block of dim {attrs['dim']}"
    elif node["op"] == ALL_TO_ALL:
        text = (f"moves {what}'s {attrs['degree']} blocks from dim {attrs['dim']} to dim {attrs['to_dim']} "
                "(all-to-all)")
    else:
        text = f"gathers {what} along dim {attrs['dim']} from {attrs['degree']} blocks into copies"
    if "axis" in attrs:
        text += f" on mesh axis {attrs['axis']}"
    viewed = viewed_weight(source, nodes, weights)
    if node["op"] == PARTITION and viewed:
        text += f" (weight {viewed} stored sharded as a block of this view of it: a strided block, no gradient sync)"
    if source["kind"] == "leaf" and source["op"] in weights:
        sharded = any("reduce-scatter" in line for line in node["cost"]["collectives"])   # ZeRO-1/2's sync
        synced = "reduce-scattered and its update all-gathered (ZeRO)" if sharded else "all-reduced"
        text += " (weight" + (f", gradient {synced} every step)" if node["op"] == REPLICATE else
                              ", stored sharded: no gradient sync)")
    collectives = node["cost"]["collectives"]
    if collectives:
        text += "; " + "; ".join(collectives)
    return text


def viewed_weight(source: Mapping, nodes: Mapping[int, Mapping], weights: set[str]) -> str:
    """The weight `source` is a view of (`ir.pcg.VIEW_OPS` from the weight leaf, the first `STRIDED_VIEW`, as
    `ir.pcg.weight_storage` reads a storage chain), or "" where it is none."""
    chain = []
    while source["kind"] == "op" and source["op"] in VIEW_OPS and len(source["inputs"]) == 1:
        chain.append(source)
        source = nodes[source["inputs"][0]]
    found = source["kind"] == "leaf" and source["op"] in weights and chain and chain[-1]["op"] == STRIDED_VIEW
    return source["op"] if found else ""


def _parallel_summary(parallel: Sequence[Mapping], nodes: Mapping[int, Mapping], weights: set[str]) -> str:
    """The parallel operators counted by what they do, so a long plan reads in one line."""
    counts: Counter = Counter()
    for node in parallel:
        source = nodes[node["inputs"][0]]
        weight = source["kind"] == "leaf" and source["op"] in weights
        d = node["attrs"]["degree"]
        kind = {PARTITION: f"weights stored in {d} shards" if weight else f"splits into {d} blocks",
                COMBINE: f"gathers of {d} blocks",
                REPLICATE: f"weights replicated on {d} devices" if weight else f"replications on {d} devices",
                REDUCE: f"sums of {d} partial sums",
                REDUCE_SCATTER: f"reduce-scatters over {d} devices",
                ALL_GATHER: f"all-gathers of {d} blocks into copies",
                ALL_TO_ALL: f"all-to-alls over {d} devices"}[node["op"]]
        counts[kind] += 1
    return ", ".join(f"{n} {kind}" for kind, n in counts.most_common())


def _degrees_text(degrees: Mapping) -> str:
    return str(Degrees.from_dict(degrees))


def node_lines(data: Mapping, nodes: Mapping[int, Mapping], limit: int | None) -> list[str]:
    """Every computed node (and every leaf read at a cost): operator, degrees, time, communication, memory."""
    lines = []
    computed = [n for n in data["nodes"] if n["kind"] != "leaf" or n["cost"]["collectives"]]
    for node in computed[:limit]:
        cost = node["cost"]
        args = ", ".join(f"#{i}" if nodes[i]["kind"] != "leaf" else nodes[i]["op"] for i in node["inputs"])
        attrs = ", ".join(f"{k}={v}" for k, v in node["attrs"].items())
        label = f"{node['op']}({args}{', ' + attrs if attrs else ''})"
        origin = f" [{node['origin']}]" if node.get("origin") else ""
        lines.append(f"  #{node['id']:<4} {label:<46} {_degrees_text(node['spread']):<18} "
                     f"{fmt_time(cost['time_s']):>10} {cost['comm_elements']:>12,} el "
                     f"{fmt_bytes(cost['memory_bytes']):>10}{origin}")
    if limit is not None and len(computed) > limit:
        lines.append(f"  ... {len(computed) - limit} more nodes (parsat explain --all)")
    return lines


def baseline_lines(data: Mapping) -> list[str]:
    """The plan beside every baseline on one cost model, and the grid point the best grid chose."""
    lines = [f"  {'plan':<15} {'time':>12} {'node sum':>12} {'exposed comm':>12} {'comm elements':>16} "
             f"{'grad sync':>14} {'memory':>12}", _baseline_row("parsat", data["totals"])]
    lines += [_baseline_row(name, data["baselines"].get(name)) for name in BASELINES]
    chosen_grid = (data["baselines"].get("best_grid") or {}).get("config")
    if chosen_grid:
        lines.append("  best_grid: " + ", ".join(f"{k} {v}" for k, v in chosen_grid.items()))
    return lines


def _baseline_row(name: str, t: Mapping | None) -> str:
    if t is None:
        return f"  {name:<15} {'n/a':>12}"
    exposed = fmt_time(t["exposed_comm_s"]) if "exposed_comm_s" in t else "-"
    return (f"  {name:<15} {fmt_time(t['time_s']):>12} {fmt_time(t.get('node_sum_s', t['time_s'])):>12} "
            f"{exposed:>12} {t['comm_elements']:>16,} {t['grad_sync_elements']:>14,} "
            f"{fmt_bytes(_deciding_memory(t)):>12}")


def _deciding_memory(totals: Mapping) -> int:
    """A plan dict's totals' memory per device that decides whether it fits, as `ir.costs.Totals.memory_bytes`
    reads a `Totals`: the simulated peak where the step was simulated, else the per-node bound."""
    return totals["step"]["peak_memory_bytes"] if "step" in totals else totals["peak_memory_bytes"]


def search_lines(data: Mapping) -> list[str]:
    """How the search went: where saturation stopped and why, what a limit cut short, which extraction won."""
    lines = []
    sat = data.get("saturation") or {}
    if sat:
        lines.append("")
        lines.append(f"saturation: stopped by {sat.get('stop')} after {sat.get('iterations')} iteration(s), "
                     f"{sat.get('enodes')} e-nodes in {sat.get('eclasses')} e-classes, {sat.get('seconds', 0):.2f} s "
                     f"(+{sat.get('compile_seconds', 0):.2f} s to compile "
                     f"{sum((sat.get('rules_compiled') or {}).values())} egglog rules)")
        if sat.get("search_limit"):
            lines.append(f"search cut short: {sat['search_limit']}")
        if sat.get("unspread"):
            lines.append(f"nothing spread by the rules: {sat['unspread']}")
        if sat.get("scouted"):
            lines.append(f"scouted: {sat['scouted']}")
    ext = data.get("extraction") or {}
    if ext.get("method") == "none":
        lines.append(f"extraction: no joint plan, the plan is the {ext.get('chosen')} baseline's")
    elif ext:
        lines.append(f"extraction: best by {ext.get('method')}; "
                     + ", ".join(f"{k} {fmt_time(v) if v is not None else 'none'}"
                                 for k, v in (ext.get('candidates') or {}).items())
                     + f"; ILP {ext.get('ilp_status', '')}")
    return lines


def saturation_stats(saturation: Mapping) -> str:
    """What every rule did in saturation (`parsat optimize --stats`): the rules that matched, most first,
    the rules that never fired, and the seconds each ruleset ran (docs/plan-schema.md, `saturation`)."""
    matches = dict(saturation.get("rule_matches") or {})
    seconds = saturation.get("ruleset_seconds") or {}
    lines = ["saturation statistics:"]
    if seconds:
        lines.append("  seconds per ruleset: " + ", ".join(f"{k} {fmt_time(v)}" for k, v in seconds.items()))
    fired = sorted(((n, c) for n, c in matches.items() if c), key=lambda item: -item[1])
    lines.append(f"  matches per rule ({len(fired)} of {len(matches)} rules fired):")
    lines += [f"  {count:>10,}  {name}" for name, count in fired]
    never = [name for name, count in matches.items() if not count]
    lines.append(f"  never fired ({len(never)}): " + (", ".join(never) if never else "none"))
    return "\n".join(lines)
