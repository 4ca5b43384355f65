"""Count XLA compilations through jax's monitoring events (a check that nothing compiles after warm-up).

    with CompileCounter() as compiles:
        ...                       # run steps
    assert compiles.count == 0

Counts backend compiles and persistent-cache loads: either means a program was built during the block.
"""

from __future__ import annotations

import threading

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    def __init__(self):
        self.compiles = 0
        self.cache_loads = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self.compiles + self.cache_loads

    def _on_duration(self, event: str, duration_secs: float, **kwargs) -> None:
        if event == BACKEND_COMPILE:
            with self._lock:
                self.compiles += 1

    def _on_event(self, event: str, **kwargs) -> None:
        if event == CACHE_HIT:
            with self._lock:
                self.cache_loads += 1

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)
