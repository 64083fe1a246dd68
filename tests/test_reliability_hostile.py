"""The hostile review of issue 20, kept fixed: each class of input or fault it found ends cleanly.

Classes (benchmarks/RELIABILITY.md, section 7): inputs that are not files
(`/dev/zero`, a named pipe), files and rule text past their caps, outputs
that would destroy an input or be left half written, limits of 0 or NaN,
graphs past `--limit enodes` or `--limit seconds`, machine and plan files
whose values make no sense, names that carry DOT syntax or terminal
escapes, an import of a file that is not a rule file, and a 5,000-digit
number in a rule. (Ranks outliving their launcher: test_reliability_faults;
`fmt` and comments: test_dsl_comments.)

Where a hang or memory is the risk, the command runs in a fresh process
(`run_cli`): it must end before its timeout with exit 1 or 2, no Python
traceback, and at most 2 GiB resident (the kernel's own count, `wait4`,
of that process alone).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from parsat.cli import main
from parsat.dsl import files
from parsat.dsl.files import FileProblem, read_capped, refuse_overwriting, write_atomic

MEMORY_LIMIT = 2 * 2 ** 30


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str
    seconds: float
    max_rss: int      # bytes


# A small parent for the command: the kernel's peak-memory count of a child starts from its parent's size
# at fork (a pytest process with torch loaded is ~0.5 GB), so `parsat` is started from this one and its
# own peak is read with wait4 and written to the file named first.
_MEASURE = """
import os, signal, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
signal.signal(signal.SIGTERM, lambda *_: child.kill())
_, status, usage = os.wait4(child.pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_cli(args: list[str], timeout: float, cwd: Path | None = None, env: dict | None = None,
            preexec=None) -> Outcome:
    """`python -m parsat ARGS` in a fresh process, ended at `timeout`; its own peak memory from `wait4`."""
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        proc = subprocess.Popen([sys.executable, "-c", _MEASURE, rss.name, sys.executable, "-m", "parsat", *args],
                                cwd=cwd, env=env, stdin=subprocess.DEVNULL, preexec_fn=preexec,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        start = time.monotonic()
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            out, err = proc.communicate()
        seconds = time.monotonic() - start
        peak = int(rss.read() or 0)
    return Outcome(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"), seconds, peak)


def assert_clean_refusal(outcome: Outcome, timeout: float, pattern: str) -> None:
    import re

    text = outcome.out + outcome.err
    assert outcome.code in (1, 2), f"exit {outcome.code}: {text[-2000:]}"
    assert outcome.seconds < timeout, f"ran {outcome.seconds:.1f} s: killed at the timeout"
    assert "Traceback" not in text, text[-3000:]
    assert 0 < outcome.max_rss < MEMORY_LIMIT, f"{outcome.max_rss / 2 ** 30:.2f} GiB"
    assert re.search(pattern, text), text[-2000:]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    """A real plan: data parallelism of a small MLP on 2 devices, as `parsat optimize` would write it."""
    pytest.importorskip("torch")
    from parsat.backend.executor import operator_library
    from parsat.ir import models
    from parsat.ir.costs import totals
    from parsat.ir.data_parallel import data_parallel_pcg
    from parsat.ir.machine import Machine
    from parsat.ir.plan import Plan
    from parsat.search.baselines import price_pcg

    lib = operator_library()
    graph = models.mlp(batch=8, d_in=6, d_hidden=4, d_out=2, library=lib)
    pcg = data_parallel_pcg(graph, lib, 2)
    machine = Machine.preset("cpu").with_devices(2)
    costs = price_pcg(pcg, lib, machine)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    Plan(graph, machine, 2, pcg, costs, totals(costs, machine)).save(path)
    return path


@pytest.fixture
def fifo(tmp_path) -> callable:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no named pipes here")

    def make(name: str) -> Path:
        path = tmp_path / name
        os.mkfifo(path)
        return path

    return make


# ------------------------------------------------------------------ inputs that are not files


@pytest.mark.parametrize("args,pattern", [
    (["optimize", "/dev/zero", "-q"], r"/dev/zero: it is a character device, not a graph file"),
    (["explain", "/dev/zero"], r"it is a character device, not a plan file"),
    (["optimize", "mlp", "-n", "2", "--machine", "/dev/zero", "-q"], r"character device, not a machine file"),
    (["check", "/dev/zero"], r"not a \.rule file"),
], ids=["optimize", "explain", "machine", "check"])
def test_dev_zero_is_refused_not_read(args, pattern):
    """Before: the size check saw 0 bytes and read on, past 5 GB in 7 s."""
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    assert_clean_refusal(run_cli(args, timeout=60), 60, pattern)


@pytest.mark.parametrize("kind", ["graph", "plan", "run", "rule", "data"])
def test_a_named_pipe_is_refused_without_waiting_for_a_writer(fifo, plan_file, kind):
    """Before: opening a pipe no one writes to hung forever."""
    path = fifo("in.rule" if kind == "rule" else "in.json")
    args = {"graph": ["optimize", str(path), "-q"], "plan": ["explain", str(path)],
            "run": ["run", str(path), "--nproc", "2"], "rule": ["check", str(path)],
            "data": ["run", str(plan_file), "--nproc", "2", "--model", "model.py:make", "--data", str(path)]}[kind]
    assert_clean_refusal(run_cli(args, timeout=60), 60, r"it is a named pipe")


def test_the_reader_reads_no_further_than_the_cap_whatever_the_size_says(tmp_path, monkeypatch):
    """`/proc` files say 0 bytes; a file may grow after it is opened: the cap counts bytes read."""
    path = tmp_path / "g.json"
    path.write_bytes(b"x" * 5000)
    real_fstat = os.fstat

    def lying_fstat(fd):
        info = real_fstat(fd)
        return os.stat_result((info.st_mode, *info[1:6], 0, *info[7:]))   # st_size 0

    monkeypatch.setattr(os, "fstat", lying_fstat)
    with pytest.raises(files.FileTooLarge, match="larger than the limit of 1,000 bytes"):
        read_capped(path, 1000, "graph")
    assert read_capped(path, 5000, "graph") == b"x" * 5000


def test_a_folder_and_a_missing_file_are_named(tmp_path):
    with pytest.raises(FileProblem, match="it is a folder"):
        read_capped(tmp_path, 100, "plan")
    with pytest.raises(FileProblem, match="no such file"):
        read_capped(tmp_path / "nope.json", 100, "plan")


def test_a_verdict_cache_entry_that_is_not_one_is_ignored(tmp_path, fifo):
    """A cache folder is on disk like any input: a pipe, a huge file or garbage where an entry should be is a
    miss (the rule is proved again), never a hang, a crash or a verdict."""
    from parsat.verifier.cache import ENTRY_BYTES, VerdictCache

    cache = VerdictCache(tmp_path / "cache")
    for name, make in (("a" * 64, lambda p: os.mkfifo(p)),
                       ("b" * 64, lambda p: p.write_bytes(b" " * (ENTRY_BYTES + 1))),
                       ("c" * 64, lambda p: p.write_text('{"timeout": "x", "verdict": []}')),
                       ("d" * 64, lambda p: p.write_text("[" * 100000))):
        path = cache._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        make(path)
        start = time.monotonic()
        assert cache.get(name, 10.0) is None
        assert time.monotonic() - start < 5


# ------------------------------------------------------------------ rule files


def test_an_import_of_a_file_that_is_not_a_rule_file_does_not_show_its_content(tmp_path, capsys, monkeypatch):
    """Before: `import "/proc/self/environ"` printed that file's first line in the syntax error."""
    monkeypatch.setenv("PARSAT_SECRET_FOR_TEST", "hunter2-do-not-print")
    secret = tmp_path / "secret.txt"
    secret.write_text("password = hunter2-do-not-print\n")
    for target in ("/proc/self/environ", str(secret)):
        path = tmp_path / "leak.rule"
        path.write_text(f'import "{target}"\n')
        assert main(["check", str(path)]) == 1
        captured = capsys.readouterr()
        text = captured.out + captured.err
        assert "only .rule files can be imported" in text and "hunter2" not in text, text


def test_a_rule_file_named_on_the_command_line_must_be_a_rule_file(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("password = hunter2\n")
    assert main(["check", str(path)]) == 1
    text = "".join(capsys.readouterr())
    assert "not a .rule file" in text and "hunter2" not in text


def test_a_5000_digit_number_in_a_rule_is_a_positioned_error(tmp_path, capsys):
    path = tmp_path / "big.rule"
    path.write_text('import "ops.rule"\nrule big: forall x: [n] where n > ' + "9" * 5000 + " relu(x) => relu(x)\n")
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "big.rule:2:35: error: a number of 5,000 characters" in err and "Traceback" not in err
    assert max(len(line) for line in err.splitlines()) < 400   # the quoted line is a window, not 5,000 digits


def test_too_much_rule_text_is_refused_at_once(tmp_path):
    """Before: a 10 MB .rule file took ~5 minutes in `check`, silently. Now the library's rule text is capped
    (1 MiB, PARSAT_MAX_RULE_BYTES) and refused before it is parsed."""
    rule = "rule r{i}: forall x: [n] relu(relu(x)) => relu(x)\n"
    path = tmp_path / "big.rule"
    with open(path, "w") as handle:
        handle.write('import "ops.rule"\n')
        for i in range(10 * 2 ** 20 // len(rule)):
            handle.write(rule.format(i=i))
    outcome = run_cli(["check", str(path)], timeout=30)
    assert_clean_refusal(outcome, 30, r"too much rule text: the \.rule files of one library may hold 1,048,576 bytes")
    assert outcome.seconds < 10


def test_checking_a_large_library_reports_progress(tmp_path, monkeypatch, capsys):
    from parsat.dsl import cli as dsl_cli

    monkeypatch.setattr(dsl_cli._Progress, "EVERY_S", 0.0)
    path = tmp_path / "many.rule"
    path.write_text('import "ops.rule"\n' + "".join(f"rule r{i}: forall x: [n] relu(relu(x)) => relu(x)\n"
                                                    for i in range(30)))
    assert main(["check", str(path)]) == 0
    assert "checked 29 of 30 rules" in capsys.readouterr().err


# ------------------------------------------------------------------ outputs


def test_show_refuses_to_overwrite_its_input(plan_file, tmp_path, capsys):
    """Before: `parsat show plan.json -o plan.json` replaced the plan with graphviz output and exited 0."""
    copy = tmp_path / "plan.json"
    copy.write_bytes(plan_file.read_bytes())
    assert main(["show", str(copy), "-o", str(copy)]) == 1
    assert "is the input file" in capsys.readouterr().err
    assert copy.read_bytes() == plan_file.read_bytes()
    link = tmp_path / "same.json"
    link.symlink_to(copy)
    assert main(["show", str(copy), "-o", str(link)]) == 1 and copy.read_bytes() == plan_file.read_bytes()


def test_optimize_refuses_a_plan_written_over_its_graph(tmp_path, capsys):
    from parsat.ir.models import mlp

    graph = tmp_path / "g.json"
    mlp(batch=8, d_in=4, d_hidden=4, d_out=2).save(graph)
    before = graph.read_bytes()
    assert main(["optimize", str(graph), "-n", "2", "-q", "-o", str(graph)]) == 1
    assert "is the input file" in capsys.readouterr().err and graph.read_bytes() == before


def test_missing_and_read_only_folders_are_clear_errors(plan_file, tmp_path, capsys, monkeypatch):
    assert main(["show", str(plan_file), "-o", str(tmp_path / "missing" / "x.dot")]) == 1
    err = capsys.readouterr().err
    assert "the folder" in err and "missing does not exist" in err and "Traceback" not in err
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() != 0:   # root writes anywhere: the refusal is then simulated below
        assert main(["show", str(plan_file), "-o", str(folder / "x.dot")]) == 1
        assert "is not writable" in capsys.readouterr().err

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(files.tempfile, "mkstemp", refused)
    assert main(["show", str(plan_file), "-o", str(folder / "x.dot")]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {folder / 'x.dot'}: the folder {folder} is not writable" in err


@pytest.mark.parametrize("args", [["optimize", "mlp", "-n", "2"], ["generate", "--ops", "relu"]], ids=lambda a: a[0])
def test_a_long_command_refuses_an_unwritable_output_before_it_works(tmp_path, capsys, args):
    """`optimize` and `generate` can work for minutes: a missing folder is said before, not after."""
    start = time.monotonic()
    assert main([*args, "-o", str(tmp_path / "missing" / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "the folder" in err and "does not exist" in err and "rules" not in err, err
    assert time.monotonic() - start < 5
    assert main([*args, "-o", str(tmp_path), "--quiet"]) == 1
    assert "it is a folder, not a file" in capsys.readouterr().err


def test_a_failed_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """A full disk during the write: the old content stays, the temporary file goes, the error says so."""
    path = tmp_path / "plan.json"
    path.write_text("the old plan")
    path.chmod(0o640)

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(files.os, "write", full)
        with pytest.raises(FileProblem, match=r"No space left on device; .*plan.json is unchanged"):
            write_atomic(path, "x" * 100000)
    assert path.read_text() == "the old plan"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    write_atomic(path, "the new plan")
    assert path.read_text() == "the new plan" and stat.S_IMODE(path.stat().st_mode) == 0o640


def test_outputs_are_fsynced_and_cache_entries_are_not(tmp_path, monkeypatch):
    """A plan or a machine file is made durable (the file and its folder fsynced); a cache entry (`durable=False`:
    every reader validates it and recomputes) is only renamed into place, written whole all the same. The
    parse cache writes its entries so: a chain of 1,200 imported files spent 8 of its 10 s in fsync."""
    from parsat.dsl.parse_cache import parse_cached

    synced: list[int] = []
    fsync = files.os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: (synced.append(fd), fsync(fd)))
    write_atomic(tmp_path / "plan.json", "the plan")
    assert len(synced) == 2 and (tmp_path / "plan.json").read_text() == "the plan"
    synced.clear()
    write_atomic(tmp_path / "entry", b"an entry", durable=False)
    assert synced == [] and (tmp_path / "entry").read_bytes() == b"an entry"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry", "plan.json"]   # no temporary left
    parse_cached("op relu(x: [*s]) -> [*s]\n  out[*i] = max(x[*i], 0)\n", "r.rule", folder=tmp_path / "cache")
    assert synced == [] and len(list((tmp_path / "cache" / "parsed").iterdir())) == 1


def test_a_plan_written_on_a_full_disk_keeps_the_old_plan(tmp_path):
    """The real thing, in a fresh process with a file size limit (EFBIG where a full disk gives ENOSPC).
    Before: `optimize -o plan.json` left a truncated file where a valid plan had been."""
    import resource

    plan = tmp_path / "plan.json"
    old = '{"the": "old plan"}\n'
    plan.write_text(old)

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    env = {**os.environ, "PARSAT_CACHE_DIR": str(tmp_path / "cache")}
    outcome = run_cli(["optimize", "mlp", "-n", "2", "-q", "--no-baselines", "--allow-unverified", "-o", str(plan)],
                      120, env=env, preexec=small_files)
    assert_clean_refusal(outcome, 120, r"cannot write .*plan\.json: File too large; .*plan\.json is unchanged")
    assert plan.read_text() == old
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".plan.json")] == []


def test_outputs_to_devices_and_pipes_are_written_as_they_are(tmp_path, fifo):
    """`-o /dev/null`, `-o /dev/stdout` (a terminal or a pipe): nothing to replace, so written directly; a folder
    is refused."""
    write_atomic(os.devnull, "ignored")
    pipe = fifo("out.pipe")
    got: list[bytes] = []
    import threading

    reader = threading.Thread(target=lambda: got.append(pipe.read_bytes()))
    reader.start()
    write_atomic(pipe, "through the pipe")
    reader.join(timeout=10)
    assert got == [b"through the pipe"]
    with pytest.raises(FileProblem, match="it is a folder, not a file"):
        write_atomic(tmp_path, "x")


def test_refuse_overwriting_compares_files_not_names(tmp_path):
    a = tmp_path / "a.json"
    a.write_text("{}")
    refuse_overwriting(tmp_path / "b.json", [a, None, "h100x8"])   # a new file, a preset name: fine
    with pytest.raises(FileProblem):
        refuse_overwriting(tmp_path / "." / "a.json", [str(a)])


# ------------------------------------------------------------------ limits and sizes


@pytest.mark.parametrize("limit,pattern", [
    ("seconds=0", r"--limit seconds must be a positive number of seconds, at most 604,800, got 0"),
    ("seconds=nan", r"--limit seconds must be a positive number of seconds, at most 604,800, got nan"),
    ("seconds=inf", r"--limit seconds must be a positive number of seconds, at most 604,800, got inf"),
    ("seconds=-1", r"--limit seconds must be"),
    ("enodes=0", r"--limit enodes must be a whole number from 1 to 100,000,000, got 0"),
    ("iterations=0", r"--limit iterations must be a whole number from 1 to 10,000, got 0"),
    ("ilp_nodes=0", r"--limit ilp_nodes must be a whole number from 1 to 10,000,000, got 0$"),
    ("enodes=inf", r"--limit enodes: 'inf' is not a whole number"),
    ("ilp_seconds=nan", r"--limit ilp_seconds must be"),
])
def test_limits_that_stop_nothing_or_everything_are_refused(capsys, limit, pattern):
    """Before: `--limit seconds=0` answered "no rule can spread 'mlp' over 2 devices"."""
    import re

    assert main(["optimize", "mlp", "-n", "2", "-q", "--limit", limit]) == 1
    err = capsys.readouterr().err
    assert re.search(pattern, err) and "no rule can spread" not in err, err


def test_a_size_past_2_to_the_53_is_refused(capsys):
    """Before: `--set batch=99999999999999999999` ended in an egglog CompileError trace. Now refused by the size's
    bound (`dsl.bounds.size_bound`) before anything is built; a tensor past 2**53 elements still is by its own."""
    assert main(["optimize", "mlp", "-n", "2", "-q", "--set", "batch=99999999999999999999"]) == 1
    err = capsys.readouterr().err
    assert "size batch must be a whole number from 1 to 9,007,199,254,740,992" in err and "Traceback" not in err
    assert main(["optimize", "mlp", "-n", "2", "-q", "--set", "batch=9007199254740992"]) == 1
    assert "more than parsat handles (2**53)" in capsys.readouterr().err


def test_a_short_time_limit_names_itself_and_still_answers(capsys):
    """Before: a limit that stopped saturation before any rule spread the graph was an error. A limit is a
    safety valve: the plan comes back (here the graph unspread, the baselines being off) and says which limit
    cut it."""
    from parsat.api import optimize

    plan = optimize("mlp", devices=2, limits={"seconds": 0.02}, baselines=False, allow_unverified=True)
    said = plan.saturation.get("unspread", "") + plan.saturation.get("search_limit", "")
    assert "--limit seconds=0.02" in said, plan.saturation


def test_a_graph_larger_than_the_e_graph_may_hold_is_refused_before_it_is_built(tmp_path):
    """Before: a 749k-node graph ran 600 s and 2.4 GB. A graph's JSON is counted before any operator is
    instantiated; here 250,001 tensors against the default --limit enodes=200000."""
    n = 250_000
    nodes = [{"name": f"n{i}", "op": "relu", "inputs": [f"n{i - 1}" if i else "x"]} for i in range(n)]
    path = tmp_path / "chain.json"
    path.write_text(json.dumps({"name": "chain", "inputs": [{"name": "x", "shape": [8, 8]}], "nodes": nodes,
                                "outputs": [f"n{n - 1}"]}))
    outcome = run_cli(["optimize", str(path), "-n", "2", "-q"], timeout=60)
    assert_clean_refusal(outcome, 60, r"the graph has 250,001 tensors .* under --limit enodes=200000")
    assert outcome.seconds < 30


def test_a_graph_too_large_to_build_is_refused_naming_the_limit(capsys):
    from parsat.api import optimize
    from parsat.ir.errors import GraphError

    start = time.monotonic()
    with pytest.raises(GraphError, match=r"graph 'stack' has more than 3,000 tensors .* --limit enodes=3000"):
        optimize("stack", devices=2, sizes={"blocks": 10_000}, limits={"enodes": 3000}, baselines=False)
    assert time.monotonic() - start < 30


@pytest.mark.slow
@pytest.mark.parametrize("args,budget,pattern", [
    (["--set", "blocks=10000"], 60, r"more than 200,000 tensors .* --limit enodes=200000"),
    (["--set", "blocks=10000", "--limit", "enodes=10000000", "--limit", "seconds=10"], 40,
     r"more than 20,000 tensors .* more than --limit seconds=10 can build, search and price"),
], ids=["enodes", "seconds"])
def test_ten_thousand_blocks_end_within_the_limits(args, budget, pattern):
    """Before: `--set blocks=10000` ran past 120 s. Now refused by the e-graph's size, or by the tensors the
    time limit pays for (`ir.budget.TENSORS_PER_SECOND`), before the graph is built."""
    outcome = run_cli(["optimize", "stack", "-n", "2", "-q", *args], timeout=budget + 60)
    assert_clean_refusal(outcome, budget, pattern)


@pytest.mark.slow
def test_seconds_bounds_the_search_end_to_end():
    """A graph whose saturation alone would take minutes: the whole `optimize` ends near --limit seconds."""
    outcome = run_cli(["optimize", "stack", "--set", "blocks=2000", "-n", "2", "-q", "--limit", "enodes=10000000",
                       "--limit", "seconds=5"], timeout=120)
    assert_clean_refusal(outcome, 30, r"--limit seconds")


# ------------------------------------------------------------------ machines and plans


@pytest.mark.parametrize("field,value,pattern", [
    ("intra_latency", -1.0, r"intra_latency: -1.0 is outside the range parsat accepts, 0 to 3600 seconds"),
    ("inter_latency", -9e-6, r"inter_latency: -9e-06 is outside"),
    ("dtype_bytes", 0, r"dtype_bytes: 0 is outside the range"),
    ("dtype_bytes", -4, r"dtype_bytes: -4 is outside the range"),
    ("peak_flops", 5e-324, r"peak_flops: 5e-324 is outside the range parsat accepts, 1000 to 1e\+21"),
    ("intra_bandwidth", 1e300, r"intra_bandwidth: 1e\+300 is outside"),
    ("memory_capacity", 0, r"memory_capacity: 0 is outside"),
])
def test_a_machine_whose_numbers_make_no_sense_is_refused(tmp_path, capsys, field, value, pattern):
    """Before: a negative latency predicted a -9 s step (the search then maximised communication), and a peak of
    5e-324 FLOP/s wrote a plan full of Infinity that `explain` and `run` refused."""
    import re

    from parsat.ir.machine import Machine

    data = Machine.preset("h100x8").to_dict()
    data[field] = value
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(data))
    assert main(["optimize", "mlp", "-n", "2", "-q", "--machine", str(path)]) == 1
    err = capsys.readouterr().err
    assert re.search(pattern, err) and "Traceback" not in err, err


def _plan_with(plan_file: Path, tmp_path: Path, edit) -> Path:
    data = json.loads(plan_file.read_text())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def _first(data: dict, kind: str) -> dict:
    return next(n for n in data["nodes"] if n["kind"] == kind)


@pytest.mark.parametrize("name,edit,pattern", [
    ("unknown operator", lambda d: _first(d, "op").update(op="frobnicate"),
     r"\.op: unknown operator 'frobnicate' \(not in the operator library\)"),
    ("parallel operator as compute", lambda d: _first(d, "op").update(op="partition"),
     r"\.kind: partition is a parallel operator: its node's kind must be 'parallel', not 'op'"),
    ("extra attribute", lambda d: _first(d, "op")["attrs"].update(extra=1), r"matmul has no attribute\(s\) extra"),
    ("extra attribute of a parallel node", lambda d: _first(d, "parallel")["attrs"].update(extra=3),
     r"partition takes the attributes axis, degree, dim, got axis, degree, dim, extra"),
    ("wrong shape", lambda d: _first(d, "op").update(shape=[3, 3]), r"\.shape: is \[3, 3\], but matmul gives"),
    ("wrong rank", lambda d: _first(d, "op").update(shape=[8, 4, 1], spread={"shard": [1, 1, 1], "copy": 1}),
     r"\.shape: is \[8, 4, 1\], but matmul gives"),
    ("wrong arity", lambda d: _first(d, "op")["inputs"].pop(), r"matmul takes 2 tensor input\(s\), got 1"),
    ("dim outside the tensor", lambda d: _first(d, "parallel")["attrs"].update(dim=5), r"dim 5 is not a dim"),
    ("unknown leaf", lambda d: _first(d, "leaf").update(op="nobody"),
     r"a leaf must name an input or weight of the plan's graph, got 'nobody'"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_plan_whose_nodes_mean_nothing_is_refused_before_any_rank_starts(plan_file, tmp_path, capsys, name, edit,
                                                                            pattern):
    """Before: KeyError / InstantiationError traces, some only after the ranks had started."""
    import re

    path = _plan_with(plan_file, tmp_path, edit)
    start = time.monotonic()
    code = main(["run", str(path), "--nproc", "2", "--steps", "1", "--timeout", "60"])
    err = capsys.readouterr().err
    assert code == 1 and re.search(pattern, err) and "Traceback" not in err, err
    assert "does not follow the plan schema" in err and "rank" not in err.split("schema")[0]
    assert time.monotonic() - start < 10   # refused before any rank was spawned


# ------------------------------------------------------------------ names


def test_a_name_with_quotes_cannot_add_attributes_to_the_drawing(plan_file, tmp_path):
    """Before: a name holding `"` ended the DOT label, and the rest of it added attributes (an SVG link to
    `javascript:`)."""
    import shutil as sh

    hostile = 'x", URL="javascript:alert(1)", label="pwned'

    def rename(data):
        old = _first(data, "leaf")["op"]
        for node in data["nodes"]:
            if node["kind"] == "leaf" and node["op"] == old:
                node["op"] = hostile
        for item in data["graph"]["inputs"] + data["graph"]["weights"]:
            if item["name"] == old:
                item["name"] = hostile
        for node in data["graph"]["nodes"]:
            node["inputs"] = [hostile if i == old else i for i in node["inputs"]]

    path = _plan_with(plan_file, tmp_path, rename)
    out = tmp_path / "pcg.dot"
    assert main(["show", str(path), "-o", str(out)]) == 0
    dot = out.read_text()
    assert 'URL="javascript' not in dot and '\\"' in dot
    if sh.which("dot"):
        svg = tmp_path / "pcg.svg"
        assert main(["show", str(path), "-o", str(svg)]) == 0
        text = svg.read_text()
        assert "javascript" not in text.split("<title>")[0] and "xlink:href" not in text and "<a " not in text


def test_terminal_escapes_in_names_are_shown_not_obeyed(plan_file, tmp_path, capsys):
    """Before: ANSI escape codes in a name reached the terminal (`explain`, error messages)."""
    def rename(data):
        data["graph"]["name"] = "evil\x1b[2J\x1b]8;;http://x\x07name\u202e"
        data["machine"]["name"] = "m\x1b[31m"

    path = _plan_with(plan_file, tmp_path, rename)
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "\\x1b[31m" in out
    missing = tmp_path / "no\x1b[2Jsuch.json"
    assert main(["explain", str(missing)]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "no\\x1b[2Jsuch.json" in err


# ------------------------------------------------------------------ the verifier's flags


def test_verify_refuses_a_timeout_that_is_not_a_number(tmp_path, capsys, monkeypatch):
    """Before: `verify --timeout nan` was accepted and written into the cache."""
    monkeypatch.setenv("PARSAT_CACHE_DIR", str(tmp_path / "cache"))
    for value in ("nan", "inf", "0", "-1"):
        assert main(["verify", "--timeout", value]) == 2
        assert "--timeout must be a positive number of seconds" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()
