"""One search's egglog sessions, captured and replayed in order: what loading programs and graphs costs.

    .venv/bin/python benchmarks/session_replay.py capture bert-large:64 sessions.pkl
    .venv/bin/python benchmarks/session_replay.py replay sessions.pkl

`capture` runs `parsat.optimize(NAME, machine="h100x8", devices=N)` and keeps every `Session`'s arguments
(program, graph text, mesh) in order; `replay` makes those sessions again, each loaded, saturated (default
limits) and read back (snapshot, match rows), and prints the CPU seconds (`time.process_time`) of the
loads and of it all, and the peak RSS. The file replays on any tree whose `RuleProgram` it unpickles, so
two trees' loading compares on the same sessions without the rest of the search's noise.
"""

from __future__ import annotations

import pickle
import resource
import sys
import time

import parsat.egraph.session as session
from parsat.egraph.program import GROW, PLACE
from parsat.egraph.runner import Limits, run_generations


def capture(case: str, path: str) -> None:
    import parsat

    made = []
    original = session.Session.__init__

    def init(self, program, text, deadline=None, mesh=None):
        made.append((program, text, mesh))
        original(self, program, text, deadline, mesh)

    session.Session.__init__ = init
    name, devices = case.split(":")
    parsat.optimize(name, machine="h100x8", devices=int(devices))
    with open(path, "wb") as out:
        pickle.dump(made, out)
    print(f"{len(made)} sessions: " + ", ".join(f"{len(p.rules)} rules on {m or 'one device'}" for p, _, m in made))


def replay(path: str) -> None:
    with open(path, "rb") as source:
        made = pickle.load(source)
    load = 0.0
    start = time.process_time()
    for program, text, mesh in made:
        began = time.process_time()
        one = session.Session(program, text, None, mesh)
        load += time.process_time() - began
        rulesets = ("alg", "par")
        run_generations(one, program.phase_chunks(GROW, rulesets), program.phase_chunks(PLACE, rulesets), Limits(),
                        float("inf"), {}, None)
        one.snapshot()
        one.match_rows()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"{len(made)} sessions: load {load:.2f} CPU s, load + saturate + read back "
          f"{time.process_time() - start:.2f} CPU s, peak RSS {peak} MiB")


if __name__ == "__main__":
    if sys.argv[1:2] == ["capture"] and len(sys.argv) == 4:
        capture(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["replay"] and len(sys.argv) == 3:
        replay(sys.argv[2])
    else:
        sys.exit(__doc__)
