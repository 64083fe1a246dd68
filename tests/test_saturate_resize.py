"""One saturation for the micro-batch counts of a step (`egraph.resize`, `search.mesh._resized`): a saturated
e-graph taken at another graph's sizes is the e-graph saturating that graph gives, and its plan is the plan
saturating anew gives; where a guard reads the sizes differently (a batch that no longer divides among the
data-parallel devices), it is not taken."""

from __future__ import annotations

import json

import pytest

from parsat.dsl.checker import resolve_library
from parsat.egraph.resize import resized
from parsat.egraph.runner import Limits
from parsat.egraph.saturate import saturate
from parsat.egraph.snapshot import matched_classes
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example
from parsat.ir.plan import without_timing
from parsat.search.deadline import Deadline
from parsat.search.request import resolve_request, step_context
from parsat.search.step import search_step

SIZES = {"blocks": 2, "hidden": 256, "heads": 8, "seq": 128, "vocab": 1024}
MESH = Mesh.of((2, 2))


@pytest.fixture(scope="module")
def saturated(kept_programs):
    library = resolve_library(None)
    like = build_example("gpt", {**SIZES, "batch": 16}, library)
    return library, like, saturate(like, library, library.rules, MESH, Limits(), caches=kept_programs, matches=True)


def test_an_e_graph_taken_at_half_the_batch_is_the_e_graph_saturating_that_batch_gives(saturated, kept_programs):
    library, like, result = saturated
    graph = build_example("gpt", {**SIZES, "batch": 8}, library)
    taken = resized(result.snapshot, result.classes, result.program, result.pattern_rows, like, graph, library)
    fresh = saturate(graph, library, library.rules, MESH, Limits(), caches=kept_programs).snapshot
    assert taken is not None and taken.shape != result.snapshot.shape   # the batch's dims moved
    same = matched_classes(taken, fresh)
    assert len(same) == len(taken.classes) == len(fresh.classes) and taken.enodes == fresh.enodes
    assert all(taken.shape[c] == fresh.shape[same[c]] and taken.placement[c] == fresh.placement[same[c]]
               for c in same)
    # the loss's scale (1 / tokens) is a real the graphs differ in: the taken e-graph carries the new one
    scales = {a for nodes in taken.classes.values() for n in nodes if n.op == "scale" for a in n.attrs}
    assert scales == {a for nodes in fresh.classes.values() for n in nodes if n.op == "scale" for a in n.attrs}


def test_an_e_graph_is_not_taken_where_the_batch_no_longer_divides_among_the_devices(saturated, kept_programs):
    library, like, result = saturated
    graph = build_example("gpt", {**SIZES, "batch": 6}, library)   # 6 on a 2 x 2 mesh: no split over both axes
    assert resized(result.snapshot, result.classes, result.program, result.pattern_rows, like, graph,
                   library) is None
    # and rightly: saturating it gives another e-graph
    assert saturate(graph, library, library.rules, MESH, Limits(), caches=kept_programs).enodes != result.enodes


def _plan(request, microbatches: int) -> dict:
    plan = search_step(step_context(request, microbatches), Deadline.starting_now(request.limits))
    return without_timing(json.loads(plan.to_json()))


@pytest.mark.slow
def test_the_plan_of_an_e_graph_taken_from_another_micro_batch_count_is_the_plan_saturating_anew_gives():
    sizes = {**SIZES, "batch": 32}   # each micro-batch count divides among the 4 devices
    shared = resolve_request("gpt", "h100x8", None, None, 4, sizes=sizes)
    _plan(shared, 1)
    kept = sum(len(v) for k, v in shared.saturations.items() if k != "instances")
    counts = lambda: {key: len(v) for key, v in shared.saturations.items() if key != "instances"}  # noqa: E731
    saturated = counts()
    taken = _plan(shared, 2)   # every mesh's e-graph taken from the count 1's: none saturated (and kept) anew
    assert kept and counts() == saturated
    fresh = _plan(resolve_request("gpt", "h100x8", None, None, 4, sizes=sizes), 2)
    assert json.dumps(taken) == json.dumps(fresh)


def test_a_guard_is_read_as_egglog_reads_it_or_not_at_all():
    from parsat.egraph.resize import Unreadable, _Guard
    guard = _Guard(["(At2 m_x s_m s_n 0 c_x_1)", "(Lift_0123456789ab c_x_1 o_0_1)", "(= (% s_m 4) 0)",
                    "(>= (/ s_n 2) 1)"], [("root", "T"), ("m_x", "T")], "(let t0 (Op_unflatten m_x 1 (/ s_n 2)))",
                   {"Lift_0123456789ab": ((0, 0), (1, 1))})
    shapes = {7: (8, 6), 8: (6, 6), 9: (8, 1)}
    assert guard.sizes((1, 7), shapes.get) == (3,)       # the guards hold; the e-node it builds reads n / 2
    assert guard.sizes((1, 8), shapes.get) is None       # 6 rows do not split 4 ways
    assert guard.sizes((1, 9), shapes.get) is None       # 1 // 2 < 1
    # placements read as egglog reads them: free (0) where the rule acts, a lift table row on the other axis
    codes = {7: (0, 1), 8: (3, 1), 9: (0, 2)}
    assert guard.bound((1, 7), shapes.get, codes.get)["o_0_1"] == 1
    assert guard.bound((1, 8), {8: (8, 6)}.get, codes.get) is None   # sharded where the rule acts
    assert guard.bound((1, 9), {9: (8, 6)}.get, codes.get) is None   # no lift table row for partial
    with pytest.raises(Unreadable):                      # a fact of a form the module does not know
        _Guard(["(Degree p)"], [("root", "T")], "")
    with pytest.raises(Unreadable):                      # a lift table the rule does not list
        _Guard(["(Lift_0123456789ab c_x_1 o_0_1)"], [("root", "T")], "")
    with pytest.raises(Unreadable):                      # an operator `encoding.poly_expr` never writes
        _Guard(["(At1 m_x d0 0)", "(= d0 (min 1 2))"], [("root", "T"), ("m_x", "T")], "")
    with pytest.raises(Unreadable):                      # an equality egglog would read right to left
        _Guard(["(At1 m_x d0 0)", "(= d0 s_k)"], [("root", "T"), ("m_x", "T")], "").sizes((1, 7), {7: (4,)}.get)


def test_an_e_graph_is_not_taken_where_a_built_e_node_reads_a_size_that_moved(saturated, kept_programs):
    """`amax_vocab_parallel` builds `unflatten(partition(x, d, p), d, n / p)`: the vocabulary's block size is an
    e-node argument. Another vocabulary keeps the graph's structure (the sizes are in the shapes), and
    saturating it builds other e-nodes: refused (measured: on 8 matches that block size moves, and on 8
    `amax_of_block_maxima`'s guard, which reads it, decides otherwise)."""
    library, like, result = saturated
    graph = build_example("gpt", {**SIZES, "batch": 16, "vocab": 2048}, library)
    assert resized(result.snapshot, result.classes, result.program, result.pattern_rows, like, graph,
                   library) is None
    unflattens = lambda s: {n.attrs for nodes in s.classes.values() for n in nodes if n.op == "unflatten"}  # noqa: E731
    fresh = saturate(graph, library, library.rules, MESH, Limits(), caches=kept_programs).snapshot
    assert unflattens(fresh) != unflattens(result.snapshot)   # and rightly: the block sizes differ


def test_a_size_in_an_integer_attribute_is_structure():
    """A graph that holds a size in an operator's integer attribute (an `unflatten` of the batch) is another
    structure at another batch: no e-graph is even looked for."""
    from parsat.egraph.resize import structure
    from parsat.ir.graph import GraphBuilder

    def build(batch: int):
        g = GraphBuilder(resolve_library(None))
        x = g.leaf("x", (batch * 4, 8), "input")
        g.output(g.op("unflatten", x, dim=0, k=batch))
        return g.build()
    assert structure(build(2)) != structure(build(4))
    gpt = lambda batch: structure(build_example("gpt", {**SIZES, "batch": batch}))  # noqa: E731
    assert gpt(8) == gpt(16)   # where the batch is in the shapes alone


def test_a_match_whose_written_shape_is_not_its_class_s_is_refused():
    """The actions write each built term's `At` row from the match's sizes; where that is not the local shape of
    the class the term is in (a second row: the guards could read either), the guards' model fails."""
    from parsat.egraph.resize import _Guard
    from parsat.egraph.snapshot import ENode
    guard = _Guard(["(At1 m_x s_n 0)", "(= (% s_n 2) 0)"], [("root", "T"), ("m_x", "T")],
                   "(let t0 (P_partition m_x 0 0)) (Made_P_partition m_x 0 0 \"r\") (At1 t0 (/ s_n 2) 3) "
                   "(union root t0)")
    index = {ENode("partition", (7,), (0, 0)): 9}
    for local, holds in (({7: (6,), 9: (3,)}, True), ({7: (6,), 9: (4,)}, False)):
        env = guard.bound((1, 7), local.get)
        classes = guard.built_classes(env, index)
        assert classes == {"t0": 9} and guard.writes_hold(env, classes, local.get) is holds
    assert guard.built_classes(guard.bound((1, 7), {7: (6,)}.get), {}) is None   # the e-graph lacks the term
