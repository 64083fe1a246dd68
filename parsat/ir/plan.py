"""A Plan: the chosen PCG with its predicted costs, the baselines, and how it was found.

The plan JSON (docs/plan-schema.md) is the contract with the torch backend
and other compilers: it is self-contained (the input graph with every shape,
the weights by name and shape, every node's spread, the device count and the
machine) and versioned. `explain()` renders the same data as text, so
`parsat explain plan.json` and `plan.explain()` print the same report.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from parsat.dsl.files import write_atomic
from parsat.dsl.parallel_ops import ALL_GATHER, COMBINE, PARTITION, REDUCE, REDUCE_SCATTER, REPLICATE
from parsat.ir.costs import NodeCost, Totals
from parsat.ir.errors import PlanError
from parsat.ir.graph import Graph
from parsat.ir.json_files import read_json_file
from parsat.ir.machine import Machine
from parsat.ir.mesh import Mesh, MeshError
from parsat.ir.parallelism import describe
from parsat.ir.pcg import PCG, Degrees, PNode
from parsat.ir.pipeline import PipelinePlan, describe_pipeline
from parsat.ir.placement import PlacementError, from_dtensor
from parsat.ir.recompute import NONE
from parsat.ir.recompute import describe as describe_recompute
from parsat.ir.validate import PLAN_SCHEMA, PLAN_VERSION, READABLE_VERSIONS, validate_plan_dict

BASELINES = ("data_parallel", "sequential", "megatron", "best_grid")
JOINT = "joint"                # `extraction.chosen` when the plan was extracted from the joint e-graph


@dataclass(frozen=True)
class BaselinePlan:
    """A baseline's PCG with its node costs, so a backend can run it, not only compare totals. No PCG (None) for
    a baseline found at another micro-batch count than the plan's graph: its totals and configuration say
    what it is (`parsat optimize --microbatches M` gives its PCG)."""

    pcg: PCG | None
    costs: Mapping[int, NodeCost]
    config: Mapping | None = None    # the configuration a grid baseline chose (dp, tp, sp, zero, microbatches)


def pcg_to_dict(pcg: PCG, costs: Mapping[int, NodeCost], dtype_bytes: int) -> dict:
    """`{"mesh": ..., "nodes": [...], "outputs": [...]}`: the node format of the plan's top level
    (docs/plan-schema.md)."""
    names = pcg.mesh.names
    nodes = []
    for node in pcg.nodes:
        cost = costs.get(node.id, NodeCost())
        entry = {"id": node.id, "kind": node.kind, "op": node.op, "attrs": dict(node.attrs),
                 "inputs": list(node.inputs), "shape": list(node.shape), "placement": node.placement.dtensor(),
                 "replicated_on": [names[a] for a in node.placement.replica_axes],
                 "spread": node.degrees.to_dict(), "pieces": node.degrees.pieces, "origin": node.origin,
                 "cost": cost.to_dict(dtype_bytes)}
        if node.kind == "leaf":
            entry["role"] = node.role
        nodes.append(entry)
    return {"mesh": pcg.mesh.to_dict(), "nodes": nodes,
            "outputs": [{"name": name, "node": ident} for name, ident in zip(pcg.output_names, pcg.outputs)],
            "recompute": pcg.recompute}


@dataclass(frozen=True)
class Plan:
    graph: Graph
    machine: Machine
    devices: int
    pcg: PCG
    costs: Mapping[int, NodeCost]
    totals: Totals
    baselines: Mapping[str, Totals | None] = field(default_factory=dict)
    rules_used: tuple[str, ...] = ()
    saturation: Mapping = field(default_factory=dict)
    extraction: Mapping = field(default_factory=dict)
    pinned: Mapping[str, Degrees] = field(default_factory=dict)   # tensor name -> pinned layout (inputs and outputs)
    baseline_plans: Mapping[str, BaselinePlan] = field(default_factory=dict)  # baseline name -> its PCG
    pipeline: PipelinePlan | None = None   # the PCG cut into stages (the PCG is one stage mesh's plan)

    @property
    def cost(self) -> float:
        """Predicted seconds per training step."""
        return self.totals.time_s

    def to_dict(self) -> dict:
        dtype = self.machine.dtype_bytes
        baselines: dict[str, dict | None] = {}
        for name in BASELINES:
            found = self.baselines.get(name)
            baselines[name] = found.to_dict() if found else None
            if found and name in self.baseline_plans:
                chosen = self.baseline_plans[name]
                if chosen.pcg is not None:
                    baselines[name]["pcg"] = pcg_to_dict(chosen.pcg, chosen.costs, dtype)
                if chosen.config:
                    baselines[name]["config"] = dict(chosen.config)
        return {
            "schema": PLAN_SCHEMA, "version": PLAN_VERSION,
            "devices": self.devices, "machine": self.machine.to_dict(), "graph": self.graph.to_dict(),
            **pcg_to_dict(self.pcg, self.costs, dtype),
            "totals": self.totals.to_dict(),
            "baselines": baselines,
            "pinned_spreads": {name: degrees.to_dict() for name, degrees in self.pinned.items()},
            "rules_used": list(self.rules_used),
            "saturation": dict(self.saturation),
            "extraction": dict(self.extraction),
            **({"pipeline": self.pipeline.to_dict()} if self.pipeline else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_default)

    def save(self, path: str | Path) -> None:
        """Write the plan JSON atomically (a failed write leaves the old file whole; raises FileProblem)."""
        write_atomic(path, self.to_json() + "\n")

    def explain(self) -> str:
        return explain(self.to_dict())


def _json_default(value):
    if value == float("inf"):
        return None
    raise TypeError(type(value).__name__)


def load_plan_dict(path: str | Path) -> dict:
    """A plan file as a dict, with its schema and version checked."""
    data = read_json_file(path, PlanError, "plan")
    if not isinstance(data, dict) or data.get("schema") != PLAN_SCHEMA:
        raise PlanError(f"{path} is not a parsat plan (schema should be {PLAN_SCHEMA!r})")
    if data.get("version") not in READABLE_VERSIONS:
        raise PlanError(f"{path}: plan version {data.get('version')} is not supported (this parsat reads "
                        f"{' and '.join(map(str, READABLE_VERSIONS))})")
    validate_plan_dict(data, PlanError, f"{path} does not follow the plan schema")
    return data


def pcg_from_dict(data: Mapping) -> PCG:
    """The PCG of a plan dict, or of a baseline's `pcg` object (same node format); the dict is validated
    (`validate_plan_dict`), so a bad placement string raises PlanError."""
    mesh = Mesh.from_dict(data["mesh"])
    try:
        nodes = tuple(PNode(n["id"], n["kind"], n["op"], tuple(n["inputs"]), tuple(n["attrs"].items()),
                            tuple(n["shape"]), Degrees.from_dict(n["spread"]), n.get("role", ""),
                            n.get("origin", ""),
                            from_dtensor(n["placement"], [mesh.index(a) for a in n.get("replicated_on", [])]))
                      for n in data["nodes"])
    except (PlacementError, MeshError) as err:
        raise PlanError(str(err)) from None
    return PCG(nodes, tuple(o["node"] for o in data["outputs"]), tuple(o["name"] for o in data["outputs"]), mesh,
               data.get("recompute", NONE))


# ----------------------------------------------------------------------- explain


def _fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _spread_text(spread: Mapping) -> str:
    return str(Degrees.from_dict(spread))


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
                ALL_GATHER: f"all-gathers of {d} blocks into copies"}[node["op"]]
        counts[kind] += 1
    return ", ".join(f"{n} {kind}" for kind, n in counts.most_common())


def step_timeline(totals: Mapping) -> list[str]:
    """The simulated step as two lanes over time (`ir.costs.StepTimeline`), their overlap, and the phases."""
    step = totals["step"]
    lanes = step["lanes"]
    compute, comm, both = lanes["compute"], lanes["comm"], lanes["overlap"]
    micro = step.get("microbatches", 1)
    lines = ["", f"step timeline (simulated, {step['profile']}"
             + (f", {micro} micro-batches" if micro > 1 else "") + "): "
             "F/f forward, B/b backward, G gradient sync, O optimizer, w waiting for slower ranks",
             f"  compute |{compute}| {_fmt_time(totals['compute_busy_s'])} busy",
             f"  comm    |{comm}| {_fmt_time(totals['comm_busy_s'])} busy",
             f"  both    |{both}| {_fmt_time(totals['overlap_s'])} overlapped; communication exposed "
             f"{_fmt_time(totals['exposed_comm_s'])}",
             f"          0{_fmt_time(totals['time_s']):>{len(compute)}}",
             f"  {'phase':<12} {'from':>10} {'to':>10} {'compute':>10} {'comm':>10}"]
    for phase in step["phases"]:
        lines.append(f"  {phase['phase']:<12} {_fmt_time(phase['start_s']):>10} {_fmt_time(phase['end_s']):>10} "
                     f"{_fmt_time(phase['compute_s']):>10} {_fmt_time(phase['comm_s']):>10}")
    lines.append(f"  simulated peak memory {_fmt_bytes(step['peak_memory_bytes'])} per device")
    return lines


def explain(data: Mapping, limit: int | None = 40) -> str:
    """A readable breakdown of a plan dict: what parsat did, where the time and bytes go, the baselines.

    Long plans show the first `limit` parallel operators and nodes (None: all).
    """
    lines: list[str] = []
    graph = data["graph"]
    machine = data["machine"]
    totals = data["totals"]
    lines.append(f"plan for '{graph.get('name', 'graph')}' on {data['devices']} device(s) of {machine['name']} "
                 f"({machine['devices_per_node']} per node)")
    if "step" in totals:
        lines.append(f"  predicted step time {_fmt_time(totals['time_s'])} (simulated as {totals['step']['profile']} runs "
                     f"it; the per-node sum extraction ranks by: {_fmt_time(totals['node_sum_s'])}, of which compute "
                     f"{_fmt_time(totals['compute_s'])}, communication {_fmt_time(totals['comm_s'])})")
    else:
        lines.append(f"  predicted step time {_fmt_time(totals['time_s'])} "
                     f"(compute {_fmt_time(totals['compute_s'])}, communication {_fmt_time(totals['comm_s'])})")
    lines.append(f"  communication {totals['comm_elements']:,} elements ({_fmt_bytes(totals['comm_bytes'])}) per step, "
                 f"of which gradient sync {totals['grad_sync_elements']:,}")
    lines.append(f"  peak memory {_fmt_bytes(totals['peak_memory_bytes'])} per device (bound)")
    micro = graph.get("microbatches", 1)
    if micro != 1:
        lines.append(f"  {micro} micro-batches per step (gradient accumulation): the graph is one micro-batch, "
                     "its weights gathered and gradients synchronised once per step; memory is one micro-batch's "
                     "activations")
    if data.get("recompute", NONE) != NONE:
        lines.append(f"  {describe_recompute(data['recompute'])}: the blocks' forward runs twice per step")
    repeated = (data.get("saturation") or {}).get("repeated_blocks")
    if repeated:
        lines.append(f"  {repeated['blocks']} identical blocks, searched as {repeated['searched_blocks']}: block "
                     f"{repeated['repeated_block']}'s plan repeated for {repeated['copies']} blocks")
    mesh = Mesh.from_dict(data["mesh"])
    lines.append(f"  {'each stage: ' if data.get('pipeline') else ''}mesh {mesh if len(mesh) else 'none (one device)'}: "
                 f"{describe(pcg_from_dict(data))}")
    if data.get("pipeline"):
        lines += describe_pipeline(PipelinePlan.from_dict(data["pipeline"]), machine["devices_per_node"])
    if "step" in totals:
        lines += step_timeline(totals)
    ext = data.get("extraction") or {}
    chosen = ext.get("chosen", JOINT)
    if chosen != JOINT:
        extracted = min((v for v in (ext.get("candidates") or {}).values() if v is not None and math.isfinite(v)),
                        default=None)
        lines.append(f"  baseline {chosen}'s simulated step was faster than the plan extracted from the joint "
                     f"e-graph (which ranks by the per-node sum"
                     + (f", best extracted {_fmt_time(extracted)}" if extracted is not None else "")
                     + f"): this plan is the {chosen} baseline's PCG")
    lines.append("")
    lines.append("what parsat did:")
    nodes = {n["id"]: n for n in data["nodes"]}
    weights = {w["name"] for w in graph.get("weights", [])}
    for node in data["nodes"]:
        if node["kind"] == "leaf" and node["cost"]["collectives"]:
            lines.append(f"  #{node['id']:<4} reads input {node['op']} whole although it arrives "
                         f"{_spread_text(data.get('pinned_spreads', {}).get(node['op'], node['spread']))}; "
                         + "; ".join(node["cost"]["collectives"]))
    parallel = [n for n in data["nodes"] if n["kind"] == "parallel"]
    if limit is not None and len(parallel) > limit:
        lines.append("  in short: " + _parallel_summary(parallel, nodes, weights))
    for node in parallel[:limit]:
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
        else:
            text = f"gathers {what} along dim {attrs['dim']} from {attrs['degree']} blocks into copies"
        if "axis" in attrs:
            text += f" on mesh axis {attrs['axis']}"
        if source["kind"] == "leaf" and source["op"] in weights:
            text += " (weight" + (", gradient all-reduced every step)" if node["op"] == REPLICATE else
                                  ", stored sharded: no gradient sync)")
        collectives = node["cost"]["collectives"]
        if collectives:
            text += "; " + "; ".join(collectives)
        lines.append(f"  #{node['id']:<4} {text}")
    if limit is not None and len(parallel) > limit:
        lines.append(f"  ... {len(parallel) - limit} more parallel operators (parsat explain --all)")
    if not any(n["kind"] == "parallel" for n in data["nodes"]):
        lines.append("  nothing split: under the cost model no parallel plan is faster on this machine "
                     "(every device runs the whole step; see the baselines below)")
    if data.get("rules_used"):
        lines.append("  rules: " + ", ".join(data["rules_used"]))
    lines.append("")
    lines.append("nodes (id, operator, spread, time, communication, memory):")
    computed = [n for n in data["nodes"] if n["kind"] != "leaf" or n["cost"]["collectives"]]
    for node in computed[:limit]:
        cost = node["cost"]
        args = ", ".join(f"#{i}" if nodes[i]["kind"] != "leaf" else nodes[i]["op"] for i in node["inputs"])
        attrs = ", ".join(f"{k}={v}" for k, v in node["attrs"].items())
        label = f"{node['op']}({args}{', ' + attrs if attrs else ''})"
        origin = f" [{node['origin']}]" if node.get("origin") else ""
        lines.append(f"  #{node['id']:<4} {label:<46} {_spread_text(node['spread']):<18} "
                     f"{_fmt_time(cost['time_s']):>10} {cost['comm_elements']:>12,} el {_fmt_bytes(cost['memory_bytes']):>10}"
                     f"{origin}")
    if limit is not None and len(computed) > limit:
        lines.append(f"  ... {len(computed) - limit} more nodes (parsat explain --all)")
    lines.append("")
    lines.append("compared with (same cost model; time: the simulated step, node sum: the per-node sum):")
    header = (f"  {'plan':<14} {'time':>12} {'node sum':>12} {'exposed comm':>12} {'comm elements':>16} "
              f"{'grad sync':>14} {'memory':>12}")
    lines.append(header)

    def row(name: str, t: Mapping | None) -> str:
        if t is None:
            return f"  {name:<14} {'n/a':>12}"
        exposed = _fmt_time(t["exposed_comm_s"]) if "exposed_comm_s" in t else "-"
        return (f"  {name:<14} {_fmt_time(t['time_s']):>12} {_fmt_time(t.get('node_sum_s', t['time_s'])):>12} "
                f"{exposed:>12} {t['comm_elements']:>16,} {t['grad_sync_elements']:>14,} "
                f"{_fmt_bytes(t['peak_memory_bytes']):>12}")

    lines.append(row("parsat", totals))
    for name in BASELINES:
        lines.append(row(name, data["baselines"].get(name)))
    chosen_grid = (data["baselines"].get("best_grid") or {}).get("config")
    if chosen_grid:
        lines.append("  best_grid: " + ", ".join(f"{k} {v}" for k, v in chosen_grid.items()))
    sat = data.get("saturation") or {}
    if sat:
        lines.append("")
        lines.append(f"saturation: stopped by {sat.get('stop')} after {sat.get('iterations')} iteration(s), "
                     f"{sat.get('enodes')} e-nodes in {sat.get('eclasses')} e-classes, {sat.get('seconds', 0):.2f} s "
                     f"(+{sat.get('compile_seconds', 0):.2f} s to compile "
                     f"{sum((sat.get('rules_compiled') or {}).values())} egglog rules)")
        if sat.get("search_limit"):
            lines.append(f"search cut short: {sat['search_limit']}")
    if ext:
        lines.append(f"extraction: best by {ext.get('method')}; "
                     + ", ".join(f"{k} {_fmt_time(v) if v is not None else 'none'}"
                                 for k, v in (ext.get('candidates') or {}).items())
                     + f"; ILP {ext.get('ilp_status', '')}")
    return "\n".join(lines)


def saturation_stats(saturation: Mapping) -> str:
    """What every rule did in saturation (`parsat optimize --stats`): the rules that matched, most first,
    the rules that never fired, and the seconds each ruleset ran (docs/plan-schema.md, `saturation`)."""
    matches = dict(saturation.get("rule_matches") or {})
    seconds = saturation.get("ruleset_seconds") or {}
    lines = ["saturation statistics:"]
    if seconds:
        lines.append("  seconds per ruleset: " + ", ".join(f"{k} {_fmt_time(v)}" for k, v in seconds.items()))
    fired = sorted(((n, c) for n, c in matches.items() if c), key=lambda item: -item[1])
    lines.append(f"  matches per rule ({len(fired)} of {len(matches)} rules fired):")
    lines += [f"  {count:>10,}  {name}" for name, count in fired]
    never = [name for name, count in matches.items() if not count]
    lines.append(f"  never fired ({len(never)}): " + (", ".join(never) if never else "none"))
    return "\n".join(lines)

