"""Issue 29, item 6: every node of a plan names the rules (file:line) whose rewrites produced it.

A node's `rules` are the makers of its e-node and the rules that equated its
class with an existing term (a rule whose right side is a metavariable
builds nothing, so only that row can name it); `rules_used` names both
kinds. Removing a rule a node names from the library makes the plan
impossible: the saturated e-graph without it no longer holds the plan.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from parsat.api import optimize
from parsat.dsl.library import load_library
from parsat.egraph.encoding import PIN_SUFFIX
from parsat.egraph.runner import Limits
from parsat.egraph.saturate import saturate
from parsat.ir.machine import Machine
from parsat.ir.models import build_example
from parsat.ir.pcg import PCG
from parsat.ir.plan import load_plan_dict, pcg_from_dict
from parsat.egraph.snapshot import Snapshot
from parsat.search.solve import solve

MLP_RULES = Path(__file__).parent / "rules_for_saturate" / "mlp.rule"
SHOWN = re.compile(r"^(\w+) \((.+):(\d+)\)$")


def _library(text: str, folder: Path):
    path = folder / "mlp.rule"
    path.write_text(text)
    return load_library([path])[0]


def _without(text: str, name: str) -> str:
    """The rule file with rule `name` (its `rule` line up to the next blank line) taken out."""
    return re.sub(rf"(?ms)^rule {name}:\n.*?(?:\n\n|\Z)", "\n", text)


def _plan(library):
    return optimize("mlp", machine="cpu", devices=2, rules=library, allow_unverified=True, baselines=False)


def _holds(snapshot: Snapshot, pcg: PCG) -> bool:
    """Whether the e-graph holds every node of the PCG: an e-node of the same operator over classes that hold
    its inputs, in a class with the node's placement (attributes are not compared, so this may say yes where
    the plan is not there; it never says no where it is)."""
    found: dict[int, set[int]] = {}
    for node in pcg.nodes:
        found[node.id] = {cid for cid, enodes in snapshot.classes.items()
                          if snapshot.placement.get(cid) == node.placement
                          and any(_same(enode, node, found) for enode in enodes)}
        if not found[node.id]:
            return False
    return True


def _same(enode, node, found) -> bool:
    if node.kind == "leaf":
        return enode.op == "leaf" and enode.attrs[0].removesuffix(PIN_SUFFIX) == node.op
    return (enode.op == node.op and len(enode.children) == len(node.inputs)
            and all(child in found[i] for child, i in zip(enode.children, node.inputs)))


def _saturated(library):
    graph = build_example("mlp", library=library)
    return graph, saturate(graph, library, library.rules, 2, Limits())


def test_each_rewritten_node_names_its_rules_with_file_and_line(tmp_path):
    text = MLP_RULES.read_text()
    plan = _plan(_library(text, tmp_path))
    path = tmp_path / "plan.json"
    plan.save(path)
    data = load_plan_dict(path)
    lines = (tmp_path / "mlp.rule").read_text().splitlines()
    named = [n for n in data["nodes"] if n.get("rules")]
    assert named, "the 2-device MLP plan has nodes that rules produced"
    for node in named:
        for shown in node["rules"]:
            name, file, line = SHOWN.match(shown).groups()
            assert Path(file).resolve() == (tmp_path / "mlp.rule").resolve()
            assert lines[int(line) - 1] == f"rule {name}:"
    assert all(not n.get("rules") for n in data["nodes"] if n["kind"] == "leaf")
    everywhere = {SHOWN.match(s).group(1) for n in named for s in n["rules"]}
    assert set(plan.rules_used) <= everywhere
    assert pcg_from_dict(data).nodes == plan.pcg.nodes  # the rules survive a round trip


def test_a_rule_that_builds_nothing_is_named(tmp_path):
    """`combine(partition(x, d, p), d, p) => x` makes no e-node: only its equation can name it."""
    library = _library(MLP_RULES.read_text(), tmp_path)
    graph, result = _saturated(library)
    roots = [result.classes[n] for n in graph.outputs]
    machine = Machine.preset("cpu").with_devices(2)
    _pcg, _costs, extraction = solve(result, graph, library, machine, roots, Limits(), True)
    snapshot = result.snapshot
    chosen = [snapshot.classes[c][i] for c, i in extraction.choice.items()]
    assert not any("combine_partition" in snapshot.makers(node) for node in chosen)
    plan = _plan(library)
    assert "combine_partition" in plan.rules_used
    assert any(s.startswith("combine_partition (") for n in plan.pcg.nodes for s in n.rules)


@pytest.mark.parametrize("removed", ["relu_split", "row_matmul"])
def test_without_a_rule_a_node_names_the_plan_cannot_be_produced(tmp_path, removed):
    text = MLP_RULES.read_text()
    library = _library(text, tmp_path)
    plan = _plan(library)
    assert any(s.startswith(removed + " (") for n in plan.pcg.nodes for s in n.rules)
    _, full = _saturated(library)
    assert _holds(full.snapshot, plan.pcg), "the matcher finds the plan in its own e-graph"

    (tmp_path / "smaller").mkdir()
    smaller = _library(_without(text, removed), tmp_path / "smaller")
    assert removed not in {r.name for r in smaller.rules} and len(smaller.rules) == len(library.rules) - 1
    _, cut = _saturated(smaller)
    assert not _holds(cut.snapshot, plan.pcg)
    again = _plan(smaller)
    assert again.pcg.nodes != plan.pcg.nodes
    assert not any(s.startswith(removed + " (") for n in again.pcg.nodes for s in n.rules)
