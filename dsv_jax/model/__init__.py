"""Flax NNX video diffusion transformers."""

# The modules are imported on first use, so that `dsv_jax.model.size` (the parameter count of a config)
# is read without jax.
_EXPORTS = {
    "VideoDiT": "dsv_jax.model.dit",
    "DiTBlock": "dsv_jax.model.dit",
    "MMDiTBlock": "dsv_jax.model.dit",
    "TextEncoder": "dsv_jax.model.text",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dsv_jax.model' has no attribute {name!r}")


__all__ = ["VideoDiT", "DiTBlock", "MMDiTBlock", "TextEncoder"]
