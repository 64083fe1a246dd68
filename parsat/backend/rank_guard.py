"""A spawned rank's first code: tie its life to its launcher's before anything heavy is imported.

A rank spends its first seconds importing torch (longer on a loaded
machine). A launcher killed then (SIGKILL, an OOM kill, a parent's
`subprocess.run(..., timeout=...)`) must not leave the rank to finish its
import and train on, adopted by PID 1. So the spawned process starts here,
in a module that imports no torch: the rank asks the kernel for SIGKILL
when its parent dies (`prctl(PR_SET_PDEATHSIG)`, Linux), checks that its
parent is still the launcher (it may have died before the request), and
starts a watchdog thread that ends the rank when its parent changes (every
platform, and any gap in the above). Only then is the job unpickled, which
imports torch and the rank's function (`launch.rank_main`, by name).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import threading
import time

WATCHDOG_S = 0.5     # how often a rank checks that its launcher is alive
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with(launcher: int) -> None:
    """End this process when `launcher`, its parent, ends."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still ends the rank
    if os.getppid() != launcher:  # the launcher died before the signal was asked for
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(WATCHDOG_S)
            if os.getppid() != launcher:
                os._exit(1)

    threading.Thread(target=watch, name="parsat-launcher-watchdog", daemon=True).start()


def start(launcher: int, job: bytes, messages) -> None:
    """The target of a spawned rank: guard, then unpickle `job`, (function, arguments), and call
    `function(*arguments, messages)` (the launcher's `rank_main`, named in the pickle, not imported here)."""
    die_with(launcher)
    function, arguments = pickle.loads(job)
    function(*arguments, messages)
