"""A step whose chosen candidate does not fit ends before its plan is made, placing only what it must
(`step._first_placeable`): the candidate `assemble_plan` would choose, found in `rank`'s order."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

import parsat.search.step as step_module
from parsat.ir.placement import PlacementError
from parsat.search.baselines import Candidate


@dataclass(frozen=True)
class _Totals:
    time_s: float
    memory_bytes: int


class _Memory:
    """A step's memory judgment where nothing fits: candidates rank by the memory they need."""

    def fits(self, candidate) -> bool:
        return False

    def needs(self, candidate) -> int:
        return candidate.totals.memory_bytes

    def leanness(self, candidate) -> tuple[int, int]:   # every candidate simulated: one kind of figure
        return 0, self.needs(candidate)


class _Library:
    ops: dict = {}


@dataclass
class _Request:
    library: _Library = field(default_factory=_Library)
    built: dict = field(default_factory=dict)


@dataclass
class _Step:
    request: _Request
    memory: _Memory


def _candidate(name: str, needs: int) -> Candidate:
    return Candidate(name, object(), {}, _Totals(1.0, needs))


@pytest.fixture
def placed(monkeypatch):
    """The PCGs whose placement was worked out, in order; those in `refused` cannot be placed."""
    calls, refused = [], set()

    def derive(pcg, _ops):
        calls.append(pcg)
        if pcg in refused:
            raise PlacementError("refused")
    monkeypatch.setattr(step_module, "derive_placements", derive)
    return calls, refused


def test_places_in_rank_order_until_one_can_be_placed(placed):
    calls, refused = placed
    a, b, c, d = _candidate("joint", 3), _candidate("megatron", 1), _candidate("data_parallel", 2), \
        _candidate("best_grid", 5)
    refused.add(b.pcg)
    step = _Step(_Request(), _Memory())
    chosen = step_module._first_placeable(step, [a, b, c, d])
    assert chosen is c   # b needs least but cannot be placed; c needs least of the rest
    assert calls == [b.pcg, c.pcg]   # a and d, ranked after c, are never placed
    # the answers are kept for the plan made after (`assemble_plan` reads them from `built`)
    assert ("placed", id(b.pcg)) in step.request.built and ("placed", id(c.pcg)) in step.request.built
    assert step_module._unplaceable([a, b, c, d], step.request.library, step.request.built) == {"megatron": "refused"}
    assert calls == [b.pcg, c.pcg, a.pcg, d.pcg]   # b and c read back, not worked out again


def test_ties_go_to_the_earlier_candidate_as_min_breaks_them(placed):
    first, second = _candidate("joint", 2), _candidate("best_grid", 2)
    step = _Step(_Request(), _Memory())
    assert step_module._first_placeable(step, [first, second]) is first
    assert min([first, second], key=lambda c: step_module.rank(c, step.memory)) is first


def test_none_when_nothing_can_be_placed(placed):
    calls, refused = placed
    only = _candidate("joint", 1)
    refused.add(only.pcg)
    assert step_module._first_placeable(_Step(_Request(), _Memory()), [only]) is None
