"""Time `parsat verify` on the shipped library, cold cache then warm cache.

Usage (from the repository root):

    .venv/bin/python benchmarks/verify_library.py [--jobs 2] [--cores 2] [PATH ...]

Runs the real CLI in a subprocess with a fresh `PARSAT_CACHE_DIR`, pinned to
`--cores` CPUs (Linux `taskset`) when available, and prints a Markdown
block with the command, the machine and the figures, for
`benchmarks/RESULTS-verify.md`. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import resource
import platform
import shutil
import subprocess
import sys
import tempfile
import time


def run(command: list[str], env: dict) -> tuple[float, float, str, int]:
    """(wall seconds, CPU seconds of the process tree, last line, exit code)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    return wall, cpu, last, done.returncode


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="*", default=["rules/"])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    parsat = os.path.join(os.path.dirname(sys.executable), "parsat")
    command = [parsat, "verify", *args.paths, "--jobs", str(args.jobs)]
    if shutil.which("taskset") and args.cores:
        command = ["taskset", "-c", ",".join(str(c) for c in range(args.cores))] + command
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, PARSAT_CACHE_DIR=cache)
        cold, cold_cpu, cold_summary, cold_code = run(command, env)
        warm, warm_cpu, warm_summary, warm_code = run(command, env)
    print("```")
    print("$ " + " ".join(command))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs visible, pinned to {args.cores}; "
          f"Python {platform.python_version()}; load average {load:.1f} at the start")
    print(f"cold cache: {cold:6.2f} s wall, {cold_cpu:6.2f} s CPU   {cold_summary}   (exit {cold_code})")
    print(f"warm cache: {warm:6.2f} s wall, {warm_cpu:6.2f} s CPU   {warm_summary}   (exit {warm_code})")
    print("```")
    return 0 if cold_code == 0 and warm_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
