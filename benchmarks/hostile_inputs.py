"""The hostile inputs of issue 20, each run as a fresh `parsat` process: exit code, wall seconds, peak memory.

    .venv/bin/python benchmarks/hostile_inputs.py            # the table recorded in benchmarks/RELIABILITY.md

Every case must end with exit 1 or 2 (a refusal), no Python traceback,
before its timeout and under 2 GiB resident (the tests' `run_cli`: wait4's
ru_maxrss of the parsat process alone); the script says FAIL otherwise. The same classes are asserted by
tests/test_reliability_hostile.py; this script records the figures.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from test_reliability_hostile import run_cli  # noqa: E402 - the tests' runner: its peak memory is the process's own


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
    del nodes, chain
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
        outcome = run_cli(args, timeout, cwd=work, env={**os.environ, **env[0]} if env else None)
        code, seconds, rss, out = outcome.code, outcome.seconds, outcome.max_rss, outcome.out + outcome.err
        lines = out.strip().splitlines()
        last = next((line for line in lines if "error:" in line or "must be" in line), lines[-1] if lines else "")
        ok = code in (1, 2) and "Traceback" not in out and seconds < timeout and rss < 2 * 2 ** 30
        failed += not ok
        message = (last if len(last) < 150 else last[:147] + "...").replace("|", "\\|")
        print(f"| `{label}` | {code} | {seconds:.1f} | {rss / 2 ** 20:.0f} | {message}{'' if ok else ' **FAIL**'} |",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
