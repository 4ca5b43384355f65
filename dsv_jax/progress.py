"""What a long command shows while it works: a progress bar on a terminal, else log lines.

A bar is drawn only where someone watches it: stderr (where tqdm writes) is a terminal with a width.
Elsewhere (a batch job's log file, `--no-progress`, a 0-column terminal) a `Heartbeat` logs the current
status at least every N seconds, so a job log never goes silent for minutes.

tqdm's notebook bar needs ipywidgets; `tqdm.auto` warns (`TqdmWarning: IProgress not found`) at import in a
notebook without it, so the plain bar is taken there instead.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
import time
from typing import Callable

log = logging.getLogger("dsv_jax")


def tqdm_class():
    """tqdm's notebook-aware bar where ipywidgets can draw it, else the plain one (no import-time warning)."""
    if importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.auto import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm


def on_terminal(stream=None) -> bool:
    """Whether `stream` (default stderr) is a terminal with a width, where a bar redraws in place."""
    stream = stream or sys.stderr
    try:
        if not stream.isatty():
            return False
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, ValueError, OSError):  # a closed or replaced stream (a notebook's, pytest's)
        return False


def duration(seconds: float) -> str:
    """12 s, 3 min 05 s, 2 h 07 min."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Heartbeat:
    """Logs `status()` whenever `every` seconds passed without a line from it or from `say`. A background
    thread, so a step, a compile or a save that takes minutes is still reported while it runs."""

    def __init__(self, every: float, status: Callable[[], str | None], *, enabled: bool = True):
        if not every > 0:
            raise ValueError(f"the status interval must be > 0 seconds, got {every}")
        self.every, self.status, self.enabled = float(every), status, enabled
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if self.enabled:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="dsv-jax-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def say(self, message: str, *args) -> None:
        """Log a line now (it counts as one: the next status line is `every` seconds after it)."""
        log.info(message, *args)
        self._last = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(max(0.0, self._last + self.every - time.monotonic())):
            if time.monotonic() - self._last < self.every:  # a `say` came in between
                continue
            try:
                text = self.status()
            except Exception as e:  # a status that cannot be read must not end the run
                text = f"(status unavailable: {type(e).__name__})"
            if text:
                log.info(text)
            self._last = time.monotonic()
