"""The latent codec: how frames become the latents the model trains on, and back.

The default pixel codec maps RGB in [0, 255] to [-1, 1]. A learned VAE plugs in here by providing
the same two functions.
"""

from __future__ import annotations

import numpy as np


def encode_frames(frames_uint8: np.ndarray) -> np.ndarray:
    """[..., T, H, W, 3] uint8 -> float32 latents in [-1, 1]."""
    return frames_uint8.astype(np.float32) / 127.5 - 1.0


def decode_latents(latents: np.ndarray) -> np.ndarray:
    """Latents [..., T, H, W, 3] -> uint8 frames."""
    return np.clip(np.round((np.asarray(latents, np.float32) + 1.0) * 127.5), 0, 255).astype(np.uint8)
