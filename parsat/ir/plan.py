"""A Plan: the chosen PCG with its predicted costs, the baselines, and how it was found.

The plan JSON (docs/plan-schema.md) is the contract with the torch backend
and other compilers: it is self-contained (the input graph with every shape,
the weights by name and shape, every node's spread, the device count and the
machine) and versioned. `parsat.report.explain` renders the same data as
text, so `parsat explain plan.json` and `parsat.explain(plan)` print the
same report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from parsat.dsl.files import write_atomic
from parsat.ir.costs import NodeCost, Totals
from parsat.ir.errors import PlanError
from parsat.ir.graph import Graph
from parsat.ir.json_files import read_json_file
from parsat.ir.machine import Machine
from parsat.ir.mesh import Mesh, MeshError
from parsat.ir.pcg import PCG, Degrees, PNode
from parsat.ir.pipeline import PipelinePlan, layout_chunks_refusal
from parsat.ir.placement import PlacementError, from_dtensor
from parsat.ir.recompute import NONE
from parsat.ir.validate import PLAN_SCHEMA, PLAN_VERSION, READABLE_VERSIONS, validate_plan_dict

BASELINES = ("data_parallel", "sequential", "megatron", "expert_parallel", "best_grid")
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
        if node.rules:
            entry["rules"] = list(node.rules)
        nodes.append(entry)
    out = {"mesh": pcg.mesh.to_dict(), "nodes": nodes,
           "outputs": [{"name": name, "node": ident} for name, ident in zip(pcg.output_names, pcg.outputs)],
           "recompute": pcg.recompute}
    if pcg.zero:
        out["zero"] = pcg.zero
    return out


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
    pinned: Mapping[str, Degrees] = field(default_factory=dict)   # tensor name -> pinned degrees (inputs and outputs)
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
        return plan_json(self.to_dict())

    def save(self, path: str | Path) -> None:
        """Write the plan JSON atomically (a failed write leaves the old file whole; raises FileProblem)."""
        save_plan_dict(path, self.to_dict())


def plan_json(data: Mapping) -> str:
    """A plan dict (`Plan.to_dict`) as the plan file's JSON."""
    return json.dumps(data, indent=2, default=_json_default)


def without_timing(value):
    """A plan dict (or any part of one) less the fields that measure time: every key holding "seconds"
    (`seconds`, `compile_seconds`, `ruleset_seconds`, ...) and every `cpu_s`. What is left is what the search
    promises to give the same for the same inputs, idle or loaded, on every rank (DESIGN: same input, same
    answer), so this is what determinism checks compare."""
    if isinstance(value, Mapping):
        return {k: without_timing(v) for k, v in value.items() if "seconds" not in k and k != "cpu_s"}
    if isinstance(value, (list, tuple)):
        return [without_timing(v) for v in value]
    return value


def save_plan_dict(path: str | Path, data: Mapping) -> None:
    """`Plan.save` of a plan dict already made: a caller that also explains the plan makes it once (a
    100,001-tensor graph's dict took 0.4 CPU s)."""
    write_atomic(path, plan_json(data) + "\n")


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
    _check_chunks(path, data.get("pipeline"))
    return data


def _check_chunks(path: str | Path, pipeline: Mapping | None) -> None:
    """A pipeline's chunks as its schedule can run them (`ir.pipeline.layout_chunks_refusal`: an interleaved one's
    chunks of equal layer counts, as Megatron runs them); PlanError with the rule's reason otherwise. Here, not in
    `ir.validate` (which checks the structure): the rule lives in `ir.pipeline`, which that module cannot import."""
    if pipeline is None:
        return
    layers = [chunk["layers"] for chunk in pipeline["layout"]["chunks"]]
    why = layout_chunks_refusal(pipeline["schedule"], pipeline["degree"], layers)
    if why is not None:
        raise PlanError(f"{path}: pipeline.layout.chunks: {why}")


def pcg_from_dict(data: Mapping) -> PCG:
    """The PCG of a plan dict, or of a baseline's `pcg` object (same node format); the dict is validated
    (`validate_plan_dict`), so a bad placement string raises PlanError."""
    mesh = Mesh.from_dict(data["mesh"])
    try:
        nodes = tuple(PNode(n["id"], n["kind"], n["op"], tuple(n["inputs"]), tuple(n["attrs"].items()),
                            tuple(n["shape"]), Degrees.from_dict(n["spread"]), n.get("role", ""),
                            n.get("origin", ""),
                            from_dtensor(n["placement"], [mesh.index(a) for a in n.get("replicated_on", [])]),
                            tuple(n.get("rules", ())))
                      for n in data["nodes"])
    except (PlacementError, MeshError) as err:
        raise PlanError(str(err)) from None
    return PCG(nodes, tuple(o["node"] for o in data["outputs"]), tuple(o["name"] for o in data["outputs"]), mesh,
               data.get("recompute", NONE), data.get("zero", 0))


