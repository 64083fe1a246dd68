"""Same input, same plan: `parsat optimize` run idle and beside two busy CPU loops, the plans compared byte for byte.

    .venv/bin/python benchmarks/search_determinism.py -- bert-large --devices 8 --machine h100x8
    .venv/bin/python benchmarks/search_determinism.py -- gpt --set blocks=2 --set hidden=64 --set heads=4 \
        --set batch=8 --set seq=32 --set vocab=256 --devices 4 --machine cpu --degrees dp=2,tp=2

Each run is a fresh `parsat optimize ... -o FILE` process with the default
limits unless the arguments say otherwise; the second runs while two
`python -c 'while True: pass'` processes hold the box's cores (2 here), so
it gets about a third of the CPU the first had. The plans' JSON is compared
with every field whose name holds "seconds" removed (the only fields that
measure time), serialized in the plan's own key order (its pipeline search's
`tried` trace included). The two processes hash strings differently
(`PYTHONHASHSEED` 0 and 1), so an answer that followed the iteration order of
a set or dict of strings would show too. Prints the CPU seconds of each run,
the stop reasons, and IDENTICAL or where they differ.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from parsat.ir.plan import without_timing

PARSAT = [sys.executable, "-m", "parsat", "optimize"]


SEEDS = ("0", "1")   # PYTHONHASHSEED of the idle run and of the busy one


def run(args: list[str], out: Path, busy: bool, seed: str) -> float:
    """CPU seconds of one `parsat optimize` process (children's rusage) hashing with PYTHONHASHSEED `seed`, with or
    without two busy loops beside."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)] if busy else []
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(PARSAT + args + ["-q", "-o", str(out)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        after = resource.getrusage(resource.RUSAGE_CHILDREN)   # before the loops are reaped: theirs not counted
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    if done.returncode:
        sys.exit(f"parsat optimize failed: {done.stderr.strip()[-2000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str]) -> int:
    args = argv[argv.index("--") + 1:] if "--" in argv else argv
    with tempfile.TemporaryDirectory() as folder:
        idle, loaded = Path(folder, "idle.json"), Path(folder, "busy.json")
        cpu_idle = run(args, idle, busy=False, seed=SEEDS[0])
        cpu_busy = run(args, loaded, busy=True, seed=SEEDS[1])
        a, b = (json.loads(p.read_text()) for p in (idle, loaded))
    same = json.dumps(without_timing(a)) == json.dumps(without_timing(b))
    print(f"parsat optimize {' '.join(args)}")
    for label, cpu, plan in ((f"idle, hash seed {SEEDS[0]}:", cpu_idle, a),
                             (f"two busy loops, hash seed {SEEDS[1]}:", cpu_busy, b)):
        print(f"  {label:30s} {cpu:7.1f} CPU s, stop {plan['saturation'].get('stop')}, "
              f"{plan['saturation'].get('enodes')} e-nodes, step {plan['totals']['time_s'] * 1e3:.3f} ms, "
              f"{len(plan['saturation'].get('pipeline_search') or ())} entries in its pipeline trace")
    print("  plans (timing fields aside): " + ("IDENTICAL, byte for byte" if same else "DIFFERENT"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
