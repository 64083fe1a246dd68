"""How a command ends when it is told to: SIGINT, SIGTERM or SIGHUP ends it and all it started within a second.

A command may be proving rules in worker processes, training on spawned
ranks, waiting for graphviz's `dot`, or deep inside egglog or z3, and it
may be half way through writing a file. Told to stop, it must stop at once,
leave no process behind and no partial file, and keep the verdict cache
consistent. (SIGTERM to `verify --jobs 2` used to wait for its workers'
proofs: the workers never saw the signal, and the pool's shutdown waited.)

The CLI runs every command inside `handling_signals()`:

* Python's handler (the main thread) first kills the command's children:
  multiprocessing's (the verifier's and the generator's workers, the
  backend's ranks) and the subprocesses registered with `track_process`
  (`dot`). It then raises KeyboardInterrupt for SIGINT (Ctrl-C, which the
  optimizer answers with the plan found so far: docs/MESH.md) or
  `Terminated` for SIGTERM and SIGHUP (a supervisor or a closed terminal:
  no plan is wanted). Unwinding removes temporary files (`temporary_file`,
  used by `files.write_atomic`); the CLI exits 130, 143 or 129.
* Python runs that handler only between bytecodes, and egglog, z3 or numpy
  can hold the main thread for seconds. The C-level handler also writes to
  a pipe (`signal.set_wakeup_fd`) that a watchdog thread waits on: when the
  command has not ended `GRACE_S` after the signal (or `valve_s` after a
  first Ctrl-C, for a command that answers it: `valve`), the watchdog
  kills the children, removes the temporary files still registered, says
  so and ends the process (`os._exit`). A second signal ends it at once.

Worker pools are made with `process_pool`, which a signal leaves without
waiting for the workers (the handler has killed them).

Cache entries and outputs are written whole or not at all
(`files.write_atomic`: a temporary file renamed over the target), so an
ended command leaves the old file or the new one. A forked child (a pool
worker) drops all of this: it ignores Ctrl-C (its parent ends it) and
never removes its parent's files.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Iterator

GRACE_S = 0.8          # from a signal to the process's end, when unwinding is stuck in native code
SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


class Terminated(BaseException):
    """SIGTERM or SIGHUP: the command is asked to end (no partial result is wanted, unlike Ctrl-C)."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


def exit_status(signum: int) -> int:
    """The shell's status for a command ended by `signum`: 128 + the signal's number (130 for Ctrl-C)."""
    return 128 + int(signum)


class _State:
    """What this process must clean up when it is ended, and the watchdog's view of the current command."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.files: set[str] = set()
        self.processes: set = set()
        self.active = False
        self.valve_s = 0.0
        self.wakeup: tuple[int, int] | None = None


_STATE = _State()


@contextmanager
def temporary_file(path: str) -> Iterator[None]:
    """`path` is removed if the block fails or the process is ended before the block is done."""
    with _STATE.lock:
        _STATE.files.add(path)
    try:
        yield
    except BaseException:
        _remove(path)
        raise
    finally:
        with _STATE.lock:
            _STATE.files.discard(path)


def track_process(process) -> None:
    """`process` (a `subprocess.Popen`) is killed when the command is ended; `untrack_process` when it is done."""
    with _STATE.lock:
        _STATE.processes.add(process)


def untrack_process(process) -> None:
    with _STATE.lock:
        _STATE.processes.discard(process)


@contextmanager
def valve(seconds: float) -> Iterator[None]:
    """Within the block, a first Ctrl-C leaves the command `seconds` to end with what it has (the optimizer's
    plan so far) before the watchdog ends it; SIGTERM, SIGHUP and a second Ctrl-C still end it within a second."""
    before, _STATE.valve_s = _STATE.valve_s, seconds
    try:
        yield
    finally:
        _STATE.valve_s = before


@contextmanager
def process_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """A `ProcessPoolExecutor` that a command told to end leaves at once.

    `with ProcessPoolExecutor()` waits for its workers on the way out, and a
    signal that lands while the pool is still starting (its workers forked,
    its manager thread not yet) turns that wait into "RuntimeError: cannot
    join thread before it is started", which replaced the user's Ctrl-C. On
    KeyboardInterrupt or `Terminated` the workers are killed, the pool is shut
    down without waiting, and the signal's exception goes on; on any other
    way out the pool is shut down as `with` would.

    The workers are forked: garbage the parent holds (an egglog e-graph of an
    earlier search) is collected first, in the parent, because a forked child
    that frees one waits forever on egglog's thread pool, whose threads were
    not forked (`_in_forked_child` freezes what a child inherits)."""
    gc.collect()
    pool = ProcessPoolExecutor(max_workers=workers)
    try:
        yield pool
    except (KeyboardInterrupt, Terminated):
        end_children()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def end_children() -> None:
    """Kill every child this command started (multiprocessing's, and the tracked subprocesses) and reap them."""
    children = multiprocessing.active_children()
    with _STATE.lock:
        tracked = list(_STATE.processes)
    for child in children + tracked:
        try:
            child.kill()
        except (OSError, ValueError, AttributeError):
            pass
    for child in children:
        child.join(timeout=GRACE_S)
    for child in tracked:
        try:
            child.wait(timeout=GRACE_S)
        except Exception:  # noqa: BLE001 - a child that cannot be reaped must not stop the ending
            pass


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _quiet_unraisable(previous):
    """`sys.unraisablehook` while a command runs: the signal's own exception (`_on_signal`'s KeyboardInterrupt or
    `Terminated`), raised where Python cannot pass it on (a hook `os.fork` runs in the parent, such as logging's
    `_releaseLock` when a pool forks a worker, or a finalizer), is not printed as "Exception ignored ...
    Traceback": the watchdog, woken by the same signal, ends the command within `GRACE_S` saying so, with the
    signal's status. Any other exception goes to `previous` as before. (`verify --jobs 2` told to end while
    forking printed a traceback before its "interrupted" line.)"""
    def hook(unraisable) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, (KeyboardInterrupt, Terminated)):
            return
        previous(unraisable)
    return hook


def _on_signal(signum: int, _frame) -> None:
    """Python's handler: the children first (they may not have seen the signal), then unwind."""
    end_children()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def _watch(read_fd: int, done: threading.Event) -> None:
    """The watchdog: wakes on a signal's byte; ends the process if the command is still running after the
    grace (`valve_s` for a first Ctrl-C), or at once on a second signal."""
    first: tuple[int, float] | None = None
    while not done.is_set():
        wait = None if first is None else max(0.0, first[1] - time.monotonic())
        ready, _, _ = select.select([read_fd], [], [], wait)
        if done.is_set():
            return
        if not ready:
            _end_now(first[0])
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in (b for b in data if b in SIGNALS):
            if first is not None:
                _end_now(signum)
            grace = _STATE.valve_s if signum == signal.SIGINT and _STATE.valve_s else GRACE_S
            first = (signum, time.monotonic() + grace)


def _end_now(signum: int) -> None:
    """The watchdog's last resort: children killed, temporary files removed, one line said, the process ended."""
    end_children()
    with _STATE.lock:
        files = list(_STATE.files)
    for path in files:
        _remove(path)
    word = "interrupted" if signum == signal.SIGINT else "terminated"
    try:
        os.write(2, f"parsat: {word} ({signal.Signals(signum).name}); ended at once\n".encode())
    except OSError:
        pass
    os._exit(exit_status(signum))


@contextmanager
def handling_signals() -> Iterator[None]:
    """Run a command under this module's handlers (only from the main thread: elsewhere, as it is)."""
    if threading.current_thread() is not threading.main_thread() or _STATE.active:
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    done = threading.Event()
    watchdog = threading.Thread(target=_watch, args=(read_fd, done), name="parsat-signal-watchdog", daemon=True)
    _STATE.active, _STATE.wakeup = True, (read_fd, write_fd)
    unraisable = sys.unraisablehook
    sys.unraisablehook = _quiet_unraisable(unraisable)
    for s in SIGNALS:
        signal.signal(s, _on_signal)
    watchdog.start()
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.unraisablehook = unraisable
        signal.set_wakeup_fd(old_fd)
        done.set()
        os.close(write_fd)   # the watchdog's select wakes (end of file) and it returns
        watchdog.join(timeout=1.0)
        os.close(read_fd)
        _STATE.active, _STATE.wakeup = False, None


def exit_process(status: int) -> None:
    """End the process with `status`; a command ended by a signal ends within `GRACE_S` even if Python's own
    shutdown hangs.

    Python 3.11's `ProcessPoolExecutor` joins its manager thread at exit, and
    that thread joins the call queue's feeder thread, which can be stuck for
    ever writing tasks into a pipe whose readers (the workers) were killed
    (CPython gh-94777, fixed in 3.12). `verify --jobs 2` told to end printed
    "parsat: interrupted" and then hung at exit under load. Only a process
    ended by a signal gets the timer: it has nothing left to do but exit."""
    if status > 128:
        def _end() -> None:
            time.sleep(GRACE_S)
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(status)

        threading.Thread(target=_end, name="parsat-exit-guard", daemon=True).start()
    sys.exit(status)


def _in_forked_child() -> None:
    """A forked worker (multiprocessing's pool) is its parent's to end: it ignores Ctrl-C, which the terminal
    sends the whole group (its parent kills it), uses the default SIGTERM and SIGHUP, wakes no watchdog, and
    never removes its parent's temporary files. Nor does it collect what it inherited: freeing a parent's
    egglog e-graph waits on a thread pool that exists only in the parent (`process_pool`)."""
    gc.freeze()
    if _STATE.wakeup is not None:
        signal.set_wakeup_fd(-1)
        for fd in _STATE.wakeup:
            try:
                os.close(fd)
            except OSError:
                pass
    if _STATE.active:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for s in SIGNALS[1:]:
            signal.signal(s, signal.SIG_DFL)
    _STATE.__init__()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_forked_child)
