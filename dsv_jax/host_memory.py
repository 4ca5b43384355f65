"""Keep freed host memory in the process when jax runs on the CPU.

XLA:CPU allocates each execution's temporary buffer (318 MB for the tiny MMDiT train step) with
malloc from one of its worker threads. glibc serves a request that large from a non-main arena
with a fresh mmap (a non-main arena's heap holds at most 64 MB) and returns it with munmap when
the step ends, so the next step faults every page in again: on the 2-core machine 72k page
faults a step, a third of the CPU time in the kernel. With one arena, no mmap and a high trim
threshold the buffer stays mapped between steps: system time 15.4 s -> 1.3 s over the first 100
tiny-MMDiT steps, wall 30.6 s -> 24.7 s (experiments/results/RESULTS.md, "The CPU step's
page faults").

The arena limit only stops new arenas from being made: threads that already have one keep it, and
later threads are handed the existing ones in turn. So the call must come before any other thread
starts (the CLI makes it first thing); a process that already runs threads (a notebook kernel)
gets the same settings only from the environment at its start:
GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647.
Accelerator hosts are left alone (their big buffers live on the device, and one arena would
serialise data-loading threads), as is any process that sets DSV_JAX_HOST_MALLOC=system.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

# the free top of the heap that glibc keeps before returning memory (mallopt takes an int)
TRIM_THRESHOLD = 2**31 - 1

TUNABLES = f"glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold={TRIM_THRESHOLD}"

ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")


def accelerator_plugin_installed() -> bool:
    """Whether a PJRT plugin other than the CPU's is installed (the known packages, or any registered under
    jax's `jax_plugins` entry points)."""
    if any(importlib.util.find_spec(name) is not None for name in ACCELERATOR_PLUGINS):
        return True
    return bool(list(importlib.metadata.entry_points(group="jax_plugins")))


def runs_on_cpu() -> bool:
    """Whether jax will use the CPU: JAX_PLATFORMS lists it first, or (unset) no accelerator plugin is installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not accelerator_plugin_installed()


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory mapped (one arena, no mmap, 2 GiB trim threshold) when jax runs on the
    CPU. Returns whether the settings were applied. Call it before any other thread starts (see the module)."""
    if os.environ.get("DSV_JAX_HOST_MALLOC", "").lower() == "system" or not sys.platform.startswith("linux"):
        return False
    if not runs_on_cpu():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    if threading.active_count() > 1 or "jaxlib" in sys.modules:
        log.warning(
            "keep_freed_memory: threads are already running, so XLA's buffers may still be mapped "
            "afresh every step; start the process with GLIBC_TUNABLES=%s instead",
            TUNABLES,
        )
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    applied = all(mallopt(param, value) == 1 for param, value in settings)
    log.debug(
        "host malloc: one arena, no mmap, trim threshold %d (%s)", TRIM_THRESHOLD, "applied" if applied else "refused"
    )
    return applied
