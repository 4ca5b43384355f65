"""TextToVideo: the trained unit, VideoDiT plus the built-in text encoder when the data has none."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dsv_jax.config import Config
from dsv_jax.data.text import START
from dsv_jax.model.dit import VideoDiT
from dsv_jax.model.text import TextEncoder


class TextToVideo(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.dit = VideoDiT(
            cfg.model, rngs=rngs, predictor_rank=cfg.predictor_rank, predictor_rope=cfg.dsv.predictor_rope
        )
        self.text_encoder = TextEncoder(cfg.model, cfg.text, rngs=rngs) if cfg.text.encoder == "builtin" else None

    def encode_text(self, batch, drop=None):
        """(embeddings [B, L, Dt], mask [B, L]) of a batch; rows where `drop` is set get the empty caption."""
        mask = batch["text_mask"]
        if drop is not None:
            mask = jnp.where(drop[:, None], jnp.arange(mask.shape[1])[None] == 0, mask)
        if self.text_encoder is not None:
            ids = batch["text_ids"]
            if drop is not None:
                empty = jnp.where(jnp.arange(ids.shape[1]) == 0, START, 0).astype(ids.dtype)
                ids = jnp.where(drop[:, None], empty[None], ids)
            return self.text_encoder(ids), mask
        emb = batch["text_emb"]
        if drop is not None:
            emb = jnp.where(drop[:, None, None], jnp.zeros_like(emb), emb)
        return emb, mask

    def __call__(
        self,
        latents,
        timesteps,
        text,
        text_mask,
        *,
        attention="auto",
        attention_inputs=None,
        return_aux=False,
        time_scale=1000.0,
    ):
        return self.dit(
            latents,
            timesteps,
            text,
            text_mask,
            attention=attention,
            attention_inputs=attention_inputs,
            return_aux=return_aux,
            time_scale=time_scale,
        )
