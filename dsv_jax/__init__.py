"""dsv-jax: video diffusion transformers with dynamic sparse attention (DSV) and AdaptiveLoad batching."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `dsv_jax.load_model` without importing jax, flax and orbax at `import dsv_jax`
    if name == "load_model":
        from dsv_jax.export import load_model

        return load_model
    raise AttributeError(f"module 'dsv_jax' has no attribute {name!r}")


__all__ = ["load_model", "__version__"]
