"""3D rotary position embedding on each token's true (t, h, w) coordinate.

The head dimension is split into three even parts rotated by the t, h and w coordinate (as in Wan:
h and w get 2 * (D // 6) each, t the rest). Rotation pairs are the two halves of each part.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def axis_dims(head_dim: int) -> tuple[int, int, int]:
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def axis_frequencies(head_dim: int, theta: float = 10000.0) -> list[np.ndarray]:
    """The rotation frequencies of the t, h and w parts of `head_dim` channels (axis_dims): dim / 2 each."""
    return [1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim) for dim in axis_dims(head_dim)]


def rope_angles(coords: np.ndarray, head_dim: int, theta: float = 10000.0) -> np.ndarray:
    """Angles [S, head_dim // 2] for positions `coords` [S, 3] (numpy, computed once per shape)."""
    parts = [
        coords[:, axis, None].astype(np.float64) * freqs[None, :]
        for axis, freqs in enumerate(axis_frequencies(head_dim, theta))
    ]
    return np.concatenate(parts, axis=1)


def rotary(coords: np.ndarray, head_dim: int, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [S, head_dim // 2] float32 of the angles of `coords` [S, 3], what `apply_rope` takes.

    Computed here, once per shape and on the host, so that no block evaluates cos / sin in any pass (the
    transformer applies RoPE to q and k of every block, in the forward and the remat's recomputed one)."""
    angles = rope_angles(coords, head_dim, theta)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _swap_pairs(x: jnp.ndarray) -> jnp.ndarray:
    """x [..., D] with the two halves of each axis part exchanged: channel i lands where its rotation partner
    was (an involution: applied twice it is the identity). Only slices and one concatenation."""
    out, start = [], 0
    for dim in axis_dims(x.shape[-1]):
        half = dim // 2
        out += [x[..., start + half : start + dim], x[..., start : start + half]]
        start += dim
    return jnp.concatenate(out, axis=-1)


def full_width_table(table: jnp.ndarray, sign: float) -> jnp.ndarray:
    """A [S, D // 2] table of pair values as [S, D] per channel: both channels of a pair take their pair's
    value, the first half of each part times `sign`."""
    out, start = [], 0
    for dim in axis_dims(2 * table.shape[-1]):
        part = table[..., start : start + dim // 2]
        out += [sign * part, part]
        start += dim // 2
    return jnp.concatenate(out, axis=-1)


def _rotate(x, cos, sin):
    """x * cos + swap(x) * signed sin per channel, in fp32: out_a = a c - b s, out_b = b c + a s for each pair."""
    c = full_width_table(jnp.asarray(cos, jnp.float32), 1.0)[None, :, None, :]
    s = full_width_table(jnp.asarray(sin, jnp.float32), -1.0)[None, :, None, :]
    return (x.astype(jnp.float32) * c + _swap_pairs(x).astype(jnp.float32) * s).astype(x.dtype)


# The backward of a rotation is the rotation by the opposite angle (same cos, sin negated): one elementwise
# pass like the forward. Left to autodiff, the slices and concatenation transpose into pads and sums of
# fp32 copies: on an H200 the backward of [1, 64k, 16, 128] bf16 took 1.01 ms that way, 0.33 ms this way
# (forward 0.81 -> 0.32 ms; experiments/bench_rope.py). cos / sin get no cotangent: they are host tables.
@jax.custom_vjp
def _rope(x, cos, sin):
    return _rotate(x, cos, sin)


def _rope_fwd(x, cos, sin):
    return _rotate(x, cos, sin), (cos, sin)


def _rope_bwd(res, g):
    cos, sin = res
    return _rotate(g, cos, -sin), None, None


_rope.defvjp(_rope_fwd, _rope_bwd)


def apply_rope(x: jnp.ndarray, rope) -> jnp.ndarray:
    """Rotate x [B, S, H, D] by rope = (cos, sin) [S, D // 2] (`rotary`); each axis part rotates its own halves."""
    cos, sin = rope
    return _rope(x, cos, sin)
