"""Every file parsat reads or writes goes through here: bounded reads, atomic writes.

Inputs come from users (graph, plan and machine JSON, `.rule` files, the
verdict cache on disk), so a read must end, and end small, whatever the
path names: a multi-gigabyte file, `/dev/zero` or a `/proc` file (whose
size says 0), a named pipe no one writes to (opening it would wait
forever), a folder. `read_capped` reads at most the cap from the stream,
never trusting the size the file system reports, and refuses anything
that is not a regular file before it reads a byte.

Outputs (plans, drawings, machine files, formatted and generated rules,
cache entries) replace what was there only when the new content is
complete: `write_atomic` writes a temporary file in the same folder,
fsyncs it and renames it over the target, so a full disk, a kill or a
crash leaves the old file as it was, never a truncated one.
`refuse_overwriting` stops a command whose output is one of its own
inputs (`parsat show plan.json -o plan.json`) before it starts.

Every failure is a `FileProblem` whose message names the path and says
what is wrong, for the user; callers turn it into their own error.
This module is the lowest layer's (dsl), so every stage can use it.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterable

from parsat.dsl.errors import printable
from parsat.dsl.lifetime import temporary_file

# Largest JSON file parsat reads (graph, plan, machine); override with PARSAT_MAX_INPUT_BYTES. Parsing
# costs memory: 64 MiB of `[{},{},...]` took 1.7 GB; 32 MiB stays under 1 GB, and a 2,400-operator plan
# with its baselines is a few MB.
MAX_INPUT_BYTES = 32 * 2 ** 20
# Most `.rule` text one library loads, all files together; override with PARSAT_MAX_RULE_BYTES.
# The shipped library is ~110 KB, the largest generated file ~220 KB; checking costs ~25-40 s per MB.
MAX_RULE_BYTES = 2 ** 20
_CHUNK = 1 << 20


class FileProblem(Exception):
    """A file that cannot be read or written; the message is for the user."""


class FileTooLarge(FileProblem):
    """A file with more bytes than the cap it was read under."""


def byte_cap(variable: str, default: int) -> int:
    """A size cap from the environment variable `variable` (a positive integer), else `default`."""
    try:
        return max(1, int(os.environ.get(variable, default)))
    except ValueError:
        return default


def max_input_bytes() -> int:
    """The cap for one JSON input file (PARSAT_MAX_INPUT_BYTES)."""
    return byte_cap("PARSAT_MAX_INPUT_BYTES", MAX_INPUT_BYTES)


def max_rule_bytes() -> int:
    """The cap for the `.rule` text of one library (PARSAT_MAX_RULE_BYTES)."""
    return byte_cap("PARSAT_MAX_RULE_BYTES", MAX_RULE_BYTES)


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def read_capped(path: str | os.PathLike, limit: int, what: str, variable: str = "PARSAT_MAX_INPUT_BYTES") -> bytes:
    """The bytes of a regular file of at most `limit` bytes; FileProblem for anything else.

    The file is opened without blocking (a named pipe with no writer would
    otherwise wait forever), checked to be a regular file, and read in
    chunks up to `limit + 1` bytes: a file that grows, or that reports a
    size of 0 (`/proc`), is still read no further than the cap.
    """
    shown = printable(os.fspath(path))
    fd, info = _open_regular(path, what)
    try:
        if info.st_size > limit:
            raise FileTooLarge(f"{shown}: the {what} file is {info.st_size:,} bytes, over the limit of {limit:,} "
                              f"({variable})")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(_CHUNK, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise FileTooLarge(f"{shown}: the {what} file is larger than the limit of {limit:,} bytes ({variable})")
        return b"".join(chunks)
    except OSError as err:
        raise FileProblem(f"cannot read {shown}: {_reason(err)}") from None
    finally:
        os.close(fd)


def _open_regular(path: str | os.PathLike, what: str) -> tuple[int, os.stat_result]:
    """An open descriptor of a regular file (without blocking on a named pipe), or FileProblem."""
    shown = printable(os.fspath(path))
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        raise FileProblem(f"cannot read {shown}: {_reason(err)}") from None
    try:
        info = os.fstat(fd)
    except OSError as err:
        os.close(fd)
        raise FileProblem(f"cannot read {shown}: {_reason(err)}") from None
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise FileProblem(f"cannot read {shown}: it is {_kind(info.st_mode)}, not a {what} file "
                          "(parsat reads only regular files)")
    return fd, info


def check_regular_file(path: str | os.PathLike, what: str) -> None:
    """FileProblem unless `path` is a regular file that can be opened: for inputs another library reads
    (`torch.load` of `--data`, the import of `--model`), which would block on a pipe or read a device forever."""
    fd, _info = _open_regular(path, what)
    os.close(fd)


def read_text_capped(path: str | os.PathLike, limit: int, what: str,
                     variable: str = "PARSAT_MAX_INPUT_BYTES") -> str:
    """`read_capped`, decoded as UTF-8 (FileProblem naming the first byte that is not)."""
    raw = read_capped(path, limit, what, variable)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FileProblem(f"{printable(os.fspath(path))} is not a {what} "
                          f"file: byte {err.start} is not UTF-8 text") from None


def _reason(err: OSError) -> str:
    if err.errno == errno.ENOENT:
        return "no such file"
    if err.errno == errno.ENXIO:
        return "it is a socket or a device with nothing behind it, not a regular file"
    return err.strerror or str(err)


# --------------------------------------------------------------------- writing


def _new_file_mode() -> int:
    """The mode a plain `open(path, "w")` would give a new file: 0o666 less the umask."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_atomic(path: str | os.PathLike, data: str | bytes, durable: bool = True) -> None:
    """Replace `path` with `data` (text is written as UTF-8), all or nothing.

    A temporary file in the target's folder is written, fsynced and renamed
    over the target; on any failure it is removed and the target is as it
    was. `durable=False` skips the two fsyncs (file and folder): for cache
    entries, which every reader validates (a key, a checksum) and recomputes
    when a crash left one short; another process never sees a partial file
    either way (the rename is atomic). A chain of 1,200 imported files
    parsed cold spent 8 of its 10 s in fsync. A symbolic link is followed (its target is replaced, not the link).
    An existing character device or pipe (`/dev/null`, a terminal,
    `-o /dev/stdout`) is written directly: there is nothing to replace. The new file keeps the old one's
    permissions, or gets the usual ones for a new file.
    """
    shown = printable(os.fspath(path))
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    try:
        info = os.stat(path)   # through symbolic links: /dev/stdout is the terminal or pipe behind it
    except FileNotFoundError:
        info = None
    except OSError as err:
        raise FileProblem(f"cannot write {shown}: {_reason(err)}") from None
    if info is not None and not stat.S_ISREG(info.st_mode):
        if stat.S_ISCHR(info.st_mode) or stat.S_ISFIFO(info.st_mode):
            _write_stream(path, payload, shown)
            return
        raise FileProblem(f"cannot write {shown}: it is {_kind(info.st_mode)}, not a file")
    target = Path(os.path.realpath(path))
    folder = target.parent
    if not folder.is_dir():
        missing = Path(shown).parent
        raise FileProblem(f"cannot write {shown}: the folder {missing} does not exist")
    mode = stat.S_IMODE(info.st_mode) if info is not None else _new_file_mode()
    unchanged = f"; {shown} is unchanged" if info is not None else ""
    try:
        fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise FileProblem(f"cannot write {shown}: the folder {Path(shown).parent} is not writable "
                              f"({err.strerror})") from None
        raise FileProblem(f"cannot write {shown}: {_reason(err)}{unchanged}") from None
    try:
        with temporary_file(temporary):   # removed on any failure, Ctrl-C or SIGTERM (`lifetime`)
            try:
                view = memoryview(payload)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                os.fchmod(fd, mode)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, target)
    except OSError as err:
        raise FileProblem(f"cannot write {shown}: {_reason(err)}{unchanged}") from None
    if durable:
        _sync_folder(folder)


def _write_stream(target: str | os.PathLike, payload: bytes, shown: str) -> None:
    """A terminal, `/dev/null` or a pipe (`-o /dev/stdout`): written as it is, there is no file to replace."""
    try:
        with open(target, "wb") as handle:
            handle.write(payload)
    except OSError as err:
        raise FileProblem(f"cannot write {shown}: {_reason(err)}") from None


def _sync_folder(folder: Path) -> None:
    """Make the rename durable (best effort: some file systems cannot fsync a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_output(path: str | os.PathLike) -> None:
    """FileProblem now for an output that `write_atomic` could not write later: a missing or read-only
    folder, a folder in the file's place. Commands that work for minutes (`optimize`, `generate`,
    `calibrate`) ask first, so the work is not lost at the end."""
    shown = printable(os.fspath(path))
    if os.path.isdir(path):
        raise FileProblem(f"cannot write {shown}: it is a folder, not a file")
    folder = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(folder):
        raise FileProblem(f"cannot write {shown}: the folder {os.path.dirname(shown) or '.'} does not exist")
    if not os.path.exists(path) and not os.access(folder, os.W_OK | os.X_OK):
        raise FileProblem(f"cannot write {shown}: the folder {os.path.dirname(shown) or '.'} is not writable")


def refuse_overwriting(output: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], flag: str = "-o") -> None:
    """FileProblem when `output` is the same file as one of `inputs` (writing it would destroy that input)."""
    for source in inputs:
        if source is None:
            continue
        try:
            same = os.path.samefile(output, source)
        except (OSError, ValueError):
            same = False
        if same:
            raise FileProblem(f"{flag} {printable(os.fspath(output))} is the input file "
                              f"{printable(os.fspath(source))}: writing it would replace that input; choose another "
                              "output file")


def cache_dir() -> Path:
    """Where parsat remembers work it can trust again: `$PARSAT_CACHE_DIR`, else `~/.cache/parsat` (the
    verifier's verdicts, the libraries that checked clean)."""
    env = os.environ.get("PARSAT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "parsat"
