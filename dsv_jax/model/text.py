"""The built-in text encoder: learned token and position embeddings, normalised.

Used when no precomputed text embeddings come with the data (text.encoder=builtin); it is trained
with the DiT. Output width is model.text_dim, the width VideoDiT expects of any text embeddings.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dsv_jax.config import ModelConfig, TextConfig
from dsv_jax.data.text import vocab_size


class TextEncoder(nnx.Module):
    def __init__(self, model_cfg: ModelConfig, text_cfg: TextConfig, *, rngs: nnx.Rngs):
        dim = model_cfg.text_dim
        self.tokens = nnx.Embed(vocab_size(text_cfg.hash_buckets), dim, rngs=rngs)
        self.positions = nnx.Param(0.02 * nnx.initializers.normal()(rngs.params(), (text_cfg.max_len, dim)))
        self.norm = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, ids):
        return self.norm(self.tokens(ids) + self.positions[None, : ids.shape[1]].astype(jnp.float32))
