"""Failures as the user sees them: one or two lines naming the cause and the thing (file, key, value,
free space); the full traceback only with --debug, or in `error.log` of the work directory a command owns
(a training run's), or, for a failure that looks like a bug in a command without one, in a temporary file
that the message names. Nothing is written into a folder the command was only pointed at."""

from __future__ import annotations

import errno
import os
import shutil
import sys
import tempfile
import time
import traceback

LOG_NAME = "error.log"


class DiskFull(OSError):
    """No space left for a write; the message says where, how much is needed and how much is free."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


def disk_full_cause(e: BaseException | None) -> BaseException | None:
    """The exception in `e`'s chain that reports ENOSPC: an OSError from Python, or a tensorstore
    (orbax) error that carries the OS code in its text; None when the disk is not full."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return e
        text = str(e)
        if "No space left on device" in text or "os_error_code='28'" in text:
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def is_disk_full(e: BaseException | None) -> bool:
    return disk_full_cause(e) is not None


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def free_space(path: str) -> str:
    """Free space of the file system holding `path` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return mib(shutil.disk_usage(path).free)
    except OSError:
        return "unknown space"


def explain(e: BaseException, workdir: str | None = None) -> tuple[str, int, bool]:
    """(message of at most two lines, exit status, expected). Expected failures are the user's input or
    environment (a bad value, a missing file, a full disk, a diverged run); the rest are our bugs."""
    if isinstance(e, DiskFull):
        return str(e), 1, True
    if is_disk_full(e):
        where = getattr(disk_full_cause(e), "filename", None) or workdir or os.getcwd()
        return f"disk full writing {where} ({free_space(where)} free)", 1, True
    if isinstance(e, OSError) and e.filename and e.strerror:
        return f"{e.strerror}: {e.filename}", 2, True
    ours = type(e).__module__.startswith("dsv_jax")
    if ours or isinstance(e, (ValueError, OSError)):
        code = 1 if isinstance(e, RuntimeError) else 2
        return _short(str(e) or type(e).__name__), code, True
    return _short(f"{type(e).__name__}: {e}"), 1, False


def _short(text: str, lines: int = 2, width: int = 400) -> str:
    kept = [line[:width] for line in text.strip().splitlines()[:lines]]
    return "\n".join(kept)


def _write_traceback(f, command: str, e: BaseException) -> None:
    f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} dsv-jax {command} ({' '.join(sys.argv[1:])})\n")
    f.write("".join(traceback.format_exception(e)))


def write_log(workdir: str | None, command: str, e: BaseException) -> str | None:
    """Append the traceback to <workdir>/error.log when the work directory exists; its path or None.
    `workdir` must be a directory the command owns (a training run's work directory)."""
    if not workdir or not os.path.isdir(workdir):
        return None
    path = os.path.join(workdir, LOG_NAME)
    try:
        with open(path, "a", encoding="utf-8") as f:
            _write_traceback(f, command, e)
        return path
    except OSError:  # a full disk, or a read-only folder: the message on screen still stands
        return None


def write_temp_log(command: str, e: BaseException) -> str | None:
    """The traceback in a new temporary file (dsv-jax-COMMAND-*.log); its path, or None where none can be made."""
    try:
        fd, path = tempfile.mkstemp(prefix=f"dsv-jax-{command}-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            _write_traceback(f, command, e)
        return path
    except OSError:
        return None


def report(command: str, e: BaseException, *, workdir: str | None = None, debug: bool = False) -> int:
    """Print the failure for a user (stderr) and return the exit status. `workdir`: a directory the command
    owns (its error.log takes every failure's traceback); without one, only a failure that looks like a bug
    leaves its traceback, in a temporary file."""
    message, code, expected = explain(e, workdir)
    if debug:
        traceback.print_exception(e, file=sys.stderr)
    log = write_log(workdir, command, e)
    if log is None and not expected and not debug:
        log = write_temp_log(command, e)
    lines = message.splitlines()
    if not expected and not debug:
        lines = lines[:1] + [f"  (a bug? the traceback is in {log})" if log else "  (--debug shows the traceback)"]
    print(f"dsv-jax {command}: error: " + "\n".join(lines), file=sys.stderr)
    return code
