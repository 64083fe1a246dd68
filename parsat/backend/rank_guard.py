"""A started rank's first code: tie its life to its launcher's before anything heavy runs.

A rank spends its first seconds importing its job's modules (torch too,
where ranks are spawned rather than forked from the fork server that
imported it: `launch._start_method`), longer on a loaded machine. A
launcher killed then (SIGKILL, an OOM kill, a parent's
`subprocess.run(..., timeout=...)`) must not leave the rank to finish its
import and train on. So the rank starts here, in a module that imports no
torch: it starts a watchdog thread that waits on its launcher's sentinel
(multiprocessing's pipe to the process that started it: end of file the
moment the launcher dies, whatever its parent process is: the launcher for
spawned ranks, the fork server for forked ones) and ends the rank then,
after checking the launcher is alive now (it may have died before); on
Linux it also asks the kernel for SIGKILL when its parent dies
(`prctl(PR_SET_PDEATHSIG)`: the launcher, or the fork server, which ends
once the launcher and every rank have). Only then is the job unpickled,
which imports the rank's function (`launch.rank_main`, by name), in the
launcher's environment as the job started (a fork server's is that of the
launcher's first job).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with(launcher: int) -> None:
    """End this process when `launcher`, the process that started it, ends."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still ends the rank
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid != launcher or not parent.is_alive():
        os._exit(1)   # not started by `launch`, or the launcher died before the watchdog could wait for it

    def watch() -> None:
        parent.join()   # returns when the launcher's end of the sentinel pipe closes: it died or ended
        os._exit(1)

    threading.Thread(target=watch, name="parsat-launcher-watchdog", daemon=True).start()


def start(launcher: int, environ: dict[str, str], job: bytes, messages) -> None:
    """The target of a started rank: guard, take the launcher's environment `environ`, then unpickle `job`,
    (function, arguments), and call `function(*arguments, messages)` (the launcher's `rank_main`, named in the
    pickle, not imported here)."""
    die_with(launcher)
    if os.environ != environ:   # a fork server's ranks inherit its environment, the launcher's of its first job
        os.environ.clear()
        os.environ.update(environ)
    function, arguments = pickle.loads(job)
    function(*arguments, messages)
