"""The hostile inputs of issues 20 and 33, each run as a fresh `parsat` process: exit code, wall seconds, peak memory.

    .venv/bin/python benchmarks/hostile_inputs.py            # every case: benchmarks/hostile_inputs_results.md
    .venv/bin/python benchmarks/hostile_inputs.py --round 3  # issue 33's cases only
    .venv/bin/python benchmarks/hostile_inputs.py --only chain100k --only microbatches  # the cases so labelled

Every case must end with exit 1 or 2 (a refusal; 0 where the input is
merely large and parsat handles it), no Python traceback, before its
timeout and under 2 GiB resident (the tests' `run_cli`: wait4's ru_maxrss
of the parsat process alone); the script says FAIL otherwise. Issue 33
adds, besides its own inputs, every bound of `parsat.dsl.bounds` at four
values past it (below, above, NaN, infinity), and signals: SIGINT, SIGTERM
and SIGHUP sent to commands at work, which must end within 20 s (the
handler's own promise is a second) with 130, 143 or 129, leaving no
process in their group and no temporary file. The same classes are
asserted by tests/test_reliability_hostile.py and
tests/test_reliability_round3.py; this script records the figures.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from test_reliability_hostile import run_cli  # noqa: E402 - the tests' runner: its peak memory is the process's own

from parsat.dsl.bounds import BOUNDS  # noqa: E402

SIGNAL_CEILING_S = 20.0


def issue20_cases(work: Path) -> list[tuple]:
    """Issue 20's inputs: files that are not files, files past their caps, graphs past the e-graph's limits."""
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
    return cases


def issue33_cases(work: Path) -> list[tuple]:
    """Issue 33's inputs: numbers that asked for unbounded work, rule files that ended in tracebacks, files whose
    messages were Python's, a graph of 100,001 tensors, and a `dot` that never finishes."""
    rule = 'import "ops.rule"\nrule big: forall x: [n] scale(x, {0}) => scale(x, {0})\n'
    for name, literal in (("huge", "1e99999999"), ("digits", "1e999999"), ("tiny", "1e-999999"),
                          ("above", "1e300"), ("below", "1e-1001")):
        (work / f"literal_{name}.rule").write_text(rule.format(literal))
    (work / "long_import.rule").write_text('import "' + "a" * 5000 + '.rule"\n')
    (work / "chain").mkdir()
    for i in range(1200):
        (work / "chain" / f"c{i}.rule").write_text(f'import "{f"c{i + 1}.rule" if i < 1199 else "ops.rule"}"\n')
    from parsat.ir.machine import Machine

    for name, edit in (("missing", lambda d: d.pop("peak_flops")), ("evil", lambda d: d.update(evil=1)),
                       ("tiny", lambda d: d.update(memory_capacity=1024)),
                       ("text", lambda d: d.update(nodes="two")),
                       ("over", lambda d: d.update(oversubscribed={"ranks": 8, "cores": 2})),
                       ("over_bad", lambda d: d.update(oversubscribed={"ranks": 2, "cores": 2}))):
        data = Machine.preset("h100x8").to_dict()
        edit(data)
        (work / f"machine_{name}.json").write_text(json.dumps(data))
    graph = {"name": "g", "inputs": [{"name": "x", "shape": [8, 8]}],
             "nodes": [{"name": "y", "op": "relu", "inputs": ["x"]}], "outputs": ["y"]}
    (work / "newline_name.json").write_text(json.dumps({**graph, "name": "g\nparsat: error: forged"}))
    (work / "escape_name.json").write_text(json.dumps({**graph, "name": "g\x1b[2J\u202e"}))
    n = 100_000
    nodes = [{"name": f"n{i}", "op": "relu", "inputs": [f"n{i - 1}" if i else "x"]} for i in range(n)]
    (work / "chain100k.json").write_text(json.dumps({**graph, "name": "chain", "nodes": nodes,
                                                     "outputs": [f"n{n - 1}"]}))
    slow_dot = work / "bin" / "dot"
    slow_dot.parent.mkdir()
    slow_dot.write_text("#!/bin/sh\nexec sleep 600\n")
    slow_dot.chmod(0o755)
    slow_path = {"PATH": f"{slow_dot.parent}{os.pathsep}{os.environ['PATH']}"}
    ok = (0, 1, 2)
    return [
        ("optimize mlp -n 1000000000", ["optimize", "mlp", "-n", "1000000000", "-q"], 60),
        ("optimize mlp -n 10**30", ["optimize", "mlp", "-n", str(10 ** 30), "-q"], 60),
        ("optimize stack --set blocks=1000000000 --microbatches 2",
         ["optimize", "stack", "--set", "blocks=1000000000", "--microbatches", "2", "-q"], 60),
        ("calibrate --size 100000 under ulimit -v 6G", ["calibrate", "-m", "box", "-o", "cal.json", "--size", "100000"],
         60, None, (1, 2), _address_space(6 * 2 ** 30)),
        ("calibrate --size 4096 under ulimit -v 6G", ["calibrate", "-m", "box", "-o", "cal.json", "--size", "4096"],
         60, None, (1, 2), _address_space(6 * 2 ** 30)),
        ("calibrate --nproc 8 (more ranks than cores)", ["calibrate", "-m", "box", "-o", "cal.json", "--nproc", "8"],
         60),
        *[(f"{command} literal_{name}.rule", [command, f"literal_{name}.rule"], 60)
          for command in ("check", "verify") for name in ("huge", "digits", "tiny", "above", "below")],
        ("check long_import.rule (5,000-character path)", ["check", "long_import.rule"], 60),
        ("check chain/c0.rule (1,200 imports)", ["check", "chain/c0.rule"], 60, None, ok),
        ("verify chain/c0.rule (1,200 imports)", ["verify", "chain/c0.rule"], 60, None, ok),
        ("run --collective-timeout inf", ["run", "absent.json", "--nproc", "2", "--collective-timeout", "inf"], 60),
        ("run --collective-timeout 1e308", ["run", "absent.json", "--nproc", "2", "--collective-timeout", "1e308"], 60),
        *[(f"optimize mlp --machine machine_{name}.json", ["optimize", "mlp", "-q", "--machine",
                                                            f"machine_{name}.json"], 60)
          for name in ("missing", "evil", "tiny", "text", "over_bad")],
        ("optimize mlp --machine machine_over.json (measured oversubscribed: one warning line)",
         ["optimize", "mlp", "-n", "2", "-q", "--no-baselines", "--machine", "machine_over.json"], 60, None, ok),
        ("calibrate --nproc 4 --oversubscribe (the file records it)",
         ["calibrate", "-m", "box", "-o", "cal_over.json", "--nproc", "4", "--oversubscribe", "--size", "32",
          "--repeats", "1", "--window", "0.002", "--comm-elements", "16", "4096"], 180, None, ok),
        ("optimize mlp --machine cal_over.json (written oversubscribed: one warning line)",
         ["optimize", "mlp", "-n", "2", "-q", "--no-baselines", "--machine", "cal_over.json"], 60, None, ok),
        *[(f"optimize mlp --microbatches {value}", ["optimize", "mlp", "-n", "2", "-q", "--microbatches", value], 60)
          for value in ("-5", "3", str(10 ** 30), "1.5")],
        ("optimize chain100k.json --limit seconds=20 (100,001 tensors)",
         ["optimize", "chain100k.json", "-n", "2", "-q", "--limit", "seconds=20"], 60),
        ("optimize stack --set blocks=100 --limit seconds=3 (a plan, near the limit)",
         ["optimize", "stack", "--set", "blocks=100", "-n", "2", "-q", "--no-baselines", "--limit", "seconds=3"], 60,
         None, ok),
        ("optimize newline_name.json", ["optimize", "newline_name.json", "-q"], 60),
        ("optimize escape_name.json -o escape_plan.json", ["optimize", "escape_name.json", "-o", "escape_plan.json"],
         60, None, ok),
        ("optimize chain100k.json (100,001 tensors)", ["optimize", "chain100k.json", "-n", "2", "--no-baselines",
                                                      "-o", "chain100k_plan.json"], 180, None, ok),
        ("optimize mlp -o mlp_plan.json (for show)", ["optimize", "mlp", "-n", "2", "-q", "-o", "mlp_plan.json"], 60,
         None, ok),
        ("show mlp_plan.json with a dot that never ends, --timeout 2",
         ["show", "mlp_plan.json", "-o", "mlp.svg", "--timeout", "2"], 60, slow_path),
    ]


def _address_space(limit: int):
    """A preexec that sets `ulimit -v` for the command."""
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


_BASE = {"run": ["run", "absent.json", "--nproc", "2"], "calibrate": ["calibrate", "-m", "box", "-o", "cal.json"],
         "verify": ["verify"], "generate": ["generate", "--ops", "relu", "-o", "new.rule"],
         "show": ["show", "absent.json", "-o", "x.svg"], "optimize": ["optimize", "mlp", "-q"]}


API_ONLY = {("calibrate", "--timeout")}
"""Bounds of the Python API that no command-line flag reaches (`calibrate(timeout_s=...)`)."""


def bound_cases() -> list[tuple]:
    """Every bound of `parsat.dsl.bounds` given four values past it: below, above, NaN and infinity."""
    cases = []
    for (command, flag), bound in BOUNDS.items():
        if (command, flag) in API_ONLY:
            continue
        below = bound.low if bound.above else (bound.low - 1 if bound.whole else bound.low - 0.5)
        above = bound.high + 1 if bound.whole else bound.high * 10
        values = [_number(below), _number(above), "nan", "inf"] if bound.high < 1e300 else ["nan", "inf", "-inf",
                                                                                            "1e309"]
        for value in values:
            if flag.startswith("--limit "):
                args = [*_BASE[command], "--limit", f"{flag.split()[1]}={value}"]
            elif flag in ("--degrees",):
                args = [*_BASE[command], flag, f"2,{value}"]
            elif flag == "--comm-elements":
                args = [*_BASE[command], flag, "1", value]
            else:
                args = [*_BASE[command], flag, value]
            cases.append((f"{command} {flag} {value}", args, 60))
    return cases


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def signal_cases(work: Path) -> list[tuple[str, list[str], signal.Signals, float]]:
    """Commands at work and the signal each is sent after `wait` seconds."""
    cases = []
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        cases += [(f"verify --jobs 2 (cold cache), {signum.name}", ["verify", "--jobs", "2"], signum, 4.0),
                  (f"optimize gpt -n 8, {signum.name}", ["optimize", "gpt", "-n", "8", "-q", "-o", "sig_plan.json"],
                   signum, 4.0),
                  (f"generate --ops relu,add, {signum.name}",
                   ["generate", "--ops", "relu,add", "--jobs", "2", "-o", "sig_new.rule"], signum, 4.0),
                  (f"run mlp_plan.json --nproc 2, {signum.name}",
                   ["run", "mlp_plan.json", "--nproc", "2", "--steps", "100000000"], signum, 8.0)]
    return cases


def run_signal(work: Path, label: str, args: list[str], signum: signal.Signals, wait: float) -> tuple[bool, str]:
    """One signal case: its row, and whether it ended as it must (status 128 + signal, or 0 or 1 for a command
    that had already finished; no process left in its group; no temporary file in the folder or the cache)."""
    env = {**os.environ, "PARSAT_CACHE_DIR": str(Path(tempfile.mkdtemp(prefix="cache-", dir=work)))}
    before = set(work.rglob("*"))
    proc = subprocess.Popen([sys.executable, "-m", "parsat", *args], cwd=work, env=env, start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(wait)
    sent = time.monotonic()
    proc.send_signal(signum)
    try:
        _out, err = proc.communicate(timeout=SIGNAL_CEILING_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _out, err = proc.communicate()
    seconds = time.monotonic() - sent
    left = _live_in_group(proc.pid)
    partial = [p.name for p in set(work.rglob("*")) - before if ".tmp" in p.name or p.name.startswith(".")]
    text = err.decode(errors="replace")
    ok = (proc.returncode in (128 + signum, 0, 1) and seconds < SIGNAL_CEILING_S and not left and not partial
          and "Traceback" not in text)
    message = (text.strip().splitlines() or [""])[-1][:140].replace("|", "\\|")
    extra = (f" left: {left}" if left else "") + (f" partial: {partial}" if partial else "")
    return ok, (f"| `{label}` | {proc.returncode} | {seconds:.2f} | {len(left)} | {message}{extra}"
                f"{'' if ok else ' **FAIL**'} |")


def _live_in_group(pgid: int) -> list[str]:
    """The processes of the group still running, after a moment for the last to be reaped."""
    for _ in range(50):
        out = subprocess.run(["ps", "-o", "stat=,args=", "-g", str(pgid)], capture_output=True, text=True).stdout
        live = [line.strip() for line in out.splitlines() if line.strip() and not line.strip().startswith("Z")]
        if not live:
            return []
        time.sleep(0.1)
    return live


def run_table(work: Path, cases: list[tuple], only: Sequence[str] = ()) -> int:
    """Each case as a row of the table (only those whose label holds one of `only`, when given); the number
    that failed."""
    failed = 0
    print("| input | exit | wall s | peak RSS MiB | message |")
    print("|---|---|---|---|---|")
    for label, args, timeout, *more in cases:
        if only and not any(word in label for word in only):
            continue
        env, codes, preexec = _defaults(more)
        outcome = run_cli(args, timeout, cwd=work, env={**os.environ, **env} if env else None, preexec=preexec)
        code, seconds, rss, out = outcome.code, outcome.seconds, outcome.max_rss, outcome.out + outcome.err
        lines = out.strip().splitlines()
        last = next((line for line in lines if "error:" in line or "must be" in line), lines[-1] if lines else "")
        ok = code in codes and "Traceback" not in out and seconds < timeout and rss < 2 * 2 ** 30
        failed += not ok
        message = (last if len(last) < 150 else last[:147] + "...").replace("|", "\\|")
        print(f"| `{label}` | {code} | {seconds:.1f} | {rss / 2 ** 20:.0f} | {message}{'' if ok else ' **FAIL**'} |",
              flush=True)
    return failed


def _defaults(more: list) -> tuple:
    """A case's optional env, allowed exit codes and preexec, defaulted."""
    env, codes, preexec = (list(more) + [None, None, None])[:3]
    return env, codes or (1, 2), preexec


def main(argv: list[str]) -> int:
    work = Path(tempfile.mkdtemp(prefix="parsat-hostile-"))
    only_round3 = argv[1:] == ["--round", "3"]
    only = [word for flag, word in zip(argv[1:], argv[2:]) if flag == "--only"]
    failed = 0
    if not only_round3:
        print("## Issue 20\n")
        failed += run_table(work, issue20_cases(work), only)
    print("\n## Issue 33: its inputs\n")
    failed += run_table(work, issue33_cases(work), only)
    print("\n## Issue 33: every bound, four values past it\n")
    failed += run_table(work, bound_cases(), only)
    if only:
        print(f"\n{failed} failed")
        return 1 if failed else 0
    print("\n## Issue 33: signals (seconds from the signal to the end; processes left in its group)\n")
    print("| command, signal | exit | s after the signal | left | message |")
    print("|---|---|---|---|---|")
    for label, args, signum, wait in signal_cases(work):
        ok, row = run_signal(work, label, args, signum, wait)
        failed += not ok
        print(row, flush=True)
    print(f"\n{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
