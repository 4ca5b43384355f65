"""3D rotary position embedding on each token's true (t, h, w) coordinate.

The head dimension is split into three even parts rotated by the t, h and w coordinate (as in Wan:
h and w get 2 * (D // 6) each, t the rest). Rotation pairs are the two halves of each part.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def axis_dims(head_dim: int) -> tuple[int, int, int]:
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def rope_angles(coords: np.ndarray, head_dim: int, theta: float = 10000.0) -> np.ndarray:
    """Angles [S, head_dim // 2] for positions `coords` [S, 3] (numpy, computed once per shape)."""
    parts = []
    for axis, dim in enumerate(axis_dims(head_dim)):
        freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        parts.append(coords[:, axis, None].astype(np.float64) * freqs[None, :])
    return np.concatenate(parts, axis=1)


def rotary(coords: np.ndarray, head_dim: int, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [S, head_dim // 2] float32 of the angles of `coords` [S, 3], what `apply_rope` takes.

    Computed here, once per shape and on the host, so that no block evaluates cos / sin in any pass (the
    transformer applies RoPE to q and k of every block, in the forward and the remat's recomputed one).
    On an H200 the profile gives RoPE ~5% of a 2.7B step, 8x its memory-bound time; host tables did not
    change the step measurably (experiments/results/RESULTS.md), so what makes it slow is still open."""
    angles = rope_angles(coords, head_dim, theta)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: jnp.ndarray, rope) -> jnp.ndarray:
    """Rotate x [B, S, H, D] by rope = (cos, sin) [S, D // 2] (`rotary`); each axis part rotates its own halves."""
    d = x.shape[-1]
    cos, sin = (jnp.asarray(t, jnp.float32)[None, :, None, :] for t in rope)
    xf = x.astype(jnp.float32)
    out, start_x, start_a = [], 0, 0
    for dim in axis_dims(d):
        part = xf[..., start_x:start_x + dim]
        c, s = cos[..., start_a:start_a + dim // 2], sin[..., start_a:start_a + dim // 2]
        a, b = part[..., : dim // 2], part[..., dim // 2:]
        out += [a * c - b * s, a * s + b * c]
        start_x += dim
        start_a += dim // 2
    return jnp.concatenate(out, axis=-1).astype(x.dtype)
