"""Issue 29, item 4: before PROVED, random instances at ranks up to 8 and dims up to 12 run on the devices.

A rank-polymorphic rule is proved at a few group lengths and generalized
by an argument (`verifier.ranks`); `crosscheck.devices_disagree` checks
the result far from where the proof looked, and a disagreement makes the
verdict UNKNOWN with a bug report, never PROVED.
"""

from __future__ import annotations

from parsat.dsl.library import load_library
from parsat.dsl.parser import parse
from parsat.verifier import core, crosscheck
from parsat.verifier.verdict import PROVED, UNKNOWN

OPS = load_library(None, strict=False)[0].ops


def _rule(text: str, name: str = "r"):
    return parse(f"rule {name}:\n" + text).rules[0]


RELU_SPLIT = "forall x: [*a, n, *b], p: degree\n  where n % p == 0\n  relu(x) => combine(relu(partition(x, len(a), p)), len(a), p)"


def _rank(instance) -> int:
    return max(len(shape) for shape in instance.tensors.values())


def test_the_instances_reach_rank_8_and_a_dim_of_12():
    drawn = list(crosscheck.large_instances(_rule(RELU_SPLIT), OPS))
    assert len(drawn) == crosscheck.LARGE_TRIALS
    assert max(_rank(instance) for instance, _, _ in drawn) == crosscheck.LARGE_MAX_RANK == 8
    assert any(max(sizes.values()) >= crosscheck.LARGE_MAX_SIZE == 12 for _, sizes, _ in drawn)
    for instance, sizes, _ in drawn:
        assert crosscheck.concrete._elements(instance, sizes) <= crosscheck.LARGE_MAX_ELEMENTS


def test_a_bounded_claim_is_checked_only_up_to_its_rank():
    drawn = list(crosscheck.large_instances(_rule(RELU_SPLIT), OPS, max_rank=5))
    assert drawn and max(_rank(instance) for instance, _, _ in drawn) <= 5


def test_the_draws_are_reproducible():
    first = [(dict(i.groups), s) for i, s, _ in crosscheck.large_instances(_rule(RELU_SPLIT), OPS)]
    again = [(dict(i.groups), s) for i, s, _ in crosscheck.large_instances(_rule(RELU_SPLIT), OPS)]
    assert first == again


def test_a_true_rule_agrees_everywhere():
    assert crosscheck.devices_disagree(_rule(RELU_SPLIT), OPS) == ""


def test_sizes_that_divide_by_an_int_of_0_are_not_drawn():
    """A grouped convolution's kernel is [o, c / groups, r, s] with `groups` an int: a draw of groups = 0 leaves
    the shape undefined (the `where` excludes it); it is skipped, not an internal error."""
    library = load_library()[0]
    rule = next(r for r in library.rules if r.name == "conv2d_grouped_batch_parallel")
    drawn = list(crosscheck.large_instances(rule, library.ops))
    assert drawn and all(sizes["groups"] >= 1 for _, sizes, _ in drawn)
    assert crosscheck.devices_disagree(rule, library.ops) == ""


def test_a_rule_wrong_only_from_rank_7_is_caught():
    """`len(a) % 6` is `len(a)` up to rank 6: a proof at small lengths would miss it, the devices do not."""
    wrong = _rule("forall x: [*a, n]\n  softmax(x, len(a)) => softmax(x, len(a) % 6)")
    found = crosscheck.devices_disagree(wrong, OPS)
    assert "the devices refute it" in found and ("len(a) = 6" in found or "len(a) = 7" in found)


def test_a_disagreement_makes_a_proof_unknown(monkeypatch):
    rule = _rule(RELU_SPLIT, "relu_split")
    assert core.verify_rule(rule, OPS).verdict == PROVED
    monkeypatch.setattr(crosscheck, "devices_disagree",
                        lambda *_args, **_kw: "at a random instance (len(a) = 7) the devices refute it: planted")
    verdict = core.verify_rule(rule, OPS)
    assert verdict.verdict == UNKNOWN
    assert "planted" in verdict.reason and "please report it" in verdict.reason and verdict.notes
