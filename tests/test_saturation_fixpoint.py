"""A saturation's stop reason is a promise: "saturated" means another round of every rule chunk adds nothing.

Each chunk run (`Session.run`) is three egglog runs: the shape ruleset (which on a mesh also unions each fused
operator with its steps, so it can add e-nodes), the rules' pattern halves, and their applying halves. The
runner ends a generation's place phase when no chunk run of an iteration reports a change, and counts the
e-graph for its limit checks afresh only after one did (`runner._Steps.enodes`), so a chunk run whose shape run
alone grew the e-graph must report it changed (once it did not: the applying run's report was the only one read).
"""

from __future__ import annotations

import pytest

import parsat.egraph.runner as runner_module
import parsat.egraph.saturate as saturate_module
from parsat.dsl.checker import resolve_library
from parsat.egraph.program import GROW, PLACE
from parsat.egraph.runner import STOP_SATURATED, Limits
from parsat.egraph.session import Session
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example

GPT = {"blocks": 2, "hidden": 64, "heads": 4, "batch": 8, "seq": 16, "vocab": 128}


class _Recording(Session):
    """A session that records, for every chunk run, the e-nodes before and after, what it reported, and whether
    egglog's report of the applying run (the last of the three) said the e-graph changed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.runs: list[tuple[int, int, bool, bool]] = []
        self._outputs: list = []

    def _run(self, text: str):
        outputs = super()._run(text)
        self._outputs = outputs
        return outputs

    def run(self, ruleset: str, budget: int | None = None):
        before = self.size()
        report = super().run(ruleset, budget)
        applied = bool(self._outputs[-1].report.updated)   # `size` runs after: read the applying run's first
        self.runs.append((before, self.size(), report.changed, applied))
        return report


@pytest.fixture(scope="module")
def library():
    return resolve_library(None)


def _recorded(monkeypatch) -> list[_Recording]:
    """The sessions saturation makes from now on, each a `_Recording`."""
    sessions: list[_Recording] = []

    class Kept(_Recording):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            sessions.append(self)

    monkeypatch.setattr(saturate_module, "Session", Kept)
    return sessions


def _saturated(library, mesh: tuple[int, ...], monkeypatch) -> tuple[saturate_module.SaturationResult, _Recording]:
    sessions = _recorded(monkeypatch)
    graph = build_example("gpt", GPT, library)
    result = saturate_module.saturate(graph, library, library.rules, Mesh.of(mesh), Limits(matches=10 ** 9))
    return result, sessions[-1]


@pytest.fixture(scope="module")
def checked_2x2(library):
    """The GPT saturated on the 2 x 2 mesh once for the module, recorded as both tests of that mesh read it:
    (the result, its recording session, the chunk runs as saturation left them, and every limit check's
    (e-nodes read, the e-graph's e-nodes then)).

    The two tests saturated the same graph on the same mesh under the same limits, each in its own session; one
    also watched the limit checks (`runner.reached`, which only reads the session's size: a count, no change to
    the e-graph). Saturating once with both recordings gives each the saturation it made: the limit-check test
    reads the chunk runs as a tuple taken before anyone ran more chunks, and the fixpoint test runs its extra
    round on the session after it, as before."""
    checked: list[tuple[int, int]] = []   # (the e-nodes a limit check read, the e-graph's e-nodes then)
    with pytest.MonkeyPatch.context() as patch:
        reached, sessions = runner_module.reached, _recorded(patch)

        def checking(limits, iterations, enodes, deadline):
            checked.append((enodes, Session.size(sessions[-1])))
            return reached(limits, iterations, enodes, deadline)

        patch.setattr(runner_module, "reached", checking)
        result = saturate_module.saturate(build_example("gpt", GPT, library), library, library.rules,
                                          Mesh.of((2, 2)), Limits(matches=10 ** 9))
    return result, sessions[-1], tuple(sessions[-1].runs), tuple(checked)


def test_a_chunk_run_that_grew_the_egraph_in_its_shape_run_alone_reports_a_change(checked_2x2):
    _result, _session, runs, checked = checked_2x2
    grew = [(before, after, changed, applied) for before, after, changed, applied in runs if after != before]
    shape_alone = [run for run in grew if not run[3]]
    assert shape_alone, "the case is not exercised: no chunk run grew the e-graph with its applying run unchanged"
    assert all(changed for _, _, changed, _ in grew)
    assert len(checked) > len(runs) // 2   # the checks between chunks, and after each iteration
    # every limit check read the e-graph's count, or a bound of it below the limit (`runner._Steps.at_least`),
    # which the shape run's growth is within
    assert all(read == true or true <= read < Limits().enodes for read, true in checked)


@pytest.mark.parametrize("mesh", [(2, 2), (4,)])
def test_saturated_is_a_fixpoint_another_round_of_every_chunk_adds_nothing(library, mesh, monkeypatch, request):
    if mesh == (2, 2):   # the module's 2 x 2 saturation (`checked_2x2`): the same call this test made
        result, session, _runs, _checked = request.getfixturevalue("checked_2x2")
    else:
        result, session = _saturated(library, mesh, monkeypatch)
    assert result.stop == STOP_SATURATED
    assert session.size() == result.enodes
    chunks = result.program.phase_chunks(PLACE) + result.program.phase_chunks(GROW)
    session.runs.clear()
    for chunk in chunks:
        session.run(chunk)
    assert len(session.runs) == len(chunks)
    assert not any(changed for _, _, changed, _ in session.runs)
    assert session.size() == result.enodes
