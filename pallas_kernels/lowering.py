"""Which Pallas GPU lowerings this jax has, and one logged line per fallback.

jax's Pallas Triton lowering is deprecated (jax 0.11) and will be removed. Every kernel that uses it
asks `triton_missing()` first and, where it is gone, runs its plain-JAX reference (for "auto") or
stops with the reason (an explicit impl="pallas"), so the day it disappears nothing breaks.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("dsv_jax")


@functools.lru_cache(maxsize=None)
def triton_missing() -> str | None:
    """None if `jax.experimental.pallas.triton` imports, else why."""
    try:
        import jax.experimental.pallas.triton  # noqa: F401
    except ImportError as e:
        return f"jax {_jax_version()} has no Pallas Triton lowering ({e})"
    return None


@functools.lru_cache(maxsize=None)
def log_fallback(kernel: str, path: str, reason: str) -> None:
    """Say once per (kernel, path, reason) why a kernel runs on a slower path."""
    log.info("%s: %s (%s)", kernel, path, reason)


def _jax_version() -> str:
    import jax

    return jax.__version__
