"""Plans the backend can lay out: rules apply only at degrees where both sides put pieces on the same devices.

A rule is proved for values and spreads; two terms with one spread can
still hold their pieces on different mesh atoms (`ir.placement`), and a
compute operator whose inputs do not line up cannot run. The rule below is
true (the verifier proves it) and moves a replica set to another atom:
with it, and without the layout guard, the optimizer's best transformer
plan on 4 devices could not run.
"""

from __future__ import annotations

import pytest

from parsat.api import optimize
from parsat.dsl.checker import load_checked
from parsat.dsl.parser import parse
from parsat.dsl.typecheck import type_rule
from parsat.ir.pcg import PCG, Degrees, PNode
from parsat.ir.pcg_layout import lay_out
from parsat.ir.placement import PlacementError
from parsat.saturate import guards
from parsat.saturate import program as rule_program

MOVES_REPLICAS = """import "ops.rule"

# Proved, but its right side holds the copies on another mesh atom than its left side.
rule replicate_via_partition:
  forall x: [*a, m, *b], p: degree
  where m % p == 0
  replicate(x, p) => combine(replicate(partition(x, len(a), p), p), len(a), p)
"""


@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory):
    from parsat.dsl.library import shipped_rules_dir

    folder = tmp_path_factory.mktemp("rules")
    for path in shipped_rules_dir().glob("*.rule"):
        (folder / path.name).write_text(path.read_text())
    (folder / "moves_replicas.rule").write_text(MOVES_REPLICAS)
    return folder


def _instance(text: str, groups=None):
    library = load_checked(None)
    rule = parse(text).items[0]
    return type_rule(rule, library.ops, groups or {g: 0 for g in ("a", "b", "s")
                                                   if any(g in str(b.type) for b in rule.binders)})


def test_a_rule_that_moves_replicas_to_another_atom_is_never_compiled(rules_dir):
    library = load_checked([str(rules_dir)])
    rule = next(r for r in library.rules if r.name == "replicate_via_partition")
    program = rule_program.compile_rules(library, [rule], {2}, 4, typing_cache={})
    assert not program.rules
    (skipped,) = program.skipped
    assert "changes where pieces live" in skipped.reason and "different devices" in skipped.reason
    unguarded = rule_program.compile_rules(library, [rule], {2}, 4, typing_cache={}, placement=False)
    assert unguarded.rules   # derivability (the rule generator) still sees it


def test_nested_degrees_apply_only_where_the_atoms_come_in_the_same_order():
    """partition(x, p * q) and partition(partition(x, p), q) agree on 12 devices (2 * 2 * 3) when the p-atoms
    come first in both: p = 2, q = 2 or 3; not p = 3, q = 2 (the product takes its 2-atom first)."""
    instance = _instance("""rule nested:
  forall x: [m, n], p: degree, q: degree
  where m % (p * q) == 0
  partition(x, 0, p * q) => partition(partition(x, 0, p), 0, q)""")
    symbols, allowed = guards.layout_guard(instance, 12)
    assert symbols == ("p", "q")
    assert (2, 2) in allowed and (2, 3) in allowed and (3, 2) not in allowed
    assert guards.layout_guard(instance, 8) is None     # one prime: the order never differs


def test_plans_lay_out_with_the_guard_and_would_not_without_it(rules_dir, monkeypatch):
    ops = load_checked([str(rules_dir)]).ops
    guarded = optimize("transformer", devices=4, machine="h100x8", rules=[str(rules_dir)], allow_unverified=True)
    assert guarded.to_dict()["extraction"]["chosen"] == "joint"
    assert "unplaceable" not in guarded.to_dict()["extraction"]
    for pcg in [guarded.pcg] + [b.pcg for b in guarded.baseline_plans.values()]:
        lay_out(pcg, ops, 4)

    monkeypatch.setattr(guards, "layout_guard", lambda instance, devices: None)
    monkeypatch.setattr(rule_program, "_COMPILED_CACHE", {})
    unguarded = optimize("transformer", devices=4, machine="h100x8", rules=[str(rules_dir)], allow_unverified=True)
    extraction = unguarded.to_dict()["extraction"]
    assert "joint" in extraction["unplaceable"] and "different ranks" in extraction["unplaceable"]["joint"]
    assert extraction["chosen"] not in extraction["unplaceable"]      # what is returned still runs
    lay_out(unguarded.pcg, ops, 4)


def test_lay_out_names_the_node_whose_inputs_do_not_line_up(data_parallel_matmul):
    library = load_checked(None)
    with pytest.raises(PlacementError, match=r"at node #6, matmul: inputs are spread over different ranks"):
        lay_out(data_parallel_matmul(aligned=False), library.ops, 4)
    layouts = lay_out(data_parallel_matmul(aligned=True), library.ops, 4)
    assert layouts[6].degrees == ((2, 1), 1, 1)


def test_a_plan_whose_spreads_are_not_its_layouts_is_refused(data_parallel_matmul):
    library = load_checked(None)
    pcg = data_parallel_matmul(aligned=True)
    wrong = PCG(tuple(n if n.id != 2 else PNode(2, n.kind, n.op, n.inputs, n.attrs, n.shape, Degrees((1, 2)))
                      for n in pcg.nodes), pcg.outputs)
    with pytest.raises(PlacementError, match=r"at node #2, partition\(dim=0, degree=2\): the plan states spread"):
        lay_out(wrong, library.ops, 2)
