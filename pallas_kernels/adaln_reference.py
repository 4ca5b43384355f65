"""AdaLN, the definition: LayerNorm (no affine) + modulation, optionally after a gated residual add.

    adaln_modulate(x, scale, shift)        = LN(x) * (1 + scale[:, None]) + shift[:, None]
    gated_residual_adaln(r, b, g, sc, sh)  = (h, adaln_modulate(h, sc, sh)),  h = r + g[:, None] * b

x, r, b: [B, N, C]; scale, shift, gate: [B, C]. Statistics and arithmetic in fp32, outputs in x.dtype
(h in residual.dtype). This module holds the plain-JAX references the kernels are tested against and the
input checks every path runs (pallas_kernels.adaln picks the path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def adaln_modulate_reference(x, scale, shift, *, eps=1e-6):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    y = y * (1.0 + scale.astype(jnp.float32)[:, None]) + shift.astype(jnp.float32)[:, None]
    return y.astype(x.dtype)


def gated_residual_adaln_reference(residual, branch, gate, scale, shift, *, eps=1e-6):
    h = residual.astype(jnp.float32) + gate.astype(jnp.float32)[:, None] * branch.astype(jnp.float32)
    h = h.astype(residual.dtype)
    return h, adaln_modulate_reference(h, scale, shift, eps=eps)


def _shape_error(fn, what, want, got):
    return ValueError(f"{fn}: {what} must have shape {want}, got {tuple(got)}")


def check_adaln_inputs(x, scale, shift, fn="adaln_modulate", x_name="x"):
    if x.ndim != 3:
        raise ValueError(f"{fn}: {x_name} must be [B, N, C], got shape {tuple(x.shape)}")
    b, n, c = x.shape
    if n < 1 or c < 1:
        raise ValueError(f"{fn}: {x_name} has an empty axis, shape {tuple(x.shape)}")
    for name, v in (("scale", scale), ("shift", shift)):
        if tuple(v.shape) != (b, c):
            raise _shape_error(fn, f"{name} ([B, C] for {x_name} {tuple(x.shape)})", (b, c), v.shape)
    for name, v in ((x_name, x), ("scale", scale), ("shift", shift)):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise ValueError(f"{fn}: {name} must be floating point, got {v.dtype}")


def check_gated_inputs(residual, branch, gate, scale, shift):
    fn = "gated_residual_adaln"
    check_adaln_inputs(residual, scale, shift, fn, "residual")
    if branch.shape != residual.shape:
        raise ValueError(
            f"{fn}: branch must have the shape of residual {tuple(residual.shape)}, got {tuple(branch.shape)}"
        )
    b, _, c = residual.shape
    if tuple(gate.shape) != (b, c):
        raise _shape_error(fn, f"gate ([B, C] for residual {tuple(residual.shape)})", (b, c), gate.shape)
    for name, v in (("branch", branch), ("gate", gate)):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise ValueError(f"{fn}: {name} must be floating point, got {v.dtype}")
