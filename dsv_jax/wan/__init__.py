"""Wan 2.1 in dsv-jax: its weights in and out, and its forward with diffusers' conventions.

The architecture itself is our one model family with Wan's options (the `wan2.1-t2v-1.3b` and
`wan2.1-t2v-14b` presets, dsv_jax/config.py); docs/guide/wan.md walks from a diffusers Wan folder to a DSV
fine-tune. Modules: layout (where each Wan tensor lives in our parameters), files (checkpoint folders,
checked before reading), convert (import-weights, export to diffusers), forward (`diffusers_forward`).
"""

from __future__ import annotations

_EXPORTS = {
    "diffusers_forward": "dsv_jax.wan.forward",
    "import_weights": "dsv_jax.wan.convert",
    "export_diffusers": "dsv_jax.wan.convert",
    "WanCheckpointError": "dsv_jax.wan.files",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dsv_jax.wan' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
