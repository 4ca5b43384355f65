"""dsv-jax: video diffusion transformers with dynamic sparse attention (DSV) and AdaptiveLoad batching."""

__version__ = "0.1.0"
