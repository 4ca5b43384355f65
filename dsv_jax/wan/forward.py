"""Our Wan model called with diffusers' conventions, for side-by-side checks against
`WanTransformer3DModel`:

    model = dsv_jax.load_model("models/wan-1.3b")          # an import (dsv-jax import-weights)
    sample = dsv_jax.wan.diffusers_forward(model, hidden_states, timestep, encoder_hidden_states)

hidden_states [B, 16, T, H, W] (channels first), timestep [B] in 0..1000, encoder_hidden_states [B, L, text_dim]
(every position attended, as Wan does); returns diffusers' `sample` [B, 16, T, H, W], the flow-matching
velocity. Ours takes channels-last latents; the timesteps reach its time embedding as they are (time_scale 1),
not as t = timestep / 1000 rounded to float32, whose ulp moves a random tiny model's output by 2e-5 of its
largest value.
"""

from __future__ import annotations

import numpy as np


def _numpy(x) -> np.ndarray:
    """An array of any framework (numpy, jax, a CPU torch tensor in any dtype) as float32 numpy."""
    if hasattr(x, "detach"):  # torch, without importing it: bf16 has no numpy dtype, so go through float32
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, np.float32)


def diffusers_forward(model, hidden_states, timestep, encoder_hidden_states):
    """diffusers' WanTransformer3DModel forward on our model (a LoadedModel, e.g. `dsv_jax.load_model(OUT)` of
    an import): `sample` [B, C, T, H, W] (a jax array) of hidden_states [B, C, T, H, W], timestep [B] in
    0..1000 and encoder_hidden_states [B, L, text_dim]."""
    import jax.numpy as jnp

    x = _numpy(hidden_states)
    text = _numpy(encoder_hidden_states)
    if x.ndim != 5:
        raise ValueError(f"hidden_states must be [B, C, T, H, W], got shape {x.shape}")
    if text.ndim != 3 or text.shape[0] != x.shape[0]:
        raise ValueError(f"encoder_hidden_states must be [B={x.shape[0]}, L, D], got shape {text.shape}")
    t = _numpy(timestep).reshape(-1)
    if t.size not in (1, x.shape[0]):
        raise ValueError(f"timestep must be one value or [B={x.shape[0]}] values, got {t.size}")
    mask = jnp.ones(text.shape[:2], bool)
    latents = jnp.asarray(x.transpose(0, 2, 3, 4, 1))
    velocity = model(latents, jnp.asarray(t), jnp.asarray(text), mask, time_scale=1.0)
    return jnp.transpose(velocity, (0, 4, 1, 2, 3))
