"""dsv-jax: video diffusion transformers with dynamic sparse attention (DSV) and AdaptiveLoad batching."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `dsv_jax.load_model` and `dsv_jax.generate` without importing jax, flax and orbax at `import dsv_jax`
    if name == "load_model":
        from dsv_jax.export import load_model

        return load_model
    if name == "generate":
        from dsv_jax.sample import generate

        return generate
    raise AttributeError(f"module 'dsv_jax' has no attribute {name!r}")


__all__ = ["generate", "load_model", "__version__"]
