"""Plans the backend can lay out: rules lifted onto a device mesh keep every piece where the plan says.

A rule is proved for values and spreads of whole tensors. On a mesh each
of its degrees acts on one axis, and it applies to tensors already spread
over the other axes only where both sides end in the same placement on
every axis (docs/MESH.md). The rule below is true (the verifier proves it)
but its right side would need two placements on one axis at once: it is
never lifted, on any mesh.
"""

from __future__ import annotations

import pytest

from parsat.api import optimize
from parsat.dsl.checker import load_checked
from parsat.dsl.parser import parse
from parsat.dsl.typecheck import type_rule
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example
from parsat.ir.pcg import PCG, Degrees, PNode
from parsat.ir.pcg_placement import derive_placements
from parsat.ir.placement import FREE, PARTIAL, REPLICA, Placement, PlacementError, codes_for_rank, shard
from parsat.egraph import program as rule_program
from parsat.egraph.lifting import NotLiftable, assignments, lift
from parsat.egraph.saturate import saturate

MOVES_REPLICAS = """import "ops.rule"

# Proved, but its right side holds copies of a block on the axis that blocks it.
rule replicate_via_partition:
  forall x: [*a, m, *b], p: degree
  where m % p == 0
  replicate(x, p) => combine(replicate(partition(x, len(a), p), p), len(a), p)
"""


@pytest.fixture(scope="module")
def library():
    return load_checked(None)


def _instance(library, text: str, groups=None):
    rule = parse(text).items[0]
    return type_rule(rule, library.ops, groups or {g: 0 for g in ("a", "b", "s")
                                                   if any(g in str(b.type) for b in rule.binders)})


def test_a_rule_whose_sides_place_pieces_differently_is_never_lifted(tmp_path):
    from parsat.dsl.library import shipped_rules_dir

    (tmp_path / "ops.rule").write_text((shipped_rules_dir() / "ops.rule").read_text())
    (tmp_path / "moves.rule").write_text(MOVES_REPLICAS)
    library = load_checked([str(tmp_path)])
    rule = next(r for r in library.rules if r.name == "replicate_via_partition")
    for shape in ((4,), (2, 2)):
        program = rule_program.compile_mesh_rules(library, [rule], {2}, Mesh.of(shape))
        assert not program.rules
        (skipped,) = program.skipped
        assert "does not accept its inputs" in skipped.reason, skipped.reason
    assert rule_program.compile_rules(library, [rule], {2}, 4, typing_cache={}).rules  # derivations still see it


def test_a_degree_that_is_a_product_is_not_one_axis(library):
    instance = _instance(library, """rule nested:
  forall x: [m, n], p: degree, q: degree
  where m % (p * q) == 0
  partition(x, 0, p * q) => partition(partition(x, 0, p), 0, q)""")
    with pytest.raises(NotLiftable, match="not one mesh axis"):
        assignments(instance, 2)


def test_a_lifted_rule_keeps_the_other_axis_placement(library):
    """Data parallelism of a matmul on axis 1 of a 2 x 2 mesh, its operands already split on axis 0: the other
    axis's table lists exactly the legal pre-splits, and both sides agree on each."""
    instance = _instance(library, """rule dp:
  forall x: [m, k], w: [k, n], p: degree
  where m % p == 0
  matmul(partition(x, 0, p), replicate(w, p)) => partition(matmul(x, w), 0, p)""")
    lifted = lift(instance, 2, {"p": 1}, {})
    assert lifted.target_codes[1][id(instance.lhs)] == shard(0)
    rows = {row[:2]: row[2:] for row in lifted.others[0].rows}
    assert set(rows) <= {(a, b) for a in codes_for_rank(2) for b in codes_for_rank(2)}
    # column parallelism on the other axis (x replicated, w split by columns): the result is split by columns
    assert rows[(REPLICA, shard(1))][-1] == shard(1)
    # a contraction split on the other axis: partial sums there
    assert rows[(shard(1), shard(0))][-1] == PARTIAL
    # x split by rows on the other axis, then by rows again on axis 1: rows nest, the other axis major
    assert rows[(shard(0), REPLICA)][-1] == shard(0)
    assert (FREE, shard(1)) not in rows            # an operand free where the other is split: not SPMD


def test_rules_nest_over_two_axes_and_every_plan_lays_out(library):
    result = saturate(build_example("mlp", None, library), library, library.rules, Mesh.of((2, 2), 4))
    both = [p for p in result.snapshot.placement.values() if len(p.spread_axes) == 2]
    assert both, "no value is spread over both axes: rules did not nest"
    plan = optimize("transformer", devices=4, machine="h100x8", allow_unverified=True)
    assert "unplaceable" not in plan.to_dict()["extraction"]
    for pcg in [plan.pcg] + [b.pcg for b in plan.baseline_plans.values()]:
        derive_placements(pcg, library.ops)


@pytest.fixture
def data_parallel_matmul(library):
    """matmul(partition(x, 0), w') on a 2-axis mesh, w' replicated on the same axis (aligned) or not at all."""

    def build(aligned: bool) -> PCG:
        mesh = Mesh.of((2, 2), 4, names=("dp", "tp"))
        whole = Placement((FREE, FREE))
        split = Placement((shard(0), FREE))
        copies = Placement((REPLICA, FREE))
        nodes = [PNode(0, "leaf", "x", (), (), (8, 4), Degrees((1, 1)), "input", "x", whole),
                 PNode(1, "parallel", "partition", (0,), (("dim", 0), ("axis", "dp"), ("degree", 2)), (8, 4),
                       Degrees((2, 1)), placement=split),
                 PNode(2, "leaf", "w", (), (), (4, 3), Degrees((1, 1)), "weight", "w", whole)]
        if aligned:
            nodes.append(PNode(3, "parallel", "replicate", (2,), (("axis", "dp"), ("degree", 2)), (4, 3),
                               Degrees((1, 1), 2), placement=copies))
            w = 3
        else:
            w = 2
        out = Placement((shard(0), FREE))
        nodes.append(PNode(len(nodes), "op", "matmul", (1, w), (), (8, 3), Degrees((2, 1)), placement=out))
        return PCG(tuple(nodes), (nodes[-1].id,), ("y",), mesh)

    return build


def test_lay_out_names_the_node_whose_inputs_do_not_line_up(library, data_parallel_matmul):
    with pytest.raises(PlacementError, match=r"at node #3, matmul: on mesh axis 0: matmul: inputs are split"):
        derive_placements(data_parallel_matmul(aligned=False), library.ops)
    placements = derive_placements(data_parallel_matmul(aligned=True), library.ops)
    assert placements[4] == Placement((shard(0), FREE))


def test_a_plan_whose_stated_placement_is_not_its_layout_is_refused(library, data_parallel_matmul):
    pcg = data_parallel_matmul(aligned=True)
    wrong = PCG(tuple(n if n.id != 1 else PNode(1, n.kind, n.op, n.inputs, n.attrs, n.shape, n.degrees,
                                                placement=Placement((FREE, shard(0))))
                      for n in pcg.nodes), pcg.outputs, pcg.output_names, pcg.mesh)
    with pytest.raises(PlacementError, match=r"at node #1, partition\(dim=0, axis=dp, degree=2\): the plan states"):
        derive_placements(wrong, library.ops)
    wrong = PCG(tuple(n if n.id != 1 else PNode(1, n.kind, n.op, n.inputs, n.attrs, n.shape, Degrees((1, 2)),
                                                placement=n.placement)
                      for n in pcg.nodes), pcg.outputs, pcg.output_names, pcg.mesh)
    with pytest.raises(PlacementError, match=r"states spread"):
        derive_placements(wrong, library.ops)


def test_every_class_has_one_local_shape_and_placement_row_on_two_axis_meshes(library):
    """The mesh encoding keeps a class's local sizes and placement as one flat row of `At<rank>`
    (`egraph.mesh_encoding`), a relation, so nothing merges two rows of one class the way a function's
    `:merge` did: a union of two classes of one value in different placements, or with different local
    sizes, would leave two rows, and extraction would read a piece of the wrong size. On two meshes of the
    same shape and different degrees, every class has exactly one row, every class read back has a
    placement, its global shape splits into whole blocks on the axes that shard it, and the e-nodes read
    back are the ones the runner counted."""
    from collections import Counter

    from parsat.egraph.instances import graph_signatures
    from parsat.egraph.mesh_encoding import at_relation, mesh_graph_program
    from parsat.egraph.runner import Limits, run_generations
    from parsat.egraph.session import Session

    graph = build_example("gpt", {"blocks": 1, "hidden": 64, "heads": 4, "seq": 16, "batch": 8, "vocab": 128},
                          library)
    for shape in ((4, 2), (2, 4)):
        mesh = Mesh.of(shape, 8)
        program = rule_program.compile_mesh_rules(library, library.rules, graph.ranks(), mesh,
                                                  {n.op for n in graph.nodes},
                                                  graph_signatures(graph, library.ops, None))
        text, _ = mesh_graph_program(graph, library.ops, mesh)
        session = Session(program, text, mesh=mesh)
        done = run_generations(session, program.phase_chunks(rule_program.GROW),
                               program.phase_chunks(rule_program.PLACE), Limits(), float("inf"))
        assert done.stop == "saturated"
        snapshot = session.snapshot()
        rows: Counter = Counter()
        frozen = session.egraph.freeze()
        for rank in range(9):
            for row in frozen.functions[at_relation(rank)].rows:
                rows[session.egraph.value_to_i64(row.inputs[0])] += 1
        assert set(rows) >= set(snapshot.classes) and max(rows.values()) == 1
        assert set(snapshot.placement) == set(snapshot.classes)
        for cid, placement in snapshot.placement.items():
            assert all(d >= 1 for d in placement.local_shape(snapshot.shape[cid], mesh.shape))
        assert sum(len(nodes) for nodes in snapshot.classes.values()) == done.enodes
