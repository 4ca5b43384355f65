"""The one attention entry point: `attention(q, k, v, *, backend=..., ...)`.

q [B, Sq, H, D], k and v [B, Skv, H, D] -> [B, Sq, H, D]. Backends register themselves by name
where they are defined, and call sites pass a name (or "auto"): the dense ones ("xla", "cudnn")
register here, the sparse ones ("dsv", "window") in `dsv_jax.dsv.backend`, which the DSV package and
the model import. `kv_lens` (int32 [B]) masks keys at positions >= kv_lens[b]: the valid keys are a
prefix, which is what padding to whole tiles and text padding produce, and what cuDNN and the sparse
kernels support without a dense mask.
`return_lse=True` also returns each query's log-sum-exp; `merge_attention` combines two partial
results over disjoint key sets exactly.
"""

from __future__ import annotations

from dsv_jax.attention import dense as _dense  # noqa: F401  (registers "xla" and "cudnn")
from dsv_jax.attention.merge import merge_attention
from dsv_jax.attention.registry import (
    attention,
    available_backends,
    register_backend,
    resolve_backend,
    unregister_backend,
)

__all__ = [
    "attention",
    "available_backends",
    "merge_attention",
    "register_backend",
    "resolve_backend",
    "unregister_backend",
]
