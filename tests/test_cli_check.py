"""`parsat check`, `--version`, `--help`: exit codes and what a user reads."""

from __future__ import annotations

import subprocess
import sys

from parsat import __version__
from parsat.cli import main


def test_check_shipped_library_passes_and_prints_counts(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "operators" in out and "rules" in out and "0 errors" in out


def test_check_reports_error_with_position_and_fails(write_rules, capsys):
    path = write_rules('import "ops.rule"\nrule r:\n  forall x: [m]\n  rellu(x) => x\n')
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}:4:3: error: rule r: unknown operator 'rellu'" in err
    assert "  rellu(x) => x" in err and "^" in err
    assert "Traceback" not in err


def test_check_missing_path_is_a_message_not_a_trace(capsys):
    assert main(["check", "/no/such/dir"]) == 1
    err = capsys.readouterr().err
    assert "/no/such/dir: no such file or folder" in err and "Traceback" not in err


def test_check_non_utf8_file(tmp_path, capsys):
    path = tmp_path / "bin.rule"
    path.write_bytes(b"rule \xff\xfe")
    assert main(["check", str(path)]) == 1
    assert "not UTF-8 text" in capsys.readouterr().err


def test_version_and_help_list_subcommands():
    version = subprocess.run([sys.executable, "-m", "parsat", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.strip() == f"parsat {__version__}"
    helptext = subprocess.run([sys.executable, "-m", "parsat", "--help"], capture_output=True, text=True).stdout
    from parsat.cli import SUBCOMMANDS

    for command in SUBCOMMANDS:
        assert command in helptext


def test_fmt_prints_canonical_source(write_rules, capsys):
    path = write_rules("op   f(x:[n])->[n] out[i]=x[i]\n")
    assert main(["fmt", str(path)]) == 0
    assert capsys.readouterr().out == "op f(x: [n]) -> [n]\n  out[i] = x[i]\n"
