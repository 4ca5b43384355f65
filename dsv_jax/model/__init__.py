"""Flax NNX video diffusion transformers."""

from dsv_jax.model.dit import DiTBlock, MMDiTBlock, VideoDiT
from dsv_jax.model.text import TextEncoder

__all__ = ["VideoDiT", "DiTBlock", "MMDiTBlock", "TextEncoder"]
