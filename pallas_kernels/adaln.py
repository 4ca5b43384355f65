"""AdaLN: LayerNorm (no affine) + modulation, optionally after a gated residual add.

    adaln_modulate(x, scale, shift)        = LN(x) * (1 + scale[:, None]) + shift[:, None]
    gated_residual_adaln(r, b, g, sc, sh)  = (h, adaln_modulate(h, sc, sh)),  h = r + g[:, None] * b

Statistics and arithmetic in fp32, outputs in x.dtype (h in residual.dtype).
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


def _check_impl(impl):
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"impl={impl!r} is not one of 'auto', 'pallas', 'xla'")
    if impl == "pallas":
        raise NotImplementedError("the Pallas AdaLN kernel is not built yet; use impl='xla'")


def adaln_modulate(x, scale, shift, *, eps=1e-6, impl="auto"):
    _check_impl(impl)
    return adaln_modulate_reference(x, scale, shift, eps=eps)


def gated_residual_adaln(residual, branch, gate, scale, shift, *, eps=1e-6, impl="auto"):
    _check_impl(impl)
    return gated_residual_adaln_reference(residual, branch, gate, scale, shift, eps=eps)
