"""The hostile inputs of issue 20, each run as a fresh `parsat` process: exit code, wall seconds, peak memory.

    .venv/bin/python benchmarks/hostile_inputs.py            # the table recorded in benchmarks/RELIABILITY.md

Every case must end with exit 1 or 2 (a refusal), no Python traceback,
before its timeout and under 2 GiB resident (`wait4`'s ru_maxrss); the
script says FAIL otherwise. The same classes are asserted by
tests/test_reliability_hostile.py; this script records the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# `parsat` is started from this small parent, so that wait4's peak is that process's own (a child's count
# starts from its parent's size at fork, and this script holds a 749k-node graph in memory at times).
_MEASURE = """
import os, signal, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
signal.signal(signal.SIGTERM, lambda *_: child.kill())
_, status, usage = os.wait4(child.pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(args: list[str], timeout: float, cwd: Path, env: dict | None = None) -> tuple[int, float, int, str]:
    """(exit code, wall seconds, peak resident bytes of the parsat process, output); ended at `timeout`."""
    rss = cwd / "peak.rss"
    proc = subprocess.Popen([sys.executable, "-c", _MEASURE, str(rss), sys.executable, "-m", "parsat", *args],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=None if env is None else {**os.environ, **env})
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate()
    seconds = time.monotonic() - start
    return proc.returncode, seconds, int(rss.read_text() or 0), out.decode(errors="replace")


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="parsat-hostile-"))
    os.mkfifo(work / "pipe.json")
    os.mkfifo(work / "pipe.rule")
    (work / "environ.rule").write_text('import "/proc/self/environ"\n')
    (work / "bigint.rule").write_text('import "ops.rule"\nrule big: forall x: [n] where n > ' + "9" * 5000
                                      + " relu(x) => relu(x)\n")
    rule = "rule r{i}: forall x: [n] relu(relu(x)) => relu(x)\n"
    with open(work / "ten_mb.rule", "w") as handle:
        handle.write('import "ops.rule"\n')
        for i in range(10 * 2 ** 20 // len(rule)):
            handle.write(rule.format(i=i))
    n = 749_000
    nodes = [{"name": f"n{i}", "op": "relu", "inputs": [f"n{i - 1}" if i else "x"]} for i in range(n)]
    chain = {"name": "chain", "inputs": [{"name": "x", "shape": [8, 8]}], "nodes": nodes, "outputs": [f"n{n - 1}"]}
    (work / "chain749k.json").write_text(json.dumps(chain))
    (work / "chain250k.json").write_text(json.dumps({**chain, "nodes": nodes[:250_000], "outputs": ["n249999"]}))
    n = (32 * 2 ** 20 - 2) // 3
    (work / "dicts.json").write_text("[" + "{}," * (n - 1) + "{}]")
    cases = [
        ("optimize /dev/zero", ["optimize", "/dev/zero", "-q"], 60),
        ("explain /dev/zero", ["explain", "/dev/zero"], 60),
        ("optimize mlp --machine /dev/zero", ["optimize", "mlp", "--machine", "/dev/zero", "-q"], 60),
        ("optimize pipe.json (named pipe)", ["optimize", "pipe.json", "-q"], 60),
        ("run pipe.json --nproc 2", ["run", "pipe.json", "--nproc", "2"], 60),
        ("check pipe.rule", ["check", "pipe.rule"], 60),
        ("check environ.rule (import /proc/self/environ)", ["check", "environ.rule"], 60),
        ("check bigint.rule (5,000 digits)", ["check", "bigint.rule"], 60),
        ("check ten_mb.rule (10 MB of rules)", ["check", "ten_mb.rule"], 60),
        ("check /", ["check", "/"], 60),
        ("optimize dicts.json (32 MiB of {})", ["optimize", "dicts.json", "-q"], 120),
        ("optimize chain749k.json (43 MB)", ["optimize", "chain749k.json", "-q"], 120),
        ("optimize chain749k.json, PARSAT_MAX_INPUT_BYTES=67108864", ["optimize", "chain749k.json", "-q"], 120,
         {"PARSAT_MAX_INPUT_BYTES": str(64 * 2 ** 20)}),
        ("optimize chain250k.json", ["optimize", "chain250k.json", "-q"], 120),
        ("optimize stack --set blocks=10000", ["optimize", "stack", "--set", "blocks=10000", "-q"], 180),
        ("optimize stack --set blocks=10000 --limit enodes=10000000 --limit seconds=20",
         ["optimize", "stack", "--set", "blocks=10000", "--limit", "enodes=10000000", "--limit", "seconds=20", "-q"],
         180),
        ("optimize stack --set blocks=2000 --limit enodes=10000000 --limit seconds=5",
         ["optimize", "stack", "--set", "blocks=2000", "--limit", "enodes=10000000", "--limit", "seconds=5", "-q"],
         180),
        ("optimize mlp --set batch=99999999999999999999",
         ["optimize", "mlp", "--set", "batch=99999999999999999999", "-q"], 60),
        ("optimize mlp --limit seconds=0", ["optimize", "mlp", "--limit", "seconds=0", "-q"], 60),
        ("optimize mlp --limit iterations=0", ["optimize", "mlp", "--limit", "iterations=0", "-q"], 60),
        ("verify --timeout nan", ["verify", "--timeout", "nan"], 60),
    ]
    failed = 0
    print("| input | exit | wall s | peak RSS MiB | message |")
    print("|---|---|---|---|---|")
    for label, args, timeout, *env in cases:
        code, seconds, rss, out = run_measured(args, timeout, work, env[0] if env else None)
        lines = out.strip().splitlines()
        last = next((line for line in lines if "error" in line), lines[-1] if lines else "")
        ok = code in (1, 2) and "Traceback" not in out and seconds < timeout and rss < 2 * 2 ** 30
        failed += not ok
        message = (last if len(last) < 150 else last[:147] + "...").replace("|", "\\|")
        print(f"| `{label}` | {code} | {seconds:.1f} | {rss / 2 ** 20:.0f} | {message}{'' if ok else ' **FAIL**'} |",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
